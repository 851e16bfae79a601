"""Pareto frontiers and hypervolume on hand-made DataFrames: ties, one point, one dominating all, NaN metrics."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from analysis import pareto


def trials(rows: list[tuple], backbone: int = 1000) -> pd.DataFrame:
    """(label, method, score, trainable params[, status]) -> the DataFrame shape analysis.runs produces."""
    records = []
    for row in rows:
        label, method, score, cost = row[:4]
        status = row[4] if len(row) > 4 else "completed"
        records.append(
            {
                "run_id": f"run-{label}",
                "label": label,
                "method": method,
                "size": label.partition(" ")[2],
                "size_value": float(len(label)),
                "status": status,
                "score": score,
                "sst_accuracy": score,
                "trainable_params_per_task": cost,
                "trainable_params_per_task_pct": 100.0 * cost / backbone,
                "backbone_params": backbone,
            }
        )
    return pd.DataFrame(records)


def labels(frame: pd.DataFrame) -> list[str]:
    return list(frame["label"])


def test_frontier_drops_dominated_points_and_sorts_by_cost():
    frame = trials(
        [
            ("lora r=8", "lora", 0.70, 100),
            ("lora r=64", "lora", 0.69, 800),  # dominated by r=8: more parameters, lower score
            ("adapter m=64", "adapter", 0.75, 500),
            ("prompt l=10", "prompt", 0.60, 10),
            ("full", "full", 0.80, 1000),
        ]
    )
    assert labels(pareto.frontier(frame)) == ["prompt l=10", "lora r=8", "adapter m=64", "full"]


def test_exact_ties_stay_on_the_frontier_together():
    frame = trials([("a", "lora", 0.7, 100), ("b", "adapter", 0.7, 100), ("c", "lora", 0.6, 200)])
    assert labels(pareto.frontier(frame)) == ["a", "b"]


def test_equal_score_at_higher_cost_is_dominated():
    # same score, more parameters: dominated (one objective equal, the other strictly worse)
    frame = trials([("cheap", "lora", 0.7, 100), ("dear", "lora", 0.7, 300)])
    assert labels(pareto.frontier(frame)) == ["cheap"]
    # same cost, lower score: dominated too
    frame = trials([("good", "lora", 0.7, 100), ("worse", "lora", 0.6, 100)])
    assert labels(pareto.frontier(frame)) == ["good"]


def test_one_point_is_its_own_frontier():
    frame = trials([("only", "lora", 0.5, 100)])
    assert labels(pareto.frontier(frame)) == ["only"]
    # cost 0.1 of the backbone: one decade below it, on a five-decade log axis
    assert pareto.hypervolume(frame["score"], frame["trainable_params_per_task"] / 1000) == pytest.approx(0.5 * 0.2)


def test_one_point_dominating_all_others():
    frame = trials(
        [("best", "lora", 0.9, 10), ("x", "lora", 0.8, 20), ("y", "adapter", 0.5, 500), ("z", "full", 0.85, 1000)]
    )
    assert labels(pareto.frontier(frame)) == ["best"]
    marked = pareto.mark_frontiers(frame, ["score"])
    assert list(marked["frontier.score"]) == [True, False, False, False]
    # per method, each method's own best survives
    assert list(marked["method_frontier.score"]) == [True, False, True, True]


def test_nan_metrics_are_neither_on_the_frontier_nor_dominating():
    frame = trials(
        [
            ("nan score", "lora", math.nan, 5),  # cheapest: would dominate "a" on cost if it counted
            ("a", "lora", 0.6, 50),
            ("nan cost", "adapter", 0.99, math.nan),  # best score: would dominate everything if it counted
            ("b", "adapter", 0.7, 100),
        ]
    )
    assert labels(pareto.frontier(frame)) == ["a", "b"]
    assert pareto.pareto_mask([math.nan, math.nan], [1, 2]).tolist() == [False, False]
    assert pareto.hypervolume([math.nan], [0.1]) == 0.0


def test_only_completed_trials_enter_by_default():
    frame = trials(
        [
            ("done", "lora", 0.6, 100),
            ("stopped", "lora", 0.9, 10, "early_stopped"),  # would dominate "done"
            ("crashed", "lora", 0.95, 5, "failed"),
        ]
    )
    assert labels(pareto.frontier(frame)) == ["done"]
    assert labels(pareto.frontier(frame, statuses=("completed", "early_stopped"))) == ["stopped"]


def test_per_task_frontier_uses_that_task_metric():
    frame = trials([("a", "lora", 0.7, 100), ("b", "adapter", 0.8, 200)])
    frame["sst_accuracy"] = [0.5, 0.4]  # b is better on the score but worse on sst at a higher cost
    assert labels(pareto.frontier(frame, "score")) == ["a", "b"]
    assert labels(pareto.frontier(frame, "sst_accuracy")) == ["a"]


def u(c: float) -> float:
    """The hypervolume's log-cost axis by hand: 0 at 1e-5 of the backbone, 1 at all of it."""
    return (math.log10(c) + 5) / 5


def test_hypervolume_by_hand():
    # frontier (cost fraction, score): (0.1, 0.5), (0.5, 0.8); reference (1.0, 0); strips on the log axis
    by_hand = (u(0.5) - u(0.1)) * 0.5 + (1 - u(0.5)) * 0.8
    assert pareto.hypervolume([0.5, 0.8], [0.1, 0.5]) == pytest.approx(by_hand)
    # a dominated point changes nothing; a point at the reference cost (full fine-tuning) adds nothing
    assert pareto.hypervolume([0.5, 0.8, 0.4, 0.95], [0.1, 0.5, 0.6, 1.0]) == pytest.approx(by_hand)
    # ties count once
    assert pareto.hypervolume([0.5, 0.5], [0.1, 0.1]) == pytest.approx(0.5 * (1 - u(0.1)))
    # scores below the reference score (a negative Pearson r) add nothing
    assert pareto.hypervolume([-0.2], [0.1]) == 0.0
    # another reference point
    assert pareto.hypervolume([0.5], [0.2], reference_score=0.25, reference_cost=0.6) == pytest.approx(
        0.25 * (u(0.6) - u(0.2))
    )


def test_every_decade_of_parameters_weighs_the_same():
    # the same score one decade cheaper gains the same area, at 1% as at 0.01%
    gain_high = pareto.hypervolume([0.5], [0.01]) - pareto.hypervolume([0.5], [0.1])
    gain_low = pareto.hypervolume([0.5], [0.0001]) - pareto.hypervolume([0.5], [0.001])
    assert gain_high == pytest.approx(gain_low) == pytest.approx(0.5 * 0.2)
    # the frozen backbone (no trainable parameters) sits at the floor: the whole axis
    assert pareto.hypervolume([0.4], [0.0]) == pytest.approx(0.4)


def test_hypervolume_is_the_dominated_area_on_a_grid():
    rng = np.random.default_rng(0)
    scores, costs = rng.uniform(0, 1, 12), 10 ** rng.uniform(-6, 0, 12)  # costs over six decades
    xs, ys = np.meshgrid(np.linspace(0, 1, 801), np.linspace(0, 1, 801))  # xs: the log-cost axis
    dominated = np.zeros_like(xs, dtype=bool)
    for s, c in zip(scores, costs, strict=True):
        dominated |= (xs >= u(max(c, 1e-5))) & (ys <= s)
    assert pareto.hypervolume(scores, costs) == pytest.approx(dominated.mean(), abs=5e-3)


def test_frontier_summary_reports_each_scope_and_objective():
    frame = trials(
        [("lora r=8", "lora", 0.7, 100), ("lora r=64", "lora", 0.6, 800), ("adapter m=64", "adapter", 0.75, 500)]
    )
    summary = pareto.frontier_summary(frame, ["score"])
    assert list(summary["scope"]) == ["all", "lora", "adapter"]
    everything = summary.iloc[0]
    assert everything["trials"] == 3 and everything["frontier_size"] == 2
    # (0.1, 0.7), (0.5, 0.75) on the log-cost axis
    assert everything["hypervolume"] == pytest.approx((u(0.5) - u(0.1)) * 0.7 + (1 - u(0.5)) * 0.75)
    assert everything["best_label"] == "adapter m=64" and everything["cheapest_label"] == "lora r=8"


def test_best_per_method_and_size_keeps_the_best_trial_of_each():
    frame = trials(
        [
            ("adapter m=64", "adapter", 0.70, 500),
            ("lora r=8", "lora", 0.60, 100),
            ("lora r=8", "lora", 0.65, 100),
            ("lora r=8", "lora", 0.99, 100, "early_stopped"),  # not completed: not the best
            ("lora r=2", "lora", 0.55, 25),
            ("frozen", "frozen", 0.30, 0),
        ]
    )
    frame.loc[frame["label"] == "lora r=2", "size_value"] = 2.0
    frame.loc[frame["label"] == "lora r=8", "size_value"] = 8.0
    best = pareto.best_per_method_size(frame)
    assert labels(best) == ["frozen", "lora r=2", "lora r=8", "adapter m=64"]  # AdaptBert order, sizes ascending
    assert best.set_index("label").loc["lora r=8", "score"] == 0.65
    assert best.set_index("label").loc["lora r=8", "trials_in_group"] == 2


def test_empty_and_all_nan_inputs():
    assert pareto.frontier(trials([("x", "lora", math.nan, math.nan)])).empty
    assert pareto.pareto_mask([], []).tolist() == []
    assert pareto.hypervolume([], []) == 0.0
    assert pareto.best_per_method_size(trials([("x", "lora", math.nan, 10)])).empty
