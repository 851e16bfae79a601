"""The names of the MLflow record: written by ``peftune.tracking``, read by ``analysis``.

One place for them, importable without Ray, so the writer and the reader cannot drift
apart. The record's layout is described in ``peftune.tracking``'s docstring.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlparse

from peftune.errors import StoreError, UserError, one_line

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
DEFAULT_STORAGE_PATH = "ray_results"  # where Ray Tune keeps a sweep's state and checkpoints, by default
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
# a trial run's tags of how it ran: its method, the precision it trained in, the retries Ray gave it
METHOD, PRECISION, RETRIES = "peftune.method", "peftune.precision", "peftune.retries"
PACK_SIZE = "peftune.pack_size"  # the members of the pack it trained in (peftune.packing); its times are the pack's
PACK_SIZE_RESULT = "pack_size"  # the result key a packed trial reports it under

# a trial run's tags of its place in the sweep (see peftune.confirm): its phase, the configuration it
# trains (peftune.search.config_key), its seed, whether it is the method's default (control arm), and
# for a confirmation run the search trial it confirms
PHASE, DEFAULT, CONFIG_KEY, SEED, CONFIRMS = (
    "peftune.phase",
    "peftune.default",
    "peftune.config_key",
    "peftune.seed",
    "peftune.confirms",
)
SEARCH, CONFIRM = "search", "confirm"  # the phases
# on a search trial the search did not propose (peftune.carry): the config key of the method's best configuration
# whose tuned setting it carries to a smaller budget's size
CARRIED_FROM = "peftune.carried_from"
SEED_REASON = "peftune.seed_reason"  # on a confirmation run of a seed added to an open decision: which one
# the seed reason of a *report* run: a budget's pick re-trained with a fresh seed after every decision was made,
# evaluated on dev only: its dev score is the one the report gives for the pick (the decision seeds' dev scores
# carry the luck that chose the pick)
REPORT_REASON = "report"


def storage_uri(storage_path: str | Path) -> str:
    """``--storage-path`` as Ray Tune and the lease name it: an object-store URI as it is, a local path absolute."""
    text = str(storage_path)
    return text if "://" in text else str(Path(text).expanduser().resolve())


# schemes pyarrow opens only by reaching a service (a bucket's region, a JVM for HDFS): not opened here, where
# an offline check of the flag must not wait on the network; Ray reports their errors when it uses them
REMOTE_SCHEMES = ("s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss", "hf")


def check_storage_uri(storage: str) -> None:
    """Refuse a storage URI that pyarrow, which Ray Tune stores through, cannot open (``garbage://x``), before
    the data is read, the lease, Ray or the record: Tune would fail with pyarrow's traceback once the sweep had
    started. pyarrow is imported only for a URI (seconds of imports a directory does not wait for)."""
    if "://" not in storage:
        return  # a directory
    scheme = urlparse(storage).scheme.lower()
    if scheme in REMOTE_SCHEMES or scheme.startswith("fsspec+"):
        return
    import pyarrow
    import pyarrow.fs

    try:
        pyarrow.fs.FileSystem.from_uri(storage)  # file://, mock:// and an unknown scheme: answered locally
    except (pyarrow.ArrowException, ValueError, OSError) as error:
        raise UserError(
            f"--storage-path {storage[:200]}: pyarrow (Ray Tune's storage) cannot open it ({one_line(error, 200)}); "
            f"expected a directory, file:///absolute/path, or s3://, gs://, abfs://, hdfs:// ..."
        ) from None


def is_report_run(seed_reason) -> bool:
    return isinstance(seed_reason, str) and seed_reason.startswith(REPORT_REASON)


TRAIN_COMMAND = "peftune.train_command"  # the `peftune train` command line that re-runs the trial
TASKS_ARTIFACT = "tasks.json"  # a sweep's tasks: declarations, examples' hashes, rows per role (tracking.task_record)

# the splits a trial's numbers come from (peftune.data.SPLITS): a search trial's plain metrics (score,
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
BEST_EPOCH = "best_epoch"  # logged once a trial ends: the epoch kept (see best_epoch)


def best_metric(name: str) -> str:
    """A metric's value at the epoch kept, logged once a trial ends: ``best_score``, ``best_sst_accuracy``."""
    return f"best_{name}"


BEST_SCORE = best_metric(SCORE)


def improves(score: float, kept: float) -> bool:
    """Whether an epoch's score replaces the epoch kept so far: only a higher one does, so that of two epochs with
    the best score the earliest is kept (a later one trained longer for nothing). A NaN score never replaces one."""
    return score > kept


def best_epoch(scores: Mapping[int, float]) -> int | None:
    """The epoch kept of ``scores`` ({epoch: score}) by :func:`improves`: the best score, the earliest on a tie;
    None without any epoch. The first epoch is kept until one improves on it (a NaN first score included)."""
    kept = None
    for epoch in sorted(scores):
        if kept is None or improves(scores[epoch], scores[kept]):
            kept = epoch
    return kept


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


# parameter counts, logged once per trial (peftune.params.ParameterCounts.summary): the backbone's, the trainable
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


def run_phase(tags: Mapping[str, str]) -> str:
    """A child run's phase; runs written before the tag existed are search trials."""
    return tags.get(PHASE) or SEARCH


def config_key(method: str, params: Mapping[str, Any]) -> str:
    """A stable short hash of a configuration: the same method and parameters give the same key."""
    text = json.dumps({"method": method, "params": params}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def run_config_key(run) -> str:
    """The run's ``peftune.config_key`` tag (see :func:`config_key`).

    A run without the tag (written before it existed) is its own configuration: re-hashing logged
    params would not give the key the search computed from the sampled ones.
    """
    return run.data.tags.get(CONFIG_KEY) or f"run:{run.info.run_id}"


# ----------------------------------------------------------------------------- the MLflow UI (3.17)

SIZE_TAG = "peftune.size"  # a trial run's size label (``r=8``, ``m=64``; "" without one): one column for all methods
NOTE_TAG = "mlflow.note.content"  # a run's description in the UI (Markdown)
DEFAULT_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves a local store (the command ui_hint prints)
# MLflow 3.17's UI reads the GenAI / model-training switch from this URL parameter (else from the browser's
# storage, GenAI by default), not from the experiment's mlflow.experimentKind tag
TRAINING_VIEW = "workflowType=machine_learning"
# a view of the runs table kept as an experiment tag (what the UI's "Share" button writes), opened by the
# URL parameter viewStateShareKey: its filter, order and columns; the UI offers no URL parameter for columns
SHARED_VIEW_TAG, TRIALS_VIEW_KEY = "mlflow.sharedViewState.", "peftune-trials"
TRIALS_COLUMNS = (
    f"tags.`{PHASE}`",
    "params.`method`",
    f"tags.`{SIZE_TAG}`",
    f"metrics.`{BEST_SCORE}`",  # a search trial's best selection score (a confirmation run's too)
    f"metrics.`{split_metric(DEV, SCORE)}`",  # a confirmation run's dev score (the report's numbers)
    f"metrics.`{TRAINABLE_PER_TASK_PCT}`",
    f"tags.`{STATUS}`",
    "attributes.`Dataset`",
)


CHARTS_SECTION = "peftune-trials"


def trials_view() -> dict:
    """The runs table the sweep's link opens: every trial and confirmation run, flat (a filter or an order other
    than by date un-nests child runs), best score first, with the columns of :data:`TRIALS_COLUMNS`; its chart
    view (one click) plots the score against the trainable fraction and the hyperparameters (:func:`trial_charts`)."""
    return {
        "searchFilter": f"tags.`{ROLE}` = '{TRIAL_ROLE}'",
        "orderByKey": f"metrics.`{BEST_SCORE}`",
        "orderByAsc": False,
        "selectedColumns": list(TRIALS_COLUMNS),
        "columnOrder": list(TRIALS_COLUMNS),
        "columnWidths": {f"metrics.`{TRAINABLE_PER_TASK_PCT}`": 230},
        "runsHiddenMode": "SHOW_ALL",  # the charts plot every run, not the first 10
        "compareRunSections": [{"uuid": CHARTS_SECTION, "name": "Trials: score against size and hyperparameters",
                                "display": True, "isReordered": False, "deleted": False, "isGenerated": False}],
        "compareRunCharts": trial_charts(),
    }  # fmt: skip


def trial_charts() -> list[dict]:
    """The chart view's cards, in the shape of the UI's own (RunsChartsCardConfig): without them it plots the
    parent's first metrics (dev_examples.sst, ...)."""

    def card(uuid: str, kind: str, **fields) -> dict:
        common = {"uuid": uuid, "type": kind, "runsCountToCompare": 100, "metricSectionId": CHARTS_SECTION}
        return {**common, "deleted": False, "isGenerated": False, **fields}

    def axis(key: str, kind: str = "METRIC") -> dict:
        return {"key": key, "type": kind}

    score, size = axis(BEST_SCORE), axis(TRAINABLE_PER_TASK_PCT)
    return [
        card("peftune-size", "SCATTER", xaxis=size, yaxis=score),
        card("peftune-dev", "SCATTER", xaxis=size, yaxis=axis(split_metric(DEV, SCORE))),
        card(
            "peftune-parallel",
            "PARALLEL",
            selectedParams=["method", *HYPERPARAMETERS],
            selectedMetrics=[BEST_SCORE],
            showAllRuns=True,
        ),  # fmt: skip
        card("peftune-lr", "SCATTER", xaxis=axis("lr", "PARAM"), yaxis=score),
    ]


def ui_base(uri: str) -> tuple[str, str | None]:
    """(the UI's address, the command that serves it or None) for a tracking URI: a server is its own UI."""
    if uri.startswith(("http://", "https://")):
        return uri.rstrip("/"), None
    return DEFAULT_UI, f"mlflow ui --backend-store-uri {uri} --host 127.0.0.1 --port 5000"


def trials_address(uri: str, experiment_id: str) -> str:
    """The experiment's runs table in the model-training view, opened on :func:`trials_view`."""
    query = f"{TRAINING_VIEW}&viewStateShareKey={TRIALS_VIEW_KEY}"
    return f"{ui_base(uri)[0]}/#/experiments/{experiment_id}/runs?{query}"


def run_address(uri: str, experiment_id: str, run_id: str) -> str:
    return f"{ui_base(uri)[0]}/#/experiments/{experiment_id}/runs/{run_id}?{TRAINING_VIEW}"


def compare_route(experiment_id: str, run_ids: Sequence[str]) -> str:
    """MLflow's compare page of ``run_ids`` (parameters and metrics side by side, parallel coordinates, scatter),
    as the UI's own route: a link in a run's description, whatever host serves the UI."""
    runs = quote(json.dumps(list(run_ids), separators=(",", ":")))
    experiments = quote(json.dumps([str(experiment_id)]))
    return f"#/compare-runs?runs={runs}&experiments={experiments}&{TRAINING_VIEW}"


def compare_address(uri: str, experiment_id: str, run_ids: Sequence[str]) -> str:
    return f"{ui_base(uri)[0]}/{compare_route(experiment_id, run_ids)}"


def artifact_route(experiment_id: str, run_id: str, path: str) -> str:
    """The UI's route to a run's artifact ``path`` (opened in the run's Artifacts tab)."""
    return f"#/experiments/{experiment_id}/runs/{run_id}/artifacts/{path}?{TRAINING_VIEW}"


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


@contextlib.contextmanager
def store_errors(uri: str):
    """MLflow's errors from the store at ``uri`` (it refuses, or cannot be reached) as one-line user errors."""
    from mlflow.exceptions import MlflowException  # deferred: this module is read without MLflow's import cost

    try:
        yield
    except MlflowException as error:
        raise StoreError(f"tracking store {uri[:200]}: {error.message}") from error


def sqlite_path(uri: str) -> Path | None:
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri[len("sqlite:///") :])


def resolve_tracking_uri(uri: str | None = None) -> str:
    """The argument, else ``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db``; a relative SQLite path made absolute.

    The writer and the reader resolve alike, so ``peftune report`` finds what ``peftune sweep``
    wrote when both run in the same directory with the same environment.
    """
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
    path = sqlite_path(uri)
    if path is not None and not path.is_absolute():
        uri = "sqlite:///" + str(Path.cwd() / path)
    return uri


# the store schemes MLflow's tracking client takes ("" and file: a local directory of mlruns)
TRACKING_SCHEMES = ("", "file", "sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks")


def check_tracking_uri(uri: str) -> str:
    """Refuse a URI MLflow cannot open (``garbage://x``) before anything starts."""
    scheme = urlparse(uri).scheme.split("+")[0]  # postgresql+psycopg://...
    if scheme not in TRACKING_SCHEMES:
        raise UserError(
            f"tracking URI {uri[:80]!r}: unsupported scheme {scheme[:20]!r}; expected one of "
            f"sqlite:///path, file:///path, http(s)://host, postgresql://..., mysql://..."
        )
    return check_sqlite_file(uri)


SQLITE_HEADER = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file


def check_sqlite_file(uri: str) -> str:
    """Refuse a ``sqlite:///`` URI naming an existing file that is not a SQLite database (a CSV, notes, an
    empty file): MLflow would write its tables into it, or fail deep in SQLAlchemy."""
    path = sqlite_path(uri)
    if path is not None and path.is_file():
        with open(path, "rb") as file:
            if file.read(len(SQLITE_HEADER)) != SQLITE_HEADER:
                raise UserError(
                    f"tracking URI {uri[:200]}: {path} is an existing file but not a SQLite database; "
                    "expected an MLflow SQLite store or a path that does not exist yet"
                )
    return uri


def existing_store_uri(uri: str | None = None) -> str:
    """:func:`resolve_tracking_uri` for commands that only read: a local store must already exist.

    MLflow creates a missing SQLite database (and its directory) on first use, so a mistyped path
    would otherwise be read as an empty store, and leave a stray file behind.
    """
    uri = check_tracking_uri(resolve_tracking_uri(uri))
    path = sqlite_path(uri)
    if path is None and urlparse(uri).scheme in ("", "file"):
        path = Path(urlparse(uri).path if "://" in uri else uri)
    if path is not None and not path.exists():
        raise FileNotFoundError(f"tracking store {uri[:200]} does not exist; check --tracking-uri")
    return uri
