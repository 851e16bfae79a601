"""A sweep's MLflow record -> one pandas DataFrame, one row per trial.

The record is the contract written by ``peftune.record.writer`` (its schema: docs/design.md, "The MLflow record").
This module only reads it, from any tracking URI (a SQLite file, a directory, an ``http://`` server), and never
imports Ray. Every trial is kept, marked with one of :data:`STATUSES`: the analysis decides which statuses enter
a frontier (completed only, by default: :mod:`analysis.pareto`). The columns of :attr:`SweepRuns.trials`
(identity, phase, outcome, parameter counts, hyperparameters, time): docs/report.md, "The record as DataFrames".
"""

from __future__ import annotations

import json
import logging
import math
import re
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from peftune.base.errors import UserError
from peftune.base.record_names import (  # the record's names, shared with the writer (no Ray import)
    BACKBONE,
    BEST_EPOCH,
    BEST_SCORE,
    CARRIED_FROM,
    CHECKPOINT_TAG,
    COMPLETED,
    CONFIRM,
    COUNT_METRICS,
    DECISION,
    DEFAULT,
    DEV,
    DIVERGED,
    EARLY_STOPPED,
    ERROR,
    FAILED,
    HYPERPARAMETERS,
    INTERRUPTED,
    METHOD,
    PREDICTION_COLUMNS,
    RUNNING,
    SCORE,
    SEED_REASON,
    SELECTION,
    STATUS,
    TASKS_ARTIFACT,
    TRIAL_ID,
    best_metric,
    keeps_predictions,
    split_metric,
)
from peftune.record import legacy, reader
from peftune.record.epoch_kept import best_epoch
from peftune.record.stores import resolve_tracking_uri

log = logging.getLogger("analysis.runs")

# the writer's three final statuses, then what an unfinished run is: still running, or interrupted (KILLED)
STATUSES = (COMPLETED, EARLY_STOPPED, DIVERGED, FAILED, RUNNING, INTERRUPTED, "unknown")

COUNT_COLUMNS = COUNT_METRICS
# the trial's settings a row keeps: the hyperparameters every method has, then the sweep's
SETTINGS = (*HYPERPARAMETERS, "epochs", "batch_size", "seed", "warmup_ratio", "sampling")


@dataclass
class SweepRuns:
    """A sweep as recorded: its parent run and one DataFrame row per trial (child run)."""

    name: str
    tracking_uri: str
    experiment_id: str
    parent_run_id: str
    parent_status: str  # the parent's peftune.status: running | completed | interrupted | failed (or MLflow's)
    backbone: str
    tasks: list[str]
    parent_params: dict[str, Any]  # typed (see param_from_mlflow): num_samples, epochs, max_train_examples, ...
    parent_tags: dict[str, str]
    record_version: (
        int  # the parent run's record version (peftune.record.legacy.record_version): what old paths it takes
    )
    trials: pd.DataFrame
    task_metrics: list[str] = field(default_factory=list)  # ["sst_accuracy", "para_accuracy", "sts_pearson"]
    confirmations: pd.DataFrame | None = None  # confirmation runs (peftune.sweep.confirm), the columns of ``trials``
    parent_metrics: dict[str, float] = field(default_factory=dict)  # budget_trials.<method>, dev_examples.<task>...

    def status_counts(self) -> dict[str, int]:
        """Trials per status, in the order of :data:`STATUSES` (statuses with no trial left out)."""
        counts = self.trials["status"].value_counts() if len(self.trials) else pd.Series(dtype=int)
        return {s: int(counts[s]) for s in STATUSES if s in counts}

    def status_summary(self) -> str:
        """``24 trials: 18 completed, 5 early_stopped, 1 failed``."""
        counts = self.status_counts()
        parts = ", ".join(f"{n} {s}" for s, n in counts.items())
        return f"{len(self.trials)} trials" + (f": {parts}" if parts else "")


# ----------------------------------------------------------------------------- reading


def read_sweep_record(name: str, tracking_uri: str | None = None, *, client=None) -> SweepRuns:
    """Read sweep ``name`` (parent run + child runs) from ``tracking_uri`` (see :func:`resolve_tracking_uri`).

    Raises ``ValueError`` naming the store and what it does hold when the sweep is not there.
    """
    uri = resolve_tracking_uri(tracking_uri)
    with reader.store_errors(uri):
        return _read_sweep_record(name, uri, client)


def _read_sweep_record(name: str, uri: str, client) -> SweepRuns:
    client = client or reader.client(uri)
    experiment_id, parent, children = reader.read_sweep(client, uri, name)
    version = legacy.record_version(parent.data.tags, parent.info.run_id)
    params = {k: param_from_mlflow(v) for k, v in parent.data.params.items()}
    tasks = legacy.recorded_tasks(parent, children, version)
    declare_recorded_tasks(client, parent.info.run_id, tasks)
    metrics = task_metric_names(tasks)
    histories = {run.info.run_id: _histories(client, run, metrics) for run in children}
    frame = trials_frame(children, metrics, histories, version=version)
    confirming = frame["phase"] == CONFIRM if len(frame) else pd.Series(dtype=bool)
    trials = frame[~confirming].reset_index(drop=True) if len(frame) else frame
    confirmations = frame[confirming].reset_index(drop=True) if len(frame) else frame
    return SweepRuns(
        name=name,
        tracking_uri=uri,
        experiment_id=experiment_id,
        parent_run_id=parent.info.run_id,
        parent_status=parent.data.tags.get(STATUS) or parent.info.status.lower(),
        backbone=parent.data.tags.get(BACKBONE) or str(params.get("model", "")),
        tasks=tasks,
        parent_params=params,
        parent_tags=dict(parent.data.tags),
        record_version=version,
        trials=trials,
        task_metrics=metrics,
        confirmations=confirmations,
        parent_metrics=dict(parent.data.metrics),
    )


def declare_recorded_tasks(client, run_id: str, tasks: Sequence[str]) -> None:
    """Declare in this process the tasks a sweep ran that are not shipped ones, from its parent run's
    ``tasks.json`` (their declarations, labels resolved): a report of a user's task needs its file nowhere."""
    from peftune.inputs.tasks import TaskSpec, declare, task_names

    unknown = [task for task in tasks if task not in task_names()]
    if not unknown:
        return
    text = reader.artifact_text(client, run_id, TASKS_ARTIFACT)
    if text is None:
        raise UserError(
            f"task(s) {', '.join(unknown)} of this sweep are not shipped ones and its parent run {run_id} has "
            f"no {TASKS_ARTIFACT} declaring them; expected a record written by a sweep that read task files"
        )
    recorded = json.loads(text)
    for task in unknown:
        declare(TaskSpec.from_declaration(recorded[task]["declaration"], f"{TASKS_ARTIFACT} of run {run_id}"))


def load_predictions(sweep: SweepRuns, *, client=None, splits: Sequence[str] = (DECISION, DEV)) -> pd.DataFrame:
    """The per-example predictions of the sweep's completed confirmation runs on ``splits``, one frame: the
    columns of ``PREDICTION_COLUMNS`` plus ``config_key``, ``run_id`` and ``split``. A run without them where the
    sweep keeps them: ``peftune.record.legacy.missing_predictions`` (an old record's is left out of that split)."""
    runs = sweep.confirmations
    columns = [*PREDICTION_COLUMNS, "config_key", "run_id", "split"]
    if runs is None or not len(runs):
        return pd.DataFrame(columns=columns)
    client = client or reader.client(sweep.tracking_uri)
    frames = []
    with (
        reader.store_errors(sweep.tracking_uri),
        tempfile.TemporaryDirectory(prefix="peftune-predictions-") as tmp,
    ):
        for run in runs[runs["status"] == COMPLETED].itertuples():
            for split in splits:
                frame = reader.run_predictions(client, sweep.tracking_uri, run.run_id, split, tmp)
                if frame is not None:
                    frames.append(frame.assign(config_key=run.config_key, run_id=run.run_id, split=split))
                else:
                    kept = keeps_predictions(split, run.seed_reason, sweep.parent_params.get("decision_examples"))
                    legacy.missing_predictions(run.run_id, split, sweep.record_version, kept)
    return pd.concat(frames, ignore_index=True)[columns] if frames else pd.DataFrame(columns=columns)


# (tracking URI, run id) -> the histories of a run the writer closed as finished: they never change, and the
# confirmation reads the whole record after each round of added seeds (one call per run, the slots idle)
_HISTORIES: dict[tuple[str, str], dict[str, dict[int, float]]] = {}


def _histories(client, run, metrics: Sequence[str]) -> dict[str, dict[int, float]]:
    """Per-epoch values (step -> value) of ``score`` and, where the best-epoch metrics are missing, the task metrics.

    ``score``'s history gives ``epochs_run`` for every trial; the task histories are only needed for a trial
    the writer has not closed (running or interrupted), which has no ``best_*`` metrics yet.
    """
    closed = BEST_SCORE in run.data.metrics
    final = closed and run.info.status == "FINISHED"  # its histories never change again
    key = (client.tracking_uri, run.info.run_id)
    if final and key in _HISTORIES:
        return _HISTORIES[key]
    names = [SCORE] if closed else [SCORE, *metrics]
    histories = {
        name: reader.metric_history(client, run.info.run_id, name) for name in names if name in run.data.metrics
    }
    if final:
        _HISTORIES[key] = histories
    return histories


def task_metric_names(tasks: Iterable[str]) -> list[str]:
    """``["sst", "sts"]`` -> ``["sst_accuracy", "sts_pearson"]`` (the metric of each registered task)."""
    from peftune.inputs.tasks import get_task

    names = []
    for task in tasks:
        try:
            spec = get_task(task)
            names.append(spec.metric_name)
        except KeyError:
            log.warning("task %r is not registered in this peftune; its metric is not read", task)
    return names


# ----------------------------------------------------------------------------- runs -> rows


def trials_frame(
    runs: Sequence,
    task_metrics: Sequence[str],
    histories: dict[str, dict[str, dict[int, float]]] | None = None,
    *,
    version: int,
) -> pd.DataFrame:
    """MLflow child runs of a record of ``version`` -> one row per trial (columns in the module docstring), in start
    order."""
    histories = histories or {}
    rows = [trial_row(run, task_metrics, histories.get(run.info.run_id, {}), version) for run in runs]
    frame = pd.DataFrame(rows, columns=_column_order(rows, task_metrics))
    if len(frame):
        frame = frame.sort_values(["start_time", "run_id"], kind="stable").reset_index(drop=True)
    return frame


def trial_row(run, task_metrics: Sequence[str], history: dict[str, dict[int, float]], version: int) -> dict[str, Any]:
    """One child run of a record of ``version`` -> one row. Best-epoch metrics come from ``best_*``, else from the
    run's history."""
    tags, metrics = run.data.tags, run.data.metrics
    params = {k: param_from_mlflow(v) for k, v in run.data.params.items()}
    method = str(params.get("method") or tags.get(METHOD) or "")
    size = size_label(method, params)
    error = tags.get(ERROR)
    row: dict[str, Any] = {
        "run_id": run.info.run_id,
        "trial_id": tags.get(TRIAL_ID, ""),
        "run_name": run.info.run_name,
        "method": method,
        "size": size,
        "label": f"{method} {size}".strip(),
        "size_value": size_value(method, params),
        "status": trial_status(tags.get(STATUS), run.info.status),
        "error": error.strip().splitlines()[0] if error and error.strip() else None,
        "mlflow_status": run.info.status,
        "epochs_run": max(history.get(SCORE, {}), default=0),
        "phase": legacy.run_phase(tags, version, run.info.run_id),
        "default": tags.get(DEFAULT) == "true",
        "config_key": legacy.run_config_key(run, version),
        "seed_reason": tags.get(SEED_REASON, ""),
        "carried_from": tags.get(CARRIED_FROM, ""),  # a carried search trial (peftune.sweep.carry)
        "data.max_train_examples": run.data.params.get("data.max_train_examples"),  # the train rows it trained on
    }
    if BEST_SCORE in metrics:
        row[BEST_EPOCH] = _int_or_none(metrics.get(BEST_EPOCH))
        row[SCORE] = metrics[BEST_SCORE]
        for key in task_metrics:
            row[key] = metrics.get(best_metric(key), math.nan)
    else:  # not closed by the writer: the best epoch so far, by the writer's rule
        scores = history.get(SCORE, {})
        best = best_epoch(scores)
        row[BEST_EPOCH] = best
        row[SCORE] = scores[best] if best is not None else math.nan
        for key in task_metrics:
            row[key] = history.get(key, {}).get(best, math.nan) if best is not None else math.nan
    row.update(split_numbers(metrics, row, task_metrics, version, run.info.run_id))
    for key in COUNT_COLUMNS:
        row[key] = metrics.get(key, math.nan)
    for key in SETTINGS:
        row[key] = params.get(key)
    row["tasks"] = run.data.params.get("tasks")
    row.update({k: v for k, v in sorted(params.items()) if k.startswith("method.")})
    row["train_time_s"] = _latest(metrics, "train_time_s")  # cumulative per epoch: the latest is the total
    row["eval_total_s"] = legacy.eval_seconds(run.info.run_id, metrics, _latest(metrics, "eval_total_s"), version)
    row["startup_s"] = _latest(metrics, "startup_s")
    row["checkpoint_time_s"] = metrics.get("checkpoint_time_s", math.nan)  # cumulative
    row["start_time"] = _timestamp(run.info.start_time)
    row["end_time"] = _timestamp(run.info.end_time)
    row["has_checkpoint"] = bool(tags.get(CHECKPOINT_TAG))
    return row


def _latest(metrics: dict[str, float], key: str) -> float:
    """A cumulative figure's last value: a trial stopped at a rung within an epoch last logged it as
    ``fidelity_<key>`` (see ``peftune.record.writer``), later than its last epoch's ``<key>``."""
    values = [metrics[name] for name in (key, f"fidelity_{key}") if name in metrics]
    return max(values) if values else math.nan


def split_numbers(
    metrics: dict[str, float], row: dict[str, Any], task_metrics: Sequence[str], version: int, run_id: str
) -> dict[str, Any]:
    """Which split a run's ``score`` and task metrics come from, and what they are (see ``peftune.base.record_names``).

    A confirmation run that evaluated dev reports dev's numbers, at the epoch the selection split chose
    (its ``best_dev_*``), and keeps its selection score as ``selection_score`` (none when a one-epoch run
    had no epoch to choose and did not evaluate selection). A search trial's numbers are the selection
    split's. Numbers of no named split: ``peftune.record.legacy.dev_judged`` (a record of ``version``).
    """
    selection_score = split_metric(SELECTION, SCORE)
    if best_metric(split_metric(DEV, SCORE)) in metrics:
        dev = {key: metrics.get(best_metric(split_metric(DEV, key)), math.nan) for key in [SCORE, *task_metrics]}
        return {**dev, selection_score: metrics.get(best_metric(selection_score), math.nan), "split": DEV}
    if best_metric(selection_score) in metrics or selection_score in metrics:
        return {selection_score: row.get(SCORE, math.nan), "split": SELECTION}
    return legacy.dev_judged(run_id, metrics, version)


def trial_status(tag: str | None, mlflow_status: str) -> str:
    """The writer's ``peftune.status``; without one, what MLflow says: running, interrupted (KILLED), failed."""
    if tag in (COMPLETED, EARLY_STOPPED, FAILED, DIVERGED):
        return tag
    return {"RUNNING": RUNNING, "SCHEDULED": RUNNING, "KILLED": INTERRUPTED, "FAILED": FAILED}.get(
        mlflow_status, "unknown"
    )


def _column_order(rows: list[dict], task_metrics: Sequence[str]) -> list[str]:
    first = [
        "run_id",
        "trial_id",
        "run_name",
        "method",
        "size",
        "label",
        "size_value",
        "status",
        "error",
        "mlflow_status",
        "epochs_run",
        "phase",
        "default",
        "config_key",
        "seed_reason",
        "carried_from",
        "data.max_train_examples",
        BEST_EPOCH,
        SCORE,
        *task_metrics,
        "split",
        split_metric(SELECTION, SCORE),
        *COUNT_COLUMNS,
        *SETTINGS,
        "tasks",
    ]
    options = sorted({k for row in rows for k in row if k.startswith("method.")})
    timers = ["train_time_s", "eval_total_s", "startup_s", "checkpoint_time_s"]
    return [*first, *options, *timers, "start_time", "end_time", "has_checkpoint"]


def _timestamp(ms: int | None):
    return pd.Timestamp(ms, unit="ms", tz="UTC") if ms else pd.NaT


def _int_or_none(value) -> int | None:
    return int(value) if value is not None and math.isfinite(value) else None


# ----------------------------------------------------------------------------- values and labels

_INT = re.compile(r"[+-]?\d+")


def param_from_mlflow(raw: str) -> Any:
    """An MLflow param string -> int, float, bool, None or the string itself (lists stay comma-separated)."""
    text = raw.strip()
    if text == "None":
        return None
    if text in ("True", "False"):
        return text == "True"
    if _INT.fullmatch(text):
        return int(text)
    try:
        return float(text)
    except ValueError:
        return raw


def size_label(method: str, params: dict[str, Any]) -> str:
    """``r=8``, ``m=64``, ``r=8 m=64`` (lora_adapter): the labels the run names use too (peftune.methods.sizes)."""
    from peftune.methods.sizes import size_label as label

    return label(method, params)


def size_value(method: str, params: dict[str, Any]) -> float:
    """The registry size field's value (NaN without one), to order a method's sizes."""
    from peftune.methods.sizes import size_field  # deferred: the methods import torch

    field = size_field(method)
    value = params.get(f"method.{field}") if field else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
