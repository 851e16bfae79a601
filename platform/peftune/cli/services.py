"""The local services of the main job: a Ray head and an MLflow server (``peftune up`` / ``peftune down``).

``up`` is idempotent: a Ray head already listening on the GCS port and an MLflow server already
answering on its port are reused, not started twice; a port held by anything else is an error
naming it. On a fresh machine it first writes Ray's authentication token (``~/.ray/auth_token``),
which ``ray start`` needs when token authentication is on (Ray 2.60's default).

What binds where (measured with Ray 2.60): the dashboard / Jobs API and MLflow listen on
127.0.0.1 only. Ray's GCS, raylet and dashboard-agent servers listen on every interface or on
the node's network address, and the client server on both, whatever ``--node-ip-address`` says
(Ray resolves 127.0.0.1 to the network address and has no bind option); token authentication
guards them.

``down`` stops what ``up`` started, found by port: the Ray processes of the head on the given GCS
port (never another Ray on this machine) and the MLflow server on the given port.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from peftune.base.errors import PeftuneError, UserError

LOOPBACK = "127.0.0.1"
READY_TIMEOUT_S = 300.0  # a loaded 2-core machine needs minutes for a fresh MLflow store


@dataclass(frozen=True)
class Ports:
    ray: int = 6379  # GCS; workers join HEAD:ray
    dashboard: int = 8265  # dashboard and Jobs API (`ray job submit --address http://127.0.0.1:8265`)
    client: int = 10001  # Ray client server
    mlflow: int = 5000
    agent: int = 52365  # the dashboard agent's HTTP port (job submission goes through it)


class ServiceError(PeftuneError, RuntimeError):
    """A service could not be started or stopped; the message says which and why."""


# ----------------------------------------------------------------------------- processes and ports


def _listener(port: int):
    """The process listening on TCP ``port`` (any address), or None."""
    import psutil

    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            try:
                return psutil.Process(conn.pid)
            except psutil.NoSuchProcess:
                return None
    return None


def _cmdline(process) -> str:
    import psutil

    try:
        return " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return ""


def ray_processes(gcs_port: int) -> list:
    """Every process of the Ray head whose GCS listens on ``gcs_port`` (their command lines name it)."""
    import psutil

    pattern = re.compile(rf"(gcs_server_port=|:){gcs_port}\b")
    found = []
    for process in psutil.process_iter():
        line = _cmdline(process)
        if "ray" in line and pattern.search(line):
            found.append(process)
    # their children too (dashboard agents, workers of the driver's jobs)
    for process in list(found):
        try:
            found.extend(child for child in process.children(recursive=True) if child not in found)
        except psutil.NoSuchProcess:
            pass
    return found


def mlflow_processes(port: int) -> list:
    """The ``mlflow server`` whose web worker listens on ``port``, with its workers; [] if that is not MLflow."""
    import psutil

    process = _listener(port)
    top = None
    while process is not None:  # the listener is a worker process of uvicorn, itself a child of `mlflow server`
        if re.search(r"mlflow\S* server\b", _cmdline(process)):
            top = process
        process = process.parent()
    if top is None:
        return []
    try:
        return [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return [top]


def _stop(processes: list, grace_s: float = 15.0) -> int:
    import psutil

    for process in processes:
        try:
            process.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    return len(processes)


def _http_ok(url: str, any_status: bool = False) -> bool:
    """A 200 from ``url``; with ``any_status`` any HTTP answer (the dashboard answers 401 without the token)."""
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            return response.status == 200
    except urllib.error.HTTPError:
        return any_status
    except (urllib.error.URLError, OSError):
        return False


def _wait_http(url: str, what: str, log_hint: str, any_status: bool = False) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if _http_ok(url, any_status):
            return
        time.sleep(1)
    raise ServiceError(f"{what} did not answer at {url} within {READY_TIMEOUT_S:.0f} s; see {log_hint}")


def _wait_dashboard(port: int) -> None:
    _wait_http(f"http://{LOOPBACK}:{port}/api/version", "the Ray dashboard", "`ray status`", any_status=True)


def _wait_job_agent(gcs_port: int) -> None:
    """The Jobs API answers "No available agent" until the head's dashboard agent listens: wait for it."""
    import psutil

    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        for process in ray_processes(gcs_port):
            try:
                if "DashboardAgent" in process.name() and any(
                    c.status == psutil.CONN_LISTEN for c in process.net_connections(kind="tcp")
                ):
                    return
            except psutil.NoSuchProcess:
                pass
        time.sleep(1)
    raise ServiceError(f"the Ray head's dashboard agent did not start within {READY_TIMEOUT_S:.0f} s; see `ray status`")


def _tool(name: str) -> str:
    """The console script ``name`` of this interpreter's environment (PATH as a fallback)."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        raise ServiceError(f"`{name}` is not installed in this environment")
    return found


# ----------------------------------------------------------------------------- up / down


def ensure_auth_token() -> bool:
    """Write Ray's token (``~/.ray/auth_token``) when there is none; True when one was generated."""
    if (Path.home() / ".ray" / "auth_token").exists():
        return False
    subprocess.run([_tool("ray"), "get-auth-token", "--generate"], check=True, stdout=subprocess.DEVNULL)
    return True


def ray_env() -> dict[str, str]:
    """The environment for Ray commands: token authentication on (workers and `ray job submit` need it too)."""
    return {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")}


def ray_temp_dir(gcs_port: int) -> Path:
    return Path(tempfile.gettempdir()) / f"peftune-ray-{gcs_port}"


def start_ray_head(ports: Ports, num_cpus: int | None) -> str:
    """Start the Ray head, or reuse the one on ``ports.ray``; returns 'started' or 'running'."""
    holder = _listener(ports.ray)
    if holder is not None:
        if "gcs_server" not in _cmdline(holder):
            raise ServiceError(f"port {ports.ray} (--ray-port) is in use by {holder.name()} (pid {holder.pid})")
        _wait_dashboard(ports.dashboard)
        _wait_job_agent(ports.ray)
        return "running"
    for flag, port in (
        ("--dashboard-port", ports.dashboard),
        ("--client-port", ports.client),
        ("--agent-port", ports.agent),
    ):
        holder = _listener(port)
        if holder is not None:
            raise ServiceError(f"port {port} ({flag}) is in use by {holder.name()} (pid {holder.pid})")
    ensure_auth_token()
    command = [
        _tool("ray"), "start", "--head",
        "--node-ip-address", LOOPBACK,
        "--port", str(ports.ray),
        "--dashboard-host", LOOPBACK,
        "--dashboard-port", str(ports.dashboard),
        "--ray-client-server-port", str(ports.client),
        "--dashboard-agent-listen-port", str(ports.agent),
        "--disable-usage-stats",
        # a temp dir of this head's own: a job's driver finds its cluster through <temp dir>/ray_current_cluster,
        # which any other Ray started on this machine overwrites in the shared default (/tmp/ray)
        "--temp-dir", str(ray_temp_dir(ports.ray)),
    ]  # fmt: skip
    if num_cpus is not None:
        command += ["--num-cpus", str(num_cpus)]
    done = subprocess.run(command, env=ray_env(), capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise ServiceError(f"`ray start --head` failed: {tail[0]}")
    _wait_dashboard(ports.dashboard)
    _wait_job_agent(ports.ray)
    return "started"


def start_mlflow(port: int, backend_store_uri: str, log_file: Path) -> str:
    """Start ``mlflow server`` on 127.0.0.1:``port``, or reuse the one answering there."""
    url = f"http://{LOOPBACK}:{port}"
    holder = _listener(port)
    if holder is not None:
        if _http_ok(f"{url}/health"):
            return "running"
        raise ServiceError(f"port {port} (--mlflow-port) is in use by {holder.name()} (pid {holder.pid})")
    # one web worker: with several, uvicorn's supervisor restarts workers that miss its 5 s health check
    # while they import (seen on a loaded 2-core machine: the server never answered)
    command = [_tool("mlflow"), "server", "--host", LOOPBACK, "--port", str(port), "--workers", "1",
               "--backend-store-uri", backend_store_uri]  # fmt: skip
    with open(log_file, "ab") as log:
        # a session of its own: it outlives this command, and `down` stops it with its workers
        server = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    try:
        _wait_http(f"{url}/health", "the MLflow server", str(log_file))
    except ServiceError:
        os.killpg(server.pid, signal.SIGKILL)  # never leave a server behind that `down` cannot find by its port
        server.wait()
        raise
    return "started"


def up(ports: Ports, num_cpus: int | None, backend_store_uri: str | None, log_file: Path) -> list[str]:
    """Start (or reuse) the Ray head and, unless ``backend_store_uri`` is None, the MLflow server."""
    ray_state = start_ray_head(ports, num_cpus)
    lines = [f"Ray head {ray_state}: GCS {ports.ray}, dashboard and Jobs API http://{LOOPBACK}:{ports.dashboard}"]
    if backend_store_uri is not None:
        mlflow_state = start_mlflow(ports.mlflow, backend_store_uri, log_file)
        lines.append(
            f"MLflow server {mlflow_state}: http://{LOOPBACK}:{ports.mlflow}"
            + (f" (store {backend_store_uri}, log {log_file})" if mlflow_state == "started" else "")
        )
    return lines


def down(ports: Ports) -> list[str]:
    lines = []
    for what, processes in (
        (f"MLflow server on port {ports.mlflow}", mlflow_processes(ports.mlflow)),
        (f"Ray head on port {ports.ray}", ray_processes(ports.ray)),
    ):
        stopped = _stop(processes)
        lines.append(f"{what}: " + (f"stopped ({stopped} processes)" if stopped else "not running"))
    return lines


# ----------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser, starting: bool) -> None:
    defaults = Ports()
    parser.add_argument("--ray-port", type=int, default=defaults.ray, help="the Ray head's GCS port")
    parser.add_argument("--dashboard-port", type=int, default=defaults.dashboard, help="dashboard and Jobs API port")
    parser.add_argument("--client-port", type=int, default=defaults.client, help="Ray client server port")
    parser.add_argument("--mlflow-port", type=int, default=defaults.mlflow, help="MLflow server port")
    parser.add_argument(
        "--agent-port", type=int, default=defaults.agent, help="the Ray dashboard agent's HTTP port (job submission)"
    )
    if starting:
        parser.add_argument("--num-cpus", type=int, help="CPUs the Ray head offers (default: all)")
        parser.add_argument("--ray-only", action="store_true", help="no MLflow server (one runs elsewhere)")
        parser.add_argument(
            "--backend-store-uri",
            help="MLflow's store (default: sqlite:///<working directory>/mlflow.db; "
            "postgresql+psycopg://... for a database server)",
        )


def ports_from_args(args) -> Ports:
    ports = Ports(args.ray_port, args.dashboard_port, args.client_port, args.mlflow_port, args.agent_port)
    for name, port in vars(ports).items():
        if not 0 < port < 65536:
            raise UserError(f"--{name}-port: expected a TCP port (1-65535), got {port}")
    if len(set(vars(ports).values())) != len(vars(ports)):
        raise UserError(f"the ports must differ, got {ports}")
    if getattr(args, "num_cpus", None) is not None and args.num_cpus < 1:
        raise UserError(f"--num-cpus: expected a positive integer, got {args.num_cpus}")
    return ports


def cmd_up(args) -> int:
    ports = ports_from_args(args)
    store = None if args.ray_only else args.backend_store_uri or f"sqlite:///{Path.cwd() / 'mlflow.db'}"
    try:
        lines = up(ports, args.num_cpus, store, Path.cwd() / "mlflow-server.log")
    except (ServiceError, subprocess.CalledProcessError) as error:
        print(f"peftune up: error: {error}", file=sys.stderr)
        return 2
    print("\n".join(lines), flush=True)
    return 0


def cmd_down(args) -> int:
    print("\n".join(down(ports_from_args(args))), flush=True)
    return 0
