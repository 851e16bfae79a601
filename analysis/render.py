"""A sweep's report as people read it: the Markdown page, the HTML page, and the display form of its tables.

Everything here is made from a :class:`~analysis.report.Report` and returned as text; nothing is written or logged
(:mod:`analysis.publish` does that). :func:`display_table` turns a table of numbers into the strings both pages
show; :func:`markdown_report` is ``report.md``, :func:`html_report` is ``report.html`` (self-contained, plotly.js
inlined once).
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from analysis import confirmed, pareto, plots, views
from analysis.report import Report, plan_of
from analysis.runs import COUNT_COLUMNS, SweepRuns
from peftune.base.record_names import BEST_EPOCH, CODE_VERSION, COMPLETED, HYPERPARAMETERS, metric_task
from peftune.record import legacy
from peftune.stats import decisions

# ----------------------------------------------------------------------------- the display form of the tables


def _fmt_metric(value) -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3f}"


def _fmt_pct(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if value == 0:
        return "0"
    return f"{value:.2f}" if abs(value) >= 0.1 else f"{value:.2g}"


INTEGER_COLUMNS = (
    "Trials",
    "Best epoch",
    "trials",
    "frontier_size",
    BEST_EPOCH,
    "epochs_run",
    "epochs",
    "batch_size",
)


INTEGER_COLUMNS += ("seed", "Seeds")


def _fmt_plain(value) -> str:
    """As logged: 64 (not 64.000), 16.5, query,key,value; empty for a missing value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def display_table(table: pd.DataFrame, *, short_ids: bool = True) -> pd.DataFrame:
    """Numbers -> the strings the Markdown and HTML tables show: metrics 3 decimals, % 2, counts with separators."""
    out = table.copy()
    for column in out.columns:
        values = out[column]
        if column.endswith("%") or column.endswith("_pct"):
            out[column] = values.map(_fmt_pct)
        elif column in ("Run id", "run_id") and short_ids:
            out[column] = values.map(lambda v: str(v)[:12] if isinstance(v, str) else "")
        elif column in ("On frontier", "Frontier"):
            out[column] = values.map(lambda v: "yes" if v else "")
        elif column == "lr":
            out[column] = values.map(lambda v: "" if pd.isna(v) else f"{v:.2e}")
        elif column.startswith("method.") or column in INTEGER_COLUMNS:  # method options: 64, not 64.000
            out[column] = values.map(_fmt_plain)
        elif column in COUNT_COLUMNS:
            out[column] = values.map(lambda v: "" if pd.isna(v) else f"{v:,.0f}")
        elif pd.api.types.is_datetime64_any_dtype(values):
            out[column] = values.dt.strftime("%Y-%m-%d %H:%M:%S UTC").astype(object).where(values.notna(), "")
        elif column == "train_time_s":
            out[column] = values.map(lambda v: "" if pd.isna(v) else f"{v:.1f}")
        elif pd.api.types.is_float_dtype(values):
            out[column] = values.map(_fmt_metric)
    return out.fillna("").astype(str)


def to_markdown(table: pd.DataFrame) -> str:
    """A GitHub Markdown table of ``table`` as is (no extra dependency); ``|`` in cells escaped."""

    def cell(value) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    header = "| " + " | ".join(map(cell, table.columns)) + " |"
    rule = "|" + "|".join("---" for _ in table.columns) + "|"
    rows = ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join([header, rule, *rows]) + "\n"


def hypervolume_table(summary: pd.DataFrame, objectives: Sequence[str]) -> pd.DataFrame:
    """One row per scope (all methods, then each method): completed trials, frontier size, hypervolume per objective."""
    scopes = list(dict.fromkeys(summary["scope"]))
    on_score = summary[summary["objective"] == "score"].set_index("scope")
    table = pd.DataFrame(
        {
            "Scope": ["all methods" if s == "all" else s for s in scopes],
            "Trials": on_score.loc[scopes, "trials"].to_numpy(),
            "Frontier size": on_score.loc[scopes, "frontier_size"].to_numpy(),
        }
    )
    for objective in objectives:
        values = summary[summary["objective"] == objective].set_index("scope").loc[scopes, "hypervolume"]
        name = "score" if objective == "score" else plots.task_name(metric_task(objective)[0], objective)
        table[f"HV {name}"] = values.to_numpy()
    return table


def side_table(table: pd.DataFrame) -> pd.DataFrame:
    """The AdaptBert table narrowed to sit beside the plot: no trial counts, epochs or run ids; short headers."""
    if not len(table):
        return table
    narrow = table.drop(columns=["Trials", "Best epoch", "Run id"], errors="ignore")
    return narrow.rename(
        columns={
            "Params updated per task %": "Params/task %",
            "Additional params stored %": "Stored %",
            "On frontier": "Frontier",
        }
    )


def expected_max_display(table: pd.DataFrame) -> pd.DataFrame:
    """Per method: the expected best after 1 (its default), 2, 3 and all of its trials."""
    rows = []
    for method, curve in table.groupby("method", sort=False):
        values = curve.set_index("n")["expected_best"]
        shown = sorted({1, 2, 3, int(values.index.max())} & set(values.index))
        row = {"Method": method, "Trials": int(values.index.max())}
        row |= {
            f"n={n}" + (" (default)" if n == 1 and curve["default"].iloc[0] else ""): f"{values[n]:.3f}" for n in shown
        }
        rows.append(row)
    return pd.DataFrame(rows).fillna("")


def own_rates_display(table: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({
        "Simulated": table["what"],
        "Rate [95% Monte-Carlo]": [f"{r:.3f} [{lo:.3f}, {hi:.3f}]" for r, lo, hi
                                   in zip(table["rate"], table["mc_low"], table["mc_high"], strict=True)],
        "Hits / simulations": [f"{h}/{n}" for h, n in zip(table["hits"], table["simulations"], strict=True)],
    })  # fmt: skip


# ----------------------------------------------------------------------------- header, notes and the plots' context


def _header_lines(sweep: SweepRuns) -> list[str]:
    p = sweep.parent_params
    keys = ("budget", "epochs", "batch_size", "max_length", "max_train_examples", "max_dev_examples")
    budget = ", ".join(f"{k} {p[k]}" for k in keys if k in p)
    return [
        f"- backbone: `{sweep.backbone}`; tasks: {', '.join(sweep.tasks)}; sweep status: {sweep.parent_status}",
        f"- trials: {sweep.status_summary()}",
        *_confirmation_line(sweep),
        f"- budget: {budget or 'not recorded'}; scheduler {p.get('scheduler', '?')}; "
        f"objective {p.get('objective', '?')}; {_search_mode(p)}; {_budget_unit(p)}",
        *_rows_line(sweep),
        *_skipped_rows_line(p),
        f"- MLflow: `{sweep.tracking_uri}`, experiment {sweep.experiment_id}, parent run `{sweep.parent_run_id}`",
        f"- code version: `{sweep.parent_tags.get(CODE_VERSION, 'unknown')}`",
    ]


def _confirmation_line(sweep: SweepRuns) -> list[str]:
    runs = sweep.confirmations
    if runs is None or not len(runs):
        return []
    return [
        f"- confirmation: {len(runs)} runs of {runs['config_key'].nunique()} configurations "
        f"({', '.join(f'{n} {s}' for s, n in runs['status'].value_counts().items())})"
    ]


def _search_mode(params: dict) -> str:
    """Whether the search was reproducible (each method's next trial after its earlier ones reported)."""
    if params.get("asynchronous") is None:
        return "search mode not recorded"
    if params.get("asynchronous") is True or str(params.get("asynchronous")) == "True":
        return "asynchronous search (draws and stops depend on timing)"
    return "synchronous search per method (reproducible: the same trials and stops whatever the timing)"


def _budget_unit(params: dict) -> str:
    """What each method's equal share of the search was counted in."""
    unit = params.get("budget_unit") or "trials"
    if params.get("allocation", "per_method") != "per_method":
        return "one joint search (no per-method share)"
    if unit == "trials":
        return "equal share per method: trials"
    return f"equal share per method: {unit} (trials_per_method full trials' worth each; the fairness table: the spend)"


def _rows_line(sweep: SweepRuns) -> list[str]:
    """The rows each role got per task (``train_examples.<task>`` and the others, as the sweep logged them): the
    search's train rows (the confirmation's are in the answer's notes), the selection, decision and dev splits."""
    metrics = sweep.parent_metrics or {}
    roles = ("train", "selection", "decision", "dev")
    parts = []
    for task in sweep.tasks:
        counts = {role: metrics.get(f"{role}_examples.{task}") for role in roles}
        if any(v is not None for v in counts.values()):
            given = ", ".join(f"{int(v):,} {role}" for role, v in counts.items() if v is not None)
            parts.append(f"{task}: {given}")
    return [f"- rows per role (the search's train rows): {'; '.join(parts)}"] if parts else []


def _skipped_rows_line(params: dict) -> list[str]:
    """The data rows the sweep did not train on (``invalid_rows: skip``): a reader must not miss them."""
    count = params.get("skipped_rows") or 0
    if not count:
        return []
    return [
        f"- data: {count} invalid row(s) skipped (invalid_rows: skip); file, line and reason of each in the "
        "parent run's `skipped_rows.json`"
    ]


def _train_rows(report: Report) -> str:
    """`` (N per task)``: what the confirmation runs trained on, from their recorded data settings; "" unknown."""
    runs = report.sweep.confirmations
    column = "data.max_train_examples"
    if runs is None or not len(runs) or column not in runs:
        return ""
    values = sorted({str(v) for v in runs[column].dropna()})
    words = ["every row not held out" if v == "None" else f"{v} per task" for v in values]
    return f" ({', '.join(words)})" if words else ""


def answer_notes(report: Report) -> dict[str, str]:
    """The sentences that say where the numbers of the answer come from (Markdown and HTML alike)."""
    configs = report.configs
    outcome = report.decisions.outcome
    sweep = report.sweep  # the plan the confirmation ran, else the one the sweep's params give (one builder)
    plan = outcome.plan if outcome is not None else None
    plan = plan or plan_of(sweep.parent_params, sweep.record_version, sweep.parent_run_id)
    margin = f"{plan.margin:g}"
    if len(configs) and configs["source"].iloc[0] == "confirmed":
        seeds = sorted(set(configs["seeds"].astype(int)))
        split = "dev" if (configs["split"] == "dev").all() else legacy.DEV_SELECTED
        source = (
            f"Seed means on {split} of the confirmation runs: each budget's contenders (its best configurations by "
            f"search score) and the anchors, re-trained with {'/'.join(map(str, seeds))} new seed(s) each on the "
            f"confirmation's train rows{_train_rows(report)}, each run at the epoch the selection split chose. The "
            f"search selected on the selection split, never on dev; the margin δ is {margin}."
        )
    else:
        source = (
            "No confirmation runs recorded: each configuration is its single search trial, scored on the split it "
            "selected on (no std, no decision)."
        )
    words = "; ".join(f"**{word}**: {meaning}" for word, meaning in decisions.WORDS.items())
    looks = f"up to {plan.looks} look(s), {plan.seeds} to {plan.max_seeds} seeds"
    return {
        "source": source,
        "noise": (
            f"Decisions are made on the decision split (train rows no trial trained on; dev chooses nothing): per "
            f"budget, each configuration under it against the best of the others, from an example part of the "
            f"error (shared by the configurations) and each configuration's own run variance (moderated toward "
            f"the others'), the seeds added in {looks} to the two configurations of the comparison that binds "
            f"each open question, each claim at 5% over all looks (Lan-DeMets spending); a configuration shown "
            f"worse by more than the margin gets no more seeds, and a question the seeds left cannot answer stops "
            f"(futile) with what would decide it. {words} (margin {margin}). The pick is the cheapest configuration "
            f"shown not worse than the best of the others under the budget by more than the margin; else the best "
            f"estimate, said as cannot tell. Each word has its interval and P(pick - best ≥ -δ) beside it; the plan "
            f"says, from the first look, the seeds each contender needs for 80% power were it equal to the best. "
            f"`decisions.csv` has every pair's own simultaneous interval with the level used (it picks nothing); "
            f"`seeds.csv` the seeds each configuration got and why it stopped. The claim rates are simulated at "
            f"this sweep's own sizes below, and by `peftune decide --simulate`. Definitions: "
            f"platform/peftune/stats/decisions.py, docs/decisions.md."
        ),
        "own_rates": (
            f"The decision procedure replayed on {confirmed.OWN_SIMULATIONS} simulated records per row, drawn "
            f"from this sweep's own measured variance components ({report.own_world}) with the truth known: "
            "at each budget's size K, the cheapest configuration (with the largest measured seed sd) truly the "
            "margin, half of it, twice it below the others or equal to them, and one equal to the best behind "
            "K - 2 twice the margin below; claims only, a pick left at 'cannot tell' counts for nothing "
            "(`own_rates.csv`; `mc_low`, `mc_high`: the Monte-Carlo 95% interval)."
            if len(report.own_rates)
            else f"Not simulated: {report.own_world}."
        ),
        "order_held": "The search ranks configurations on its own cheap fidelity (the budget's rows, ASHA's "
        "rungs); the confirmation re-trains them at the full budget. Per budget: the rank correlation of the two "
        "orders among the confirmed configurations under it, and any the search ranked below the pick that the "
        "confirmation puts above it. A per-method tuning gain read off the search stays at the search's fidelity.",
        "by_budget": "Each method's best confirmed configuration under the budget, against the budget's best "
        "(worse: the interval lies below 0).",
        "expected_max": "Per method, the expected best selection score of its first n search trials (trial 1: "
        "its published default; later ones drawn from its searched trials; Dodge et al. 2019): how much each "
        "further trial of tuning is worth (`expected_max.csv`).",
        "fairness": "Trials, steps, tokens (a prompt's vectors included) and compute seconds each method received in "
        "the search; default: the control arm (the method's published default), a seed mean where it was "
        "confirmed, else its one search run; tuning gain = best tuned seed mean − default, with its interval and "
        "decision where both were confirmed; spread: "
        "IQR and std of the completed search trials' selection scores (how sensitive the method is to tuning).",
    }


def plot_context(report: Report) -> dict:
    """What every score-versus-parameters plot of the report is told about its sweep."""
    sweep = report.sweep
    return {
        "sweep": sweep.name,
        "backbone": sweep.backbone,
        "tasks": sweep.tasks,
        "status_summary": sweep.status_summary(),
        "record_version": sweep.record_version,
        "reference": report.reference,
    }


# ----------------------------------------------------------------------------- Markdown


def markdown_report(report: Report) -> str:
    sweep = report.sweep
    lines = [f"# Sweep {sweep.name}: results", "", *_header_lines(sweep), ""]
    lines += answer_lines(report)
    lines += held_out_lines(report.directory)
    lines += [
        "From here on, the search's trials: one run each (no seeds), so gaps smaller than the noise above are "
        "not evidence. All figures are figures of each trial's best epoch on the split it selected on (selection; "
        "dev in records written before the selection split existed). Frontiers, hypervolumes and the "
        "table below use completed trials only; early-stopped and failed trials are listed apart.",
        "",
        "## Best configuration per method and size",
        "",
        "Params are the trainable parameters per task (shared + that task's own, heads excluded) and the "
        "parameters the method adds for all tasks, as % of the backbone. A size marked *untuned default* was "
        "tried only at the method's published default: its row says nothing of the method tuned at that size.",
        "",
        to_markdown(display_table(report.best)) if len(report.best) else "No completed trial yet.\n",
        "![score vs trainable parameters](score_vs_params.png)",
        "",
        "## Pareto frontier (score up, trainable parameters per task down)",
        "",
    ]
    lines += _frontier_lines(report)
    lines += _search_lines(report)
    return "\n".join(lines)


def answer_lines(report: Report) -> list[str]:
    """The report's opening: recommendation per budget, fairness per method, confirmed configurations."""
    notes = answer_notes(report)
    lines = ["## Recommendation per parameter budget", "", notes["source"], ""]
    if len(report.configs):
        lines += [to_markdown(confirmed.recommendation_display(report.recommendation)), notes["noise"], ""]
        lines += ["### Every method under each budget", "", notes["by_budget"], ""]
        lines += [to_markdown(confirmed.budget_table_display(report.by_budget)), ""]
        if len(report.order_held):
            lines += ["### How far the search's order held", "", notes["order_held"], ""]
            lines += [to_markdown(confirmed.order_held_display(report.order_held)), ""]
        lines += ["### How often this procedure errs at this sweep's sizes", "", notes["own_rates"], ""]
        if len(report.own_rates):
            lines += [to_markdown(own_rates_display(report.own_rates)), ""]
    else:
        lines += ["No completed trial yet.", ""]
    lines += ["## Fairness per method", "", notes["fairness"], ""]
    if len(report.fairness):
        lines.append(to_markdown(confirmed.fairness_display(report.fairness)))
    lines += ["", "### What tuning buys", "", notes["expected_max"], ""]
    if len(report.expected_max):
        lines += [
            to_markdown(expected_max_display(report.expected_max)),
            "",
            "![what tuning buys](expected_max.png)",
            "",
        ]
    lines += ["## Confirmed configurations (seed means)", ""]
    if len(report.configs):
        shown = confirmed.configurations_display(report.confirmed_front, report.configs, report.sweep.task_metrics)
        lines += [
            "Frontier: non-dominated on (seed mean up, trainable parameters per task down); beside each frontier "
            "point, its decision against the next cheaper one (better: its extra parameters buy a measurable gain).",
            "",
            to_markdown(shown),
            "![confirmed configurations](confirmed_frontier.png)",
            "",
        ]
    else:
        lines += ["None.", ""]
    return lines


def held_out_lines(directory: Path | None) -> list[str]:
    """The final evaluation on the held-out test split (``evaluation/``, written by ``peftune evaluate`` or a job's
    ``--test-dir``), when there is one: its table, under a heading that says which split it is."""
    path = directory / "evaluation" / "evaluation.md" if directory is not None else None
    if path is None or not path.is_file():
        return []
    table = path.read_text().split("\n\n", 1)[-1].replace("](evaluation.png)", "](evaluation/evaluation.png)")
    return [
        "## Held-out test split (final evaluation)",
        "",
        "The frontier's configurations re-trained with new seeds and scored once on the labelled test files, "
        "which nothing above selected on (details: `evaluation/evaluation.md`).",
        "",
        table,
        "",
    ]


def _frontier_lines(report: Report) -> list[str]:
    """The score's frontier of the search trials as a table, then each task's frontier in a line."""
    sweep, frontier_rows, lines = report.sweep, report.frontier, []
    front = frontier_rows[frontier_rows["objective"] == "score"] if len(frontier_rows) else frontier_rows
    if len(front):
        shown = front[["label", "score", *sweep.task_metrics, pareto.COST_PCT, *HYPERPARAMETERS, "run_id"]]
        lines.append(to_markdown(display_table(shown.rename(columns={pareto.COST_PCT: "trainable/task %"}))))
    else:
        lines.append("No completed trial yet.\n")
    lines += ["## Frontier per task", ""]
    if len(report.objectives) == 1:
        lines.append("One task: its frontier is the score's.")
    for metric in report.objectives[1:]:
        on = frontier_rows[frontier_rows["objective"] == metric] if len(frontier_rows) else frontier_rows
        labels = ", ".join(f"{r.label} ({getattr(r, metric):.3f})" for r in on.itertuples()) or "none"
        task = metric_task(metric)[0]
        lines.append(f"- **{plots.task_name(task)}** ({metric}): {labels} (plot: score_vs_params_{task}.png)")
    return lines


def _search_lines(report: Report) -> list[str]:
    """The hypervolume table, the trials that did not complete, and the hyperparameter importances."""
    trials, lines = report.trials, []
    lines += [
        "",
        "## Hypervolume",
        "",
        "Area of the (trainable parameters per task as a fraction of the backbone on a log axis from 0.001% "
        "to 100%, metric) plane the frontier of the search trials dominates, up to the reference point (100% "
        "of the backbone, metric 0); in [0, 1], every decade of parameters weighing the same. See "
        "`analysis/pareto.py` for the definition.",
        "",
    ]
    if len(report.summary):
        lines.append(to_markdown(display_table(hypervolume_table(report.summary, report.objectives))))
    unfinished = trials[trials["status"] != COMPLETED] if len(trials) else trials
    lines += ["## Trials not completed", ""]
    if len(unfinished):
        columns = ["trial_id", "label", "status", "epochs_run", "score", "error", "run_id"]
        lines.append(to_markdown(display_table(unfinished[columns])))
    else:
        lines.append("None.\n")
    lines += ["## Hyperparameter importance (PED-ANOVA)", ""]
    if len(report.importances):
        lines.append(to_markdown(display_table(report.importances)))
        lines.append("![importance](importance.png)\n")
    else:
        lines.append(f"Not computed: fewer than {views.MIN_TRIALS} completed trials.\n")
    lines += ["![parallel coordinates](parallel_coordinates.png)", ""]
    return lines + _slot_lines(report.slots)


def _slot_lines(table: pd.DataFrame) -> list[str]:
    """Where the slots' time went per phase (see :mod:`analysis.slots`)."""
    if not len(table):
        return []
    shown = table.assign(
        span_min=(table["span_s"] / 60).map(lambda v: f"{v:.1f}"),  # minutes, not a metric's 3 decimals
        outside=table["outside_share"].map(_fmt_pct_share),
        evaluation=table["eval_share"].map(_fmt_pct_share),
    )[["phase", "runs", "slots", "span_min", "outside", "evaluation"]]
    return [
        "## Where the time went",
        "",
        "Per phase: its span (first run's start to last run's end), the most runs open at once (slots), the "
        "share of span x slots outside every run's own timers (training, evaluation, start-up, checkpoints: "
        "Ray starting and stopping trials, a slot idle at the phase's end), and evaluation's share of the runs' "
        "timed seconds. The sweep row spans both phases, so its outside share also counts the hand-over between "
        "them.",
        "",
        to_markdown(display_table(shown)),
    ]


def _fmt_pct_share(value: float) -> str:
    return "-" if pd.isna(value) else f"{100 * value:.1f}%"


# ----------------------------------------------------------------------------- HTML


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; }
.row { display: flex; gap: 1.5em; align-items: flex-start; flex-wrap: wrap; }
.row > div { flex: 0 0 auto; } .row > div.side { flex: 0 1 720px; overflow-x: auto; }
table { border-collapse: collapse; font-size: 0.85em; } th, td { border: 1px solid #ccc; padding: 3px 6px; }
th { background: #f3f3f3; } td { text-align: right; } td:first-child, td:nth-child(2) { text-align: left; }
.note { color: #555; font-size: 0.9em; max-width: 70em; }
"""


def _table_html(table: pd.DataFrame, *, short_ids: bool = True) -> str:
    if not len(table):
        return "<p>none</p>"
    return display_table(table, short_ids=short_ids).to_html(index=False, border=0, escape=True)


class _Embedder:
    """Plotly figures -> HTML pieces of one page: plotly.js inlined with the first only (the page must work
    offline, and once is enough)."""

    def __init__(self):
        self.first = True

    def __call__(self, fig) -> str:
        width, height = fig.layout.width or 1000, fig.layout.height or 480  # fixed sizes: a layout that never reflows
        piece = fig.to_html(
            full_html=False, include_plotlyjs=self.first, default_width=f"{width}px", default_height=f"{height}px"
        )
        self.first = False
        return piece


def html_report(report: Report) -> str:
    """One self-contained page: plotly.js inlined once (the page must work offline), then every view."""
    embed = _Embedder()
    parts = _html_head(report.sweep)
    parts += _answer_html(report, embed)
    parts += _trials_html(report, embed)
    parts += _views_html(report, embed)
    parts.append("</body></html>")
    return "\n".join(parts)


def _html_head(sweep: SweepRuns) -> list[str]:
    esc = html.escape
    header = "".join(f"<li>{esc(line.removeprefix('- ').replace('`', ''))}</li>" for line in _header_lines(sweep))
    return [
        f"<!doctype html><html><head><meta charset='utf-8'><title>peftune report: {esc(sweep.name)}</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>Sweep {esc(sweep.name)}: score vs trainable parameters</h1><ul>{header}</ul>",
        "<p class='note'>Dev figures of each trial's best epoch. Frontiers and the table use completed trials only; "
        "crosses are trials stopped early. Hover a point for its hyperparameters and MLflow run id. Hollow diamonds: "
        "the AdaptBert report's published bert-base figures (another backbone), for reference only.</p>",
    ]


def _answer_html(report: Report, embed: _Embedder) -> list[str]:
    """The answer: the pick per budget, every method under each budget, fairness, the confirmed seed means."""
    esc, sweep, notes = html.escape, report.sweep, answer_notes(report)
    parts = ["<h2>Recommendation per parameter budget</h2>", f"<p class='note'>{esc(notes['source'])}</p>"]
    if len(report.configs):
        parts += [
            _table_html(confirmed.recommendation_display(report.recommendation)),
            f"<p class='note'>{esc(notes['noise'])}</p>",
            "<h3>Every method under each budget</h3>",
            f"<p class='note'>{esc(notes['by_budget'])}</p>",
            _table_html(confirmed.budget_table_display(report.by_budget)),
            "<h3>How often this procedure errs at this sweep's sizes</h3>",
            f"<p class='note'>{esc(notes['own_rates'])}</p>",
            _table_html(own_rates_display(report.own_rates)) if len(report.own_rates) else "",
        ]
    parts += ["<h2>Fairness per method</h2>", f"<p class='note'>{esc(notes['fairness'])}</p>"]
    parts.append(_table_html(confirmed.fairness_display(report.fairness)) if len(report.fairness) else "")
    if len(report.configs):
        shown = confirmed.configurations_display(report.confirmed_front, report.configs, sweep.task_metrics)
        about = {"sweep": sweep.name, "backbone": sweep.backbone}
        parts += [
            "<h2>Confirmed configurations (seed means)</h2><div class='row'><div class='plot'>",
            embed(plots.confirmed_figure(report.configs, report.confirmed_front, **about)),
            "</div><div class='side'>",
            _table_html(shown),
            "</div></div>",
        ]
    return parts


def _trials_html(report: Report, embed: _Embedder) -> list[str]:
    """The search trials: score vs parameters (hoverable) beside the best per method and size, then per task."""
    sweep, trials = report.sweep, report.trials
    if not len(trials):
        return ["<p>No trial recorded yet.</p>"]
    common = {**plot_context(report), "task_metrics": sweep.task_metrics}
    parts = [
        "<div class='row'><div class='plot' id='score-vs-params'>",  # every search trial, hoverable
        embed(plots.score_vs_params_figure(trials, objective="score", **common)),
        "</div><div class='side'><h2>Best configuration per method and size</h2>",
        _table_html(side_table(report.best)),
        "<p class='note'>Params: trainable per task and additionally stored, % of the backbone. "
        "Run ids: best_by_method_size.csv and the hover boxes.</p>",
        "</div></div>",
    ]
    if len(report.objectives) > 1:
        parts.append("<h2>Per task</h2>")
    parts.append("<div class='row'>")
    for metric in report.objectives[1:]:
        figure = plots.score_vs_params_figure(trials, objective=metric, width=780, height=480, **common)
        parts += ["<div>", embed(figure), "</div>"]
    parts.append("</div>")
    return parts


def _views_html(report: Report, embed: _Embedder) -> list[str]:
    """Frontier and hypervolume, parallel coordinates, importances, and every trial (folded)."""
    sweep, trials = report.sweep, report.trials
    parts = [
        "<h2>Frontier and hypervolume</h2>",
        _table_html(hypervolume_table(report.summary, report.objectives)) if len(report.summary) else "",
    ]
    parallel = views.parallel_coordinates_figure(
        trials, report.objectives[1:], sweep=sweep.name, backbone=sweep.backbone
    )
    if parallel is not None:
        parts += ["<h2>Parallel coordinates</h2>", embed(parallel)]
    parts.append("<h2>Hyperparameter importance (PED-ANOVA)</h2>")
    if len(report.importances):
        parts += [
            embed(views.importance_figure(report.importances, sweep=sweep.name, backbone=sweep.backbone)),
            _table_html(report.importances),
        ]
    else:
        parts.append(f"<p>Not computed: fewer than {views.MIN_TRIALS} completed trials.</p>")
    if len(trials):
        columns = [c for c in trials.columns if not c.startswith(("frontier.", "method_frontier."))]
        parts += [
            f"<h2>All trials</h2><details><summary>{html.escape(sweep.status_summary())}</summary>",
            _table_html(trials[columns].drop(columns=["size_value", "label"], errors="ignore"), short_ids=False),
            "</details>",
        ]
    return parts
