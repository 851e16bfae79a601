"""The report end to end on a real MLflow store (SQLite in tmp_path) written as peftune.record.writer writes it.

The sweep holds completed, early-stopped, failed (with and without a finished epoch) and interrupted
trials: every one must come back as one row, marked, and only completed ones may shape a frontier.
"""

from __future__ import annotations

import math

import mlflow
import pandas as pd
import pytest

from analysis import runs
from analysis.report import load_reference
from sweep_record import TrialSpec, counts, record_sweep

TASKS = ["sst", "para", "sts"]
LORA = {"alpha": 16.0, "targets": ["query", "key", "value"]}


def epochs(*scores: float) -> list[dict]:
    """Per-epoch task metrics whose mean is each given score (sst below, para above, sts at it)."""
    return [{"sst_accuracy": s - 0.1, "para_accuracy": s + 0.1, "sts_pearson": s} for s in scores]


TRIALS = [
    TrialSpec("t0", "frozen", {}, epochs(0.30, 0.35), counts(0)),
    TrialSpec("t1", "lora", {"rank": 4, **LORA}, epochs(0.50, 0.62), counts(2_000), lr=2e-3),
    TrialSpec("t2", "lora", {"rank": 8, **LORA}, epochs(0.58, 0.60), counts(4_000), lr=8e-4),  # dominated by t1
    TrialSpec("t3", "adapter", {"bottleneck": 16}, epochs(0.55, 0.66), counts(9_000, 27_000), lr=1e-3),
    TrialSpec("t4", "lora_adapter", {"rank": 8, "bottleneck": 32, **LORA}, epochs(0.60, 0.70), counts(20_000)),
    # stopped by ASHA after one epoch: its score would put it on the frontier, it must not be
    TrialSpec("t5", "adapter", {"bottleneck": 64}, epochs(0.90), counts(30_000, 90_000), status="early_stopped"),
    TrialSpec(
        "t6",
        "prefix",
        {"prefix_length": 10},
        [],
        counts(1_000),
        status="failed",
        error="TrainingDiverged: loss is nan at epoch 1\n\nTraceback (most recent call last): ...",
    ),
    TrialSpec("t7", "prompt", {"prompt_length": 20}, epochs(0.95), counts(500), status="failed", error="OOM"),
    # interrupted: no peftune.status, MLflow KILLED, one epoch logged, no best_* metrics yet
    TrialSpec("t8", "top_k", {"k": 1}, epochs(0.40), counts(100_000), status=None, mlflow_status="KILLED"),
]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    _, parent_id, run_ids = record_sweep(
        uri, "unit_sweep", TASKS, TRIALS, artifact_dir=root / "artifacts", budget={"max_train_examples": 64}
    )
    return uri, parent_id, run_ids


def test_runs_become_one_row_per_trial_with_status(store):
    uri, parent_id, run_ids = store
    sweep = runs.read_sweep_record("unit_sweep", uri)
    assert sweep.parent_run_id == parent_id
    assert sweep.backbone == "all-minilm-l6-v2" and sweep.tasks == TASKS
    assert sweep.task_metrics == ["sst_accuracy", "para_accuracy", "sts_pearson"]
    assert sweep.parent_params["max_train_examples"] == 64 and sweep.parent_params["max_dev_examples"] is None

    trials = sweep.trials.set_index("trial_id")
    assert len(trials) == len(TRIALS) and set(trials["run_id"]) == set(run_ids.values())
    assert trials["status"].to_dict() == {
        "t0": "completed",
        "t1": "completed",
        "t2": "completed",
        "t3": "completed",
        "t4": "completed",
        "t5": "early_stopped",
        "t6": "failed",
        "t7": "failed",
        "t8": "interrupted",
    }
    assert sweep.status_summary() == "9 trials: 5 completed, 1 early_stopped, 2 failed, 1 interrupted"

    # best epoch metrics, epochs run, method sizes and typed hyperparameters
    t1 = trials.loc["t1"]
    assert t1["score"] == pytest.approx(0.62) and t1["best_epoch"] == 2 and t1["epochs_run"] == 2
    assert t1["sst_accuracy"] == pytest.approx(0.52) and t1["sts_pearson"] == pytest.approx(0.62)
    assert t1["label"] == "lora r=4" and t1["size_value"] == 4.0
    assert t1["lr"] == pytest.approx(2e-3) and t1["epochs"] == 2 and t1["method.rank"] == 4
    assert t1["method.targets"] == "query,key,value" and t1["method.alpha"] == 16.0
    assert t1["trainable_params_per_task"] == 2_000 and t1["trainable_params_per_task_pct"] == pytest.approx(0.2)
    assert t1["train_time_s"] == pytest.approx(3.0)  # cumulative: the last epoch's value is the total
    assert trials.loc["t4", "label"] == "lora_adapter r=8 m=32"
    assert trials.loc["t3", "label"] == "adapter m=16" and trials.loc["t3", "stored_params"] == 27_000
    assert trials.loc["t0", "label"] == "frozen" and trials.loc["t0", "size"] == ""
    assert trials.loc["t5", "epochs_run"] == 1

    # failed without an epoch: no score; failed after one: its best-epoch figures are kept
    assert math.isnan(trials.loc["t6", "score"]) and trials.loc["t6", "epochs_run"] == 0
    assert trials.loc["t6", "error"] == "TrainingDiverged: loss is nan at epoch 1"
    assert trials.loc["t7", "score"] == pytest.approx(0.95) and trials.loc["t7", "error"] == "OOM"
    # interrupted: the best epoch so far, read from the history
    assert trials.loc["t8", "score"] == pytest.approx(0.40) and trials.loc["t8", "best_epoch"] == 1
    assert trials.loc["t8", "para_accuracy"] == pytest.approx(0.50)


def test_report_end_to_end(store, tmp_path):
    from peftune.cli.commands import main

    uri, parent_id, _ = store
    output = tmp_path / "report"
    assert main(["report", "--sweep", "unit_sweep", "--tracking-uri", uri, "--output", str(output)]) == 0

    expected = {
        "report.md",
        "report.html",
        "trials.csv",
        "best_by_method_size.csv",
        "best_by_method_size.md",
        "frontier.csv",
        "frontier_summary.csv",
        "importance.csv",
        "score_vs_params.png",
        "score_vs_params_sst.png",
        "score_vs_params_para.png",
        "score_vs_params_sts.png",
        "parallel_coordinates.png",
        "importance.png",
        "slots.csv",
    }
    assert expected <= {p.name for p in output.iterdir()}
    for name in expected:
        assert (output / name).stat().st_size > 0, name
    assert (output / "score_vs_params.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # every trial, marked; only completed ones on the frontier
    table = pd.read_csv(output / "trials.csv")
    assert len(table) == len(TRIALS)
    on_frontier = set(table.loc[table["frontier.score"], "trial_id"])
    assert on_frontier == {"t0", "t1", "t3", "t4"}
    assert not table.loc[table["status"] != "completed", "frontier.score"].any()

    # the AdaptBert-shaped table: best per method and size, completed trials only
    best = pd.read_csv(output / "best_by_method_size.csv", keep_default_na=False)
    assert list(best.columns[:8]) == [
        "Method",
        "Size",
        "SST",
        "Quora",
        "STS",
        "Average",
        "Params updated per task %",
        "Additional params stored %",
    ]
    assert list(zip(best["Method"], best["Size"], strict=True)) == [
        ("frozen", ""),
        ("lora", "r=4"),
        ("lora", "r=8"),
        ("adapter", "m=16"),
        ("lora_adapter", "r=8 m=32"),
    ]
    adapter = best[best["Size"] == "m=16"].iloc[0]
    assert adapter["Average"] == pytest.approx(0.66) and adapter["Additional params stored %"] == pytest.approx(2.7)
    markdown = (output / "best_by_method_size.md").read_text()
    assert "| lora | r=4 | 0.520 | 0.720 | 0.620 | 0.620 | 0.20 | 0.20 |" in markdown

    # hypervolume of all methods on the score, by hand: frontier (cost fraction, score)
    # (0, 0.35), (0.002, 0.62), (0.009, 0.66), (0.02, 0.70); reference (1, 0)
    summary = pd.read_csv(output / "frontier_summary.csv")
    everything = summary[(summary["scope"] == "all") & (summary["objective"] == "score")].iloc[0]
    u = [0.0, *((math.log10(c) + 5) / 5 for c in (0.002, 0.009, 0.02)), 1.0]  # the log-cost axis, floor 1e-5
    expected_hv = sum((u[i + 1] - u[i]) * s for i, s in enumerate((0.35, 0.62, 0.66, 0.70)))
    assert everything["hypervolume"] == pytest.approx(expected_hv) and everything["frontier_size"] == 4

    report_md = (output / "report.md").read_text()
    assert "## Trials not completed" in report_md and "TrainingDiverged" in report_md
    assert "interrupted" in report_md and "early_stopped" in report_md
    assert "## Where the time went" in report_md and pd.read_csv(output / "slots.csv")["runs"].iloc[0] > 0

    # logged to the parent run under report/
    client = mlflow.MlflowClient(tracking_uri=uri)
    logged = {item.path for item in client.list_artifacts(parent_id, "report")}
    assert {f"report/{name}" for name in expected} <= logged
    assert {item.path for item in client.list_artifacts(parent_id)} >= {"report", "sweep.yaml", "data_hashes.json"}
    # and the frontier's summary is on the parent run, for the runs table (issue 8)
    metrics = client.get_run(parent_id).data.metrics
    assert metrics["sweep_frontier_size"] == 4 and metrics["sweep_hypervolume"] == pytest.approx(expected_hv)


def test_a_run_still_written_is_read_again_and_a_closed_one_stays(tmp_path):
    """The record is read after every confirmation round: a run the writer has not closed shows its new
    epochs each time (its histories are never kept from an earlier read); a closed one reads the same."""
    from mlflow.entities import Metric

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    trials = [
        TrialSpec("done", "frozen", {}, epochs(0.30, 0.35), counts(0)),
        TrialSpec("open", "top_k", {"k": 1}, epochs(0.40), counts(100_000), status=None, mlflow_status="RUNNING"),
    ]
    _, _, run_ids = record_sweep(uri, "growing", TASKS, trials, artifact_dir=tmp_path / "artifacts")
    first = runs.read_sweep_record("growing", uri).trials.set_index("trial_id")
    assert first.loc["open", "epochs_run"] == 1 and first.loc["done", "epochs_run"] == 2

    client, now = mlflow.MlflowClient(tracking_uri=uri), 0
    values = {"sst_accuracy": 0.4, "para_accuracy": 0.6, "sts_pearson": 0.5, "score": 0.5}
    client.log_batch(run_ids["open"], metrics=[Metric(k, v, now, 2) for k, v in values.items()])
    again = runs.read_sweep_record("growing", uri).trials.set_index("trial_id")
    assert again.loc["open", "epochs_run"] == 2 and again.loc["open", "score"] == pytest.approx(0.5)
    assert again.loc["done"].equals(first.loc["done"])


def test_unknown_sweep_names_the_store_and_its_sweeps(store, capsys):
    from peftune.cli.commands import main

    uri, _, _ = store
    assert main(["report", "--sweep", "nope", "--tracking-uri", uri]) == 2
    error = capsys.readouterr().err
    assert "no MLflow experiment named 'nope'" in error and "unit_sweep" in error


def test_the_sweep_hook_never_fails_a_finished_sweep(store, tmp_path, caplog):
    """``on_sweep_finished`` runs at the end of a job: a failing report is logged with the retry command."""
    from types import SimpleNamespace

    from analysis.publish import on_sweep_finished

    uri, parent_id, _ = store
    result = SimpleNamespace(name="missing", tracking_uri=uri, report_dir=tmp_path / "r", parent_run_id=parent_id)
    assert on_sweep_finished(result) is None
    assert "peftune report --sweep missing" in caplog.text


def test_reference_table_is_adaptbert_table_3():
    reference = load_reference()
    assert len(reference) == 20
    lora = reference[(reference["method"] == "lora") & (reference["size"] == "r=8")].iloc[0]
    assert lora["trainable_params_per_task_pct"] == pytest.approx(0.40) and lora["score"] == pytest.approx(0.676)
    assert {"sst_accuracy", "para_accuracy", "sts_pearson", "stored_params_pct"} <= set(reference.columns)


def test_reading_a_sweep_never_imports_ray():
    """The writer and the reader share peftune.base.record_names; the reader must stay free of Ray."""
    import subprocess
    import sys

    code = "import sys, analysis.runs, analysis.publish; print('ray' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )


@pytest.mark.parametrize("trials", [TRIALS[6:9], []], ids=["failed and interrupted", "no trial"])
def test_a_sweep_without_a_completed_trial_is_refused_in_one_line_and_nothing_is_written(tmp_path, capsys, trials):
    """Issue 34: such a sweep was a KeyError: 'method' (exit 1) after 14 files were written."""
    from peftune.cli.commands import main

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    record_sweep(uri, "nothing_yet", TASKS, trials, artifact_dir=tmp_path / "artifacts")
    output = tmp_path / "reports" / "nothing_yet"
    capsys.readouterr()
    assert main(["report", "--sweep", "nothing_yet", "--tracking-uri", uri, "--output", str(output)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sweep 'nothing_yet' has no completed trial yet" in err[0], err
    assert f"({len(trials)} trials" in err[0] and "nothing to report" in err[0]
    assert not (tmp_path / "reports").exists()


def test_a_report_that_fails_midway_leaves_its_folder_as_it_was(store, tmp_path, monkeypatch):
    """The files are written beside the folder and moved in once all are written: a failure leaves no half report."""
    from analysis import publish

    uri, _, _ = store
    sweep = runs.read_sweep_record("unit_sweep", uri)

    def fails(*args):
        raise RuntimeError("the last file failed")

    output = tmp_path / "reports" / "unit_sweep"
    with monkeypatch.context() as patched:
        patched.setattr(publish, "html_report", fails)  # the last file written
        with pytest.raises(RuntimeError, match="the last file failed"):
            publish.write_report(sweep, output, reference=False)
    assert not (tmp_path / "reports").exists()  # nothing, not even the folder above

    written = publish.write_report(sweep, output, reference=False)
    assert {p.name for p in output.iterdir()} == {p.name for p in written.files}
    (output / "evaluation").mkdir()  # peftune evaluate's, and a user's own file: a new report keeps both
    (output / "evaluation" / "evaluation.md").write_text("# Final evaluation\n\n| score |\n|---|\n| 0.5 |\n")
    (output / "notes.txt").write_text("mine")
    (output / "report.md").write_text("the earlier report")
    with monkeypatch.context() as patched:
        patched.setattr(publish, "html_report", fails)
        with pytest.raises(RuntimeError):
            publish.write_report(sweep, output, reference=False)
    assert (output / "report.md").read_text() == "the earlier report"  # not half replaced
    assert [p.name for p in (tmp_path / "reports").iterdir()] == ["unit_sweep"]  # no temporary folder left
    publish.write_report(sweep, output, reference=False)
    assert "## Held-out test split" in (output / "report.md").read_text()
    assert (output / "notes.txt").read_text() == "mine" and (output / "evaluation" / "evaluation.md").is_file()


def test_the_per_size_table_says_which_sizes_only_an_untuned_default_represents():
    """A default is a method's untuned setting (AdaptBert's rate, 1e-5, for LoRA): a size whose best trial is
    it must not read as the method tuned at that size; nor a carried trial as one the search tuned there."""
    from analysis import pareto
    from analysis.report import adaptbert_table
    from peftune.base.record_names import BEST_EPOCH, STORED_PARAMS_PCT

    def row(run_id, method, size, score, trials, default=False, carried_from=""):
        return {"run_id": run_id, "method": method, "size": size, "sst_accuracy": score, "score": score,
                pareto.COST_PCT: 0.5, STORED_PARAMS_PCT: 0.5, "trials_in_group": trials, BEST_EPOCH: 1,
                "default": default, "carried_from": carried_from}  # fmt: skip

    best = pd.DataFrame([
        row("a", "lora", "r=8", 0.33, 1, default=True),  # the only trial at r=8
        row("b", "lora", "r=16", 0.45, 1, carried_from="x"),
        row("c", "dora", "r=8", 0.40, 3, default=True),  # the default beat two tuned trials of its size
        row("d", "ia3", "", 0.43, 2),
    ])  # fmt: skip
    sizes = list(adaptbert_table(best, ["sst_accuracy"])["Size"])
    assert sizes == ["r=8 (untuned default)", "r=16 (tuned setting carried to this size)",
                     "r=8 (default, best of its size)", ""]  # fmt: skip
