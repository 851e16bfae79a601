"""Reading the MLflow record: every query the sweep, its resume, the confirmation, the report and the evaluation
make of runs, params, metrics and artifacts, and the predictions the confirmation decides on.

With ``peftune.record.writer`` the only modules of ``peftune`` and ``analysis`` that import MLflow
(``tests/test_layers.py`` checks it). MLflow is imported where a function first needs it, so importing this module
costs nothing. The record's schema: docs/design.md, "The MLflow record"; its names: ``peftune.base.record_names``.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlparse

from peftune.base.errors import StoreError, UserError
from peftune.base.record_names import (
    DECISION,
    PARENT_TAG,
    PREDICTION_COLUMNS,
    ROLE,
    SWEEP,
    SWEEP_ROLE,
    TRIAL_ID,
    TRIAL_ROLE,
    predictions_artifact,
)
from peftune.record.stores import sqlite_path
from peftune.record.ui_links import DEFAULT_UI


def client(uri: str):
    """MLflow's client of the store at ``uri``."""
    import mlflow

    return mlflow.MlflowClient(tracking_uri=uri)


def client_class():
    """MLflow's client class (the benchmark driver counts the calls of its methods)."""
    import mlflow

    return mlflow.MlflowClient


@contextlib.contextmanager
def store_errors(uri: str):
    """MLflow's errors from the store at ``uri`` (it refuses, or cannot be reached) as one-line user errors."""
    from mlflow.exceptions import MlflowException

    try:
        yield
    except MlflowException as error:
        raise StoreError(f"tracking store {uri[:200]}: {error.message}") from error


# ----------------------------------------------------------------------------- the sweep's runs


def find_experiment_id(store, name: str) -> str | None:
    """The experiment of sweep ``name`` (None without one); a deleted one is refused."""
    experiment = store.get_experiment_by_name(name)
    if experiment is None:
        return None
    if experiment.lifecycle_stage == "deleted":
        raise UserError(
            f"MLflow experiment {name!r} is deleted in this store: restore it "
            f"(mlflow experiments restore) or pick another sweep name"
        )
    return experiment.experiment_id


def find_parent_run(store, experiment_id: str, sweep: str):
    runs = store.search_runs(
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
    store = client(tracking_uri)
    experiment = store.get_experiment_by_name(sweep)
    return experiment is not None and find_parent_run(store, experiment.experiment_id, sweep) is not None


def child_runs(store, experiment_id: str, parent_run_id: str) -> list:
    """Every child run of the parent run, page after page."""
    runs, token = [], None
    while True:
        page = store.search_runs(
            [experiment_id],
            filter_string=f"tags.`{PARENT_TAG}` = '{parent_run_id}'",
            max_results=1000,
            page_token=token,
        )
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def trial_run(store, experiment_id: str, parent_run_id: str, trial_id: str):
    """The run of Ray trial ``trial_id`` under the parent run, None before it is created (the write buffer finds a
    trial's run before creating one, so a replayed write creates none twice)."""
    runs = store.search_runs(
        [experiment_id],
        filter_string=f"tags.`{PARENT_TAG}` = '{parent_run_id}' and tags.`{TRIAL_ID}` = '{trial_id}'",
        max_results=1,
    )
    return runs[0] if runs else None


def read_sweep(store, uri: str, name: str) -> tuple[str, object, list]:
    """(experiment id, parent run, trial runs) of sweep ``name`` as the report reads it; a missing sweep is refused,
    naming the store and the sweeps it does hold."""
    experiment = store.get_experiment_by_name(name)
    if experiment is None or experiment.lifecycle_stage == "deleted":
        known = sorted(e.name for e in store.search_experiments() if e.name != "Default")
        where = f"no MLflow experiment named {name!r}" if experiment is None else f"experiment {name!r} is deleted"
        raise UserError(
            f"{where} in {uri}; sweeps there: {', '.join(known) or 'none'} "
            f"(pass --tracking-uri or set MLFLOW_TRACKING_URI to read another store)"
        )
    experiment_id = experiment.experiment_id
    parents = store.search_runs(
        [experiment_id], filter_string=f"tags.`{ROLE}` = '{SWEEP_ROLE}' and tags.`{SWEEP}` = '{name}'", max_results=2
    )
    if not parents:
        raise UserError(f"experiment {name!r} in {uri} has no sweep parent run (tag {ROLE}={SWEEP_ROLE})")
    if len(parents) > 1:
        raise UserError(f"experiment {name!r} in {uri} holds more than one sweep parent run; expected one")
    parent = parents[0]
    if parent.info.artifact_uri.startswith("mlflow-artifacts:") and urlparse(uri).scheme not in ("http", "https"):
        # MLflow can only fetch such artifacts through the server that stored them
        raise UserError(
            f"sweep {name!r} in {uri} keeps its artifacts on the MLflow server that recorded it "
            f"({parent.info.artifact_uri[:80]}); start it (`peftune up` where the store lives) and pass "
            f"--tracking-uri {DEFAULT_UI}, or set MLFLOW_TRACKING_URI to it"
        )
    children = [
        run
        for run in child_runs(store, experiment_id, parent.info.run_id)
        if run.data.tags.get(ROLE, TRIAL_ROLE) == TRIAL_ROLE
    ]
    return experiment_id, parent, children


def run_params(store, run_id: str) -> dict[str, str]:
    """A run's params as the record stores them (strings)."""
    return dict(store.get_run(run_id).data.params)


def run_tags(store, run_id: str) -> dict[str, str]:
    """A run's tags."""
    return dict(store.get_run(run_id).data.tags)


def metric_history(store, run_id: str, key: str) -> dict[int, float]:
    """A metric's values by step."""
    return {int(m.step): m.value for m in store.get_metric_history(run_id, key)}


def run_entity(run_id: str, experiment_id: str, status: str, start_time: int, run_name: str | None,
               metrics: dict[str, tuple[int, int, float]], params: dict[str, str], tags: dict[str, str]):  # fmt: skip
    """A run held in memory as MLflow's ``Run`` entity (what a search of the record returns): ``metrics``, key ->
    (step, timestamp, value) of its latest value."""
    from mlflow.entities import LifecycleStage, Metric, Param, Run, RunData, RunInfo, RunTag

    info = RunInfo(run_id, experiment_id, "", status, start_time, None, LifecycleStage.ACTIVE, run_name=run_name)
    data = RunData(
        metrics=[Metric(key, value, timestamp, step) for key, (step, timestamp, value) in metrics.items()],
        params=[Param(key, value) for key, value in params.items()],
        tags=[RunTag(key, value) for key, value in tags.items()],
    )
    return Run(info, data)


# ----------------------------------------------------------------------------- artifacts


def artifact_names(store, run_id: str, directory: str) -> set[str]:
    """The names of the files and folders directly in a run's artifact ``directory``."""
    return {Path(f.path).name for f in store.list_artifacts(run_id, directory)}


def download_artifact(store, run_id: str, path: str, directory: str) -> str:
    """A run's artifact ``path`` (a file or a folder) copied into ``directory``; its local path."""
    return store.download_artifacts(run_id, path, directory)


def artifact_text(store, run_id: str, path: str) -> str | None:
    """A run's text artifact, None where the run has none (MLflow raises its own kinds for a missing one)."""
    with tempfile.TemporaryDirectory(prefix="peftune-artifact-") as directory:
        try:
            local = download_artifact(store, run_id, path, directory)
        except Exception:  # noqa: BLE001
            return None
        return Path(local).read_text()


# (tracking URI, run id, split) -> that completed run's predictions: the artifact of a completed run never
# changes, and the confirmation asks for every run's predictions after each round of added seeds (HTTP calls per
# run, the slots idle meanwhile)
_PREDICTIONS: dict[tuple[str, str, str], object] = {}


def run_predictions(store, tracking_uri: str, run_id: str, split: str, directory: str):
    """A completed run's predictions artifact on ``split`` as a frame of ``PREDICTION_COLUMNS`` (None where it has
    none), downloaded once per process."""
    import pandas as pd

    key = (tracking_uri, run_id, split)
    if key not in _PREDICTIONS:
        path = predictions_artifact(split)
        folder, name = path.rsplit("/", 1)
        if name not in artifact_names(store, run_id, folder):
            return None
        _PREDICTIONS[key] = pd.read_csv(download_artifact(store, run_id, path, directory), compression="gzip")
    return _PREDICTIONS[key]


def read_predictions(tracking_uri: str, runs: Mapping[str, str]):
    """The decision-split predictions of completed confirmation runs ``runs`` (run id -> config key, in that order):
    what the confirmation's decision procedure (``peftune.stats.decisions``) reads after each round. One frame of
    ``PREDICTION_COLUMNS`` (``seed`` an integer) plus ``config_key``, ``run_id`` and ``split``; a run without them
    is left out (the caller says whether it may be). Reading only: nothing is decided here."""
    import pandas as pd

    columns = [*PREDICTION_COLUMNS, "config_key", "run_id", "split"]
    store = client(tracking_uri)
    frames = []
    with store_errors(tracking_uri), tempfile.TemporaryDirectory(prefix="peftune-predictions-") as directory:
        for run_id, key in runs.items():
            frame = run_predictions(store, tracking_uri, run_id, DECISION, directory)
            if frame is not None:
                frames.append(frame.assign(config_key=key, run_id=run_id, split=DECISION))
    if not frames:
        return pd.DataFrame(columns=columns)
    frame = pd.concat(frames, ignore_index=True)[columns]
    return frame.assign(seed=frame["seed"].astype(int))
