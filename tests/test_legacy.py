"""The record's version (issue 55): the sweep tags its parent run with it, the report reads it, and every old path
(``peftune.record.legacy``) is taken by an untagged record only. A tagged record that lacks a piece, or a tag this
peftune cannot read, is refused in one line naming the run. Real MLflow stores (SQLite in tmp_path), no mocks."""

from __future__ import annotations

import math

import mlflow
import pytest

from analysis import report, runs
from peftune.base import record_names
from peftune.base.errors import RecordError
from peftune.cli.commands import main
from peftune.record import legacy, writer
from peftune.stats.decisions import Plan
from peftune.sweep import spaces
from sweep_record import TrialSpec, counts, record_sweep

# a confirmation run's predictions: task -> (example ids, predictions, labels)
PREDICTIONS = {"sst": (["e1", "e2", "e3"], [1, 2, 0], [1, 3, 0])}


def one_line_naming(error: RecordError, run_id: str) -> str:
    text = str(error)
    assert "\n" not in text and run_id in text, text
    return text


def test_a_new_sweep_tags_its_version_and_a_resumed_old_one_stays_untagged(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    definition = spaces.load_sweep(spaces.resolve_sweep_path("sst_tuning"), budget="cpu")
    where = {"data_hashes": {}, "ray_experiment_path": str(tmp_path / "ray")}
    opened = writer.open_sweep(uri, definition, expect_existing=False, **where)
    client = mlflow.MlflowClient(uri)
    tags = client.get_run(opened.parent_run_id).data.tags
    assert (
        tags[record_names.RECORD_VERSION_TAG] == str(legacy.RECORD_VERSION) and opened.version == legacy.RECORD_VERSION
    )
    resumed = writer.open_sweep(uri, definition, expect_existing=True, **where)
    assert resumed.resumed and resumed.version == legacy.RECORD_VERSION

    # a sweep begun before the tag: resumed, it keeps none and stays an old record
    client.delete_tag(opened.parent_run_id, record_names.RECORD_VERSION_TAG)
    resumed = writer.open_sweep(uri, definition, expect_existing=True, **where)
    assert resumed.version == legacy.UNTAGGED
    assert record_names.RECORD_VERSION_TAG not in client.get_run(opened.parent_run_id).data.tags


def test_an_untagged_record_takes_the_old_paths(tmp_path):
    """No phase or config key tag, no selection split, no plan and no predictions: read as before the tag."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    specs = [
        TrialSpec("s", "lora", {"rank": 8}, [{"sst_accuracy": 0.40}], counts(5_000)),
        TrialSpec("c", "lora", {"rank": 8}, [{"sst_accuracy": 0.42}], counts(5_000), seed=4),
    ]
    _, _, ids = record_sweep(uri, "old", ["sst"], specs, artifact_dir=tmp_path / "artifacts")
    client = mlflow.MlflowClient(uri)
    client.delete_tag(ids["s"], record_names.CONFIG_KEY)
    client.set_tag(ids["c"], record_names.PHASE, record_names.CONFIRM)

    sweep = runs.read_sweep_record("old", uri)
    assert sweep.record_version == legacy.UNTAGGED
    trial = sweep.trials.set_index("trial_id").loc["s"]
    assert (
        trial["phase"] == record_names.SEARCH and trial["config_key"] == f"run:{ids['s']}" and trial["split"] == "dev"
    )
    assert len(sweep.confirmations) == 1 and runs.load_predictions(sweep).empty  # no predictions: left out
    plan = report.plan_of(sweep.parent_params, sweep.record_version, sweep.parent_run_id)
    assert plan == Plan(seeds=3, max_seeds=3, margin=0.05)


def current_record(tmp_path, drop: str | None = None) -> tuple[str, str, dict[str, str]]:
    """(tracking URI, parent run id, trial id -> run id) of a record of the current version (search trial ``s``,
    confirmation run ``c``), but for the piece ``drop``."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    specs = [
        TrialSpec("s", "lora", {"rank": 8}, [{"sst_accuracy": 0.40}], counts(5_000)),
        TrialSpec("c", "lora", {"rank": 8}, [{"sst_accuracy": 0.42}], counts(5_000), seed=4,
                  predictions=None if drop == "predictions" else PREDICTIONS),
    ]  # fmt: skip
    budget = {"selection_examples": 8, "decision_examples": 3}
    _, parent, ids = record_sweep(uri, "current", ["sst"], specs, artifact_dir=tmp_path / "artifacts", budget=budget)
    client = mlflow.MlflowClient(uri)
    client.set_tag(parent, record_names.RECORD_VERSION_TAG, str(legacy.RECORD_VERSION))
    client.set_tag(ids["s"], record_names.PHASE, record_names.SEARCH)
    client.set_tag(ids["c"], record_names.PHASE, record_names.CONFIRM)
    if drop != "selection_score":
        client.log_metric(ids["s"], record_names.split_metric(record_names.SELECTION, record_names.SCORE), 0.40, step=1)
    client.log_metric(ids["c"], record_names.split_metric(record_names.DEV, record_names.SCORE), 0.42, step=1)
    if drop in (record_names.PHASE, record_names.CONFIG_KEY):
        client.delete_tag(ids["s"], drop)
    return uri, parent, ids


def test_a_whole_current_record_takes_no_old_path(tmp_path):
    uri, _, _ = current_record(tmp_path)
    sweep = runs.read_sweep_record("current", uri)
    assert sweep.record_version == legacy.RECORD_VERSION
    trial = sweep.trials.set_index("trial_id").loc["s"]
    assert trial["phase"] == record_names.SEARCH and not trial["config_key"].startswith("run:")
    assert trial["split"] == "selection"
    assert set(runs.load_predictions(sweep)["split"]) == {record_names.DECISION, record_names.DEV}


@pytest.mark.parametrize("drop", [record_names.PHASE, record_names.CONFIG_KEY, "selection_score"])
def test_a_current_record_that_lost_a_run_piece_is_refused(tmp_path, drop):
    uri, _, ids = current_record(tmp_path, drop)
    with pytest.raises(RecordError) as refused:
        runs.read_sweep_record("current", uri)
    assert drop in one_line_naming(refused.value, ids["s"])


def test_a_current_record_that_lost_its_predictions_is_refused(tmp_path):
    uri, _, ids = current_record(tmp_path, "predictions")
    sweep = runs.read_sweep_record("current", uri)
    with pytest.raises(RecordError) as refused:
        runs.load_predictions(sweep)
    assert "predictions on the decision split" in one_line_naming(refused.value, ids["c"])


@pytest.mark.parametrize("tag", ["six", "6.0", "5", str(legacy.RECORD_VERSION + 1)])
def test_a_version_tag_this_peftune_cannot_read_is_refused(tmp_path, capsys, tag):
    uri, parent, _ = current_record(tmp_path)
    mlflow.MlflowClient(uri).set_tag(parent, record_names.RECORD_VERSION_TAG, tag)
    with pytest.raises(RecordError) as refused:
        runs.read_sweep_record("current", uri)
    assert f"expected an integer from 6 to {legacy.RECORD_VERSION}" in one_line_naming(refused.value, parent)
    capsys.readouterr()
    assert main(["report", "--sweep", "current", "--tracking-uri", uri, "--output", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and parent in error and record_names.RECORD_VERSION_TAG in error


RUN = "0123abcd"


@pytest.mark.parametrize(
    "old_path, before",
    [
        (lambda v: legacy.unspecified(RUN, {record_names.TRAIN_COMMAND: "peftune train --method bitfit"}, v), None),
        (lambda v: legacy.confirmation_rows(RUN, None, v), False),
        (lambda v: legacy.split_sizes({}, v, RUN), (False, 0)),
        (lambda v: legacy.plan_params({}, v, RUN), (3, 3, 0.05)),
        (lambda v: legacy.eval_seconds(RUN, {"eval_time_s": 2.0}, math.nan, v), 2.0),
        (lambda v: legacy.missing_predictions(RUN, record_names.DEV, v, kept=True), None),
    ],
    ids=["trial_spec", "confirmation_rows", "split_sizes", "plan", "eval_total_s", "predictions"],
)
def test_each_old_path_is_an_untagged_records_only(old_path, before):
    assert old_path(legacy.UNTAGGED) == before
    with pytest.raises(RecordError) as refused:
        old_path(legacy.RECORD_VERSION)
    one_line_naming(refused.value, RUN)


def test_what_a_current_record_may_lack_is_no_lost_piece():
    """A sweep with no data directory stores no trial_spec.json (nor a command); a report run keeps no predictions,
    and a sweep without decision examples none on that split."""
    assert legacy.unspecified(RUN, {}, legacy.RECORD_VERSION) is None
    for split, reason, decision_examples in [
        (record_names.DEV, "report: fresh seed", 8),
        (record_names.DECISION, "", 0),
    ]:
        kept = record_names.keeps_predictions(split, reason, decision_examples)
        assert not kept and legacy.missing_predictions(RUN, split, legacy.RECORD_VERSION, kept) is None
    assert record_names.keeps_predictions(record_names.DECISION, "", 8) and record_names.keeps_predictions(
        record_names.DEV, "", 0
    )
