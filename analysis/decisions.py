"""Decisions: is configuration A better than B, equivalent to it, or is the question still open?

Every comparison the report makes is between two configurations (a method at a size, with a set of
hyperparameters), each trained with several seeds and evaluated on the same dev examples. Following
Bouthillier et al. 2021 ("Accounting for Variance in Machine Learning Benchmarks"), a comparison accounts
for both sources of variance, which dev examples and which seeds, and a family of comparisons is
corrected for multiplicity (Holm). Definitions (the report quotes them):

- **Score.** Per seed, the mean over the configuration's tasks of the task metrics on the dev examples:
  accuracy (share of predictions equal to the label) for ``multiclass`` and ``binary`` tasks, Pearson r
  between prediction and label for ``regression`` tasks (0 when either is constant). A configuration's
  score is the mean of its seeds' scores. ``diff_mean`` = score(A) - score(B), on all examples and seeds.
- **Paired bootstrap.** ``n_boot`` draws (default 2000) of the difference, each of which resamples with
  replacement, for every task, the dev examples, the *same* examples for A and B (paired: both were
  evaluated on them, so an example's difficulty cancels out of the difference), and, independently for A
  and for B, that side's seeds. A single seed contributes no seed variance.
- **Interval.** The percentile interval of the bootstrap differences at level L: their (1 - L)/2 and
  (1 + L)/2 quantiles (inverted-CDF quantiles, so the interval excludes 0 exactly when the p-value is
  below 1 - L, down to the bootstrap's resolution 1/n_boot).
- **p-value.** Two-sided bootstrap p-value of "no difference":
  ``p = 2 * min(share of draws <= 0, share of draws >= 0)``, clipped to [1/n_boot, 1].
- **Resolvable gap.** The smallest true difference the comparison would call "better" with 80% power, in
  the normal approximation: ``(z_{(1+L)/2} + z_{0.80}) * se``, se the standard deviation of the bootstrap
  differences. A gap below it going undetected says nothing about its absence.
- **Family (Holm).** A report's m comparisons are sorted by p-value (ties keep their order); the k-th
  (k = 0 .. m-1) is judged at level ``1 - alpha / (m - k)`` as long as every earlier one was rejected (its
  interval excludes 0); the first that is not stops the step-down, and its level applies to it and to all
  later ones. Saying "better" of any pair with no true difference then happens with probability at most
  alpha (5%) across the whole family. Each pair is oriented so that A has the higher (or equal) point
  estimate; ``swapped`` says when that reversed the pair as given.

The three words (``DECISIONS``), for the interval at the comparison's level and a margin (default 0.01,
one point of score):

- **better**: the interval lies above 0: A beats B (this takes precedence: an interval inside
  (0, margin] is "better", a real but small gap);
- **equivalent**: the interval lies inside [-margin, +margin]: any difference is smaller than the margin;
- **inconclusive**: otherwise: the data cannot tell; the resolvable gap says how large a gap they could.

Expected maximum (Dodge et al. 2019, "Show Your Work"): ``expected_max_curve`` is the expected best score
of n search trials drawn with replacement from the observed ones, for n = 1, 2, ...; with the default
configuration as the first trial, ``expected_max_with_default``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

KINDS = ("multiclass", "binary", "regression")
DECISIONS = {
    "better": "the interval lies above 0: A beats B",
    "equivalent": "the interval lies inside [-margin, +margin]: any difference is smaller than the margin",
    "inconclusive": "otherwise: the data cannot tell",
}
COLUMNS = [
    "comparison",
    "budget",
    "a",
    "b",
    "diff_mean",
    "ci_low",
    "ci_high",
    "decision",
    "seeds_a",
    "seeds_b",
    "level",
    "p_value",
    "resolvable_gap",
    "swapped",
]
Z_POWER = 0.8416212335729143  # the normal 80% quantile: 80% power
CHUNK_ELEMENTS = 1 << 22  # bootstrap draws x examples per chunk: about 32 MB per (draws, n) float array


# ----------------------------------------------------------------------------- predictions


@dataclass(frozen=True)
class Predictions:
    """One configuration's dev predictions: for every task, the labels (n_t,) and a (S, n_t) array of the
    S seeds' predictions, seeds listed in ``seeds``; ``example_ids`` (optional) name the examples, in order."""

    labels: Mapping[str, np.ndarray]  # task -> (n_t,) float: class ids for classification, targets for regression
    predictions: Mapping[str, np.ndarray]  # task -> (S, n_t)
    seeds: tuple[int, ...]
    kinds: Mapping[str, str]  # task -> "multiclass" | "binary" | "regression"
    example_ids: Mapping[str, np.ndarray] | None = None  # task -> (n_t,)

    def __post_init__(self):
        tasks = set(self.labels)
        if not tasks or set(self.predictions) != tasks or set(self.kinds) != tasks:
            raise ValueError(
                f"labels, predictions and kinds must name the same tasks: "
                f"{sorted(self.labels)}, {sorted(self.predictions)}, {sorted(self.kinds)}"
            )
        for task in tasks:
            n, shape = len(self.labels[task]), np.shape(self.predictions[task])
            if shape != (len(self.seeds), n):
                raise ValueError(f"task {task!r}: predictions of shape {shape}, expected ({len(self.seeds)}, {n})")
            if self.kinds[task] not in KINDS:
                raise ValueError(f"task {task!r}: kind {self.kinds[task]!r}, expected one of {KINDS}")
            if self.example_ids is not None and len(self.example_ids[task]) != n:
                raise ValueError(f"task {task!r}: {len(self.example_ids[task])} example ids for {n} labels")

    @property
    def tasks(self) -> tuple[str, ...]:
        return tuple(sorted(self.labels))


def predictions_from_frame(
    frame: pd.DataFrame, labels_by_task: Mapping[str, pd.Series], kinds: Mapping[str, str]
) -> Predictions:
    """One configuration's ``Predictions`` from a long frame with columns ``task, example_id, seed, prediction``
    (one row per example per seed). ``labels_by_task``: task -> labels indexed by example_id, the reference
    dev set every configuration must cover exactly (so configurations built with it are paired). Examples
    are sorted by example_id. Raises ValueError naming the task on a missing or extra example, a duplicate
    row, a seed without the task, or a task without labels."""
    missing_columns = {"task", "example_id", "seed", "prediction"} - set(frame.columns)
    if missing_columns:
        raise ValueError(f"the predictions frame lacks the columns {sorted(missing_columns)}")
    extra = set(frame["task"].unique()) - set(labels_by_task)
    if extra:
        raise ValueError(f"no labels for the task(s) {sorted(extra)}")
    seeds = tuple(sorted(int(s) for s in frame["seed"].unique()))
    labels, predictions, example_ids = {}, {}, {}
    for task, task_labels in labels_by_task.items():
        rows = frame[frame["task"] == task]
        if rows.empty:
            raise ValueError(f"task {task!r}: no predictions")
        if rows.duplicated(["example_id", "seed"]).any():
            raise ValueError(f"task {task!r}: more than one prediction for an example and seed")
        if task_labels.index.has_duplicates:
            raise ValueError(f"task {task!r}: duplicate example ids among the labels")
        _check_same_examples(task, set(rows["example_id"]), set(task_labels.index))
        ids = task_labels.sort_index().index
        table = rows.pivot(index="seed", columns="example_id", values="prediction")  # (S, n_t)
        table = table.reindex(index=list(seeds), columns=ids)
        if table.isna().any(axis=None):
            lacking = sorted(int(s) for s in table.index[table.isna().any(axis=1)])
            raise ValueError(f"task {task!r}: seed(s) {lacking} lack predictions for some examples")
        labels[task] = task_labels.loc[ids].to_numpy(dtype=float)
        predictions[task] = table.to_numpy(dtype=float)
        example_ids[task] = ids.to_numpy()
    return Predictions(labels, predictions, seeds, {t: kinds[t] for t in labels}, example_ids)


def _check_same_examples(task: str, ours: set, theirs: set) -> None:
    if ours != theirs:
        missing, extra = sorted(theirs - ours, key=str), sorted(ours - theirs, key=str)
        raise ValueError(
            f"task {task!r}: the example sets differ ({len(missing)} missing, e.g. {missing[:3]}; "
            f"{len(extra)} extra, e.g. {extra[:3]}): configurations must be evaluated on the same dev examples"
        )


def _check_paired(a: Predictions, b: Predictions) -> None:
    """Raise ValueError (naming the task) unless a and b were evaluated on the same examples of the same tasks."""
    if a.tasks != b.tasks:
        raise ValueError(f"the configurations have different tasks: {list(a.tasks)} and {list(b.tasks)}")
    for task in a.tasks:
        if a.kinds[task] != b.kinds[task]:
            raise ValueError(f"task {task!r}: kinds {a.kinds[task]!r} and {b.kinds[task]!r} differ")
        if a.example_ids is not None and b.example_ids is not None:
            _check_same_examples(task, set(a.example_ids[task]), set(b.example_ids[task]))
            if not np.array_equal(a.example_ids[task], b.example_ids[task]):
                raise ValueError(f"task {task!r}: the same examples in another order")
        if not np.array_equal(a.labels[task], b.labels[task]):
            raise ValueError(f"task {task!r}: the labels differ: configurations must share the dev examples")


# ----------------------------------------------------------------------------- score


def score(
    pred: Predictions, example_idx: Mapping[str, np.ndarray] | None = None, seed_idx: np.ndarray | None = None
) -> np.ndarray:
    """(B,) scores: for each of B bootstrap draws, the mean over the resampled seeds ``seed_idx`` (B, S) of
    the seed's score on the resampled examples ``example_idx[task]`` (B, n_t). Without indices the plain
    estimate (B = 1); either may be None (all examples / all seeds in every draw)."""
    sizes = [len(i) for i in (example_idx or {}).values()] + ([len(seed_idx)] if seed_idx is not None else [])
    if len(set(sizes)) > 1:
        raise ValueError(f"the indices disagree on the number of draws: {sorted(set(sizes))}")
    weights = {t: _counts(example_idx[t], len(pred.labels[t])) for t in pred.tasks} if example_idx else None
    return _score(pred, weights, seed_idx)


def _counts(idx: np.ndarray, n: int) -> np.ndarray:
    """(B, n) resampled example indices -> (B, n) float weights: how often each example was drawn."""
    b = len(idx)
    flat = (idx + np.arange(b, dtype=np.int64)[:, None] * n).ravel()
    return np.bincount(flat, minlength=b * n).reshape(b, n).astype(float)


def _score(pred: Predictions, weights: Mapping[str, np.ndarray] | None, seed_idx: np.ndarray | None) -> np.ndarray:
    """``score`` with the examples given as weights (B, n_t) (None: every example once)."""
    per_seed = sum(_metric(pred, t, None if weights is None else weights[t]) for t in pred.tasks) / len(pred.tasks)
    if seed_idx is None:  # per_seed: (B, S) or (1, S)
        return per_seed.mean(axis=1)
    per_seed = np.broadcast_to(per_seed, (len(seed_idx), per_seed.shape[1]))
    return np.take_along_axis(per_seed, seed_idx, axis=1).mean(axis=1)  # (B,)


def _metric(pred: Predictions, task: str, w: np.ndarray | None) -> np.ndarray:
    """(B, S): the task metric of every seed on every draw's examples, weighted by w (B, n) (None: (1, n) ones)."""
    y, x = pred.labels[task], pred.predictions[task]  # (n,), (S, n)
    w = np.ones((1, len(y))) if w is None else w  # (B, n)
    if pred.kinds[task] in ("multiclass", "binary"):
        return w @ (x == y).T.astype(float) / w.sum(axis=1, keepdims=True)
    return _pearson(x, y, w)


def _pearson(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """(B, S) weighted Pearson r of every seed's predictions x (S, n) with y (n,), weights w (B, n).

    Centred sums (centred on the full sample first, which leaves r unchanged and keeps the sums small);
    a variance below 1e-12 of the raw sum of squares is zero: r = 0, as for a constant prediction."""
    x = x - x.mean(axis=1, keepdims=True)  # (S, n)
    y = (y - y.mean())[:, None]  # (n, 1)
    n = w.sum(axis=1, keepdims=True)  # (B, 1)
    sx, sy = w @ x.T, w @ y  # (B, S), (B, 1)
    sxx, syy, sxy = w @ (x * x).T, w @ (y * y), w @ (x.T * y)  # (B, S), (B, 1), (B, S)
    vx, vy = sxx - sx * sx / n, syy - sy * sy / n
    cov = sxy - sx * sy / n
    ok = (vx > 1e-12 * sxx) & (vy > 1e-12 * syy)  # (B, S)
    return np.where(ok, cov / np.sqrt(np.where(ok, vx * vy, 1.0)), 0.0)


# ----------------------------------------------------------------------------- one comparison


@dataclass(frozen=True)
class Comparison:
    """The paired bootstrap comparison of a with b (``compare``); diff = score(a) - score(b)."""

    diff_mean: float
    ci_low: float
    ci_high: float
    decision: str  # one of DECISIONS
    seeds_a: int
    seeds_b: int
    resolvable_gap: float
    p_value: float
    level: float = 0.95


def bootstrap_diffs(a: Predictions, b: Predictions, *, rng: np.random.Generator, n_boot: int = 2000) -> np.ndarray:
    """(n_boot,) paired bootstrap draws of score(a) - score(b): per draw the same resampled examples for a
    and b, each side's seeds resampled independently. Draws from ``rng``: examples task by task (sorted),
    then a's seeds, then b's; in chunks of draws when the tasks are large (memory: ``CHUNK_ELEMENTS``)."""
    _check_paired(a, b)
    sizes = {task: len(a.labels[task]) for task in a.tasks}
    chunk = max(1, CHUNK_ELEMENTS // max(sizes.values()))
    out = []
    for start in range(0, n_boot, chunk):
        draws = min(chunk, n_boot - start)
        weights = {t: _counts(rng.integers(0, n, size=(draws, n), dtype=np.int32), n) for t, n in sizes.items()}
        seeds_a = rng.integers(0, len(a.seeds), size=(draws, len(a.seeds)))  # (draws, S_a)
        seeds_b = rng.integers(0, len(b.seeds), size=(draws, len(b.seeds)))  # (draws, S_b)
        out.append(_score(a, weights, seeds_a) - _score(b, weights, seeds_b))
    return np.concatenate(out)


def p_value(draws: np.ndarray) -> float:
    """Two-sided bootstrap p-value of "no difference": 2 min(share <= 0, share >= 0), clipped to [1/B, 1]."""
    share = min(np.mean(draws <= 0), np.mean(draws >= 0))
    return float(np.clip(2 * share, 1 / len(draws), 1.0))


def interval(draws: np.ndarray, level: float) -> tuple[float, float]:
    """The percentile interval of the draws at ``level`` (inverted-CDF quantiles)."""
    low, high = np.quantile(draws, [(1 - level) / 2, (1 + level) / 2], method="inverted_cdf")
    return float(low), float(high)


def resolvable_gap(draws: np.ndarray, level: float) -> float:
    """(z_{(1+L)/2} + z_{0.80}) * se: the true gap that an interval at level L excludes 0 for with 80% power."""
    from scipy import stats

    return float((stats.norm.ppf((1 + level) / 2) + Z_POWER) * np.std(draws, ddof=1))


def decide(ci_low: float, ci_high: float, margin: float = 0.01) -> str:
    """The word for an interval of score(a) - score(b) (see ``DECISIONS``)."""
    if ci_low > 0:
        return "better"
    if -margin <= ci_low and ci_high <= margin:
        return "equivalent"
    return "inconclusive"


def summarise(
    a: Predictions, b: Predictions, draws: np.ndarray, *, level: float = 0.95, margin: float = 0.01
) -> Comparison:
    """The ``Comparison`` of a with b from their bootstrap draws, with the interval at ``level``."""
    low, high = interval(draws, level)
    return Comparison(
        diff_mean=float(score(a)[0] - score(b)[0]),
        ci_low=low,
        ci_high=high,
        decision=decide(low, high, margin),
        seeds_a=len(a.seeds),
        seeds_b=len(b.seeds),
        resolvable_gap=resolvable_gap(draws, level),
        p_value=p_value(draws),
        level=level,
    )


def compare(
    a: Predictions,
    b: Predictions,
    *,
    rng: np.random.Generator,
    n_boot: int = 2000,
    level: float = 0.95,
    margin: float = 0.01,
) -> Comparison:
    """Is a better than b? The paired bootstrap of score(a) - score(b), a and b kept as given: call it with
    a the side claimed better (an interval below 0, b better, is "inconclusive" here); ``orient`` orders a
    pair by point estimate, as ``decide_family`` does."""
    return summarise(a, b, bootstrap_diffs(a, b, rng=rng, n_boot=n_boot), level=level, margin=margin)


def orient(a_name: str, a: Predictions, b_name: str, b: Predictions) -> tuple[str, Predictions, str, Predictions, bool]:
    """(a_name, a, b_name, b, swapped): the pair with the higher (or equal) point-estimate score first."""
    if score(b)[0] > score(a)[0]:
        return b_name, b, a_name, a, True
    return a_name, a, b_name, b, False


# ----------------------------------------------------------------------------- a family of comparisons


def holm_levels(p_values: Sequence[float], alpha: float, rejects) -> np.ndarray:
    """Holm's step-down levels, in the order of ``p_values``: sorted by p-value (stable), the k-th gets
    1 - alpha / (m - k) while every earlier one was rejected; from the first non-rejection on, that step's
    level. ``rejects(i, level)`` says whether comparison i is rejected at ``level``."""
    m = len(p_values)
    levels = np.empty(m)
    stop_level = None
    for k, i in enumerate(np.argsort(np.asarray(p_values, dtype=float), kind="stable")):
        if stop_level is not None:
            levels[i] = stop_level
            continue
        levels[i] = 1 - alpha / (m - k)
        if not rejects(i, levels[i]):
            stop_level = levels[i]
    return levels


def pair_rng(seed: int, name_a: str, name_b: str) -> np.random.Generator:
    """The bootstrap generator of the pair (name_a, name_b), either order: from ``seed`` and the two names only.

    One generator shared pair by pair made a pair's interval depend on the pairs drawn before it and on
    their order: one more seed of one configuration moved the intervals of every pair drawn after it (two
    runs of the cpu job whose common runs scored identically differed in 6 of 43 intervals with the same
    predictions on both sides)."""
    names = "\0".join(sorted((name_a, name_b))).encode()
    return np.random.default_rng([seed, int.from_bytes(hashlib.sha256(names).digest()[:8], "little")])


def decide_family(
    pairs: Sequence[tuple[str, str, str, str]],
    configs: Mapping[str, Predictions],
    *,
    margin: float = 0.01,
    alpha: float = 0.05,
    n_boot: int = 2000,
    seed: int = 0,
) -> pd.DataFrame:
    """One row per (comparison, budget, name_a, name_b) of ``pairs``, in their order, with columns ``COLUMNS``.

    Each pair is oriented so that a has the higher point estimate (``swapped``), bootstrapped with its own
    generator (:func:`pair_rng`: reproducible, and the same whatever else the family holds), and judged at
    its Holm level across the family (the same draws, other quantiles)."""
    unknown = sorted({name for *_, x, y in pairs for name in (x, y)} - set(configs))
    if unknown:
        raise ValueError(f"no predictions for the configuration(s) {unknown}")
    rows, draws = [], []
    for comparison, budget, name_a, name_b in pairs:
        a_name, a, b_name, b, swapped = orient(name_a, configs[name_a], name_b, configs[name_b])
        rows.append((comparison, budget, a_name, a, b_name, b, swapped))
        draws.append(bootstrap_diffs(a, b, rng=pair_rng(seed, name_a, name_b), n_boot=n_boot))

    def rejects(i: int, level: float) -> bool:
        low, high = interval(draws[i], level)
        return low > 0 or high < 0

    levels = holm_levels([p_value(d) for d in draws], alpha, rejects)
    out = []
    for (comparison, budget, a_name, a, b_name, b, swapped), d, level in zip(rows, draws, levels, strict=True):
        c = summarise(a, b, d, level=float(level), margin=margin)
        out.append(
            {
                "comparison": comparison,
                "budget": budget,
                "a": a_name,
                "b": b_name,
                "diff_mean": c.diff_mean,
                "ci_low": c.ci_low,
                "ci_high": c.ci_high,
                "decision": c.decision,
                "seeds_a": c.seeds_a,
                "seeds_b": c.seeds_b,
                "level": c.level,
                "p_value": c.p_value,
                "resolvable_gap": c.resolvable_gap,
                "swapped": swapped,
            }
        )
    return pd.DataFrame(out, columns=COLUMNS)


def write_decisions_csv(frame: pd.DataFrame, path) -> Path:
    """Write the ``decide_family`` frame as CSV (no index); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(path, index=False)
    return path


# ----------------------------------------------------------------------------- expected maximum


def _expected_max(values: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """E[max of k draws with replacement from ``values``] for each k in ``draws`` (k >= 1)."""
    v = np.sort(values)  # (N,)
    cdf = np.arange(1, len(v) + 1) / len(v)  # (N,): P(one draw <= v_(i))
    k = np.asarray(draws, dtype=float)[:, None]  # (K, 1)
    mass = cdf**k - (cdf - 1 / len(v)) ** k  # (K, N): P(max of k draws = v_(i))
    return mass @ v


def _finite(scores: Sequence[float], what: str) -> np.ndarray:
    values = np.asarray(scores, dtype=float)
    if values.ndim != 1 or not len(values) or not np.isfinite(values).all():
        raise ValueError(f"{what}: need a non-empty list of finite scores")
    return values


def expected_max_curve(scores: Sequence[float], max_n: int | None = None) -> np.ndarray:
    """(max_n,) expected best score of n = 1 .. max_n trials (default max_n = N = len(scores)).

    Dodge et al. 2019: n i.i.d. draws from the empirical distribution of the N observed trial scores
    (with replacement), ``E[max of n] = sum_i v_(i) ((i/N)^n - ((i-1)/N)^n)`` over the sorted scores v_(1) <=
    ... <= v_(N). n = 1 gives the mean; the curve rises to the maximum as n grows."""
    values = _finite(scores, "expected_max_curve")
    return _expected_max(values, np.arange(1, (max_n or len(values)) + 1))


def expected_max_with_default(
    default_score: float, searched_scores: Sequence[float], max_n: int | None = None
) -> np.ndarray:
    """(max_n,) expected best score when the first trial is the default configuration and the later ones are
    search trials (default max_n = N + 1): n = 1 is ``default_score``; n >= 2 is
    ``E[max(default, max of n-1 draws)] = sum_i max(default, v_(i)) ((i/N)^(n-1) - ((i-1)/N)^(n-1))``
    (the draws as in ``expected_max_curve``)."""
    values = _finite(searched_scores, "expected_max_with_default")
    max_n = max_n or len(values) + 1
    curve = np.full(max_n, float(default_score))
    curve[1:] = _expected_max(np.maximum(values, default_score), np.arange(1, max_n))
    return curve
