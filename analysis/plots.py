"""Score versus trainable parameters, of the search trials and of the confirmed seed means.

Each plot is described once (:func:`score_vs_params`, :func:`confirmed_configurations`: an
:class:`analysis.figure.FigureSpec`) and drawn from that description as a PNG (matplotlib) and as an interactive
HTML figure (plotly). x: trainable parameters per task as % of the backbone, log scale (frozen at a floor labelled
"0"); y: the dev figure of the best epoch; one fixed colour per method (:func:`method_color`); completed trials
filled, early-stopped ones as small crosses, failed ones counted in the title; the frontier as a staircase; the
AdaptBert report's bert-base figures as hollow diamonds, a reference only. Why each: docs/report.md, "The plots".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from analysis import pareto
from analysis.figure import Axis, FigureSpec, Key, Series, to_plotly, to_png
from analysis.runs import EARLY_STOPPED, task_metric_names
from peftune.base.record_names import (
    BACKBONE_PARAMS,
    BEST_EPOCH,
    HYPERPARAMETERS,
    STORED_PARAMS,
    STORED_PARAMS_PCT,
    metric_task,
)
from peftune.record import legacy

REFERENCE_LABEL = "AdaptBert Table 3: bert-base, published figures (another backbone)"
PCT = pareto.COST_PCT
FRONTIER_LEGEND = "Pareto frontier (all methods)"


# a frontier point's mark by its decision against the cheaper point (analysis.confirmed.seed_mean_frontier)
FRONTIER_MARKS = {"equivalent": "=", "inconclusive": "?", "worse": "?"}


def method_color(method: str) -> str:
    """The registry's colour of a method; one it does not know, a stable colour
    (``peftune.record.legacy.method_color``)."""
    from peftune.record.legacy import method_color  # deferred: the methods import torch

    return method_color(method)


def task_name(task: str, unknown: str | None = None) -> str:
    """A task as the report names it (its spec's ``display_name``: ``SST``, ``Quora``); one the registry does not
    know as ``unknown`` (default: its name)."""
    from peftune.base.errors import UnknownNameError
    from peftune.inputs.tasks import get_task

    try:
        return get_task(task).display_name
    except UnknownNameError:
        return task if unknown is None else unknown


def metric_label(objective: str, tasks: Sequence[str] = (), split: str = "dev") -> str:
    """Axis label: ``dev score (mean of SST acc., Quora acc., STS Pearson r)``, ``selection SST accuracy``..."""
    if objective == "score":
        parts = [_short_metric(t) for t in tasks]
        if len(parts) == 1:
            return f"{split} score (= {parts[0]})"
        return f"{split} score" + (f" (mean of {', '.join(parts)})" if parts else "")
    task, metric = metric_task(objective)
    return f"{split} {task_name(task)} {'Pearson r' if metric == 'pearson' else metric}"


def _short_metric(task: str) -> str:
    from peftune.inputs.tasks import get_task

    try:
        metric = get_task(task).metric
    except KeyError:
        metric = "metric"
    return f"{task_name(task)} {'Pearson r' if metric == 'pearson' else 'acc.'}"


def human_count(n: float) -> str:
    """22713216 -> ``22.7M``."""
    if not math.isfinite(n):
        return "?"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def zero_floor(*pct_series: pd.Series) -> float:
    """Where 0% is drawn on the log axis: one decade below the smallest positive value's decade."""
    values = pd.concat([s.dropna() for s in pct_series if s is not None]) if pct_series else pd.Series(dtype=float)
    positive = values[values > 0]
    smallest = positive.min() if len(positive) else 1.0
    return 10.0 ** (math.floor(math.log10(smallest)) - 1)


def reference_points(reference: pd.DataFrame | None, objective: str, tasks: Sequence[str]) -> pd.DataFrame | None:
    """The published points comparable to ``objective``, with their value in the column ``objective``; else None.

    The published average is the mean over SST, Para and STS: it is drawn against a sweep's score only when
    the sweep ran exactly those tasks; a one-task sweep's score is that task's metric, drawn against the
    published figure of that task. A task metric is drawn against its own published column.
    """
    if reference is None:
        return None
    column = objective
    if objective == "score" and set(tasks) != {"sst", "para", "sts"}:
        column = task_metric_names(tasks)[0] if len(tasks) == 1 else None
    if column is None or column not in reference:
        return None
    points = reference[reference[column].notna()].copy()
    points[objective] = points[column]
    return points if len(points) else None


def _x(pct: pd.Series, floor: float) -> np.ndarray:
    return np.where(pct.to_numpy(float) <= 0, floor, pct.to_numpy(float))


def _decades(floor: float, top: float) -> list[float]:
    return [10.0**e for e in range(round(math.log10(floor)) + 1, math.ceil(math.log10(max(top, floor * 10))) + 1)]


def _pct_text(value: float) -> str:
    return f"{value:g}%"


def _plot_frame(trials: pd.DataFrame, objective: str) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(eligible trials with finite values, early-stopped ones, frontier of the eligible) for one objective."""
    drawable = trials[trials[objective].notna() & trials[PCT].notna()]
    eligible = pareto.eligible(drawable)
    stopped = drawable[drawable["status"] == EARLY_STOPPED]
    return eligible, stopped, pareto.frontier(eligible, objective, PCT)


def plot_title(
    sweep: str, backbone: str, objective: str, tasks: Sequence[str], status_summary: str, split: str = "dev"
) -> str:
    what = "score" if objective == "score" else metric_label(objective).removeprefix("dev ")
    return (
        f"Sweep {sweep}: {split} {what} vs trainable parameters per task\n"
        f"backbone {backbone}; {status_summary}; frontiers over completed trials"
    )


# ----------------------------------------------------------------------------- score vs parameters (search trials)


def score_vs_params(
    trials: pd.DataFrame,
    *,
    objective: str = "score",
    sweep: str,
    backbone: str,
    tasks: Sequence[str],
    status_summary: str,
    record_version: int,
    reference: pd.DataFrame | None = None,
    task_metrics: Sequence[str] = (),
) -> FigureSpec:
    """The plot of ``objective`` versus trainable parameters per task (see the module docstring), described once;
    ``task_metrics``: the metrics a hover box lists besides the score; ``record_version``: the sweep's record's
    (the split its trials were judged on: ``peftune.record.legacy.trials_split``)."""
    eligible, stopped, front = _plot_frame(trials, objective)
    ref = reference_points(reference, objective, tasks)
    floor = zero_floor(trials[PCT], ref[PCT] if ref is not None else None)
    shown = ["score", *task_metrics]
    series: list[Series] = []
    for method in pareto.ordered_methods(pd.concat([eligible["method"], stopped["method"]])):
        series += _method_series(method, eligible, stopped, objective, floor, shown)
    keys: list[Key] = []
    if len(front):
        hover = tuple(f"<i>on the frontier</i><br>{hover_text(row, shown)}" for _, row in front.iterrows())
        labels = tuple(front["label"])
        xy = _xy(front, objective, floor)
        series.append(Series("frontier", *xy, legend=FRONTIER_LEGEND, hover=hover, labels=labels))
        keys.append(Key("method_frontier", "each method's own frontier"))
    if len(stopped):
        keys.append(Key("stopped", "stopped early (not on frontiers)"))
    if ref is not None and len(ref):
        series.append(_reference_series(ref, objective, floor))
        drawn = set(eligible["method"]) | set(stopped["method"])
        for method in pareto.ordered_methods([m for m in ref["method"] if m not in drawn]):
            keys.append(Key("reference", f"{method} (published only)", method_color(method)))
    split = legacy.trials_split(trials, record_version)
    sizes = [*eligible[PCT], *stopped[PCT], *(ref[PCT] if ref is not None else [])]
    return FigureSpec(
        title=plot_title(sweep, backbone, objective, tasks, status_summary, split),
        x=size_axis(floor, sizes, _backbone_params(trials)),
        y=Axis(metric_label(objective, tasks, split)),
        series=tuple(series),
        keys=tuple(keys),
        note="" if len(eligible) or len(stopped) else "no trial with a dev result yet",
        **_count_axis(_backbone_params(trials)),
    )


def _method_series(
    method: str, eligible: pd.DataFrame, stopped: pd.DataFrame, objective: str, floor: float, shown: Sequence[str]
) -> list[Series]:
    """One method's completed trials, its stopped ones and its own frontier (a staircase from two points on)."""
    color, out = method_color(method), []
    mine, mine_stopped = eligible[eligible["method"] == method], stopped[stopped["method"] == method]
    for kind, frame in (("trials", mine), ("stopped", mine_stopped)):
        if len(frame):
            hover = tuple(hover_text(row, shown) for _, row in frame.iterrows())
            # one legend entry per method: its circles, or its crosses when none of its trials completed
            legend = method if kind == "trials" or not len(mine) else None
            out.append(Series(kind, *_xy(frame, objective, floor), color, group=method, legend=legend, hover=hover))
    own = pareto.frontier(mine, objective, PCT)
    if len(own) > 1:
        out.append(Series("method_frontier", *_xy(own, objective, floor), color, group=method))
    return out


def _reference_series(ref: pd.DataFrame, objective: str, floor: float) -> Series:
    return Series(
        "reference",
        *_xy(ref, objective, floor),
        tuple(method_color(m) for m in ref["method"]),
        legend=REFERENCE_LABEL.replace(": ", ":\n"),
        hover=tuple(reference_hover(row, objective) for _, row in ref.iterrows()),
    )


def size_axis(floor: float, sizes: Sequence[float], backbone_params: float | None) -> Axis:
    """The x axis: % of the backbone, log scale, a tick per decade and the floor labelled "0" (heads only)."""
    top = max([floor * 10, *(s for s in sizes if pd.notna(s))])
    ticks = (floor, *_decades(floor, top))
    of = f" (% of the backbone's {human_count(backbone_params)})" if backbone_params else " (%)"
    return Axis(
        f"trainable parameters per task{of}, log scale; 0 = heads only",
        log=True,
        ticks=ticks,
        tick_labels=("0", *(_pct_text(t) for t in ticks[1:])),
        limits=(floor / 1.8, top * 1.8),
    )


def _backbone_params(frame: pd.DataFrame) -> float | None:
    known = frame[BACKBONE_PARAMS].dropna() if BACKBONE_PARAMS in frame else ()
    return float(known.iloc[0]) if len(known) else None


def _count_axis(backbone_params: float | None) -> dict:
    """The PNG's top axis: the same sizes as parameter counts."""
    if not backbone_params:
        return {}
    return {"count_scale": backbone_params / 100.0, "count_label": "trainable parameters per task (count)"}


def _xy(frame: pd.DataFrame, column: str, floor: float) -> tuple[np.ndarray, np.ndarray]:
    return _x(frame[PCT], floor), frame[column].to_numpy(float)


def score_vs_params_png(trials: pd.DataFrame, path: str | Path, **described) -> Path:
    """Write the static plot :func:`score_vs_params` describes (same keywords) to ``path``."""
    return to_png(score_vs_params(trials, **described), path)


def score_vs_params_figure(trials: pd.DataFrame, *, width: int = 900, height: int = 540, **described):
    """The interactive plot :func:`score_vs_params` describes (same keywords); hovering a point shows its
    hyperparameters and run id."""
    return to_plotly(score_vs_params(trials, **described), width=width, height=height)


def hover_text(row: pd.Series, objective_columns: Sequence[str]) -> str:
    """The hover box of one trial: what it scored, its size, every hyperparameter, its run id."""
    lines = [f"<b>{row['label']}</b> ({row['status']})"]
    for key in objective_columns:
        if key in row and pd.notna(row[key]):
            lines.append(f"{key}: {row[key]:.4f}")
    if pd.notna(row.get(pareto.COST)):
        lines.append(f"trainable/task: {row[pareto.COST]:,.0f} ({row[PCT]:.3g}%)")
    if pd.notna(row.get(STORED_PARAMS)):
        lines.append(f"stored: {row[STORED_PARAMS]:,.0f} ({row[STORED_PARAMS_PCT]:.3g}%)")
    for key in (*HYPERPARAMETERS, "batch_size", "epochs"):
        value = row.get(key)
        if value is not None and not (isinstance(value, float) and math.isnan(value)):
            lines.append(f"{key}: {value:.3g}" if isinstance(value, float) else f"{key}: {value}")
    for key in row.index:
        if (
            key.startswith("method.")
            and row[key] is not None
            and not (isinstance(row[key], float) and math.isnan(row[key]))
        ):
            lines.append(f"{key}: {row[key]}")
    if pd.notna(row.get(BEST_EPOCH)):
        lines.append(f"best epoch {int(row[BEST_EPOCH])} of {int(row['epochs_run'])} run")
    lines.append(f"trial {row['trial_id']}<br>run {row['run_id']}")
    return "<br>".join(lines)


def reference_hover(row: pd.Series, objective: str) -> str:
    size = f" {row['size']}" if isinstance(row["size"], str) and row["size"] else ""
    return (
        f"<b>{row['method']}{size}</b>, {row['epochs']} epochs<br>{objective}: {row[objective]:.3f}<br>"
        f"params updated per task: {row[PCT]:g}%<br><i>published (AdaptBert Table 3), bert-base-uncased: "
        "another backbone</i>"
    )


# ----------------------------------------------------------------------------- confirmed configurations (seed means)


def _interval(configs: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(upper, lower) lengths of the 95% interval bars around the seed means; 0 where undefined."""
    mean = configs["score_mean"].to_numpy(float)
    upper = np.nan_to_num(configs["score_ci_high"].to_numpy(float) - mean)
    lower = np.nan_to_num(mean - configs["score_ci_low"].to_numpy(float))
    return upper, lower


def confirmed_configurations(configs: pd.DataFrame, front: pd.DataFrame, *, sweep: str, backbone: str) -> FigureSpec:
    """Seed means vs trainable parameters per task: thick bar = std, thin bar = 95% interval; the frontier on means.

    Frontier points marked ``=`` are equivalent to the next cheaper frontier point, ``?`` not shown better.
    """
    floor = zero_floor(configs[PCT])
    series: list[Series] = []
    for method in pareto.ordered_methods(configs["method"]):
        mine = configs[configs["method"] == method]
        color, (x, y) = method_color(method), _xy(mine, "score_mean", floor)
        upper, lower = _interval(mine)
        std = np.nan_to_num(mine["score_std"].to_numpy(float))
        hover = tuple(
            f"{r['label']}<br>score {r['score_mean']:.4f} ± {r['score_std']:.4f} ({r['seeds']} seeds)"
            f"<br>95% interval [{r['score_ci_low']:.4f}, {r['score_ci_high']:.4f}]<br>trainable {r[PCT]:.3g}%"
            for r in mine.to_dict("records")
        )
        series.append(Series("interval", x, y, color, group=method, error=(lower, upper)))
        series.append(Series("means", x, y, color, group=method, legend=method, hover=hover, error=(std, std)))
    if len(front):
        labels = tuple(
            f"{FRONTIER_MARKS.get(word, '')} {label}".strip()
            for label, word in zip(front["label"], front["vs_cheaper"], strict=True)
        )
        xy = _xy(front, "score_mean", floor)
        series.append(Series("means_frontier", *xy, legend="frontier of the seed means", labels=labels))
    keys = (
        Key("std", "± std over seeds"),
        Key("interval", "95% interval (t)"),
        Key("text", "=: equivalent to the cheaper frontier point; ?: not shown better"),
    )
    seeds = int(configs["seeds"].max()) if len(configs) else 0
    return FigureSpec(
        title=f"Sweep {sweep}: confirmed configurations, up to {seeds} seed(s) each\nbackbone {backbone}",
        x=size_axis(floor, configs[PCT], _backbone_params(configs)),
        y=Axis("dev score, mean over seeds"),
        series=tuple(series),
        keys=keys,
        **_count_axis(_backbone_params(configs)),
    )


def confirmed_png(configs: pd.DataFrame, front: pd.DataFrame, path: str | Path, **described) -> Path:
    """Write the static plot :func:`confirmed_configurations` describes (same keywords) to ``path``."""
    return to_png(confirmed_configurations(configs, front, **described), path)


def confirmed_figure(configs: pd.DataFrame, front: pd.DataFrame, *, width: int = 900, height: int = 520, **described):
    """The interactive plot :func:`confirmed_configurations` describes (same keywords)."""
    return to_plotly(confirmed_configurations(configs, front, **described), width=width, height=height)
