"""The names of the MLflow record: written by ``peftune.tracking``, read by ``analysis``.

One place for them, importable without Ray, so the writer and the reader cannot drift
apart. The record's layout is described in ``peftune.tracking``'s docstring.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

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


# the store schemes MLflow's tracking client takes ("" and file: a local directory of mlruns)
TRACKING_SCHEMES = ("", "file", "sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks")


def check_tracking_uri(uri: str) -> str:
    """Refuse a URI MLflow cannot open (``garbage://x``) before anything starts."""
    scheme = urlparse(uri).scheme.split("+")[0]  # postgresql+psycopg://...
    if scheme not in TRACKING_SCHEMES:
        raise ValueError(
            f"tracking URI {uri[:80]!r}: unsupported scheme {scheme[:20]!r}; expected one of "
            f"sqlite:///path, file:///path, http(s)://host, postgresql://..., mysql://..."
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
