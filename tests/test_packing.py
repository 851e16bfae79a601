"""Packed trials in a real sweep (peftune.sweep.packing): Ray Tune, Optuna, ASHA and MLflow as every sweep runs them.

The same sweep runs twice on a local Ray of 2 CPUs and one declared GPU (this machine has no CUDA: the trials
train on the CPU, but Ray grants GPU shares as on a GPU cluster, and a pack's members must be on one GPU), its
search trials of bitfit and adapter packed 3 to a pack (``resources.pack_size: 3``), then alone. Each method's
three trials are its default and two random draws, the same whatever the order, so both sweeps train the same
configurations: each packed trial's record holds exactly the scores its solo twin's holds, at every rung and epoch
both reached, and one MLflow run per configuration.
"""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest
import ray
from ray.tune.schedulers import TrialScheduler

from conftest import start_local_ray
from peftune.base import record_names
from peftune.sweep import orchestrator, packing, search, spaces
from tiny_sweep import FROZEN_AND_TOP_K, write_definition

BITFIT = """\
    method: bitfit
    lr: {low: 1.0e-4, high: 1.0e-2, log: true}
    dropout: {low: 0.05, high: 0.3}
    weight_decay: {low: 0.0, high: 0.1}
    default: {lr: 1.0e-3, dropout: 0.3, weight_decay: 0.0, source: "a test"}
"""
ADAPTER = """\
    method: adapter
    lr: {low: 1.0e-4, high: 1.0e-2, log: true}
    dropout: {low: 0.05, high: 0.3}
    weight_decay: 0.0
    options:
      bottleneck: {choices: [4, 8]}
    default: {lr: 1.0e-3, dropout: 0.1, weight_decay: 0.0, bottleneck: 8, source: "a test"}
"""
SWEEP = """\
    name: {name}
    tasks: [sst]
    methods: [bitfit, adapter, frozen]
    seed: 3
    search: {{objective: single, sampler: tpe, n_startup_trials: 3, allocation: per_method}}
    scheduler: {{type: asha, grace_period: 1, reduction_factor: 3, fidelity: data, rungs: 2}}
    resources: {{cpus_per_trial: 1, gpus_per_trial: 0.5, pack_size: {pack_size}, pack_wait_s: 20}}
    max_failures: 0
    checkpoints_per_method: 1
    confirm: {{seeds: 0}}
    budget: tiny
    budgets:
      tiny: {{trials_per_method: 3, epochs: 1, batch_size: 8, max_length: 32, max_train_examples: 64,
              max_dev_examples: 32}}
"""


def definition(directory: Path, name: str, pack_size: int) -> spaces.SweepDefinition:
    methods = {"bitfit": BITFIT, "adapter": ADAPTER, "frozen": FROZEN_AND_TOP_K["frozen"]}
    return write_definition(directory / name, name, methods, SWEEP, pack_size=pack_size)


@pytest.fixture(scope="module")
def local_ray():
    start_local_ray(num_gpus=1)
    yield
    ray.shutdown()


def histories(uri: str, name: str) -> dict[str, dict]:
    """config_key -> its one run's {"method", "scores" (each score logged, at its rungs and epochs), "pack_size"}."""
    client = mlflow.MlflowClient(uri)
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=[name])
    children = runs[runs["tags.peftune.role"] == "trial"]
    keys = list(children["tags.peftune.config_key"])
    assert len(keys) == len(set(keys)) == 9, "one run per configuration"
    out = {}
    for _, run in children.iterrows():
        scores = sorted(  # at its rungs within the epoch (at step = examples seen), then at its epoch's end
            (key, m.step, m.value)
            for key in ("fidelity_score", "score")
            for m in client.get_metric_history(run["run_id"], key)
        )
        pack_size = run.get("tags.peftune.pack_size")
        out[run["tags.peftune.config_key"]] = {
            "method": run["tags.peftune.method"],
            "scores": scores,
            "pack_size": int(pack_size) if isinstance(pack_size, str) else None,  # NaN: never packed
            "status": run["tags.peftune.status"],
            "granted_gpu": run["metrics.granted_gpu"],
        }
    return out


def stop_each_methods_second_trial_at_its_first_rung(monkeypatch) -> None:
    """ASHA, and then a stop at the first rung of each method's Optuna trial 1 (in both sweeps): a packed member
    stopped mid-pack by the scheduler, whatever the tiny data's scores."""
    decide = search.PerMethodScheduler.on_trial_result

    def on_trial_result(self, tune_controller, trial, result):
        decision = decide(self, tune_controller, trial, result)
        if trial.config["peftune"].get("optuna_trial") == 1 and result.get(record_names.PARTIAL):
            return TrialScheduler.STOP
        return decision

    monkeypatch.setattr(search.PerMethodScheduler, "on_trial_result", on_trial_result)


@pytest.mark.long
@pytest.mark.slow
def test_packed_search_trials_record_their_solo_twins_scores(local_ray, tmp_path, tiny_data_dir, monkeypatch):
    stop_each_methods_second_trial_at_its_first_rung(monkeypatch)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    packed = definition(tmp_path, "packed", pack_size=3)
    assert search.pack_sizes(packed) == {"bitfit": 3, "adapter": 3}
    result = orchestrator.run_sweep(packed, tiny_data_dir, uri, storage_path=tmp_path / "ray_results")
    assert result.status == "completed", result.statuses
    solo = definition(tmp_path, "solo", pack_size=1)
    orchestrator.run_sweep(solo, tiny_data_dir, uri, storage_path=tmp_path / "ray_results")

    ours, theirs = histories(uri, "packed"), histories(uri, "solo")
    assert ours.keys() == theirs.keys()  # the same nine configurations
    packed_sizes = [h["pack_size"] for h in ours.values() if h["method"] in ("bitfit", "adapter")]
    assert sum(bool(size and size > 1) for size in packed_sizes) >= 4, (
        f"too few trials trained in a pack: {packed_sizes}"
    )
    assert all(h["pack_size"] is None for h in ours.values() if h["method"] == "frozen")
    assert all(h["pack_size"] is None for h in theirs.values())
    granted = [(h["method"], h["granted_gpu"]) for h in ours.values() if h["granted_gpu"] == h["granted_gpu"]]
    assert granted  # (logged at an epoch's end: not by a trial stopped at its first rung)
    for method, gpu in granted:  # a member holds its share of the slot's GPU, the pack's runner trains on it
        assert gpu == pytest.approx(0.5 / 3 if method in ("bitfit", "adapter") else 0.5, abs=1e-4), method
    stopped = [h for h in ours.values() if h["pack_size"] and h["status"] == "early_stopped"]
    assert len(stopped) >= 2 and all(len(h["scores"]) == 1 for h in stopped)  # at its first rung
    for key, history in ours.items():
        both = min(len(history["scores"]), len(theirs[key]["scores"]))
        assert both >= 1
        assert history["scores"][:both] == theirs[key]["scores"][:both], key  # to the bit, at every rung and epoch
        if history["status"] == theirs[key]["status"] == "completed":
            assert len(history["scores"]) == len(theirs[key]["scores"])  # a pack-mate stopped changed nothing


def test_only_search_trials_of_packable_methods_ask_for_a_share_of_a_slot():
    settings = packing.PackSettings(size=4, wait_s=1.0, hub="h")
    per_trial = packing.TrialResources(cpu=1.0, gpu=0.5, packing=settings)
    bundle = per_trial({"method": "lora", "peftune": {"phase": "search"}}).bundles[0]
    assert bundle == {"CPU": 0.25, "GPU": 0.125}
    assert per_trial({"method": "full", "peftune": {"phase": "search"}}).bundles[0] == {"CPU": 1.0, "GPU": 0.5}
    pissa = {"method": "lora", "lora": {"init": "pissa"}, "peftune": {"phase": "search"}}  # rewrites shared weights
    assert per_trial(pissa).bundles[0] == {"CPU": 1.0, "GPU": 0.5}
    assert per_trial({"method": "lora", "peftune": {"phase": "confirm"}}).bundles[0] == {"CPU": 1.0, "GPU": 0.5}
    alone = packing.TrialResources(cpu=1.0)
    assert alone({"method": "lora", "peftune": {"phase": "search"}}).bundles[0] == {"CPU": 1.0}


@pytest.mark.slow
def test_a_pack_whose_runner_cannot_get_its_cpus_starts_without_them(local_ray, tiny_prepared):
    """Every CPU held (here by one actor; in the SST job by members waiting for their runners): a cohort closed
    short of K cannot get its runner's top-up. It must start without it after ``pack_wait_s``, not wait forever
    (before, the SST job's search stood still: 5 runners pending, 6 members holding both CPUs)."""
    import time

    from peftune.core import pack, train
    from peftune.sweep import shared_data

    @ray.remote(num_cpus=2)
    class Holder:
        def ready(self) -> bool:
            return True

    holder = Holder.remote()
    ray.get(holder.ready.remote())
    try:
        settings = packing.start_hub(shared_data.SharedData(ray.put(tiny_prepared)), 1, 3, 1.0, 1.0)
        hub = ray.get_actor(settings.hub)
        config = train.TrainConfig(method="bitfit", tasks=["sst"], epochs=1, batch_size=8, device="cpu", log_every=0)
        place = (ray.get_runtime_context().get_node_id(), ())
        started = time.monotonic()
        runner, _, index, size = ray.get(hub.join.remote(pack.pack_key(config), config, place), timeout=120)
        assert (index, size) == (0, 1)  # closed short of 3 at its deadline
        assert ray.get(runner.ready.remote(), timeout=120)  # and its runner runs, on the member's share alone
        assert time.monotonic() - started < 120
    finally:
        packing.stop_hubs()
        ray.kill(holder)
