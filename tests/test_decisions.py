"""The paired bootstrap decisions (analysis.decisions) on synthetic predictions with a known truth.

The simulated classifier (``simulate``): on a binary task of n dev examples, seed s of a configuration with
true accuracy p gets example i right when ``V_si < p + u_s``: ``u_s ~ N(0, seed_sd)`` is the seed's effect
and ``V_si`` is uniform, correlated across seeds and configurations through the example's shared difficulty
(a Gaussian copula with correlation rho). So the true accuracy is exactly p, the errors of two
configurations are paired, and with n = 500, seed_sd = 0.01 and rho = 0.7 one seed's accuracy varies by
about 1.7 points from seed to seed, as fine-tuning a BERT does. The simulations use n_boot = 400 draws (the
report uses 2000) to stay fast.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from analysis import decisions
from analysis.decisions import Predictions

N_BOOT = 400  # bootstrap draws in the simulations (the report's default is 2000)


def dev_set(rng: np.random.Generator, n: int = 500) -> tuple[np.ndarray, np.ndarray]:
    """(labels, difficulty) of n binary dev examples: labels (n,) 0/1, difficulty (n,) standard normal."""
    return rng.integers(0, 2, n).astype(float), rng.standard_normal(n)


def simulate(rng, labels, difficulty, accuracy, seeds=3, seed_sd=0.01, rho=0.7) -> Predictions:
    """One configuration of true ``accuracy`` on the binary task "para" (see the module docstring)."""
    n = len(labels)
    effect = rng.normal(0.0, seed_sd, size=(seeds, 1))  # (S, 1)
    v = stats.norm.cdf(np.sqrt(rho) * difficulty + np.sqrt(1 - rho) * rng.standard_normal((seeds, n)))  # (S, n)
    predictions = np.where(v < accuracy + effect, labels, 1 - labels)
    return Predictions({"para": labels}, {"para": predictions}, tuple(range(seeds)), {"para": "binary"})


# ----------------------------------------------------------------------------- error rates


def test_null_comparisons_say_better_at_most_5_percent_of_the_time():
    """200 nulls (same true accuracy 0.8, 3 seeds each, 500 examples), each a family of one comparison
    oriented as the report does (either side may be called better): "better" at most 5% of the time.
    (Measured: about 1-2%. Without the seed resampling it is about 13%, with only the seeds about 20%.)"""
    rng = np.random.default_rng(11)
    better = 0
    for i in range(200):
        labels, difficulty = dev_set(rng)
        configs = {"a": simulate(rng, labels, difficulty, 0.8), "b": simulate(rng, labels, difficulty, 0.8)}
        frame = decisions.decide_family([("null", "1%", "a", "b")], configs, n_boot=N_BOOT, seed=i)
        better += frame["decision"].iloc[0] == "better"
    assert better / 200 <= 0.05


def test_a_true_gap_of_5_points_is_found_80_percent_of_the_time():
    """True accuracies 0.85 and 0.80 on the same 500 examples (paired, correlated errors), 3 seeds each:
    "better" in at least 80% of 100 simulations (measured: about 89%; a bootstrap that resampled the
    examples of the two sides independently, losing the pairing, finds it about 60% of the time)."""
    rng = np.random.default_rng(12)
    better, gaps = 0, []
    for _ in range(100):
        labels, difficulty = dev_set(rng)
        a, b = simulate(rng, labels, difficulty, 0.85), simulate(rng, labels, difficulty, 0.80)
        c = decisions.compare(a, b, rng=rng, n_boot=N_BOOT)
        better += c.decision == "better"
        gaps.append(c.resolvable_gap)
    assert better / 100 >= 0.80
    # the resolvable gap (80% power) is about the 5 points this test finds 80+% of the time
    assert 0.03 < np.median(gaps) < 0.06


def test_identical_configurations_are_equivalent():
    """The same predictions on both sides, of a stable configuration (10 seeds, 2000 examples, seed effect
    0.003: one seed's accuracy varies by 0.7 points): the seeds, resampled independently for each side,
    still spread the differences, but within the margin of one point."""
    rng = np.random.default_rng(13)
    labels, difficulty = dev_set(rng, n=2000)
    a = simulate(rng, labels, difficulty, 0.8, seeds=10, seed_sd=0.003)
    c = decisions.compare(a, a, rng=rng, n_boot=2000)
    assert c.diff_mean == 0.0 and c.p_value > 0.5
    assert c.decision == "equivalent"
    assert -0.01 <= c.ci_low < 0 < c.ci_high <= 0.01  # not a degenerate [0, 0]
    # 3 seeds of 500 examples as in the simulations above (1.7 points from seed to seed): the seed spread
    # alone is wider than the margin, and a configuration is not even "equivalent" to itself
    labels, difficulty = dev_set(rng, n=500)
    few = simulate(rng, labels, difficulty, 0.8, seeds=3)
    assert decisions.compare(few, few, rng=rng, n_boot=2000).decision == "inconclusive"


def test_interval_p_value_and_resolvable_gap_agree():
    """The percentile interval at level L excludes 0 exactly when the bootstrap p-value is below 1 - L."""
    draws = np.arange(-25, 974) / 1000  # 26 of 999 draws <= 0
    assert decisions.p_value(draws) == pytest.approx(2 * 26 / 999)
    # the (1 - L)/2 and (1 + L)/2 quantiles: the 25th (ceil(0.025 * 999)) and the 975th draw
    assert decisions.interval(draws, 0.95) == pytest.approx((-0.001, 0.949))
    for level in np.linspace(0.90, 0.99, 37):
        low, high = decisions.interval(draws, level)
        assert (low > 0) == (decisions.p_value(draws) < 1 - level), level
    assert decisions.p_value(np.ones(400)) == 1 / 400  # clipped to the resolution
    assert decisions.p_value(np.zeros(400)) == 1.0
    normal = np.random.default_rng(0).standard_normal(100_000)
    assert decisions.resolvable_gap(normal, 0.95) == pytest.approx(1.959964 + 0.841621, rel=0.01)


def test_the_words():
    assert decisions.decide(0.001, 0.05) == "better"
    assert decisions.decide(0.001, 0.005) == "better"  # better takes precedence over equivalent
    assert decisions.decide(-0.004, 0.009) == "equivalent"
    assert decisions.decide(-0.02, 0.009) == "inconclusive"
    assert decisions.decide(-0.05, -0.02) == "inconclusive"  # b better: compare keeps a and b as given
    assert set(decisions.DECISIONS) == {"better", "equivalent", "inconclusive"}
    assert all(word in decisions.__doc__ for word in ("**better**", "**equivalent**", "**inconclusive**"))


# ----------------------------------------------------------------------------- Holm


def test_holm_step_down_levels_on_given_p_values():
    p = [0.04, 0.001, 0.3, 0.01]
    levels = decisions.holm_levels(p, 0.05, lambda i, level: p[i] < 1 - level)
    # sorted: 0.001 at 1 - 0.05/4 (rejected), 0.01 at 1 - 0.05/3 (rejected), 0.04 at 1 - 0.05/2 (stops),
    # 0.3 at the level of the step that stopped
    assert levels == pytest.approx([0.975, 0.9875, 0.975, 1 - 0.05 / 3])
    assert decisions.holm_levels([], 0.05, lambda i, level: True).shape == (0,)


def test_holm_family_one_true_gap_among_nulls():
    rng = np.random.default_rng(14)
    labels, difficulty = dev_set(rng)
    configs = {"big": simulate(rng, labels, difficulty, 0.90)}
    configs |= {f"null{i}": simulate(rng, labels, difficulty, 0.80) for i in range(5)}
    pairs = [("big gap", "10%", "null0", "big")] + [("null", "1%", "null0", f"null{i}") for i in range(1, 5)]
    frame = decisions.decide_family(pairs, configs, n_boot=2000, seed=3)
    assert list(frame.columns) == decisions.COLUMNS
    big = frame.iloc[0]
    assert big["decision"] == "better" and big["a"] == "big" and big["swapped"]  # oriented: big first
    assert big["diff_mean"] > 0.05 and big["ci_low"] > 0
    assert (frame["diff_mean"] >= 0).all()
    assert frame["decision"].iloc[1:].ne("better").all()
    # Holm: the smallest p-value gets 1 - alpha/m; then 1 - alpha/(m-k) while rejected; then constant
    m, ordered = len(frame), frame.sort_values("p_value", kind="stable")
    assert ordered.index[0] == 0 and big["level"] == pytest.approx(1 - 0.05 / m)
    expected, stop = [], None
    for k, (_, row) in enumerate(ordered.iterrows()):
        level = stop if stop is not None else 1 - 0.05 / (m - k)
        expected.append(level)
        if stop is None and not (row["ci_low"] > 0 or row["ci_high"] < 0):
            stop = level
    assert ordered["level"].tolist() == pytest.approx(expected)
    assert ordered["level"].iloc[1] == pytest.approx(1 - 0.05 / (m - 1))  # the first null stops the step-down
    # a stricter level widens the interval: the big gap's Holm interval contains its 95% one
    narrow = decisions.compare(configs["big"], configs["null0"], rng=np.random.default_rng(0), n_boot=2000)
    assert big["ci_high"] - big["ci_low"] > narrow.ci_high - narrow.ci_low
    assert big["resolvable_gap"] > narrow.resolvable_gap


# ----------------------------------------------------------------------------- scores


def two_task(rng, n_sst=300, n_sts=200, seeds=3, noise=0.5) -> Predictions:
    """sst (5 classes, accuracy) and sts (regression, Pearson r) predictions of ``seeds`` seeds."""
    sst = rng.integers(0, 5, n_sst).astype(float)
    sts = rng.uniform(0, 5, n_sts)
    sst_pred = np.where(rng.random((seeds, n_sst)) < 0.6, sst, rng.integers(0, 5, (seeds, n_sst)))
    sts_pred = sts + rng.normal(0, noise * 5, (seeds, n_sts))
    kinds = {"sst": "multiclass", "sts": "regression"}
    return Predictions({"sst": sst, "sts": sts}, {"sst": sst_pred, "sts": sts_pred}, tuple(range(seeds)), kinds)


def direct_score(pred: Predictions, example_idx=None, seed_idx=None) -> float:
    """One draw's score, computed literally: resample, then accuracy / scipy's Pearson r, mean, mean."""
    seeds = range(len(pred.seeds)) if seed_idx is None else seed_idx
    per_seed = []
    for s in seeds:
        metrics = []
        for task in pred.tasks:
            idx = slice(None) if example_idx is None else example_idx[task]
            y, x = pred.labels[task][idx], pred.predictions[task][s][idx]
            metrics.append(np.mean(x == y) if pred.kinds[task] != "regression" else stats.pearsonr(x, y)[0])
        per_seed.append(np.mean(metrics))
    return float(np.mean(per_seed))


def test_two_task_score_with_a_regression_task():
    rng = np.random.default_rng(15)
    pred = two_task(rng)
    assert decisions.score(pred) == pytest.approx([direct_score(pred)], abs=1e-12)
    sst_only = Predictions(
        {"sst": pred.labels["sst"]}, {"sst": pred.predictions["sst"]}, pred.seeds, {"sst": "multiclass"}
    )
    assert decisions.score(sst_only)[0] == pytest.approx(np.mean(pred.predictions["sst"] == pred.labels["sst"]))
    # bootstrap draws: the vectorised weights equal resampling literally
    example_idx = {t: rng.integers(0, len(pred.labels[t]), size=(4, len(pred.labels[t]))) for t in pred.tasks}
    seed_idx = rng.integers(0, 3, size=(4, 3))
    got = decisions.score(pred, example_idx, seed_idx)
    want = [direct_score(pred, {t: i[b] for t, i in example_idx.items()}, seed_idx[b]) for b in range(4)]
    assert got == pytest.approx(want, abs=1e-12)
    assert decisions.score(pred, None, seed_idx) == pytest.approx([direct_score(pred, None, s) for s in seed_idx])


def test_a_constant_regression_prediction_scores_zero():
    rng = np.random.default_rng(16)
    labels = rng.normal(size=50)
    predictions = np.stack([np.full(50, 0.1), labels + rng.normal(size=50)])  # seed 0 constant
    pred = Predictions({"sts": labels}, {"sts": predictions}, (0, 1), {"sts": "regression"})
    r1 = stats.pearsonr(predictions[1], labels)[0]
    assert decisions.score(pred)[0] == pytest.approx((0.0 + r1) / 2)
    assert np.isfinite(decisions.score(pred, {"sts": rng.integers(0, 50, (8, 50))})).all()


def test_a_better_regressor_is_better_on_the_two_task_score():
    good, bad = two_task(np.random.default_rng(17), noise=0.3), two_task(np.random.default_rng(17), noise=0.6)
    c = decisions.compare(good, bad, rng=np.random.default_rng(0), n_boot=1000)
    assert c.decision == "better" and c.diff_mean == pytest.approx(direct_score(good) - direct_score(bad))
    assert c.p_value == pytest.approx(1 / 1000) and c.seeds_a == c.seeds_b == 3


# ----------------------------------------------------------------------------- the frame builder


def long_frame(task_examples: dict[str, list], seeds=(1, 2), value=1.0) -> pd.DataFrame:
    rows = [(t, e, s, value) for t, ids in task_examples.items() for s in seeds for e in ids]
    return pd.DataFrame(rows, columns=["task", "example_id", "seed", "prediction"])


def test_predictions_from_frame_sorts_by_example_id():
    labels = {"sst": pd.Series([1.0, 0.0, 2.0], index=["c", "a", "b"]), "sts": pd.Series([0.5, 2.0], index=[7, 3])}
    frame = long_frame({"sst": ["b", "c", "a"], "sts": [3, 7]}, seeds=(5, 2))
    frame.loc[(frame["task"] == "sst") & (frame["example_id"] == "c") & (frame["seed"] == 5), "prediction"] = 9.0
    pred = decisions.predictions_from_frame(frame, labels, {"sst": "multiclass", "sts": "regression"})
    assert pred.seeds == (2, 5)
    assert pred.example_ids["sst"].tolist() == ["a", "b", "c"] and pred.labels["sst"].tolist() == [0.0, 2.0, 1.0]
    assert pred.predictions["sst"].tolist() == [[1.0, 1.0, 1.0], [1.0, 1.0, 9.0]]
    assert pred.labels["sts"].tolist() == [2.0, 0.5] and pred.predictions["sts"].shape == (2, 2)


def test_predictions_from_frame_refuses_other_examples():
    kinds = {"sst": "multiclass", "sts": "regression"}
    labels = {"sst": pd.Series([1.0, 0.0], index=[1, 2]), "sts": pd.Series([0.5, 2.0, 1.0], index=[1, 2, 3])}
    with pytest.raises(ValueError, match="'sts'.*example sets differ"):  # an example missing
        decisions.predictions_from_frame(long_frame({"sst": [1, 2], "sts": [1, 2]}), labels, kinds)
    with pytest.raises(ValueError, match="'sst'.*example sets differ"):  # an extra example
        decisions.predictions_from_frame(long_frame({"sst": [1, 2, 4], "sts": [1, 2, 3]}), labels, kinds)
    partial = long_frame({"sst": [1, 2], "sts": [1, 2, 3]}).iloc[:-1]  # seed 2 lacks sts example 3
    with pytest.raises(ValueError, match=r"'sts'.*seed\(s\) \[2\]"):
        decisions.predictions_from_frame(partial, labels, kinds)
    # two configurations built on other dev examples cannot be compared
    a = decisions.predictions_from_frame(long_frame({"sst": [1, 2], "sts": [1, 2, 3]}), labels, kinds)
    other = dict(labels, sts=pd.Series([0.5, 2.0, 1.0], index=[1, 2, 9]))
    b = decisions.predictions_from_frame(long_frame({"sst": [1, 2], "sts": [1, 2, 9]}), other, kinds)
    with pytest.raises(ValueError, match="'sts'"):
        decisions.compare(a, b, rng=np.random.default_rng(0), n_boot=10)


# ----------------------------------------------------------------------------- expected maximum


def test_expected_max_curve():
    scores = [0.3, 0.5, 0.4, 0.9, 0.1]
    curve = decisions.expected_max_curve(scores)
    assert len(curve) == 5 and curve[0] == pytest.approx(np.mean(scores))
    assert (np.diff(curve) >= 0).all() and curve[-1] <= 0.9
    pairs = [max(x, y) for x in scores for y in scores]  # n = 2, with replacement, enumerated
    assert curve[1] == pytest.approx(np.mean(pairs))
    assert decisions.expected_max_curve(scores, max_n=200)[-1] == pytest.approx(0.9, abs=1e-6)
    with pytest.raises(ValueError):
        decisions.expected_max_curve([0.1, float("nan")])


def test_expected_max_with_default():
    scores = [0.3, 0.5, 0.4, 0.9, 0.1]
    curve = decisions.expected_max_with_default(0.45, scores, max_n=8)
    assert len(curve) == 8 and curve[0] == 0.45
    assert curve[1] == pytest.approx(np.mean([max(0.45, s) for s in scores]))
    assert curve[2] == pytest.approx(np.mean([max(0.45, x, y) for x in scores for y in scores]))
    assert (np.diff(curve) >= 0).all()
    assert (curve[1:] >= decisions.expected_max_curve(scores, max_n=7)).all()
    assert len(decisions.expected_max_with_default(0.45, scores)) == 6


# ----------------------------------------------------------------------------- reproducibility


def test_same_seed_same_frame(tmp_path):
    rng = np.random.default_rng(18)
    labels, difficulty = dev_set(rng)
    configs = {name: simulate(rng, labels, difficulty, p) for name, p in [("x", 0.8), ("y", 0.82), ("z", 0.78)]}
    pairs = [("x vs y", "1%", "x", "y"), ("x vs z", "1%", "x", "z"), ("y vs z", "10%", "y", "z")]
    first = decisions.decide_family(pairs, configs, n_boot=500, seed=7)
    pd.testing.assert_frame_equal(first, decisions.decide_family(pairs, configs, n_boot=500, seed=7))
    assert not first["ci_low"].equals(decisions.decide_family(pairs, configs, n_boot=500, seed=8)["ci_low"])
    path = decisions.write_decisions_csv(first, tmp_path / "out" / "decisions.csv")
    back = pd.read_csv(path)
    assert list(back.columns) == decisions.COLUMNS and back["decision"].tolist() == first["decision"].tolist()
    with pytest.raises(ValueError, match="'w'"):
        decisions.decide_family([("c", "1%", "x", "w")], configs)


def test_a_pairs_draws_depend_on_its_own_predictions_only():
    """A pair's bootstrap draws come from its two configurations alone: the family read in another order gives
    every pair the same row, and a pair alone gets the p-value it has in a family (its interval differs only
    by the Holm level, which the family sets)."""
    rng = np.random.default_rng(19)
    labels, difficulty = dev_set(rng)
    configs = {name: simulate(rng, labels, difficulty, p) for name, p in [("x", 0.8), ("y", 0.82), ("z", 0.78)]}
    family = [("z vs y", "1%", "z", "y"), ("x vs z", "1%", "x", "z"), ("y vs x", "1%", "y", "x")]
    forward = decisions.decide_family(family, configs, n_boot=500, seed=7).set_index(["a", "b"])
    backward = decisions.decide_family(family[::-1], configs, n_boot=500, seed=7).set_index(["a", "b"])
    pd.testing.assert_frame_equal(forward.sort_index().drop(columns="comparison"),
                                  backward.sort_index().drop(columns="comparison"))  # fmt: skip
    alone = decisions.decide_family([("x vs y", "1%", "x", "y")], configs, n_boot=500, seed=7)
    assert alone.iloc[0]["p_value"] == forward.loc[("y", "x"), "p_value"]
