"""Seed means, paired decisions, the recommendation and the fairness table, on hand-made records.

The record is written with real MLflow (``tests/sweep_record.py``) with the tags the search and the
confirmation write (``peftune.phase``, ``peftune.default``, ``peftune.config_key``, ``peftune.seed``) and,
for confirmation runs, their per-example dev predictions (``predictions/dev.csv.gz``), made here so that
the truth is known: on 550 SST dev examples each with a fixed difficulty, a run is right on an example
when the difficulty (plus a little seed noise) lies under the configuration's skill.
"""

from __future__ import annotations

import math
import statistics

import mlflow
import numpy as np
import pandas as pd
import pytest

from analysis import confirmed, publish, render, report, runs
from peftune.record import reader
from sweep_record import TrialSpec, counts, record_sweep

BACKBONE = 1_000_000
N_DEV = 550
RNG = np.random.default_rng(7)
LABELS = RNG.integers(0, 5, N_DEV).astype(float)
DIFFICULTY = RNG.random(N_DEV)


def test_seed_stats_interval_is_t_based():
    s = confirmed.seed_stats([0.46, 0.47, 0.48])
    assert s["mean"] == pytest.approx(0.47) and s["std"] == pytest.approx(0.01)
    half = 4.302652729911275 * 0.01 / math.sqrt(3)  # t(0.975, 2)
    assert s["ci_low"] == pytest.approx(0.47 - half) and s["ci_high"] == pytest.approx(0.47 + half)
    one = confirmed.seed_stats([0.5])
    assert one["n"] == 1 and math.isnan(one["std"]) and math.isnan(one["ci_low"])


# ----------------------------------------------------------------------------- a hand-made record

# search trials: (id, method, options, selection score, default, lr, trainable params per task)
SEARCH = [
    ("l1", "lora", {"rank": 8}, 0.30, True, 1e-5, 5_000),
    ("l2", "lora", {"rank": 8}, 0.45, False, 1e-3, 5_000),
    ("r1", "lora", {"rank": 1}, 0.44, False, 1e-3, 700),  # under 0.1%: confirmed for that budget
    ("a1", "adapter", {"bottleneck": 64}, 0.42, False, 1e-3, 8_000),
    ("b1", "bitfit", {}, 0.40, True, 1e-5, 500),  # bitfit's default won its search
    ("b2", "bitfit", {}, 0.38, False, 1e-3, 500),
    ("f1", "full", {}, 0.47, True, 1e-5, BACKBONE),
]
# confirmed configurations: skill, and (for r1) a copy of another's predictions with a few flips
SKILL = {"l2": 0.50, "a1": 0.44, "b1": 0.36, "b2": 0.34, "f1": 0.505}
SEEDS = (1, 2, 3)


def predictions(skill: float, seed: int) -> np.ndarray:
    """A run's SST predictions: right where difficulty + seed noise < skill, else a wrong class."""
    noise = np.random.default_rng(seed * 1000 + int(skill * 1000)).normal(0, 0.005, N_DEV)
    right = DIFFICULTY + noise < skill
    return np.where(right, LABELS, (LABELS + 1) % 5)


def near_copy(values: np.ndarray, seed: int) -> np.ndarray:
    """The same predictions with 3 right answers made wrong and 2 wrong made right: 1/550 lower, equivalent."""
    out = values.copy()
    rng = np.random.default_rng(100 + seed)
    spoiled = rng.choice(np.flatnonzero(out == LABELS), 3, replace=False)
    mended = rng.choice(np.flatnonzero(out != LABELS), 2, replace=False)
    out[spoiled] = (LABELS[spoiled] + 1) % 5
    out[mended] = LABELS[mended]
    return out


def confirmed_predictions() -> dict[str, dict[int, np.ndarray]]:
    out = {key: {s: predictions(skill, s) for s in SEEDS} for key, skill in SKILL.items()}
    out["r1"] = {s: near_copy(out["l2"][s], s) for s in SEEDS}
    return out


def accuracy(values: np.ndarray) -> float:
    return float(np.mean(values == LABELS))


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
    for trial_id, by_seed in confirmed_predictions().items():
        _, method, options, _, default, lr, trainable = by_id[trial_id]
        for seed, values in by_seed.items():
            run = f"{trial_id}-seed{seed}"
            ids = list(range(N_DEV))
            spec = TrialSpec(run, method, options, [{"sst_accuracy": accuracy(values)}], counts(trainable), lr=lr)
            spec.seed, spec.predictions = seed, {"sst": (ids, values.tolist(), LABELS.tolist())}
            specs.append(spec)
            tags[run] = {
                "peftune.phase": "confirm",
                "peftune.config_key": f"key-{trial_id}",
                "peftune.seed": str(seed),
                "peftune.default": str(default).lower(),
            }
    _, parent, run_ids = record_sweep(
        uri, "noise", ["sst"], specs, artifact_dir=tmp / "artifacts", budget={"max_dev_examples": N_DEV}
    )
    client = mlflow.MlflowClient(uri)
    for trial_id, values in tags.items():
        for key, value in values.items():
            client.set_tag(run_ids[trial_id], key, value)
    client.log_metric(parent, "budget_trials.lora", 3)
    client.log_metric(parent, "budget_steps.lora", 1200)
    return uri, tmp


@pytest.fixture(scope="module")
def built(record):
    uri, tmp = record
    return publish.write_report(runs.read_sweep_record("noise", uri), tmp / "report", reference=False)


def seed_means() -> dict[str, float]:
    return {
        key: statistics.mean(accuracy(v) for v in by_seed.values()) for key, by_seed in confirmed_predictions().items()
    }


def test_report_draws_seed_means_with_the_seeds_std(record, built):
    uri, tmp = record
    sweep = runs.read_sweep_record("noise", uri)
    assert len(sweep.trials) == len(SEARCH) and len(sweep.confirmations) == 3 * len(SKILL) + 3
    configs = built.configs.set_index("config_key")
    for trial_id, by_seed in confirmed_predictions().items():
        values = [accuracy(v) for v in by_seed.values()]
        row = configs.loc[f"key-{trial_id}"]
        assert row["seeds"] == 3 and row["source"] == "confirmed"
        assert row["score_mean"] == pytest.approx(statistics.mean(values))
        assert row["score_std"] == pytest.approx(statistics.stdev(values))
    figure = report.plots.confirmed_figure(built.configs, built.confirmed_front, sweep="noise", backbone="b")
    bars = {}
    for trace in figure.data:
        if trace.meta and trace.meta.get("kind") == "means":  # the seed means, their error bars the std
            for y, std in zip(trace.y, trace.error_y.array, strict=True):
                bars[round(y, 6)] = std
    assert bars[round(configs.loc["key-f1", "score_mean"], 6)] == pytest.approx(configs.loc["key-f1", "score_std"])
    assert (tmp / "report" / "confirmed_frontier.png").stat().st_size > 10_000


def test_decisions_csv_holds_every_comparison_with_its_interval(built, record):
    _, tmp = record
    table = pd.read_csv(tmp / "report" / "decisions.csv")
    expected = ["budget", "a", "b", "diff_mean", "ci_low", "ci_high", "decision", "seeds_a", "seeds_b", "level"]
    assert list(table.columns[: len(expected)]) == expected
    assert set(table["decision"]) <= {"better", "equivalent", "cannot tell"}
    assert (table["ci_low"] <= table["diff_mean"]).all() and (table["diff_mean"] <= table["ci_high"]).all()
    assert (table["seeds_a"] == 3).all() and (table["seeds_b"] == 3).all()
    means = seed_means()
    # lora r=8 against bitfit's tuned configuration: 0.16 apart on the same 550 examples -> better
    row = table[(table["key_a"] == "key-l2") & (table["key_b"] == "key-b2") & (table["budget"] == "≤ 1%")]
    assert len(row) and set(row["decision"]) == {"better"}
    assert row["diff_mean"].iloc[0] == pytest.approx(means["l2"] - means["b2"])
    # simultaneous intervals at the level of their look: at least 95%, printed
    assert (table["level"] >= 0.95 - 1e-12).all() and (table["level"] < 1).all()


def test_the_pick_is_the_cheapest_configuration_not_worse_than_the_best(built):
    rec = built.recommendation.set_index("budget_pct")
    # under 1%: lora r=8 is the best; lora r=1 (7x fewer parameters) has nearly its predictions: equivalent
    assert rec.loc[1.0, "best"] == "lora r=8"
    assert rec.loc[1.0, "label"] == "lora r=1" and rec.loc[1.0, "decision"] == "not worse"
    assert rec.loc[1.0, "ci_low"] >= -0.05  # shown not worse than lora r=8 by more than the margin
    # under 0.1% only r=1 and bitfit fit; r=1 is the best there and shown better than the cheaper bitfit
    assert rec.loc[0.1, "label"] == "lora r=1" and rec.loc[0.1, "best"] == "lora r=1"
    assert rec.loc[0.1, "decision"] == "better" and 0 < rec.loc[0.1, "p_best"] <= 1
    text = render.markdown_report(built)
    assert "| ≤ 1% | lora r=1 | not worse (δ = 0.05) |" in text  # every word carries its margin


def test_every_method_tried_under_a_budget_is_in_its_rows(built):
    rows = built.by_budget
    under_01 = rows[rows["budget_pct"] == 0.1]
    assert set(under_01["method"]) == {"lora", "bitfit"}  # adapter (0.8%) and full do not fit
    assert set(rows[rows["budget_pct"] == 1.0]["method"]) == {"lora", "bitfit", "adapter"}
    assert (under_01.set_index("method").loc["lora", "vs_best"]) == "the best"
    assert under_01.set_index("method").loc["bitfit", "vs_best"] == "worse"


def test_the_tuning_gain_is_shown_with_its_interval_also_when_the_default_won(built):
    fair = built.fairness.set_index("method")
    means = seed_means()
    # bitfit's default won its search and was confirmed beside the tuned configuration: the gain is negative
    assert fair.loc["bitfit", "default_source"] == "confirmed"
    assert (
        fair.loc["bitfit", "tuning_gain"] == pytest.approx(means["b2"] - means["b1"])
        and fair.loc["bitfit", "tuning_gain"] < 0
    )
    assert fair.loc["bitfit", "gain_ci_low"] <= fair.loc["bitfit", "tuning_gain"] <= fair.loc["bitfit", "gain_ci_high"]
    assert fair.loc["bitfit", "gain_decision"] in ("worse", "cannot tell", "equivalent")
    # lora's default was not confirmed: its gain is against the one search run, with no interval
    assert fair.loc["lora", "default_source"] == "search" and fair.loc["lora", "default_score"] == pytest.approx(0.30)
    assert math.isnan(fair.loc["lora", "gain_ci_low"]) and fair.loc["lora", "tuning_gain"] > 0
    assert fair.loc["lora", "trials"] == 3 and fair.loc["lora", "steps"] == 1200  # from the parent's budget metrics
    text = render.markdown_report(built)
    sections = [line for line in text.splitlines() if line.startswith("## ")]
    assert sections[:3] == [
        "## Recommendation per parameter budget",
        "## Fairness per method",
        "## Confirmed configurations (seed means)",
    ]
    page = render.html_report(built)
    assert page.index("Recommendation per parameter budget") < page.index("Fairness per method")


def test_a_default_that_won_the_search_and_was_confirmed_alone_has_a_gain_of_zero_not_a_blank(built):
    """With top_k 1, a method whose best search trial is its default confirms that one configuration only."""
    configs = built.configs[built.configs["config_key"] != "key-b2"]  # bitfit: its default only
    fair = confirmed.fairness(built.sweep, configs).set_index("method")
    assert fair.loc["bitfit", "tuned_label"] == configs.set_index("config_key").loc["key-b1", "label"]
    assert fair.loc["bitfit", "tuning_gain"] == 0.0 and fair.loc["bitfit", "gain_decision"] == confirmed.DEFAULT_WON
    shown = confirmed.fairness_display(fair.reset_index()).set_index("Method")
    assert shown.loc["bitfit", "Tuning gain [95% interval]"] == "+0.000"
    assert shown.loc["bitfit", "Gain decision"] == "the default won the search"


def test_control_arm_is_the_search_default_whatever_a_confirmation_run_says(record):
    """Confirmation runs once tagged every configuration ``peftune.default=true`` (the string "false" was truthy),
    which emptied the tuned column of the README run's fairness table: the search trial's tag decides."""
    uri, _ = record
    sweep = runs.read_sweep_record("noise", uri)
    sweep.confirmations["default"] = True  # as the faulty record had it
    fair = report.build_report(sweep, reference=False).fairness.set_index("method")
    assert fair.loc["lora", "default_source"] == "search" and fair.loc["lora", "default_score"] == pytest.approx(0.30)
    assert fair.loc["lora", "tuned_label"] == "lora r=8"


def test_without_predictions_every_decision_stays_open(tmp_path):
    """A record written before predictions were kept (or without confirmation) decides nothing."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    specs = [
        TrialSpec("x", "lora", {"rank": 8}, [{"sst_accuracy": 0.47}], counts(5_000)),
        TrialSpec("y", "bitfit", {}, [{"sst_accuracy": 0.30}], counts(500)),
    ]
    record_sweep(uri, "plain", ["sst"], specs, artifact_dir=tmp_path / "a", budget={"max_dev_examples": 550})
    built = report.build_report(runs.read_sweep_record("plain", uri), reference=False)
    assert set(built.configs["source"]) == {"search"} and set(built.configs["seeds"]) == {1}
    rec = built.recommendation.set_index("budget_pct")
    assert rec.loc[1.0, "label"] == "lora r=8" and rec.loc[1.0, "decision"] == "cannot tell"
    assert "no decision-split predictions" in rec.loc[1.0, "needs"]
    assert not len(built.decisions.table)
    assert "No confirmation runs recorded" in render.markdown_report(built)


def test_evaluate_reuses_the_confirmed_configurations_and_seeds(record):
    from analysis import evaluate

    uri, _ = record
    sweep = runs.read_sweep_record("noise", uri)
    chosen = evaluate.select_configurations(sweep)
    front = confirmed.seed_mean_frontier(confirmed.configurations(sweep))
    assert list(chosen["config_key"]) == list(front["config_key"])  # the frontier of the seed means
    assert evaluate.evaluation_seeds(sweep, chosen.iloc[0], 2) == [1, 2]  # the confirmation's seeds


def test_what_tuning_buys_starts_at_the_default(built, record):
    _, tmp = record
    curve = built.expected_max[built.expected_max["method"] == "lora"].set_index("n")["expected_best"]
    assert list(curve.index) == [1, 2, 3]  # lora had 3 search trials
    assert curve[1] == pytest.approx(0.30)  # trial 1 is its published default
    assert curve[2] == pytest.approx((0.45 + 0.44) / 2)  # the default or one searched draw, whichever is better
    assert curve.is_monotonic_increasing and curve[3] <= 0.45
    assert (tmp / "report" / "expected_max.png").stat().st_size > 10_000
    assert "### What tuning buys" in render.markdown_report(built)


class CountingClient(mlflow.MlflowClient):
    """A real client that counts its artifact downloads."""

    downloads = 0

    def download_artifacts(self, *args, **kwargs):
        self.downloads += 1
        return super().download_artifacts(*args, **kwargs)


def test_predictions_are_downloaded_once_per_run_however_often_the_confirmation_decides(record):
    """Each round of added seeds decides on every confirmation run's predictions: a completed run's
    artifact never changes, so only the runs new since the last round are fetched."""
    uri, _ = record
    sweep = runs.read_sweep_record("noise", uri)
    completed = int((sweep.confirmations["status"] == "completed").sum())
    reader._PREDICTIONS.clear()
    first, again = CountingClient(uri), CountingClient(uri)
    frame = runs.load_predictions(sweep, client=first)
    assert first.downloads == 2 * completed > 0  # the decision split's and dev's
    pd.testing.assert_frame_equal(runs.load_predictions(sweep, client=again), frame)
    assert again.downloads == 0


def test_the_report_says_how_far_the_searchs_order_held(built):
    """Per budget: the rank correlation of search scores with confirmed means, and who moved past the pick."""
    held = built.order_held.set_index("budget_pct")
    assert list(held.index) == list(built.recommendation["budget_pct"])
    configs = built.configs
    for budget, row in held.iterrows():
        under = configs[configs["trainable_params_per_task_pct"] <= budget]
        assert row["contenders"] == len(under)
        if len(under) >= 3:
            expected = under["search_score"].rank().corr(under["score_mean"].rank())
            assert row["rank_correlation"] == pytest.approx(expected)
        pick = built.recommendation.set_index("budget_pct").loc[budget, "label"]
        p = under[under["label"] == pick].iloc[0]
        past = under[(under["search_score"] < p["search_score"]) & (under["score_mean"] > p["score_mean"])]
        assert row["moved_past_pick"] == ", ".join(past["label"])
    assert "### How far the search's order held" in render.markdown_report(built)


def test_what_would_tell_is_costed_at_the_sweeps_speed():
    """An open budget that seeds would decide says how many runs that is and their slot-minutes."""
    from peftune.stats import decisions

    a = decisions.Answer(1.0, ["a", "b"], seeds_needed=10)
    assert confirmed._cost_of(a, 3, 60.0) == " (14 more runs: about 14 slot-minutes at this sweep's speed)"
    assert confirmed._cost_of(decisions.Answer(1.0, ["a", "b"]), 3, 60.0) == ""  # rows would tell, not seeds


def test_two_configurations_of_one_label_are_told_apart_in_what_would_decide():
    """Two frozen configurations (the default and a tuned one) left open name which is which, not "frozen" twice."""
    from types import SimpleNamespace

    from peftune.stats import decisions

    configs = pd.DataFrame({
        "config_key": ["f0000000aa", "f1111111bb", "ia3000000c"], "label": ["frozen", "frozen", "ia3"],
        "method": ["frozen", "frozen", "ia3"], "default": [True, False, False], "trainable_pct": [0.0, 0.0, 0.06],
        "score_mean": [0.40, 0.41, 0.45], "score_std": [0.01] * 3, "seeds": [3] * 3, "report_seeds": [0] * 3,
    })  # fmt: skip
    configs[confirmed.pareto.COST] = [0.0, 0.0, 60.0]
    configs[confirmed.pareto.COST_PCT] = configs["trainable_pct"]
    answer = decisions.Answer(0.1, list(configs["config_key"]), best="ia3000000c", pick="ia3000000c")
    answer.needs = "cheaper and still open: f0000000aa, f1111111bb"
    decided = SimpleNamespace(outcome=SimpleNamespace(plan=None), answer=lambda budget: answer)
    needs = confirmed.recommendations(configs, decided, budgets_pct=[0.1]).iloc[0]["needs"]
    assert needs == "cheaper and still open: frozen (default), frozen [f1111111]"


def test_the_answer_to_re_train_holds_each_budgets_pick_and_the_best_of_the_others(record):
    """--answer: where the pick is the budget's best, the configuration it was compared with is re-trained too."""
    from analysis import evaluate

    uri, _ = record
    sweep = runs.read_sweep_record("noise", uri)
    outcome = report.decide(sweep, confirmed.configurations(sweep)).outcome
    chosen = evaluate.answer_configurations(sweep)
    roles = dict(zip(chosen["config_key"], chosen["answer_role"], strict=True))
    checked = [a for a in outcome.answers if a.pick is not None and len(a.members) > 1]
    assert any(a.pick == a.best for a in checked)  # a budget whose rival is more than its best
    for a in checked:
        others = [k for k in a.members if k != a.pick]
        rival = evaluate.rival(a)
        assert rival in others and f"rival <= {a.budget:g}%" in roles[rival]
        assert f"pick <= {a.budget:g}%" in roles[a.pick]
        pick_vs = {r["b"] if r["a"] == a.pick else r["a"]: r for r in a.pairs if a.pick in (r["a"], r["b"])}
        assert set(pick_vs) == set(others)  # the pick is compared with each of the others
        estimate = {k: (r["diff_mean"] if r["a"] == k else -r["diff_mean"]) for k, r in pick_vs.items()}
        assert estimate[rival] == max(estimate.values())


def test_a_pick_made_while_a_cheaper_question_is_open_says_so_beside_its_word(built):
    """A budget's "not worse" or "better" stands on the questions answered; where a cheaper configuration's is
    still open (the seeds ran out, or the time cap), the answer is not final and its Decision cell says so."""
    rec = built.recommendation
    answers = [built.decisions.answer(budget) for budget in rec["budget_pct"]]
    expected = [a is not None and a.decision in ("better", "not worse") and not a.decided for a in answers]
    assert list(rec["open"]) == expected
    shown = confirmed.recommendation_display(rec.assign(open=[True] + [False] * (len(rec) - 1)))
    words = list(shown["Decision (decision split)"])
    assert words[0].endswith("; a cheaper question still open") and words[0].startswith(rec["decision"].iloc[0])
    assert not any("still open" in word for word in words[1:])


def test_a_claim_an_earlier_look_made_is_shown_with_the_interval_that_made_it():
    """A pick shown not worse at look 1 keeps its claim when seeds added at later looks (for a cheaper question)
    move its interval below -margin: the table prints look 1's interval, which showed it, then the last look's,
    so "not worse (δ = 0.02)" never stands beside an interval that alone does not show it."""
    from types import SimpleNamespace

    from peftune.stats import decisions

    configs = pd.DataFrame({
        "config_key": ["ia3000000c", "dora00000d"], "label": ["ia3", "dora r=32"], "method": ["ia3", "dora"],
        "default": [False, False], "trainable_pct": [0.06, 1.98], "score_mean": [0.40, 0.41],
        "score_std": [0.01] * 2, "seeds": [5] * 2, "report_seeds": [0] * 2,
    })  # fmt: skip
    configs[confirmed.pareto.COST] = [60.0, 2000.0]
    configs[confirmed.pareto.COST_PCT] = configs["trainable_pct"]
    claim = decisions.Claim(decisions.NOT_WORSE, 1, 0.021, -0.016, 0.058, 0.9917)
    answer = decisions.Answer(10.0, list(configs["config_key"]), best="dora00000d", pick="dora00000d", look=3,
                              decision=decisions.NOT_WORSE, diff=0.008, ci_low=-0.027, ci_high=0.031, level=0.9917,
                              claims={"dora00000d": claim}, grow=["ia3000000c"])  # fmt: skip
    decided = SimpleNamespace(outcome=SimpleNamespace(plan=None), answer=lambda budget: answer)
    rec = confirmed.recommendations(configs, decided, budgets_pct=[10.0])
    assert rec.iloc[0][["shown_look", "shown_low"]].tolist() == [1, -0.016]
    cell = confirmed.recommendation_display(rec).iloc[0]["Pick - best of the others [simultaneous interval]"]
    assert cell == ("+0.021 [-0.016, +0.058] at 99.17% when shown, at look 1; "
                    "+0.008 [-0.027, +0.031] at 99.17% at look 3, with the seeds added since")  # fmt: skip
    answer.claims = {"dora00000d": claim._replace(look=3)}  # shown at the last look: one interval
    rec = confirmed.recommendations(configs, decided, budgets_pct=[10.0])
    assert confirmed.recommendation_display(rec).iloc[0]["Pick - best of the others [simultaneous interval]"] == (
        "+0.008 [-0.027, +0.031] at 99.17%"
    )
