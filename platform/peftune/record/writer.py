"""Writing the MLflow record of a sweep: the parent run's life (created or resumed, ended; its params, tags,
artifacts, datasets and summary), the trials' writes as the write buffer applies them (:class:`TrialWrites`), and the
report's files.

With ``peftune.record.reader`` the only modules of ``peftune`` and ``analysis`` that import MLflow
(``tests/test_layers.py`` checks it); it imports no Ray, so publishing a report does not either. What a trial's run
holds is decided by the Tune callback (``peftune.record.trial_logger``), in the driver, so trials never touch the
tracking store and an embedded SQLite store has a single writer. The trials' writes go through the durable, ordered
write-ahead buffer of ``peftune.record.tracking_buffer``: a tracking-server outage holds up no trial, every write is
applied exactly once, and writes still pending when the sweep ends are written by the next run of the sweep. The
record's schema: docs/design.md, "The MLflow record"; a contract with ``analysis/``, changed only together with it.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import subprocess
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param
from mlflow.exceptions import MlflowException

import peftune
from peftune.base.errors import UserError
from peftune.base.record_names import (
    BACKBONE,
    BEST_SCORE,
    CHECKPOINT_TAG,
    CODE_VERSION,
    COMPLETED,
    COMPLETED_WITH_FAILURES,
    CONFIRM,
    DATA_FINGERPRINT,
    DEFINITION_FINGERPRINT,
    DIVERGED,
    EARLY_STOPPED,
    ERROR,
    FAILED,
    INTERRUPTED,
    METHOD,
    NOTE_TAG,
    PARENT_TAG,
    RAY_EXPERIMENT_PATH,
    RECORD_VERSION_TAG,
    RETRIES,
    ROLE,
    RUNNING,
    SEARCH,
    SHARED_VIEW_TAG,
    STATUS,
    SWEEP,
    SWEEP_ROLE,
    TASKS_ARTIFACT,
    TRIAL_ID,
    TRIAL_ROLE,
    TRIALS_VIEW_KEY,
    UNFINISHED,
    param_text,
)
from peftune.inputs.tasks import get_task
from peftune.record import legacy
from peftune.record.reader import child_runs, find_experiment_id, find_parent_run, trial_run
from peftune.record.stores import sqlite_path
from peftune.record.tracking_buffer import WriteBuffer
from peftune.record.ui_links import trials_view

log = logging.getLogger("peftune.tracking")

CHECKPOINT_ARTIFACTS = ("trainable.safetensors", "peftune.json")  # the optimizer state stays with Ray
# the experiment's kind: MLflow 3.17's UI takes its view from the link's workflowType instead (ui_links.TRAINING_VIEW);
# the tag keeps the experiment marked as model training for other MLflow versions and clients
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
DIGEST_CHARS = 12  # of a data file's sha256 (data_hashes.json) as its MLflow dataset digest (at most 36 there)
TRAINING, DEV_CONTEXT = "training", "dev"  # the datasets' mlflow.data.context: what a run did with the file
SUMMARY_STATUSES = (COMPLETED, EARLY_STOPPED, DIVERGED, FAILED, UNFINISHED)


def data_inputs(prepared) -> list[dict[str, str]]:
    """Every task's train and dev file as an MLflow dataset: {name (the file's name, as in ``data_hashes.json``),
    digest (its sha256's first :data:`DIGEST_CHARS`), sha256, source (its path), context (training | dev)}."""
    return [
        {"name": Path(split.source).name, "digest": split.sha256[:DIGEST_CHARS], "sha256": split.sha256,
         "source": str(Path(split.source).resolve()), "context": context}
        for task in prepared.tasks.values()
        for split, context in ((task.train, TRAINING), (task.dev, DEV_CONTEXT))
    ]  # fmt: skip


def inputs_of(phase: str, datasets) -> list[dict[str, str]]:
    """What a run of ``phase`` read: a search trial trains on and selects in the train files (the selection
    split is carved from them); a confirmation run also reads dev."""
    return [d for d in datasets if phase == CONFIRM or d["context"] == TRAINING]


def show_trials(client, experiment_id: str) -> None:
    """The experiment's shared view of its trials (ui_links.trials_view), which the printed link opens."""
    view = json.dumps(trials_view(), separators=(",", ":"))
    client.set_experiment_tag(experiment_id, SHARED_VIEW_TAG + TRIALS_VIEW_KEY, view)


@functools.cache
def code_version() -> str:
    """Git commit of the peftune source tree (``-dirty`` with local changes), else the package version."""
    root = Path(peftune.__file__).resolve().parents[2]  # platform/peftune/__init__.py -> the source tree
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        from importlib.metadata import PackageNotFoundError, version

        try:
            return f"peftune {version('peftune')}"
        except PackageNotFoundError:
            return "unknown"


def _client(uri: str):
    return mlflow.MlflowClient(tracking_uri=uri)


def now_ms() -> int:
    return int(time.time() * 1000)


def delete_run(record: SweepRecord, run_id: str) -> None:
    """A trial's run out of the record (a partial one, which its trial replaces by training again in one run)."""
    _client(record.tracking_uri).delete_run(run_id)


def missing_record_error(sweep: str, tracking_uri: str, ray_experiment_path: str) -> str:
    """Tune state without its MLflow record: the one-line refusal, naming both places and the ways out."""
    return (
        f"sweep {sweep!r} has Ray Tune state at {ray_experiment_path} but no record in {tracking_uri}: "
        f"resume it with the --tracking-uri it started with, or start a new sweep with another --name "
        f"or --storage-path"
    )


# ----------------------------------------------------------------------------- the parent run


@dataclass
class SweepRecord:
    """The parent run of a sweep and the facts a resumed sweep is checked against."""

    tracking_uri: str
    experiment_id: str
    parent_run_id: str
    resumed: bool
    datasets: tuple = ()  # the data files as MLflow datasets (data_inputs), logged on the parent and the trials
    # the record's version (peftune.record.legacy): a new sweep writes the current one; a resumed sweep keeps its own,
    # and one begun before the version tag stays an old record (its untagged runs read as such)
    version: int = legacy.RECORD_VERSION


def open_sweep(
    tracking_uri: str,
    definition,
    *,
    data_hashes: dict[str, str],
    ray_experiment_path: str,
    expect_existing: bool,
    skipped_rows: list[dict] | None = None,
    datasets: list[dict[str, str]] | None = None,
    tasks: dict[str, dict] | None = None,
) -> SweepRecord:
    """Create the sweep's parent run, or find it again when the sweep resumes (and check it matches).

    ``expect_existing``: Tune has state for this sweep (it resumes). A parent run without Tune state is
    an error (the trials' state is gone; another name is needed); so is Tune state without a parent run
    (another store: the trials already run would be missing from it; Tune state is only written after
    the parent run is created).
    ``skipped_rows``: the data rows dropped under ``invalid_rows: skip`` ({file, line, reason}); a new
    parent run records their count (param ``skipped_rows``) and the list (``skipped_rows.json``).
    ``datasets``: the data files as MLflow datasets (:func:`data_inputs`), logged on the parent run.
    ``tasks``: each task's declaration, examples' hashes and rows per role (:func:`task_record`, ``tasks.json``).
    Both a new and a resumed sweep (re)write the experiment's view of its trials (:func:`show_trials`). A new parent
    run carries the record's version (``legacy.RECORD_VERSION``); a resumed one keeps what it has, no tag added.
    """
    client = _client(tracking_uri)
    name = definition.name
    experiment_id = find_experiment_id(client, name)
    parent = find_parent_run(client, experiment_id, name) if experiment_id else None
    fingerprints = {
        DEFINITION_FINGERPRINT: definition.fingerprint(),
        DATA_FINGERPRINT: fingerprint_hashes(data_hashes, getattr(definition, "invalid_rows", "raise")),
    }
    if parent is not None:
        _check_resumed(parent, name, fingerprints, expect_existing, tracking_uri, ray_experiment_path)
        version = legacy.record_version(parent.data.tags, parent.info.run_id)
        client.update_run(parent.info.run_id, status="RUNNING")
        client.set_tag(parent.info.run_id, STATUS, RUNNING)
        show_trials(client, experiment_id)
        log_datasets(client, parent.info.run_id, datasets)
        return SweepRecord(tracking_uri, experiment_id, parent.info.run_id, True, tuple(datasets or ()), version)

    if expect_existing:
        raise UserError(missing_record_error(name, tracking_uri, ray_experiment_path))
    if experiment_id is None:
        experiment_id = client.create_experiment(name, artifact_location=_artifact_location(tracking_uri, name))
    client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    show_trials(client, experiment_id)
    tags = {ROLE: SWEEP_ROLE, SWEEP: name, BACKBONE: definition.model, CODE_VERSION: code_version(),
            RECORD_VERSION_TAG: str(legacy.RECORD_VERSION), STATUS: RUNNING, **fingerprints,
            RAY_EXPERIMENT_PATH: ray_experiment_path}  # fmt: skip
    run_id = client.create_run(experiment_id, run_name=name, tags=tags).info.run_id
    params = sweep_params(definition, len(skipped_rows or []))
    client.log_batch(run_id, params=[Param(k, param_text(v)) for k, v in params.items()])
    client.log_text(run_id, definition.to_yaml(), "sweep.yaml")
    client.log_dict(run_id, dict(sorted(data_hashes.items())), "data_hashes.json")
    if tasks:
        client.log_dict(run_id, tasks, TASKS_ARTIFACT)
    if skipped_rows:
        client.log_dict(run_id, list(skipped_rows), "skipped_rows.json")
    log_datasets(client, run_id, datasets)
    return SweepRecord(tracking_uri, experiment_id, run_id, resumed=False, datasets=tuple(datasets or ()))


def _check_resumed(parent, name: str, fingerprints: dict, expect_existing: bool, uri: str, ray_path: str) -> None:
    """A found parent run may be resumed only with Tune's state, the same definition and the same data."""
    if not expect_existing:
        raise UserError(
            f"sweep {name!r} is already recorded in {uri} (parent run {parent.info.run_id}) but Ray has no "
            f"state for it at {ray_path}: pick another sweep name (--name) or point --storage-path at its Ray results"
        )
    tags = parent.data.tags
    if tags.get(DEFINITION_FINGERPRINT) != fingerprints[DEFINITION_FINGERPRINT]:
        raise UserError(
            f"sweep {name!r} was started with another definition (methods, tasks, budget, spaces "
            f"or settings differ): resume it with the same file and budget, or pick another name"
        )
    if tags.get(DATA_FINGERPRINT) != fingerprints[DATA_FINGERPRINT]:
        raise UserError(
            f"the data files differ from those sweep {name!r} started with: resume it on the same "
            f"data, or pick another name"
        )


def task_record(prepared) -> dict[str, dict]:
    """Per task: its declaration as read (class labels resolved, in id order), the hash of its train and dev
    files' examples (the same in every format) and the rows each role got: what a report re-reads a user's task
    from, and what says which data the answer is about."""
    out = {}
    for name, data in prepared.tasks.items():
        splits = {role: getattr(data, role) for role in ("train", "selection", "decision", "dev")}
        out[name] = {
            "declaration": get_task(name).declaration(),
            "examples_sha256": {"train": data.train.examples_sha256, "dev": data.dev.examples_sha256},
            "rows": {role: len(split) for role, split in splits.items() if split is not None},
        }
    return out


def sweep_params(definition, skipped_rows: int) -> dict[str, Any]:
    """The parent run's params: the sweep's search, budget and data settings."""
    budget, search = definition.budget, definition.search
    return {
        "tasks": definition.tasks,
        "methods": definition.methods,
        "num_samples": definition.search_trials,  # Tune's name: the search's trials in all (as before)
        "scheduler": definition.scheduler.type,
        "objective": search.objective,
        "sampler": search.sampler,
        "allocation": search.allocation,
        "budget_unit": search.unit,
        "asynchronous": search.asynchronous,
        "seed": definition.seed,
        "model": definition.model,
        "budget": definition.budget_name,
        "epochs": budget.epochs,
        "batch_size": budget.batch_size,
        "max_length": budget.max_length,
        "max_train_examples": budget.max_train_examples,
        "max_dev_examples": budget.max_dev_examples,
        "selection_examples": budget.selection_examples,
        "decision_examples": budget.decision_examples,
        "decision_margin": definition.confirm.margin,
        "confirm_seeds": definition.confirm.seeds,
        "confirm_max_seeds": definition.confirm.max_seeds,
        "invalid_rows": getattr(definition, "invalid_rows", "raise"),
        "skipped_rows": skipped_rows,
    }


def _artifact_location(uri: str, name: str) -> str | None:
    path = sqlite_path(uri)
    return (path.parent / "mlruns" / name).as_uri() if path is not None else None


def fingerprint_hashes(hashes: dict[str, str], invalid_rows: str = "raise") -> str:
    """The data files' hashes, and the row policy when it drops rows (so a resume cannot change it)."""
    import hashlib

    items = sorted(hashes.items()) + ([["invalid_rows", invalid_rows]] if invalid_rows != "raise" else [])
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def close_sweep(record: SweepRecord, status: str, runs: list | None = None) -> None:
    """``status``: completed, completed_with_failures (FINISHED) | interrupted (KILLED) | failed (FAILED).

    Also logs the summary metrics the runs table shows on the parent run before any click:
    ``sweep_best_score``, ``sweep_trials`` and ``sweep_trials_<status>`` (``unfinished`` for trials
    without a status) over the search trials, and ``sweep_confirm_runs``. ``runs``: the sweep's trial runs as the
    driver knows them (``TrialLogger.runs``), else read from the record (a sweep closed after an error).
    """
    client = _client(record.tracking_uri)
    log_sweep_summary(client, record, runs if runs is not None else _child_runs(record))
    client.set_tag(record.parent_run_id, STATUS, status)
    mlflow_status = {
        COMPLETED: "FINISHED",
        COMPLETED_WITH_FAILURES: "FINISHED",
        INTERRUPTED: "KILLED",
        FAILED: "FAILED",
    }[status]
    client.set_terminated(record.parent_run_id, status=mlflow_status)


def log_method_budgets(record: SweepRecord, runs: list) -> dict[str, dict[str, float]]:
    """The budget each method received in the search, on the parent run.

    Metrics ``budget_trials.<method>``, ``budget_steps.<method>`` (optimizer steps trained, summed over
    its trials), ``budget_tokens.<method>`` (training tokens, summed) and ``budget_compute_s.<method>``
    (training seconds, summed); returned as ``{method: {"trials", "steps", "tokens", "compute_s"}}``. A trial
    stopped at a rung within an epoch counts the steps, tokens and seconds of that rung (its ``fidelity_``
    metrics), not only its last full epoch's. ``runs``: the sweep's trial runs (``TrialLogger.runs``).
    """
    client = _client(record.tracking_uri)
    budgets: dict[str, dict[str, float]] = {}
    for run in runs:
        tags, metrics = run.data.tags, run.data.metrics
        if not tags.get(TRIAL_ID) or legacy.run_phase(tags, record.version, run.info.run_id) != SEARCH:
            continue
        empty = {"trials": 0, "steps": 0.0, "tokens": 0.0, "compute_s": 0.0}
        budget = budgets.setdefault(tags.get(METHOD, ""), empty)
        budget["trials"] += 1
        budget["steps"] += max(metrics.get("steps", 0.0), metrics.get("fidelity_steps", 0.0))
        budget["tokens"] += max(metrics.get("tokens_seen", 0.0), metrics.get("fidelity_tokens_seen", 0.0))
        budget["compute_s"] += max(metrics.get("train_time_s", 0.0), metrics.get("fidelity_train_time_s", 0.0))
    now = now_ms()
    client.log_batch(
        record.parent_run_id,
        metrics=[
            Metric(f"budget_{key}.{method}", float(value), now, 0)
            for method, budget in budgets.items()
            for key, value in budget.items()
        ],
    )
    return budgets


def log_sweep_summary(client, record: SweepRecord, runs: list) -> None:
    runs = trial_records(runs, record.version)
    trials = [run for run in runs if run.phase == SEARCH]  # confirmation runs re-train, they are not trials
    counts = Counter(trial.status or UNFINISHED for trial in trials)
    values = {f"sweep_trials_{status}": float(counts.get(status, 0)) for status in SUMMARY_STATUSES}
    values["sweep_trials"] = float(len(trials))
    values["sweep_confirm_runs"] = float(len(runs) - len(trials))
    scores = [t.best_score for t in trials if t.best_score is not None]
    if scores:
        values["sweep_best_score"] = max(scores)
    now = int(time.time() * 1000)
    client.log_batch(record.parent_run_id, metrics=[Metric(k, v, now, 0) for k, v in sorted(values.items())])


@dataclass
class TrialRecord:
    trial_id: str
    run_id: str
    method: str
    status: str | None  # completed | early_stopped | failed | None (running or interrupted)
    best_score: float | None
    params: dict = field(default_factory=dict)
    phase: str = SEARCH  # search | confirm (the peftune.phase tag: legacy.run_phase)


def _child_runs(record: SweepRecord) -> list:
    return child_runs(_client(record.tracking_uri), record.experiment_id, record.parent_run_id)


def trial_records(runs: list, version: int) -> list[TrialRecord]:
    """The sweep's trial runs (MLflow ``Run`` entities: ``TrialLogger.runs``, or the record's, of ``version``) as
    ``TrialRecord``."""
    out = []
    for run in runs:
        tags = run.data.tags
        out.append(
            TrialRecord(
                tags.get(TRIAL_ID, ""),
                run.info.run_id,
                run.data.params.get("method", ""),
                tags.get(STATUS),
                run.data.metrics.get(BEST_SCORE),
                dict(run.data.params),
                legacy.run_phase(tags, version, run.info.run_id),
            )
        )
    return out


def log_best_checkpoints(
    record: SweepRecord, runs: list, checkpoints: dict[str, tuple[float, object]], per_method: int
) -> list:
    """Log the checkpoint of the best ``per_method`` trials of each method under ``checkpoint/``.

    ``checkpoints``: Ray trial id -> (best score, ``tune.Checkpoint`` of that epoch). Returns the
    trial ids whose checkpoint the record holds.
    """
    if per_method <= 0:
        return []
    client = _client(record.tracking_uri)
    by_method: dict[str, list[TrialRecord]] = {}
    for trial in trial_records(runs, record.version):
        if trial.trial_id in checkpoints:
            by_method.setdefault(trial.method, []).append(trial)
    logged = []
    for trials in by_method.values():
        trials.sort(key=lambda t: checkpoints[t.trial_id][0], reverse=True)
        for trial in trials[:per_method]:
            if client.list_artifacts(trial.run_id, "checkpoint"):
                logged.append(trial.trial_id)  # logged by an earlier run of this sweep
                continue
            with checkpoints[trial.trial_id][1].as_directory() as directory:
                for name in CHECKPOINT_ARTIFACTS:
                    if (Path(directory) / name).is_file():
                        client.log_artifact(trial.run_id, str(Path(directory) / name), "checkpoint")
            client.set_tag(trial.run_id, CHECKPOINT_TAG, "checkpoint/")
            logged.append(trial.trial_id)
    return logged


def log_dev_sizes(record: SweepRecord, prepared, seed: int) -> None:
    """Parent metrics ``train_examples.<task>`` (the search's train rows), ``selection_examples.<task>``,
    ``decision_examples.<task>`` and ``dev_examples.<task>`` (the rows each role got: the report gives them, and its
    noise rule needs dev's) and ``selection_seed`` (the seed that carved the selection split)."""
    now = now_ms()
    metrics = [Metric("selection_seed", seed, now, 0)]
    for task, data in prepared.tasks.items():
        metrics.append(Metric(f"train_examples.{task}", len(data.train), now, 0))
        metrics.append(Metric(f"dev_examples.{task}", len(data.dev), now, 0))
        if data.selection is not None:
            metrics.append(Metric(f"selection_examples.{task}", len(data.selection), now, 0))
        if data.decision is not None:
            metrics.append(Metric(f"decision_examples.{task}", len(data.decision), now, 0))
    _client(record.tracking_uri).log_batch(record.parent_run_id, metrics=metrics)


def log_report_files(
    tracking_uri: str, run_id: str, directory: str | Path, artifact_path: str, *, note: str | None = None,
    metrics: dict[str, float] | None = None,
) -> None:  # fmt: skip
    """A report's files (``directory``) as the parent run's artifacts under ``artifact_path``; with ``note``, the
    run's description in the UI; with ``metrics``, parent-run metrics (the finite ones) the runs table shows."""
    client = _client(tracking_uri)
    client.log_artifacts(run_id, str(directory), artifact_path=artifact_path)
    if note is not None:
        client.set_tag(run_id, NOTE_TAG, note)
    if metrics:
        now = now_ms()
        client.log_batch(run_id, metrics=[Metric(k, v, now, 0) for k, v in metrics.items() if math.isfinite(v)])


# ----------------------------------------------------------------------------- the trials' writes


class TrialWrites(WriteBuffer):
    """The trials' writes to MLflow, as the write buffer applies them (``peftune.record.tracking_buffer``), each
    idempotent: a trial's run is found by its Ray trial id before one is created (the buffer's one read), metrics carry
    the timestamp of their first sending, params and tags are set to the same values."""

    def __init__(self, record, path: Path | str | None):
        self._runs: dict[str, str] = {}  # trial id -> run id, found or created by this buffer
        self._started: dict[str, int] = {}  # trial id -> its run's start time (ms), as the server set it
        self._client = None
        super().__init__(record, path)

    @property
    def client(self):
        if self._client is None:
            self._client = _client(self.record.tracking_uri)
        return self._client

    def created(self, trial_id: str) -> tuple[str, int] | None:
        """The run id and start time (ms) of the trial's run, once this buffer created or found it."""
        run_id = self._runs.get(trial_id)
        return (run_id, self._started.get(trial_id, 0)) if run_id is not None else None

    def known_run_id(self, trial_id: str) -> str | None:
        """The trial's run id if this buffer has created or found its run already (no call to the store)."""
        return self._runs.get(trial_id)

    def run_id(self, trial_id: str) -> str | None:
        """The trial's run id: created or found by this buffer, else found in the record (None: not created yet)."""
        if trial_id not in self._runs:
            run = trial_run(self.client, self.record.experiment_id, self.record.parent_run_id, trial_id)
            if run is not None:
                self._runs[trial_id] = run.info.run_id
                self._started[trial_id] = run.info.start_time
        return self._runs.get(trial_id)

    def _op_trial_run(
        self, trial_id: str, run_name: str, method: str, sweep: str, params: dict, tags: dict | None = None,
        datasets: list | None = None,
    ) -> None:  # fmt: skip
        """Create the trial's run (found again by trial id), its params and ``datasets`` (:func:`data_inputs`)."""
        run_id = self.run_id(trial_id)
        if run_id is None:
            base = {PARENT_TAG: self.record.parent_run_id, ROLE: TRIAL_ROLE, SWEEP: sweep, TRIAL_ID: trial_id}
            run = self.client.create_run(
                self.record.experiment_id, run_name=run_name, tags={**base, METHOD: method, **(tags or {})}
            )
            run_id = self._runs[trial_id] = run.info.run_id
            self._started[trial_id] = run.info.start_time
        self.client.log_batch(run_id, params=[Param(k, v) for k, v in params.items()])
        log_datasets(self.client, run_id, datasets)

    def _op_metrics(self, trial_id: str, metrics: list) -> None:
        self.client.log_batch(self._need(trial_id), metrics=[Metric(*m) for m in metrics])

    def _op_tags(self, trial_id: str, tags: dict) -> None:
        run_id = self._need(trial_id)
        for key, value in tags.items():
            self.client.set_tag(run_id, key, value)

    def _op_delete_tags(self, trial_id: str, keys: list) -> None:
        run_id = self._need(trial_id)
        for key in keys:
            try:
                self.client.delete_tag(run_id, key)
            except MlflowException as error:  # the run has no such tag (never set, or deleted by an earlier try)
                if error.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise

    def _op_run_status(self, trial_id: str, status: str) -> None:
        run_id = self._need(trial_id)
        if status == "RUNNING":
            self.client.update_run(run_id, status="RUNNING")
        else:
            self.client.set_terminated(run_id, status=status)

    def _op_finish(
        self, trial_id: str, status: str, error: str | None, retries: int, best: list | None = None,
        task_metrics: list | None = None,
    ) -> None:  # fmt: skip
        """The trial's end: its ``best`` metrics (best_epoch, best_<metric>, as the driver kept them), its status,
        error and retries. ``task_metrics``: an operation queued by a peftune that read the best epoch back from the
        record here; now ignored (without best_* the analysis finds the best epoch in the run's history)."""
        run_id = self._need(trial_id)
        if best:
            self.client.log_batch(run_id, metrics=[Metric(*m) for m in best])
        tags = {STATUS: status, **({ERROR: error} if error is not None else {})}
        if retries > 0:
            tags[RETRIES] = str(retries)
        for key, value in tags.items():
            self.client.set_tag(run_id, key, value)
        self.client.set_terminated(run_id, status="FAILED" if status == FAILED else "FINISHED")

    def _op_artifact(self, trial_id: str, path: str, text: str) -> None:
        """A text file as the run's artifact ``path`` (gzip-compressed when it ends in ``.gz``); replaces it."""
        import gzip
        import tempfile

        run_id = self._need(trial_id)
        directory, name = os.path.split(path)
        with tempfile.TemporaryDirectory(prefix="peftune-artifact-") as tmp:
            local = Path(tmp) / name
            data = text.encode()
            local.write_bytes(gzip.compress(data, mtime=0) if name.endswith(".gz") else data)
            self.client.log_artifact(run_id, str(local), artifact_path=directory or None)

    def _need(self, trial_id: str) -> str:
        run_id = self.run_id(trial_id)
        if run_id is None:  # its trial_run operation comes first in the order: this is not an outage
            raise LookupError(f"no MLflow run for trial {trial_id} under parent run {self.record.parent_run_id}")
        return run_id


def log_datasets(client, run_id: str, datasets) -> None:
    """``datasets`` (:func:`data_inputs`) as the run's MLflow dataset inputs (the UI's Dataset column
    and filter); logging one again changes nothing (MLflow keeps one input per dataset name and digest)."""
    if not datasets:
        return
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset

    inputs = []
    for item in datasets:
        with warnings.catch_warnings():  # MLflow registers its local-file source twice ("" and file:): either fits
            warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted")
            source = resolve_dataset_source(item["source"])
        meta = MetaDataset(source, name=item["name"], digest=item["digest"]).to_dict()
        entity = Dataset(meta["name"], meta["digest"], meta["source_type"], meta["source"],
                         profile=json.dumps({"sha256": item["sha256"]}))  # fmt: skip
        inputs.append(DatasetInput(entity, tags=[InputTag("mlflow.data.context", item["context"])]))
    client.log_inputs(run_id, datasets=inputs)
