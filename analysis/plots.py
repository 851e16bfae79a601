"""Score versus trainable parameters: PNG (matplotlib) and interactive (plotly) versions of one plot.

What each plot shows, and why:

- x: trainable parameters per task as % of the backbone, log scale (PEFT methods span 0.01%..100%:
  a linear axis would crush all of them against zero). Methods that train no backbone-side
  parameter (``frozen``: heads only) sit at a floor one decade below the smallest positive value,
  on a tick labelled "0". The top axis gives the same quantity as a parameter count.
- y: the dev figure of the best epoch: the score (mean of the task metrics) or one task's metric.
- one colour per method (fixed across every plot of every report, :func:`method_color`); completed
  trials filled, early-stopped trials as small crosses (they trained fewer epochs, so they stay out of
  every frontier); failed trials are not drawn (the title counts them);
- the frontier over all methods in black, each method's own frontier faint in its colour, both as
  staircases: between two frontier points the best score reachable at that size is the left one's;
- optionally the AdaptBert report's published bert-base figures (its Table 3) as hollow diamonds,
  labelled as reported figures of another backbone: a sanity reference, not a comparison.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from analysis import pareto
from analysis.runs import EARLY_STOPPED, task_metric_names

TASK_NAMES = {"sst": "SST", "para": "Quora", "sts": "STS", "cfimdb": "CFIMDB"}
METHOD_COLORS = {
    "frozen": "#7f7f7f",
    "full": "#8c564b",
    "lora": "#1f77b4",
    "adapter": "#ff7f0e",
    "lora_adapter": "#2ca02c",
    "hyperformer": "#d62728",
    "bitfit": "#9467bd",
    "layernorm": "#e377c2",
    "top_k": "#bcbd22",
    "prefix": "#17becf",
    "prompt": "#393b79",
}
_EXTRA_COLORS = ("#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d")
REFERENCE_LABEL = "AdaptBert Table 3: bert-base, published figures (another backbone)"
PCT = pareto.COST_PCT


# a frontier point's mark by its decision against the cheaper point (analysis.confirmed.seed_mean_frontier)
FRONTIER_MARKS = {"equivalent": "=", "inconclusive": "?", "worse": "?"}


def method_color(method: str) -> str:
    """A fixed colour per registered method; unknown methods get a stable colour from their name."""
    if method in METHOD_COLORS:
        return METHOD_COLORS[method]
    return _EXTRA_COLORS[sum(map(ord, method)) % len(_EXTRA_COLORS)]


def metric_label(objective: str, tasks: Sequence[str] = (), split: str = "dev") -> str:
    """Axis label: ``dev score (mean of SST acc., Quora acc., STS Pearson r)``, ``selection SST accuracy``..."""
    if objective == "score":
        parts = [_short_metric(t) for t in tasks]
        if len(parts) == 1:
            return f"{split} score (= {parts[0]})"
        return f"{split} score" + (f" (mean of {', '.join(parts)})" if parts else "")
    task, _, metric = objective.partition("_")
    return f"{split} {TASK_NAMES.get(task, task)} {'Pearson r' if metric == 'pearson' else metric}"


def trials_split(trials: pd.DataFrame) -> str:
    """The split the search trials' numbers come from: selection, or dev in a record written before it."""
    return "selection" if "split" in trials and (trials["split"] == "selection").any() else "dev"


def _short_metric(task: str) -> str:
    from peftune.tasks import get_task

    try:
        metric = get_task(task).metric
    except KeyError:
        metric = "metric"
    return f"{TASK_NAMES.get(task, task)} {'Pearson r' if metric == 'pearson' else 'acc.'}"


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


# ----------------------------------------------------------------------------- PNG (matplotlib)


def score_vs_params_png(
    trials: pd.DataFrame,
    path: str | Path,
    *,
    objective: str = "score",
    sweep: str,
    backbone: str,
    tasks: Sequence[str],
    status_summary: str,
    reference: pd.DataFrame | None = None,
) -> Path:
    """Write the static plot of ``objective`` versus trainable parameters per task (see the module docstring)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import EngFormatter, FixedLocator, FuncFormatter, NullLocator

    eligible, stopped, front = _plot_frame(trials, objective)
    ref = reference_points(reference, objective, tasks)
    floor = zero_floor(trials[PCT], ref[PCT] if ref is not None else None)

    fig, ax = plt.subplots(figsize=(11, 6.2), dpi=150, layout="constrained")
    handles: list = []
    for method in pareto.ordered_methods(pd.concat([eligible["method"], stopped["method"]])):
        color = method_color(method)
        mine = eligible[eligible["method"] == method]
        if len(mine):
            ax.scatter(_x(mine[PCT], floor), mine[objective], s=42, color=color, edgecolor="white", lw=0.6, zorder=4)
            own = pareto.frontier(mine, objective, PCT)
            if len(own) > 1:
                ax.step(_x(own[PCT], floor), own[objective], where="post", color=color, alpha=0.35, lw=1.3, zorder=2)
        mine_stopped = stopped[stopped["method"] == method]
        if len(mine_stopped):
            ax.scatter(
                _x(mine_stopped[PCT], floor),
                mine_stopped[objective],
                s=26,
                marker="x",
                color=color,
                lw=1.1,
                alpha=0.7,
                zorder=3,
            )
        handles.append(Line2D([], [], ls="", marker="o", ms=7, color=color, mec="white", label=method))
    if len(front):
        x, y = _x(front[PCT], floor), front[objective].to_numpy(float)
        ax.step(x, y, where="post", color="black", lw=1.8, zorder=5)
        ax.scatter(x, y, s=120, facecolors="none", edgecolors="black", lw=1.2, zorder=6)
        for i, (xi, yi, label) in enumerate(zip(x, y, front["label"], strict=True)):
            ax.annotate(
                label,
                (xi, yi),
                xytext=(6, 6) if i % 2 == 0 else (6, -13),  # alternate above / below: neighbours often sit close
                textcoords="offset points",
                fontsize=7.5,
                zorder=7,
                bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.75},
            )
        handles.append(
            Line2D([], [], color="black", lw=1.8, marker="o", mfc="none", ms=9, label="Pareto frontier (all methods)")
        )
        handles.append(Line2D([], [], color="grey", lw=1.3, alpha=0.45, label="each method's own frontier"))
    if len(stopped):
        handles.append(Line2D([], [], ls="", marker="x", ms=6, color="grey", label="stopped early (not on frontiers)"))
    if ref is not None and len(ref):
        for method, group in ref.groupby("method", sort=False):
            ax.scatter(
                _x(group[PCT], floor),
                group[objective],
                s=36,
                marker="D",
                facecolors="none",
                edgecolors=method_color(method),
                lw=1.2,
                zorder=3,
            )
        handles.append(
            Line2D(
                [], [], ls="", marker="D", mfc="none", mec="dimgrey", ms=6, label=REFERENCE_LABEL.replace(": ", ":\n")
            )
        )
        drawn = set(eligible["method"]) | set(stopped["method"])
        for method in pareto.ordered_methods([m for m in ref["method"] if m not in drawn]):
            label = f"{method} (published only)"
            handles.append(Line2D([], [], ls="", marker="D", mfc="none", mec=method_color(method), ms=6, label=label))

    ax.set_xscale("log")
    top = max([floor * 10, *eligible[PCT].dropna(), *stopped[PCT].dropna(), *(ref[PCT] if ref is not None else [])])
    ticks = [floor, *_decades(floor, top)]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: "0" if math.isclose(v, floor) else _pct_text(v)))
    ax.set_xlim(floor / 1.8, top * 1.8)
    backbone_params = trials["backbone_params"].dropna()
    size = f" (% of the backbone's {human_count(backbone_params.iloc[0])})" if len(backbone_params) else " (%)"
    ax.set_xlabel(f"trainable parameters per task{size}, log scale; 0 = heads only")
    ax.set_ylabel(metric_label(objective, tasks, trials_split(trials)))
    if len(backbone_params):
        n = float(backbone_params.iloc[0])
        top_axis = ax.secondary_xaxis("top", functions=(lambda p: p * n / 100.0, lambda c: c * 100.0 / n))
        top_axis.xaxis.set_major_formatter(EngFormatter(places=0, sep=""))
        top_axis.set_xlabel("trainable parameters per task (count)", fontsize=9)
        top_axis.tick_params(labelsize=8)
    ax.grid(True, which="major", alpha=0.3)
    fig.suptitle(plot_title(sweep, backbone, objective, tasks, status_summary, trials_split(trials)), fontsize=11)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8.5, frameon=False)
    if not len(eligible) and not len(stopped):
        ax.text(0.5, 0.5, "no trial with a dev result yet", transform=ax.transAxes, ha="center", color="grey")
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- interactive (plotly)


def hover_text(row: pd.Series, objective_columns: Sequence[str]) -> str:
    """The hover box of one trial: what it scored, its size, every hyperparameter, its run id."""
    lines = [f"<b>{row['label']}</b> ({row['status']})"]
    for key in objective_columns:
        if key in row and pd.notna(row[key]):
            lines.append(f"{key}: {row[key]:.4f}")
    if pd.notna(row.get(pareto.COST)):
        lines.append(f"trainable/task: {row[pareto.COST]:,.0f} ({row[PCT]:.3g}%)")
    if pd.notna(row.get("stored_params")):
        lines.append(f"stored: {row['stored_params']:,.0f} ({row['stored_params_pct']:.3g}%)")
    for key in ("lr", "dropout", "weight_decay", "batch_size", "epochs"):
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
    if pd.notna(row.get("best_epoch")):
        lines.append(f"best epoch {int(row['best_epoch'])} of {int(row['epochs_run'])} run")
    lines.append(f"trial {row['trial_id']}<br>run {row['run_id']}")
    return "<br>".join(lines)


def reference_hover(row: pd.Series, objective: str) -> str:
    size = f" {row['size']}" if isinstance(row["size"], str) and row["size"] else ""
    return (
        f"<b>{row['method']}{size}</b>, {row['epochs']} epochs<br>{objective}: {row[objective]:.3f}<br>"
        f"params updated per task: {row[PCT]:g}%<br><i>published (AdaptBert Table 3), bert-base-uncased: "
        "another backbone</i>"
    )


def score_vs_params_figure(
    trials: pd.DataFrame,
    *,
    objective: str = "score",
    sweep: str,
    backbone: str,
    tasks: Sequence[str],
    status_summary: str,
    reference: pd.DataFrame | None = None,
    task_metrics: Sequence[str] = (),
    width: int = 900,
    height: int = 540,
):
    """The interactive version of :func:`score_vs_params_png`; hovering a point shows its hyperparameters and run id."""
    import plotly.graph_objects as go

    eligible, stopped, front = _plot_frame(trials, objective)
    ref = reference_points(reference, objective, tasks)
    floor = zero_floor(trials[PCT], ref[PCT] if ref is not None else None)
    shown = ["score", *task_metrics]
    fig = go.Figure()
    for method in pareto.ordered_methods(pd.concat([eligible["method"], stopped["method"]])):
        color = method_color(method)
        for frame, name, symbol, size in (
            (eligible[eligible["method"] == method], method, "circle", 9),
            (stopped[stopped["method"] == method], f"{method}, stopped early", "x-thin-open", 8),
        ):
            if not len(frame):
                continue
            fig.add_trace(
                go.Scatter(
                    x=_x(frame[PCT], floor),
                    y=frame[objective],
                    mode="markers",
                    name=name,
                    legendgroup=method,  # clicking a method in the legend hides its crosses and frontier too
                    showlegend=symbol == "circle",
                    marker={"color": color, "symbol": symbol, "size": size, "line": {"color": color, "width": 1}}
                    if symbol != "circle"
                    else {"color": color, "symbol": symbol, "size": size, "line": {"color": "white", "width": 0.5}},
                    text=[hover_text(row, shown) for _, row in frame.iterrows()],
                    hovertemplate="%{text}<extra></extra>",
                )
            )
        own = pareto.frontier(eligible[eligible["method"] == method], objective, PCT)
        if len(own) > 1:
            fig.add_trace(
                go.Scatter(
                    x=_x(own[PCT], floor),
                    y=own[objective],
                    mode="lines",
                    line={"color": color, "width": 1.3, "shape": "hv"},
                    opacity=0.35,
                    name=f"{method} frontier",
                    legendgroup=method,
                    showlegend=False,
                    hoverinfo="skip",
                )
            )
    if len(front):
        fig.add_trace(
            go.Scatter(
                x=_x(front[PCT], floor),
                y=front[objective],
                mode="lines+markers",
                name="Pareto frontier (all methods)",
                line={"color": "black", "width": 2, "shape": "hv"},
                marker={"symbol": "circle-open", "size": 15, "color": "black", "line": {"width": 1.5}},
                text=[hover_text(row, shown) for _, row in front.iterrows()],
                hovertemplate="<i>on the frontier</i><br>%{text}<extra></extra>",
            )
        )
    if ref is not None and len(ref):
        fig.add_trace(
            go.Scatter(
                x=_x(ref[PCT], floor),
                y=ref[objective],
                mode="markers",
                name=REFERENCE_LABEL.replace(": ", ":<br>"),
                marker={
                    "symbol": "diamond-open",
                    "size": 9,
                    "color": [method_color(m) for m in ref["method"]],
                    "line": {"width": 1.5},
                },
                text=[reference_hover(row, objective) for _, row in ref.iterrows()],
                hovertemplate="%{text}<extra></extra>",
            )
        )
    top = max([floor * 10, *trials[PCT].dropna(), *(ref[PCT] if ref is not None else [])])
    ticks = [floor, *_decades(floor, top)]
    backbone_params = trials["backbone_params"].dropna()
    size = f"% of the backbone's {human_count(backbone_params.iloc[0])}" if len(backbone_params) else "%"
    fig.update_layout(
        title={
            "text": plot_title(sweep, backbone, objective, tasks, status_summary, trials_split(trials)).replace(
                "\n", "<br>"
            ),
            "font": {"size": 14},
        },
        xaxis={
            "type": "log",
            "title": f"trainable parameters per task ({size}, log); 0 = heads only",
            "tickvals": ticks,
            "ticktext": ["0", *(_pct_text(t) for t in ticks[1:])],
        },
        yaxis={"title": metric_label(objective, tasks, trials_split(trials))},
        legend={"font": {"size": 11}},
        template="plotly_white",
        margin={"t": 80, "l": 60, "r": 20, "b": 60},
        width=width,
        height=height,
    )
    return fig


# ----------------------------------------------------------------------------- confirmed configurations (seed means)


def _interval(configs: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(upper, lower) lengths of the 95% interval bars around the seed means; 0 where undefined."""
    mean = configs["score_mean"].to_numpy(float)
    upper = np.nan_to_num(configs["score_ci_high"].to_numpy(float) - mean)
    lower = np.nan_to_num(mean - configs["score_ci_low"].to_numpy(float))
    return upper, lower


def confirmed_png(configs: pd.DataFrame, front: pd.DataFrame, path: str | Path, *, sweep: str, backbone: str) -> Path:
    """Seed means vs trainable parameters per task: thick bar = std, thin bar = 95% interval; the frontier on means.

    Frontier points marked ``≈`` are within noise of the next cheaper frontier point.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    floor = zero_floor(configs[PCT])
    fig, ax = plt.subplots(figsize=(11, 6.2), dpi=150, layout="constrained")
    handles = []
    for method in pareto.ordered_methods(configs["method"]):
        mine = configs[configs["method"] == method]
        x, y, color = _x(mine[PCT], floor), mine["score_mean"].to_numpy(float), method_color(method)
        upper, lower = _interval(mine)
        ax.errorbar(x, y, yerr=[lower, upper], fmt="none", ecolor=color, elinewidth=0.8, capsize=2, alpha=0.7)
        std = np.nan_to_num(mine["score_std"].to_numpy(float))
        ax.errorbar(x, y, yerr=std, fmt="o", color=color, ms=6, elinewidth=2.4, capsize=0, mec="white", zorder=4)
        handles.append(Line2D([], [], ls="", marker="o", ms=7, color=color, mec="white", label=method))
    if len(front):
        x, y = _x(front[PCT], floor), front["score_mean"].to_numpy(float)
        ax.step(x, y, where="post", color="black", lw=1.5, zorder=5)
        for xi, yi, label, word in zip(x, y, front["label"], front["vs_cheaper"], strict=True):
            text = f"{FRONTIER_MARKS.get(word, '')} {label}".strip()
            ax.annotate(text, (xi, yi), xytext=(6, 6), textcoords="offset points", fontsize=7.5, zorder=7)
        handles.append(Line2D([], [], color="black", lw=1.5, label="frontier of the seed means"))
    handles += [
        Line2D([], [], color="grey", lw=2.4, label="± std over seeds"),
        Line2D([], [], color="grey", lw=0.8, label="95% interval (t)"),
        Line2D([], [], ls="", label="=: equivalent to the cheaper frontier point; ?: not shown better"),
    ]
    ax.set_xscale("log")
    ax.set_xlabel("trainable parameters per task, % of the backbone (log; 0% drawn at the left edge)")
    ax.set_ylabel("dev score, mean over seeds")
    seeds = int(configs["seeds"].max()) if len(configs) else 0
    title = f"Sweep {sweep}: confirmed configurations, up to {seeds} seed(s) each\nbackbone {backbone}"
    ax.set_title(title, fontsize=11)
    ax.grid(True, alpha=0.3)
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def confirmed_figure(configs: pd.DataFrame, front: pd.DataFrame, *, sweep: str, width: int = 900, height: int = 520):
    """The interactive :func:`confirmed_png`: per method, error bars of the std (and a trace of the 95% intervals)."""
    import plotly.graph_objects as go

    floor = zero_floor(configs[PCT])
    fig = go.Figure()
    for method in pareto.ordered_methods(configs["method"]):
        mine = configs[configs["method"] == method]
        color = method_color(method)
        x, y = _x(mine[PCT], floor), mine["score_mean"]
        upper, lower = _interval(mine)
        fig.add_trace(
            go.Scatter(
                x=x,
                y=y,
                mode="markers",
                name=f"{method} 95% interval",
                legendgroup=method,
                showlegend=False,
                marker={"color": color, "size": 1, "opacity": 0},
                error_y={"type": "data", "symmetric": False, "array": upper, "arrayminus": lower, "thickness": 0.8},
                hoverinfo="skip",
            )
        )
        text = [
            f"{r['label']}<br>score {r['score_mean']:.4f} ± {r['score_std']:.4f} ({r['seeds']} seeds)"
            f"<br>95% interval [{r['score_ci_low']:.4f}, {r['score_ci_high']:.4f}]<br>trainable {r[PCT]:.3g}%"
            for r in mine.to_dict("records")
        ]
        fig.add_trace(
            go.Scatter(
                x=x,
                y=y,
                mode="markers",
                name=method,
                legendgroup=method,
                marker={"color": color, "size": 10},
                error_y={"type": "data", "array": np.nan_to_num(mine["score_std"].to_numpy(float)), "thickness": 2.5},
                text=text,
                hovertemplate="%{text}<extra></extra>",
                meta={"error": "std"},
            )
        )
    if len(front):
        fig.add_trace(
            go.Scatter(
                x=_x(front[PCT], floor),
                y=front["score_mean"],
                mode="lines+text",
                line={"color": "black", "width": 1.5, "shape": "hv"},
                text=[FRONTIER_MARKS.get(word, "") for word in front["vs_cheaper"]],
                textposition="top center",
                name="frontier of the seed means (=: equivalent to the cheaper point; ?: not shown better)",
                hoverinfo="skip",
            )
        )
    fig.update_layout(
        title=f"Sweep {sweep}: confirmed configurations, seed mean ± std (thin: 95% interval)",
        xaxis={"type": "log", "title": "trainable parameters per task, % of the backbone"},
        yaxis={"title": "dev score, mean over seeds"},
        width=width,
        height=height,
        template="plotly_white",
    )
    return fig
