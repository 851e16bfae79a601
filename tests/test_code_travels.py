"""The submitted code travels: a two-node cluster whose worker node cannot import the installed peftune.

The head (no CPU for trials) and a worker node (one CPU) run on this machine; the worker node's Python
refuses any ``peftune`` or ``analysis`` that is not Ray's unpacked copy of what a job shipped (a
``sitecustomize`` on its path), so it stands for a node whose image has the dependencies but not this
package. A sweep submitted with ``ray job submit --working-dir <a copy of the sources>`` completes its
trials there; after an edit to a method in that copy, a second job's trials run the edited code.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import mlflow
import psutil
import pytest

pytestmark = pytest.mark.slow
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


# on the worker node: only Ray's copies of peftune and analysis (under runtime_resources/) may be imported
HIDE = """\
import sys
from importlib.machinery import PathFinder

sys.meta_path[:] = [f for f in sys.meta_path if "Editable" not in getattr(f, "__name__", type(f).__name__)]


class OnlyShipped:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name not in ("peftune", "analysis"):
            return None
        spec = PathFinder.find_spec(name, sys.path)
        if spec is None or "runtime_resources" not in str(spec.origin or spec.submodule_search_locations):
            raise ModuleNotFoundError(f"{name}: not installed on this node (only what a job ships)", name=name)
        return spec


sys.meta_path.insert(0, OnlyShipped)
"""
SWEEP = """\
name: travels
tasks: [sst]
methods: [frozen]
seed: 0
search: {objective: single, sampler: tpe, n_startup_trials: 2}
scheduler: {type: none}
resources: {cpus_per_trial: 1, max_concurrent_trials: 1}
max_failures: 0
checkpoints_per_method: 0
confirm: {seeds: 0}
budget: tiny
budgets:
  tiny: {trials_per_method: 2, epochs: 1, batch_size: 16, max_length: 32, max_train_examples: 32, max_dev_examples: 16}
"""
FROZEN = "method: frozen\nlr: {low: 1.0e-4, high: 1.0e-2, log: true}\ndropout: 0.1\nweight_decay: 0.0\n"
EDIT = """\
def apply_frozen(backbone, config: FrozenConfig, context) -> None:
    import os
    from pathlib import Path

    marker = Path(os.environ["PEFTUNE_TEST_MARKER_DIR"]) / f"edited-{os.getpid()}"
    marker.write_text(__file__)  # the edited method ran, from this file
"""


class WorkerNode:
    """``ray start --address ... --block`` with one CPU, in its own session and temp dir, under ``env``.

    Its own temp dir, as on another machine: nodes sharing one unpack Ray's runtime environments into the same
    directories, and one node's unpacking pulled the job's working directory from under the other's driver.
    """

    def __init__(self, gcs: str, env: dict[str, str], log: Path):
        self.temp_dir = tempfile.mkdtemp(prefix="rw", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
        ports = ("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--metrics-export-port",
                 "--runtime-env-agent-port", "--node-manager-port", "--object-manager-port")  # fmt: skip
        command = [str(BIN / "ray"), "start", f"--address={gcs}", "--num-cpus=1", "--block", "--disable-usage-stats",
                   f"--temp-dir={self.temp_dir}"]  # fmt: skip
        command += [f"{flag}={free_port()}" for flag in ports]
        self.log = log.open("w")
        self.process = subprocess.Popen(command, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                        start_new_session=True)  # fmt: skip

    def stop(self):
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
        for process in psutil.process_iter(["cmdline"]):  # its daemons that left the session
            if any(self.temp_dir in part for part in process.info["cmdline"] or []):
                with contextlib.suppress(psutil.Error):
                    process.kill()
        self.log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def alive_nodes(env: dict[str, str], gcs: str) -> int:
    code = f"import ray; ray.init(address='{gcs}', logging_level='ERROR'); print(sum(n['Alive'] for n in ray.nodes()))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    return int(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else 0


def copy_sources(destination: Path) -> Path:
    for part in ("platform", "analysis", "jobs", "search_spaces"):
        shutil.copytree(REPO / part, destination / part, ignore=shutil.ignore_patterns("__pycache__"))
    (destination / "defs" / "methods").mkdir(parents=True)
    (destination / "defs" / "methods" / "frozen.yaml").write_text(FROZEN)
    (destination / "defs" / "travels.yaml").write_text(SWEEP)
    job = (REPO / "jobs" / "sst_tuning.py").read_text().replace('run("sst_tuning"', 'run("defs/travels.yaml"')
    assert "defs/travels.yaml" in job
    (destination / "jobs" / "travels.py").write_text(job)  # the shipped job file, on a tiny definition
    return destination


@pytest.mark.long
def test_a_job_s_trials_run_its_own_code_on_a_node_without_the_package(tmp_path, tiny_data_dir, cluster_env):
    head_env = {k: v for k, v in cluster_env.items() if k != "PYTHONPATH"}  # the installed peftune only
    # Ray's memory monitor counts the whole machine's memory, which the test shares with other work: seen killing
    # this tiny job's workers at 95 % of it; the kernel's own OOM killer still guards the machine
    head_env["RAY_memory_monitor_refresh_ms"] = "0"
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE)
    markers = tmp_path / "markers"
    markers.mkdir()
    worker_env = {**head_env, "PYTHONPATH": str(hide), "PEFTUNE_TEST_MARKER_DIR": str(markers)}
    probe = subprocess.run([sys.executable, "-c", "import peftune"], env=worker_env, capture_output=True, text=True)
    assert probe.returncode != 0 and "not installed on this node" in probe.stderr, probe.stderr[-2000:]

    source = copy_sources(tmp_path / "src")
    cluster = LocalCluster(head_env, num_cpus=0)  # the head runs the job's driver, never a trial
    worker = None
    try:
        cluster.wait_ready()
        gcs = cluster.gcs_address
        worker = WorkerNode(gcs, worker_env, tmp_path / "worker.log")
        deadline = time.monotonic() + 120
        while alive_nodes(head_env, gcs) < 2:
            assert time.monotonic() < deadline, (tmp_path / "worker.log").read_text()[-3000:]
            time.sleep(2)

        def submit(name: str) -> str:
            places = ["--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}", "--shared-storage", "--storage-path",
                      str(tmp_path / "ray_results"), "--reports-dir", str(tmp_path / "reports")]  # fmt: skip
            command = [str(BIN / "ray"), "job", "submit", "--address", cluster.address, "--working-dir", str(source),
                       "--", "python", "jobs/travels.py", "--name", name, "--data-dir", str(tiny_data_dir),
                       *places]  # fmt: skip
            job = subprocess.run(command, cwd=tmp_path, env=head_env, capture_output=True, text=True, timeout=1500)
            output = job.stdout + job.stderr
            assert job.returncode == 0 and f"sweep {name}: completed; 2 trials (2 completed)" in output, output[-5000:]
            return output

        first = time.monotonic()
        submit("before_edit")
        print(f"first job: {time.monotonic() - first:.0f} s")
        assert not list(markers.iterdir())  # the shipped method is the unedited one

        method = source / "platform" / "peftune" / "methods" / "frozen.py"
        text = method.read_text()
        original = textwrap.dedent("""\
            def apply_frozen(backbone, config: FrozenConfig, context) -> None:
                pass  # the backbone arrives frozen; the heads are trained by the model
        """)
        assert original in text
        method.write_text(text.replace(original, EDIT))
        submit("after_edit")
    finally:
        if worker is not None:
            worker.stop()
        cluster.stop()

    ran = [marker.read_text() for marker in markers.iterdir()]
    assert ran, "the edited method never ran on the worker node"
    assert all("runtime_resources" in path and str(source) not in path for path in ran), ran  # Ray's shipped copy
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["after_edit"])
    trials = runs[runs["tags.peftune.role"] == "trial"]
    assert len(trials) == 2 and (trials["tags.peftune.status"] == "completed").all()
