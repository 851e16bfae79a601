"""The SST job end to end: `ray job submit` to a real local Ray cluster started (and stopped) by the test."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import mlflow
import psutil
import pytest

from conftest import NEGATIVE, POSITIVE, write_task_file
from peftune import spaces

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalCluster:
    """``ray start --head --block`` on free ports, bound to 127.0.0.1, in its own session and temp dir.

    Stopped by signalling that session and then any process left that names the temp dir: never
    ``ray stop``, which would stop every Ray on the machine.
    """

    def __init__(self, env: dict[str, str], num_cpus: int = 2):
        self.temp_dir = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
        self.dashboard_port = free_port()
        ports = {
            "--port": free_port(),
            "--dashboard-port": self.dashboard_port,
            "--dashboard-agent-listen-port": free_port(),
            "--dashboard-agent-grpc-port": free_port(),
            "--metrics-export-port": free_port(),
            "--runtime-env-agent-port": free_port(),
            "--ray-client-server-port": free_port(),
            "--node-manager-port": free_port(),
            "--object-manager-port": free_port(),
        }
        command = [
            str(BIN / "ray"),
            "start",
            "--head",
            "--block",
            "--dashboard-host=127.0.0.1",
            f"--num-cpus={num_cpus}",
            "--include-dashboard=true",
            f"--temp-dir={self.temp_dir}",
        ]
        command += [f"{flag}={port}" for flag, port in ports.items()]
        self.gcs_address = f"127.0.0.1:{ports['--port']}"  # where other nodes join
        self.log = open(Path(self.temp_dir) / "ray-start.log", "w")  # noqa: SIM115 (closed in stop())
        self.process = subprocess.Popen(
            command, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ray start exited: {(Path(self.temp_dir) / 'ray-start.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.address}/api/version", timeout=2):
                    return
            except urllib.error.HTTPError:
                return  # it answers (401 without the cluster's token): it is up
            except OSError:
                time.sleep(1)
        raise TimeoutError(f"the Ray dashboard did not come up at {self.address}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:  # the GCS can take most of a minute to shut down gracefully
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
        for process in psutil.process_iter(["pid", "cmdline"]):  # daemons that left the session
            if any(self.temp_dir in part for part in process.info["cmdline"] or []):
                try:
                    process.kill()
                except psutil.Error:
                    pass
        self.log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture
def cluster_env(tmp_path) -> dict[str, str]:
    # token authentication, explicitly and on both sides (the cluster requires the token, and `ray job
    # submit` sends it only when RAY_AUTH_MODE=token), with a token of this test's own
    token = tmp_path / "ray_auth_token"
    token.write_text(secrets.token_hex(32))
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "HF_HUB_OFFLINE": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
    }
    env.pop("RAY_AUTH_TOKEN", None)
    env.pop("RAY_ADDRESS", None)
    return env


@pytest.mark.slow
def test_sst_job_smoke_test_through_ray_job_submit(tiny_data_dir, tmp_path, cluster_env):
    cluster = LocalCluster(cluster_env)
    try:
        cluster.wait_ready()
        uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
        command = [
            str(BIN / "ray"), "job", "submit", "--address", cluster.address, "--working-dir", ".", "--",
            "python", "jobs/sst_tuning.py", "--smoke-test", "--data-dir", str(tiny_data_dir), "--tracking-uri", uri,
            "--storage-path", str(tmp_path / "ray_results"), "--reports-dir", str(tmp_path / "reports"),
            "--test-dir", str(held_out_dir(tmp_path / "test")), "--test-seeds", "1",
        ]  # fmt: skip
        job = subprocess.run(command, cwd=REPO, env=cluster_env, capture_output=True, text=True, timeout=900)
    finally:
        cluster.stop()
    output = job.stdout + job.stderr
    assert job.returncode == 0, output[-6000:]
    assert "succeeded" in output

    # it ends by printing the parent run, the MLflow UI and where the report goes
    run_id = re.search(r"MLflow parent run id: (\w+)", output).group(1)
    assert "MLflow UI: http://127.0.0.1:5000/#/experiments/" in output
    assert f"mlflow ui --backend-store-uri {uri} --host 127.0.0.1" in output
    assert f"report: {tmp_path / 'reports' / 'sst_tuning'}/" in output

    # --test-dir: the final evaluation ran after the sweep and the report shows its table
    report = (tmp_path / "reports" / "sst_tuning" / "report.md").read_text()
    assert "## Held-out test split (final evaluation)" in report
    assert (tmp_path / "reports" / "sst_tuning" / "evaluation" / "evaluation.csv").is_file()

    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["sst_tuning"])
    parent = runs[runs["run_id"] == run_id].iloc[0]
    assert parent["tags.peftune.role"] == "sweep" and parent["params.budget"] == "smoke"
    assert parent["tags.peftune.status"] == "completed" and parent["status"] == "FINISHED"
    children = runs[runs["tags.mlflow.parentRunId"] == run_id]
    confirmed = children[children["tags.peftune.phase"] == "confirm"]  # smoke: the best of each method, 1 seed
    children = children[children["tags.peftune.phase"] != "confirm"]
    assert (confirmed["tags.peftune.status"] == "completed").all()
    assert len(children) == int(parent["params.num_samples"]) == 11
    # the smoke budget gives every method one trial: its published default
    methods = spaces.load_sweep(spaces.resolve_sweep_path("sst_tuning")).methods
    assert sorted(children["tags.peftune.method"]) == sorted(methods)
    assert (children["tags.peftune.default"] == "true").all()
    assert len(confirmed) == children["params.method"].nunique()
    assert children["tags.peftune.status"].isin(["completed", "early_stopped"]).all()
    assert children["metrics.best_score"].notna().all() and children["metrics.trainable_params_per_task"].notna().all()


def held_out_dir(directory: Path) -> Path:
    """A labelled SST test file in dev's format, with sentences of its own (a test split must be held out)."""
    directory.mkdir(parents=True, exist_ok=True)
    rows = [[f"{text} , said reviewer {i}", 4 if text in POSITIVE else 0] for i, text in enumerate(POSITIVE + NEGATIVE)]
    write_task_file(directory / "ids-sst-test.csv", ["sentence", "sentiment"], rows)
    return directory


def test_a_bad_test_dir_is_refused_before_the_sweep_starts(tiny_data_dir, tmp_path):
    """A missing test file exits 2 with a one-line error, before Ray starts or a record is written."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    command = [
        sys.executable, "jobs/sst_tuning.py", "--smoke-test", "--data-dir", str(tiny_data_dir), "--tracking-uri", uri,
        "--storage-path", str(tmp_path / "ray_results"), "--test-dir", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "ids-sst-test.csv" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "ray_results").exists()
