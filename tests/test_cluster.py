"""A two-node Ray cluster on this machine: a head (`peftune up`) and a worker node joined with the
README's join command (`RAY_AUTH_MODE=token ray start --address HEAD:PORT`), each with one CPU.

A sweep with a local --storage-path is refused on it before anything starts (worker nodes write
trial checkpoints there, and Ray fails those trials while the sweep ends "completed").
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import sweep_command
from peftune.base import record_names
from peftune.cli import services
from test_fresh_machine import free_ports

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """(env, ports) of a head and a joined worker node under a fresh HOME; both stopped afterwards.

    One cluster for the module (starting and stopping one takes about 45 s): each test's sweep has its own
    directories, and the node-kill test, which ends the worker node, is the module's last."""
    tmp_path = tmp_path_factory.mktemp("two_nodes")
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
    peftune = [sys.executable, "-m", "peftune.cli.commands"]
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
        env["PEFTUNE_TEST_WORKER_AGENT_PORT"] = str(worker_agent_port)  # tells the worker node's processes apart
        yield env, ports
    finally:
        subprocess.run([*peftune, "down", *flags], cwd=tmp_path, env=env, capture_output=True, text=True)
        shutil.rmtree(services.ray_temp_dir(ports.ray), ignore_errors=True)  # the head's session logs
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
    argv = [sys.executable, "-m", "peftune.cli.commands", "sweep", "smoke", "--data-dir", str(tiny_data_dir),
            "--ray-address", f"127.0.0.1:{ports.ray}", "--tracking-uri", f"sqlite:///{work / 'mlflow.db'}",
            "--storage-path", str(work / "ray_results"), "--reports-dir", str(work / "reports")]  # fmt: skip
    done = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True)
    assert done.returncode == 2, done.stderr[-3000:]
    error = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(error) == 1 and "--storage-path" in error[0] and "2-node Ray cluster" in error[0], done.stderr[-3000:]
    assert "--shared-storage" in error[0] and "Traceback" not in done.stderr
    assert sorted(p.name for p in work.iterdir()) == []  # nothing written: no MLflow store, no Tune state


def test_a_sweep_runs_trials_on_both_nodes(two_nodes, tiny_data_dir, tmp_path):
    """--shared-storage: on one machine the storage path is shared by construction."""
    import json
    from collections import Counter

    import mlflow

    from test_sweep import definition

    env, ports = two_nodes
    definition(tmp_path / "definitions", "two_nodes", trials_per_method=1, concurrency=2, fits=True)
    work = tmp_path / "work"
    work.mkdir()
    uri = f"sqlite:///{work / 'mlflow.db'}"
    extra = ("--ray-address", f"127.0.0.1:{ports.ray}", "--shared-storage")
    argv = sweep_command(tmp_path / "definitions" / "two_nodes.yaml", tiny_data_dir, uri, work, *extra)
    done = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert re.search(r"sweep two_nodes: completed(_with_failures)?; 2 trials", done.stdout), done.stdout[-3000:]

    code = (
        "import json, ray\nfrom ray.util.state import list_actors\n"
        f"ray.init(address='127.0.0.1:{ports.ray}', logging_level='ERROR')\n"
        f"actors = list_actors(address='http://127.0.0.1:{ports.dashboard}', limit=10000)\n"
        "print(json.dumps([[a.class_name, a.node_id] for a in actors]))"
    )
    listed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr[-3000:]
    actors = json.loads(listed.stdout.strip().splitlines()[-1])
    # an actor Tune created for a pending trial and removed before Ray placed it has no node: it ran nothing
    trial_nodes = {node for name, node in actors if ("ImplicitFunc" in name or "trainable" in name) and node}
    print("actors (class, node):", Counter(map(tuple, actors)))
    assert len(trial_nodes) == 2, actors  # the trials' actors ran on the head and on the worker node

    client = mlflow.MlflowClient(uri)
    experiment = client.get_experiment_by_name("two_nodes")
    trials = [
        r for r in client.search_runs([experiment.experiment_id]) if r.data.tags.get(record_names.ROLE) == "trial"
    ]
    assert sorted(Counter(r.data.tags[record_names.TRIAL_ID] for r in trials).values()) == [1, 1]  # once each


KILL_SWEEP = """\
name: node_kill
tasks: [sst]
methods: [frozen]
seed: 0
# asynchronous: one method's trials must run two at a time, one on each node, for the kill to hit a trial
search: {objective: single, sampler: tpe, n_startup_trials: 10, asynchronous: true}
scheduler: {type: none}
resources: {cpus_per_trial: 1, max_concurrent_trials: 2}
max_failures: 2
checkpoints_per_method: 1
confirm: {seeds: 0}  # the search under a node kill; confirmation has its own tests
budget: tiny
budgets:
  tiny: {trials_per_method: 4, epochs: 6, batch_size: 16, max_length: 32, max_train_examples: 96, max_dev_examples: 32}
"""
# waits until a trial runs on the worker node, then kills that node's raylet (the node dies with it). The trial's
# actor is found among the raylet's own child processes (Ray titles them ray::ImplicitFunc...), which needs no
# dashboard; if the sweep (its pid) ends first, the killer says so and exits 1 instead of waiting on.
KILLER = """\
import sys, time, psutil
marker, sweep_pid = sys.argv[1], int(sys.argv[2])
raylet = next(p for p in psutil.process_iter() if p.name() == "raylet" and marker in " ".join(p.cmdline()))
while not any("ImplicitFunc" in " ".join(c.cmdline()) for c in raylet.children(recursive=True)):
    if not psutil.pid_exists(sweep_pid) or psutil.Process(sweep_pid).status() == psutil.STATUS_ZOMBIE:
        sys.exit("the sweep ended before a trial ran on the worker node")
    time.sleep(0.2)
raylet.kill()
print("killed the worker node's raylet", raylet.pid, flush=True)
"""


def test_killing_the_worker_node_mid_sweep_loses_and_duplicates_nothing(two_nodes, tiny_data_dir, tmp_path):
    from collections import Counter

    import mlflow

    env, ports = two_nodes
    (tmp_path / "methods").mkdir()
    (tmp_path / "methods" / "frozen.yaml").write_text(
        "method: frozen\nlr: 1.0e-3\ndropout: {low: 0.0, high: 0.2}\nweight_decay: 0.0\n"
    )
    (tmp_path / "node_kill.yaml").write_text(KILL_SWEEP)
    work = tmp_path / "work"
    work.mkdir()
    uri = f"sqlite:///{work / 'mlflow.db'}"
    argv = [sys.executable, "-m", "peftune.cli.commands", "sweep", str(tmp_path / "node_kill.yaml"), "--data-dir",
            str(tiny_data_dir), "--ray-address", f"127.0.0.1:{ports.ray}", "--tracking-uri", uri, "--storage-path",
            str(work / "ray_results"), "--reports-dir", str(work / "reports"), "--shared-storage"]  # fmt: skip
    raylets = [p for p in services.ray_processes(ports.ray) if p.name() == "raylet"]
    assert len(raylets) == 2  # head and worker node
    marker = f"--listen-port={env['PEFTUNE_TEST_WORKER_AGENT_PORT']}"  # the raylet starts its agent with it
    sweep_run = subprocess.Popen(argv, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killer = subprocess.run([sys.executable, "-c", KILLER, marker, str(sweep_run.pid)], env=env,
                            capture_output=True, text=True, timeout=900)  # fmt: skip
    output = sweep_run.communicate(timeout=1800)[0]
    assert killer.returncode == 0 and "killed" in killer.stdout, killer.stderr[-3000:] + output[-3000:]
    assert sweep_run.returncode == 0, output[-3000:]
    assert "sweep node_kill: completed; 4 trials (4 completed)" in output, output[-3000:]

    client = mlflow.MlflowClient(uri)
    experiment = client.get_experiment_by_name("node_kill")
    trials = [
        r for r in client.search_runs([experiment.experiment_id]) if r.data.tags.get(record_names.ROLE) == "trial"
    ]
    assert sorted(Counter(r.data.tags[record_names.TRIAL_ID] for r in trials).values()) == [1, 1, 1, 1]
    assert {r.data.tags.get(record_names.STATUS) for r in trials} == {"completed"}
    retried = [r for r in trials if int(r.data.tags.get("peftune.retries", "0")) >= 1]
    assert retried  # the kill hit a running trial, and Ray ran it again on the head
    for run in trials:  # every epoch logged once, the retried trials' included
        steps = [m.step for m in client.get_metric_history(run.info.run_id, "score")]
        assert sorted(steps) == sorted(set(steps)) and len(steps) == 6, (run.info.run_name, steps)
    summary = [line for line in output.splitlines() if "node_kill:" in line]
    print(killer.stdout.strip(), "| retried:", [r.info.run_name for r in retried], "| sweep:", summary)
