"""A two-node Ray cluster on this machine: a head (`peftune up`) and a worker node joined with the
README's join command (`RAY_AUTH_MODE=token ray start --address HEAD:PORT`), each with one CPU.

A sweep with a local --storage-path is refused on it before anything starts (worker nodes write
trial checkpoints there, and Ray fails those trials while the sweep ends "completed").
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from peftune import services
from test_fresh_machine import free_ports

pytestmark = pytest.mark.slow


@pytest.fixture
def two_nodes(tmp_path):
    """(env, ports) of a head and a joined worker node under a fresh HOME; both stopped afterwards."""
    home = tmp_path / "home"
    home.mkdir()
    repo = Path(__file__).resolve().parents[1]
    env = {key: value for key, value in os.environ.items() if not key.startswith(("RAY_", "MLFLOW_"))}
    env.update(
        HOME=str(home),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=f"{repo / 'platform'}{os.pathsep}{repo}",
        RAY_USAGE_STATS_ENABLED="0",
        RAY_AUTH_MODE="token",
    )
    ports = services.Ports(*free_ports(5))
    worker_agent_port = free_ports(1)[0]
    flags = [f"--ray-port={ports.ray}", f"--dashboard-port={ports.dashboard}", f"--client-port={ports.client}",
             f"--mlflow-port={ports.mlflow}", f"--agent-port={ports.agent}"]  # fmt: skip
    peftune = [sys.executable, "-m", "peftune.cli"]
    try:
        up = subprocess.run([*peftune, "up", *flags, "--num-cpus", "1", "--ray-only"], cwd=tmp_path, env=env,
                            capture_output=True, text=True)  # fmt: skip
        assert up.returncode == 0, up.stderr[-3000:]
        join = subprocess.run(
            [str(Path(sys.executable).parent / "ray"), "start", "--address", f"127.0.0.1:{ports.ray}", "--num-cpus",
             "1", "--dashboard-agent-listen-port", str(worker_agent_port), "--disable-usage-stats"],
            env=env, capture_output=True, text=True,
        )  # fmt: skip
        assert join.returncode == 0, join.stderr[-3000:]
        yield env, ports
    finally:
        subprocess.run([*peftune, "down", *flags], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert services.ray_processes(ports.ray) == []


def alive_nodes(env, ports) -> int:
    code = (
        f"import ray; ray.init(address='127.0.0.1:{ports.ray}', logging_level='ERROR');"
        "print(sum(1 for n in ray.nodes() if n['Alive']))"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return int(done.stdout.strip().splitlines()[-1])


def test_local_storage_path_is_refused_on_two_nodes(two_nodes, tiny_data_dir, tmp_path):
    env, ports = two_nodes
    assert alive_nodes(env, ports) == 2  # the worker node joined with the token
    work = tmp_path / "work"
    work.mkdir()
    argv = [sys.executable, "-m", "peftune.cli", "sweep", "smoke", "--data-dir", str(tiny_data_dir),
            "--ray-address", f"127.0.0.1:{ports.ray}", "--tracking-uri", f"sqlite:///{work / 'mlflow.db'}",
            "--storage-path", str(work / "ray_results"), "--reports-dir", str(work / "reports")]  # fmt: skip
    done = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True)
    assert done.returncode == 2, done.stderr[-3000:]
    error = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(error) == 1 and "--storage-path" in error[0] and "2-node Ray cluster" in error[0], done.stderr[-3000:]
    assert "--shared-storage" in error[0] and "Traceback" not in done.stderr
    assert sorted(p.name for p in work.iterdir()) == []  # nothing written: no MLflow store, no Tune state
