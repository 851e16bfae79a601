"""The decision procedure: which configuration to recommend under each parameter budget, and how sure.

One procedure serves the confirmation (which configurations get another seed), the report and ``peftune
decide``. It reads each configuration's per-example predictions on the decision split, one row per seed,
fits an example part and a seed part of each estimate's error, and compares every configuration of a budget
with the best of the others (Hsu's comparisons with the best, Bonferroni over them, each comparison's seed
variance from its fiducial law, by quadrature). The pick is the cheapest configuration shown not worse than
the best of the others by more than the margin; a cheaper configuration neither shown within the margin nor
shown worse by more than it keeps its budget open, and gets seeds in the planned looks while the seeds left
could answer it. docs/decisions.md says what each word means and how each part is computed.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pandas as pd
from scipy import optimize, special

from peftune.record import BUDGETS_PCT

ALPHA = 0.05
# the configurations' seed variances are pooled unless Bartlett's test rejects their equality at this level
POOLING_ALPHA = 0.05
FINAL_SHARE = 0.5  # of alpha, spent at the last look (``Plan.alpha_at``)
QUADRATURE = 48  # nodes per seed pool of the expectation over its fiducial law (``_inflation_nodes``)
BETTER, NOT_WORSE, CANNOT_TELL, EQUIVALENT = "better", "not worse", "cannot tell", "equivalent"
WORDS = {
    BETTER: "the interval of the difference lies above 0",
    EQUIVALENT: "the interval lies inside [-margin, +margin]: either is not worse than the other",
    CANNOT_TELL: "otherwise: the data cannot tell",
}
KINDS = ("multiclass", "binary", "regression")
PREDICTION_COLUMNS = ("config", "seed", "task", "example_id", "prediction", "label")
DECISION, DEV = "decision", "dev"


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
    """The estimates of K configurations (``names``), their covariance's parts, and the seed pools."""

    names: tuple[str, ...]
    means: np.ndarray  # (K,) seed-mean scores
    seeds: np.ndarray  # (K,) seeds used
    example_cov: np.ndarray  # (K, K) the example part of the estimates' covariance (with the per-run noise)
    seed_var: np.ndarray  # (K,) seed variance component (per seed) of each configuration's pool
    seed_df: np.ndarray  # (K,) degrees of freedom of that pool (0: no seed variance estimable)
    pool: np.ndarray  # (K,) index of each configuration's pool (configurations sharing a pool share a draw)
    seed_var_raw: np.ndarray  # (K,) the pool's variance of seed scores, example-level noise left in (>= seed_var)
    seed_noise: np.ndarray  # (K,) the example-level noise in one seed's score (seed_var_raw - seed_var, untruncated)

    def cov(self, seeds: np.ndarray | None = None) -> np.ndarray:
        """(K, K) covariance of the estimates, at ``seeds`` seeds per configuration (default: those used)."""
        s = self.seeds if seeds is None else seeds
        # the example part is kept as measured: its per-run noise would shrink with more seeds (conservative)
        return self.example_cov + np.diag(self.seed_var / s)

    def pair_se(self, i: int, j: int, seeds: np.ndarray | None = None) -> float:
        c = self.cov(seeds)
        return math.sqrt(max(c[i, i] + c[j, j] - 2 * c[i, j], 1e-18))

    def index(self, name: str) -> int:
        return self.names.index(name)


def fit(values: Mapping[str, Values], names: Sequence[str], pooled: Sequence[str] | None = None) -> Fit:
    """The variance-component fit of configurations ``names`` (see the module docstring); ``pooled``: the
    configurations whose seeds may estimate a shared seed variance (default ``names``; the replay passes every
    configuration it knows, so a configuration's seed variance, and so its interval, does not change with the
    budget it is compared under). They share one pool unless Bartlett's test rejects equal variances of their
    seed scores at ``POOLING_ALPHA`` (``pooling_rejected``); then each configuration has its own."""
    pooled = list(names) + [n for n in (pooled or ()) if n not in names]
    tasks = sorted(next(iter(values.values())).values)
    k = len(names)
    means = np.array([values[n].scores.mean() for n in names])
    seeds = np.array([len(values[n].seeds) for n in names], dtype=float)
    example_cov = np.zeros((k, k))
    for task in tasks:
        cols = np.stack([values[n].values[task].mean(axis=0) for n in names])  # (K, n_t) seed-averaged values
        example_cov += np.cov(cols).reshape(k, k) / cols.shape[1] / len(tasks) ** 2
    resid, ss, df = seed_sums(values, pooled, tasks)
    raw = ss + df * resid  # sums of squares of the seed scores themselves
    m = len(pooled)
    all_df = df.sum()
    own = df > 0
    if all_df and not pooling_rejected(raw[own] / df[own], df[own]):  # one pool: one draw for all
        seed_var = np.full(m, max(ss.sum(), 0.0) / all_df)
        seed_df, seed_raw = np.full(m, all_df), np.full(m, raw.sum() / all_df)
        pool = np.zeros(m, dtype=int)
        noise = np.full(m, (df * resid).sum() / all_df)
    else:  # each configuration its own pool (one seed: none, and nothing it takes part in is decided)
        safe = np.maximum(df, 1.0)
        seed_var, seed_df, seed_raw = np.maximum(ss, 0.0) / safe, df.copy(), raw / safe
        pool, noise = np.arange(m), resid.copy()
    kept = slice(0, k)  # ``names`` come first in ``pooled``
    return Fit(tuple(names), means, seeds, example_cov, seed_var[kept], seed_df[kept], pool[kept], seed_raw[kept],
               noise[kept])  # fmt: skip


def pooling_rejected(variances: np.ndarray, df: np.ndarray, alpha: float = POOLING_ALPHA) -> bool:
    """Bartlett's test of equal variances (``variances`` with ``df`` degrees of freedom each): True when it rejects
    at ``alpha``. A variance of exactly 0 beside positive ones rejects (seeds that never move a score)."""
    if len(variances) < 2:
        return False
    v = np.asarray(variances, dtype=float)
    if (v <= 0).any():
        return bool((v > 0).any())
    n = df.sum()
    pooled = float((df * v).sum() / n)
    statistic = n * math.log(pooled) - float((df * np.log(v)).sum())
    statistic /= 1 + (float((1 / df).sum()) - 1 / n) / (3 * (len(v) - 1))
    return bool(special.chdtrc(len(v) - 1, statistic) < alpha)


def residual_mean_square(v: np.ndarray) -> float:
    """The seeds x examples two-way layout's residual mean square of (S, n) per-example values (S >= 2): the
    variance of one run's per-example value around its seed's and its example's effects."""
    s, n = v.shape
    r = v - v.mean(axis=1, keepdims=True) - v.mean(axis=0, keepdims=True) + v.mean()
    return float((r * r).sum() / ((s - 1) * (n - 1)))


def seed_sums(values: Mapping[str, Values], names: Sequence[str], tasks: Sequence[str]):
    """Per configuration: the example-level noise in one seed's score (the two-way layout's residual mean square
    over n), and the sum of squares of its seed scores around their mean less that noise, with its df."""
    k = len(names)
    resid, ss, df = np.zeros(k), np.zeros(k), np.zeros(k)
    for c, n in enumerate(names):
        for task in tasks:
            v = values[n].values[task]  # (S, n_t)
            if v.shape[0] > 1:
                resid[c] += residual_mean_square(v) / v.shape[1] / len(tasks) ** 2
        scores = values[n].scores
        if len(scores) > 1:
            ss[c] = float(((scores - scores.mean()) ** 2).sum()) - (len(scores) - 1) * resid[c]
            df[c] = len(scores) - 1
    return resid, ss, df


# ----------------------------------------------------------------------------- simultaneous intervals


@functools.lru_cache(maxsize=512)
def _inflation_nodes(df: float) -> tuple[np.ndarray, np.ndarray]:
    """Nodes and weights of E[g(df / X)] for X ~ chi-square(df): generalized Gauss-Laguerre in X / 2, whose
    weight x^(df/2 - 1) e^-x is the chi-square's own density (exact for the smooth integrands used here to
    about 1e-5 of the tail; a deterministic expectation, so the same data always give the same interval)."""
    y, w = special.roots_genlaguerre(QUADRATURE, df / 2 - 1)
    return df / (2 * y), w / w.sum()


def _error_law(f: Fit, i: int, j: int) -> tuple[np.ndarray, np.ndarray]:
    """(sd, weight) nodes of the law of the error of ``estimate_i - estimate_j``: normal given the seed
    variances, their example part as measured and each pool's seed variance drawn from its fiducial law
    ``raw * df / chi-square(df) - example noise`` (raw: the pool's variance of seed scores, example noise left
    in; so an estimate that fell to 0 by chance does not narrow the law). With the seed part alone this is
    Student's t with the pool's df, exactly; with the example part beside it, the mixture in between. (A
    plug-in seed variance from 1 to 5 df covered 85% for a nominal 95% at 2 seeds.)"""
    c = f.example_cov
    var = np.array([max(c[i, i] + c[j, j] - 2 * c[i, j], 0.0)])  # the example part (thousands of df: known)
    weight = np.ones(1)
    for p in sorted({int(f.pool[m]) for m in (i, j) if f.seed_df[m] > 0}):  # one chi-square per pool
        members = [m for m in (i, j) if f.pool[m] == p and f.seed_df[m] > 0]
        inflation, w = _inflation_nodes(float(f.seed_df[members[0]]))
        part = sum(np.maximum(f.seed_var_raw[m] * inflation - f.seed_noise[m], 0.0) / f.seeds[m] for m in members)
        var = (var[:, None] + part[None, :]).ravel()  # a product grid over the pools of the pair
        weight = (weight[:, None] * w[None, :]).ravel()
    return np.sqrt(np.maximum(var, 1e-30)), weight


def _tails(f: Fit, pairs: Sequence[tuple[int, int]]):
    """q -> (P,) P(error_ij / se_ij > q) per pair (one-sided; the law is symmetric): se the intervals' own."""
    laws = [_error_law(f, i, j) for i, j in pairs]
    se = np.array([f.pair_se(i, j) for i, j in pairs])
    sizes = [len(sd) for sd, _ in laws]
    sd = np.concatenate([s for s, _ in laws])  # (N,) every pair's nodes, flat
    w = np.concatenate([x for _, x in laws])
    owner = np.repeat(np.arange(len(pairs)), sizes)
    ratio = se[owner] / sd

    def tails(q: float) -> np.ndarray:
        return np.bincount(owner, weights=w * special.ndtr(-q * ratio), minlength=len(pairs))

    return tails


def critical_value(f: Fit, alpha: float, family: str) -> float:
    """The critical value ``q`` of a family's simultaneous intervals ``diff +- q * se`` at level 1 - alpha, by
    Bonferroni over the family's comparisons with each comparison's exact law (``_error_law``):

    - ``"pairs"``: every pair, two-sided: sum over pairs of P(|t_ij| > q) = alpha.
    - ``"best"``: multiple comparisons with the best (Hsu): one-sided comparisons of every other configuration
      with the true best, whichever it is: max over i of sum over j != i of P(t_ji > q) = alpha. Intervals of
      ``score_i - max_(j != i) score_j`` built with this q hold for every i at once (``Intervals.vs_best``).

    No random numbers: the same fit gives the same q."""
    k = len(f.names)
    if k < 2:
        return math.nan
    pairs = all_pairs(k)
    tails = _tails(f, pairs)
    owner_a, owner_b = np.array(pairs).T
    if family == "pairs":

        def error(q: float) -> float:
            return 2 * float(tails(q).sum()) - alpha
    else:

        def error(q: float) -> float:
            t = tails(q)
            per = np.bincount(owner_a, weights=t, minlength=k) + np.bincount(owner_b, weights=t, minlength=k)
            return float(per.max()) - alpha

    if error(0.0) <= 0:
        return 0.0
    high = 8.0
    while error(high) > 0 and high < 1e6:
        high *= 4
    return float(optimize.brentq(error, 0.0, high, xtol=1e-6))


def estimate_errors(f: Fit, rng: np.random.Generator, draws: int) -> np.ndarray:
    """(draws, K) draws of the estimates' errors under the same law as the intervals' (``_error_law``, jointly
    for all K): for P(best) and the regret, which need the joint law."""
    k = len(f.names)
    ex = f.example_cov + 1e-15 * np.eye(k)
    z = rng.multivariate_normal(np.zeros(k), ex, size=draws, method="eigh")  # (draws, K) example part
    inflation = np.ones((draws, k))
    for p in np.unique(f.pool):
        mine = f.pool == p
        df = f.seed_df[mine][0]
        if df > 0:
            inflation[:, mine] = (df / rng.chisquare(df, size=draws))[:, None]
    component = np.maximum(f.seed_var_raw[None, :] * inflation - f.seed_noise[None, :], 0.0)  # (draws, K)
    component = np.where(f.seed_df[None, :] > 0, component, 0.0)
    z += rng.standard_normal((draws, k)) * np.sqrt(component / f.seeds)  # the seed part, independent per config
    return z


def all_pairs(k: int) -> list[tuple[int, int]]:
    return [(i, j) for i in range(k) for j in range(i + 1, k)]


@dataclass(frozen=True)
class Intervals:
    """A family's simultaneous intervals at ``level``: of every pair (``q``, two-sided) and of each
    configuration against the best of the others (``q_best``, Hsu's comparisons with the best)."""

    fit: Fit
    q: float
    q_best: float
    level: float

    def diff(self, i: int, j: int) -> tuple[float, float, float]:
        """(estimate, low, high) of score(i) - score(j), from the all-pairs family."""
        d = float(self.fit.means[i] - self.fit.means[j])
        h = self.q * self.fit.pair_se(i, j)
        return d, d - h, d + h

    def vs_best(self, i: int) -> tuple[float, float, float]:
        """(estimate, low, high) of score(i) - max over j != i of score(j): Hsu's constrained interval. The low
        end above -margin says i is not worse than the best by more than margin; above 0, that i is the best."""
        f = self.fit
        others = [j for j in range(len(f.names)) if j != i]
        h = np.array([self.q_best * f.pair_se(i, j) for j in others])
        d = f.means[i] - f.means[others]
        return float(d.min()), float((d - h).min()), float(max((d + h).min(), 0.0))


def intervals(f: Fit, alpha: float) -> Intervals:
    decidable = bool((f.seed_df > 0).any()) or bool((f.seeds > 1).any())
    if not decidable or len(f.names) < 2:
        return Intervals(f, math.inf, math.inf, 1 - alpha)
    return Intervals(f, critical_value(f, alpha, "pairs"), critical_value(f, alpha, "best"), 1 - alpha)


def pair_word(low: float, high: float, margin: float) -> str:
    """The word for an oriented pair (its estimate >= 0): better, equivalent or cannot tell."""
    if low > 0:
        return BETTER
    if -margin <= low and high <= margin:
        return EQUIVALENT
    return CANNOT_TELL


# ----------------------------------------------------------------------------- one budget's answer


@dataclass
class Answer:
    """One budget's answer at one look."""

    budget: float
    members: list[str]
    best: str | None = None
    pick: str | None = None
    decision: str = CANNOT_TELL  # better | not worse | cannot tell | only one fits | none fits
    diff: float = math.nan  # pick - best (a "better" best: best - the strongest cheaper one)
    ci_low: float = math.nan
    ci_high: float = math.nan
    level: float = math.nan
    look: int = 0
    p_best: dict[str, float] = field(default_factory=dict)
    regret: float = math.nan  # the pick's expected shortfall from the best, and its 95% upper bound
    regret_high: float = math.nan
    needs: str = ""  # what would decide it
    seeds_needed: int = 0  # where more seeds would: about how many per configuration (0: not seeds, or unknown)
    grow: list[str] = field(default_factory=list)  # configurations a further seed could decide it with
    # the claims about its configurations, this look's with the earlier looks' (a claim, once made, stands)
    claims: dict[str, Claim] = field(default_factory=dict)
    why: str = ""
    pairs: list[dict] = field(default_factory=list)  # every pair of its family at its look (``pair_rows``)

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
    """What a look showed about one configuration against the best of the others, with the interval that showed it."""

    word: str  # "not worse" (within the margin of the best of the others) or "worse" (by more than the margin)
    look: int
    diff: float  # this configuration - the best of the others, at that look
    low: float
    high: float
    level: float


def answer(budget: float, iv: Intervals, costs: Mapping[str, float], margin: float, max_seeds: int,
           q_last: float, posterior: bool = True, claims: Mapping[str, Claim] | None = None,
           look: int = 0) -> Answer:  # fmt: skip
    """The answer for the configurations of ``iv`` (all under the budget) at this look (module docstring);
    ``posterior``: also P(best) and the regret, which decide nothing (a simulation leaves them out).

    Each configuration cheaper than the best has a question: is it worse than the best of the others by more
    than ``margin``? It is answered "not worse" (its interval's low end at or above -margin), "worse" (its high
    end below -margin), or not at all. The pick is the cheapest configuration shown not worse (the best itself
    when none is). The budget is decided when every configuration cheaper than the pick is answered "worse";
    while one is open and seeds could still answer it (``_open_questions``), it and the best get the next seed;
    else the budget stays "cannot tell", said with what would tell."""
    f = iv.fit
    names = list(f.names)
    out = Answer(budget, names, level=iv.level, look=look)
    if not names:
        out.decision = "none fits"
        return out
    order = sorted(range(len(names)), key=lambda i: (-f.means[i], costs[names[i]], names[i]))
    best = order[0]
    out.best = names[best]
    if len(names) == 1:
        out.pick, out.decision = names[best], "only one fits"
        return out
    by_cost = sorted(range(len(names)), key=lambda i: (costs[names[i]], -f.means[i], names[i]))
    vs_best = {i: iv.vs_best(i) for i in by_cost}  # (estimate, low, high) against the best of the others
    low_of = {i: v[1] for i, v in vs_best.items()}
    out.claims = dict(claims or {})  # an earlier look's claim stands (Bonferroni over the looks covers it)
    for i in by_cost:
        if names[i] not in out.claims and (low_of[i] >= -margin or vs_best[i][2] < -margin):
            word = NOT_WORSE if low_of[i] >= -margin else "worse"
            out.claims[names[i]] = Claim(word, look, *vs_best[i], iv.level)
    not_worse = [i for i in by_cost if names[i] in out.claims and out.claims[names[i]].word == NOT_WORSE]
    chosen = not_worse[0] if not_worse else None
    # the questions still open: configurations at least as cheap as the pick (as the best, without one) neither
    # shown not worse nor shown worse by more than the margin
    before = by_cost[: by_cost.index(chosen)] if chosen is not None else by_cost[: by_cost.index(best) + 1]
    open_ = [j for j in before if names[j] not in out.claims]
    pick = chosen if chosen is not None else best
    out.pick = names[pick]
    out.diff, out.ci_low, out.ci_high = vs_best[pick]
    if posterior:
        out.p_best, out.regret, out.regret_high = _posterior(f, pick)
    if chosen is not None:  # a claim: the pick is within the margin of the best of the others
        out.decision = BETTER if chosen == best and low_of[best] > 0 else NOT_WORSE
        out.why = (
            f"the cheapest configuration shown not worse than the best of the others by more than {margin:g}"
            + (" (at an earlier look: the interval printed is this look's)" if low_of[chosen] < -margin else "")
            + ("; every cheaper one is shown worse by more than that" if before and not open_ else "")
        )
        if not open_:
            return out
    out.grow, needs, out.seeds_needed = _open_questions(iv, open_ or [pick], costs, margin, max_seeds, q_last)
    if chosen is None:
        out.decision, out.needs = CANNOT_TELL, needs
        out.why = (f"open: no configuration shown within {margin:g} of the best of the others, and "
                   f"{len(open_ or [pick])} neither shown within it nor shown worse by more than it")  # fmt: skip
    else:  # the claim stands; while seeds may answer a cheaper one, the budget stays open (``Answer.decided``)
        cheaper = ", ".join(names[j] for j in open_)
        out.needs = f"cheaper and still open at margin {margin:g}: {cheaper}; {needs}"
    return out


def _open_questions(iv: Intervals, open_: Sequence[int], costs, margin: float, max_seeds: int,
                    q_last: float) -> tuple[list[str], str, int]:  # fmt: skip
    """(configurations worth a seed, what would decide the question). Each open configuration j is compared with
    the best of the others (its rival r). It gets seeds, with r, while the seeds left (up to ``max_seeds`` on
    both sides) could answer it: with the last look's ``q_last`` and the standard error at ``max_seeds``
    (``se``), "not worse" or "worse by more than the margin" must be reachable for a difference one ``se``
    beyond its estimate. Otherwise its question is futile at this plan, and what would tell is said (with the
    seeds per configuration that would, where seeds would)."""
    f = iv.fit
    at_max = np.maximum(f.seeds, max_seeds).astype(float)
    grow: set[str] = set()
    for j in open_:
        r = max((i for i in range(len(f.names)) if i != j), key=lambda i: f.means[i])
        gap, se = float(f.means[j] - f.means[r]), f.pair_se(r, j, at_max)
        h = q_last * se
        reachable = gap + se - h >= -margin or gap - se + h < -margin
        if reachable and (f.seeds[j] < max_seeds or f.seeds[r] < max_seeds):
            grow |= {f.names[j], f.names[r]}
    if grow:
        return sorted(grow), f"more seeds may decide it (up to {max_seeds})", 0
    j = min(open_, key=lambda o: (costs[f.names[o]], f.names[o]))
    r = max((i for i in range(len(f.names)) if i != j), key=lambda i: f.means[i])
    gap = float(f.means[j] - f.means[r])
    se_max = f.pair_se(r, j, at_max)
    ex_se = f.pair_se(r, j, np.full(len(f.names), 1e12))  # the example term alone: infinite seeds
    route = abs(gap + margin)  # the interval's half-width must shrink below the estimate's distance to -margin
    if route <= 1e-12:
        return [], f"cannot tell: {f.names[j]} is estimated on the margin {-margin:+.3f} itself", 0
    if q_last * ex_se >= route:
        factor = (q_last * ex_se / route) ** 2  # the example term shrinks as 1 / sqrt(decision examples)
        return [], (f"cannot tell at margin {margin:g} with {max_seeds} seeds: the decision examples' noise alone "
                    f"(se {ex_se:.4f}) keeps {f.names[j]} open; about {factor:.1f}x the decision examples would "
                    "tell at these estimates"), 0  # fmt: skip
    seed_part = route**2 / q_last**2 - ex_se**2
    seeds = math.ceil(max(se_max**2 - ex_se**2, 1e-12) * max_seeds / max(seed_part, 1e-12))
    return [], (f"cannot tell at margin {margin:g} with {max_seeds} seeds: about {seeds} seeds per configuration "
                f"would tell at these estimates"), seeds  # fmt: skip


def _stream(*parts) -> np.random.Generator:
    """A generator from the names and numbers it is for only: the same estimates give the same P(best)."""
    text = "\0".join(map(str, parts)).encode()
    return np.random.default_rng(int.from_bytes(hashlib.sha256(text).digest()[:8], "little"))


def _posterior(f: Fit, pick: int, draws: int = 4000) -> tuple[dict[str, float], float, float]:
    """P(best) of each configuration and the pick's expected regret (and its 95% bound): the true scores drawn
    around the estimates from the same law as the intervals' (``estimate_errors``; flat prior)."""
    rng = _stream("posterior", f.names, f.means.tobytes())
    mu = f.means[None, :] - estimate_errors(f, rng, draws)
    winner = mu.argmax(axis=1)
    p_best = {n: float(np.mean(winner == i)) for i, n in enumerate(f.names)}
    regret = mu.max(axis=1) - mu[:, pick]
    return p_best, float(regret.mean()), float(np.quantile(regret, 0.95))


# ----------------------------------------------------------------------------- the sequential plan


@dataclass(frozen=True)
class Plan:
    """What the confirmation does: ``seeds`` first seeds, up to ``max_seeds``; ``alpha`` over all looks."""

    seeds: int
    max_seeds: int
    margin: float
    alpha: float = ALPHA
    budgets: tuple[float, ...] = BUDGETS_PCT

    @property
    def looks(self) -> int:
        return self.max_seeds - self.seeds + 1

    def alpha_at(self, look: int) -> float:
        """The alpha spent at look ``look`` (1-based): half of it at the last look, the other half shared by the
        earlier ones (Bonferroni over the looks: they sum to alpha). The last look, at ``max_seeds``, is where a
        close question is decided: an even split (alpha / L each) cost it most of its power."""
        if self.looks == 1:
            return self.alpha
        if look >= self.looks:
            return self.alpha * FINAL_SHARE
        return self.alpha * (1 - FINAL_SHARE) / (self.looks - 1)


@dataclass(frozen=True)
class Configuration:
    """A configuration the confirmation trains: its method, its cost (trainable % per task), its role."""

    name: str
    method: str
    trainable_pct: float
    default: bool = False


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


def replay(values: Mapping[str, Values], configurations: Sequence[Configuration], plan: Plan,
           summaries: bool = True) -> Outcome:  # fmt: skip
    """Replay the confirmation on the predictions there are: look 1 with every configuration's first
    ``plan.seeds`` seeds; at each look, decide every budget; the configurations worth a seed in an open budget
    get their next seed (the next in their numbered order) if the data hold it, and the next look follows; it
    ends when every budget is decided or futile, at ``max_seeds``, or where the data hold no wanted seed (the
    confirmation trains those: ``next_seeds``). Deterministic: the same data give the same outcome.
    ``summaries``: also what decides nothing (P(best), regret, the all-configurations pair table); a
    simulation of the decisions' error rates leaves them out."""
    known = [c for c in configurations if c.name in values and len(values[c.name].seeds)]
    count = {c.name: min(plan.seeds, len(values[c.name].seeds)) for c in known}
    settled: dict[float, Answer] = {}
    claims: dict[float, dict[str, Claim]] = {}  # per budget, the claims made so far
    reasons: dict[str, str] = {c.name: "" for c in known}
    look, answers, wanted = 0, [], {}
    while True:
        look += 1
        data = {n: values[n].first(count[n]) for n in count}
        answers = _look(data, known, plan, look, settled, summaries, claims)
        for a in answers:
            claims[a.budget] = dict(a.claims)
            if a.decided and a.budget not in settled:
                settled[a.budget] = a
        grow = sorted({n for a in answers if not a.decided for n in a.grow if count[n] < plan.max_seeds})
        if look >= plan.looks or not grow:
            stopped = "decided" if all(a.decided or a.decision in ("only one fits", "none fits") for a in answers) \
                else ("max_seeds" if look >= plan.looks else "futile")  # fmt: skip
            for n in count:
                reasons[n] = reasons[n] or _reason(n, answers, stopped)
            everything = _all_family(data, known, plan, look) if summaries else []
            return Outcome(answers, dict(count), reasons, {}, look, stopped, data, plan, everything)
        wanted = {n: values[n].seeds[count[n]] if count[n] < len(values[n].seeds) else None for n in grow}
        missing = {n: _next_seed(values[n].seeds) for n, s in wanted.items() if s is None}
        if missing:  # the data stop here: the confirmation trains these next (a record: it stopped adding)
            for n in count:
                why = "open: its next seed was not trained (max_seconds, or the sweep was interrupted)"
                reasons[n] = reasons[n] or (why if n in missing else _reason(n, answers, "open"))
            return Outcome(answers, dict(count), reasons, missing, look, "", data, plan)
        for n in grow:
            count[n] += 1


def _all_family(data: Mapping[str, Values], known: Sequence[Configuration], plan: Plan, look: int) -> list[dict]:
    names = [c.name for c in known]
    if len(names) < 2:
        return []
    f = fit(data, names)
    return pair_rows(intervals(f, plan.alpha_at(look)), plan.margin, "all")


def _next_seed(seeds: Sequence[int]) -> int:
    return max(seeds) + 1


def _reason(name: str, answers: Sequence[Answer], stopped: str) -> str:
    mine = [a for a in answers if name in a.members]
    if not mine:
        return "in no budget"
    if all(a.decided for a in mine):
        return "decided"
    return stopped


def _look(data: Mapping[str, Values], known: Sequence[Configuration], plan: Plan, look: int,
          settled: Mapping[float, Answer], summaries: bool = True,
          claims: Mapping[float, Mapping[str, Claim]] | None = None) -> list[Answer]:  # fmt: skip
    costs = {c.name: c.trainable_pct for c in known}
    q_cache: dict[tuple[str, ...], float] = {}
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
        f = fit(data, members, pooled=list(data))
        iv = intervals(f, plan.alpha_at(look))
        key = tuple(members)
        if key not in q_cache:  # the last look's q at max_seeds: what more seeds could reach
            q_cache[key] = _q_at_max(f, plan)
        a = answer(budget, iv, costs, plan.margin, plan.max_seeds, q_cache[key], posterior=summaries,
                   claims=(claims or {}).get(budget), look=look)  # fmt: skip
        a.pairs = pair_rows(iv, plan.margin, budget)
        if not np.isfinite(iv.q):
            a.needs = "no seed variance can be estimated below 2 seeds: confirm with 2 or more"
            a.grow = [n for n in members if len(data[n].seeds) < 2]
        out.append(a)
    return out


def _q_at_max(f: Fit, plan: Plan) -> float:
    """The critical value a look at ``max_seeds`` seeds everywhere would use (the futility rule's yardstick)."""
    full = np.maximum(f.seeds, plan.max_seeds).astype(float)
    df = np.maximum(f.seed_df, (plan.max_seeds - 1) * np.bincount(f.pool)[f.pool])
    g = Fit(f.names, f.means, full, f.example_cov, f.seed_var, df.astype(float), f.pool, f.seed_var_raw, f.seed_noise)
    return critical_value(g, plan.alpha_at(plan.looks), "best")


# ----------------------------------------------------------------------------- what the sweep can reach


def reachable_margin(examples: int, configurations: int, plan: Plan, *, disagreement: float = 0.25,
                     seed_sd: float = 0.02, power: float = 0.8) -> float:  # fmt: skip
    """The smallest margin (delta) at which a configuration truly equal to the best is shown not worse with
    ``power`` at ``max_seeds``, for ``configurations`` in one budget on ``examples`` decision examples; assumed
    components (defaults from this project's cpu jobs): two configurations disagree on ``disagreement`` of the
    examples, a seed moves a score by ``seed_sd``. An approximation for planning; the report measures."""
    from scipy import stats

    k = max(configurations, 2)
    se = math.sqrt(disagreement / examples + 2 * seed_sd**2 / plan.max_seeds)
    # comparisons with the best: k - 1 one-sided ones at the last look's alpha, by Bonferroni (as ``critical_value``)
    q = stats.norm.ppf(1 - plan.alpha_at(plan.looks) / (k - 1))
    return float((q + stats.norm.ppf(power)) * se)


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
                          "regret", "regret_high", "level", "look", "needs"]  # fmt: skip


def recommendation_table(outcome: Outcome) -> pd.DataFrame:
    rows = []
    for a in outcome.answers:
        rows.append({"budget": a.budget, "pick": a.pick, "best": a.best, "decision": a.decision, "diff_mean": a.diff,
                     "ci_low": a.ci_low, "ci_high": a.ci_high, "p_best": a.p_best.get(a.pick, math.nan)
                     if a.pick else math.nan, "regret": a.regret, "regret_high": a.regret_high, "level": a.level,
                     "look": a.look, "needs": a.needs})  # fmt: skip
    return pd.DataFrame(rows, columns=RECOMMENDATION_COLUMNS)


def seeds_table(outcome: Outcome | None) -> pd.DataFrame:
    """One row per configuration: the seeds the replay used and why adding stopped."""
    used = outcome.seeds_used.items() if outcome is not None else ()
    return pd.DataFrame(
        [{"config": n, "seeds_used": s, "stop_reason": outcome.stop_reason.get(n, "")} for n, s in used],
        columns=["config", "seeds_used", "stop_reason"],
    )


# ----------------------------------------------------------------------------- `peftune decide`


def read_table(path, what: str, columns: Sequence[str]) -> pd.DataFrame:
    """A CSV (or Parquet, by extension) with at least ``columns``; ValueError naming the file otherwise."""
    from pathlib import Path

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: {what} file not found" if not path.exists() else f"{path}: is not a file")
    try:
        frame = pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)
    except Exception as error:  # noqa: BLE001 -- pandas' parsers raise many kinds: one line names the file
        raise ValueError(f"{path}: cannot be read as {what} ({str(error).splitlines()[0][:120]})") from None
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ValueError(f"{path}: {what} lacks the column(s) {missing}; expected {list(columns)}")
    return frame


def configurations_from_frame(frame: pd.DataFrame, source) -> list[Configuration]:
    """``C`` of ``peftune decide``: one row per configuration (config, method, trainable_pct, default)."""
    out = []
    for line, r in zip(range(2, len(frame) + 2), frame.itertuples(index=False), strict=True):
        pct = pd.to_numeric(pd.Series([r.trainable_pct]), errors="coerce").iloc[0]
        if not (isinstance(pct, float) and math.isfinite(pct) and pct >= 0):
            raise ValueError(f"{source}: line {line}: trainable_pct {r.trainable_pct!r}, expected a number >= 0")
        default = str(r.default).strip().lower()
        if default not in ("true", "false", "1", "0"):
            raise ValueError(f"{source}: line {line}: default {r.default!r}, expected true or false")
        out.append(Configuration(str(r.config), str(r.method), float(pct), default in ("true", "1")))
    names = [c.name for c in out]
    if len(set(names)) != len(names):
        raise ValueError(f"{source}: a configuration is listed twice")
    return out
