"""The decision procedure's claim rates where it can fail, through the real loop with its looks.

The world is the README job's measured components (2,000 decision rows, a configuration's own per-example
effect sd 0.178, a run's per-example noise sd 0.265: about a third of two configurations' disagreement is
configuration x example, the rest run noise), a plan of 3 seeds up to 10 at a margin of 0.02, and families of
8 and 23 configurations. Every rate counts claims only ("not worse" or "better" said), each with its Wilson
95% Monte-Carlo interval.
"""

from __future__ import annotations

import pytest

from peftune.stats import simulate as sm
from peftune.stats.decisions import Plan

pytestmark = pytest.mark.slow

WORLD = sm.README_JOB
PLAN = Plan(seeds=3, max_seeds=10, margin=0.02, budgets=(100.0,))
SIMS = 400
CHEAP_SD, OTHERS_SD = 0.03, 0.012


def upper(rate: sm.Rate) -> float:
    return sm.wilson(rate.hits, rate.n)[1]


@pytest.mark.parametrize("k", [8, pytest.param(23, marks=pytest.mark.long)])
def test_a_cheaper_contender_exactly_the_margin_worse_is_rarely_claimed(k):
    """Its seeds vary more than the others' (sd 0.03 against 0.012): its own variance is used, moderated. Nor is
    it often shown worse by more than the margin, against K - 1 equal best ones: each comparison at alpha / (K - 1).
    That rate's target is alpha too; it is missed by about a point (docs/benchmarks.md: the looks' t boundaries and
    the moderation toward quieter configurations), so this bound guards the union's correction, which took it
    from 0.19 to about 0.06 at K = 8."""
    rate, worse = sm.scenario_rates(WORLD, PLAN, k, SIMS, cheap_sd=CHEAP_SD, others_sd=OTHERS_SD, only=("boundary",))
    print(rate, worse, sep="\n")
    assert rate.rate <= 0.05 and upper(rate) <= 0.065, str(rate)
    assert worse.rate <= 0.09, str(worse)


@pytest.mark.parametrize("k", [8, pytest.param(23, marks=pytest.mark.long)])
def test_among_equal_configurations_better_is_rarely_said(k):
    rates = sm.scenario_rates(WORLD, PLAN, k, SIMS, cheap_sd=OTHERS_SD, others_sd=OTHERS_SD, only=("equal",))
    better = next(r for r in rates if "'better'" in r.what)
    print(*rates, sep="\n")
    assert better.rate <= 0.05 and upper(better) <= 0.065, str(better)


def test_an_equal_cheaper_contender_is_claimed_and_the_clearly_worse_ones_are_shown_worse():
    """K = 8: six cheaper ones twice the margin below, then one equal to the best. Its power is held to what
    the best level-5% test at these sizes can reach (one look at 10 seeds each, the variance known:
    ``simulate.oracle_power_within``), less the looks' price. The six are shown worse, each claim paying for its
    K - 1 comparisons (``decisions.level``)."""
    claimed, shown = sm.scenario_rates(WORLD, PLAN, 8, SIMS, cheap_sd=OTHERS_SD, others_sd=OTHERS_SD,
                                       only=("power",))  # fmt: skip
    oracle = sm.oracle_power_within(WORLD, PLAN, OTHERS_SD, 4000)
    print(claimed, shown, oracle, sep="\n")
    assert claimed.rate >= oracle.rate - 0.08, f"{claimed}; {oracle}"
    assert shown.rate >= 0.4, str(shown)


def test_the_stated_chance_of_being_within_the_margin_is_not_above_what_holds():
    """K = 2 through the real loop, the cheapest the margin, half of it, twice it or nothing below (seed sd 0.03
    against 0.012): in every band of the stated P(pick - best >= -δ) with 50 answers or more, the share whose
    pick truly lies within δ of the best (exactly δ counts as outside) reaches the band's floor within its
    Wilson 95% interval (``simulate.within_calibration``)."""
    calibration = sm.within_calibration(WORLD, PLAN, 2, 300, cheap_sd=CHEAP_SD, others_sd=OTHERS_SD,
                                        only=("boundary", "half", "two", "equal"))  # fmt: skip
    edges = (0.0, 0.5, 0.8, 0.95, 0.99, 1.0)
    bands = calibration.bins(edges)
    print(calibration.above(0.95), *(rate for _, rate in bands), sep="\n")
    for floor, (_, rate) in zip(edges[:-1], bands, strict=True):
        if rate.n >= 50:
            assert upper(rate) >= floor, str(rate)
