"""The MLflow UI's (3.17) links to a sweep: the runs table of its trials (and the view it opens on), a run, runs
compared, an artifact; where the UI of a tracking URI is served."""

from __future__ import annotations

import json
from collections.abc import Sequence
from urllib.parse import quote

from peftune.base.record_names import (
    BEST_SCORE,
    DEV,
    HYPERPARAMETERS,
    PHASE,
    ROLE,
    SCORE,
    SIZE_TAG,
    STATUS,
    TRAINABLE_PER_TASK_PCT,
    TRIAL_ROLE,
    TRIALS_VIEW_KEY,
    split_metric,
)

DEFAULT_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves a local store (the command ui_hint prints)
# MLflow 3.17's UI reads the GenAI / model-training switch from this URL parameter (else from the browser's
# storage, GenAI by default), not from the experiment's mlflow.experimentKind tag
TRAINING_VIEW = "workflowType=machine_learning"
# the runs table's columns in the trials' view (trials_view), in order
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
CHARTS_SECTION = "peftune-trials"  # the chart view's one section (trial_charts)


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


def ui_hint(uri: str, experiment_id: str | None = None) -> tuple[str, str | None]:
    """(address of the sweep's trials in the runs table, command that serves it or None) for a tracking URI."""
    base, command = ui_base(uri)
    return (trials_address(uri, experiment_id) if experiment_id else f"{base}/"), command
