"""The README's first command, run as written on a "fresh machine": a new HOME (no Ray token, no
Ray session, no MLflow state), a copy of the repository's files, free ports.

What differs from the README, and why: the install part (`python3 -m venv .venv && pip install
-e ".[dev]" && . .venv/bin/activate`) is left out and this interpreter's environment is used
instead (its bin directory first on PATH, the copy's sources on PYTHONPATH): reinstalling torch
takes minutes and tests nothing of ours. `--budget cpu` becomes `--smoke-test`, the default ports
become free ones (passed to `peftune up` and put in the two addresses), `DATA` is the shared
data directory, and on the first run `--test-dir` adds a held-out test file, so that the job's final
evaluation runs too. The job's record on the MLflow server and its report are checked, then the command runs
a second time (the Ray head and MLflow server up, the sweep finished): it must reuse both and succeed again.
`peftune down` stops everything at the end.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, SHARED_DATA, copy_repository
from peftune.base import record_names
from peftune.cli import services
from peftune.sweep import spaces
from test_jobs import held_out_dir

LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}


def readme_first_command() -> str:
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return blocks[0].strip()


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def adapt(command: str, ports: services.Ports, data: Path, test_dir: Path | None = None) -> str:
    """The README command with the substitutions the module docstring lists (each must apply once)."""
    install, sep, rest = command.partition(". .venv/bin/activate && ")
    assert sep and install.startswith("DATA=$(realpath ../shared/data) && python3 -m venv .venv"), command
    flags = (
        f"--ray-port {ports.ray} --dashboard-port {ports.dashboard} --client-port {ports.client} "
        f"--mlflow-port {ports.mlflow} --agent-port {ports.agent}"
    )
    for old, new in (
        ("peftune up", f"peftune up {flags}"),
        ("127.0.0.1:8265", f"127.0.0.1:{ports.dashboard}"),
        ("127.0.0.1:5000", f"127.0.0.1:{ports.mlflow}"),
        ("--budget cpu", f"--smoke-test --test-dir {test_dir} --test-seeds 1" if test_dir else "--smoke-test"),
    ):
        assert rest.count(old) == 1, (old, rest)
        rest = rest.replace(old, new)
    return f"DATA={data} && {rest}"


def run(command: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    # a bound: `ray job submit` was seen waiting on after its job had failed
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)


def check_the_job(output: str, ports: services.Ports, report: Path) -> None:
    """What the job printed, its report with the held-out evaluation, and its record on the MLflow server."""
    import mlflow

    run_id = re.search(r"MLflow parent run id: (\w+)", output).group(1)
    assert f"MLflow UI: http://127.0.0.1:{ports.mlflow}/#/experiments/" in output
    assert re.search(r"^report: \S+/reports/sst_tuning/", output, flags=re.M), output[-3000:]
    assert "## Held-out test split (final evaluation)" in (report / "report.md").read_text()
    assert (report / "evaluation" / "evaluation.csv").is_file()

    client = mlflow.MlflowClient(f"http://127.0.0.1:{ports.mlflow}")
    parent = client.get_run(run_id)
    assert parent.data.tags[record_names.ROLE] == "sweep" and parent.data.params["budget"] == "smoke"
    assert parent.data.tags[record_names.STATUS] == "completed" and parent.info.status == "FINISHED"
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{run_id}'")
    # smoke: each budget's best contender, 1 seed; the carried trials are search trials the search did not propose
    confirmed = [r for r in children if r.data.tags[record_names.PHASE] == record_names.CONFIRM]
    every = [r for r in children if r.data.tags[record_names.PHASE] == record_names.SEARCH]
    searched = [r for r in every if not r.data.tags.get(record_names.CARRIED_FROM)]
    assert all(r.data.tags[record_names.STATUS] == "completed" for r in confirmed)
    assert len(searched) == int(parent.data.params["num_samples"]) == 14
    # the smoke budget gives every method one trial: its published default
    methods = spaces.load_sweep(spaces.resolve_sweep_path("sst_tuning")).methods
    assert sorted(r.data.params["method"] for r in searched) == sorted(methods)
    assert all(r.data.tags[record_names.DEFAULT] == "true" for r in searched)
    assert 1 <= len(confirmed) == len({r.data.tags[record_names.CONFIG_KEY] for r in confirmed}) <= 3  # one per budget
    assert {r.data.tags[record_names.STATUS] for r in searched} <= {"completed", "early_stopped"}
    assert all({"best_score", "trainable_params_per_task"} <= set(r.data.metrics) for r in searched)


def listening(processes) -> list[tuple[str, str, int]]:
    import psutil

    out = []
    for process in processes:
        try:
            for conn in process.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    out.append((process.name(), conn.laddr.ip, conn.laddr.port))
        except psutil.NoSuchProcess:
            pass
    return out


def test_up_refuses_bad_ports_and_a_port_held_by_something_else(capsys, tmp_path, monkeypatch):
    from peftune.cli.commands import main

    monkeypatch.chdir(tmp_path)
    assert main(["up", "--ray-port", "5000", "--mlflow-port", "5000"]) == 2
    assert "the ports must differ" in capsys.readouterr().err
    assert main(["up", "--client-port", "70000"]) == 2
    assert "--client-port: expected a TCP port" in capsys.readouterr().err
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    busy = holder.getsockname()[1]
    dashboard, *others = free_ports(4)
    try:
        argv = ["up", "--ray-port", str(busy), "--dashboard-port", str(dashboard)]
        argv += ["--client-port", str(others[0]), "--mlflow-port", str(others[1]), "--agent-port", str(others[2])]
        assert main(argv) == 2
    finally:
        holder.close()
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"port {busy} (--ray-port) is in use by" in err, err
    assert f"pid {os.getpid()}" in err
    assert not (tmp_path / "mlflow.db").exists()  # nothing started, nothing written


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.skipif(not (SHARED_DATA / "ids-sst-train.csv").exists(), reason="the shared data is not here")
def test_readme_first_command_on_a_fresh_machine(tmp_path):
    home, repo = tmp_path / "home", tmp_path / "repo"
    home.mkdir()
    repo.mkdir()
    copy_repository(repo)
    ports = services.Ports(*free_ports(5))
    first_command = adapt(readme_first_command(), ports, SHARED_DATA.resolve(), held_out_dir(tmp_path / "test"))
    env = {
        key: value for key, value in os.environ.items() if not key.startswith(("RAY_", "MLFLOW_"))
    }  # nothing of a Ray or MLflow the caller may run carries over
    env.update(
        HOME=str(home),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=f"{repo / 'platform'}{os.pathsep}{repo}",
        RAY_USAGE_STATS_ENABLED="0",
    )
    down = [sys.executable, "-m", "peftune.cli.commands", "down", "--ray-port", str(ports.ray), "--mlflow-port",
            str(ports.mlflow)]  # fmt: skip
    try:
        first = run(first_command, repo, env)
        output = first.stdout + first.stderr
        assert first.returncode == 0, output[-4000:]
        assert (home / ".ray" / "auth_token").exists()  # generated: there was none
        assert "Ray head started" in output and "MLflow server started" in output
        assert re.search(r"Job 'raysubmit_\w+' succeeded", output), output[-4000:]
        assert "sweep sst_tuning: completed" in output
        check_the_job(output, ports, repo / "reports" / "sst_tuning")

        # the dashboard / Jobs API and MLflow listen on loopback only. Ray 2.60 binds its GCS, raylets
        # and agents to the node's address (or all) whatever --node-ip-address says: token auth guards them
        sockets = listening(services.ray_processes(ports.ray) + services.mlflow_processes(ports.mlflow))
        by_port = {}
        for _name, ip, port in sockets:
            by_port.setdefault(port, set()).add(ip)
        for port in (ports.dashboard, ports.mlflow):
            assert port in by_port and by_port[port] <= LOOPBACK, (port, sockets)
        print("listening sockets of the started services:", sorted(set(sockets)))

        # again, as on a machine where it already ran: services reused, the finished sweep reported again
        second = run(adapt(readme_first_command(), ports, SHARED_DATA.resolve()), repo, env)
        output = second.stdout + second.stderr
        assert second.returncode == 0, output[-4000:]
        assert "Ray head running" in output and "MLflow server running" in output
        assert re.search(r"Job 'raysubmit_\w+' succeeded", output), output[-4000:]
        assert "sweep sst_tuning: completed" in output
    finally:
        subprocess.run(down, cwd=repo, env=env, capture_output=True, text=True)
        shutil.rmtree(services.ray_temp_dir(ports.ray), ignore_errors=True)  # the head's session logs
    assert services.ray_processes(ports.ray) == [] and services.mlflow_processes(ports.mlflow) == []
