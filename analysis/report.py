"""What a sweep's report says: its tables, computed from the sweep's runs (nothing is written here).

:func:`build_report` reads a :class:`~analysis.runs.SweepRuns` into a :class:`Report`: every trial with its frontier
flags, the best configuration per method and size (the AdaptBert tables' shape), the frontiers and hypervolumes, the
importances, the published reference, and the answer (:mod:`analysis.confirmed`): the configurations' seed means, the
decisions the confirmation ran (replayed here on the sweep's record), the pick per budget, the fairness table.
:mod:`analysis.render` turns a ``Report`` into Markdown and HTML; :mod:`analysis.publish` writes its files and logs
them to the sweep's parent run.

Three roles of data: the search selects on the selection split (train-file rows no trial trains on);
the answer (recommendation, fairness, configurations, decisions) is dev figures of the confirmation runs;
the test split appears only in ``evaluation/`` (see :mod:`analysis.evaluate`). The search trials' own
figures (frontiers of trials, hypervolumes, importances) are selection figures.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from analysis import confirmed, pareto, plots, slots, views
from analysis.runs import SweepRuns, load_predictions
from peftune.base.record_names import BEST_EPOCH, DECISION, STORED_PARAMS_PCT, metric_task
from peftune.inputs.tasks import get_task
from peftune.record import legacy
from peftune.stats.decisions import Plan

REFERENCE_FILE = "adaptbert_table3.csv"


# ----------------------------------------------------------------------------- the report


@dataclass
class Report:
    """A sweep's report, computed (:func:`build_report`), possibly written (:func:`analysis.publish.write_report`)."""

    sweep: SweepRuns
    trials: pd.DataFrame  # every trial with frontier.<objective> / method_frontier.<objective> flags
    best: pd.DataFrame  # best per method and size, AdaptBert shape (numbers)
    frontier: pd.DataFrame  # the trials on the frontier of each objective (column ``objective``)
    summary: pd.DataFrame  # frontier size and hypervolume per scope and objective
    importances: pd.DataFrame
    reference: pd.DataFrame | None  # AdaptBert Table 3, when drawn
    directory: Path | None = None
    files: list[Path] = field(default_factory=list)
    # the answer (analysis.confirmed): configurations with seed statistics, their frontier with
    # within-noise marks, the recommendation per parameter budget, the fairness table per method
    configs: pd.DataFrame = field(default_factory=pd.DataFrame)
    confirmed_front: pd.DataFrame = field(default_factory=pd.DataFrame)
    recommendation: pd.DataFrame = field(default_factory=pd.DataFrame)
    fairness: pd.DataFrame = field(default_factory=pd.DataFrame)
    decisions: confirmed.Decided = field(default_factory=lambda: confirmed.Decided(pd.DataFrame()))  # decisions.csv
    by_budget: pd.DataFrame = field(default_factory=pd.DataFrame)  # every method's best under each budget
    order_held: pd.DataFrame = field(default_factory=pd.DataFrame)  # how far the search's order held, per budget
    expected_max: pd.DataFrame = field(default_factory=pd.DataFrame)  # per method: E[best] after n trials
    slots: pd.DataFrame = field(default_factory=pd.DataFrame)  # per phase: where the slots' time went
    own_world: str = ""  # the measured components the own rates were simulated from (or why none)
    own_rates: pd.DataFrame = field(default_factory=pd.DataFrame)  # the procedure's rates at this sweep's sizes

    @property
    def objectives(self) -> list[str]:
        return report_objectives(self.sweep)


def report_objectives(sweep: SweepRuns) -> list[str]:
    """The score, then each task's metric; a one-task sweep has only the score (it is that task's metric)."""
    return ["score", *sweep.task_metrics] if len(sweep.task_metrics) > 1 else ["score"]


def build_report(sweep: SweepRuns, *, reference: bool = True) -> Report:
    """Frontiers, tables and importances of ``sweep`` (nothing written)."""
    objectives = report_objectives(sweep)
    if not len(sweep.trials):
        empty = pd.DataFrame()
        return Report(
            sweep,
            sweep.trials,
            empty,
            pd.DataFrame(columns=["objective"]),
            empty,
            empty,
            load_reference() if reference else None,
        )
    trials = pareto.mark_frontiers(sweep.trials, objectives)
    best = pareto.best_per_method_size(trials)
    frontier_ids = set(trials.loc[trials["frontier.score"], "run_id"])
    table = adaptbert_table(best, sweep.task_metrics, frontier_ids) if len(best) else pd.DataFrame()
    fronts = [pareto.frontier(trials, objective).assign(objective=objective) for objective in objectives]
    frontier_rows = pd.concat(fronts)
    frontier_rows = frontier_rows[["objective", *[c for c in frontier_rows.columns if c != "objective"]]]
    configs = confirmed.configurations(sweep)
    decided = decide(sweep, configs)
    own_world, own_rates = confirmed.own_rates(decided)
    seconds = confirmed.seconds_per_confirmation_run(sweep)
    recommendation = confirmed.recommendations(configs, decided, seconds_per_run=seconds,
                                               record_version=sweep.record_version)  # fmt: skip
    return Report(
        sweep=sweep,
        trials=trials,
        best=table,
        frontier=frontier_rows,
        summary=pareto.frontier_summary(trials, objectives),
        importances=views.param_importances(trials, objectives[1:]),
        reference=load_reference() if reference else None,
        configs=configs,
        confirmed_front=confirmed.seed_mean_frontier(configs, decided),
        recommendation=recommendation,
        order_held=confirmed.order_held(configs, recommendation),
        fairness=confirmed.fairness(sweep, configs, decided),
        decisions=decided,
        by_budget=confirmed.budget_table(configs, decided),
        expected_max=views.expected_max_table(sweep.trials),
        slots=slots.slot_table(sweep.trials, sweep.confirmations),
        own_world=own_world,
        own_rates=own_rates,
    )


def adaptbert_table(
    best: pd.DataFrame, task_metrics: Sequence[str], frontier_ids: set[str] = frozenset()
) -> pd.DataFrame:
    """The AdaptBert tables' shape: method and size, each task's dev metric, average, params % (numbers, unrounded).

    ``best`` is :func:`analysis.pareto.best_per_method_size`; ``frontier_ids`` marks rows on the frontier.
    """
    columns = {"method": "Method", "size": "Size"}
    for metric in task_metrics:
        columns[metric] = plots.task_name(metric_task(metric)[0], metric)
    columns.update(
        {
            "score": "Average",
            pareto.COST_PCT: "Params updated per task %",
            STORED_PARAMS_PCT: "Additional params stored %",
            "trials_in_group": "Trials",
            BEST_EPOCH: "Best epoch",
            "run_id": "Run id",
        }
    )
    table = best[list(columns)].rename(columns=columns).reset_index(drop=True)
    marks = [
        confirmed.setting_mark(bool(row.get("default")), bool(row.get("carried_from")), row["trials_in_group"] > 1)
        for _, row in best.iterrows()
    ]
    table["Size"] = [(size + mark).strip() for size, mark in zip(table["Size"], marks, strict=True)]
    table.insert(len(table.columns) - 1, "On frontier", best["run_id"].isin(frontier_ids).to_numpy())
    return table


def decide(sweep: SweepRuns, configs: pd.DataFrame) -> confirmed.Decided:
    """The decision procedure the confirmation ran, replayed on the sweep's record (decision split)."""
    plan = plan_of(sweep.parent_params, sweep.record_version, sweep.parent_run_id)
    if not len(configs) or configs["source"].iloc[0] != "confirmed":
        return confirmed.decide(configs, pd.DataFrame(), {}, plan)
    kinds = {task: get_task(task).kind for task in sweep.tasks}
    return confirmed.decide(configs, load_predictions(sweep, splits=(DECISION,)), kinds, plan)


def plan_of(params: dict, version: int = legacy.RECORD_VERSION, run_id: str = "") -> Plan:
    """The decision plan a sweep ran with, from its parent run's (``run_id``) params in a record of ``version``: the
    sweep's own builder, ``Plan.from_params`` (an old record's defaults where a param is missing)."""
    return Plan.from_params(params, version=version, run_id=run_id)


# ----------------------------------------------------------------------------- the published reference


def load_reference() -> pd.DataFrame:
    """The AdaptBert report's Table 3 (bert-base-uncased, dev), in this package's column names.

    Published figures of another backbone and budget: plotted as a sanity reference, never ranked
    against the sweep.
    """
    path = importlib.resources.files("analysis") / "reference" / REFERENCE_FILE
    with path.open() as f:
        table = pd.read_csv(f, dtype={"size": "string"})
    return table.rename(
        columns={
            "score_avg": "score",
            "sst_acc": "sst_accuracy",
            "para_acc": "para_accuracy",
            "params_updated_per_task_pct": pareto.COST_PCT,
            "additional_params_stored_pct": STORED_PARAMS_PCT,
        }
    ).assign(size=lambda t: t["size"].fillna("").astype(str))
