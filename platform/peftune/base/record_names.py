"""The names of the MLflow record: its tags, params, metrics, phases, splits, statuses and artifacts, written by
``peftune.record.writer`` and read by ``peftune.record.reader`` and ``analysis``.

One place for them, importable without Ray or MLflow, so the writer and the readers cannot drift apart. The
record's layout: docs/design.md, "The MLflow record".
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

REPORTS_DIR = "reports"  # a sweep's report goes to <reports dir>/<sweep>/ (the sweep's end, `peftune report`)

ROLE, SWEEP, TRIAL_ID, STATUS, ERROR = (
    "peftune.role",
    "peftune.sweep",
    "peftune.trial_id",
    "peftune.status",
    "peftune.error",
)
PARENT_TAG = "mlflow.parentRunId"
CHECKPOINT_TAG = "peftune.checkpoint"
SWEEP_ROLE, TRIAL_ROLE = "sweep", "trial"  # the values of ROLE: the sweep's parent run, a trial's child run

# the parent run's tags of what the sweep ran: the backbone, the code's version, the fingerprints a resumed
# sweep must match (its definition, its data), and where Ray keeps its state
BACKBONE, CODE_VERSION = "peftune.backbone", "peftune.code_version"
DEFINITION_FINGERPRINT, DATA_FINGERPRINT = "peftune.definition_fingerprint", "peftune.data_fingerprint"
RAY_EXPERIMENT_PATH = "peftune.ray_experiment_path"
# the parent run's tag of the record's version (``peftune.record.legacy.RECORD_VERSION``), written when the sweep
# begins: what the report tells an old record by; a sweep begun before it has none, and a resume adds none
RECORD_VERSION_TAG = "peftune.record_version"
# a trial run's tags of how it ran: its method, the precision it trained in, the retries Ray gave it
METHOD, PRECISION, RETRIES = "peftune.method", "peftune.precision", "peftune.retries"
# the members of the pack it trained in (peftune.sweep.packing); its times are the pack's
PACK_SIZE = "peftune.pack_size"
PACK_SIZE_RESULT = "pack_size"  # the result key a packed trial reports it under

# a trial run's tags of its place in the sweep (see peftune.sweep.confirm): its phase, the configuration it
# trains (peftune.sweep.search.config_key), its seed, whether it is the method's default (control arm), and
# for a confirmation run the search trial it confirms
PHASE, DEFAULT, CONFIG_KEY, SEED, CONFIRMS = (
    "peftune.phase",
    "peftune.default",
    "peftune.config_key",
    "peftune.seed",
    "peftune.confirms",
)
SEARCH, CONFIRM = "search", "confirm"  # the phases
# on a search trial the search did not propose (peftune.sweep.carry): the config key of the method's best configuration
# whose tuned setting it carries to a smaller budget's size
CARRIED_FROM = "peftune.carried_from"
SEED_REASON = "peftune.seed_reason"  # on a confirmation run of a seed added to an open decision: which one
# the seed reason of a *report* run: a budget's pick re-trained with a fresh seed after every decision was made,
# evaluated on dev only: its dev score is the one the report gives for the pick (the decision seeds' dev scores
# carry the luck that chose the pick)
REPORT_REASON = "report"


def is_report_run(seed_reason) -> bool:
    return isinstance(seed_reason, str) and seed_reason.startswith(REPORT_REASON)


TRAIN_COMMAND = "peftune.train_command"  # the `peftune train` command line that re-runs the trial
TASKS_ARTIFACT = "tasks.json"  # the tasks: declarations, examples' hashes, rows per role (writer.task_record)

# the splits a trial's numbers come from (peftune.inputs.data.SPLITS): a search trial's plain metrics (score,
# sst_accuracy, ...) are on the selection split and repeated as selection_score; a confirmation run also
# logs dev_score and dev_<task metric> (the report's numbers, at the epoch the selection split chose; a
# one-epoch confirmation run evaluates dev only, so its plain metrics are dev's and it has no selection_score)
SELECTION, DECISION, DEV = "selection", "decision", "dev"


def predictions_artifact(split: str) -> str:
    """A confirmation run's per-example predictions on ``split`` (decision, dev) at the epoch kept: gzip CSV,
    one row per example."""
    return f"predictions/{split}.csv.gz"


PREDICTIONS_ARTIFACT = predictions_artifact(DEV)
PREDICTION_COLUMNS = ("task", "example_id", "seed", "prediction", "label")


def keeps_predictions(split: str, seed_reason, decision_examples) -> bool:
    """Whether a completed confirmation run keeps its predictions on ``split`` (what ``peftune.sweep.worker`` asks of
    it): on dev, and on the decision split where the sweep carves one (``decision_examples``), unless it is a report
    run, which decides nothing."""
    if is_report_run(seed_reason):
        return False
    return split == DEV or (split == DECISION and bool(decision_examples))


def split_metric(split: str, name: str) -> str:
    """A metric under its split's name: ``selection_score``, ``dev_score``, ``dev_sst_accuracy`` (a trial's plain
    metrics are those of the split it is judged on)."""
    return f"{split}_{name}"


def split_metric_names(task_metrics: Sequence[str]) -> list[str]:
    """The per-split metrics a trial logs beside its task metrics (see the names above)."""
    scores = [split_metric(split, SCORE) for split in (SELECTION, DECISION, DEV)]
    return [*scores, *(split_metric(DEV, m) for m in task_metrics)]


def predictions_csv(predictions: dict[str, list[float]], examples: dict[str, tuple[list, list]], seed: int) -> str:
    """One run's per-example predictions as CSV text in :data:`PREDICTION_COLUMNS`; ``examples``: per task, the
    (example ids, labels) of the split the predictions were made on, in their order."""
    lines = [",".join(PREDICTION_COLUMNS)]
    for task, values in predictions.items():
        ids, labels = examples[task]
        if len(ids) != len(values):
            raise ValueError(f"task {task}: {len(values)} predictions for {len(ids)} dev examples")
        lines += [f"{task},{i},{seed},{p!r},{y!r}" for i, p, y in zip(ids, values, labels, strict=True)]
    return "\n".join(lines) + "\n"


# the parameter budgets (trainable parameters per task, % of the backbone) the report answers for, and
# under each of which confirmation takes every method's best configuration
BUDGETS_PCT = (0.1, 1.0, 10.0)

# a trial's final statuses; a diverged trial (non-finite or exploding loss) is a result, not a failure. A trial
# without a status is counted as unfinished (running, or the sweep was interrupted)
COMPLETED, EARLY_STOPPED, FAILED = "completed", "early_stopped", "failed"
DIVERGED = "diverged"
UNFINISHED = "unfinished"
# the sweep's statuses (its parent run's STATUS tag): running, then completed, completed_with_failures, interrupted
# or failed
RUNNING, COMPLETED_WITH_FAILURES, INTERRUPTED = "running", "completed_with_failures", "interrupted"
# the flags of a trial's result (to Tune, then the record): DIVERGED, set in a diverged trial's final result, and
# PARTIAL, set in a report within an epoch (a data-fidelity rung)
PARTIAL = "partial"

# ----------------------------------------------------------------------------- a trial's metrics

# the hyperparameters every method has (TrainConfig fields, search space keys and run params of the same names)
HYPERPARAMETERS = ("lr", "dropout", "weight_decay")
SCORE = "score"  # the mean of the task metrics, logged every epoch on the split the trial is judged on
EPOCH = "epoch"  # a result's 1-based epoch (an MLflow metric's step)
BEST_EPOCH = "best_epoch"  # logged once a trial ends: the epoch kept (peftune.record.epoch_kept)


def best_metric(name: str) -> str:
    """A metric's value at the epoch kept, logged once a trial ends: ``best_score``, ``best_sst_accuracy``."""
    return f"best_{name}"


BEST_SCORE = best_metric(SCORE)


def param_text(value) -> str:
    """A run param as the record stores it: ``str(value)``, a list comma-joined (``peftune.methods.options`` reads
    them back with the types a method's config declares)."""
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


def task_metric(task: str, metric: str) -> str:
    """A task's metric in the record: ``sst_accuracy``, ``sts_pearson``. A metric's name has no ``_`` (a task's
    name may have), so that :func:`metric_task` reads the name back."""
    if "_" in metric:
        raise ValueError(f"task {task!r}: metric {metric!r} has a '_'")
    return f"{task}_{metric}"


def metric_task(name: str) -> tuple[str, str]:
    """The inverse of :func:`task_metric`: ``("sst", "accuracy")`` for ``sst_accuracy``, ``("my_task", "pearson")``
    for ``my_task_pearson``."""
    task, _, metric = name.rpartition("_")
    return task, metric


# parameter counts, logged once per trial (peftune.core.params.ParameterCounts.summary): the backbone's, the trainable
# parameters per task (shared + that task's; the frontier's cost) and those stored for all tasks, each also as % of
# the backbone, those a checkpoint holds, and the task heads'
BACKBONE_PARAMS = "backbone_params"
TRAINABLE_PER_TASK, TRAINABLE_PER_TASK_PCT = "trainable_params_per_task", "trainable_params_per_task_pct"
STORED_PARAMS, STORED_PARAMS_PCT = "stored_params", "stored_params_pct"
CHECKPOINT_PARAMS, HEAD_PARAMS = "checkpoint_params", "head_params"
COUNT_METRICS = (
    BACKBONE_PARAMS,
    TRAINABLE_PER_TASK,
    TRAINABLE_PER_TASK_PCT,
    STORED_PARAMS,
    STORED_PARAMS_PCT,
    CHECKPOINT_PARAMS,
    HEAD_PARAMS,
)


def config_key(method: str, params: Mapping[str, Any]) -> str:
    """A stable short hash of a configuration: the same method and parameters give the same key."""
    text = json.dumps({"method": method, "params": params}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# ----------------------------------------------------------------------------- what the MLflow UI shows

SIZE_TAG = "peftune.size"  # a trial run's size label (``r=8``, ``m=64``; "" without one): one column for all methods
NOTE_TAG = "mlflow.note.content"  # a run's description in the UI (Markdown)
# a view of the runs table kept as an experiment tag (what the UI's "Share" button writes), opened by the
# URL parameter viewStateShareKey: its filter, order and columns; the UI offers no URL parameter for columns
SHARED_VIEW_TAG, TRIALS_VIEW_KEY = "mlflow.sharedViewState.", "peftune-trials"


def unique_labels(configurations: Sequence[tuple[str, str, bool]]) -> dict[str, str]:
    """config_key -> its label (``lora r=16``), made unique where two configurations share one, as the console and
    the report name them: the default's as ``<label> (default)``, any other with the start of its key
    (``frozen [318e62bf]``). ``configurations``: (config_key, label, default) each."""
    counts: dict[str, int] = {}
    for _, label, _ in configurations:
        counts[label] = counts.get(label, 0) + 1
    names, defaulted = {}, set()
    for key, label, default in configurations:
        names[key] = label
        if counts[label] > 1 and default and label not in defaulted:  # one default per label is named so
            names[key], defaulted = f"{label} (default)", defaulted | {label}
        elif counts[label] > 1:
            names[key] = f"{label} [{key[:8]}]"
    return names


def run_label(method: str, size: str, phase: str, seed=None, default: bool = False) -> str:
    """A trial run's name: ``lora r=8 · search``, ``adapter m=32 · confirm s3``, ``bitfit · search default``.

    A search trial trains with the sweep's seed (all alike), so only a confirmation run names its seed. Names
    are for reading; nothing finds a run by its name (two search trials of one method and size share one).
    """
    head = f"{method} {size}".strip()
    tail = phase + (f" s{seed}" if phase == CONFIRM and seed is not None else "") + (" default" if default else "")
    return f"{head} · {tail}"


def trial_name(trial) -> str:
    """``lora_3f2a1c0d``: the method and Ray's trial id (Ray's default name lists every parameter)."""
    return f"{trial.config.get('method', 'trial')}_{trial.trial_id}"
