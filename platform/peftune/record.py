"""The names of the MLflow record: written by ``peftune.tracking``, read by ``analysis``.

One place for them, importable without Ray, so the writer and the reader cannot drift
apart. The record's layout is described in ``peftune.tracking``'s docstring.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"

ROLE, SWEEP, TRIAL_ID, STATUS, ERROR = (
    "peftune.role",
    "peftune.sweep",
    "peftune.trial_id",
    "peftune.status",
    "peftune.error",
)
PARENT_TAG = "mlflow.parentRunId"
CHECKPOINT_TAG = "peftune.checkpoint"

# a trial's final statuses; a diverged trial (non-finite or exploding loss) is a result, not a failure
COMPLETED, EARLY_STOPPED, FAILED = "completed", "early_stopped", "failed"
DIVERGED = "diverged"

# parameter counts, logged once per trial (peftune.params.ParameterCounts.summary)
COUNT_METRICS = (
    "backbone_params",
    "trainable_params_per_task",
    "trainable_params_per_task_pct",
    "stored_params",
    "stored_params_pct",
    "checkpoint_params",
    "head_params",
)


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
