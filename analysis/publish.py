"""The report of a sweep published: its files written into a directory, logged to the sweep's parent run.

``peftune report --sweep NAME`` calls :func:`report_sweep`; a sweep job can call :func:`on_sweep_finished` at its
end (``peftune.sweep.orchestrator.run_sweep(..., on_finished=...)``). What the report says is :mod:`analysis.report`,
how it reads :mod:`analysis.render`; here: the files (written beside the directory, then moved into place), the PNG
plots, the artifacts, metrics and description of the parent run. The directory (default ``reports/<sweep>/``) is
also logged under ``report/`` in the sweep's parent run; its files, one by one: docs/report.md.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from analysis import confirmed, pareto, plots, views
from analysis.render import answer_notes, display_table, html_report, markdown_report, plot_context, to_markdown
from analysis.report import Report, build_report
from analysis.runs import SweepRuns, read_sweep_record
from peftune.base.errors import UserError
from peftune.base.record_names import (
    BACKBONE_PARAMS,
    COMPLETED,
    REPORTS_DIR,
    metric_task,
)
from peftune.record import writer
from peftune.record.ui_links import artifact_route, compare_address, compare_route
from peftune.stats import decisions

log = logging.getLogger("analysis.report")  # the report's log lines, under the name they have always had

ARTIFACT_PATH = "report"


# ----------------------------------------------------------------------------- written and logged


def report_sweep(
    name: str,
    tracking_uri: str | None = None,
    output: str | Path | None = None,
    *,
    reference: bool = True,
    log_artifacts: bool = True,
) -> Report:
    """Read sweep ``name``, write its report to ``output`` (default ``reports/<name>``), log it to the parent run."""
    started = time.perf_counter()
    sweep = read_sweep_record(name, tracking_uri)
    report = write_report(sweep, output or Path(REPORTS_DIR) / name, reference=reference)
    if log_artifacts:
        log_report(report)
    log.info(
        "report of sweep %s (%s) in %s, %.1fs",
        name,
        sweep.status_summary(),
        report.directory,
        time.perf_counter() - started,
    )
    return report


def on_sweep_finished(result) -> Report | None:
    """Hook for ``peftune.sweep.orchestrator.run_sweep(..., on_finished=on_sweep_finished)``: the report at the end of a
    job.

    A report that fails must not turn a finished sweep into a failed job: the error is logged with
    the command that retries it.
    """
    try:
        report = report_sweep(result.name, result.tracking_uri, result.report_dir)
    except UserError as error:  # e.g. every trial failed: the sweep's summary says so, and this is no bug
        log.warning(
            "no report of sweep %s: %s. Retry with: peftune report --sweep %s --tracking-uri %s --output %s",
            result.name,
            error,
            result.name,
            result.tracking_uri,
            result.report_dir,
        )
        return None
    except Exception:
        log.exception(
            "the report of sweep %s failed; the sweep itself is recorded. Retry with: "
            "peftune report --sweep %s --tracking-uri %s --output %s",
            result.name,
            result.name,
            result.tracking_uri,
            result.report_dir,
        )
        return None
    print(f"report: {report.directory}/report.html (also logged to MLflow run {result.parent_run_id})", flush=True)
    runs = frontier_run_ids(report)
    if runs:
        where = compare_address(result.tracking_uri, result.experiment_id, runs)
        print(f"MLflow compare, the confirmed frontier's {len(runs)} runs: {where}", flush=True)
    return report


# ----------------------------------------------------------------------------- the files


def write_report(sweep: SweepRuns, directory: str | Path, *, reference: bool = True) -> Report:
    """Build the report and write every file of it into ``directory`` (see the module docstring).

    A sweep without a completed trial has nothing to report: a user error, and nothing is written. The files
    are written into a temporary folder beside ``directory``, then moved into place (:func:`_move_into_place`),
    so a failure midway leaves ``directory`` as it was, never a report half old and half new.
    """
    if not (len(sweep.trials) and (sweep.trials["status"] == COMPLETED).any()):
        raise UserError(
            f"sweep {sweep.name!r} has no completed trial yet ({sweep.status_summary()}): nothing to report; "
            f"run the sweep's command again to resume it (a failed trial's error is its peftune.error tag in MLflow)"
        )
    report = build_report(sweep, reference=reference)
    report.directory = directory = Path(directory)
    made = [d for d in (directory.parent, *directory.parent.parents) if not d.exists()]
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".partial", dir=directory.parent))
    try:
        _write_files(report, staging)
        _move_into_place(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for folder in made:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only when empty
        raise
    return report


def _move_into_place(staging: Path, directory: Path) -> None:
    """The written report becomes ``directory``: renamed whole when there is none (or an empty one); else each
    file replaces its old self (renames, once everything is written), and the folder's other content stays:
    ``evaluation/`` (``peftune evaluate``), or whatever else a user keeps there."""
    if directory.is_dir() and not any(directory.iterdir()):
        directory.rmdir()
    if not directory.exists():
        staging.rename(directory)
        return
    for stale in directory.glob("score_vs_params_*.png"):  # a task plot of an earlier report
        stale.unlink()
    for file in staging.iterdir():
        os.replace(file, directory / file.name)
    staging.rmdir()


def _write_files(report: Report, staging: Path) -> None:
    """Every file of ``report`` into ``staging``; ``report.files`` lists them where they will be, in its directory."""
    trials = report.trials

    def out(name: str) -> Path:
        report.files.append(report.directory / name)
        return staging / name

    trials.to_csv(out("trials.csv"), index=False)
    report.best.to_csv(out("best_by_method_size.csv"), index=False)
    best_md = to_markdown(display_table(report.best)) if len(report.best) else "No completed trial yet.\n"
    out("best_by_method_size.md").write_text(best_md)
    report.frontier.to_csv(out("frontier.csv"), index=False)
    report.summary.to_csv(out("frontier_summary.csv"), index=False)
    report.importances.to_csv(out("importance.csv"), index=False)
    report.configs.to_csv(out("configurations.csv"), index=False)
    report.confirmed_front.to_csv(out("confirmed_frontier.csv"), index=False)
    report.recommendation.to_csv(out("recommendation.csv"), index=False)
    report.fairness.to_csv(out("fairness.csv"), index=False)
    report.decisions.table.to_csv(out("decisions.csv"), index=False)
    decisions.seeds_table(report.decisions.outcome).to_csv(out("seeds.csv"), index=False)
    report.by_budget.to_csv(out("by_budget.csv"), index=False)
    report.expected_max.to_csv(out("expected_max.csv"), index=False)
    report.slots.to_csv(out("slots.csv"), index=False)
    report.own_rates.to_csv(out("own_rates.csv"), index=False)
    _write_plots(report, out)
    out("report.md").write_text(markdown_report(report))  # reads the directory's evaluation/, if there is one
    out("report.html").write_text(html_report(report), encoding="utf-8")


def _write_plots(report: Report, out: Callable[[str], Path]) -> None:
    """The report's PNG plots; ``out(name)``: the path of a new file of the report."""
    sweep, trials = report.sweep, report.trials
    views.expected_max_png(report.expected_max, out("expected_max.png"), sweep=sweep.name, backbone=sweep.backbone)
    if len(report.configs):
        plots.confirmed_png(
            report.configs,
            report.confirmed_front,
            out("confirmed_frontier.png"),
            sweep=sweep.name,
            backbone=sweep.backbone,
        )
    if len(trials):
        common = plot_context(report)
        for objective in report.objectives:
            task = metric_task(objective)[0]
            name = "score_vs_params.png" if objective == "score" else f"score_vs_params_{task}.png"
            plots.score_vs_params_png(trials, out(name), objective=objective, **common)
        views.parallel_coordinates_png(
            trials, out("parallel_coordinates.png"), report.objectives[1:], sweep=sweep.name, backbone=sweep.backbone
        )
        views.importance_png(
            report.importances,
            out("importance.png"),
            sweep=sweep.name,
            backbone=sweep.backbone,
            n_trials=len(pareto.eligible(trials)),
        )


# ----------------------------------------------------------------------------- the parent run


def log_report(report: Report) -> None:
    """Log the report directory as artifacts of the sweep's parent run, under ``report/``, and its headline as the
    run's description (:func:`description`).

    Also the frontier's summary as parent-run metrics, so the MLflow runs table shows it without a
    click: ``sweep_frontier_size`` and ``sweep_hypervolume`` (all methods, the combined score).
    """
    sweep = report.sweep
    writer.log_report_files(sweep.tracking_uri, sweep.parent_run_id, report.directory, ARTIFACT_PATH,
                                   note=description(report), metrics=headline_frontier(report))  # fmt: skip


def headline_frontier(report: Report) -> dict[str, float]:
    """``sweep_frontier_size`` and ``sweep_hypervolume`` of the answer: the confirmed configurations' seed means
    (their frontier, the hypervolume on the log-cost axis); without confirmation, the completed search trials."""
    configs = report.configs
    if len(configs) and configs["source"].iloc[0] == "confirmed":
        fraction = configs[pareto.COST] / configs[BACKBONE_PARAMS]
        return {
            "sweep_frontier_size": float(len(report.confirmed_front)),
            "sweep_hypervolume": pareto.hypervolume(configs["score_mean"], fraction),
        }
    summary = report.summary
    overall = summary[(summary["scope"] == "all") & (summary["objective"] == "score")] if len(summary) else summary
    if not len(overall):
        return {}
    row = overall.iloc[0]
    return {"sweep_frontier_size": float(row["frontier_size"]), "sweep_hypervolume": float(row["hypervolume"])}


# ----------------------------------------------------------------------------- the parent run's description


NOTE_CHARS = 8000  # MLflow's limit on a tag's value


DESCRIPTION_COLUMNS = ("Budget (trainable/task)", "Pick", "Trainable/task (%)", "Dev score (mean ± std)", "Seeds",
                       "Pick vs best", "Runner-up (another method)", "Best vs runner-up")  # fmt: skip


def frontier_run_ids(report: Report) -> list[str]:
    """The runs of the frontier's configurations: their confirmation runs (completed), else their search trials."""
    if not len(report.confirmed_front):
        return []
    confirmations = report.sweep.confirmations
    confirmed_runs = report.configs["source"].iloc[0] == "confirmed" and confirmations is not None
    runs = confirmations[confirmations["status"] == COMPLETED] if confirmed_runs else report.sweep.trials
    return runs.loc[runs["config_key"].isin(set(report.confirmed_front["config_key"])), "run_id"].tolist()


def description(report: Report) -> str:
    """The sweep's parent run's description in the MLflow UI (Markdown): the report's headline first (the UI shows
    its first lines, the rest under "Show more"): the pick per budget and the frontier in a line each, links to
    the report's files and to the frontier's runs compared; then the recommendation and frontier tables."""
    sweep = report.sweep
    route = functools.partial(artifact_route, sweep.experiment_id, sweep.parent_run_id)
    files = (
        f"[report.md]({route(f'{ARTIFACT_PATH}/report.md')}), [report.html]({route(f'{ARTIFACT_PATH}/report.html')})"
    )
    lines = [f"**Sweep `{sweep.name}`** on `{sweep.backbone}`: {sweep.status_summary()}; the full report: {files}.", ""]
    picks = [f"≤ {r.budget_pct:g}%: {_pick(r)}" for r in report.recommendation.itertuples(index=False)]
    picked = "; ".join(picks) or "none yet"
    lines += [f"**Pick per budget** (trainable parameters per task; score mean ± std over seeds): {picked}.", ""]
    runs = frontier_run_ids(report)
    front = report.confirmed_front
    points = [f"{r.label} ({r[pareto.COST_PCT]:.2g}%, {r['score_mean']:.3f})" for _, r in front.iterrows()]
    compare = f" [Compare its {len(runs)} runs]({compare_route(sweep.experiment_id, runs)})." if runs else ""
    lines += [f"**Frontier**, cheapest first: {' → '.join(points) or 'none yet'}.{compare}", ""]
    tables = ["### Recommendation per parameter budget", "", answer_notes(report)["source"], ""]
    if len(report.recommendation):
        shown = confirmed.recommendation_display(report.recommendation)
        tables.append(to_markdown(shown[[c for c in DESCRIPTION_COLUMNS if c in shown]]))
    if len(front):
        shown = confirmed.configurations_display(front, report.configs, sweep.task_metrics)
        tables += ["### The frontier's configurations", "", to_markdown(shown[shown["Frontier"].str.startswith("yes")])]
    text = "\n".join(lines + tables)
    return text if len(text) <= NOTE_CHARS else "\n".join(lines)[:NOTE_CHARS]


def _pick(row) -> str:
    """One budget's pick as the headline says it: ``lora r=8, dev 0.412 ± 0.010``."""
    if not isinstance(row.label, str) or not row.label:
        return "none fits"
    return f"{row.label}, {row.mean:.3f} ± {row.std:.3f}" if math.isfinite(row.std) else f"{row.label}, {row.mean:.3f}"
