"""One driver per sweep: the lease on the storage path (``peftune.sweep.lease``).

The rules on real files (a second holder refused naming the first, a lapsed lease taken over, a
superseded holder told so, one winner of a race), then real driver processes of one sweep: the
second exits 2 at once naming the first; after the first is SIGKILLed and its lease has lapsed, a
new driver takes over, and the record loses or repeats nothing.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import mlflow
import psutil
import pytest

from conftest import sweep_command
from peftune.cli import common
from peftune.sweep import lease
from tiny_sweep import FROZEN_AND_TOP_K

# ----------------------------------------------------------------------------- the rules, on files


def write_holder(directory: Path, name: str, generation: int, *, age: float, ttl: float, host="elsewhere", pid=4242):
    now = time.time()
    holder = {"host": host, "pid": pid, "since": now - age - 100, "renewed": now - age, "ttl": ttl, "token": "t"}
    (directory / f"{name}.driver.{generation}.lease").write_text(json.dumps(holder))


def test_a_held_lease_refuses_a_second_driver_naming_the_first(tmp_path):
    first = lease.Lease(tmp_path, "s", ttl=30)
    first.acquire()
    try:
        with pytest.raises(lease.LeaseHeld) as refused:
            lease.Lease(tmp_path, "s", ttl=30).acquire()
        message = str(refused.value)
        assert f"host {socket.gethostname()}, pid {os.getpid()}, since " in message and "'s'" in message
        assert "lapses at" in message and "\n" not in message
        assert isinstance(refused.value, ValueError)  # a user error: one line, exit 2
        other = lease.Lease(tmp_path, "other", ttl=30)
        other.acquire()  # another sweep under the same storage path is free
        other.release()  # (left renewing, its thread would stop this process once tmp_path is gone)
    finally:
        first.release()
    assert first.current() == (None, None)  # released: the next driver starts at once
    again = lease.Lease(tmp_path, "s", ttl=30)
    again.acquire()
    again.release()


def test_a_lapsed_lease_is_taken_over_and_its_holder_finds_it_superseded(tmp_path):
    write_holder(tmp_path, "s", 3, age=2.0, ttl=1.0)  # a driver on another host, silent for 2 s of its 1 s
    taker = lease.Lease(tmp_path, "s", ttl=30)
    taker.acquire()
    try:
        assert taker.generation == 4 and taker.current()[1].pid == os.getpid()
        assert (tmp_path / "s.driver.3.lease").exists()  # history stays (a crash leaves one small file)
    finally:
        taker.release()

    lost = threading.Event()
    stalled = lease.Lease(tmp_path, "s", ttl=0.3, on_lost=lost.set)
    stalled.acquire()
    time.sleep(0.6)  # twice its ttl: the thread renewed it meanwhile, so it is still its own
    assert not lost.is_set() and not stalled.current()[1].lapsed(time.time())
    write_holder(tmp_path, "s", stalled.generation + 1, age=0.0, ttl=30)  # taken over while it stalled
    assert lost.wait(5) and not stalled.renew()  # the renewing thread found out, and says so
    stalled.release()  # leaves the new holder's lease alone
    assert stalled.current()[1].host == "elsewhere"


def test_a_fresh_lease_of_a_silent_driver_is_not_taken_over(tmp_path):
    write_holder(tmp_path, "s", 0, age=5.0, ttl=60.0)
    with pytest.raises(lease.LeaseHeld, match="host elsewhere, pid 4242, since .*, lease renewed 5 s ago;"):
        lease.Lease(tmp_path, "s", ttl=60).acquire()


HOLD = """\
import sys, time
from peftune.sweep import lease
lease.Lease(sys.argv[1], "s", ttl=60).acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_the_lease_of_a_dead_driver_on_this_host_is_taken_over_at_once(tmp_path, caplog):
    """Issue 34: after a driver's kill -9 the sweep could not be resumed for up to a minute (the lease's ttl)
    though its pid was dead on this very host."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(lease.LeaseHeld, match=f"pid {holder.pid}, "):  # alive: refused
            lease.Lease(tmp_path, "s", ttl=60).acquire()
        holder.kill()
        os.waitid(os.P_PID, holder.pid, os.WEXITED | os.WNOWAIT)  # dead, not yet reaped: a zombie
        taker = lease.Lease(tmp_path, "s", ttl=60)
        with caplog.at_level("WARNING", logger="peftune.sweep.lease"):
            taker.acquire()  # at once, 59 s before the dead driver's lease lapses
        taker.release()
        assert "whose process has ended" in caplog.text and f"pid {holder.pid}" in caplog.text
    finally:
        holder.kill()
        holder.wait()
    write_holder(tmp_path, "s", 5, age=0.0, ttl=60, host=socket.gethostname(), pid=holder.pid)  # reaped: no pid
    taker = lease.Lease(tmp_path, "s", ttl=60)
    taker.acquire()
    assert taker.generation == 6
    taker.release()


def test_a_live_pid_that_is_another_process_than_the_holder_is_taken_over_and_another_host_waits(tmp_path):
    this_host, now = socket.gethostname(), time.time()
    live = {"host": this_host, "pid": os.getpid(), "since": now, "renewed": now, "ttl": 60.0, "token": "t"}
    path = tmp_path / "s.driver.0.lease"
    path.write_text(json.dumps({**live, "started": psutil.Process().create_time()}))  # this very process
    with pytest.raises(lease.LeaseHeld):
        lease.Lease(tmp_path, "s", ttl=60).acquire()
    path.write_text(json.dumps({**live, "started": psutil.Process().create_time() - 3600}))  # its pid, reused
    taker = lease.Lease(tmp_path, "s", ttl=60)
    taker.acquire()
    try:  # a lease records its holder's start
        assert taker.current()[1].started == pytest.approx(psutil.Process().create_time())
    finally:
        taker.release()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    write_holder(tmp_path, "s", 2, age=0.0, ttl=60, host="elsewhere", pid=int(gone.stdout))  # dead, but elsewhere
    with pytest.raises(lease.LeaseHeld, match="host elsewhere"):
        lease.Lease(tmp_path, "s", ttl=60).acquire()


def test_of_drivers_racing_for_a_lapsed_lease_exactly_one_wins(tmp_path):
    write_holder(tmp_path, "s", 0, age=10.0, ttl=1.0)
    racers = [lease.Lease(tmp_path, "s", ttl=30) for _ in range(16)]
    outcomes, start = [], threading.Barrier(len(racers))

    def race(one):
        start.wait()
        try:
            one.acquire()
            outcomes.append("won")
        except lease.LeaseHeld:
            outcomes.append("refused")

    threads = [threading.Thread(target=race, args=(one,)) for one in racers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert Counter(outcomes) == {"won": 1, "refused": 15}
    for one in racers:
        one.release()


def test_the_lease_time_is_a_setting_and_a_bad_one_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv(lease.TTL_ENV, "7.5")
    assert lease.Lease(tmp_path, "s").ttl == 7.5
    monkeypatch.setenv(lease.TTL_ENV, "soon")
    with pytest.raises(ValueError, match=f"{lease.TTL_ENV}='soon': expected a positive number of seconds"):
        lease.Lease(tmp_path, "s")


def test_object_storage_keeps_its_leases_in_a_local_directory(monkeypatch, tmp_path):
    assert lease.lease_dir(str(tmp_path)) == tmp_path
    assert lease.lease_dir(f"file://{tmp_path}") == tmp_path
    monkeypatch.setenv(lease.DIR_ENV, str(tmp_path / "leases"))
    s3 = lease.lease_dir("s3://bucket/sweeps")
    assert s3.parent == tmp_path / "leases" and s3 != lease.lease_dir("s3://bucket/other")


def test_held_releases_at_the_end_and_a_refused_start_leaves_no_directory_behind(tmp_path):
    storage = tmp_path / "new" / "ray_results"
    with pytest.raises(ValueError, match="bad input"):
        with lease.held(str(storage), "s"):
            assert list(storage.glob("s.driver.*.lease"))
            raise lease.UserError("bad input")  # nothing started: what the lease created goes again
    assert not (tmp_path / "new").exists()
    with pytest.raises(KeyboardInterrupt):
        with lease.held(str(storage), "s"):
            raise KeyboardInterrupt  # the sweep ran: its directory stays, the lease is released
    assert storage.is_dir() and not list(storage.iterdir())


# ----------------------------------------------------------------------------- real drivers

METHODS = FROZEN_AND_TOP_K
SWEEP = """\
    name: leased
    tasks: [sst]
    methods: [frozen, top_k]
    seed: 3
    search: {objective: single, sampler: tpe, n_startup_trials: 2, allocation: per_method}
    scheduler: {type: none}
    resources: {cpus_per_trial: 1, max_concurrent_trials: 1}
    max_failures: 0
    checkpoints_per_method: 0
    confirm: {seeds: 0}
    budget: tiny
    budgets:
      tiny: {trials_per_method: 2, epochs: 3, batch_size: 16, max_length: 32, max_train_examples: 64,
             max_dev_examples: 16}
"""
TTL_S = 15.0


class Driver:
    """``peftune sweep`` in its own session (the driver and the local Ray it starts), its output collected."""

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str]):
        self.started = time.monotonic()
        self.process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, start_new_session=True)  # fmt: skip
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.process.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output:
            assert self.process.poll() is None and time.monotonic() < deadline, self.output[-3000:]
            time.sleep(0.2)

    def finish(self, timeout: float) -> int:
        code = self.process.wait(timeout)
        self.reader.join(10)
        return code

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # the driver and its Ray at once, as a crash does
        except ProcessLookupError:
            pass


@pytest.mark.long
@pytest.mark.slow
def test_two_drivers_of_one_sweep_the_second_refused_then_a_takeover_after_sigkill(tmp_path, tiny_data_dir):
    (tmp_path / "methods").mkdir()
    for method, text in METHODS.items():
        (tmp_path / "methods" / f"{method}.yaml").write_text(textwrap.dedent(text))
    (tmp_path / "leased.yaml").write_text(textwrap.dedent(SWEEP))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    argv = sweep_command(tmp_path / "leased.yaml", tiny_data_dir, uri, tmp_path)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", lease.TTL_ENV: str(TTL_S)}
    env.pop("RAY_ADDRESS", None)
    storage = tmp_path / "ray_results"
    drivers = []
    try:
        first = Driver(argv, tmp_path, env)
        second = Driver(argv, tmp_path, env)  # started together; the first takes the lease (it may be either)
        drivers += [first, second]
        codes = {}
        deadline = time.monotonic() + 300
        while not codes and time.monotonic() < deadline:
            codes = {i: d.process.poll() for i, d in enumerate((first, second)) if d.process.poll() is not None}
            time.sleep(0.2)
        ((refused_index, code),) = codes.items()  # one of them ended, the other runs on
        refused, running = (second, first) if refused_index == 1 else (first, second)
        refused.finish(30)
        assert code == common.EXIT_USER_ERROR, refused.output[-3000:]
        errors = [line for line in refused.output.splitlines() if "error" in line]
        assert len(errors) == 1 and f"pid {running.process.pid}, since " in errors[0], refused.output[-3000:]
        assert f"host {socket.gethostname()}" in errors[0] and "Traceback" not in refused.output
        print("refused after", round(time.monotonic() - refused.started, 1), "s:", errors[0])
        assert running.process.poll() is None  # refused while the first runs

        running.wait_for("search 1/", timeout=600)  # mid-sweep: its first trial finished (the progress line)
        mlflow.set_tracking_uri(uri)
        running.kill()
        running.finish(60)
        (lease_file,) = storage.glob("leased.driver.*.lease")  # a crash leaves it behind
        holder = json.loads(lease_file.read_text())
        assert holder["pid"] == running.process.pid and holder["ttl"] == TTL_S
        time.sleep(max(0.0, holder["renewed"] + holder["ttl"] - time.time()) + 0.5)  # until it has lapsed

        third = Driver(argv, tmp_path, env)
        drivers.append(third)
        assert third.finish(1200) == 0, third.output[-4000:]
        assert "taking over sweep leased" in third.output and "sweep leased: completed; 4 trials" in third.output
    finally:
        for driver in drivers:
            driver.kill()
    left = [json.loads(path.read_text())["pid"] for path in storage.glob("leased.driver.*.lease")]
    assert left == [running.process.pid]  # the third released its own; the killed driver's lapsed one stays

    runs = mlflow.search_runs(experiment_names=["leased"])
    assert (runs["tags.peftune.role"] == "sweep").sum() == 1
    children = runs[runs["tags.peftune.role"] == "trial"]
    assert len(children) == 4, "a trial was lost or recorded twice"
    assert children["tags.peftune.trial_id"].is_unique and children["tags.peftune.config_key"].is_unique
    assert children["tags.peftune.status"].notna().all() and (children["status"] != "RUNNING").all()
    assert Counter(children["tags.peftune.method"]) == {"frozen": 2, "top_k": 2}
    client = mlflow.MlflowClient(uri)
    for run_id in children["run_id"]:
        steps = [m.step for m in client.get_metric_history(run_id, "score")]
        assert sorted(steps) == sorted(set(steps)), steps  # no epoch logged twice
