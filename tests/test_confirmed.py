"""Seed means, the within-noise rule, the recommendation and the fairness table, on hand-made records.

The record is written with real MLflow (``tests/sweep_record.py``) with the tags the search and the
confirmation write: ``peftune.phase``, ``peftune.default``, ``peftune.config_key``, ``peftune.seed``.
"""

from __future__ import annotations

import math
import statistics

import mlflow
import pandas as pd
import pytest

from analysis import confirmed, report, runs
from sweep_record import TrialSpec, counts, record_sweep

BACKBONE = 1_000_000


# ----------------------------------------------------------------------------- the rule, on numbers


def config(seeds: list[float] | None = None, *, mean=None, se=math.nan) -> pd.Series:
    values = seeds or [mean]
    s = confirmed.seed_stats(values)
    return pd.Series({"seeds": s["n"], "score_mean": s["mean"], "score_std": s["std"], "score_se": se})


def test_welch_rule_separates_a_clear_win_from_noise():
    better, p, rule = confirmed.beats(config([0.50, 0.51, 0.52]), config([0.40, 0.41, 0.40]))
    assert better is True and p < 0.001 and rule.startswith("Welch")
    better, p, _ = confirmed.beats(config([0.45, 0.40, 0.50]), config([0.44, 0.47, 0.43]))
    assert better is False and p > 0.05  # a higher mean, within the seeds' spread
    better, _, _ = confirmed.beats(config([0.40, 0.41, 0.40]), config([0.50, 0.51, 0.52]))
    assert better is False  # significant, but the other way


def test_single_runs_use_the_standard_error_of_the_dev_set():
    n = 550
    se = confirmed.metric_se("sst_accuracy", 0.40, n)
    assert se == pytest.approx(math.sqrt(0.4 * 0.6 / n))  # about 0.021, as the issue measured
    close = confirmed.beats(config(mean=0.42, se=se), config(mean=0.40, se=se))
    far = confirmed.beats(config(mean=0.50, se=se), config(mean=0.40, se=se))
    assert close[0] is False and far[0] is True and far[2].startswith("binomial")
    assert confirmed.beats(config(mean=0.50), config(mean=0.40))[0] is None  # no dev size: left open
    r = confirmed.metric_se("sts_pearson", 0.6, 101)
    assert r == pytest.approx((1 - 0.36) / 10)
    # the score of two tasks: sqrt(se1^2 + se2^2) / 2
    both = confirmed.score_se({"sst_accuracy": 0.4, "sts_pearson": 0.6}, {"sst": n, "sts": 101})
    assert both == pytest.approx(math.hypot(se, r) / 2)


def test_seed_stats_interval_is_t_based():
    s = confirmed.seed_stats([0.46, 0.47, 0.48])
    assert s["std"] == pytest.approx(0.01) and s["mean"] == pytest.approx(0.47)
    assert s["ci_high"] - s["mean"] == pytest.approx(4.302652729911275 * 0.01 / math.sqrt(3))  # t(0.975, 2)
    one = confirmed.seed_stats([0.5])
    assert one["n"] == 1 and math.isnan(one["std"]) and math.isnan(one["ci_low"])


# ----------------------------------------------------------------------------- a hand-made record

# search trials: (id, method, options, score, default, lr, trainable params per task)
SEARCH = [
    ("l1", "lora", {"rank": 8}, 0.30, True, 1e-5, 5_000),
    ("l2", "lora", {"rank": 8}, 0.45, False, 1e-3, 5_000),
    ("l3", "lora", {"rank": 8}, 0.40, False, 2e-3, 5_000),
    ("a1", "adapter", {"bottleneck": 64}, 0.42, False, 1e-3, 8_000),
    ("b1", "bitfit", {}, 0.28, True, 1e-5, 500),
    ("b2", "bitfit", {}, 0.38, False, 1e-3, 500),
    ("f1", "full", {}, 0.47, True, 1e-5, BACKBONE),
]
# confirmation seeds of some of them
SEEDS = {
    "l2": [0.46, 0.47, 0.48],
    "a1": [0.45, 0.47, 0.44],  # below lora's mean, within noise of it
    "b2": [0.36, 0.37, 0.38],  # clearly below lora
    "f1": [0.48, 0.50, 0.46],  # 200x lora's parameters for a gain within noise
}


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("confirmed")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    specs, tags = [], {}
    by_id = {row[0]: row for row in SEARCH}
    for trial_id, method, options, score, default, lr, trainable in SEARCH:
        specs.append(TrialSpec(trial_id, method, options, [{"sst_accuracy": score}], counts(trainable), lr=lr))
        tags[trial_id] = {"peftune.phase": "search", "peftune.default": str(default).lower()}
        tags[trial_id]["peftune.config_key"] = f"key-{trial_id}"
    for trial_id, scores in SEEDS.items():
        _, method, options, _, default, lr, trainable = by_id[trial_id]
        for i, score in enumerate(scores):
            run = f"{trial_id}-seed{i + 1}"
            specs.append(
                TrialSpec(run, method, options, [{"sst_accuracy": score}], counts(trainable), lr=lr, seed=i + 1)
            )
            tags[run] = {
                "peftune.phase": "confirm",
                "peftune.config_key": f"key-{trial_id}",
                "peftune.seed": str(i + 1),
                "peftune.default": str(default).lower(),
            }
    _, parent, run_ids = record_sweep(
        uri, "noise", ["sst"], specs, artifact_dir=tmp / "artifacts", budget={"max_dev_examples": 550}
    )
    client = mlflow.MlflowClient(uri)
    for trial_id, values in tags.items():
        for key, value in values.items():
            client.set_tag(run_ids[trial_id], key, value)
    client.log_metric(parent, "budget_trials.lora", 3)
    client.log_metric(parent, "budget_steps.lora", 1200)
    return uri, tmp


def test_report_draws_seed_means_with_the_seeds_std(record):
    uri, tmp = record
    sweep = runs.load_sweep("noise", uri)
    assert len(sweep.trials) == len(SEARCH) and len(sweep.confirmations) == 12
    assert set(sweep.trials["phase"]) == {"search"} and sweep.trials["default"].sum() == 3

    written = report.write_report(sweep, tmp / "report", reference=False)
    configs = written.configs.set_index("config_key")
    for trial_id, seeds in SEEDS.items():
        row = configs.loc[f"key-{trial_id}"]
        assert row["seeds"] == len(seeds) and row["source"] == "confirmed"
        assert row["score_mean"] == pytest.approx(statistics.mean(seeds))
        assert row["score_std"] == pytest.approx(statistics.stdev(seeds))
    # the figure's error bars are exactly those stds (read back from the plotly figure)
    figure = report.plots.confirmed_figure(written.configs, written.confirmed_front, sweep="noise")
    bars = {}
    for trace in figure.data:
        if trace.meta and trace.meta.get("error") == "std":
            for y, std in zip(trace.y, trace.error_y.array, strict=True):
                bars[round(y, 6)] = std
    for seeds in SEEDS.values():
        assert bars[round(statistics.mean(seeds), 6)] == pytest.approx(statistics.stdev(seeds))
    # and the CSV the report wrote holds the same numbers
    csv = pd.read_csv(tmp / "report" / "configurations.csv").set_index("config_key")
    assert csv.loc["key-f1", "score_std"] == pytest.approx(statistics.stdev(SEEDS["f1"]))
    assert (tmp / "report" / "confirmed_frontier.png").stat().st_size > 10_000

    # the frontier on seed means: bitfit, then lora (beyond noise), then full (within noise of lora)
    front = written.confirmed_front
    assert list(front["config_key"]) == ["key-b2", "key-l2", "key-f1"]
    assert list(front["within_noise_of"]) == ["", "", "lora r=8"]


def test_recommendation_and_fairness_tables(record):
    uri, tmp = record
    written = report.build_report(runs.load_sweep("noise", uri), reference=False)
    rec = written.recommendation.set_index("budget_pct")
    assert rec.loc[0.1, "method"] == "bitfit" and pd.isna(rec.loc[0.1, "runner_up"])
    assert rec.loc[1.0, "method"] == "lora" and rec.loc[1.0, "runner_up"] == "adapter m=64"
    assert rec.loc[1.0, "mean"] == pytest.approx(0.47) and rec.loc[1.0, "std"] == pytest.approx(0.01)
    assert rec.loc[1.0, "beats_runner_up"] is False  # lora 0.47 ± 0.010 vs adapter 0.453 ± 0.015: within noise
    assert rec.loc[1.0, "p_value"] > 0.05

    fair = written.fairness.set_index("method")
    assert fair.loc["lora", "trials"] == 3 and fair.loc["lora", "steps"] == 1200  # from the parent's budget metrics
    assert fair.loc["lora", "default_score"] == pytest.approx(0.30) and fair.loc["lora", "default_source"] == "search"
    assert fair.loc["lora", "tuned_mean"] == pytest.approx(0.47)
    assert fair.loc["lora", "tuned_std"] == pytest.approx(0.01)
    assert fair.loc["lora", "tuning_gain"] == pytest.approx(0.17)
    assert fair.loc["lora", "score_iqr"] == pytest.approx(0.075)  # quartiles of 0.30, 0.40, 0.45
    assert fair.loc["bitfit", "tuning_gain"] == pytest.approx(0.37 - 0.28)
    # full's only configuration is its default, confirmed: the control arm is a seed mean, nothing tuned beats it
    assert fair.loc["full", "default_source"] == "confirmed" and math.isnan(fair.loc["full", "tuning_gain"])

    text = report.markdown_report(written)
    sections = [line for line in text.splitlines() if line.startswith("## ")]
    assert sections[:3] == [
        "## Recommendation per parameter budget",
        "## Fairness per method",
        "## Confirmed configurations (seed means)",
    ]
    assert "| ≤ 1% | lora | lora r=8 |" in text and "no (within noise)" in text
    assert "0.470 ± 0.010" in text
    assert "- confirmation: 12 runs of 4 configurations (12 completed)" in text
    page = report.html_report(written)
    assert page.index("Recommendation per parameter budget") < page.index("Fairness per method")
    assert "<h2>Confirmed configurations (seed means)</h2>" in page and "no (within noise)" in page
    assert page.count('"error_y"') >= 2 * len(SEEDS)  # per method: the std bars and the 95% intervals


def test_control_arm_is_the_search_default_whatever_a_confirmation_run_says(record):
    """Confirmation runs once tagged every configuration ``peftune.default=true`` (the string "false" was truthy),
    which emptied the tuned column of the README run's fairness table: the search trial's tag decides."""
    uri, _ = record
    sweep = runs.load_sweep("noise", uri)
    sweep.confirmations["default"] = True  # as the faulty record had it
    fair = report.build_report(sweep, reference=False).fairness.set_index("method")
    assert fair.loc["lora", "default_source"] == "search" and fair.loc["lora", "default_score"] == pytest.approx(0.30)
    assert fair.loc["lora", "tuned_mean"] == pytest.approx(0.47)
    assert fair.loc["lora", "tuning_gain"] == pytest.approx(0.17)
    assert fair.loc["full", "default_source"] == "confirmed" and math.isnan(fair.loc["full", "tuning_gain"])


def test_without_confirmation_the_search_trials_answer_with_the_binomial_rule(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    specs = [
        TrialSpec("x", "lora", {"rank": 8}, [{"sst_accuracy": 0.47}], counts(5_000)),
        TrialSpec("y", "bitfit", {}, [{"sst_accuracy": 0.46}], counts(500)),
    ]
    record_sweep(uri, "plain", ["sst"], specs, artifact_dir=tmp_path / "a", budget={"max_dev_examples": 550})
    built = report.build_report(runs.load_sweep("plain", uri), reference=False)
    assert set(built.configs["source"]) == {"search"} and set(built.configs["seeds"]) == {1}
    rec = built.recommendation.set_index("budget_pct")
    assert rec.loc[1.0, "method"] == "lora" and rec.loc[1.0, "runner_up"] == "bitfit"
    assert rec.loc[1.0, "noise_rule"].startswith("binomial") and not rec.loc[1.0, "beats_runner_up"]
    assert "No confirmation runs recorded" in report.markdown_report(built)


def test_evaluate_reuses_the_confirmed_configurations_and_seeds(record):
    from analysis import evaluate

    uri, _ = record
    sweep = runs.load_sweep("noise", uri)
    chosen = evaluate.select_configurations(sweep)
    assert list(chosen["config_key"]) == ["key-b2", "key-l2", "key-f1"]  # the frontier of the seed means
    assert list(chosen["trial_id"]) == ["b2", "l2", "f1"]  # represented by their search trials
    assert evaluate.evaluation_seeds(sweep, chosen.iloc[1], 2) == [1, 2]  # the confirmation's seeds
    assert list(evaluate.select_configurations(sweep, top=1)["config_key"]) == ["key-f1"]

    summary = evaluate.summarize(
        pd.DataFrame(
            [
                {"run_id": "r", "label": "x", "method": "lora", "size": "", "split": "dev", "score": v}
                | {confirmed.pareto.COST: 1, confirmed.pareto.COST_PCT: 0.1}
                for v in SEEDS["l2"]
            ]
        ),
        ["score"],
    )
    stats = confirmed.seed_stats(SEEDS["l2"])
    assert summary.loc[0, "score_ci_low"] == pytest.approx(stats["ci_low"])
    assert summary.loc[0, "score_ci_high"] == pytest.approx(stats["ci_high"])
