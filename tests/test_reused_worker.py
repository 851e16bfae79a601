"""A trial whose predecessor on a reused Tune worker takes a while to unwind still runs.

Found in CI: on a loaded 2-core machine a stopped trial's thread took longer than Tune's default 2 s to end
(its checkpoint directory removed, its memory given back), and Tune failed the *next* trial on that worker
("Could not re-use actor"), which ended the smoke sweep interrupted (exit 3). The sweep's own Ray
(``orchestrator.init_ray``) is under test: its runtime environment gives the workers a longer wait.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from peftune.sweep import orchestrator

UNWIND_S = 4  # longer than Tune's default wait (2 s), far shorter than the sweep's


@pytest.fixture
def sweep_ray(monkeypatch):
    import ray

    monkeypatch.delenv(orchestrator.THREAD_TIMEOUT_VAR, raising=False)  # the sweep's setting, not this shell's
    orchestrator.init_ray()
    yield ray
    ray.shutdown()


def test_a_trial_after_a_slowly_unwinding_one_runs_on_the_same_worker(sweep_ray, tmp_path):
    from ray import tune

    def slow_to_unwind(config):
        try:
            for step in range(3):
                tune.report({"score": config["x"] * step, "pid": os.getpid()})
        finally:
            time.sleep(UNWIND_S)

    every_cpu = sweep_ray.cluster_resources()["CPU"]  # one trial at a time: the second must reuse the first's worker
    results = tune.Tuner(
        tune.with_resources(slow_to_unwind, {"cpu": every_cpu}),
        param_space={"x": tune.grid_search([1, 2, 3])},
        tune_config=tune.TuneConfig(reuse_actors=True),
        run_config=tune.RunConfig(stop={"training_iteration": 1}, storage_path=str(tmp_path), verbose=0),
    ).fit()
    assert not results.errors, results.errors
    assert len({result.metrics["pid"] for result in results}) == 1  # the worker was reused
    assert sorted(result.metrics["score"] for result in results) == [0, 0, 0]  # each stopped after its first report


def test_a_job_that_sets_the_wait_itself_keeps_it(monkeypatch):
    import json

    job = {"runtime_env": {"env_vars": {orchestrator.THREAD_TIMEOUT_VAR: "30"}, "py_modules": ["elsewhere"]}}
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(job))
    assert orchestrator.trial_runtime_env() == {}  # Ray refuses to merge a key both set: the job's stands
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")
    shipped = orchestrator.trial_runtime_env()
    assert (
        shipped["env_vars"][orchestrator.THREAD_TIMEOUT_VAR] == str(orchestrator.THREAD_TIMEOUT_S)
        and shipped["py_modules"]
    )
    package = Path(shipped["py_modules"][0])  # the whole package, not the folder of the module that ships it
    assert package.name == "peftune" and (package / "sweep" / "orchestrator.py").is_file()
