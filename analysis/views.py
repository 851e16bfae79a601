"""Comparison views of a sweep: parallel coordinates, hyperparameter importance, and what tuning buys.

Importance uses Optuna's PED-ANOVA evaluator on an in-memory study rebuilt from the DataFrame (one Optuna trial per
completed trial; conditional parameters named per method, ``lora.rank``; parameters that never varied left out),
for the score, for reaching the Pareto frontier, and for each task metric, comparing the top ``max(0.1, 5 / n)``
quantile (at most 0.5) with all trials; fewer than :data:`MIN_TRIALS` completed trials: no importance. What tuning
buys (Dodge et al. 2019): per method, the expected best selection score of its first n search trials, its default
as trial 1 (``expected_max_with_default``). The details: docs/report.md, "Comparison views".
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import optuna
import pandas as pd
import plotly.graph_objects as go
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.importance import PedAnovaImportanceEvaluator

from analysis import pareto
from analysis.plots import method_color, task_name, zero_floor
from peftune.base.record_names import COMPLETED, EARLY_STOPPED, HYPERPARAMETERS, metric_task

log = logging.getLogger("analysis.views")

MIN_TRIALS = 4
LOG_PARAMS = ("lr",)


# ----------------------------------------------------------------------------- what tuning buys


def expected_max_table(trials: pd.DataFrame) -> pd.DataFrame:
    """One row per (method, n): the expected best selection score of n search trials (module docstring).

    The trials counted are the finished ones with a score (completed, and early-stopped at their rung);
    a method without a recorded default starts from its searched trials alone.
    """
    rows = []
    scored = trials[trials["status"].isin((COMPLETED, EARLY_STOPPED)) & trials["score"].notna()]
    for method in pareto.ordered_methods(scored["method"]) if len(scored) else []:
        mine = scored[scored["method"] == method]
        default = mine[mine["default"]]["score"] if "default" in mine else mine.iloc[0:0]["score"]
        searched = mine[~mine["default"]]["score"].to_numpy(float) if "default" in mine else mine["score"]
        if len(default) and len(searched):
            curve = expected_max_with_default(float(default.max()), searched, len(mine))
        elif len(searched):
            curve = expected_max_curve(searched, len(mine))
        else:
            curve = np.full(len(mine), float(default.max()))
        rows += [{"method": method, "n": n, "expected_best": v, "default": bool(len(default))} for n, v in
                 enumerate(curve, start=1)]  # fmt: skip
    return pd.DataFrame(rows, columns=["method", "n", "expected_best", "default"])


def expected_max_png(table: pd.DataFrame, path: str | Path, *, sweep: str, backbone: str) -> Path:
    """One line per method: the expected best selection score against the number of search trials."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=150, layout="constrained")
    for method, rows in table.groupby("method", sort=False):
        ax.plot(rows["n"], rows["expected_best"], marker="o", ms=3.5, color=method_color(method), label=method)
    ax.set_xlabel("search trials (trial 1: the method's published default)")
    ax.set_ylabel("expected best selection score")
    ax.set_title(f"Sweep {sweep}: what tuning buys (expected maximum, Dodge et al. 2019)\nbackbone {backbone}",
                 fontsize=11)  # fmt: skip
    ax.grid(True, alpha=0.3)
    if len(table):
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8.5, frameon=False)
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- importance


def _search_params(trials: pd.DataFrame) -> dict[str, dict]:
    """Per trial index: {param name: value} as a sweep samples them (method first, conditional ones per method)."""
    out = {}
    for index, row in trials.iterrows():
        params = {"method": row["method"]}
        for key in HYPERPARAMETERS:
            if key in row and pd.notna(row[key]):
                params[key] = row[key]
        for key in row.index:
            value = row[key]
            if key.startswith("method.") and value is not None and not (isinstance(value, float) and math.isnan(value)):
                params[f"{row['method']}.{key.removeprefix('method.')}"] = value
        out[index] = params
    return out


def _distributions(param_sets: dict[int, dict]) -> dict:
    """Observed ranges -> Optuna distributions; parameters with a single observed value are dropped."""

    values: dict[str, list] = {}
    for params in param_sets.values():
        for key, value in params.items():
            values.setdefault(key, []).append(value)
    distributions = {}
    for key, seen in values.items():
        distinct = sorted(set(seen), key=str)
        if len(distinct) < 2:
            continue
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in distinct)
        if key == "method" or not numeric:
            ordered = pareto.ordered_methods(distinct) if key == "method" else distinct
            distributions[key] = CategoricalDistribution(tuple(ordered))
        elif all(isinstance(v, int) for v in distinct):
            low, high = min(distinct), max(distinct)
            distributions[key] = IntDistribution(low, high, log=low >= 1)
        else:
            low, high = float(min(distinct)), float(max(distinct))
            distributions[key] = FloatDistribution(low, high, log=key.split(".")[-1] in LOG_PARAMS and low > 0)
    return distributions


def importance_study(trials: pd.DataFrame, task_metrics: Sequence[str] = (), *, multi_objective: bool = False):
    """An in-memory Optuna study of the completed trials (None with fewer than :data:`MIN_TRIALS`).

    Single objective: maximize ``score``; task metrics ride along as user attributes. Multi-objective:
    (maximize score, minimize trainable parameters per task).
    """

    pool = pareto.eligible(trials)
    pool = pool[pool["score"].notna() & (pool[pareto.COST].notna() if multi_objective else True)]
    if len(pool) < MIN_TRIALS:
        return None
    param_sets = _search_params(pool)
    distributions = _distributions(param_sets)
    if not distributions:
        return None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    directions = ["maximize", "minimize"] if multi_objective else ["maximize"]
    study = optuna.create_study(directions=directions)
    for index, row in pool.iterrows():
        params = {k: v for k, v in param_sets[index].items() if k in distributions}
        values = [float(row["score"]), float(row[pareto.COST])] if multi_objective else [float(row["score"])]
        study.add_trial(
            optuna.trial.create_trial(
                values=values,
                params=params,
                distributions={k: distributions[k] for k in params},
                user_attrs={"run_id": row["run_id"], **{m: float(row[m]) for m in task_metrics if pd.notna(row[m])}},
            )
        )
    return study


def param_importances(trials: pd.DataFrame, task_metrics: Sequence[str] = ()) -> pd.DataFrame:
    """Importance of each searched parameter (rows) for ``score``, ``pareto`` and each task metric (columns).

    Each column sums to 1 over the parameters. Empty (no rows) when the sweep has too few completed trials.
    """
    empty = pd.DataFrame(columns=["param", "score", "pareto", *task_metrics])
    single = importance_study(trials, task_metrics)
    if single is None:
        return empty
    try:
        return _importances(single, trials, task_metrics)
    except (ValueError, RuntimeError, ZeroDivisionError) as error:  # a degenerate sweep must not sink the report
        log.warning("hyperparameter importance not computed: %s", error)
        return empty


def _importances(single, trials: pd.DataFrame, task_metrics: Sequence[str]) -> pd.DataFrame:
    n = len(single.trials)
    evaluator = PedAnovaImportanceEvaluator(target_quantile=min(0.5, max(0.1, 5 / n)))
    columns: dict[str, dict[str, float]] = {}
    with warnings.catch_warnings():
        # PED-ANOVA warns that a `target` is minimized; the targets below are negated on purpose
        warnings.simplefilter("ignore")
        columns["score"] = optuna.importance.get_param_importances(single, evaluator=evaluator)
        multi = importance_study(trials, task_metrics, multi_objective=True)
        if multi is not None:
            columns["pareto"] = optuna.importance.get_param_importances(multi, evaluator=evaluator)
        for metric in task_metrics:
            scored = [t for t in single.trials if metric in t.user_attrs]
            if len(scored) >= MIN_TRIALS:
                columns[metric] = optuna.importance.get_param_importances(
                    single, evaluator=evaluator, target=lambda t, m=metric: -t.user_attrs.get(m, -math.inf)
                )
    frame = pd.DataFrame(columns).rename_axis("param").reset_index()
    return frame.sort_values("score", ascending=False, kind="stable").reset_index(drop=True)


def importance_png(importances: pd.DataFrame, path: str | Path, *, sweep: str, backbone: str, n_trials: int) -> Path:
    """Horizontal bars per parameter: importance for the dev score and for reaching the frontier.

    The per-task importances are in ``importance.csv`` and the HTML page; five bars per parameter
    would make this figure unreadable.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = [c for c in ("score", "pareto") if c in importances.columns]
    params = list(importances["param"])[::-1]  # most important on top
    fig, ax = plt.subplots(figsize=(9, 1.8 + 0.45 * max(1, len(params))), dpi=150, layout="constrained")
    height = 0.8 / max(1, len(targets))
    colors = {"score": "#1f77b4", "pareto": "#ff7f0e"}
    for i, target in enumerate(targets):
        values = importances.set_index("param").loc[params, target].astype(float).fillna(0.0)
        positions = np.arange(len(params)) - (i - (len(targets) - 1) / 2) * height
        ax.barh(positions, values, height=height, color=colors[target], label=importance_target_label(target))
    ax.set_yticks(np.arange(len(params)), params)
    ax.set_xlabel("importance (PED-ANOVA; each target sums to 1 over the parameters)")
    ax.set_ylabel("searched parameter (conditional ones as <method>.<field>)")
    ax.set_title(
        f"Sweep {sweep}: hyperparameter importance\nbackbone {backbone}; {n_trials} completed trials", fontsize=11
    )
    ax.grid(True, axis="x", alpha=0.3)
    if not params:
        ax.text(0.5, 0.5, f"fewer than {MIN_TRIALS} completed trials", transform=ax.transAxes, ha="center")
    else:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.09), ncols=2, fontsize=8.5, frameon=False)
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def importance_target_label(target: str) -> str:
    if target == "score":
        return "score"
    if target == "pareto":
        return "reaching the frontier (score up, params down)"
    task, metric = metric_task(target)
    return f"{task_name(task)} {metric}"


def importance_figure(importances: pd.DataFrame, *, sweep: str, backbone: str):
    fig = go.Figure()
    for target in [c for c in importances.columns if c != "param"]:
        fig.add_trace(go.Bar(x=importances["param"], y=importances[target], name=importance_target_label(target)))
    fig.update_layout(
        barmode="group",
        title=f"Sweep {sweep}: hyperparameter importance (PED-ANOVA), backbone {backbone}",
        yaxis={"title": "importance (sums to 1 per target)"},
        xaxis={"title": "parameter"},
        template="plotly_white",
        width=1000,
        height=440,
    )
    return fig


# ----------------------------------------------------------------------------- parallel coordinates


def _axes(trials: pd.DataFrame, task_metrics: Sequence[str]) -> list[dict]:
    """The parallel-coordinates axes: method, common hyperparameters, size (log %), task metrics, score."""
    methods = pareto.ordered_methods(trials["method"])
    axes = [
        {
            "label": "method",
            "values": trials["method"].map({m: i for i, m in enumerate(methods)}).astype(float),
            "tickvals": list(range(len(methods))),
            "ticktext": methods,
        }
    ]
    for key in HYPERPARAMETERS:
        if key in trials and trials[key].notna().any():
            values = pd.to_numeric(trials[key], errors="coerce").astype(float)
            if key in LOG_PARAMS and (values > 0).all():
                axes.append(_log_axis(f"{key} (log)", values))
            else:
                axes.append({"label": key, "values": values})
    pct = trials[pareto.COST_PCT].astype(float)
    floor = zero_floor(pct)
    axes.append(_log_axis("trainable/task % (log)", pct.where(pct > 0, floor), zero_at=floor))
    for metric in task_metrics:
        axes.append({"label": metric, "values": trials[metric].astype(float)})
    axes.append({"label": "score", "values": trials["score"].astype(float)})
    return axes


def _log_axis(label: str, values: pd.Series, zero_at: float | None = None) -> dict:
    """An axis of log10(values), ticked at 1-2-5 steps of each decade in range; ``zero_at`` is labelled "0"."""
    logs = np.log10(values.astype(float))
    low, high = float(logs.min()), float(logs.max())
    steps = [math.log10(m * 10.0**e) for e in range(math.floor(low), math.ceil(high) + 1) for m in (1, 2, 5)]
    tickvals = [t for t in steps if low - 1e-9 <= t <= high + 1e-9]
    if len(tickvals) > 7:  # a wide range: decades only
        tickvals = [t for t in tickvals if float(t).is_integer()]
    if len(tickvals) < 2:
        tickvals = sorted({low, high})
    ticktext = ["0" if zero_at is not None and math.isclose(10.0**t, zero_at) else f"{10.0**t:.2g}" for t in tickvals]
    return {"label": label, "values": logs, "tickvals": tickvals, "ticktext": ticktext}


def parallel_coordinates_figure(trials: pd.DataFrame, task_metrics: Sequence[str], *, sweep: str, backbone: str):
    """Plotly parallel coordinates of the completed trials, coloured by dev score."""

    pool = pareto.eligible(trials)
    pool = pool[pool["score"].notna() & pool[pareto.COST_PCT].notna()]
    if pool.empty:
        return None
    dimensions = []
    for axis in _axes(pool, task_metrics):
        dimension = {"label": axis["label"], "values": list(axis["values"])}
        if "tickvals" in axis:
            dimension.update(tickvals=axis["tickvals"], ticktext=axis["ticktext"])
        dimensions.append(dimension)
    fig = go.Figure(
        go.Parcoords(
            line={"color": pool["score"], "colorscale": "Viridis", "showscale": True, "colorbar": {"title": "score"}},
            dimensions=dimensions,
        )
    )
    fig.update_layout(
        title=f"Sweep {sweep}: completed trials coloured by dev score (backbone {backbone}); drag an axis to filter",
        width=1400,
        height=480,
        margin={"l": 80, "r": 60, "t": 90, "b": 40},
    )
    return fig


def parallel_coordinates_png(
    trials: pd.DataFrame, path: str | Path, task_metrics: Sequence[str], *, sweep: str, backbone: str
) -> Path:
    """Static parallel coordinates: each axis scaled to its own range; one line per completed trial."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import Normalize

    pool = pareto.eligible(trials)
    pool = pool[pool["score"].notna() & pool[pareto.COST_PCT].notna()]
    fig, ax = plt.subplots(figsize=(11, 5.2), dpi=150, layout="constrained")
    path = Path(path)
    if pool.empty:
        ax.text(0.5, 0.5, "no completed trial yet", ha="center", transform=ax.transAxes)
        ax.set_axis_off()
        fig.savefig(path)
        plt.close(fig)
        return path
    axes = _axes(pool, task_metrics)
    matrix = _scaled(axes)
    norm = Normalize(pool["score"].min(), pool["score"].max())
    cmap = plt.get_cmap("viridis")
    order = np.argsort(pool["score"].to_numpy())  # best drawn last, on top
    for i in order:
        ax.plot(range(len(axes)), matrix[i], color=cmap(norm(pool["score"].iloc[i])), alpha=0.75, lw=1.4)
    for j, axis in enumerate(axes):
        _vertical_axis(ax, j, axis)
    ax.set_xticks(range(len(axes)), [a["label"] for a in axes], fontsize=8.5)
    ax.set_yticks([])
    ax.set_xlim(-0.2, len(axes) - 0.4)
    ax.set_ylim(-0.05, 1.05)
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, label="dev score", fraction=0.03)
    ax.set_title(
        f"Sweep {sweep}: hyperparameters of the {len(pool)} completed trials, coloured by dev score\n"
        f"backbone {backbone}; each axis spans its own observed range",
        fontsize=11,
    )
    fig.savefig(path)
    plt.close(fig)
    return path


def _scaled(axes: list[dict]) -> np.ndarray:
    """(trials, axes): each axis' values scaled to [0, 1] over its own range; its ``low``, ``high`` and ``span``
    kept on the axis for its ticks."""
    scaled = []
    for axis in axes:
        values = np.asarray(axis["values"], dtype=float)
        low, high = np.nanmin(values), np.nanmax(values)
        span = high - low if high > low else 1.0  # a constant axis: every line at its bottom
        axis["low"], axis["high"], axis["span"] = low, high, span
        scaled.append((values - low) / span)
    return np.vstack(scaled).T


def _vertical_axis(ax, j: int, axis: dict) -> None:
    """Axis ``j`` of the static parallel coordinates: a vertical line and its tick labels (methods in colour)."""
    ax.axvline(j, color="black", lw=0.8)
    if "tickvals" in axis:
        ticks = [(t - axis["low"]) / axis["span"] for t in axis["tickvals"]]
        labels = axis["ticktext"]
    else:
        ticks = [0.0, (axis["high"] - axis["low"]) / axis["span"]]
        labels = [f"{axis['low']:.3g}", f"{axis['high']:.3g}"]
    for tick, label in zip(ticks, labels, strict=True):
        if -0.01 <= tick <= 1.01:
            color = method_color(label) if axis["label"] == "method" else "black"
            ax.text(j + 0.04, tick, str(label), fontsize=7.5, va="center", color=color)


# ----------------------------------------------------------------------------- expected maximum


def _expected_max(values: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """E[max of k draws with replacement from ``values``] for each k in ``draws`` (k >= 1)."""
    v = np.sort(values)  # (N,)
    cdf = np.arange(1, len(v) + 1) / len(v)  # (N,): P(one draw <= v_(i))
    k = np.asarray(draws, dtype=float)[:, None]  # (K, 1)
    mass = cdf**k - (cdf - 1 / len(v)) ** k  # (K, N): P(max of k draws = v_(i))
    return mass @ v


def _finite_scores(scores: Sequence[float], what: str) -> np.ndarray:
    values = np.asarray(scores, dtype=float)
    if values.ndim != 1 or not len(values) or not np.isfinite(values).all():
        raise ValueError(f"{what}: need a non-empty list of finite scores")
    return values


def expected_max_curve(scores: Sequence[float], max_n: int | None = None) -> np.ndarray:
    """(max_n,) expected best score of n = 1 .. max_n trials (default max_n = N = len(scores)).

    Dodge et al. 2019: n i.i.d. draws from the empirical distribution of the N observed trial scores
    (with replacement), ``E[max of n] = sum_i v_(i) ((i/N)^n - ((i-1)/N)^n)`` over the sorted scores v_(1) <=
    ... <= v_(N). n = 1 gives the mean; the curve rises to the maximum as n grows."""
    values = _finite_scores(scores, "expected_max_curve")
    return _expected_max(values, np.arange(1, (max_n or len(values)) + 1))


def expected_max_with_default(
    default_score: float, searched_scores: Sequence[float], max_n: int | None = None
) -> np.ndarray:
    """(max_n,) expected best score when the first trial is the default configuration and the later ones are
    search trials (default max_n = N + 1): n = 1 is ``default_score``; n >= 2 is
    ``E[max(default, max of n-1 draws)] = sum_i max(default, v_(i)) ((i/N)^(n-1) - ((i-1)/N)^(n-1))``
    (the draws as in ``expected_max_curve``)."""
    values = _finite_scores(searched_scores, "expected_max_with_default")
    max_n = max_n or len(values) + 1
    curve = np.full(max_n, float(default_score))
    curve[1:] = _expected_max(np.maximum(values, default_score), np.arange(1, max_n))
    return curve
