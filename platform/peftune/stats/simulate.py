"""Operating characteristics of the decision procedure, measured by simulation through its real code.

A *world* says how a configuration's per-example outcomes arise: example i is right for configuration c and
seed s with probability ``logistic(ease_i + effect_c,i + shift_c,s + noise_c,s,i)`` (``ease`` shared, which
pairs the configurations; ``effect`` a configuration's own take; ``shift`` a seed's; ``noise`` the run's). Each
simulation draws a world's data and calls :func:`peftune.stats.decisions.replay` (the confirmation's loop: its looks,
added seeds, futility stops and answer) with every seed up to ``max_seeds`` present. Rates come with Wilson
95% intervals. Every rate counts claims only: "not worse" or "better" said, never a pick left at "cannot tell".
The logistic reference worlds (``W1``, ``W2``) serve the tests; ``peftune decide --simulate`` runs
:func:`scenario_rates` on a :class:`Measured` world (the README job's components, ``README_JOB``, or a record's
own), which also gives the report its own rates. :func:`within_calibration` (through the loop) and
:func:`stated_at_the_margin` (one look, the truth on the margin) hold the answers' stated P(pick - best >=
-margin) against the truth.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from peftune.stats import decisions
from peftune.stats.decisions import Configuration, Plan, Values


@dataclass(frozen=True)
class World:
    """The noise of a set of configurations (module docstring), on the logit scale."""

    name: str
    ease_sd: float  # spread of the examples' ease (shared)
    effect_sd: float  # a configuration's own per-example effect: sets how often two configurations disagree
    seed_sd: float  # a seed's shift
    noise_sd: float  # per run and example
    ease_mean: float = -0.1  # accuracy about 0.48

    def outcome(self, shifts: Sequence[float], plan: Plan, examples: int, rng) -> decisions.Outcome:
        """One simulated confirmation on ``examples`` decision examples (:func:`simulate`)."""
        return simulate(self, shifts, plan, examples, rng).outcome

    def shift_for(self, gap: float) -> float:
        """The logit offset whose true score gap is ``gap`` (:func:`shift_for_gap`)."""
        return shift_for_gap(self, gap)

    def outcomes(self, rng, n: int, shifts: np.ndarray, seeds: int, ease=None) -> np.ndarray:
        """(K, S, n) right (1) or wrong (0) for K configurations (``shifts``: their logit offsets), S seeds."""
        k = len(shifts)
        ease = rng.normal(self.ease_mean, self.ease_sd, n) if ease is None else ease
        effect = rng.normal(0, self.effect_sd, (k, 1, n))
        shift = rng.normal(0, self.seed_sd, (k, seeds, 1))
        noise = rng.normal(0, self.noise_sd, (k, seeds, n))
        logit = ease[None, None, :] + shifts[:, None, None] + effect + shift + noise
        return (rng.random((k, seeds, n)) < 1 / (1 + np.exp(-logit))).astype(float)


# two configurations disagree on about 24% of the examples, a seed moves the score by about 0.017 (W1); 29% and
# 0.031 (W2): the two settings the review measured on this project's cpu jobs
W1 = World("W1", ease_sd=3.0, effect_sd=0.6, seed_sd=0.15, noise_sd=0.2)
W2 = World("W2", ease_sd=2.5, effect_sd=0.9, seed_sd=0.28, noise_sd=0.2)
WORLDS = {w.name: w for w in (W1, W2)}


def describe(world: World, rng=None, n: int = 200_000) -> dict[str, float]:
    """The world's accuracy, disagreement between two equal configurations and seed sd of a score."""
    rng = rng or np.random.default_rng(0)
    y = world.outcomes(rng, n, np.zeros(2), 2)
    seed_scores = world.outcomes(rng, 5000, np.zeros(1), 200)[0].mean(axis=1)  # (200,) on one example set
    return {"accuracy": float(y.mean()), "disagreement": float((y[0, 0] != y[1, 0]).mean()),
            "seed_sd": float(seed_scores.std(ddof=1))}  # fmt: skip


def true_gap(world: World, shift: float, rng=None, n: int = 400_000) -> float:
    """The true score of a configuration at logit offset ``shift`` minus one at 0 (expected accuracy)."""
    rng = rng or np.random.default_rng(1)
    ease = rng.normal(world.ease_mean, world.ease_sd, n)
    effect = rng.normal(0, world.effect_sd, n)
    seed = rng.normal(0, world.seed_sd, n)
    noise = rng.normal(0, world.noise_sd, n)
    base = ease + effect + seed + noise
    return float(np.mean(1 / (1 + np.exp(-(base + shift))) - 1 / (1 + np.exp(-base))))


def shift_for_gap(world: World, gap: float) -> float:
    """The logit offset whose true score gap is ``gap`` (bisection)."""
    low, high = (0.0, 3.0) if gap >= 0 else (-3.0, 0.0)
    for _ in range(40):
        mid = (low + high) / 2
        if true_gap(world, mid) < gap:
            low = mid
        else:
            high = mid
    return (low + high) / 2


@dataclass
class Draw:
    """One simulated confirmation: the replayed outcome and each configuration's dev score at the seeds used."""

    outcome: decisions.Outcome
    dev: dict[str, float]  # on dev, the seeds the replay used (the decision seeds)
    dev_fresh: dict[str, float]  # on dev, ``report_seeds`` further seeds the replay never saw (report runs)
    values: dict[str, Values] | None = None  # the decision data, every seed to max_seeds


def simulate(world: World, shifts: Sequence[float], plan: Plan, examples: int, rng, *, costs=None,
             dev_examples: int = 1000, report_seeds: int = 3) -> Draw:  # fmt: skip
    """One draw: K configurations (logit ``shifts``; ``costs``: trainable %, default 0.01 * (1 .. K)) with every
    seed to ``plan.max_seeds`` on ``examples`` decision examples and ``dev_examples`` dev ones, replayed."""
    k = len(shifts)
    costs = costs if costs is not None else [0.01 * (i + 1) for i in range(k)]
    shifts = np.asarray(shifts, dtype=float)
    n_all = examples + dev_examples
    ease = rng.normal(world.ease_mean, world.ease_sd, n_all)
    y = world.outcomes(rng, n_all, shifts, plan.max_seeds + report_seeds, ease=ease)  # (K, S, n): decision, dev
    names = [f"c{i}" for i in range(k)]
    seeds = tuple(range(1, plan.max_seeds + 1))
    values = {
        n: Values(seeds, {"task": decisions.example_values(y[i, : len(seeds), :examples], np.ones(examples), "binary")})
        for i, n in enumerate(names)
    }
    configurations = [Configuration(n, f"m{i}", costs[i]) for i, n in enumerate(names)]
    outcome = decisions.replay(values, configurations, plan)
    dev = {n: float(y[i, : outcome.seeds_used[n], examples:].mean()) for i, n in enumerate(names)}
    fresh = {n: float(y[i, len(seeds) :, examples:].mean()) if report_seeds else math.nan for i, n in enumerate(names)}
    return Draw(outcome, dev, fresh, values)


@dataclass(frozen=True)
class Measured:
    """A world measured on a sweep's own decision record: per task its decision examples, the spread of a
    configuration's own per-example effect and of a run's per-example noise (on the scale of the per-example
    values, ``decisions.example_values``), and the seed sd of a score. Values are normal: a configuration's
    per-example value is ``effect_c,i + shift_c + seed_c,s + noise_c,s,i``, so a shift is a score gap and the
    examples' shared ease (which the pairing takes off) is left out. What the report's own rates are
    simulated from."""

    name: str
    tasks: tuple[tuple[str, int, float, float], ...]  # (task, examples, effect sd, noise sd)
    seed_sd: float

    @classmethod
    def from_values(cls, values: Mapping[str, Values], name: str = "this sweep") -> Measured | None:
        """The components of ``values`` (every configuration's decision values, all its seeds), pooled over
        the configurations: the noise from the seeds x examples residual of those with 2 or more seeds, the
        effect from the per-example spread of every pair's difference of seed means less that noise, the seed
        sd from the seed scores less their example noise (``decisions`` measures them the same way). None where
        no configuration has 2 seeds: no noise or seed variance can be told apart."""
        names = [n for n in values if len(values[n].seeds)]
        tasks = sorted(next(iter(values.values())).values) if names else []
        repeated = [n for n in names if len(values[n].seeds) > 1]
        if len(names) < 2 or not repeated:
            return None
        parts = []
        for task in tasks:
            runs = [values[n].values[task] for n in repeated]  # (S, n_t) each
            dofs = [(v.shape[0] - 1) * (v.shape[1] - 1) for v in runs]
            noise = sum(decisions.residual_mean_square(v) * d for v, d in zip(runs, dofs, strict=True)) / sum(dofs)
            spread = []
            for a in range(len(names)):
                for b in range(a + 1, len(names)):
                    va, vb = values[names[a]].values[task], values[names[b]].values[task]
                    d = va.mean(axis=0) - vb.mean(axis=0)
                    spread.append((d.var(ddof=1) - noise * (1 / len(va) + 1 / len(vb))) / 2)
            n_t = values[names[0]].values[task].shape[1]
            parts.append((task, n_t, math.sqrt(max(float(np.mean(spread)), 0.0)), math.sqrt(noise)))
        _, ss, df = decisions.seed_sums(values, repeated, tasks)
        return cls(name, tuple(parts), math.sqrt(max(float(ss.sum()), 0.0) / float(df.sum())))

    def draw(self, shifts: Sequence[float], seeds: int, rng, seed_sds: Sequence[float] | None = None
             ) -> dict[str, Values]:  # fmt: skip
        """A decision record of K configurations ``c0 .. c{K-1}`` (score offsets ``shifts``), ``seeds`` each;
        ``seed_sds``: each configuration's own seed sd of a score (default: the world's, for all)."""
        k = len(shifts)
        sds = np.full(k, self.seed_sd) if seed_sds is None else np.asarray(seed_sds, dtype=float)
        offset = np.asarray(shifts, dtype=float)[:, None, None] + rng.normal(0, 1, (k, seeds, 1)) * sds[:, None, None]
        per_task = {}
        for task, n, effect_sd, noise_sd in self.tasks:
            effect = rng.normal(0, effect_sd, (k, 1, n))
            per_task[task] = offset + effect + rng.normal(0, noise_sd, (k, seeds, n))  # (K, S, n)
        numbered = tuple(range(1, seeds + 1))
        return {f"c{i}": Values(numbered, {t: v[i] for t, v in per_task.items()}) for i in range(k)}

    def outcome(self, shifts: Sequence[float], plan: Plan, examples: int, rng,
                seed_sds: Sequence[float] | None = None) -> decisions.Outcome:  # fmt: skip
        """One simulated confirmation (as :meth:`World.outcome`; ``examples`` unused: each task has its own
        measured size): every seed to ``plan.max_seeds`` drawn, replayed, costs 0.01 * (1 .. K)."""
        configurations = [Configuration(f"c{i}", f"m{i}", 0.01 * (i + 1)) for i in range(len(shifts))]
        values = self.draw(shifts, plan.max_seeds, rng, seed_sds)
        return decisions.replay(values, configurations, plan, summaries=False)  # the decisions alone

    def shift_for(self, gap: float) -> float:
        """The offset whose true score gap is ``gap``: the gap itself (values are normal, effects add)."""
        return gap

    def describe(self) -> str:
        tasks = ", ".join(f"{t} {n} examples (effect sd {e:.3f}, noise sd {z:.3f})" for t, n, e, z in self.tasks)
        return f"{tasks}; seed sd of a score {self.seed_sd:.4f}"


README_JOB = Measured("the README job", (("sst", 2000, 0.178, 0.265),), seed_sd=0.012)
CHEAP_SD = 0.03  # the cheapest configuration's seed sd where no record says one (a noisier method: the hard case)


def own_characteristics(values: Mapping[str, Values], plan: Plan, sizes: Sequence[int], sims: int,
                        seed: int = 0) -> tuple[Measured | None, list[Rate]]:  # fmt: skip
    """The procedure's rates at a sweep's own sizes, simulated from its own measured components
    (:class:`Measured`) and its configurations' own seed sds (the cheapest with the largest measured, the
    others the pooled one), through the real loop with its looks: :func:`scenario_rates` at each budget's
    family size K in ``sizes``."""
    world = Measured.from_values(values)
    if world is None:
        return None, []
    largest = max(world.seed_sd, max(seed_sds(values).values(), default=0.0))
    rates = []
    for k in sorted({k for k in sizes if k >= 2}):
        rates += scenario_rates(world, plan, k, sims, cheap_sd=largest, others_sd=world.seed_sd, seed=seed)
    return world, rates


def reachable_margin(world: Measured, k: int, plan: Plan, power: float = decisions.POWER) -> float:
    """The smallest margin at which a configuration truly equal to the best is shown not worse with ``power`` at
    ``plan.max_seeds`` seeds, from a world's measured components (a normal approximation of the last look's
    one-sided test; the "not worse" claim is an intersection-union test, so ``k`` does not enter; the
    simulated rates are the measure)."""
    from scipy import stats

    del k
    s = plan.max_seeds
    example = sum((2 * e * e + 2 * z * z / s) / n for _, n, e, z in world.tasks) / len(world.tasks) ** 2
    se = math.sqrt(example + 2 * world.seed_sd**2 / s)
    return float((stats.norm.ppf(1 - plan.alpha) + stats.norm.ppf(power)) * se)


def seed_sds(values: Mapping[str, Values]) -> dict[str, float]:
    """Each configuration's own seed sd of a score (its seed scores' spread less their example noise), where it
    has 2 or more seeds."""
    names = [n for n in values if len(values[n].seeds) > 1]
    if not names:
        return {}
    _, ss, df = decisions.seed_sums(values, names, sorted(next(iter(values.values())).values))
    return {n: math.sqrt(max(float(s) / float(d), 0.0)) for n, s, d in zip(names, ss, df, strict=True)}


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson's 95% interval of a binomial rate."""
    if n == 0:
        return math.nan, math.nan
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(centre - half, 0.0), min(centre + half, 1.0)


@dataclass(frozen=True)
class Rate:
    what: str
    hits: int
    n: int

    @property
    def rate(self) -> float:
        return self.hits / self.n if self.n else math.nan

    def __str__(self) -> str:
        low, high = wilson(self.hits, self.n)
        return f"{self.what}: {self.rate:.3f} [{low:.3f}, {high:.3f}] ({self.hits}/{self.n})"


def _said_better(a: decisions.Answer, truth: Mapping[str, float]) -> bool:
    """A false "better": the answer's, or a pair table row's, where the truth is not strictly above."""
    if a.decision == decisions.BETTER and any(truth[a.pick] <= truth[n] for n in a.members if n != a.pick):
        return True
    return any(r["decision"] == decisions.BETTER and truth[r["a"]] <= truth[r["b"]] for r in a.pairs)


def null_error(world: World, k: int, plan: Plan, examples: int, sims: int, seed: int = 0,
               pairs: bool = True) -> Rate:  # fmt: skip
    """K equally good configurations: the share of simulations with any "better" said, the answer's or (with
    ``pairs``) a pair table row's: every one is false, all being equal."""
    rng = np.random.default_rng([seed, k, examples])
    truth = {f"c{i}": 0.0 for i in range(k)}
    hits = 0
    for _ in range(sims):
        a = world.outcome([0.0] * k, plan, examples, rng).answers[0]
        hits += _said_better(a, truth) if pairs else a.decision == decisions.BETTER
    what = "any 'better' said, answer or pair table" if pairs else "the answer's 'better'"
    return Rate(f"{world.name} K={k} false {what} (global null)", hits, sims)


@dataclass
class Family:
    """A family's simulations: per configuration how often it was claimed "not worse" (or "better", as the
    pick), claimed "worse", and its mean seeds; how often a false "better" was said."""

    names: list[str]
    sims: int
    not_worse: np.ndarray
    worse: np.ndarray
    seeds: np.ndarray
    false_better: int

    def claimed(self, i: int, what: str) -> Rate:
        return Rate(what, int(self.not_worse[i]), self.sims)


def family(world: Measured, shifts: Sequence[float], sds: Sequence[float], plan: Plan, sims: int,
           seed: int = 0) -> Family:  # fmt: skip
    """``sims`` confirmations of one budget's family (configurations ``c0 ..`` in cost order, true score offsets
    ``shifts``, seed sds ``sds``) through the real loop with its looks, counted by claims (:class:`Family`)."""
    k = len(shifts)
    key = [seed, k, *(int(round(x * 1e5)) for x in shifts), *(int(round(x * 1e5)) for x in sds), 31]
    rng = np.random.default_rng([abs(v) for v in key] + [sum(x < 0 for x in shifts)])
    names = [f"c{i}" for i in range(k)]
    truth = dict(zip(names, shifts, strict=True))
    one = Plan(plan.seeds, plan.max_seeds, plan.margin, plan.alpha, (100.0,))
    nw, worse, seeds, better = np.zeros(k), np.zeros(k), np.zeros(k), 0
    for _ in range(sims):
        outcome = world.outcome(shifts, one, 0, rng, seed_sds=sds)
        a = outcome.answers[0]
        for i, n in enumerate(names):
            claim = a.claims.get(n)
            nw[i] += (claim is not None and claim.word == decisions.NOT_WORSE) or (
                a.pick == n and a.decision == decisions.BETTER)  # fmt: skip
            worse[i] += claim is not None and claim.word == decisions.WORSE
            seeds[i] += outcome.seeds_used[n]
        better += _said_better(a, truth)
    return Family(names, sims, nw, worse, seeds / sims, better)


SCENARIOS = ("boundary", "half", "two", "equal", "power")


def scenario_rates(world: Measured, plan: Plan, k: int, sims: int, *, cheap_sd: float, others_sd: float,
                   seed: int = 0, only: Sequence[str] = SCENARIOS) -> list[Rate]:  # fmt: skip
    """One budget of K configurations, the cheapest (seed sd ``cheap_sd``; the others ``others_sd``), through
    the real loop: truly exactly the margin below the others ("boundary": claimed not worse, or shown worse, is
    an error), half the margin ("half": a claim is right), twice ("two": an error; and how often it is shown
    worse), equal ("equal": claimed is power; any "better" is false); and "power": K - 2 cheapest twice the
    margin below, then one equal to the best: it claimed, and the K - 2 shown worse with their mean seeds.
    ``only``: which."""
    m = plan.margin
    where = f"{world.name} K={k}, seed sd {cheap_sd:.3f} (cheapest) / {others_sd:.3f}"
    rates = []
    for name in ("boundary", "half", "two", "equal"):
        if name not in only:
            continue
        shifts, sds = scenario_truth(name, k, m, cheap_sd, others_sd)
        gap = abs(shifts[0])  # how far below the others the cheapest truly is
        f = family(world, shifts, sds, plan, sims, seed)
        kind = "an error" if gap >= m else "right"
        rates.append(f.claimed(0, f"{where}: the cheapest {gap / m:g}δ below, claimed not worse ({kind})"))
        if name == "boundary":  # exactly the margin below: "worse by more than" it is an error too
            rates.append(Rate(f"{where}: the cheapest 1δ below, shown worse (an error)", int(f.worse[0]), sims))
        if name == "two":
            rates.append(Rate(f"{where}: the cheapest 2δ below, shown worse (mean seeds {f.seeds[0]:.1f})",
                              int(f.worse[0]), sims))  # fmt: skip
        if name == "equal":
            rates.append(Rate(f"{where}: all equal, any 'better' said (false)", f.false_better, sims))
    if "power" in only and k >= 3:
        f = family(world, *scenario_truth("power", k, m, cheap_sd, others_sd), plan, sims, seed)
        rates.append(f.claimed(k - 2, f"{world.name} K={k}, seed sd {others_sd:.3f}: one equal to the best after "
                                      f"{k - 2} cheaper 2δ below, claimed not worse (power)"))  # fmt: skip
        shown = int(f.worse[: k - 2].sum())
        rates.append(Rate(f"{world.name} K={k}, those {k - 2} cheaper: shown worse (mean seeds "
                          f"{f.seeds[: k - 2].mean():.1f} each)", shown, sims * (k - 2)))  # fmt: skip
    return rates


def scenario_truth(name: str, k: int, margin: float, cheap_sd: float, others_sd: float
                   ) -> tuple[list[float], list[float]]:  # fmt: skip
    """The true score offsets and seed sds of :func:`scenario_rates`' world ``name`` at K configurations (cost
    order): the cheapest the margin ("boundary"), half of it ("half"), twice ("two") or nothing ("equal") below
    the others; "power": K - 2 twice the margin below, then two equal, every seed sd ``others_sd``."""
    gaps = {"boundary": margin, "half": 0.5 * margin, "two": 2 * margin, "equal": 0.0}
    if name == "power":
        return [-2 * margin] * (k - 2) + [0.0, 0.0], [others_sd] * k
    return [-gaps[name]] + [0.0] * (k - 1), [cheap_sd] + [others_sd] * (k - 1)


@dataclass(frozen=True)
class Calibration:
    """Simulated answers' stated P(pick - best >= -margin) against the truth: per answer the stated probability
    and the pick's true score minus the best true score of the others (``gap``)."""

    what: str
    margin: float
    stated: np.ndarray  # (n,)
    gap: np.ndarray  # (n,)

    @property
    def within(self) -> np.ndarray:
        """Whether the pick truly lies within the margin of the best. A truth exactly on the margin (the
        boundary world's cheapest) counts as outside: the claims' convention, where "not worse" there is an
        error; it is the side on which a too sure probability shows."""
        return self.gap > -self.margin + 1e-12

    def above(self, p: float = 0.95) -> Rate:
        """Among the answers that state at least ``p``: how often the pick truly was within the margin."""
        chosen = self.stated >= p
        share = f" ({chosen.mean():.0%} of answers)" if len(chosen) else ""
        return Rate(f"{self.what}: stated P >= {p:g}{share}, truly within", int(self.within[chosen].sum()),
                    int(chosen.sum()))  # fmt: skip

    def bins(self, edges: Sequence[float] = (0.0, 0.5, 0.8, 0.95, 0.99, 1.0)) -> list[tuple[float, Rate]]:
        """Per bin of the stated probability (the last closed): its mean and how often the truth was within."""
        out = []
        for low, high in zip(edges[:-1], edges[1:], strict=True):
            chosen = (self.stated >= low) & ((self.stated < high) | (high >= edges[-1]))
            mean = float(self.stated[chosen].mean()) if chosen.any() else math.nan
            out.append((mean, Rate(f"{self.what}: stated P in [{low:g}, {high:g}] (mean {mean:.3f}), truly within",
                                   int(self.within[chosen].sum()), int(chosen.sum()))))  # fmt: skip
        return out

    def __add__(self, other: Calibration) -> Calibration:
        return Calibration(f"{self.what}; {other.what}", self.margin, np.concatenate([self.stated, other.stated]),
                           np.concatenate([self.gap, other.gap]))  # fmt: skip


def within_calibration(world: Measured, plan: Plan, k: int, sims: int, *, cheap_sd: float, others_sd: float,
                       seed: int = 0, only: Sequence[str] = SCENARIOS) -> Calibration:  # fmt: skip
    """Whether the answer's P(pick - best >= -margin) is calibrated: ``sims`` confirmations of each world of
    ``only`` (:func:`scenario_truth`, known truth) through the real loop with its looks and its summaries (the
    probability is one of them), each answer's stated probability kept with its pick's true gap to the best
    (:class:`Calibration`: compare ``bins`` or ``above``; the rate depends on the mix of worlds, as any
    calibration does on the truths it is checked on)."""
    one = Plan(plan.seeds, plan.max_seeds, plan.margin, plan.alpha, (100.0,))
    configurations = [Configuration(f"c{i}", f"m{i}", 0.01 * (i + 1)) for i in range(k)]
    stated, gap = [], []
    names = [n for n in SCENARIOS if n in only and (n != "power" or k >= 3)]
    for name in names:
        shifts, sds = scenario_truth(name, k, plan.margin, cheap_sd, others_sd)
        rng = np.random.default_rng([seed, k, SCENARIOS.index(name), int(cheap_sd * 1e5), int(others_sd * 1e5), 43])
        for _ in range(sims):
            a = decisions.replay(world.draw(shifts, one.max_seeds, rng, sds), configurations, one).answers[0]
            pick = int(a.pick[1:])
            stated.append(a.p_within)
            gap.append(shifts[pick] - max(s for i, s in enumerate(shifts) if i != pick))
    what = (f"{world.name} K={k}, seed sd {cheap_sd:.3f} (cheapest) / {others_sd:.3f}, {', '.join(names)}, "
            f"{sims} each")  # fmt: skip
    return Calibration(what, plan.margin, np.array(stated), np.array(gap))


def stated_at_the_margin(world: Measured, k: int, plan: Plan, sims: int, *, cheap_sd: float, others_sd: float,
                         rival_seeds: int | None = None, seed: int = 0) -> Rate:  # fmt: skip
    """The stated P(pick - best >= -margin) where the truth lies on the margin itself: the cheapest exactly
    ``plan.margin`` below K - 1 equal others, ``plan.seeds`` seeds for it and ``rival_seeds`` (default the
    same) for each other, one look, no selection, its probability as an answer would state it were it the pick
    (``decisions.chances``). Returns the share of draws that state 0.95 or more: a calibrated probability does
    so in about 5% (for one comparison the flat prior's P(theta >= -margin) is one minus the p-value of theta
    <= -margin, uniform at the margin; with K - 1 others their best is drawn above the truth, and less)."""
    names = [f"c{i}" for i in range(k)]
    shifts, sds = scenario_truth("boundary", k, plan.margin, cheap_sd, others_sd)
    rivals = plan.seeds if rival_seeds is None else rival_seeds
    rng = np.random.default_rng([seed, k, plan.seeds, rivals, int(cheap_sd * 1e5), int(others_sd * 1e5), 47])
    hits = 0
    for _ in range(sims):
        values = world.draw(shifts, max(plan.seeds, rivals), rng, sds)
        values = {n: v.first(plan.seeds if n == "c0" else rivals) for n, v in values.items()}
        hits += decisions.chances(decisions.fit(values, names), 0, plan.margin)[1] >= 0.95
    return Rate(f"{world.name} K={k}, {plan.seeds} seeds (the others {rivals}), the cheapest (seed sd "
                f"{cheap_sd:.3f}, the others {others_sd:.3f}) exactly the margin below: stated P(it - best >= "
                "-margin) >= 0.95", hits, sims)  # fmt: skip


def rerun_rate(world: Measured, plan: Plan, sims: int, *, gap: float = 0.0, seed_sd: float = CHEAP_SD,
               cap: int = 100, seed: int = 0) -> tuple[Rate, float]:  # fmt: skip
    """Whether "what would decide it" keeps its word: two configurations, the cheaper ``gap`` below (seed sds
    ``seed_sd``), through the real loop; where the answer leaves the cheaper one's question open and names N
    seeds that would decide it, the same truth is drawn afresh with ``max_seeds`` N (at most ``cap``) and
    replayed. Returns the share of those reruns that answer the question, and the mean N named."""
    rng = np.random.default_rng([seed, int(abs(gap) * 1e5), int(seed_sd * 1e5), 41])
    one = Plan(plan.seeds, plan.max_seeds, plan.margin, plan.alpha, (100.0,))
    configurations = [Configuration("c0", "m0", 0.01), Configuration("c1", "m1", 0.02)]
    decided = asked = named = 0
    for _ in range(sims):
        values = world.draw([-gap, 0.0], one.max_seeds, rng, [seed_sd, seed_sd])
        a = decisions.replay(values, configurations, one, summaries=False).answers[0]
        if "c0" in a.claims or not 0 < a.seeds_needed <= cap:
            continue
        asked, named = asked + 1, named + a.seeds_needed
        more = dataclasses.replace(one, max_seeds=max(a.seeds_needed, one.seeds))
        again = decisions.replay(world.draw([-gap, 0.0], more.max_seeds, rng, [seed_sd, seed_sd]), configurations,
                                 more, summaries=False).answers[0]  # fmt: skip
        decided += "c0" in again.claims
    what = (f"{world.name}: the cheaper of two {gap / plan.margin:g}δ below (seed sd {seed_sd:.3f}), open at "
            f"{plan.max_seeds} seeds: rerun with the seeds 'what would decide it' names, decided")  # fmt: skip
    return Rate(what, decided, asked), named / asked if asked else math.nan


def family_rates(world: Measured, k: int, plan: Plan, sims: int, *, gap: float, cheap_sd: float,
                 others_sd: float, seed: int = 0) -> tuple[Rate, Rate, float]:  # fmt: skip
    """A budget's family of K configurations through the real loop: the cheapest (``c0``, its seed sd
    ``cheap_sd``) truly ``gap`` below the others (all equal, seed sd ``others_sd``). Returns the share of
    simulations that claim c0 not worse, the share with a false "better" said, and the mean seeds c0 got."""
    f = family(world, [-gap] + [0.0] * (k - 1), [cheap_sd] + [others_sd] * (k - 1), plan, sims, seed)
    where = f"{world.name} K={k}, cheapest {gap:.3f} below (seed sd {cheap_sd:.3f} against {others_sd:.3f})"
    return f.claimed(0, f"{where}: claimed"), Rate(f"{where}: false 'better'", f.false_better, sims), f.seeds[0]


def coverage(world: World, seeds: int, examples: int, sims: int, seed: int = 0) -> Rate:
    """Two equal configurations at fixed ``seeds``: the share of nominal 95% intervals that cover 0."""
    rng = np.random.default_rng([seed, seeds, examples, 7])
    plan = Plan(seeds=seeds, max_seeds=seeds, margin=0.01, budgets=(100.0,))
    hits = 0
    for _ in range(sims):
        a = simulate(world, [0.0, 0.0], plan, examples, rng).outcome.answers[0]
        row = a.pairs[0]
        hits += row["ci_low"] <= 0 <= row["ci_high"]
    return Rate(f"{world.name} {seeds} seeds: 95% interval covers the truth", hits, sims)


def claim_rate(world: World, below: float, plan: Plan, examples: int, sims: int, seed: int = 0) -> Rate:
    """The cheaper of two configurations, ``below`` under the dearer one in truth (0: equal; 2 * margin: worse):
    the share of simulations that claim it not worse (a pick left at "cannot tell" is no claim)."""
    rng = np.random.default_rng([seed, int(abs(below) * 1e4), examples, 11])
    shift = world.shift_for(below)
    hits = 0
    for _ in range(sims):
        a = world.outcome([0.0, shift], plan, examples, rng).answers[0]
        claim = a.claims.get("c0")
        hits += (claim is not None and claim.word == decisions.NOT_WORSE) or (
            a.pick == "c0" and a.decision == decisions.BETTER)  # fmt: skip
    return Rate(f"{world.name} cheaper {below:.3f} below the best: claimed not worse", hits, sims)


def better_rate(world: World, gap: float, plan: Plan, examples: int, sims: int, seed: int = 0) -> Rate:
    """The dearer of two configurations ``gap`` above the cheaper in truth: the share called "better" within
    ``plan.max_seeds``, asked at margin 0 (a user who wants the best: at a margin above the gap, "the cheaper is
    not worse" is the right answer and no seed is spent on more)."""
    import dataclasses

    rng = np.random.default_rng([seed, int(abs(gap) * 1e4), gap < 0, examples, 13])
    shift = world.shift_for(gap)
    best_only = dataclasses.replace(plan, margin=0.0)
    hits = 0
    for _ in range(sims):
        a = world.outcome([0.0, shift], best_only, examples, rng).answers[0]
        hits += a.decision == decisions.BETTER and a.pick == "c1"
    return Rate(f"{world.name} a true gap of {gap:.3f}: called better", hits, sims)


def oracle_power(world: World, gap: float, seeds: int, examples: int, sims: int, alpha: float = 0.05,
                 seed: int = 0) -> Rate:  # fmt: skip
    """The power no level-``alpha`` test of "the dearer is better" can beat at these sizes: one look at
    ``seeds`` seeds each, one-sided, the difference's true standard deviation known (measured over the
    simulations themselves, a normal law: Neyman-Pearson's best test). What the data can tell at best."""
    from scipy import stats

    rng = np.random.default_rng([seed, int(abs(gap) * 1e4), seeds, examples, 23])
    shift = shift_for_gap(world, gap)
    diffs = []
    for _ in range(sims):
        y = world.outcomes(rng, examples, np.array([0.0, shift]), seeds)  # (2, S, n)
        diffs.append(float(y[1].mean() - y[0].mean()))
    diffs = np.array(diffs)
    sd = float(np.sqrt(np.mean((diffs - gap) ** 2)))  # around the truth: the test's known sd
    hits = int(np.sum(diffs / sd > stats.norm.ppf(1 - alpha)))
    return Rate(f"{world.name} a true gap of {gap:.3f}, {seeds} seeds: best possible level-{alpha} test", hits, sims)


def oracle_power_within(world: Measured, plan: Plan, seed_sd: float, sims: int, seed: int = 0) -> Rate:
    """The power no level-``plan.alpha`` test of "not worse by more than the margin" can beat for two equal
    configurations of ``world`` (seed sd ``seed_sd``): one look at ``max_seeds`` seeds each, one-sided, the
    difference's true standard deviation known (measured over the simulations themselves). What the data
    can tell at best at these sizes, without looks or estimated variances."""
    from scipy import stats

    rng = np.random.default_rng([seed, plan.max_seeds, int(seed_sd * 1e5), 37])
    diffs = []
    for _ in range(sims):
        values = world.draw([0.0, 0.0], plan.max_seeds, rng, [seed_sd, seed_sd])
        diffs.append(float(values["c0"].scores.mean() - values["c1"].scores.mean()))
    diffs = np.array(diffs)
    sd = float(np.sqrt(np.mean(diffs**2)))
    hits = int(np.sum(diffs - stats.norm.ppf(1 - plan.alpha) * sd >= -plan.margin))
    return Rate(f"{world.name}: the best possible level-{plan.alpha} test at {plan.max_seeds} seeds, two equal "
                f"(seed sd {seed_sd:.3f}): shown not worse", hits, sims)  # fmt: skip


def oracle_shown_worse(world: Measured, plan: Plan, seed_sd: float, sims: int, seed: int = 0) -> list[Rate]:
    """For a configuration twice the margin below the best (both seed sd ``seed_sd``), at each of its seed counts
    n from ``plan.seeds`` to ``max_seeds``: the share of draws that the best level-``plan.alpha`` test of "worse
    by more than the margin" on its first n seeds rejects, the best's seeds at ``max_seeds``, one-sided, the
    difference's true standard deviation known (measured over the simulations). A procedure that does not know
    the best's score can show it worse by its n-th seed no more often than this (that event is a
    level-``alpha`` test on those seeds), so its mean seeds, counted to ``max_seeds`` where it is not shown, are
    at least ``seeds`` plus the sum over n < ``max_seeds`` of one minus these. Against several equal best ones
    the bound is higher (their mean is a surer rival)."""
    from scipy import stats

    rng = np.random.default_rng([seed, plan.max_seeds, int(seed_sd * 1e5), 41])
    gap, counts = -2 * plan.margin, range(plan.seeds, plan.max_seeds + 1)
    diffs = {n: [] for n in counts}
    for _ in range(sims):
        values = world.draw([gap, 0.0], plan.max_seeds, rng, [seed_sd, seed_sd])
        best = float(values["c1"].scores.mean())
        for n in counts:
            diffs[n].append(float(values["c0"].first(n).scores.mean()) - best)
    rates = []
    for n in counts:
        d = np.array(diffs[n])
        sd = float(np.sqrt(np.mean((d - gap) ** 2)))
        hits = int(np.sum(d + stats.norm.ppf(1 - plan.alpha) * sd < -plan.margin))
        rates.append(Rate(f"{world.name}: 2δ below, shown worse by its seed {n} at best (seed sd {seed_sd:.3f})",
                          hits, sims))  # fmt: skip
    return rates


def pick_bias(world: World, k: int, plan: Plan, examples: int, sims: int, seed: int = 0) -> dict[str, tuple]:
    """K equal configurations: the mean (and standard error) of the first budget's pick's dev score minus its
    truth, from the decision seeds (``decision_seeds``) and from fresh report seeds (``fresh_seeds``)."""
    rng = np.random.default_rng([seed, k, examples, 17])
    truth = expected_accuracy(world)
    errors: dict[str, list[float]] = {"decision_seeds": [], "fresh_seeds": []}
    for _ in range(sims):
        draw = simulate(world, [0.0] * k, plan, examples, rng)
        pick = draw.outcome.answers[0].pick
        errors["decision_seeds"].append(draw.dev[pick] - truth)
        errors["fresh_seeds"].append(draw.dev_fresh[pick] - truth)
    return {key: (float(np.mean(e)), float(np.std(e, ddof=1) / math.sqrt(len(e)))) for key, e in errors.items()}


def expected_accuracy(world: World, n: int = 400_000) -> float:
    rng = np.random.default_rng(3)
    logit = (rng.normal(world.ease_mean, world.ease_sd, n) + rng.normal(0, world.effect_sd, n)
             + rng.normal(0, world.seed_sd, n) + rng.normal(0, world.noise_sd, n))  # fmt: skip
    return float(np.mean(1 / (1 + np.exp(-logit))))


def reference_world(tasks: Sequence[str], examples: int) -> Measured:
    """The README job's per-example components on ``examples`` decision rows for each of ``tasks``."""
    ((_, _, effect, noise),) = README_JOB.tasks
    return Measured(README_JOB.name, tuple((t, examples, effect, noise) for t in tasks), README_JOB.seed_sd)


def operating_characteristics(plan: Plan, world: Measured, sizes: Sequence[int], sims: int, *,
                              cheap_sd: float = CHEAP_SD, others_sd: float | None = None, seed: int = 0,
                              only: Sequence[str] = SCENARIOS) -> Iterator[str]:  # fmt: skip
    """Lines of the procedure's claim rates (:func:`scenario_rates`) at each budget's family size in ``sizes``,
    each with its Monte-Carlo 95% interval, one scenario at a time: what ``peftune decide --simulate`` prints."""
    others = world.seed_sd if others_sd is None else others_sd
    yield (f"plan: seeds {plan.seeds} to {plan.max_seeds}, margin δ = {plan.margin}, alpha {plan.alpha} per claim "
           f"over the looks; {world.name}: {world.describe()}; {sims} simulations each")  # fmt: skip
    for k in sorted({k for k in sizes if k >= 2}):
        for name in (n for n in SCENARIOS if n in only):
            for rate in scenario_rates(world, plan, k, sims, cheap_sd=cheap_sd, others_sd=others, seed=seed,
                                       only=(name,)):  # fmt: skip
                yield str(rate)
