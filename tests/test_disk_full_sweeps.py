"""Disk full on a real sweep (issue 34, items 8 and 9): the storage path, or the MLflow store, on a small tmpfs that
fills up while a trial is mid-way through.

The sweep stops as interrupted (exit 3) with one line naming where the write went, no run is left RUNNING where the
store can take the write, and the same command, once space is freed, finishes the sweep with every configuration
recorded once. These tests use only the command line and the record (no name added by the fix), so they can be run
against the code before it (measured there: exit 2 with no path, runs left RUNNING, a resume stuck for good).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import mlflow
import pytest

from test_faults import SWEEP
from tiny_sweep import FROZEN_AND_TOP_K, write_definition

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def small_disk(directory: Path, size: str = "64m"):
    """A tmpfs of ``size`` at ``directory`` (skips the test where mounting is not permitted); always unmounted."""
    directory.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
                             capture_output=True, text=True)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip() or mounted.returncode}): needs root")
    try:
        yield directory
    finally:
        if subprocess.run(["umount", str(directory)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(directory)], capture_output=True)  # busy: detached now, freed later


def fill(directory: Path) -> Path:
    """Write zeros into ``directory`` until its file system refuses for space; the ballast file is returned."""
    ballast = directory / "ballast"
    with contextlib.suppress(OSError), ballast.open("wb") as file:
        chunk = b"\0" * 65536
        while True:
            file.write(chunk)
            file.flush()
    probe = directory / "probe"
    with pytest.raises(OSError) as refused:
        probe.write_bytes(b"\0" * 4096)
    probe.unlink(missing_ok=True)
    assert refused.value.errno == errno.ENOSPC
    return ballast


def run_until(command: list[str], cwd: Path, mid_way, timeout: float = 600) -> tuple[int, str]:
    """Run ``command``; call ``mid_way()`` once a search trial has finished its first epoch; its status and output."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []

    def read():
        done = mid_way is None
        for line in process.stdout:
            output.append(line)
            if not done and "epoch 1/" in line and "peftune.tracking" in line:
                done = True
                mid_way()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = process.wait(timeout)
    finally:
        if process.poll() is None:
            process.kill()
    reader.join(10)
    return code, "".join(output)


def runs_of(uri: str, name: str):
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=[name])
    return runs[runs["tags.peftune.role"] == "sweep"], runs[runs["tags.peftune.role"] == "trial"]


def cut_state_files(experiment: Path) -> list[str]:
    """Tune's experiment state files that do not parse and have no complete copy beside them."""
    cut = []
    for path in experiment.glob("experiment_state-*.json"):
        for candidate in (path, path.with_name(path.name + ".good")):
            with contextlib.suppress(OSError, ValueError):
                json.loads(candidate.read_text())
                break
        else:
            cut.append(path.name)
    return cut


@pytest.mark.long
@pytest.mark.parametrize("full", ["storage", "store"])
def test_a_full_disk_interrupts_the_sweep_and_the_same_command_resumes_it(full, tmp_path, tiny_data_dir):
    samples = 3
    small = tmp_path / "small"
    with small_disk(small):
        storage = (small if full == "storage" else tmp_path) / "ray_results"
        db = (small if full == "store" else tmp_path) / "mlflow.db"
        uri = f"sqlite:///{db}"
        frozen = {"frozen": FROZEN_AND_TOP_K["frozen"]}  # lr and dropout searched: each trial its own configuration
        write_definition(tmp_path / "defs", "diskfull", frozen, SWEEP, methods="frozen", seed=0, confirm="{seeds: 0}",
                         trials_per_method=samples, epochs=2)  # fmt: skip
        definition = tmp_path / "defs" / "diskfull.yaml"
        command = [sys.executable, "-m", "peftune.cli.commands", "-v", "sweep", str(definition), "--data-dir",
                   str(tiny_data_dir), "--tracking-uri", uri, "--storage-path", str(storage), "--reports-dir",
                   str(tmp_path / "reports")]  # fmt: skip
        ballast: list[Path] = []
        code, log = run_until(command, tmp_path, lambda: ballast.append(fill(small)))
        assert ballast, log[-3000:]

        # stopped as interrupted, one line naming where the write went
        assert code == 3, log[-4000:]
        errors = [line for line in log.splitlines() if line.startswith("peftune sweep: error:")]
        assert len(errors) == 1 and "no space left" in errors[0] and str(small) in errors[0], log[-4000:]
        assert "Exception in thread" not in log, log[-4000:]  # issue 34: the tracking write thread died
        if full == "storage":  # the store has room: the record is closed, truthfully
            parents, children = runs_of(uri, "diskfull")
            assert len(parents) == 1 and parents.iloc[0]["tags.peftune.status"] == "interrupted"
            assert parents.iloc[0]["status"] == "KILLED"
            assert not (children["status"] == "RUNNING").any(), children[["tags.peftune.trial_id", "status"]]
            assert not (children.get("tags.peftune.status") == "failed").any()  # a trial did not fail: space did
        assert not cut_state_files(storage / "diskfull")

        ballast[0].unlink()  # space freed: the same command resumes it
        code, log = run_until(command, tmp_path, None)
        assert code == 0, log[-4000:]
        parents, children = runs_of(uri, "diskfull")
        assert len(parents) == 1 and parents.iloc[0]["tags.peftune.status"] == "completed", log[-3000:]
        assert parents.iloc[0]["status"] == "FINISHED"
        # every configuration recorded once, every run closed
        assert len(children) == samples and children["tags.peftune.trial_id"].is_unique, children
        assert children["tags.peftune.config_key"].is_unique, children["tags.peftune.config_key"]
        assert (children["status"] == "FINISHED").all() and (children["tags.peftune.status"] == "completed").all()
        assert not cut_state_files(storage / "diskfull")
