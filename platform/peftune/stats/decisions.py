"""The decision procedure: which configuration to recommend under each parameter budget, and how sure.

One procedure serves the confirmation (which configurations get another seed), the report and ``peftune
decide``. It reads each configuration's per-example predictions on the decision split, one row per seed, and
splits each estimate's error into an example part (which decision rows were drawn, shared by the
configurations) and a run part (a seed's shift and the run's per-example noise). Each configuration keeps its
own run variance, moderated toward the others' (Smyth 2004), with no pretest. Per budget, every configuration
is compared with the best of the others: "not worse" by more than the margin (every comparison's lower bound
above -margin: an intersection-union test), "worse" by more than it (the unconstrained upper bound below
-margin, a union of K - 1 comparisons: each at alpha / (K - 1)) or "better" (above 0 against every other).
The seeds come in looks; each comparison spends its alpha over its own information (Lan and DeMets,
O'Brien-Fleming shape for the claims a pick rests on). Seeds go to the two configurations of the comparison
that binds each open question; one shown worse gets no more. The pick is the cheapest configuration shown not
worse; a budget ends when every question at least as cheap as the pick is answered or futile at the plan.
docs/decisions.md says what each word means and how each part is computed.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pandas as pd
from scipy import optimize, special, stats

from peftune.base.record_names import BUDGETS_PCT
from peftune.record import legacy

ALPHA = 0.05  # one-sided, per claim, over all looks ("better": two-sided, so alpha / 2 a side)
POWER = 0.8  # the plan's target: the seeds at which a contender truly equal to the best is shown not worse
# "what would decide it": the seeds at which the question is answered this often were the truth its estimate
# (above the promise kept when run: an open question's estimate lies near the margin by its selection)
DECIDE = 0.9
# the spending shapes (``spent``): the claims a pick rests on ("not worse", "better") keep their alpha for the
# last look, where a close question is decided; "worse" spends early, so a configuration clearly worse stops
# at the first looks (its error can cost a cheaper pick, never make the pick worse than the margin)
SHAPES = {"not worse": "obrien-fleming", "better": "obrien-fleming", "worse": "pocock"}
# the time each claim's spending runs on (``fractions``): the seeds' share of the most, or the information's
CLOCKS = {"not worse": "seeds", "better": "seeds", "worse": "information"}
BETTER, NOT_WORSE, CANNOT_TELL, EQUIVALENT, WORSE = "better", "not worse", "cannot tell", "equivalent", "worse"
WORDS = {
    NOT_WORSE: "every lower bound of the configuration minus another lies above -margin",
    WORSE: "an upper bound of the configuration minus another (each at alpha / (K - 1)) lies below -margin (it gets "
    "no more seeds)",
    BETTER: "the pick's lower bound against every other lies above 0, or every other is shown worse",
    EQUIVALENT: "a pair's interval lies inside [-margin, +margin] (the pair table)",
    CANNOT_TELL: "otherwise: the data cannot tell (the answer says what would)",
}
KINDS = ("multiclass", "binary", "regression")
PREDICTION_COLUMNS = ("config", "seed", "task", "example_id", "prediction", "label")
DECISION, DEV = "decision", "dev"
# assumed components of the sweep's start line (before any confirmation seed: the plan at look 1 measures them)
DISAGREEMENT = 0.24  # the share of decision examples two configurations' runs disagree on
INTERACTION_SHARE = 1 / 3  # the part of that disagreement that is configuration x example (the rest: run noise)
SEED_SD = 0.02  # a seed's shift of a score
# the prior df of the run variances' moderation (``moderation``): None estimates it (Smyth's moments)
PRIOR_DF: float | None = 4.0


# ----------------------------------------------------------------------------- per-example values


@dataclass(frozen=True)
class Values:
    """One configuration's per-example values on the decision split: ``values[t]`` is (S, n_t), one row per
    seed (``seeds``, ascending), whose row mean is that seed's task metric; the score is the mean over tasks."""

    seeds: tuple[int, ...]
    values: Mapping[str, np.ndarray]  # task -> (S, n_t)

    @property
    def scores(self) -> np.ndarray:
        """(S,) each seed's score."""
        return np.mean([v.mean(axis=1) for v in self.values.values()], axis=0)

    def first(self, count: int) -> Values:
        """The values of the first ``count`` seeds."""
        return Values(self.seeds[:count], {t: v[:count] for t, v in self.values.items()})


def example_values(predictions: np.ndarray, labels: np.ndarray, kind: str) -> np.ndarray:
    """(S, n) per-example values of S seeds' predictions (S, n) against labels (n,): 1/0 right or wrong for a
    classification; for a regression ``r + IF_i`` (Pearson r and each example's empirical influence on it)."""
    if kind in ("multiclass", "binary"):
        return (predictions == labels[None, :]).astype(float)
    x = predictions - predictions.mean(axis=1, keepdims=True)  # (S, n)
    y = labels - labels.mean()  # (n,)
    sx, sy = np.sqrt((x * x).mean(axis=1, keepdims=True)), math.sqrt(float((y * y).mean()))
    ok = (sx[:, 0] > 1e-12) & (sy > 1e-12)
    zx = np.where(ok[:, None], x / np.where(sx > 0, sx, 1.0), 0.0)
    zy = y / sy if sy > 1e-12 else np.zeros_like(y)
    r = (zx * zy[None, :]).mean(axis=1, keepdims=True)  # (S, 1)
    influence = zx * zy[None, :] - r / 2 * (zx * zx + (zy * zy)[None, :])
    return np.where(ok[:, None], r + influence, 0.0)


def values_from_frame(frame: pd.DataFrame, kinds: Mapping[str, str]) -> dict[str, Values]:
    """config -> its ``Values``, from a frame with the columns of ``PREDICTION_COLUMNS`` (the decision split's
    rows). Every configuration must cover the same examples of the same tasks, with the same labels; a seed
    must cover every example. Raises ValueError naming the configuration, task or seed otherwise."""
    missing = set(PREDICTION_COLUMNS) - set(frame.columns)
    if missing:
        raise ValueError(f"the predictions lack the column(s) {sorted(missing)}")
    if frame.duplicated(["config", "seed", "task", "example_id"]).any():
        row = frame[frame.duplicated(["config", "seed", "task", "example_id"])].iloc[0]
        raise ValueError(
            f"config {row['config']!r} seed {row['seed']} task {row['task']!r} example {row['example_id']!r}: "
            "more than one prediction"
        )
    unknown = sorted(set(frame["task"]) - set(kinds))
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}: expected {sorted(kinds)}")
    reference: dict[str, pd.Series] = {}
    for task, rows in frame.groupby("task", sort=True):
        labels = rows.drop_duplicates(["example_id"]).set_index("example_id")["label"].sort_index()
        clash = rows.groupby("example_id")["label"].nunique()
        if (clash > 1).any():
            raise ValueError(f"task {task!r} example {clash[clash > 1].index[0]!r}: two different labels")
        reference[task] = labels
    out = {}
    for config, rows in frame.groupby("config", sort=False):
        seeds = tuple(sorted(int(s) for s in rows["seed"].unique()))
        values = {}
        for task, labels in reference.items():
            mine = rows[rows["task"] == task]
            table = mine.pivot(index="seed", columns="example_id", values="prediction")
            table = table.reindex(index=list(seeds), columns=labels.index)  # (S, n_t)
            if table.isna().any(axis=None):
                seed = table.index[table.isna().any(axis=1)][0]
                raise ValueError(
                    f"config {config!r} seed {seed} task {task!r}: predictions missing for some examples "
                    "(every configuration and seed must cover the same decision examples)"
                )
            y = labels.to_numpy(dtype=float)
            values[task] = example_values(table.to_numpy(dtype=float), y, kinds[task])
        out[str(config)] = Values(seeds, values)
    return out


# ----------------------------------------------------------------------------- the fitted model


@dataclass(frozen=True)
class Fit:
    """The estimates of K configurations (``names``) and their error's parts."""

    names: tuple[str, ...]
    means: np.ndarray  # (K,) seed-mean scores
    seeds: np.ndarray  # (K,) seeds used
    example_cov: np.ndarray  # (K, K) covariance of the example part (configuration x example; run noise taken off)
    run_var: np.ndarray  # (K,) variance of one run's score around the configuration's (seed and noise), moderated
    run_df: np.ndarray  # (K,) its degrees of freedom (own seeds - 1 + the prior's; 0: not estimable)
    prior_var: float = math.nan  # the prior the run variances are moderated toward (``moderation``)
    prior_df: float = 0.0
    # every pooled configuration's own run variance and df, the family first (what the prior is made of)
    pool_var: np.ndarray | None = None
    pool_df: np.ndarray | None = None

    def cov(self, seeds: np.ndarray | None = None) -> np.ndarray:
        """(K, K) covariance of the estimates at ``seeds`` seeds per configuration (default: those used)."""
        s = self.seeds if seeds is None else np.asarray(seeds, dtype=float)
        return self.example_cov + np.diag(self.run_var / s)

    def pair_var(self, i: int, j: int, seeds: np.ndarray | None = None) -> float:
        s = self.seeds if seeds is None else np.asarray(seeds, dtype=float)
        c = self.example_cov
        example = max(c[i, i] + c[j, j] - 2 * c[i, j], 0.0)
        return max(example + self.run_var[i] / s[i] + self.run_var[j] / s[j], 1e-18)

    def pair_se(self, i: int, j: int, seeds: np.ndarray | None = None) -> float:
        return math.sqrt(self.pair_var(i, j, seeds))

    def pair_df(self, i: int, j: int, seeds: np.ndarray | None = None) -> float:
        """Welch-Satterthwaite degrees of freedom of the difference: the example part is known (thousands of
        rows), each run part has its configuration's moderated df."""
        s = self.seeds if seeds is None else np.asarray(seeds, dtype=float)
        parts = [(self.run_var[m] / s[m], self.run_df[m]) for m in (i, j)]
        if any(df <= 0 for _, df in parts):
            return 0.0
        denominator = sum(a * a / df for a, df in parts)
        return math.inf if denominator <= 0 else self.pair_var(i, j, s) ** 2 / denominator

    def shared_pair_df(self, i: int, j: int) -> float:
        """Satterthwaite degrees of freedom of the difference with each configuration's moderated variance
        written as what it is: a sum of every pooled configuration's own mean square (its own, and the prior's
        share of each), each mean square counted once with its own df. ``pair_df`` counts the prior's df again
        for each configuration of the pair, though both priors are the same seeds, and those of the pair itself
        are in them: with few configurations it claims far more df than the seeds hold. The example part is
        known. Without the pool (a fit built by hand): ``pair_df``."""
        if self.pool_var is None or self.pool_df is None:
            return self.pair_df(i, j)
        v, d = self.pool_var, self.pool_df
        total, d0 = float(d.sum()), self.prior_df
        weights = np.zeros(len(v))
        for m in (i, j):
            if d[m] + d0 <= 0:
                return 0.0
            share = 1 / (self.seeds[m] * (d0 + d[m]))  # run_var[m] / seeds[m] = share * (d0 prior + d own)
            if d0 > 0:
                weights += share * d0 * d / total  # the prior: the pooled variance, each own one by its df
            weights[m] += share * d[m]
        terms = (weights * v)[d > 0]
        denominator = float((terms * terms / d[d > 0]).sum())
        return math.inf if denominator <= 0 else self.pair_var(i, j) ** 2 / denominator

    def index(self, name: str) -> int:
        return self.names.index(name)


def fit(values: Mapping[str, Values], names: Sequence[str], pooled: Sequence[str] | None = None) -> Fit:
    """The fit of configurations ``names``: seed means, the example part's covariance and each configuration's
    run variance, moderated toward a prior estimated from the configurations ``pooled`` (default ``names``;
    the replay passes every configuration it knows, so a configuration's variance does not change with the
    budget it is compared under)."""
    pooled = list(names) + [n for n in (pooled or ()) if n not in names]
    tasks = sorted(next(iter(values.values())).values)
    k = len(names)
    means = np.array([values[n].scores.mean() for n in names])
    seeds = np.array([len(values[n].seeds) for n in names], dtype=float)
    noise, raw, df = run_sums(values, pooled, tasks)
    example_cov = np.zeros((k, k))
    for task in tasks:
        cols = np.stack([values[n].values[task].mean(axis=0) for n in names])  # (K, n_t) seed-averaged values
        example_cov += np.cov(cols).reshape(k, k) / cols.shape[1] / len(tasks) ** 2
    # the run noise in the seed-averaged values is counted in the run part: taken off the example part (and the
    # part kept a covariance: a sampling dip below zero is clipped)
    example_cov -= np.diag(noise[:k] / seeds)
    eigen, vectors = np.linalg.eigh((example_cov + example_cov.T) / 2)
    example_cov = (vectors * np.maximum(eigen, 0.0)) @ vectors.T
    prior_var, prior_df = moderation(raw[df > 0], df[df > 0], PRIOR_DF)
    run_var = np.where(df > 0, (prior_df * prior_var + df * raw) / np.maximum(prior_df + df, 1e-12), prior_var)
    run_df = df + prior_df
    return Fit(tuple(names), means, seeds, example_cov, run_var[:k], run_df[:k], prior_var, prior_df, raw,
               df)  # fmt: skip


def residual_mean_square(v: np.ndarray) -> float:
    """The seeds x examples two-way layout's residual mean square of (S, n) per-example values (S >= 2): the
    variance of one run's per-example value around its seed's and its example's effects."""
    s, n = v.shape
    r = v - v.mean(axis=1, keepdims=True) - v.mean(axis=0, keepdims=True) + v.mean()
    return float((r * r).sum() / ((s - 1) * (n - 1)))


def run_sums(values: Mapping[str, Values], names: Sequence[str], tasks: Sequence[str]):
    """Per configuration: the example-level noise in one seed's score (the two-way layout's residual mean square
    over n), the variance of its seed scores (that noise and the seeds' shifts) and its df (seeds - 1)."""
    k = len(names)
    noise, raw, df = np.zeros(k), np.zeros(k), np.zeros(k)
    for c, n in enumerate(names):
        scores = values[n].scores
        if len(scores) < 2:
            continue
        for task in tasks:
            v = values[n].values[task]  # (S, n_t)
            noise[c] += residual_mean_square(v) / v.shape[1] / len(tasks) ** 2
        raw[c], df[c] = float(scores.var(ddof=1)), len(scores) - 1
    return noise, raw, df


def seed_sums(values: Mapping[str, Values], names: Sequence[str], tasks: Sequence[str]):
    """Per configuration: the example noise in one seed's score, the sum of squares of its seed scores less that
    noise (the seeds' own part), and its df."""
    noise, raw, df = run_sums(values, names, tasks)
    return noise, df * (raw - noise), df


def moderation(variances: np.ndarray, df: np.ndarray, prior_df: float | None = None) -> tuple[float, float]:
    """(prior variance, prior df) of the run variances ``variances`` (``df`` each), Smyth's (2004) moments of
    their logarithms: each configuration's variance is then ``(d0 s0^2 + d s^2) / (d0 + d)`` with ``d0 + d``
    df. The spread of the logarithms beyond what their own df explain sets d0 (a configuration whose seeds
    vary much more than the others' keeps most of its own); d0 is at most the df the prior is made of (the
    prior is no surer than its data), and 0 with fewer than 3 configurations to tell a spread from."""
    v, d = np.asarray(variances, dtype=float), np.asarray(df, dtype=float)
    if len(v) == 0:
        return math.nan, 0.0
    if prior_df is not None:  # fixed: the prior is the pooled variance, with at most the df it is made of
        return float((v * d).sum() / d.sum()), min(prior_df, float(d.sum())) if len(v) > 1 else 0.0
    if len(v) < 3:
        return float((v * d).sum() / d.sum()), 0.0
    z = np.log(np.maximum(v, 1e-30)) - special.digamma(d / 2) + np.log(d / 2)
    mean = float(z.mean())
    spread = float(((z - mean) ** 2).sum() / (len(z) - 1) - special.polygamma(1, d / 2).mean())
    cap = float(d.sum())
    d0 = cap if spread <= 0 else min(2 * _trigamma_inverse(spread), cap)
    return float(math.exp(mean + special.digamma(d0 / 2) - math.log(d0 / 2))), d0


def _trigamma_inverse(y: float) -> float:
    """x with trigamma(x) = y (Newton's method on 1 / trigamma, as Smyth's limma does)."""
    if y > 1e7:
        return 1 / math.sqrt(y)
    if y < 1e-6:
        return 1 / y
    x = 0.5 + 1 / y
    for _ in range(50):
        tri = float(special.polygamma(1, x))
        step = tri * (1 - tri / y) / float(special.polygamma(2, x))
        x += step
        if -step / x < 1e-8:
            break
    return x


# ----------------------------------------------------------------------------- alpha spent over the looks


def spent(t: float, alpha: float, shape: str) -> float:
    """Lan and DeMets' spending function: the alpha spent by information fraction ``t`` (0 to 1)."""
    t = min(max(t, 0.0), 1.0)
    if t <= 0:
        return 0.0
    if shape == "pocock":
        return alpha * math.log(1 + (math.e - 1) * t)
    return float(2 * special.ndtr(-special.ndtri(1 - alpha / 2) / math.sqrt(t)))  # O'Brien-Fleming


def boundary(looks: tuple[tuple[float, float], ...], alpha: float, shape: str) -> float:
    """The one-sided z boundary at the last of ``looks`` ((information fraction, spending time) each, both
    increasing to at most 1) so that the chance of crossing at that look and not before is the alpha spent
    there (``spent`` at its spending time): the group-sequential recursion of the statistic's Brownian motion
    in information time (Armitage, McPherson and Rowe), on a grid. A look with no new information spends
    nothing: it has the same data and so the same boundary."""
    points: list[tuple[float, float]] = []
    for t, u in looks:
        t, u = min(max(t, 1e-6), 1.0), min(max(u, 1e-6), 1.0)
        if not points or t > points[-1][0] + 1e-9:
            points.append((t, max(u, points[-1][1]) if points else u))
    return _paths(tuple(points), alpha, shape)[0]


@functools.lru_cache(maxsize=200_000)
def _paths(points: tuple[tuple[float, float], ...], alpha: float, shape: str):
    """(boundary at the last point, the surviving paths' values and weights there): one step of the recursion
    from the points before it (cached: a comparison's next look costs one step)."""
    t, u = points[-1]
    if len(points) == 1:
        previous, spent_before, x, weight = 0.0, 0.0, None, None
    else:
        _, x, weight = _paths(points[:-1], alpha, shape)
        previous, spent_before = points[-2][0], spent(points[-2][1], alpha, shape)
    target = spent(u, alpha, shape) - spent_before
    step = math.sqrt(t - previous)

    def crossing(c: float) -> float:
        if x is None:
            return float(special.ndtr(-c / step))
        return float((weight * special.ndtr((x - c) / step)).sum())

    high = 8.0 * math.sqrt(t)
    if target <= 1e-12:
        c = math.inf
    elif crossing(high) > target:
        c = high
    else:
        low = 0.0 if crossing(0.0) > target else -high
        c = float(optimize.brentq(lambda v: crossing(v) - target, low, high, xtol=1e-5))
    # the paths that did not cross: the midpoints of cells up to the boundary (the density jumps there)
    bottom, top = -7 * math.sqrt(t), min(c, 7 * math.sqrt(t))
    width = (top - bottom) / 120
    grid = bottom + width * (np.arange(120) + 0.5)
    if x is None:
        density = np.exp(-grid * grid / (2 * t)) / math.sqrt(2 * math.pi * t)
    else:
        kernel = np.exp(-((grid[:, None] - x[None, :]) ** 2) / (2 * step * step))
        density = kernel @ weight / (math.sqrt(2 * math.pi) * step)
    return c / math.sqrt(t), grid, density * width


# ----------------------------------------------------------------------------- the comparisons


def all_pairs(k: int) -> list[tuple[int, int]]:
    return [(i, j) for i in range(k) for j in range(i + 1, k)]


@dataclass(frozen=True)
class Intervals:
    """Every pair's simultaneous two-sided interval at ``level``: Bonferroni over the pairs, each pair on its
    configurations' moderated run variances (the answer's) with the df those hold (``Fit.shared_pair_df``). The
    pair table's, which picks nothing."""

    fit: Fit
    level: float

    @functools.cached_property
    def _q(self) -> np.ndarray:
        f = self.fit
        k = len(f.names)
        pairs = max(len(all_pairs(k)), 1)
        df = np.array([[f.shared_pair_df(i, j) if i != j else 0.0 for j in range(k)] for i in range(k)])
        q = stats.t.ppf(1 - (1 - self.level) / (2 * pairs), np.where(df > 0, np.minimum(df, 1e9), 1.0))
        return np.where(df > 0, q, np.inf)

    def diff(self, i: int, j: int) -> tuple[float, float, float]:
        """(estimate, low, high) of score(i) - score(j)."""
        d = float(self.fit.means[i] - self.fit.means[j])
        h = float(self._q[i, j]) * self.fit.pair_se(i, j)
        return d, d - h, d + h


def intervals(f: Fit, alpha: float) -> Intervals:
    """The pair table's intervals at 1 - ``alpha`` (``Intervals``)."""
    return Intervals(f, 1 - alpha)


def pair_word(low: float, high: float, margin: float) -> str:
    """The word for an oriented pair (its estimate >= 0): better, equivalent or cannot tell."""
    if low > 0:
        return BETTER
    if -margin <= low and high <= margin:
        return EQUIVALENT
    return CANNOT_TELL


class VsBest(NamedTuple):
    """A configuration against the best of the others at one look: the estimate (its score minus the best other
    estimate), the lower bound of the "not worse" test, the upper bound of the "worse" test, whether it is
    better than every other, and the configurations that bind each bound."""

    diff: float
    low: float
    high: float
    better: bool
    binds_low: int
    binds_high: int


def fractions(f: Fit, i: int, j: int, history: Sequence[Mapping[str, int]], max_seeds: int
              ) -> tuple[tuple[float, float], ...]:  # fmt: skip
    """The comparison of i and j at each look so far: its information fraction (its variance with both at
    ``max_seeds`` over its variance then, from this fit's components: what correlates the looks' statistics)
    and its spending time (the seeds it has of the most it can have). The time is the seeds', not the
    information's: the example part does not shrink with seeds, so the first look already holds much of the
    information, and spending by it would leave the last look, where a close question is decided, little.
    The fractions are rounded to 1/25 (the boundaries move little within that; rounded, they are reused)."""
    a, b = f.names[i], f.names[j]
    c = f.example_cov
    example = max(c[i, i] + c[j, j] - 2 * c[i, j], 0.0)
    top_i, top_j = max(max_seeds, f.seeds[i]), max(max_seeds, f.seeds[j])
    final = max(example + f.run_var[i] / top_i + f.run_var[j] / top_j, 1e-18)
    out = []
    for counts in history:
        s_i, s_j = max(counts.get(a, f.seeds[i]), 1), max(counts.get(b, f.seeds[j]), 1)
        var = max(example + f.run_var[i] / s_i + f.run_var[j] / s_j, 1e-18)
        out.append((round(min(final / var, 1.0) * 25) / 25, round(min((s_i + s_j) / (top_i + top_j), 1.0), 4)))
    return tuple(out)


def versus_best_all(f: Fit, history: Sequence[Mapping[str, int]], plan: Plan) -> list[VsBest]:
    """Every configuration of the fit against every other, at this look's alpha spent (``boundary``, each
    comparison its own looks; a t quantile with the df its seeds hold, each seed once: ``Fit.shared_pair_df``,
    as the pair table's): per configuration, its estimate against the best of the others, the "not worse" lower
    bound and the "worse" upper bound (the smallest over the others of each comparison's bound), whether it is
    better than every other, and the comparisons that bind."""
    k = len(f.names)
    d = f.means[:, None] - f.means[None, :]
    se, df = np.ones((k, k)), np.zeros((k, k))
    z = {word: np.full((k, k), np.inf) for word in (NOT_WORSE, WORSE, BETTER)}
    levels = {word: level(plan.alpha, word, k) for word in (NOT_WORSE, WORSE, BETTER)}
    for i, j in all_pairs(k):
        se[i, j] = se[j, i] = f.pair_se(i, j)
        df[i, j] = df[j, i] = f.shared_pair_df(i, j)
        looks = fractions(f, i, j, history, plan.max_seeds)
        for word, table in z.items():
            timed = looks if CLOCKS[word] == "seeds" else tuple((t, t) for t, _ in looks)
            table[i, j] = table[j, i] = boundary(timed, levels[word], SHAPES[word])
    usable = (df > 0) & ~np.eye(k, dtype=bool)
    q = {}
    for word, table in z.items():
        p = special.ndtr(np.where(np.isfinite(table), table, 40.0))
        t = stats.t.ppf(p, np.where(usable, np.minimum(df, 1e9), 1.0))
        q[word] = np.where(usable & np.isfinite(table), t, np.inf)
    out = []
    for i in range(k):
        others = [j for j in range(k) if j != i]
        lows = [d[i, j] - q[NOT_WORSE][i, j] * se[i, j] for j in others]
        highs = [d[i, j] + q[WORSE][i, j] * se[i, j] for j in others]
        betters = [d[i, j] - q[BETTER][i, j] * se[i, j] for j in others]
        low, high = int(np.argmin(lows)), int(np.argmin(highs))
        out.append(VsBest(float(min(d[i, j] for j in others)), float(lows[low]), float(highs[high]),
                          bool(min(betters) > 0), others[low], others[high]))  # fmt: skip
    return out


# ----------------------------------------------------------------------------- one budget's answer


@dataclass
class Answer:
    """One budget's answer at one look."""

    budget: float
    members: list[str]
    best: str | None = None
    pick: str | None = None
    decision: str = CANNOT_TELL  # better | not worse | cannot tell | only one fits | none fits
    diff: float = math.nan  # pick - the best of the others
    ci_low: float = math.nan  # the "not worse" test's lower bound of it
    ci_high: float = math.nan  # the "worse" test's upper bound
    level: float = math.nan
    look: int = 0
    p_best: dict[str, float] = field(default_factory=dict)
    p_within: float = math.nan  # P(pick - the best of the others >= -margin), from the intervals' law
    regret: float = math.nan  # the pick's expected shortfall from the best, and its 95% upper bound
    regret_high: float = math.nan
    needs: str = ""  # what would decide it
    seeds_needed: int = 0  # where more seeds would: about how many per configuration (0: not seeds, or unknown)
    grow: list[str] = field(default_factory=list)  # configurations the next look gives a seed
    # the claims about its configurations, this look's with the earlier looks' (a claim, once made, stands)
    claims: dict[str, Claim] = field(default_factory=dict)
    why: str = ""
    pairs: list[dict] = field(default_factory=list)  # every pair of its family at its look (``pair_rows``)
    plan: str = ""  # the seeds each contender needs (the first look's ``seed_plan``)
    margin: float = math.nan

    @property
    def decided(self) -> bool:
        """A claim with no cheaper question that more seeds could still answer."""
        return self.decision in (BETTER, NOT_WORSE) and not self.grow

    @property
    def shown_earlier(self) -> Claim | None:
        """The pick's claim where an earlier look made it: its interval then, which ``diff``/``ci_*`` (this
        look's, with the seeds added since for other questions) may no longer show."""
        if self.decision != NOT_WORSE:  # "better" stands on this look's interval (above 0)
            return None
        claim = self.claims.get(self.pick) if self.pick is not None else None
        return claim if claim is not None and claim.look < self.look else None


class Claim(NamedTuple):
    """What a look showed about one configuration against the best of the others, with the bounds that showed it."""

    word: str  # "not worse" (within the margin of the best of the others) or "worse" (by more than the margin)
    look: int
    diff: float  # this configuration - the best of the others, at that look
    low: float
    high: float
    level: float


def answer(budget: float, f: Fit, costs: Mapping[str, float], plan: Plan,
           history: Sequence[Mapping[str, int]] | None = None, posterior: bool = True,
           claims: Mapping[str, Claim] | None = None, look: int = 0) -> Answer:  # fmt: skip
    """The answer for the configurations of ``f`` (all under the budget) at this look (module docstring).

    Each configuration at least as cheap as the pick has a question: is it worse than the best of the others by
    more than the margin? "not worse" (every comparison's lower bound at or above -margin), "worse" (the upper
    bound below -margin), or open. The pick is the cheapest configuration shown not worse (the best estimate
    when none is). An open question whose answer the seeds left can still reach gives its configuration and the
    rival that binds it a seed each (``_open_questions``); else it is futile at the plan, and the answer says
    what would decide it. ``history``: each look's seeds per configuration (default: this look's alone)."""
    names = list(f.names)
    margin = plan.margin
    out = Answer(budget, names, level=1 - plan.alpha, look=look, margin=margin)
    if not names:
        out.decision = "none fits"
        return out
    order = sorted(range(len(names)), key=lambda i: (-f.means[i], costs[names[i]], names[i]))
    best = order[0]
    out.best = names[best]
    if len(names) == 1:
        out.pick, out.decision = names[best], "only one fits"
        return out
    history = list(history or [dict(zip(names, f.seeds.astype(int), strict=True))])
    by_cost = sorted(range(len(names)), key=lambda i: (costs[names[i]], -f.means[i], names[i]))
    every = versus_best_all(f, history, plan)
    vs = {i: every[i] for i in by_cost}
    out.claims = dict(claims or {})  # an earlier look's claim stands (the spending covers every look)
    for i in by_cost:
        if names[i] not in out.claims and (vs[i].low >= -margin or vs[i].high < -margin):
            word = NOT_WORSE if vs[i].low >= -margin else WORSE
            out.claims[names[i]] = Claim(word, look, vs[i].diff, vs[i].low, vs[i].high, 1 - plan.alpha)
    not_worse = [i for i in by_cost if out.claims.get(names[i], Claim("", 0, 0, 0, 0, 0)).word == NOT_WORSE]
    chosen = not_worse[0] if not_worse else None
    # the questions: configurations cheaper than the pick (without one: as cheap as the best estimate)
    before = by_cost[: by_cost.index(chosen)] if chosen is not None else by_cost[: by_cost.index(best) + 1]
    open_ = [j for j in before if names[j] not in out.claims]
    pick = chosen if chosen is not None else best
    out.pick = names[pick]
    out.diff, out.ci_low, out.ci_high = vs[pick].diff, vs[pick].low, vs[pick].high
    if posterior:
        out.p_best, out.p_within, out.regret, out.regret_high = chances(f, pick, margin)
    if chosen is not None:
        # better: the best estimate above every other, or every other shown worse by more than the margin (>= 0)
        others_worse = all(out.claims.get(names[j], Claim("", 0, 0, 0, 0, 0)).word == WORSE for j in by_cost
                           if j != best)  # fmt: skip
        out.decision = BETTER if chosen == best and (vs[best].better or others_worse) else NOT_WORSE
        out.why = (
            f"the cheapest configuration shown not worse than the best of the others by more than {margin:g}"
            + (" (at an earlier look: the interval printed is this look's)" if vs[chosen].low < -margin else "")
            + ("; every cheaper one is shown worse by more than that" if before and not open_ else "")
        )
        if not open_:
            return out
    worse = {n for n, c in out.claims.items() if c.word == WORSE}
    out.grow, needs, out.seeds_needed = _open_questions(f, vs, open_ or [pick], costs, plan, worse)
    if chosen is None:
        out.decision, out.needs = CANNOT_TELL, needs
        out.why = (f"open: no configuration shown within {margin:g} of the best of the others, and "
                   f"{len(open_ or [pick])} neither shown within it nor shown worse by more than it")  # fmt: skip
    else:  # the claim stands; while seeds may answer a cheaper one, the budget stays open (``Answer.decided``)
        cheaper = ", ".join(names[j] for j in open_)
        out.needs = f"cheaper and still open at margin {margin:g}: {cheaper}; {needs}"
    return out


def level(alpha: float, word: str, k: int) -> float:
    """One comparison's share of a claim's ``alpha`` among ``k`` configurations. "Not worse" needs every
    comparison (an intersection-union test) and "better" every comparison above 0 at half the level a side: each
    comparison at the claim's level. "Worse" needs one comparison of the K - 1 (a union): were the configuration
    exactly the margin below several equal best ones, each comparison at the full level would make the claim an
    error more often than ``alpha`` (docs/decisions.md), so each gets ``alpha / (k - 1)`` (Bonferroni)."""
    if word == BETTER:
        return alpha / 2
    return alpha / max(k - 1, 1) if word == WORSE else alpha


def _final_q(plan: Plan, word: str, k: int = 2) -> float:
    """About the critical value of a comparison's last look (known variance, looks near the end)."""
    return float(special.ndtri(1 - level(plan.alpha, word, k)))


def seeds_to_decide(f: Fit, i: int, r: int, gap: float, margin: float, q: float, power: float,
                    cap: int = 1000, first: int | None = None) -> int | None:  # fmt: skip
    """The fewest seeds (each of i and r) at which a difference truly ``gap`` is answered, one way or the other,
    with probability ``power`` (None: no number of seeds does, at these decision rows): at the critical value
    ``q``, then, with ``first`` (the plan's first seeds), at the last look's boundary of a plan that looks at
    every seed from ``first`` to that number (its looks cost it power), for the claim the estimate points to."""
    distance = abs(gap + margin)
    z = float(special.ndtri(power))
    word = NOT_WORSE if gap >= -margin else WORSE  # the claim the estimate points to, with its own level
    q = max(q, float(special.ndtri(1 - level(ALPHA, word, len(f.names)))))

    def fewest(q: float) -> int | None:
        for s in range(2, cap + 1):
            seeds = f.seeds.copy()
            seeds[[i, r]] = s
            if distance >= (q + z) * f.pair_se(i, r, seeds):
                return s
        return None

    seeds = fewest(q)
    if seeds is None or first is None or seeds <= first:
        return seeds
    return fewest(_last_look_q(f, i, r, word, q, first, seeds))


def _last_look_q(f: Fit, i: int, r: int, word: str, q: float, first: int | None, seeds: int) -> float:
    """The critical value of the last look of a plan that looks at every seed of i and r from ``first`` to
    ``seeds``, for ``word``'s claim: its looks cost it power (at least ``q``, one look's)."""
    if first is None or seeds <= first:
        return q
    history = [{f.names[i]: n, f.names[r]: n} for n in range(first, seeds + 1)]
    looks = fractions(dataclasses.replace(f, seeds=np.full(len(f.names), float(seeds))), i, r, history, seeds)
    timed = looks if CLOCKS[word] == "seeds" else tuple((t, t) for t, _ in looks)
    return max(q, boundary(timed, level(ALPHA, word, len(f.names)), SHAPES[word]))


def _open_questions(f: Fit, vs: Mapping[int, VsBest], open_: Sequence[int], costs, plan: Plan,
                    worse: set[str]) -> tuple[list[str], str, int]:  # fmt: skip
    """(configurations the next look gives a seed, what would decide, seeds that would). Each open question j is
    bound by one comparison, j against its rival r: the configuration whose comparison gives j's "not worse"
    bound where j's estimate lies within the margin, else its "worse" bound. It gets seeds, j and r one each, while the
    seeds left could answer it: with both at ``max_seeds`` and the last look's critical value, "not worse" or
    "worse" must be reachable for a difference one standard error beyond its estimate. Otherwise it is futile
    at this plan, and what would decide it is said: the seeds at which it is answered ``DECIDE`` of the time
    at its estimate, or the decision rows where no number of seeds would."""
    grow: set[str] = set()
    q, q_worse = _final_q(plan, NOT_WORSE), _final_q(plan, WORSE, len(f.names))
    margin, max_seeds = plan.margin, plan.max_seeds
    for j in open_:
        r = vs[j].binds_low if vs[j].diff >= -margin else vs[j].binds_high
        at_max = f.seeds.copy()
        at_max[[j, r]] = np.maximum(at_max[[j, r]], max_seeds)
        gap, se = float(f.means[j] - f.means[r]), f.pair_se(j, r, at_max)
        reachable = gap + se - q * se >= -margin or gap - se + q_worse * se < -margin
        if reachable and (f.seeds[j] < max_seeds or f.seeds[r] < max_seeds):
            grow |= {f.names[m] for m in (j, r) if f.seeds[m] < max_seeds and f.names[m] not in worse}
    if grow:
        return sorted(grow), f"more seeds may decide it (up to {max_seeds})", 0
    j = min(open_, key=lambda o: (costs[f.names[o]], f.names[o]))
    r = vs[j].binds_low if vs[j].diff >= -margin else vs[j].binds_high
    gap = float(f.means[j] - f.means[r])
    if abs(gap + margin) <= 1e-12:
        return [], f"cannot tell: {f.names[j]} is estimated on the margin {-margin:+.3f} itself", 0
    seeds = seeds_to_decide(f, j, r, gap, margin, q, DECIDE, first=plan.seeds)
    if seeds is not None:
        return [], (f"cannot tell at margin {margin:g} with {max_seeds} seeds: about {seeds} seeds each for "
                    f"{f.names[j]} and {f.names[r]} would decide it {DECIDE:.0%} of the time at these "
                    "estimates"), seeds  # fmt: skip
    rows = _rows_to_decide(f, j, r, gap, margin, q if gap >= -margin else q_worse, DECIDE, max_seeds, plan.seeds)
    return [], (f"cannot tell at margin {margin:g} with {max_seeds} seeds: the decision examples' noise alone "
                f"keeps {f.names[j]} open; about {rows:.1f}x the decision examples (and {max_seeds} seeds) would "
                f"decide it {DECIDE:.0%} of the time at these estimates"), 0  # fmt: skip


def _rows_to_decide(f: Fit, j: int, r: int, gap: float, margin: float, q: float, power: float,
                    max_seeds: int, first: int | None = None) -> float:  # fmt: skip
    """How many times the decision rows (both parts of the error shrink with them; seeds at ``max_seeds``)
    would answer the question with probability ``power`` at its estimate, at the critical value
    ``seeds_to_decide`` uses (the last look of a plan from ``first`` seeds to ``max_seeds``); inf on the margin
    itself, where no amount of data would."""
    distance = abs(gap + margin)
    if distance <= 0:
        return math.inf
    word = NOT_WORSE if gap >= -margin else WORSE
    q = max(q, float(special.ndtri(1 - level(ALPHA, word, len(f.names)))))
    q = _last_look_q(f, j, r, word, q, first, max_seeds)
    seeds = f.seeds.copy()
    seeds[[j, r]] = max_seeds
    need = (distance / (q + float(special.ndtri(power)))) ** 2
    return max(f.pair_var(j, r, seeds) / need, 1.0)


def _stream(*parts) -> np.random.Generator:
    """A generator from the names and numbers it is for only: the same estimates give the same P(best)."""
    text = "\0".join(map(str, parts)).encode()
    return np.random.default_rng(int.from_bytes(hashlib.sha256(text).digest()[:8], "little"))


def run_variances(f: Fit, rng: np.random.Generator, draws: int) -> np.ndarray:
    """(draws, K) draws of each configuration's run variance from its fiducial law, each seed's df counted once.

    A moderated variance ``(d0 s0^2 + d s^2) / (d0 + d)`` is a sum of the pooled configurations' own mean
    squares, the prior s0^2 the same ones for every configuration (``Fit.shared_pair_df`` counts the df so).
    So each pooled configuration's own variance is drawn once per draw from its own law (``s^2 d /
    chi-square(d)``), the prior's part is made of those draws (common to every configuration) and each
    configuration adds its own draw. Drawing each moderated variance alone with ``d0 + d`` df would take the
    pool's df once per configuration, and a noisy configuration at few seeds, moderated toward rivals with many,
    would look surer than its own seeds allow: P(pick - best >= -margin) too high (docs/benchmarks.md, "The
    decision procedure's error rates"). Without the pool (a fit built by hand): each
    with its ``run_df``."""
    k = len(f.names)
    if f.pool_var is None or f.pool_df is None:
        df = np.where(f.run_df > 0, f.run_df, 1.0)
        inflation = np.where(f.run_df[None, :] > 0, df[None, :] / rng.chisquare(df, size=(draws, k)), 1.0)
        return f.run_var[None, :] * inflation
    v, d, d0 = f.pool_var, f.pool_df, f.prior_df
    held = d > 0  # the pooled configurations with a variance of their own
    own = np.tile(v, (draws, 1))  # (draws, P)
    own[:, held] = v[held] * d[held] / rng.chisquare(d[held], size=(draws, int(held.sum())))
    # the prior moves with the pool it is made of (at its point value ``moderation``'s, however d0 was set)
    pooled = float((v * d)[held].sum())
    prior = f.prior_var * (own[:, held] @ d[held]) / pooled if pooled > 0 else np.full(draws, f.prior_var)
    weight = d0 + d[:k]
    moderated = (d0 * prior[:, None] + d[:k] * own[:, :k]) / np.where(weight > 0, weight, 1.0)
    return np.where(weight[None, :] > 0, moderated, f.run_var[None, :])  # no df at all: not estimable, kept


def estimate_errors(f: Fit, rng: np.random.Generator, draws: int) -> np.ndarray:
    """(draws, K) draws of the estimates' errors: the example part normal with its covariance, each run part
    normal with its variance drawn from its fiducial law (``run_variances``)."""
    k = len(f.names)
    z = rng.multivariate_normal(np.zeros(k), f.example_cov + 1e-15 * np.eye(k), size=draws, method="eigh")
    var = run_variances(f, rng, draws)  # (draws, K)
    return z + rng.standard_normal((draws, k)) * np.sqrt(var / f.seeds[None, :])


def chances(f: Fit, pick: int, margin: float, draws: int = 4000) -> tuple[dict[str, float], float, float, float]:
    """P(best) of each configuration, P(pick - the best of the others >= -margin), and the pick's expected regret
    (and its 95% bound): the true scores drawn around the estimates (``estimate_errors``; flat prior)."""
    rng = _stream("posterior", f.names, f.means.tobytes())
    mu = f.means[None, :] - estimate_errors(f, rng, draws)
    winner = mu.argmax(axis=1)
    p_best = {n: float(np.mean(winner == i)) for i, n in enumerate(f.names)}
    others = np.delete(mu, pick, axis=1).max(axis=1)
    within = float(np.mean(mu[:, pick] - others >= -margin))
    regret = mu.max(axis=1) - mu[:, pick]
    return p_best, within, float(regret.mean()), float(np.quantile(regret, 0.95))


# ----------------------------------------------------------------------------- the sequential plan


@dataclass(frozen=True)
class Plan:
    """What the confirmation does: ``seeds`` first seeds, up to ``max_seeds`` a configuration; ``alpha`` per claim
    over all looks; claims at ``margin``."""

    seeds: int
    max_seeds: int
    margin: float
    alpha: float = ALPHA
    budgets: tuple[float, ...] = BUDGETS_PCT

    @property
    def looks(self) -> int:
        """The most looks: one per seed from ``seeds`` to ``max_seeds``."""
        return self.max_seeds - self.seeds + 1

    @classmethod
    def from_params(cls, params: Mapping, budgets: Sequence[float] = BUDGETS_PCT, *,
                    version: int = legacy.RECORD_VERSION, run_id: str = "") -> Plan:  # fmt: skip
        """The plan of a sweep's parameters as its parent run (``run_id``) records them (``confirm_seeds``,
        ``confirm_max_seeds``, ``decision_margin``; in a record of ``version`` before 2, the defaults where one is
        missing): what the sweep runs and the report replays."""
        seeds, max_seeds, margin = legacy.plan_params(params, version, run_id)
        return cls(seeds=seeds, max_seeds=max_seeds, margin=margin, budgets=tuple(budgets))


@dataclass(frozen=True)
class Configuration:
    """A configuration the confirmation trains: its method, its cost (trainable % per task), its role."""

    name: str
    method: str
    trainable_pct: float
    default: bool = False


def seed_plan(f: Fit, costs: Mapping[str, float], plan: Plan) -> tuple[str, dict[str, int | None]]:
    """The seeds each configuration of a budget (``f``) needs for ``POWER`` of being shown not worse than the best
    of the others were it truly equal to it (against the best estimate, the best against the second), from the
    fit's components: (a line that says it, config -> seeds; None where no number of seeds would)."""
    order = sorted(range(len(f.names)), key=lambda i: (-f.means[i], costs[f.names[i]], f.names[i]))
    q = _final_q(plan, NOT_WORSE)
    need: dict[str, int | None] = {}
    parts = []
    for i in sorted(range(len(f.names)), key=lambda i: (costs[f.names[i]], f.names[i])):
        r = order[1] if i == order[0] else order[0]
        seeds = seeds_to_decide(f, i, r, 0.0, plan.margin, q, POWER, first=plan.seeds)
        need[f.names[i]] = seeds
        if seeds is None:
            rows = _rows_to_decide(f, i, r, 0.0, plan.margin, q, POWER, plan.max_seeds, plan.seeds)
            parts.append(f"{f.names[i]} none within reach (" + (
                f"about {rows:.1f}x the decision rows would, at {plan.max_seeds} seeds)" if math.isfinite(rows)
                else "no amount of data shows an equal one not worse at margin 0)"))  # fmt: skip
        elif seeds > plan.max_seeds:
            parts.append(f"{f.names[i]} {seeds} (beyond max_seeds {plan.max_seeds})")
        else:
            parts.append(f"{f.names[i]} {seeds}")
    short = [n for n, s in need.items() if s is None or s > plan.max_seeds]
    head = f"seeds for {POWER:.0%} power at margin {plan.margin:g} were a contender equal to the best: "
    tail = (f"; max_seeds {plan.max_seeds} cannot reach it for {len(short)} of {len(need)}" if short else
            f"; max_seeds {plan.max_seeds} reaches it for all")  # fmt: skip
    return head + ", ".join(parts) + tail, need


@dataclass
class Outcome:
    """The replayed confirmation: the answers per budget, the seeds used and why each stopped, and what the
    next round should train (empty when it is over)."""

    answers: list[Answer]
    seeds_used: dict[str, int]
    stop_reason: dict[str, str]
    next_seeds: dict[str, int]  # config -> the seed number its next run trains (the next round)
    looks: int
    stopped: str  # decided | max_seeds | futile | no more data ("" while the next round is wanted)
    final: dict[str, Values] = field(default_factory=dict)  # the data of the last look, per configuration
    plan: Plan | None = None
    all_pairs: list[dict] = field(default_factory=list)  # the family of every configuration, last look
    plans: dict[float, str] = field(default_factory=dict)  # per budget, the first look's ``seed_plan``


def replay(values: Mapping[str, Values], configurations: Sequence[Configuration], plan: Plan,
           summaries: bool = True) -> Outcome:  # fmt: skip
    """Replay the confirmation on the predictions there are: look 1 with every configuration's first
    ``plan.seeds`` seeds (and each budget's ``seed_plan`` from them); at each look, decide every budget; the
    configurations an open question wants get their next seed (the next in their numbered order) if the data
    hold it, and the next look follows; it ends when every budget is decided or futile, at ``max_seeds``, or
    where the data hold no wanted seed (the confirmation trains those: ``next_seeds``). Deterministic: the same
    data give the same outcome. ``summaries``: also what decides nothing (P(best), regret, the plans, the
    all-configurations pair table); a simulation of the decisions' error rates leaves them out."""
    known = [c for c in configurations if c.name in values and len(values[c.name].seeds)]
    count = {c.name: min(plan.seeds, len(values[c.name].seeds)) for c in known}
    settled: dict[float, Answer] = {}
    claims: dict[float, dict[str, Claim]] = {}  # per budget, the claims made so far
    reasons: dict[str, str] = {c.name: "" for c in known}
    history: list[dict[str, int]] = []
    plans: dict[float, str] = {}
    look, answers = 0, []
    while True:
        look += 1
        history.append(dict(count))
        data = {n: values[n].first(count[n]) for n in count}
        answers = _look(data, known, plan, look, settled, summaries, claims, history)
        if look == 1 and summaries:
            plans = _plans(data, known, plan)
        for a in answers:
            a.plan = plans.get(a.budget, "")
            claims[a.budget] = dict(a.claims)
            if a.decided and a.budget not in settled:
                settled[a.budget] = a
        grow = sorted({n for a in answers if not a.decided for n in a.grow if count[n] < plan.max_seeds})
        if not grow:
            undecided = [a for a in answers if not a.decided and a.decision not in ("only one fits", "none fits")]
            at_max = any(count[n] >= plan.max_seeds for a in undecided for n in a.members)
            stopped = "decided" if not undecided else ("max_seeds" if at_max else "futile")
            for n in count:
                reasons[n] = reasons[n] or _reason(n, answers, stopped, claims)
            everything = _all_family(data, known, plan, look) if summaries else []
            return Outcome(answers, dict(count), reasons, {}, look, stopped, data, plan, everything, plans)
        wanted = {n: values[n].seeds[count[n]] if count[n] < len(values[n].seeds) else None for n in grow}
        missing = {n: _next_seed(values[n].seeds) for n, s in wanted.items() if s is None}
        if missing:  # the data stop here: the confirmation trains these next (a record: it stopped adding)
            for n in count:
                why = "open: its next seed was not trained (max_seconds, or the sweep was interrupted)"
                reasons[n] = reasons[n] or (why if n in missing else _reason(n, answers, "open", claims))
            return Outcome(answers, dict(count), reasons, missing, look, "", data, plan, plans=plans)
        for n in grow:
            count[n] += 1


def _plans(data: Mapping[str, Values], known: Sequence[Configuration], plan: Plan) -> dict[float, str]:
    costs = {c.name: c.trainable_pct for c in known}
    out = {}
    for budget in plan.budgets:
        members = [c.name for c in known if c.trainable_pct <= budget]
        if len(members) >= 2 and all(len(data[n].seeds) >= 2 for n in members):
            out[budget] = seed_plan(fit(data, members, pooled=list(data)), costs, plan)[0]
    return out


def _all_family(data: Mapping[str, Values], known: Sequence[Configuration], plan: Plan, look: int) -> list[dict]:
    names = [c.name for c in known]
    if len(names) < 2 or any(len(data[n].seeds) < 2 for n in names):
        return []
    return pair_rows(intervals(fit(data, names), plan.alpha / look), plan.margin, "all")


def _next_seed(seeds: Sequence[int]) -> int:
    return max(seeds) + 1


def _reason(name: str, answers: Sequence[Answer], stopped: str, claims: Mapping[float, Mapping[str, Claim]]) -> str:
    mine = [a for a in answers if name in a.members]
    if not mine:
        return "in no budget"
    if any(c.get(name) is not None and c[name].word == WORSE for c in claims.values()):
        return "shown worse by more than the margin"
    if all(a.decided for a in mine):
        return "decided"
    return stopped


def _look(data: Mapping[str, Values], known: Sequence[Configuration], plan: Plan, look: int,
          settled: Mapping[float, Answer], summaries: bool, claims: Mapping[float, Mapping[str, Claim]],
          history: Sequence[Mapping[str, int]]) -> list[Answer]:  # fmt: skip
    costs = {c.name: c.trainable_pct for c in known}
    out = []
    for budget in plan.budgets:
        if budget in settled:  # a claim, once made, stands
            out.append(settled[budget])
            continue
        members = [c.name for c in known if c.trainable_pct <= budget]
        if len(members) < 2:
            a = Answer(budget, members, best=members[0] if members else None, pick=members[0] if members else None)
            a.decision = "only one fits" if members else "none fits"
            out.append(a)
            continue
        few = [n for n in members if len(data[n].seeds) < 2]
        f = fit(data, members, pooled=list(data))
        if few:  # no run variance of its own: nothing it takes part in is decided
            a = Answer(budget, members, best=f.names[int(np.argmax(f.means))], look=look, margin=plan.margin)
            a.pick = a.best
            a.needs = "no seed variance can be estimated below 2 seeds: confirm with 2 or more"
            a.grow = few
            out.append(a)
            continue
        a = answer(budget, f, costs, plan, history, posterior=summaries, claims=claims.get(budget), look=look)
        # Bonferroni over the pairs and the looks so far: the seeds each got depend on the data (a configuration
        # shown worse stops while its estimate is low), and the union over every look holds whatever they did
        a.pairs = pair_rows(intervals(f, plan.alpha / look), plan.margin, budget)
        out.append(a)
    return out


# ----------------------------------------------------------------------------- what the sweep can reach


def reachable_margin(examples: int, plan: Plan, *, disagreement: float = DISAGREEMENT,
                     interaction_share: float = INTERACTION_SHARE, seed_sd: float = SEED_SD,
                     power: float = POWER) -> float:  # fmt: skip
    """The smallest margin at which a configuration truly equal to the best is shown not worse with ``power`` at
    ``max_seeds``, on ``examples`` decision examples, from assumed components: two configurations' runs disagree
    on ``disagreement`` of the examples, ``interaction_share`` of it configuration x example (the rest run
    noise, which seeds average), a seed moves a score by ``seed_sd``. The "not worse" claim is an
    intersection-union test: the family's size does not enter. An approximation for the start line; the first
    look's plan measures the components."""
    s = plan.max_seeds
    var = disagreement * (interaction_share + (1 - interaction_share) / s) / examples + 2 * seed_sd**2 / s
    return float((special.ndtri(1 - plan.alpha) + special.ndtri(power)) * math.sqrt(var))


# ----------------------------------------------------------------------------- tables


DECISION_COLUMNS = ["budget", "a", "b", "diff_mean", "ci_low", "ci_high", "decision", "seeds_a", "seeds_b", "level"]


def pair_rows(iv: Intervals, margin: float, budget) -> list[dict]:
    """Every pair of a family: a the higher estimate, its simultaneous interval at ``iv.level``, its word."""
    f, rows = iv.fit, []
    for i, j in all_pairs(len(f.names)):
        if f.means[j] > f.means[i]:
            i, j = j, i
        d, low, high = iv.diff(i, j)
        rows.append({"budget": budget, "a": f.names[i], "b": f.names[j], "diff_mean": d, "ci_low": low,
                     "ci_high": high, "decision": pair_word(low, high, margin), "seeds_a": int(f.seeds[i]),
                     "seeds_b": int(f.seeds[j]), "level": iv.level})  # fmt: skip
    return rows


def pair_table(outcome: Outcome) -> pd.DataFrame:
    """Every pair of every budget's family at the look that settled it (else the last), then the family of all
    configurations at the last look (``budget`` "all": tuning gains and frontier neighbours read it)."""
    rows = [row for a in outcome.answers for row in a.pairs] + outcome.all_pairs
    return pd.DataFrame(rows, columns=DECISION_COLUMNS)


RECOMMENDATION_COLUMNS = ["budget", "pick", "best", "decision", "diff_mean", "ci_low", "ci_high", "p_best",
                          "p_within", "margin", "regret", "regret_high", "level", "look", "needs",
                          "plan"]  # fmt: skip


def recommendation_table(outcome: Outcome) -> pd.DataFrame:
    rows = []
    for a in outcome.answers:
        rows.append({"budget": a.budget, "pick": a.pick, "best": a.best, "decision": a.decision, "diff_mean": a.diff,
                     "ci_low": a.ci_low, "ci_high": a.ci_high, "p_best": a.p_best.get(a.pick, math.nan)
                     if a.pick else math.nan, "p_within": a.p_within, "margin": a.margin, "regret": a.regret,
                     "regret_high": a.regret_high, "level": a.level, "look": a.look, "needs": a.needs,
                     "plan": a.plan})  # fmt: skip
    return pd.DataFrame(rows, columns=RECOMMENDATION_COLUMNS)


def seeds_table(outcome: Outcome | None) -> pd.DataFrame:
    """One row per configuration: the seeds the replay used and why adding stopped."""
    used = outcome.seeds_used.items() if outcome is not None else ()
    return pd.DataFrame(
        [{"config": n, "seeds_used": s, "stop_reason": outcome.stop_reason.get(n, "")} for n, s in used],
        columns=["config", "seeds_used", "stop_reason"],
    )


def said(a: Answer) -> str:
    """An answer's word with its margin, interval and P(within the margin): how every place prints it."""
    if a.decision not in (BETTER, NOT_WORSE, CANNOT_TELL) or not math.isfinite(a.diff):
        return a.decision
    within = f", P(pick - best >= -{a.margin:g}) {a.p_within:.2f}" if math.isfinite(a.p_within) else ""
    return (f"{a.decision} (δ = {a.margin:g}): {a.diff:+.3f} [{a.ci_low:+.3f}, {a.ci_high:+.3f}] against the best "
            f"of the others{within}")  # fmt: skip
