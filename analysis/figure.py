"""A plot described once (:class:`FigureSpec`), drawn by matplotlib (the PNG) or plotly (the interactive HTML).

The description says *what* is drawn: series of points in data coordinates, each of one :data:`SERIES_KINDS`
(completed trials, stopped ones, a frontier, seed means with error bars...), their colours, legend
entries, hover texts and labels, and the axes (label, log scale, ticks, limits). The two renderers
below only say *how* a kind looks in their library (the style tables ``_MPL`` and ``_PLOTLY``), so the
PNG and the HTML cannot drift apart: they draw the same points, series, legend and axis labels.

What only one medium can do stays with its renderer: hover texts are shown by plotly only, and the
count axis on top (``count_scale``) by matplotlib only (the HTML hover box gives each point's count).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# what a series' marks mean; each renderer maps a kind to its look
SERIES_KINDS = (
    "trials",  # completed search trials: filled circles
    "stopped",  # trials stopped early: small crosses
    "method_frontier",  # one method's own frontier: a faint staircase
    "frontier",  # the frontier over all methods: a black staircase with rings on its points
    "reference",  # published figures of another backbone: hollow diamonds
    "interval",  # 95% intervals of seed means: thin error bars only
    "means",  # seed means: filled circles with thick error bars (the std)
    "means_frontier",  # the frontier of the seed means: a black staircase
)
KEY_KINDS = (*SERIES_KINDS, "std", "text")  # a legend key can also explain a bar's thickness, or be a line of text


@dataclass(frozen=True)
class Series:
    """Points of one kind: ``x``/``y`` in data coordinates (a staircase steps up after each point)."""

    kind: str
    x: np.ndarray
    y: np.ndarray
    color: str | tuple[str, ...] = "black"  # one colour, or one per point
    group: str = ""  # the method the marks belong to: the HTML legend shows and hides a group together
    legend: str | None = None  # this series' own legend entry; None: it has none
    hover: tuple[str, ...] = ()  # one text per point (HTML markup), shown on hover
    labels: tuple[str, ...] = ()  # one text per point, written beside it
    error: tuple[np.ndarray, np.ndarray] | None = None  # (below, above): error bar lengths per point

    def __post_init__(self):
        if self.kind not in SERIES_KINDS:
            raise ValueError(f"unknown series kind {self.kind!r}; expected one of {SERIES_KINDS}")
        for name in ("hover", "labels"):
            if getattr(self, name) and len(getattr(self, name)) != len(self.x):
                raise ValueError(f"{name}: {len(getattr(self, name))} texts for {len(self.x)} points")


@dataclass(frozen=True)
class Key:
    """A legend entry that explains a kind of mark rather than naming one series."""

    kind: str
    label: str
    color: str = "grey"


@dataclass(frozen=True)
class Axis:
    label: str
    log: bool = False
    ticks: tuple[float, ...] = ()  # empty: the library's own
    tick_labels: tuple[str, ...] = ()
    limits: tuple[float, float] | None = None


@dataclass(frozen=True)
class FigureSpec:
    title: str
    x: Axis
    y: Axis
    series: tuple[Series, ...]
    keys: tuple[Key, ...] = ()
    count_scale: float | None = None  # x * count_scale is a count: the PNG's top axis shows it
    count_label: str = ""
    note: str = ""  # written in the middle of the plot (an empty one says why)

    def legend(self) -> list[tuple[str, str, str | tuple[str, ...]]]:
        """(kind, label, colour) of every legend entry, in order: the series' own, then the keys."""
        own = [(s.kind, s.legend, s.color) for s in self.series if s.legend is not None]
        return own + [(k.kind, k.label, k.color) for k in self.keys]


# ----------------------------------------------------------------------------- matplotlib (PNG)

_MPL = {  # kind -> the calls that draw it: scatter (filled), rings (hollow), step (staircase), errorbar
    "trials": [("scatter", {"s": 42, "edgecolor": "white", "lw": 0.6, "zorder": 4})],
    "stopped": [("scatter", {"s": 26, "marker": "x", "lw": 1.1, "alpha": 0.7, "zorder": 3})],
    "method_frontier": [("step", {"where": "post", "alpha": 0.35, "lw": 1.3, "zorder": 2})],
    "frontier": [("step", {"where": "post", "lw": 1.8, "zorder": 5}), ("rings", {"s": 120, "lw": 1.2, "zorder": 6})],
    "reference": [("rings", {"s": 36, "marker": "D", "lw": 1.2, "zorder": 3})],
    "interval": [("errorbar", {"fmt": "none", "elinewidth": 0.8, "capsize": 2, "alpha": 0.7})],
    "means": [("errorbar", {"fmt": "o", "ms": 6, "elinewidth": 2.4, "capsize": 0, "mec": "white", "zorder": 4})],
    "means_frontier": [("step", {"where": "post", "lw": 1.5, "zorder": 5})],
}
_MPL_KEY = {  # kind -> its legend handle (a Line2D)
    "trials": {"ls": "", "marker": "o", "ms": 7, "mec": "white"},
    "stopped": {"ls": "", "marker": "x", "ms": 6},
    "method_frontier": {"lw": 1.3, "alpha": 0.45},
    "frontier": {"lw": 1.8, "marker": "o", "mfc": "none", "ms": 9},
    "reference": {"ls": "", "marker": "D", "mfc": "none", "ms": 6},
    "interval": {"lw": 0.8},
    "means": {"ls": "", "marker": "o", "ms": 7, "mec": "white"},
    "means_frontier": {"lw": 1.5},
    "std": {"lw": 2.4},
    "text": {"ls": ""},
}
_LABEL_OFFSETS = ((6, 6), (6, -13))  # alternate above / below: neighbouring frontier points often sit close


def draw_matplotlib(spec: FigureSpec):
    """The matplotlib figure of ``spec``; each series' artists carry ``gid`` ``<index>:<kind>``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, ax = plt.subplots(figsize=(11, 6.2), dpi=150, layout="constrained")
    for index, series in enumerate(spec.series):
        _draw_series(ax, series, f"{index}:{series.kind}")
    _axes_matplotlib(ax, spec)
    fig.suptitle(spec.title, fontsize=11)
    handles = [
        Line2D([], [], color=color if isinstance(color, str) else "dimgrey", label=label, **_MPL_KEY[kind])
        for kind, label, color in spec.legend()
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8.5, frameon=False)
    if spec.note:
        ax.text(0.5, 0.5, spec.note, transform=ax.transAxes, ha="center", color="grey")
    return fig


def to_png(spec: FigureSpec, path: str | Path) -> Path:
    """Draw ``spec`` with matplotlib into the PNG file ``path``."""
    import matplotlib.pyplot as plt

    fig = draw_matplotlib(spec)
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def _draw_series(ax, series: Series, gid: str) -> None:
    color = series.color if isinstance(series.color, str) else list(series.color)
    for call, style in _MPL[series.kind]:
        if call == "scatter":
            ax.scatter(series.x, series.y, color=color, gid=gid, **style)
        elif call == "rings":
            ax.scatter(series.x, series.y, facecolors="none", edgecolors=color, gid=gid, **style)
        elif call == "step":
            ax.step(series.x, series.y, color=color, gid=gid, **style)
        else:
            bars = ax.errorbar(series.x, series.y, yerr=list(series.error), color=color, ecolor=color, **style)
            for artist in bars.get_children():
                artist.set_gid(gid)
    labelled = zip(series.x, series.y, series.labels, strict=True) if series.labels else ()
    for i, (x, y, label) in enumerate(labelled):
        ax.annotate(
            label,
            (x, y),
            xytext=_LABEL_OFFSETS[i % 2],
            textcoords="offset points",
            fontsize=7.5,
            zorder=7,
            bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.75},
        )


def _axes_matplotlib(ax, spec: FigureSpec) -> None:
    from matplotlib.ticker import EngFormatter, FixedFormatter, FixedLocator, NullLocator

    for axis, which in ((spec.x, ax.xaxis), (spec.y, ax.yaxis)):
        which.set_label_text(axis.label)
        if axis.log:
            (ax.set_xscale if which is ax.xaxis else ax.set_yscale)("log")
        if axis.ticks:
            which.set_major_locator(FixedLocator(axis.ticks))
            which.set_minor_locator(NullLocator())
            which.set_major_formatter(FixedFormatter(axis.tick_labels))
        if axis.limits:
            (ax.set_xlim if which is ax.xaxis else ax.set_ylim)(*axis.limits)
    if spec.count_scale:
        scale = spec.count_scale
        top = ax.secondary_xaxis("top", functions=(lambda p: p * scale, lambda c: c / scale))
        top.xaxis.set_major_formatter(EngFormatter(places=0, sep=""))
        top.set_xlabel(spec.count_label, fontsize=9)
        top.tick_params(labelsize=8)
    ax.grid(True, which="major", alpha=0.3)


# ----------------------------------------------------------------------------- plotly (HTML)

_PLOTLY = {  # kind -> the trace's look (its colour is merged into marker and line)
    "trials": {"mode": "markers", "marker": {"symbol": "circle", "size": 9, "line": {"color": "white", "width": 0.5}}},
    "stopped": {"mode": "markers", "marker": {"symbol": "x-thin-open", "size": 8, "line": {"width": 1}}},
    "method_frontier": {"mode": "lines", "line": {"width": 1.3, "shape": "hv"}, "opacity": 0.35},
    "frontier": {
        "mode": "lines+markers",
        "line": {"width": 2, "shape": "hv"},
        "marker": {"symbol": "circle-open", "size": 15, "line": {"width": 1.5}},
    },
    "reference": {"mode": "markers", "marker": {"symbol": "diamond-open", "size": 9, "line": {"width": 1.5}}},
    "interval": {"mode": "markers", "marker": {"size": 1, "opacity": 0}, "error_y": {"thickness": 0.8}},
    "means": {"mode": "markers", "marker": {"size": 10}, "error_y": {"thickness": 2.5}},
    "means_frontier": {"mode": "lines", "line": {"width": 1.5, "shape": "hv"}},
    "std": {"mode": "lines", "line": {"width": 2.5}},
    "text": {"mode": "markers", "marker": {"opacity": 0}},
}
_TEXT_POSITIONS = ("top right", "bottom right")  # as the PNG's label offsets


def to_plotly(spec: FigureSpec, *, width: int = 900, height: int = 540):
    """The interactive plotly figure of ``spec``; each trace's ``meta`` holds its series' ``kind``."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for series in spec.series:
        fig.add_trace(go.Scatter(**_trace(series)))
    for key in spec.keys:  # legend-only traces: no point (x None), an entry that explains a kind of mark
        style = _styled(key.kind, key.color)
        legend_only = {"x": [None], "y": [None], "name": _html(key.label), "hoverinfo": "skip"}
        fig.add_trace(go.Scatter(**legend_only, meta={"key": key.kind}, **style))
    fig.update_layout(
        title={"text": _html(spec.title), "font": {"size": 14}},
        xaxis=_axis_plotly(spec.x),
        yaxis=_axis_plotly(spec.y),
        legend={"font": {"size": 11}},
        template="plotly_white",
        margin={"t": 80, "l": 60, "r": 20, "b": 60},
        width=width,
        height=height,
    )
    if spec.note:
        fig.add_annotation(text=spec.note, x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False)
    return fig


def _trace(series: Series) -> dict:
    trace = _styled(series.kind, series.color)
    trace |= {"x": series.x, "y": series.y, "meta": {"kind": series.kind}}
    trace |= {"name": _html(series.legend or f"{series.group} {series.kind}".strip())}
    trace |= {"showlegend": series.legend is not None}
    if series.group:
        trace["legendgroup"] = series.group  # clicking a method in the legend hides its crosses and frontier too
    if series.hover:
        # hovertext, not customdata: with these strings as customdata, plotly.js drew no marker (seen in Chromium)
        trace |= {"hovertext": list(series.hover), "hovertemplate": "%{hovertext}<extra></extra>"}
    else:
        trace["hoverinfo"] = "skip"
    if series.labels:
        trace["mode"] += "+text"
        trace["text"] = [_html(label) for label in series.labels]
        trace["textposition"] = [_TEXT_POSITIONS[i % 2] for i in range(len(series.labels))]
        trace["textfont"] = {"size": 10}
    if series.error is not None:
        below, above = series.error
        bars = {"type": "data", "symmetric": False, "array": above, "arrayminus": below}
        trace["error_y"] = {**trace.get("error_y", {}), **bars}
    return trace


def _styled(kind: str, color: str | tuple[str, ...]) -> dict:
    """The kind's look with ``color`` in its marker, its line and its marker's outline (unless set)."""
    style = copy.deepcopy(_PLOTLY[kind])
    color = color if isinstance(color, str) else list(color)
    for part in ("marker", "line", "error_y"):
        if part in style:
            style[part].setdefault("color", color if part == "marker" or isinstance(color, str) else "dimgrey")
    if "line" in style.get("marker", {}):
        style["marker"]["line"].setdefault("color", color)
    return style


def _axis_plotly(axis: Axis) -> dict:
    out: dict = {"title": _html(axis.label)}
    if axis.log:
        out["type"] = "log"
    if axis.ticks:
        out |= {"tickvals": list(axis.ticks), "ticktext": list(axis.tick_labels)}
    if axis.limits:
        out["range"] = [math.log10(v) for v in axis.limits] if axis.log else list(axis.limits)
    return out


def _html(text: str) -> str:
    return text.replace("\n", "<br>")
