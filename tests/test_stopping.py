"""A Ctrl-C that Tune's fit takes is the user's stop, whenever it comes (``stopping.ctrl_c_through_tune``)."""

from __future__ import annotations

import os
import signal

import pytest
import ray
from ray import tune

from conftest import start_local_ray
from peftune.sweep.stopping import ctrl_c_through_tune


@pytest.fixture(scope="module")
def local_ray():
    start_local_ray(num_cpus=1)
    yield
    ray.shutdown()


def fit(tmp_path, ctrl_c_to: int) -> None:
    def trainable(config):  # defined here, so that Ray sends it by value (the workers cannot import this file)
        tune.report({"score": 1.0})
        if config["ctrl_c_to"]:  # the trial's work is done: the Ctrl-C comes as Tune is about to end the run
            os.kill(config["ctrl_c_to"], signal.SIGINT)

    grid = tune.Tuner(
        trainable,
        param_space={"ctrl_c_to": ctrl_c_to},
        run_config=tune.RunConfig(storage_path=str(tmp_path), verbose=0),
    ).fit()
    assert not grid.errors and grid[0].metrics["score"] == 1.0  # its trial ran to its end


def test_a_ctrl_c_tune_took_as_its_trials_ended_is_noted(local_ray, tmp_path):
    ours = signal.getsignal(signal.SIGINT)
    with ctrl_c_through_tune() as ctrl_c:
        fit(tmp_path, os.getpid())  # Tune takes it for a graceful stop and returns as a finished run does
    assert ctrl_c.pressed
    assert signal.getsignal(signal.SIGINT) is ours


def test_a_fit_without_ctrl_c_gives_ctrl_c_back(local_ray, tmp_path):
    ours = signal.getsignal(signal.SIGINT)
    with ctrl_c_through_tune() as ctrl_c:
        fit(tmp_path, 0)
        assert signal.getsignal(signal.SIGINT) is not ours  # Tune's own, left behind by the fit
    assert not ctrl_c.pressed
    assert signal.getsignal(signal.SIGINT) is ours  # the next Ctrl-C (the confirmation, the report) is ours again
