"""``peftune evaluate`` end to end on a tiny sweep: real trials, their MLflow record, a test split carved from train.

The backbone is a tiny random BERT saved as a local HF directory (the packaged model's tokenizer,
2 layers of 32): every training run takes well under a second, and the code path is the real one
(``prepare`` by model path, checkpoints restored through MLflow artifacts, ``run_trial``, ``evaluate``).
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path

import mlflow
import pandas as pd
import pytest
import torch
from safetensors.torch import save_file

from analysis.evaluate import evaluate_sweep
from analysis.runs import param_from_mlflow, read_sweep_record
from conftest import NEGATIVE, POSITIVE, write_task_file
from peftune.base.errors import UserError
from peftune.core.trial_spec import DataSettings
from peftune.core.trial_spec import TrialSpec as Spec
from peftune.methods.options import options_from_params
from peftune.record.legacy import method_params
from sweep_record import COUNT_KEYS, TrialSpec, record_sweep

TASKS = ["sst", "sts"]
SWEEP = "eval_sweep"


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A local HF BERT directory: the packaged model's tokenizer files and a tiny random encoder in safetensors."""
    from peftune.inputs.backbone import DEFAULT_MODEL, BertConfig, BertModel, resolve_model_dir

    source = resolve_model_dir(DEFAULT_MODEL)
    directory = tmp_path_factory.mktemp("tiny-bert")
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).is_file():
            shutil.copy(source / name, directory / name)
    vocab_size = json.loads((source / "config.json").read_text())["vocab_size"]
    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    (directory / "config.json").write_text(json.dumps({**config.to_dict(), "model_type": "bert"}))
    torch.manual_seed(0)
    save_file(BertModel(config).state_dict(), str(directory / "model.safetensors"))
    return directory


@pytest.fixture(scope="module")
def data_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """Train/dev files in the shared format, and a labelled test split carved from each train file."""
    rng = random.Random(1)
    data, test = tmp_path_factory.mktemp("data"), tmp_path_factory.mktemp("test")
    for spec_name, header, make in (
        ("ids-sst", ["sentence", "sentiment"], lambda i, t: [t, 4 if i % 2 == 0 else 0]),
        (
            "sts",
            ["sentence1", "sentence2", "similarity"],
            lambda i, t: [t, t if i % 3 else "awful", 5.0 if i % 3 else 1.0],
        ),
    ):
        rows = [make(i, rng.choice(POSITIVE if i % 2 == 0 else NEGATIVE)) for i in range(100)]
        train, carved = rows[:72], rows[72:88]  # the test rows are cut out of the train file: never trained on
        write_task_file(data / f"{spec_name}-train.csv", header, train)
        write_task_file(test / f"{spec_name}-test.csv", header, carved)
        dev = [make(i, rng.choice(POSITIVE if i % 2 == 0 else NEGATIVE)) for i in range(16)]
        write_task_file(data / f"{spec_name}-dev.csv", header, dev)
    return data, test


@pytest.fixture(scope="module")
def sweep_store(tmp_path_factory, tiny_model_dir, data_dirs):
    """Three real trials (frozen, LoRA r=2, full) trained for 2 epochs, recorded as peftune.record.writer records a
    sweep."""
    from peftune import methods
    from peftune.core.train import TrainConfig, prepare, run_trial

    data, _ = data_dirs
    root = tmp_path_factory.mktemp("mlflow")
    prepared = prepare(DataSettings(str(data), model=str(tiny_model_dir), max_length=32, seed=0), TASKS)
    specs, stored = [], {}
    # frozen (heads only) and full fine-tuning land far apart on both axes: both are on any frontier
    trials = (("t0", "frozen", {}, 1e-2), ("t1", "lora", {"rank": 2}, 3e-2), ("t2", "full", {}, 1e-3))
    for trial_id, method, options, lr in trials:
        config = TrainConfig(
            method=method, method_options=options, tasks=TASKS, lr=lr, epochs=2, batch_size=16, seed=0, log_every=0
        )
        checkpoint = root / f"ckpt-{trial_id}"
        best = {"score": -1.0}

        def report(metrics, save, best=best, checkpoint=checkpoint):
            if metrics["score"] > best["score"]:
                best["score"] = metrics["score"]
                save(checkpoint)

        history = run_trial(config, prepared, report).history
        data_settings = DataSettings(str(data), model=str(tiny_model_dir), max_length=32)
        stored[trial_id] = Spec(config, data_settings).to_json()  # as every sweep run stores it
        fields = dataclasses.asdict(methods.make_method_config(method, config.method_options_with_dropout()))
        fields.pop("dropout")
        specs.append(
            TrialSpec(
                trial_id,
                method,
                fields,
                [{"sst_accuracy": h["sst_accuracy"], "sts_pearson": h["sts_pearson"]} for h in history],
                {k: history[0][k] for k in COUNT_KEYS},
                lr=lr,
                checkpoint_dir=checkpoint,
            )
        )
    uri = f"sqlite:///{root / 'mlflow.db'}"
    _, parent_id, runs = record_sweep(
        uri,
        SWEEP,
        TASKS,
        specs,
        artifact_dir=root / "artifacts",
        model=str(tiny_model_dir),
        data_hashes=prepared.file_hashes,
        planned_epochs=2,
        batch_size=16,
    )
    client = mlflow.MlflowClient(tracking_uri=uri)
    for trial_id, text in stored.items():  # what a re-trained seed trains (analysis.evaluate.recorded_config)
        client.log_text(runs[trial_id], text, "trial_spec.json")
    return uri, parent_id


def test_a_trial_row_gives_back_the_options_it_trained():
    """The trials frame holds params typed by param_from_mlflow, in columns shared by methods (an int column
    with gaps reads back as floats); the confirmation reads the same params as strings: both get one answer."""
    logged = {"method.bottleneck": "16", "method.init_std": "0.001", "method.train_layernorm": "False"}
    frame = pd.DataFrame(
        [
            {"method": "hyperformer", **{k: param_from_mlflow(v) for k, v in logged.items()}},
            {"method": "lora", "method.rank": 8, "method.targets": "query,value"},  # hyperformer's columns: NaN
        ]
    )
    expected = {"bottleneck": 16, "init_std": 0.001, "train_layernorm": False}
    assert options_from_params("hyperformer", method_params(frame.iloc[0])) == expected
    assert options_from_params("hyperformer", logged) == expected
    assert type(options_from_params("hyperformer", method_params(frame.iloc[0]))["bottleneck"]) is int
    assert options_from_params("lora", method_params(frame.iloc[1])) == {"rank": 8, "targets": ["query", "value"]}


def test_evaluate_frontier_with_two_seeds(sweep_store, data_dirs, tmp_path):
    """Note: peftune.core.checkpoint fingerprints a checkpoint's backbone from the *trained* embeddings, so a full
    fine-tuning checkpoint is refused by the pretrained backbone; evaluate then re-trains that seed."""
    uri, parent_id = sweep_store
    data, test = data_dirs
    sweep = read_sweep_record(SWEEP, uri)
    options = options_from_params("lora", method_params(sweep.trials.set_index("trial_id").loc["t1"]))
    assert options["targets"] == ["query", "key", "value"]

    evaluation = evaluate_sweep(SWEEP, data, test, seeds=2, tracking_uri=uri, output=tmp_path / "report")

    from analysis.pareto import frontier

    expected = set(frontier(sweep.trials)["run_id"])
    assert set(evaluation.configurations["run_id"]) == expected
    assert {"t0", "t2"} <= set(evaluation.configurations["trial_id"])
    runs = evaluation.runs
    # run round by round: every configuration's first seed before any second one (a long evaluation's log
    # has every configuration early)
    assert list(runs[runs["split"] == "dev"]["seed"]) == [0] * len(expected) + [1] * len(expected)
    # per configuration: its sweep dev figure, then each seed's dev and test
    assert len(runs) == len(expected) * (1 + 2 * 2)
    for run_id in expected:
        mine = runs[runs["run_id"] == run_id]
        assert list(mine["split"]) == ["selection (sweep)", "dev", "test", "dev", "test"]
        first = "checkpoint" if mine["method"].iloc[0] != "full" else mine["source"].iloc[1]  # see the note below
        assert list(mine["source"]) == ["sweep record", first, first, "retrained", "retrained"]
        assert list(mine["seed"].iloc[1:]) == [0, 0, 1, 1]
        # the trial's own seed, restored (or re-trained: training is deterministic on CPU), reproduces the
        # score the sweep recorded: same data, same weights
        recorded, restored = mine["score"].iloc[0], mine["score"].iloc[1]
        assert restored == pytest.approx(recorded, abs=1e-6)
        test_rows = mine[mine["split"] == "test"]
        assert test_rows["score"].to_numpy() == pytest.approx(test_rows[["sst_accuracy", "sts_pearson"]].mean(axis=1))

    # mean and sample std over the seeds
    summary = evaluation.summary
    for run_id in expected:
        tests = runs[(runs["run_id"] == run_id) & (runs["split"] == "test")]
        row = summary[(summary["run_id"] == run_id) & (summary["split"] == "test")].iloc[0]
        assert row["n"] == 2
        assert row["score_mean"] == pytest.approx(tests["score"].mean())
        assert row["score_std"] == pytest.approx(tests["score"].std(ddof=1))
        assert row["sst_accuracy_std"] == pytest.approx(tests["sst_accuracy"].std(ddof=1))

    directory = tmp_path / "report" / "evaluation"
    names = {"evaluation.csv", "evaluation_runs.csv", "evaluation.md", "evaluation.png"}
    assert names <= {p.name for p in directory.iterdir()}
    markdown = (directory / "evaluation.md").read_text()
    header = "| Method | Params/task % | Split | Score | SST | STS | Trained on (rows per task) | Seeds | Run id |"
    assert header in markdown
    assert " ± " in markdown and "| frozen | 0 | test |" in markdown
    assert pd.read_csv(directory / "evaluation.csv")["split"].tolist().count("test") == len(expected)

    client = mlflow.MlflowClient(tracking_uri=uri)
    logged = {item.path for item in client.list_artifacts(parent_id, "report/evaluation")}
    assert {f"report/evaluation/{name}" for name in names} <= logged


def test_a_test_split_equal_to_a_dev_file_is_refused(sweep_store, data_dirs, tmp_path, capsys):
    from peftune.cli.commands import main

    uri, _ = sweep_store
    data, test = data_dirs
    leaky = tmp_path / "leaky"
    leaky.mkdir()
    shutil.copy(data / "ids-sst-dev.csv", leaky / "ids-sst-test.csv")
    shutil.copy(test / "sts-test.csv", leaky / "sts-test.csv")
    argv = ["evaluate", "--sweep", SWEEP, "--tracking-uri", uri, "--data-dir", str(data), "--test-dir", str(leaky)]
    assert main([*argv, "--seeds", "1", "--output", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert "ids-sst-test.csv has the same content as ids-sst-dev.csv" in error
    assert not (tmp_path / "out").exists()  # refused before anything was trained or written


def test_missing_test_file_names_it(sweep_store, data_dirs, tmp_path, capsys):
    from peftune.cli.commands import main

    uri, _ = sweep_store
    data, _ = data_dirs
    argv = ["evaluate", "--sweep", SWEEP, "--tracking-uri", uri, "--data-dir", str(data), "--test-dir", str(tmp_path)]
    assert main([*argv, "--seeds", "1"]) == 2
    assert "ids-sst-test.csv: file not found" in capsys.readouterr().err


def test_a_retrained_trial_is_its_own_method_kept_on_the_selection_split_as_the_sweep():
    from analysis.evaluate import rerun_config

    row = pd.Series({"method": "bitfit", "tasks": "sst", "lr": 1e-3, "dropout": 0.1, "weight_decay": 0.0,
                     "epochs": 2, "batch_size": 16})  # fmt: skip
    config = rerun_config(row, seed=3, train_settings={"eval_splits": ["dev"]}, device="cpu")
    assert config.method == "bitfit" and config.seed == 3
    assert config.eval_splits == ["selection", "dev"]  # selection keeps the epoch; dev is reported
    one = rerun_config(row.copy().replace({2: 1}), seed=3, train_settings={}, device="cpu")
    assert one.eval_splits == ["dev"]  # one epoch: nothing to choose


def test_a_retrained_trial_with_a_stored_spec_trains_exactly_that_spec_with_the_new_seed(tmp_path):
    from analysis.evaluate import recorded_config
    from peftune.core.train import TrainConfig

    trained = TrainConfig(
        method="lora", method_options={"rank": 4, "targets": ["query", "value"]}, tasks=["sst"], lr=3e-4,
        dropout=0.05, weight_decay=0.01, epochs=3, batch_size=8, seed=0, warmup_ratio=0.2, head_lr=1e-3,
        eval_splits=["selection", "decision", "dev"], predictions_of=("decision",),
    )  # fmt: skip
    spec = Spec(trained, DataSettings(str(tmp_path), selection_examples=16, decision_examples=8))
    config = recorded_config(spec.to_json(), "run r: trial_spec.json", seed=7, device="cpu")
    # what a row of the trials frame cannot give back (the heads' rate, the warm-up) comes from the spec
    expected = {"seed": 7, "device": "cpu", "eval_splits": ["selection", "dev"], "predictions_of": ()}
    assert config == dataclasses.replace(spec.config, **expected)
    assert recorded_config(spec.to_json(), "x", seed=7, device="cpu", selecting=False).eval_splits == ["dev"]
    with pytest.raises(Exception, match="run r: trial_spec.json: not valid JSON"):
        recorded_config("{", "run r: trial_spec.json", seed=7, device="cpu")


def test_a_search_trial_judged_at_data_fidelity_rungs_re_trains_without_a_traceback(tiny_prepared):
    """The shipped presets' search trials report at data-fidelity rungs (without a checkpoint): their re-run is
    judged at its epochs' ends only, so ``peftune evaluate`` runs on the record those presets make."""
    from analysis.evaluate import _retrain, recorded_config
    from peftune.core.train import TrainConfig

    searched = TrainConfig(method="bitfit", tasks=["sst"], lr=1e-3, epochs=2, batch_size=8, seed=0,
                           report_fractions=[1 / 9, 1 / 3], eval_splits=["selection"])  # fmt: skip
    spec = Spec(searched, DataSettings("data", selection_examples=8))
    config = recorded_config(spec.to_json(), "run r: trial_spec.json", seed=1, device="cpu")
    assert config.report_fractions == [] and config.eval_splits == ["selection", "dev"]
    model, metrics = _retrain(config, tiny_prepared)
    assert 0.0 <= metrics["score"] <= 1.0 and model is not None


def test_dev_only_at_more_epochs_and_no_answer_without_a_confirmation(sweep_store, data_dirs, tmp_path):
    """Without a test split the evaluation scores dev only; --epochs re-trains every seed (no checkpoint restored)
    for that many epochs, and the table says so; --answer needs the record's answer per budget."""
    uri, _ = sweep_store
    data, _ = data_dirs
    evaluation = evaluate_sweep(SWEEP, data, None, seeds=1, top=1, epochs=3, tracking_uri=uri,
                                output=tmp_path / "report", log_artifacts=False)  # fmt: skip
    runs = evaluation.runs
    assert set(runs["split"]) == {"selection (sweep)", "dev"}
    seeded = runs[runs["split"] == "dev"]
    assert (seeded["source"] == "retrained").all() and seeded["train_rows"].str.endswith("x 3 epoch(s)").all()
    assert "dev only" in (tmp_path / "report" / "evaluation" / "evaluation.md").read_text()
    with pytest.raises(UserError, match="no confirmation runs: --answer"):
        evaluate_sweep(SWEEP, data, None, answer=True, tracking_uri=uri, output=tmp_path / "r2", log_artifacts=False)


def test_a_sweep_that_skipped_malformed_rows_is_re_read_the_same_way(tiny_model_dir, data_dirs, tmp_path):
    """The multitask preset skips Quora's two malformed train rows (``invalid_rows: skip``): its record is
    evaluated without being told so; ``invalid_rows="raise"`` still stops at the row, naming file and line."""
    data, _ = data_dirs
    broken = tmp_path / "data"
    shutil.copytree(data, broken)
    with open(broken / "sts-train.csv", "a", encoding="utf-8") as f:
        f.write("72\tid0072\ta fine film\t\t5.0\n")  # line 74: an empty second sentence
    counts = {key: 1_000 for key in COUNT_KEYS}
    trial = TrialSpec("t0", "frozen", {}, [{"sst_accuracy": 0.5, "sts_pearson": 0.1}], counts, lr=1e-2)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    record_sweep(uri, "skipping", TASKS, [trial], artifact_dir=tmp_path / "artifacts", model=str(tiny_model_dir),
                 planned_epochs=1, definition={"invalid_rows": "skip"})  # fmt: skip
    evaluation = evaluate_sweep("skipping", broken, None, seeds=1, tracking_uri=uri, output=tmp_path / "report",
                                log_artifacts=False)  # fmt: skip
    assert (evaluation.runs["split"] == "dev").sum() == 1
    with pytest.raises(UserError, match=r"sts-train.csv, line 74: empty text"):
        evaluate_sweep("skipping", broken, None, seeds=1, tracking_uri=uri, output=tmp_path / "r2",
                       invalid_rows="raise", log_artifacts=False)  # fmt: skip


def test_a_record_whose_artifacts_live_on_its_server_names_the_server(tmp_path):
    """A sweep run through ``peftune up`` keeps its artifacts behind the MLflow server (``mlflow-artifacts:``);
    read through its SQLite file, the one-line error says to start the server and read through it."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("served", artifact_location="mlflow-artifacts:/1")
    client.create_run(experiment, tags={"peftune.role": "sweep", "peftune.sweep": "served"})
    with pytest.raises(UserError, match=r"start it \(`peftune up` where the store lives\) and pass --tracking-uri"):
        read_sweep_record("served", uri)
