"""MLflow record of a sweep: one parent run per sweep, one child run per trial, logged from the driver.

Logging runs in the Tune driver (:class:`TrialLogger`, a ``tune.Callback``), so trials never touch the tracking
store and an embedded SQLite store has a single writer. Its writes go through the durable, ordered write-ahead
buffer of ``peftune.tracking_buffer``: a tracking-server outage holds up no trial, every write is applied exactly
once, and writes still pending when the sweep ends are written by the next run of the sweep.

Tracking URI: ``--tracking-uri``, else ``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db`` in the working
directory. The record's schema (the experiment, the parent run, the child runs: their tags, params, metrics,
datasets and artifacts, and how a resume continues them) is documented in docs/design.md, "The MLflow record".
It is a contract with ``analysis/``; change it, and that page, only together with it.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import mlflow
from mlflow.entities import Metric, Param
from ray import tune

from peftune import trial_spec
from peftune.errors import DiskFullError, UserError
from peftune.methods.sizes import size_label
from peftune.record import (
    BACKBONE,
    BEST_SCORE,
    CARRIED_FROM,
    CHECKPOINT_TAG,
    CODE_VERSION,
    COMPLETED,
    COMPLETED_WITH_FAILURES,
    CONFIG_KEY,
    CONFIRM,
    COUNT_METRICS,
    DATA_FINGERPRINT,
    DECISION,
    DEFAULT,
    DEFINITION_FINGERPRINT,
    DIVERGED,
    EARLY_STOPPED,
    EPOCH,
    ERROR,
    FAILED,
    HYPERPARAMETERS,
    INTERRUPTED,
    METHOD,
    PACK_SIZE,
    PACK_SIZE_RESULT,
    PARENT_TAG,
    PARTIAL,
    PHASE,
    PRECISION,
    RAY_EXPERIMENT_PATH,
    RETRIES,
    ROLE,
    RUNNING,
    SCORE,
    SEARCH,
    SHARED_VIEW_TAG,
    SIZE_TAG,
    STATUS,
    SWEEP,
    SWEEP_ROLE,
    TASKS_ARTIFACT,
    TRAIN_COMMAND,
    TRAINABLE_PER_TASK,
    TRIAL_ID,
    TRIALS_VIEW_KEY,
    UNFINISHED,
    config_key,
    improves,
    param_text,
    predictions_artifact,
    predictions_csv,
    run_label,
    run_phase,
    sqlite_path,
    trials_address,
    trials_view,
    ui_base,
)
from peftune.sweep_state import SweepState
from peftune.tasks import get_task
from peftune.tracking_buffer import log_datasets

log = logging.getLogger("peftune.tracking")

EPOCH_METRICS = (
    *(SCORE, "train_loss", "epoch_time_s", "tokens_per_s", "train_time_s"),
    *("steps", "examples_seen", "tokens_seen", "progress"),  # the fidelity: steps, examples, tokens, fraction
    # where a trial's time goes besides training, and what packing trials onto a GPU must leave room for
    *("startup_s", "eval_time_s", "eval_total_s", "checkpoint_time_s", "peak_gpu_memory_mb"),
    *("granted_cpu", "granted_gpu"),  # what Ray gave the trial: the sweep's resources, as scheduled
)
# a report within an epoch (a data-fidelity rung), logged at step = examples seen: fidelity_score, ...
PARTIAL_METRICS = (SCORE, "steps", "tokens_seen", "progress", "train_time_s", "eval_total_s", "startup_s")
CHECKPOINT_ARTIFACTS = ("trainable.safetensors", "peftune.json")  # the optimizer state stays with Ray
MAX_TAG_CHARS = 5000
# the experiment's kind: MLflow 3.17's UI takes its view from the link's workflowType instead (record.TRAINING_VIEW);
# the tag keeps the experiment marked as model training for other MLflow versions and clients
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
DIGEST_CHARS = 12  # of a data file's sha256 (data_hashes.json) as its MLflow dataset digest (at most 36 there)
TRAINING, DEV_CONTEXT = "training", "dev"  # the datasets' mlflow.data.context: what a run did with the file
SUMMARY_STATUSES = (COMPLETED, EARLY_STOPPED, DIVERGED, FAILED, UNFINISHED)


def ui_hint(uri: str, experiment_id: str | None = None) -> tuple[str, str | None]:
    """(address of the sweep's trials in the runs table, command that serves it or None) for a tracking URI."""
    base, command = ui_base(uri)
    return (trials_address(uri, experiment_id) if experiment_id else f"{base}/"), command


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
    """The experiment's shared view of its trials (record.trials_view), which the printed link opens."""
    view = json.dumps(trials_view(), separators=(",", ":"))
    client.set_experiment_tag(experiment_id, SHARED_VIEW_TAG + TRIALS_VIEW_KEY, view)


@functools.cache
def code_version() -> str:
    """Git commit of the peftune source tree (``-dirty`` with local changes), else the package version."""
    root = Path(__file__).resolve().parents[2]
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


def _now_ms() -> int:
    return int(time.time() * 1000)


def find_experiment_id(client, name: str) -> str | None:
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        return None
    if experiment.lifecycle_stage == "deleted":
        raise UserError(
            f"MLflow experiment {name!r} is deleted in this store: restore it "
            f"(mlflow experiments restore) or pick another sweep name"
        )
    return experiment.experiment_id


def find_parent_run(client, experiment_id: str, sweep: str):
    runs = client.search_runs(
        [experiment_id], filter_string=f"tags.`{ROLE}` = '{SWEEP_ROLE}' and tags.`{SWEEP}` = '{sweep}'", max_results=2
    )
    if len(runs) > 1:
        raise UserError(f"MLflow experiment {sweep!r} holds more than one parent run; expected one per sweep")
    return runs[0] if runs else None


def has_parent_run(tracking_uri: str, sweep: str) -> bool:
    """Whether the store records sweep ``sweep``; a SQLite file that does not exist is not created."""
    path = sqlite_path(tracking_uri)
    if path is not None and not path.is_file():
        return False
    client = _client(tracking_uri)
    experiment = client.get_experiment_by_name(sweep)
    return experiment is not None and find_parent_run(client, experiment.experiment_id, sweep) is not None


def missing_record_error(sweep: str, tracking_uri: str, ray_experiment_path: str) -> str:
    """Tune state without its MLflow record: the one-line refusal, naming both places and the ways out."""
    return (
        f"sweep {sweep!r} has Ray Tune state at {ray_experiment_path} but no record in {tracking_uri}: "
        f"resume it with the --tracking-uri it started with, or start a new sweep with another --name "
        f"or --storage-path"
    )


def child_runs(client, experiment_id: str, parent_run_id: str) -> list:
    runs, token = [], None
    while True:
        page = client.search_runs(
            [experiment_id],
            filter_string=f"tags.`{PARENT_TAG}` = '{parent_run_id}'",
            max_results=1000,
            page_token=token,
        )
        runs.extend(page)
        token = page.token
        if not token:
            return runs


# ----------------------------------------------------------------------------- the parent run


@dataclass
class SweepRecord:
    """The parent run of a sweep and the facts a resumed sweep is checked against."""

    tracking_uri: str
    experiment_id: str
    parent_run_id: str
    resumed: bool
    datasets: tuple = ()  # the data files as MLflow datasets (data_inputs), logged on the parent and the trials


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
    Both a new and a resumed sweep (re)write the experiment's view of its trials (:func:`show_trials`).
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
        client.update_run(parent.info.run_id, status="RUNNING")
        client.set_tag(parent.info.run_id, STATUS, RUNNING)
        show_trials(client, experiment_id)
        log_datasets(client, parent.info.run_id, datasets)
        return SweepRecord(tracking_uri, experiment_id, parent.info.run_id, True, tuple(datasets or ()))

    if expect_existing:
        raise UserError(missing_record_error(name, tracking_uri, ray_experiment_path))
    if experiment_id is None:
        experiment_id = client.create_experiment(name, artifact_location=_artifact_location(tracking_uri, name))
    client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    show_trials(client, experiment_id)
    tags = {ROLE: SWEEP_ROLE, SWEEP: name, BACKBONE: definition.model, CODE_VERSION: code_version(),
            STATUS: RUNNING, **fingerprints, RAY_EXPERIMENT_PATH: ray_experiment_path}  # fmt: skip
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


def search_tags(config: dict, method: str, sampled: dict) -> dict[str, str]:
    """``peftune.phase``, ``peftune.default``, ``peftune.config_key`` from the ``"peftune"`` marks of a trial's config.

    A trial without marks (the joint search) is a search trial, not a default, keyed by its method and params.
    """
    marks = config.get("peftune") or {}
    tags = {
        PHASE: str(marks.get("phase", SEARCH)),
        DEFAULT: "true" if marks.get("default") else "false",
        CONFIG_KEY: str(marks.get("config_key") or config_key(method, sampled)),
    }
    if marks.get("carried_from"):  # a carried trial (peftune.carry): the configuration it carries down
        tags[CARRIED_FROM] = str(marks["carried_from"])
    return tags


@dataclass(frozen=True)
class RecordedResults:
    """The per-epoch results of the sweep's search trials, as the driver running it holds them: a restored scheduler
    refills its rungs from them. Pickled with the scheduler in Tune's state, so it holds only the record it names;
    the running driver's ``TrialLogger`` of that record answers (it reads an earlier driver's record once)."""

    record: SweepRecord

    def results(self) -> dict[str, tuple[str, list[dict]]]:
        """Ray trial id -> (method, [{"epoch" or "progress", "score", "steps"}, ...] in the order they were reported)
        (``SweepState.rung_results``)."""
        logger = TrialLogger.driving.get(self.record.parent_run_id)
        if logger is None:
            raise RuntimeError(f"no trial logger of sweep run {self.record.parent_run_id} in this process")
        return logger.rung_results()


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
        if not tags.get(TRIAL_ID) or run_phase(tags) != SEARCH:
            continue
        empty = {"trials": 0, "steps": 0.0, "tokens": 0.0, "compute_s": 0.0}
        budget = budgets.setdefault(tags.get(METHOD, ""), empty)
        budget["trials"] += 1
        budget["steps"] += max(metrics.get("steps", 0.0), metrics.get("fidelity_steps", 0.0))
        budget["tokens"] += max(metrics.get("tokens_seen", 0.0), metrics.get("fidelity_tokens_seen", 0.0))
        budget["compute_s"] += max(metrics.get("train_time_s", 0.0), metrics.get("fidelity_train_time_s", 0.0))
    now = _now_ms()
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
    runs = trial_records(runs)
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
    phase: str = SEARCH  # search | confirm (the peftune.phase tag; untagged runs are search trials)


def _child_runs(record: SweepRecord) -> list:
    return child_runs(_client(record.tracking_uri), record.experiment_id, record.parent_run_id)


def trial_records(runs: list) -> list[TrialRecord]:
    """The sweep's trial runs (MLflow ``Run`` entities: ``TrialLogger.runs``, or the record's) as ``TrialRecord``."""
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
                run_phase(tags),
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
    for trial in trial_records(runs):
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


# ----------------------------------------------------------------------------- the Tune callback


def error_text(raw: str | None) -> str:
    """Ray's error file -> the last failure: its exception line first, then the end of its traceback."""
    if not raw:
        return "unknown error (Ray recorded no error text)"
    last = raw.split("Failure # ")[-1]
    lines = [line for line in last.splitlines() if line.strip()]
    if lines and lines[0][:1].isdigit() and "occurred at" in lines[0]:
        lines = lines[1:]
    summary = next((line.strip() for line in reversed(lines) if not line.startswith((" ", "\t"))), "")
    body = "\n".join(lines)
    room = MAX_TAG_CHARS - len(summary) - 2
    return f"{summary}\n\n{body[-room:]}" if summary else body[-MAX_TAG_CHARS:]


@dataclass
class ConfirmedPair:
    """A confirmation trial's outcome as the driver saw it end: its final status and, completed, the decision
    split's predictions of its kept epoch (the text of its ``predictions/decision.csv.gz``)."""

    status: str
    decision: str | None = None


class TrialLogger(tune.Callback):
    """Logs each trial as a child run of the sweep's parent run (see the module docstring).

    ``settings`` (``peftune.worker.TrialSettings``) turns a trial's sampled config into its
    ``TrainConfig``, as the trainable does, so the params logged are exactly what the trial trains.
    The writes go through a durable write-ahead buffer (``peftune.tracking_buffer``, kept at
    ``pending_path``) drained by a background thread: a tracking-server outage never holds up a trial.
    The record an earlier driver left is read once per driver (``load``): at the first Tune experiment's start,
    or at a restored scheduler's refill (``rung_results``) when that comes first.
    """

    # parent run id -> the logger that writes that sweep's record in this process (the last one made): what a
    # scheduler restored from Tune's state finds it through (``RecordedResults``)
    driving: ClassVar[dict[str, TrialLogger]] = {}

    def __init__(
        self,
        record: SweepRecord,
        settings,
        task_metrics: list[str],
        pending_path: str | Path | None = None,
        examples: dict[str, dict[str, tuple[list[int], list[float]]]] | None = None,
    ):
        self.record = record
        self.settings = settings
        self.task_metrics = list(task_metrics)
        self.pending_path = pending_path
        # per split (decision, dev), per task: (example ids, labels), in the order of a trial's predictions
        self.examples = examples or {}
        self.buffer = None
        # (config key, seed) -> how each confirmation trial of this driver ended: what the confirmation decides on
        # between its rounds, instead of reading back the record it wrote (kept across Tune experiments)
        self.confirmed: dict[tuple[str, int], ConfirmedPair] = {}
        self._reset()
        TrialLogger.driving[record.parent_run_id] = self  # not an unpickled copy (__setstate__)

    def _reset(self):
        self._client = None
        self._loaded = False  # the record an earlier driver left is read (load)
        self._last_epoch: dict[str, int] = {}  # trial id -> last epoch logged
        self._counted: set[str] = set()  # trial ids whose parameter counts are logged
        self._partials: dict[str, set[int]] = {}  # trial id -> examples_seen of the rungs logged within epochs
        self._unfinished: dict[str, tuple[str, str]] = {}  # config key -> (trial id, run id) of unfinished runs
        self._predicted: dict[str, float] = {}  # trial id -> score of the epoch whose predictions are logged
        self._decision: dict[str, str] = {}  # trial id -> those predictions on the decision split (CSV text)
        self._full: DiskFullError | None = None  # a trial's write refused for space: the sweep stops on it
        # every trial run as the record holds it once the buffer drains: what the sweep decides on (SweepState)
        self.state = SweepState(self.record.parent_run_id, self.record.experiment_id)

    def __getstate__(self):  # Ray pickles callbacks with the experiment; the client is rebuilt in setup()
        return {
            "record": self.record,
            "settings": self.settings,
            "task_metrics": self.task_metrics,
            "pending_path": self.pending_path,
            "examples": self.examples,
        }

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.buffer = None
        self.confirmed = {}
        self._reset()

    def open_buffer(self, timeout: float = 600.0) -> None:
        """Start the write buffer, first writing what an earlier run of the sweep left pending."""
        if self.buffer is not None:
            return
        from peftune.tracking_buffer import WriteBuffer

        self.buffer = WriteBuffer(self.record, self.pending_path)
        if not self.buffer.flush(timeout):
            if self.buffer.full is not None:
                raise self.buffer.full
            raise RuntimeError(
                f"{self.buffer.pending()} MLflow write(s) left by an earlier run could not be written to "
                f"{self.record.tracking_uri} in {timeout:.0f}s; they stay in {self.pending_path}"
            )

    def flush(self, timeout: float) -> bool:
        """Wait, at most ``timeout`` s, for every queued write to reach MLflow; False if some are still pending."""
        return self.buffer is None or self.buffer.flush(timeout)

    def known_run_id(self, trial_id: str) -> str | None:
        """The trial's MLflow run id when this driver knows it already (from memory: no call to the store)."""
        run = self.state.trials.get(trial_id)
        known = run.run_id if run is not None else None
        return known or (self.buffer.known_run_id(trial_id) if self.buffer is not None else None)

    def _write(self, op: str, **args) -> None:
        """One write of the record: queued in the buffer, and applied to the driver's state at once."""
        self.open_buffer()
        self.buffer.put(op, **args)
        self.state.apply(op, args)

    def runs(self) -> list:
        """The sweep's trial runs as MLflow ``Run`` entities, from the driver's state (``SweepState``): what the
        record holds once every write queued reached it (flush first), without reading it back."""
        return self.state.runs(self.buffer.created if self.buffer is not None else lambda trial_id: None)

    def forget(self, run_id: str) -> None:
        """A run deleted from the record (the confirmation replaces a partial run): out of the state, and no write
        goes to it again (closing the open runs at an experiment's end)."""
        for trial_id in self.state.forget(run_id):
            self._counted.discard(trial_id)
            for kept in (self._last_epoch, self._partials, self._predicted, self._decision):
                kept.pop(trial_id, None)

    @property
    def client(self):
        if self._client is None:
            self._client = _client(self.record.tracking_uri)
        return self._client

    def setup(self, **info):
        """A Tune experiment starts: the record an earlier driver left is read, if it was not yet."""
        self.load()

    def load(self) -> None:
        """Find the child runs of a resumed sweep, so no trial gets a second run: the record read once per driver
        (every write after goes to it and to the state); a fresh sweep's has none."""
        if self._loaded:
            return
        self.open_buffer()  # first the writes an earlier run left pending
        self._loaded = True
        runs = child_runs(self.client, self.record.experiment_id, self.record.parent_run_id)
        self.state = SweepState.from_runs(runs, self.record.parent_run_id, self.record.experiment_id)
        for run in runs:
            trial_id = run.data.tags.get(TRIAL_ID)
            if not trial_id:
                continue
            searched = run_phase(run.data.tags) == SEARCH  # confirmation has its own resume
            if searched and not run.data.tags.get(STATUS) and run.data.tags.get(CONFIG_KEY):
                self._unfinished[run.data.tags[CONFIG_KEY]] = (trial_id, run.info.run_id)
            if TRAINABLE_PER_TASK in run.data.metrics:
                self._counted.add(trial_id)
            if run.data.tags.get(STATUS) not in (None, FAILED):
                continue  # ended: what it reports again is not logged (on_trial_result), so no history is read
            if SCORE in run.data.metrics:  # the last epoch logged and the best so far of the run a trial continues
                histories = {key: self._history(run.info.run_id, key) for key in (SCORE, *self.task_metrics)}
                self._last_epoch[trial_id] = max(histories[SCORE])
                self.state.start_best(trial_id, histories)
            if "fidelity_score" in run.data.metrics:
                self._partials[trial_id] = set(self._history(run.info.run_id, "fidelity_score"))

    def _status(self, trial_id: str) -> str | None:
        """The trial's final ``peftune.status`` (its run is closed), None while it has none (or no run yet)."""
        run = self.state.trials.get(trial_id)
        return run.tags.get(STATUS) if run is not None else None

    def _history(self, run_id: str, key: str) -> dict[int, float]:
        """A metric's values by step of a run an earlier driver left: read from the record once (``SweepState``)."""
        return self.state.history(run_id, key, self._read_history)

    def _read_history(self, run_id: str, key: str) -> dict[int, float]:
        return {int(m.step): m.value for m in self.client.get_metric_history(run_id, key)}

    def rung_results(self) -> dict[str, tuple[str, list[dict]]]:
        """Every search trial's results by rung (``SweepState.rung_results``): what a restored scheduler refills
        from. Tune restores the scheduler before it starts the experiment's callbacks, so this may read first."""
        self.load()
        return self.state.rung_results(self._read_history)

    # -- run lifecycle

    def _run_for(self, trial) -> None:
        """Queue the creation of the trial's child run (found again by trial id if it exists)."""
        trial_id = trial.trial_id
        if trial_id in self.state.trials:
            return
        method, sampled = self.settings.split(trial.config)
        settings = self.settings.for_trial(trial.config)  # a confirmation trial's own seed and phase
        try:
            spec = settings.trial_spec(method, sampled)
        except (ValueError, TypeError, KeyError) as error:
            # the trial will fail on the same error and be recorded so; the sweep must go on
            log.warning("trial config %s %s is invalid: %s", method, sampled, error)
            spec = None
        params = spec.params() if spec is not None else invalid_params(settings, method, sampled)
        # a confirmation trial's seed and origin; every trial's phase, default mark and config key; its size
        tags = {**trial_tags(trial.config), **search_tags(trial.config, method, sampled)}
        rerunnable = spec is not None and bool(spec.data.data_dir)  # a command and a file that re-run it
        if rerunnable:
            tags[TRAIN_COMMAND] = spec.command()
        tags[SIZE_TAG] = size_label(method, params)
        phase = tags[PHASE]
        name = run_label(method, tags[SIZE_TAG], phase, params["seed"], default=tags[DEFAULT] == "true")
        self._write(
            "trial_run", trial_id=trial_id, run_name=name, method=method, sweep=self.settings.sweep,
            params={k: param_text(v) for k, v in params.items()}, tags=tags,
            datasets=inputs_of(phase, self.record.datasets),
        )  # fmt: skip
        if rerunnable:  # the trial's specification, which `peftune train --spec` re-runs
            self._write("artifact", trial_id=trial_id, path=trial_spec.ARTIFACT, text=spec.to_json())

    def _adopt(self, trial, known: set[str]) -> None:
        """Continue the child run of the same configuration whose Ray trial Tune no longer knows.

        A driver killed after a trial started but before Tune saved its state leaves that trial's
        child run behind; the searcher hands the same configuration out again under a new Ray trial
        id, and its record continues that run (retagged) instead of a second one.
        """
        method, sampled = self.settings.split(trial.config)
        key = search_tags(trial.config, method, sampled)[CONFIG_KEY]
        old_id, run_id = self._unfinished.get(key, (None, None))
        if run_id is None or old_id in known or old_id == trial.trial_id:
            return
        del self._unfinished[key]
        self._write("tags", trial_id=old_id, tags={TRIAL_ID: trial.trial_id})  # the run is found by trial id
        for logged in (self._last_epoch, self._partials):
            if old_id in logged:
                logged[trial.trial_id] = logged.pop(old_id)
        if old_id in self._counted:
            self._counted.add(trial.trial_id)
        log.info("trial %s continues the child run of trial %s (the same configuration)", trial.trial_id, old_id)

    def on_trial_start(self, iteration, trials, trial, **info):
        if trial.trial_id not in self.state.trials:
            self._adopt(trial, {t.trial_id for t in trials})
        existed = trial.trial_id in self.state.trials
        self._run_for(trial)
        if self._status(trial.trial_id) == FAILED:  # Tuner.restore(resume_errored=True) gives it another chance
            self._write("delete_tags", trial_id=trial.trial_id, keys=[STATUS, ERROR])
        if existed and self._status(trial.trial_id) is None:  # an interrupted (or retried) trial goes on
            self._write("run_status", trial_id=trial.trial_id, status="RUNNING")

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self._run_for(trial)
        if self._status(trial.trial_id) is not None:
            return  # its run is closed (a driver stopped before Tune saved that the trial ended re-runs its end)
        if result.get(DIVERGED):
            return  # the final result of a diverged trial carries no epoch's metrics; on_trial_complete records it
        packed = result.get(PACK_SIZE_RESULT)
        if packed is not None and PACK_SIZE not in self.state.trials[trial.trial_id].tags:  # trained in a pack
            self._write("tags", trial_id=trial.trial_id, tags={PACK_SIZE: str(int(packed))})
        if result.get(PARTIAL):
            self._log_partial(trial.trial_id, result)
            return
        epoch = int(result[EPOCH])
        if epoch <= self._last_epoch.get(trial.trial_id, 0):
            return  # logged before the sweep was interrupted; the resumed trial re-ran this epoch
        now = _now_ms()  # sent with the metrics, so a re-sent batch is identical and MLflow keeps one copy
        keys = [*self.task_metrics, *EPOCH_METRICS]
        metrics = [(k, float(result[k]), now, epoch) for k in keys if _finite(result.get(k))]
        if trial.trial_id not in self._counted:
            metrics += [(k, float(result[k]), now, 0) for k in COUNT_METRICS if k in result]
            if "precision" in result:  # what the trial computed in: bf16 autocast or fp32
                self._write("tags", trial_id=trial.trial_id, tags={PRECISION: str(result["precision"])})
            self._counted.add(trial.trial_id)
        self._write("metrics", trial_id=trial.trial_id, metrics=metrics)
        self._last_epoch[trial.trial_id] = epoch
        if "predictions" in result:
            self._log_predictions(trial, result)
        shown = " ".join(f"{k} {result[k]:.4f}" for k in self.task_metrics if k in result)
        log.debug(  # the console's line per finished trial is ``console.Progress``'s; this one with --verbose
            "trial %s (%s) epoch %d/%d: %s score %.4f, %.0fs",
            trial.trial_id,
            trial.config.get("method"),
            epoch,
            self.settings.epochs,
            shown,
            result.get(SCORE, float("nan")),
            result.get("epoch_time_s", 0),
        )

    def _log_predictions(self, trial, result: dict) -> None:
        """The dev predictions of the trial's best epoch so far (by ``score``, the earliest on a tie, as
        ``best_*``), one artifact per split (``predictions_artifact``): what the decisions and the report read."""
        score = result.get(SCORE)
        if not _finite(score) or not improves(score, self._predicted.get(trial.trial_id, -math.inf)):
            return
        self._predicted[trial.trial_id] = score
        seed = (trial.config.get("peftune") or {}).get("seed", self.settings.seed)
        for split, predictions in result["predictions"].items():
            text = predictions_csv(predictions, self.examples[split], int(seed))
            self._write("artifact", trial_id=trial.trial_id, path=predictions_artifact(split), text=text)
            if split == DECISION:
                self._decision[trial.trial_id] = text

    def _log_partial(self, trial_id: str, result: dict) -> None:
        """A rung within an epoch, once: ``fidelity_<score|steps|progress>`` at step = examples seen."""
        seen = int(result["examples_seen"])
        logged = self._partials.setdefault(trial_id, set())
        if seen in logged:
            return  # logged before the sweep was interrupted; the resumed trial re-ran this part of its epoch
        now = _now_ms()
        keys = [k for k in PARTIAL_METRICS if _finite(result.get(k))]
        metrics = [(f"fidelity_{k}", float(result[k]), now, seen) for k in keys]
        self._write("metrics", trial_id=trial_id, metrics=metrics)
        logged.add(seen)

    def space_refused(self) -> DiskFullError | None:
        """The first write refused for space this driver saw (a trial's checkpoint, or its own record), naming
        the file; None while every write had room."""
        return self._full or (self.buffer.full if self.buffer is not None else None)

    def on_step_end(self, iteration, trials, **info):
        """Stop the experiment (the error leaves Tune's loop; the sweep closes as interrupted) at the first write
        refused for space."""
        full = self.space_refused()
        if full is not None:
            raise full

    def on_trial_recover(self, iteration, trials, trial, **info):
        if self._out_of_space(trial):
            return  # not a failure of the trial: it runs again, from its last checkpoint, when the sweep resumes
        self._run_for(trial)
        # retries so far; the final count is set when the trial ends
        self._write("tags", trial_id=trial.trial_id, tags={RETRIES: str(trial.num_failures)})
        log.warning("trial %s failed and is retried (%d failure(s) so far)", trial.trial_id, trial.num_failures)

    def on_trial_complete(self, iteration, trials, trial, **info):
        last = trial.last_result or {}
        if last.get(DIVERGED):
            self._finish(trial, DIVERGED, error=str(last.get("divergence", DIVERGED))[:MAX_TAG_CHARS])
            return
        status = COMPLETED if int(last.get(EPOCH, 0)) >= self.settings.epochs else EARLY_STOPPED
        self._finish(trial, status)

    def on_trial_error(self, iteration, trials, trial, **info):
        if self._out_of_space(trial):
            return  # its run is closed as interrupted, and the sweep's resume retries it (resume_errored)
        self._finish(trial, FAILED, error=error_text(_read_error(trial)))

    def _out_of_space(self, trial) -> bool:
        """Whether ``trial`` failed writing (its checkpoint) for lack of space; the first such is kept to stop on."""
        full = no_space_text(_read_error(trial) or "", trial.path)
        if full is not None and self._full is None:
            self._full = full
        return full is not None

    def _finish(self, trial, status: str, error: str | None = None) -> None:
        if self._status(trial.trial_id) is not None:
            return
        self._run_for(trial)
        if error is not None:
            log.warning("trial %s %s: %s", trial.trial_id, status, error.splitlines()[0])
        # the retries Ray made: every failure but a final one (Ray's num_failures counts that too)
        retries = trial.num_failures - (1 if status == FAILED else 0)
        self._write(
            "finish", trial_id=trial.trial_id, status=status, error=error, retries=retries,
            best=self.state.best_metrics(trial.trial_id, self.task_metrics, _now_ms()),
        )  # fmt: skip
        marks = trial.config.get("peftune") or {}
        if marks.get("phase") == CONFIRM:
            decision = self._decision.get(trial.trial_id) if status == COMPLETED else None
            self.confirmed[(str(marks["config_key"]), int(marks["seed"]))] = ConfirmedPair(status, decision)

    def on_experiment_end(self, trials, **info):
        self.close_open_runs()

    def close_open_runs(self) -> None:
        """Trials still open when the experiment ends were interrupted: KILLED until the sweep resumes."""
        for trial_id in [trial_id for trial_id, run in self.state.trials.items() if STATUS not in run.tags]:
            self._write("run_status", trial_id=trial_id, status="KILLED")


# how an error refused for space reads once Ray has turned it into text: Python's OSError ("[Errno 28] No space left
# on device: 'PATH'") or pyarrow's, which Tune's checkpoint upload raises ("... Detail: [errno 28] No space left")
NO_SPACE_TEXT = re.compile(r"\[errno (?:28|122)\][^\n]*?(?:: '(?P<path>[^'\n]+)')?$", re.IGNORECASE | re.MULTILINE)


def no_space_text(text: str, path: str | None = None) -> DiskFullError | None:
    """A trial's error text as a ``DiskFullError`` when it says a write had no space (the path it names, else
    ``path``); None otherwise."""
    found = NO_SPACE_TEXT.search(text)
    if found is None:
        return None
    return DiskFullError(found.group("path") or path)


def invalid_params(settings, method: str, sampled: dict) -> dict:
    """The params of a trial whose config is invalid (its spec refused it): what was sampled, and the sweep's
    fixed settings, so its failed run says what it was."""
    common = {k: sampled.get(k) for k in HYPERPARAMETERS}
    return {
        "method": method,
        **common,
        "epochs": settings.epochs,
        "batch_size": settings.batch_size,
        "tasks": settings.tasks,
        "seed": settings.seed,
        **{f"method.{k}": v for k, v in sampled.items() if k not in common},
    }


def trial_tags(config: dict) -> dict[str, str]:
    """The trial config's ``"peftune"`` dict as child-run tags: ``{"phase": "confirm"}`` -> ``peftune.phase``."""
    return {f"peftune.{key}": str(value) for key, value in (config.get("peftune") or {}).items()}


def _read_error(trial) -> str | None:
    """The trial's error text: Tune writes it on the driver first, then syncs it to the storage path."""
    if trial.error_file and Path(trial.error_file).is_file():
        return Path(trial.error_file).read_text(errors="replace")
    return trial.get_error()


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
