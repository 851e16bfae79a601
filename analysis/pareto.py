"""Pareto frontiers of (dev score: higher is better, trainable parameters per task: lower is better).

Trial q dominates p when it scores at least as high at no more cost, one of the two strictly; the frontier is the
trials no eligible trial dominates (exact ties both stay; a NaN score or cost neither enters nor dominates).
Eligible: ``completed`` trials by default (:data:`FRONTIER_STATUSES`). The hypervolume is the area the frontier
dominates up to the reference point (cost = the whole backbone, score = 0), with cost on a log scale from
``LOG_FLOOR`` (1e-5 of the backbone) to 1, so it lies in [0, 1] and every decade of parameters weighs the same.
The definitions in full: docs/report.md, "Pareto frontiers and hypervolume".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from peftune.base.errors import UserError
from peftune.base.record_names import BACKBONE_PARAMS, COMPLETED, TRAINABLE_PER_TASK, TRAINABLE_PER_TASK_PCT

COST, COST_PCT = TRAINABLE_PER_TASK, TRAINABLE_PER_TASK_PCT  # the frontier's cost: the record's count
FRONTIER_STATUSES = (COMPLETED,)
REFERENCE_SCORE = 0.0
REFERENCE_COST_FRACTION = 1.0  # 100% of the backbone: what full fine-tuning trains
LOG_FLOOR = 1e-5  # the hypervolume's log-cost axis starts at 0.001% of the backbone


def pareto_mask(scores: Sequence[float], costs: Sequence[float]) -> np.ndarray:
    """Boolean array: True where the point is on the frontier (see the module docstring; NaN -> False).

    O(n log n): sorted by cost, a group of equal-cost points keeps its highest score(s), and only if
    that score beats every score reached at a strictly lower cost.
    """
    scores = np.asarray(scores, dtype=float)
    costs = np.asarray(costs, dtype=float)
    if scores.shape != costs.shape or scores.ndim != 1:
        raise UserError(f"scores and costs must be 1-D of one length, got {scores.shape} and {costs.shape}")
    mask = np.zeros(len(scores), dtype=bool)
    valid = np.flatnonzero(~(np.isnan(scores) | np.isnan(costs)))
    order = valid[np.lexsort((-scores[valid], costs[valid]))]  # cost ascending, then score descending
    best_cheaper = -math.inf  # best score among points of strictly lower cost
    start = 0
    while start < len(order):
        end = start
        while end < len(order) and costs[order[end]] == costs[order[start]]:
            end += 1
        group = order[start:end]
        top = scores[group[0]]  # the group is sorted by score descending
        if top > best_cheaper:
            mask[group[scores[group] == top]] = True
            best_cheaper = top
        start = end
    return mask


def cost_fraction(trials: pd.DataFrame) -> pd.Series:
    """Trainable parameters per task as a fraction of the backbone (from the counts, else from the logged %)."""
    if BACKBONE_PARAMS in trials and COST in trials:
        fraction = trials[COST] / trials[BACKBONE_PARAMS]
    else:
        fraction = pd.Series(np.nan, index=trials.index)
    if COST_PCT in trials:
        fraction = fraction.fillna(trials[COST_PCT] / 100.0)
    return fraction.astype(float)


def eligible(trials: pd.DataFrame, statuses: Sequence[str] = FRONTIER_STATUSES) -> pd.DataFrame:
    """The trials of the given statuses (all rows when the frame has no ``status`` column)."""
    if "status" not in trials:
        return trials
    return trials[trials["status"].isin(list(statuses))]


def frontier(
    trials: pd.DataFrame,
    score: str = "score",
    cost: str = COST,
    *,
    statuses: Sequence[str] = FRONTIER_STATUSES,
) -> pd.DataFrame:
    """The non-dominated eligible trials, sorted by cost (then score descending); the original index is kept."""
    pool = eligible(trials, statuses)
    on = pool[pareto_mask(pool[score].to_numpy(float), pool[cost].to_numpy(float))]
    return on.sort_values([cost, score], ascending=[True, False], kind="stable")


def mark_frontiers(
    trials: pd.DataFrame,
    objectives: Sequence[str],
    cost: str = COST,
    *,
    statuses: Sequence[str] = FRONTIER_STATUSES,
) -> pd.DataFrame:
    """A copy with boolean columns ``frontier.<objective>`` (all methods) and ``method_frontier.<objective>``."""
    out = trials.copy()
    pool = eligible(trials, statuses)
    for objective in objectives:
        overall = pd.Series(False, index=trials.index)
        overall[frontier(pool, objective, cost, statuses=statuses).index] = True
        by_method = pd.Series(False, index=trials.index)
        for _, group in pool.groupby("method", sort=False):
            by_method[frontier(group, objective, cost, statuses=statuses).index] = True
        out[f"frontier.{objective}"] = overall
        out[f"method_frontier.{objective}"] = by_method
    return out


def log_cost(cost_fractions, floor: float = LOG_FLOOR) -> np.ndarray:
    """``u(c)``: the cost fraction on the hypervolume's log axis, 0 at ``floor`` and 1 at the whole backbone."""
    c = np.maximum(np.asarray(cost_fractions, dtype=float), floor)
    return np.log10(c / floor) / math.log10(1 / floor)


def hypervolume(
    scores: Sequence[float],
    cost_fractions: Sequence[float],
    reference_score: float = REFERENCE_SCORE,
    reference_cost: float = REFERENCE_COST_FRACTION,
    floor: float = LOG_FLOOR,
) -> float:
    """Area dominated by the points' frontier up to the reference point, cost on the log axis ``log_cost``
    (see the module docstring). Dominated and NaN points may be passed: only the frontier counts. 0.0 when
    nothing beats the reference."""
    scores = np.asarray(scores, dtype=float)
    costs = np.asarray(cost_fractions, dtype=float)
    front = pareto_mask(scores, costs)
    inside = front & (scores > reference_score) & (costs < reference_cost)
    order = np.argsort(costs[inside], kind="stable")
    s, u = scores[inside][order], log_cost(costs[inside][order], floor)
    if len(s) == 0:
        return 0.0
    # on a frontier sorted by cost, scores rise: each point owns the strip up to the next point's cost
    widths = np.diff(np.append(u, log_cost([reference_cost], floor)))
    return float(np.sum(widths * (s - reference_score)))


def frontier_summary(
    trials: pd.DataFrame,
    objectives: Sequence[str],
    *,
    statuses: Sequence[str] = FRONTIER_STATUSES,
) -> pd.DataFrame:
    """One row per (scope, objective): scope ``all`` (every method) or one method.

    Columns: ``scope``, ``objective``, ``trials`` (eligible, with a finite objective), ``frontier_size``,
    ``hypervolume``, ``best`` (the highest objective), ``best_label``, ``cheapest_label`` (the frontier's
    lowest-cost trial).
    """
    pool = eligible(trials, statuses).copy()
    pool["_fraction"] = cost_fraction(pool)
    scopes = [("all", pool)] + [(m, pool[pool["method"] == m]) for m in ordered_methods(pool["method"])]
    rows = []
    for objective in objectives:
        for scope, group in scopes:
            finite = group[group[objective].notna() & group["_fraction"].notna()]
            front = frontier(finite, objective, "_fraction", statuses=statuses)
            best = finite.loc[finite[objective].idxmax()] if len(finite) else None
            rows.append(
                {
                    "scope": scope,
                    "objective": objective,
                    "trials": len(finite),
                    "frontier_size": len(front),
                    "hypervolume": hypervolume(finite[objective], finite["_fraction"]),
                    "best": best[objective] if best is not None else math.nan,
                    "best_label": best["label"] if best is not None and "label" in best else None,
                    "cheapest_label": front.iloc[0]["label"] if len(front) and "label" in front else None,
                }
            )
    return pd.DataFrame(rows)


def best_per_method_size(
    trials: pd.DataFrame,
    score: str = "score",
    *,
    statuses: Sequence[str] = FRONTIER_STATUSES,
) -> pd.DataFrame:
    """The best eligible trial (highest ``score``) of each (method, size), ordered as the AdaptBert tables.

    The rows keep every column of ``trials`` plus ``trials_in_group`` (how many trials tried that
    method and size). Ties go to the earlier trial.
    """
    pool = eligible(trials, statuses)
    pool = pool[pool[score].notna()]
    if pool.empty:
        return pool.assign(trials_in_group=pd.Series(dtype=int))
    keys = ["method", "size"]
    best = pool.loc[pool.groupby(keys, sort=False)[score].idxmax()].copy()
    counts = pool.groupby(keys, sort=False).size().rename("trials_in_group")
    best = best.join(counts, on=keys)
    rank = {m: i for i, m in enumerate(ordered_methods(best["method"]))}
    best["_rank"] = best["method"].map(rank)
    size_sort = best["size_value"] if "size_value" in best else pd.Series(0.0, index=best.index)
    best["_size"] = size_sort.fillna(-1.0)
    return best.sort_values(["_rank", "_size", "size"], kind="stable").drop(columns=["_rank", "_size"])


def ordered_methods(methods: Sequence[str] | pd.Series) -> list[str]:
    """Distinct method names in the registry's display order (each spec's ``order``), unknown ones after,
    alphabetically."""
    from peftune.methods.base import display_order  # deferred: the methods import torch

    return display_order(methods)
