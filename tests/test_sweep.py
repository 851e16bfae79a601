"""Real sweeps, in process: Ray Tune + OptunaSearch + ASHA on the embedded MiniLM, recorded in MLflow (no mocks).

One tiny sweep checks the MLflow record (parent, every child, params, per-epoch metrics,
parameter counts, statuses completed / early_stopped / failed, best checkpoints); a second
is interrupted part-way and run again, and must resume without re-running finished trials
or duplicating child runs.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import mlflow
import pytest
import ray
import yaml
from ray import tune

from conftest import start_local_ray
from peftune.core import checkpoint
from peftune.record import legacy, reader, stores
from peftune.sweep import orchestrator, search, spaces
from tiny_sweep import FROZEN_AND_TOP_K, write_definition

# frozen with a vanishing lr cannot learn: it scores below top_k after epoch 1, so ASHA stops it
# there; top_k with k = 8 > the 6 layers of MiniLM fails when the trial builds its model.
# the joint search (one TPE over a categorical method, one ASHA for all): per-method allocation is tested in
# test_search.py
FROZEN = """\
    method: frozen
    lr: 1.0e-9
    dropout: {low: 0.0, high: 0.2}
    weight_decay: 0.0
"""
TOP_K = """\
    method: top_k
    lr: {low: 2.0e-4, high: 1.0e-3, log: true}
    dropout: 0.1
    weight_decay: {low: 0.0, high: 0.1}
    options:
      k: {choices: [1, 8]}
"""
SWEEP = """\
    name: {name}
    tasks: [sst]
    methods: [frozen, top_k]
    seed: {seed}
    search: {{objective: single, sampler: tpe, n_startup_trials: 10, allocation: joint}}
    scheduler: {{type: asha, grace_period: 1, reduction_factor: 2}}
    resources: {{cpus_per_trial: 1, max_concurrent_trials: {concurrency}}}
    max_failures: 1
    checkpoints_per_method: 1
    confirm: {{seeds: 0}}
    budget: tiny
    budgets:
      tiny: {{trials_per_method: {trials_per_method}, epochs: 2, batch_size: 16, max_length: 32, max_train_examples: 64,
              max_dev_examples: 32}}
"""


def definition(directory: Path, name: str, trials_per_method: int, concurrency: int, seed: int = 0, fits: bool = False):
    """``fits``: top_k's k within MiniLM's 6 layers, for sweeps started by the command line, which refuses a space
    that does not fit the model before any work (``sweep_command.check_spaces_against_model``)."""
    spaces_ = {"frozen": FROZEN, "top_k": FROZEN_AND_TOP_K["top_k"] if fits else TOP_K}  # the same, k in {1, 2}
    return write_definition(
        directory, name, spaces_, SWEEP, seed=seed, concurrency=concurrency, trials_per_method=trials_per_method
    )


@pytest.fixture(scope="module")
def local_ray():
    start_local_ray()
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sweeps")


@pytest.fixture(scope="module")
def tracking_uri(workdir) -> str:
    return f"sqlite:///{workdir / 'mlflow.db'}"  # one store for the module: MLflow sets a new one up in ~10 s


def runs_of(uri: str, name: str):
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=[name])
    parents = runs[runs["tags.peftune.role"] == "sweep"]
    children = runs[runs["tags.peftune.role"] == "trial"]
    return parents, children


def steps(client, run_id: str, key: str) -> list[int]:
    return sorted(int(m.step) for m in client.get_metric_history(run_id, key))


def assert_state_is_the_record(logger, uri: str, parent_run_id: str) -> None:
    """The driver's state of the sweep (``TrialLogger.runs``) is what the record holds: the same runs in the same
    order, each with its tags, params, latest metrics, status and start time (but the checkpoint tag, which the
    sweep's end sets on the record alone, and MLflow's own tags)."""
    client = mlflow.MlflowClient(uri)
    experiment_id = client.get_run(parent_run_id).info.experiment_id
    recorded = reader.child_runs(client, experiment_id, parent_run_id)
    held = logger.runs()
    assert [r.info.run_id for r in held] == [r.info.run_id for r in recorded]
    for state, run in zip(held, recorded, strict=True):
        tags = {k: v for k, v in run.data.tags.items() if k != "peftune.checkpoint"}
        held = {k: v for k, v in state.data.tags.items() if k != "peftune.checkpoint"}  # read back on a resume
        assert {k: tags[k] for k in held if k in tags} == held  # every tag held is recorded
        assert all(k.startswith("mlflow.") for k in set(tags) - set(held))  # the rest are MLflow's
        assert state.data.params == run.data.params and state.data.metrics == run.data.metrics
        assert (state.info.status, state.info.start_time) == (run.info.status, run.info.start_time)


def test_sweep_records_parent_and_every_trial(local_ray, workdir, tracking_uri, tiny_data_dir, monkeypatch):
    # seed 7 proposes top_k(k=1), frozen, top_k(k=8), frozen, frozen, frozen: all random (n_startup_trials
    # 10 > 6 trials), so the order does not depend on scores; one trial at a time makes ASHA's decisions certain
    spec = definition(workdir / "defs", "record", trials_per_method=3, concurrency=1, seed=7)
    loggers = []  # the sweep's trial logger, kept to read its state after the sweep
    hooks = orchestrator.SweepHooks(on_trial_logger=loggers.append)
    result = orchestrator.run_sweep(
        spec, tiny_data_dir, tracking_uri, storage_path=workdir / "ray_results", hooks=hooks
    )
    assert_state_is_the_record(loggers[-1], tracking_uri, result.parent_run_id)
    # one trial fails (top_k with k = 8): the sweep says so
    assert result.status == "completed_with_failures" and result.num_trials == 6 and not result.resumed

    parents, children = runs_of(tracking_uri, "record")
    assert len(parents) == 1
    parent = parents.iloc[0]
    assert parent["run_id"] == result.parent_run_id and parent["status"] == "FINISHED"
    assert parent["tags.mlflow.runName"] == "record" and parent["tags.peftune.sweep"] == "record"
    assert parent["tags.peftune.backbone"] == "all-minilm-l6-v2" and parent["tags.peftune.code_version"]
    assert parent["tags.peftune.status"] == "completed_with_failures"
    assert parent["tags.peftune.record_version"] == str(legacy.RECORD_VERSION)  # the record says its version
    expected = {
        "tasks": "sst",
        "methods": "frozen,top_k",
        "num_samples": "6",
        "scheduler": "asha",
        "seed": "7",
        "model": "all-minilm-l6-v2",
        "budget": "tiny",
        "epochs": "2",
        "batch_size": "16",
        "max_length": "32",
        "max_train_examples": "64",
        "max_dev_examples": "32",
    }
    assert {k: parent[f"params.{k}"] for k in expected} == expected
    client = mlflow.MlflowClient(tracking_uri)
    hashes = json.loads(
        Path(client.download_artifacts(result.parent_run_id, "data_hashes.json", str(workdir))).read_text()
    )
    assert set(hashes) == {"ids-sst-train.csv", "ids-sst-dev.csv"}
    resolved = Path(client.download_artifacts(result.parent_run_id, "sweep.yaml", str(workdir))).read_text()
    assert yaml.safe_load(resolved)["budget_trials_per_method"] == 3

    # one child per trial, nested under the parent, keyed by the Ray trial id
    assert len(children) == 6 and children["tags.peftune.trial_id"].is_unique
    assert (children["tags.mlflow.parentRunId"] == result.parent_run_id).all()
    assert (children["tags.peftune.sweep"] == "record").all()
    for key in ("method", "lr", "dropout", "weight_decay", "epochs", "batch_size", "tasks", "seed"):
        assert children[f"params.{key}"].notna().all(), key
    statuses = children["tags.peftune.status"].value_counts().to_dict()
    assert set(statuses) == {"completed", "early_stopped", "failed"}, statuses

    for _, run in children.iterrows():
        method, status, run_id = run["params.method"], run["tags.peftune.status"], run["run_id"]
        # conditional space: only top_k trials have (and have only) their size
        assert (run["params.method.k"] in ("1", "8")) if method == "top_k" else pd_isna(run.get("params.method.k"))
        if status == "failed":
            assert run["params.method.k"] == "8" and run["status"] == "FAILED"
            assert "exceeds the backbone's 6 layers" in run["tags.peftune.error"]
            assert run["tags.peftune.retries"] == "1"  # FailureConfig retried it once
            continue
        assert run["status"] == "FINISHED" and pd_isna(run.get("tags.peftune.error"))
        epochs = steps(client, run_id, "score")
        assert epochs == ([1] if status == "early_stopped" else [1, 2]), (status, epochs)
        for key in ("sst_accuracy", "train_loss", "epoch_time_s", "tokens_per_s", "train_time_s"):
            assert steps(client, run_id, key) == epochs, key
        for key in (
            "backbone_params",
            "trainable_params_per_task",
            "trainable_params_per_task_pct",
            "stored_params",
            "stored_params_pct",
            "checkpoint_params",
        ):
            assert run[f"metrics.{key}"] >= 0, key
        assert run["metrics.backbone_params"] > 20_000_000  # MiniLM: 22.7M
        assert (run["metrics.trainable_params_per_task"] > 0) == (method == "top_k")
        scores = {int(m.step): m.value for m in client.get_metric_history(run_id, "score")}
        best_epoch = max(sorted(scores), key=scores.get)
        assert run["metrics.best_score"] == scores[best_epoch] and run["metrics.best_epoch"] == best_epoch
        assert run["metrics.best_sst_accuracy"] == scores[best_epoch]  # one task: score = its accuracy
    assert (children[children["params.method"] == "frozen"]["tags.peftune.status"] != "completed").any()

    # the best trial of each method keeps its checkpoint (trainable parameters, safetensors)
    logged = children[children["tags.peftune.checkpoint"].notna()] if "tags.peftune.checkpoint" in children else []
    assert sorted(logged["params.method"]) == ["frozen", "top_k"]
    for _, run in logged.iterrows():
        best_of_method = children[(children["params.method"] == run["params.method"])]["metrics.best_score"].max()
        assert run["metrics.best_score"] == best_of_method
        local = Path(client.download_artifacts(run["run_id"], "checkpoint", str(workdir / run["run_id"])))
        assert sorted(p.name for p in local.iterdir()) == ["peftune.json", "trainable.safetensors"]
        assert checkpoint.read_meta(local)["method"] == run["params.method"]

    # running a finished sweep again restores it: nothing runs again but the failed trial (Ray retries
    # errored trials), which fails again; the record keeps one run per trial
    again = orchestrator.run_sweep(spec, tiny_data_dir, tracking_uri, storage_path=workdir / "ray_results", hooks=hooks)
    assert_state_is_the_record(loggers[-1], tracking_uri, result.parent_run_id)  # read once, then kept
    assert again.status == "completed_with_failures" and again.resumed and again.parent_run_id == result.parent_run_id
    assert again.statuses == result.statuses
    parents, rerun = runs_of(tracking_uri, "record")
    assert len(parents) == 1 and len(rerun) == 6 and rerun["tags.peftune.trial_id"].is_unique
    failed = rerun[rerun["tags.peftune.status"] == "failed"]
    assert len(failed) == 1 and "exceeds the backbone's 6 layers" in failed.iloc[0]["tags.peftune.error"]


def pd_isna(value) -> bool:
    return value is None or value != value  # NaN


class InterruptMidTrial(tune.Callback):
    """Stops the experiment as Ctrl+C does (Tune's SIGUSR1 handler) once ``after`` trials have finished and a
    top_k trial (which ASHA keeps) has saved its first epoch's checkpoint: that trial must go on from there."""

    def __init__(self, after: int):
        self.after, self.finished, self.fired = after, 0, None
        self.epoch: dict[str, int] = {}

    def on_trial_complete(self, iteration, trials, trial, **info):
        self.finished += 1

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self.epoch[trial.trial_id] = result["epoch"]

    def on_checkpoint(self, iteration, trials, trial, checkpoint, **info):
        first_epoch = self.epoch.get(trial.trial_id) == 1 and trial.config["method"] == "top_k"
        if self.fired is None and self.finished >= self.after and first_epoch:
            self.fired = trial.trial_id
            os.kill(os.getpid(), signal.SIGUSR1)


class Recorder(tune.Callback):
    def __init__(self):
        self.started: list[str] = []
        self.epochs: dict[str, list[int]] = {}

    def on_trial_start(self, iteration, trials, trial, **info):
        self.started.append(trial.trial_id)

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self.epochs.setdefault(trial.trial_id, []).append(result["epoch"])


def test_interrupted_sweep_resumes_without_rerunning_or_duplicating(local_ray, workdir, tracking_uri, tiny_data_dir):
    # seed 8 proposes top_k(k=1), frozen, top_k(k=1), frozen, one at a time: the interruption comes
    # when the second top_k has saved its first epoch, after the first two trials finished
    spec = definition(workdir / "defs", "resume", trials_per_method=2, concurrency=1, seed=8)
    storage = workdir / "ray_results"
    interrupter = InterruptMidTrial(after=2)
    first = orchestrator.run_sweep(spec, tiny_data_dir, tracking_uri, storage_path=storage, callbacks=[interrupter])
    assert first.status == "interrupted" and interrupter.fired
    parents, children = runs_of(tracking_uri, "resume")
    assert parents.iloc[0]["tags.peftune.status"] == "interrupted" and parents.iloc[0]["status"] == "KILLED"
    finished = set(children[children["tags.peftune.status"].notna()]["tags.peftune.trial_id"])
    assert 2 <= len(finished) < 4 and interrupter.fired not in finished
    open_runs = children[children["tags.peftune.status"].isna()]
    assert (open_runs["status"] == "KILLED").all()  # interrupted, not finished: resuming continues them
    results_before = {t: _result_lines(storage / "resume", t) for t in finished}

    # with another definition, or --fresh, the sweep refuses to go on
    with pytest.raises(ValueError, match="another definition"):
        orchestrator.run_sweep(
            spec.with_overrides(trials_per_method=3), tiny_data_dir, tracking_uri, storage_path=storage
        )
    with pytest.raises(ValueError, match="already has Ray Tune state"):
        orchestrator.run_sweep(spec, tiny_data_dir, tracking_uri, storage_path=storage, resume=False)

    recorder = Recorder()
    second = orchestrator.run_sweep(spec, tiny_data_dir, tracking_uri, storage_path=storage, callbacks=[recorder])
    assert second.status == "completed" and second.resumed and second.parent_run_id == first.parent_run_id
    assert not finished & set(recorder.started), "a finished trial ran again"
    for trial_id, lines in results_before.items():
        assert _result_lines(storage / "resume", trial_id) == lines
    assert recorder.epochs[interrupter.fired] == [2], "the interrupted trial did not go on from its checkpoint"
    # ASHA remembers the first run's epochs: the frozen trial (which cannot learn) started after the
    # restore is stopped at the first rung, as they would have been without the interruption
    new_trials = [t for t in recorder.epochs if t != interrupter.fired]
    assert len(new_trials) == 1 and all(recorder.epochs[t] == [1] for t in new_trials), recorder.epochs

    parents, children = runs_of(tracking_uri, "resume")
    assert len(parents) == 1 and parents.iloc[0]["status"] == "FINISHED"
    assert len(children) == 4 and children["tags.peftune.trial_id"].is_unique, "a child run was duplicated"
    assert children["tags.peftune.status"].notna().all() and (children["status"] == "FINISHED").all()
    client = mlflow.MlflowClient(tracking_uri)
    for _, run in children.iterrows():
        epochs = steps(client, run["run_id"], "score")
        assert epochs == ([1] if run["tags.peftune.status"] == "early_stopped" else [1, 2]), (
            "an epoch is missing or twice"
        )


def _result_lines(experiment: Path, trial_id: str) -> int:
    (result,) = experiment.glob(f"*_{trial_id}/result.json")
    return len(result.read_text().splitlines())


def test_multi_objective_mode_searches_score_and_size_without_a_scheduler():
    spec = spaces.load_sweep(spaces.resolve_sweep_path("smoke")).with_overrides(multi_objective=True)
    searcher = search.make_searcher(spec)
    assert searcher.metric == ["score", "trainable_params_per_task"] and searcher.mode == ["max", "min"]
    assert search.make_scheduler(spec) is None
    single = spaces.load_sweep(spaces.resolve_sweep_path("smoke"))
    assert type(search.make_scheduler(single)).__name__ == "PerMethodScheduler"


def test_tracking_uri_defaults_to_sqlite_in_the_working_directory(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert stores.resolve_tracking_uri() == f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert stores.resolve_tracking_uri() == "http://127.0.0.1:5000"
    assert stores.resolve_tracking_uri("sqlite:///x.db") == f"sqlite:///{tmp_path / 'x.db'}"
