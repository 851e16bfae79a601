"""The decision procedure's error rates and power where it can fail, through the real loop with its looks.

The world is the SST cpu job's measured components (2,000 decision rows, a configuration's own per-example
effect sd 0.113, a run's per-example noise sd 0.292), its plan (3 seeds, up to 6, a margin of 0.02), and
families of 8, 15 and 23 configurations, with unequal seed variances: the cheapest configuration's seed sd
0.03 against 0.012 for the others. Each rate from 400 simulations, with its Wilson 95% Monte-Carlo interval.
"""

from __future__ import annotations

import pytest

from peftune import simulate as sm
from peftune.decisions import Plan

pytestmark = pytest.mark.slow

WORLD = sm.Measured("SST job", (("sst", 2000, 0.113, 0.292),), seed_sd=0.016)
CPU = Plan(seeds=3, max_seeds=6, margin=0.02, budgets=(100.0,))  # the cpu presets' plan
SIMS = 400
CHEAP_SD, OTHERS_SD = 0.03, 0.012


def upper(rate: sm.Rate) -> float:
    return sm.wilson(rate.hits, rate.n)[1]


@pytest.mark.parametrize("k", [8, pytest.param(15, marks=pytest.mark.long), pytest.param(23, marks=pytest.mark.long)])
def test_a_cheaper_contender_exactly_the_margin_worse_is_rarely_picked(k):
    picked, _, seeds = sm.family_rates(WORLD, k, CPU, SIMS, gap=CPU.margin, cheap_sd=CHEAP_SD, others_sd=OTHERS_SD)
    assert picked.rate <= 0.05 and upper(picked) <= 0.065, str(picked)


@pytest.mark.parametrize("k", [8, pytest.param(15, marks=pytest.mark.long), pytest.param(23, marks=pytest.mark.long)])
@pytest.mark.parametrize("cheap_sd", [OTHERS_SD, CHEAP_SD], ids=["equal", "unequal"])
def test_among_equal_configurations_better_is_rarely_claimed(k, cheap_sd):
    _, better, _ = sm.family_rates(WORLD, k, CPU, SIMS, gap=0.0, cheap_sd=cheap_sd, others_sd=OTHERS_SD)
    assert better.rate <= 0.05 and upper(better) <= 0.065, str(better)


def test_where_the_margin_is_reachable_an_equal_cheaper_one_is_picked_and_the_looks_add_seeds():
    """A margin the plan can reach within max_seeds (0.05 here; 0.02 is not, at 2,000 rows and 6 seeds)."""
    plan = Plan(seeds=3, max_seeds=6, margin=0.05, budgets=(100.0,))
    picked, _, _ = sm.family_rates(WORLD, 8, plan, SIMS, gap=0.0, cheap_sd=OTHERS_SD, others_sd=OTHERS_SD)
    assert picked.rate >= 0.8, str(picked)
    _, _, seeds = sm.family_rates(WORLD, 8, plan, SIMS, gap=plan.margin, cheap_sd=CHEAP_SD, others_sd=OTHERS_SD)
    assert seeds > plan.seeds  # at the boundary the question stays open: the looks add seeds to it
