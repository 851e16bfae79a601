"""MLflow on a real database server: a private PostgreSQL (Debian's packages) on 127.0.0.1, an
`mlflow server` backed by it, two sweeps at once against it, a resume and the reports.

The server refuses to run as root: as root, PostgreSQL runs as the `postgres` system user
(`runuser`). Without the PostgreSQL binaries the test is skipped, unless CI is set (CI installs them).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import pytest

from conftest import sweep_command
from peftune.base import record_names
from peftune.cli import services
from test_fresh_machine import free_ports
from test_sweep import definition

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def postgres_bin() -> Path | None:
    found = shutil.which("pg_ctl")
    if found:
        return Path(os.path.realpath(found)).parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return Path(candidates[-1]).parent if candidates else None


@pytest.fixture
def postgres():
    """A PostgreSQL server of this test only: data and unix socket in a temp dir, TCP on 127.0.0.1."""
    bindir = postgres_bin()
    if bindir is None:
        if os.environ.get("CI"):
            pytest.fail("CI is set but the PostgreSQL binaries are missing (.ci/run installs `postgresql`)")
        pytest.skip("PostgreSQL binaries (Debian package `postgresql`) are not installed")
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    root = Path(tempfile.mkdtemp(prefix="peftune-pg-"))  # not under pytest's 0700 tmp: the postgres user reads it
    root.chmod(0o755)
    data = root / "data"
    data.mkdir()
    if as_user:
        shutil.chown(data, "postgres", "postgres")
    port = free_ports(1)[0]

    def run(*argv):
        done = subprocess.run([*as_user, *argv], capture_output=True, text=True)
        assert done.returncode == 0, f"{argv[0]}: {done.stderr[-2000:]}"

    try:
        run(str(bindir / "initdb"), "-D", str(data), "-U", "mlflow", "-A", "trust", "--no-sync")
        run(str(bindir / "pg_ctl"), "-D", str(data), "-l", str(data / "server.log"), "-w", "start",
            "-o", f"-h 127.0.0.1 -p {port} -k {data} -F")  # fmt: skip
        run(str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "mlflow", "mlflow")
        yield f"postgresql+psycopg://mlflow@127.0.0.1:{port}/mlflow"
    finally:
        subprocess.run([*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "stop"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def mlflow_server(postgres, tmp_path):
    port = free_ports(1)[0]
    (tmp_path / "server").mkdir()
    cwd = os.getcwd()
    os.chdir(tmp_path / "server")  # the server's default artifact root goes here
    try:
        services.start_mlflow(port, postgres, tmp_path / "server" / "mlflow-server.log")
    finally:
        os.chdir(cwd)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        services._stop(services.mlflow_processes(port))


def test_two_sweeps_a_resume_and_reports_on_postgres(mlflow_server, tiny_data_dir, tmp_path):
    import mlflow

    from peftune.record import writer

    env = {key: value for key, value in os.environ.items() if not key.startswith(("RAY_ADDRESS", "MLFLOW_"))}
    env.update(PYTHONPATH=f"{REPO / 'platform'}{os.pathsep}{REPO}", RAY_USAGE_STATS_ENABLED="0")
    runs = {}
    for name, seed in (("pg_a", 0), ("pg_b", 1)):
        definition(tmp_path / "definitions", name, trials_per_method=1, concurrency=1, seed=seed, fits=True)
        (tmp_path / name).mkdir()
        runs[name] = (tmp_path / "definitions" / f"{name}.yaml", tmp_path / name)
    # both at once, each with its own local Ray, one MLflow server
    started = {
        name: subprocess.Popen(sweep_command(path, tiny_data_dir, mlflow_server, work), cwd=work, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for name, (path, work) in runs.items()
    }  # fmt: skip
    outputs = {name: process.communicate()[0] for name, process in started.items()}
    for name, process in started.items():
        assert process.returncode == 0, outputs[name][-3000:]
        assert re.search(rf"sweep {name}: completed(_with_failures)?; 2 trials", outputs[name]), outputs[name][-3000:]

    # resume one: nothing to run, the same parent run, the report written again
    path, work = runs["pg_a"]
    again = subprocess.run(sweep_command(path, tiny_data_dir, mlflow_server, work), cwd=work, env=env,
                           capture_output=True, text=True)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]

    client = mlflow.MlflowClient(mlflow_server)
    for name, (_, work) in runs.items():
        experiment = client.get_experiment_by_name(name)
        assert experiment.tags.get(writer.EXPERIMENT_KIND_TAG) == writer.EXPERIMENT_KIND
        parents = client.search_runs([experiment.experiment_id], f"tags.`{record_names.ROLE}` = 'sweep'")
        assert len(parents) == 1  # the resume found the parent run again
        parent_id = parents[0].info.run_id
        children = [r for r in client.search_runs([experiment.experiment_id]) if r.info.run_id != parent_id]
        trial_ids = Counter(r.data.tags.get(record_names.TRIAL_ID) for r in children)
        assert len(trial_ids) == 2 and set(trial_ids.values()) == {1}  # each trial once, none of the other sweep's
        assert all(r.data.tags.get("mlflow.parentRunId") == parent_id for r in children)
        assert all(r.data.tags.get(record_names.STATUS) in ("completed", "early_stopped", "failed") for r in children)
        assert parents[0].data.metrics["sweep_trials"] == 2
        assert (work / "reports" / name / "report.md").exists()
        if name == "pg_a":
            assert f"MLflow parent run id: {parent_id}" in again.stdout  # the resume reported the same sweep
