"""The driver benchmark runs end to end on a small sweep and prints its table (its numbers are not checked)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, SHARED_DATA


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED_DATA / "ids-sst-train.csv").exists(), reason="the shared data is not here")
def test_the_driver_benchmark_prints_a_row_per_window_and_the_confirmation_reads(tmp_path):
    paths = [str(REPO / "platform"), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    command = [sys.executable, "-m", "peftune.benchmarks.driver", "--trials", "28", "--window", "14",
               "--record-sizes", "28", "--data-dir", str(SHARED_DATA), "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    lines = done.stdout.splitlines()  # Ray Tune's own banner first
    assert any(line.startswith("sweep completed: 28 trials") for line in lines), done.stdout[-3000:]
    rows = [line.split() for line in lines if line.strip().startswith(("1-14", "15-28"))]
    assert [row[0] for row in rows] == ["1-14", "15-28"]
    # trials, results, cpu s, wall s, ms/trial, ms/result, MLflow calls/trial, buffer ms/trial, queued
    assert all(len(row) == 9 for row in rows)
    assert any(line.startswith("last/first CPU per trial: ") for line in lines)
    assert any(line.startswith("end of sweep (flush and closing reads): ") for line in lines)

    windows = json.loads((tmp_path / "windows.json").read_text())
    assert [(w["from"], w["to"]) for w in windows["windows"]] == [(1, 14), (15, 28)]
    assert all(w["calls_per_trial"] > 0 and w["cpu_ms_per_trial"] > 0 for w in windows["windows"])
    (reads,) = windows["confirmation"]
    assert reads["search_runs"] == 28 and reads["confirm_runs"] > 0
    # a round decides on what the driver kept of its trials: no call to the tracking server (issue 31: the first
    # round read every run's histories and predictions, a later one every run again through search_runs)
    assert reads["round_1"]["calls"] == 0, reads["round_1"]


def test_the_driver_measures_through_the_sweeps_public_seams():
    """The benchmark patches nothing of the package: it runs the sweep with ``SweepHooks`` and times the write
    buffer through ``around_apply`` (issue 47: it swapped in its own ``orchestrator._runnable`` and
    ``_trial_logger``)."""
    from types import SimpleNamespace

    from peftune.benchmarks import driver
    from peftune.record.tracking_buffer import WriteBuffer
    from peftune.sweep import orchestrator, worker

    assert orchestrator.SweepHooks().trainable is worker.trainable and orchestrator.SweepHooks().on_trial_logger is None
    buffer = WriteBuffer(SimpleNamespace(tracking_uri="sqlite:///unused.db"), None)
    applied = []
    buffer._apply = applied.append  # the store, stood in for by a list (this test's own buffer)
    ops = driver.BufferOps()
    buffer.around_apply = ops.timed
    try:
        buffer.put("metrics", trial_id="t1", metrics=[])
        buffer.put("finish", trial_id="t1", status="completed", error=None, retries=0, best=[])
        assert buffer.flush(30)
    finally:
        buffer.stop()
    assert [item["op"] for item in applied] == ["metrics", "finish"]
    assert ops.snapshot()[1] == {"metrics": 1, "finish": 1}
