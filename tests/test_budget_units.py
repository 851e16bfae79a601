"""The per-method budget counted in optimizer steps or training tokens (``search.unit``), not only in trials.

Real Optuna studies in a SQLite storage fed trial results as Tune would, the sweep definition's validation, the
token count of a prompt's vectors in a real training run, and one real tiny sweep (Ray Tune + MLflow).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import mlflow
import pytest
import ray
from ray.tune.search import Searcher

from conftest import start_local_ray
from peftune.base.errors import UserError
from peftune.core.train import TrainConfig, run_trial
from peftune.sweep import orchestrator, search, spaces
from tiny_sweep import FROZEN_AND_TOP_K, write_definition

SPACES_DIR = spaces.SEARCH_SPACES_DIR / "methods"
METHODS = ["frozen", "lora"]


def searcher_in(tmp_path: Path, unit: str, budget: dict[str, int], full_cost: float, min_fraction: float):
    allocation = search.Allocation(unit, budget, full_cost, min_fraction)
    return search.PerMethodSearcher(
        {m: spaces.load_method_space(SPACES_DIR / f"{m}.yaml") for m in budget},
        sweep="units",
        storage_url=f"sqlite:///{tmp_path / 'optuna.db'}",
        n_startup_trials=2,
        allocation=allocation,
    )


def run_search(searcher, cost_per_run: dict[str, float], stopped_at: dict[str, float], unit_key: str) -> Counter:
    """Drive ``searcher`` as Tune would, one trial at a time per method (synchronous): each trial of a method
    trains ``stopped_at[m]`` of a run costing ``cost_per_run[m]``. Returns the trials each method got."""
    started: Counter = Counter()
    for i in range(1000):
        config = searcher.suggest(f"t{i}")
        if config == Searcher.FINISHED:
            return started
        assert config is not None, "a synchronous searcher with no trial running must hand one out or finish"
        method = config["method"]
        started[method] += 1
        fraction = stopped_at[method]
        result = {"score": 0.3, unit_key: cost_per_run[method] * fraction, "progress": fraction}
        searcher.on_trial_complete(f"t{i}", result)
    raise AssertionError("the search never finished")


def test_in_steps_a_method_whose_trials_stop_early_gets_more_trials_for_the_same_steps(tmp_path):
    budget = {"frozen": 2, "lora": 2}
    searcher = searcher_in(tmp_path, "steps", budget, full_cost=100, min_fraction=0.25)
    trials = run_search(searcher, {"frozen": 100, "lora": 100}, {"frozen": 1.0, "lora": 0.25}, "steps")
    assert trials == {"frozen": 2, "lora": 8}  # 200 steps each: 2 full runs, or 8 stopped at the first rung
    assert {m: searcher.allocation.spent(m) for m in budget} == {"frozen": 200, "lora": 200}
    assert searcher.suggest("after") == Searcher.FINISHED


@pytest.mark.parametrize("prompt_cost", [1.3, 2.5, 4.0])
def test_in_tokens_a_costlier_method_buys_fewer_trials_and_every_share_is_met_within_half_a_trial(
    tmp_path, prompt_cost
):
    budget = {"frozen": 4, "lora": 4}
    searcher = searcher_in(tmp_path, "tokens", budget, full_cost=1000, min_fraction=1.0)
    costs = {"frozen": 1000, "lora": 1000 * prompt_cost}
    trials = run_search(searcher, costs, {"frozen": 1.0, "lora": 1.0}, "tokens_seen")
    assert trials["frozen"] == 4 and trials["lora"] < 4
    for method in budget:
        spent = searcher.allocation.spent(method)
        assert abs(spent - budget[method] * 1000) <= costs[method] / 2, (method, spent)


def test_the_spend_survives_a_save_and_restore(tmp_path):
    budget = {"frozen": 2, "lora": 2}
    searcher = searcher_in(tmp_path, "steps", budget, full_cost=100, min_fraction=0.25)
    first = searcher.suggest("a")
    searcher.on_trial_complete("a", {"score": 0.3, "steps": 25, "progress": 0.25})
    searcher.save(str(tmp_path / "state.json"))
    again = searcher_in(tmp_path, "steps", budget, full_cost=100, min_fraction=0.25)
    again.restore(str(tmp_path / "state.json"))
    assert again.allocation.costs == {first["method"]: [25]}
    assert again.handed == searcher.handed


def test_in_trials_the_budget_is_today_s_equal_count():
    allocation = search.Allocation("trials", {"frozen": 3, "lora": 2})
    assert allocation.trials_bound() == 5
    assert allocation.may_start("frozen", 2, 1) and not allocation.may_start("lora", 2, 0)
    assert search.search_finished(allocation, [("frozen", {})] * 3 + [("lora", {})] * 2)
    assert not search.search_finished(allocation, [("frozen", {})] * 3 + [("lora", {})])


def test_the_completion_check_agrees_with_the_searcher(tmp_path):
    budget = {"frozen": 2, "lora": 2}
    allocation = search.Allocation("steps", budget, 100, 0.25)
    ended = [("frozen", {"steps": 100, "progress": 1.0})] * 2 + [("lora", {"steps": 25, "progress": 0.25})] * 7
    assert not search.search_finished(allocation, ended)  # lora has 25 steps left: one more trial
    assert search.search_finished(allocation, ended + [("lora", {"steps": 25, "progress": 0.25})])
    assert allocation.costs == {}  # the check counts on a copy: the searcher's own spend is untouched


def test_a_trial_that_fails_before_reporting_spends_nothing_but_the_trials_stay_bounded(tmp_path):
    searcher = searcher_in(tmp_path, "steps", {"frozen": 1, "lora": 1}, full_cost=100, min_fraction=0.5)
    handed = Counter()
    for i in range(50):
        config = searcher.suggest(f"t{i}")
        if config == Searcher.FINISHED:
            break
        handed[config["method"]] += 1
        searcher.on_trial_complete(f"t{i}", None, error=True)
    assert handed == {"frozen": 2, "lora": 2}  # the cap: 1 trial's share at the first rung (1/2) is 2 trials


SWEEP = """\
name: units
tasks: [sst]
methods: [frozen, top_k]
search: {{allocation: {allocation}, unit: {unit}}}
budget: tiny
budgets:
  tiny: {{trials_per_method: 2, epochs: 1}}
"""


@pytest.mark.parametrize(("allocation", "unit"), [("joint", "steps"), ("joint", "tokens")])
def test_a_budget_in_steps_or_tokens_needs_the_per_method_search(tmp_path, allocation, unit):
    path = tmp_path / "sweep.yaml"
    path.write_text(SWEEP.format(allocation=allocation, unit=unit))
    with pytest.raises(UserError, match=r"search\.unit.*per_method"):
        spaces.load_sweep(path)


def test_an_unknown_unit_is_refused_naming_the_key(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text(SWEEP.format(allocation="per_method", unit="seconds"))
    with pytest.raises(UserError, match=r"search\.unit"):
        spaces.load_sweep(path)


def test_a_prompt_s_vectors_count_as_training_tokens(tiny_prepared):
    """The same rows trained with and without a prompt of P vectors: P more tokens per example seen."""
    seen = {}
    for method, options in (("frozen", {}), ("prompt", {"prompt_length": 8})):
        config = TrainConfig(method=method, method_options=options, tasks=["sst"], epochs=1, batch_size=16, log_every=0)
        seen[method] = run_trial(config, tiny_prepared).history[-1]
    assert seen["prompt"]["examples_seen"] == seen["frozen"]["examples_seen"] > 0
    extra = seen["prompt"]["tokens_seen"] - seen["frozen"]["tokens_seen"]
    assert extra == 8 * seen["frozen"]["examples_seen"]


# ----------------------------------------------------------------------------- a real sweep

PROMPT = """\
method: prompt
lr: {low: 1.0e-3, high: 3.0e-1, log: true}
dropout: 0.1
weight_decay: 0.0
options:
  prompt_length: {choices: [24, 32]}
default: {lr: 3.0e-2, prompt_length: 32, source: "test"}
"""
REAL_SWEEP = """\
name: {name}
tasks: [sst]
methods: [frozen, prompt]
search: {{n_startup_trials: 2, unit: tokens}}
scheduler: {{type: none}}
resources: {{cpus_per_trial: 1, max_concurrent_trials: 2}}
max_failures: 0
checkpoints_per_method: 0
confirm: {{seeds: 0}}
budget: tiny
budgets:
  tiny: {{trials_per_method: 3, epochs: 1, batch_size: 16, max_length: 32, max_train_examples: 32,
          max_dev_examples: 16}}
"""


@pytest.mark.slow
def test_a_real_sweep_in_tokens_gives_a_long_prompt_fewer_trials_for_the_same_tokens(tmp_path, tiny_data_dir):
    method_spaces = {"frozen": FROZEN_AND_TOP_K["frozen"], "prompt": PROMPT}
    definition = write_definition(tmp_path, "tokens", method_spaces, REAL_SWEEP)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    start_local_ray()
    try:
        result = orchestrator.run_sweep(
            definition, tiny_data_dir, uri, storage_path=tmp_path / "ray", reports_dir=tmp_path
        )
    finally:
        ray.shutdown()
    assert result.status == "completed"
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["tokens"])
    parent = runs[runs["tags.peftune.role"] == "sweep"].iloc[0]
    assert parent["params.budget_unit"] == "tokens"
    trials = Counter(runs[runs["tags.peftune.role"] == "trial"]["tags.peftune.method"])
    assert trials["frozen"] == 3 and 1 <= trials["prompt"] < 3  # the prompt's vectors double a row's tokens
    full_run = parent["metrics.budget_tokens.frozen"] / 3  # frozen ran its 3 trials in full
    prompt_run = parent["metrics.budget_tokens.prompt"] / trials["prompt"]
    assert prompt_run > 1.5 * full_run
    assert abs(parent["metrics.budget_tokens.prompt"] - 3 * full_run) <= prompt_run / 2
