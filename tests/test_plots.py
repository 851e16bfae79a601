"""One description, two renderers: the PNG (matplotlib) and the HTML figure (plotly) draw the same plot.

The trials come from a real MLflow record (SQLite in tmp_path) written as ``peftune.record.writer`` writes it, and
are read back by ``analysis.runs``; the published reference is the packaged AdaptBert table.
"""

from __future__ import annotations

import contextlib

import matplotlib.pyplot as plt
import numpy as np
import pytest

from analysis import figure, pareto, plots, runs
from analysis.report import build_report, load_reference
from sweep_record import TrialSpec, counts, record_sweep

TASKS = ["sst", "para", "sts"]
LORA = {"alpha": 16.0, "targets": ["query", "key", "value"]}


def epochs(*scores: float) -> list[dict]:
    return [{"sst_accuracy": s - 0.1, "para_accuracy": s + 0.1, "sts_pearson": s} for s in scores]


TRIALS = [
    TrialSpec("t0", "frozen", {}, epochs(0.30, 0.35), counts(0)),  # heads only: drawn at the "0" tick
    TrialSpec("t1", "lora", {"rank": 4, **LORA}, epochs(0.50, 0.62), counts(2_000), lr=2e-3),
    TrialSpec("t2", "lora", {"rank": 8, **LORA}, epochs(0.58, 0.64), counts(4_000), lr=8e-4),
    TrialSpec("t3", "lora", {"rank": 16, **LORA}, epochs(0.60, 0.61), counts(8_000), lr=8e-4),  # dominated
    TrialSpec("t4", "adapter", {"bottleneck": 16}, epochs(0.55, 0.66), counts(9_000, 27_000)),
    TrialSpec("t5", "adapter", {"bottleneck": 64}, epochs(0.90), counts(30_000), status="early_stopped"),
    TrialSpec("t6", "bitfit", {}, epochs(0.70), counts(1_000), status="early_stopped"),  # no completed bitfit
    TrialSpec("t7", "prefix", {"prefix_length": 10}, [], counts(1_000), status="failed", error="OOM"),
]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    record_sweep(uri, "plots_sweep", TASKS, TRIALS, artifact_dir=root / "artifacts")
    return runs.read_sweep_record("plots_sweep", uri)


@pytest.fixture(scope="module")
def score_spec(sweep):
    return plots.score_vs_params(
        sweep.trials,
        sweep=sweep.name,
        backbone=sweep.backbone,
        tasks=sweep.tasks,
        status_summary=sweep.status_summary(),
        record_version=sweep.record_version,
        reference=load_reference(),
        task_metrics=sweep.task_metrics,
    )


@contextlib.contextmanager
def drawn(spec: figure.FigureSpec):
    """(matplotlib axes, plotly figure) of one description."""
    mpl = figure.draw_matplotlib(spec)
    try:
        yield mpl.axes[0], figure.to_plotly(spec)
    finally:
        plt.close(mpl)


def mpl_points(ax, gid: str) -> set[tuple[float, float]]:
    """The distinct points matplotlib drew for one series: scatter offsets and staircase vertices."""
    points = set()
    for collection in ax.collections:
        if collection.get_gid() == gid:
            points |= {(round(x, 9), round(y, 9)) for x, y in collection.get_offsets()}
    for line in ax.lines:
        if line.get_gid() == gid:
            points |= {(round(x, 9), round(y, 9)) for x, y in zip(line.get_xdata(), line.get_ydata(), strict=True)}
    return points


def plotly_points(trace) -> set[tuple[float, float]]:
    return {(round(x, 9), round(y, 9)) for x, y in zip(trace.x, trace.y, strict=True) if x is not None}


def legends(ax, fig) -> tuple[list[str], list[str]]:
    """The legend entries of both renderings, in order (plotly's line breaks written as newlines)."""
    mpl = [text.get_text() for text in ax.get_legend().get_texts()]
    html = [trace.name.replace("<br>", "\n") for trace in fig.data if trace.showlegend is not False]
    return mpl, html


def test_score_plot_describes_the_trials_as_the_record_holds_them(sweep, score_spec):
    by_kind = {}
    for series in score_spec.series:
        by_kind.setdefault(series.kind, []).append(series)
    trials = sweep.trials
    assert sum(len(s.x) for s in by_kind["trials"]) == (trials["status"] == "completed").sum() == 5
    assert sum(len(s.x) for s in by_kind["stopped"]) == 2
    front = pareto.frontier(trials)
    assert (
        list(by_kind["frontier"][0].labels)
        == list(front["label"])
        == ["frozen", "lora r=4", "lora r=8", "adapter m=16"]
    )
    (own,) = by_kind["method_frontier"]  # lora's: two of its three trials; adapter has one, frozen one
    assert own.group == "lora" and len(own.x) == 2
    assert len(by_kind["reference"][0].x) > 0
    # heads only sits on the first tick, labelled 0; the failed trial is not drawn
    floor = score_spec.x.ticks[0]
    assert score_spec.x.tick_labels[0] == "0" and floor in by_kind["trials"][0].x
    assert "1M" in score_spec.x.label and score_spec.count_scale == pytest.approx(1_000_000 / 100)
    # bitfit completed nothing: its crosses carry its legend entry
    assert [s.legend for s in by_kind["stopped"]] == [None, "bitfit"]


def test_both_renderers_draw_the_same_points_legend_and_axes(score_spec):
    with drawn(score_spec) as (ax, fig):
        assert len(fig.data) == len(score_spec.series) + len(score_spec.keys)
        for index, (series, trace) in enumerate(zip(score_spec.series, fig.data, strict=False)):
            expected = {(round(x, 9), round(y, 9)) for x, y in zip(series.x, series.y, strict=True)}
            assert trace.meta["kind"] == series.kind
            assert list(trace.hovertext or ()) == list(series.hover)  # the HTML shows it on hover
            assert mpl_points(ax, f"{index}:{series.kind}") == plotly_points(trace) == expected, series
        mpl_legend, html_legend = legends(ax, fig)
        assert mpl_legend == html_legend == [label for _, label, _ in score_spec.legend()]
        assert "Pareto frontier (all methods)" in mpl_legend and "stopped early (not on frontiers)" in mpl_legend
        assert ax.get_xlabel() == fig.layout.xaxis.title.text == score_spec.x.label
        assert (
            ax.get_ylabel()
            == fig.layout.yaxis.title.text
            == "dev score (mean of SST acc., Quora acc., STS Pearson r)"  # a record without a selection split
        )
        assert [t.get_text() for t in ax.get_xticklabels()] == list(fig.layout.xaxis.ticktext)
        assert ax.get_xscale() == fig.layout.xaxis.type == "log"
        assert np.allclose(10 ** np.array(fig.layout.xaxis.range), ax.get_xlim())
        assert fig.layout.title.text.replace("<br>", "\n") == ax.figure.get_suptitle() == score_spec.title
        # the frontier's labels: written beside its points in both
        annotations = [child.get_text() for child in ax.texts]
        frontier = next(s for s in score_spec.series if s.kind == "frontier")
        assert annotations == list(frontier.labels)
        assert list(fig.data[score_spec.series.index(frontier)].text) == list(frontier.labels)


def test_confirmed_plot_draws_the_same_bars_in_both(sweep):
    built = build_report(sweep, reference=False)  # no confirmation runs: each completed trial is a configuration
    spec = plots.confirmed_configurations(built.configs, built.confirmed_front, sweep="s", backbone="b")
    assert [s.kind for s in spec.series].count("means") == built.configs["method"].nunique()
    with drawn(spec) as (ax, fig):
        for index, (series, trace) in enumerate(zip(spec.series, fig.data, strict=False)):
            gid = f"{index}:{series.kind}"
            if series.error is None:
                assert mpl_points(ax, gid) == plotly_points(trace)
                continue
            below, above = series.error
            assert list(trace.error_y.array) == list(above) and list(trace.error_y.arrayminus) == list(below)
            bars = [c for c in ax.collections if c.get_gid() == gid]  # one vertical segment per point
            assert sum(len(c.get_segments()) for c in bars) == len(series.x) == len(trace.x)
        mpl_legend, html_legend = legends(ax, fig)
        assert (
            mpl_legend == html_legend
            and "± std over seeds" in mpl_legend
            and "frontier of the seed means" in mpl_legend
        )
        assert ax.get_xlabel() == fig.layout.xaxis.title.text and ax.get_ylabel() == "dev score, mean over seeds"


def test_the_png_and_html_wrappers_draw_the_description(tmp_path, sweep, score_spec):
    common = dict(sweep=sweep.name, backbone=sweep.backbone, tasks=sweep.tasks, status_summary=sweep.status_summary(),
                  record_version=sweep.record_version)  # fmt: skip
    path = plots.score_vs_params_png(sweep.trials, tmp_path / "plot.png", reference=load_reference(), **common)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000
    html = plots.score_vs_params_figure(
        sweep.trials, reference=load_reference(), task_metrics=sweep.task_metrics, **common
    )
    assert [t.name for t in html.data] == [t.name for t in figure.to_plotly(score_spec).data]
    empty = plots.score_vs_params(sweep.trials.iloc[0:0], **common)
    assert empty.note == "no trial with a dev result yet" and not empty.series
    with pytest.raises(ValueError, match="unknown series kind"):
        figure.Series("bars", np.zeros(1), np.zeros(1))
