"""The GPU scheduling path on a machine without a GPU: Ray told the node has one (``num_gpus``), as a CPU
machine can declare GPUs with ``ray start --num-gpus``.

What a cluster run relies on, tested as far as a CPU machine allows: every trial asks for the sweep's GPU
fraction, Ray packs four trials of 0.25 onto the one GPU and grants each what the sweep asked for, and a trial
given a GPU where CUDA is missing says so in one line and trains on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest
import ray

from conftest import start_local_ray
from peftune.sweep import orchestrator
from tiny_sweep import FROZEN_AND_TOP_K, write_definition

pytestmark = pytest.mark.slow

SWEEP = """\
name: {name}
tasks: [sst]
methods: [frozen]
search: {{n_startup_trials: 4}}
scheduler: {{type: none}}
resources: {{cpus_per_trial: 0.5, gpus_per_trial: 0.25}}
max_failures: 0
checkpoints_per_method: 0
confirm: {{seeds: 0}}
budget: tiny
budgets:
  tiny: {{trials_per_method: 4, epochs: 1, batch_size: 16, max_length: 32, max_train_examples: 32,
          max_dev_examples: 16}}
"""


def test_four_quarter_gpu_trials_share_one_declared_gpu_and_say_they_train_on_the_cpu(tmp_path, tiny_data_dir):
    frozen = {"frozen": FROZEN_AND_TOP_K["frozen"]}
    definition = write_definition(tmp_path, "gpus", frozen, SWEEP)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    context = start_local_ray(num_gpus=1)
    try:
        assert orchestrator.trial_resources(definition.resources) == {"cpu": 0.5, "gpu": 0.25}
        result = orchestrator.run_sweep(
            definition, tiny_data_dir, uri, storage_path=tmp_path / "ray", reports_dir=tmp_path
        )
        session = Path(context.address_info["session_dir"])
    finally:
        ray.shutdown()
    assert result.status == "completed"

    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["gpus"])
    trials = runs[runs["tags.peftune.role"] == "trial"]
    assert len(trials) == 4
    assert (trials["metrics.granted_gpu"] == 0.25).all() and (trials["metrics.granted_cpu"] == 0.5).all()
    logs = "".join(path.read_text(errors="replace") for path in (session / "logs").glob("worker-*.err"))
    said = [line for line in logs.splitlines() if "CUDA is not available" in line]
    assert len(said) == 4 and all("trains on the CPU" in line for line in said)
