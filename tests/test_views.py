"""Comparison views: hyperparameter importance recovers the one parameter that matters; parallel coordinates."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from analysis import views


def synthetic_sweep(n: int = 40, seed: int = 0) -> pd.DataFrame:
    """Completed LoRA/adapter trials whose score depends on lr only (dropout and the sizes are noise)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        method = "lora" if i % 2 else "adapter"
        lr = 10 ** rng.uniform(-5, -2)
        score = 0.8 - 0.15 * abs(math.log10(lr) + 3.5) + rng.normal(0, 0.005)
        rows.append(
            {
                "run_id": f"r{i}",
                "method": method,
                "status": "completed",
                "score": score,
                "sst_accuracy": score,
                "lr": lr,
                "dropout": rng.uniform(0, 0.3),
                "weight_decay": rng.uniform(0, 0.1),
                "method.rank": int(rng.choice([4, 8, 16])) if method == "lora" else math.nan,
                "method.bottleneck": int(rng.choice([16, 64])) if method == "adapter" else math.nan,
                "trainable_params_per_task": 1000.0 * (i + 1),
                "trainable_params_per_task_pct": 0.1 * (i + 1),
            }
        )
    frame = pd.DataFrame(rows)
    # as analysis.runs gives them: method options typed per row, None where the method has no such field
    for column in ("method.rank", "method.bottleneck"):
        frame[column] = frame[column].astype(object).where(frame[column].notna(), None)
        frame[column] = frame[column].map(lambda v: None if v is None else int(v))
    return frame


def test_importance_finds_the_parameter_that_matters():
    importances = views.param_importances(synthetic_sweep(), ["sst_accuracy"])
    assert set(importances.columns) == {"param", "score", "pareto", "sst_accuracy"}
    assert importances.iloc[0]["param"] == "lr"
    assert importances.set_index("param").loc["lr", "sst_accuracy"] == importances["sst_accuracy"].max()
    # conditional parameters are named per method
    assert {"lora.rank", "adapter.bottleneck", "method", "dropout"} <= set(importances["param"])
    assert math.isclose(importances["score"].sum(), 1.0)


def test_importance_needs_enough_completed_trials():
    few = synthetic_sweep(n=3)
    assert views.param_importances(few).empty
    stopped = synthetic_sweep().assign(status="early_stopped")
    assert views.param_importances(stopped).empty


def test_parallel_coordinates_axes():
    sweep = synthetic_sweep(n=6)
    sweep.loc[0, "trainable_params_per_task_pct"] = 0.0  # a frozen-like trial: drawn at the "0" tick
    figure = views.parallel_coordinates_figure(sweep, ["sst_accuracy"], sweep="s", backbone="b")
    labels = [d.label for d in figure.data[0].dimensions]
    assert labels == [
        "method",
        "lr (log)",
        "dropout",
        "weight_decay",
        "trainable/task % (log)",
        "sst_accuracy",
        "score",
    ]
    size_axis = figure.data[0].dimensions[4]
    assert size_axis.ticktext[0] == "0"
    assert views.parallel_coordinates_figure(sweep.assign(status="failed"), [], sweep="s", backbone="b") is None
