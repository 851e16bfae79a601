"""Faults on real sweeps (real Ray, real MLflow, the embedded MiniLM on a sliver of data).

A diverging method is a result (``diverged``), never retried; a sweep with failed trials says so in
its status and exit code; Tune state without its MLflow record is refused up front; a double Ctrl-C
still closes every run. Each asserts the MLflow record against Ray's view: every trial exactly once,
every run with a final status.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import mlflow
import pytest
import ray
import torch
from ray import tune

from conftest import start_local_ray
from peftune.cli import sweep_command
from peftune.core.train import DivergenceGuard, TrainConfig, TrainingDiverged
from peftune.sweep import orchestrator, spaces

# lr 10 (the largest a space accepts) blows the heads up: a deterministic divergence; top_k with k = 8 > the
# 6 layers of MiniLM fails when the trial builds its model (a failure, retried once by max_failures: 1)
DIVERGING = """\
    method: frozen
    lr: 10.0
    dropout: 0.0
    weight_decay: 0.0
"""
FAILING = """\
    method: top_k
    lr: 1.0e-3
    dropout: 0.1
    weight_decay: 0.0
    options:
      k: 8
"""
HEALTHY = """\
    method: bitfit
    lr: 1.0e-3
    dropout: 0.1
    weight_decay: 0.0
"""
SWEEP = """\
    name: {name}
    tasks: [sst]
    methods: [{methods}]
    seed: {seed}
    search: {{objective: single, sampler: tpe, n_startup_trials: 10}}
    scheduler: {{type: none}}
    resources: {{cpus_per_trial: 1, max_concurrent_trials: 1}}
    max_failures: 1
    checkpoints_per_method: 1
    confirm: {confirm}
    budget: tiny
    budgets:
      tiny: {{trials_per_method: {trials_per_method}, epochs: {epochs}, batch_size: 16, max_length: 32,
              max_train_examples: 64, max_dev_examples: 32}}
"""


# the search's faults; confirmation's resume has its own tests (test_confirm.py)
NO_CONFIRMATION = "{seeds: 0}"


def write_definition(
    directory: Path, name: str, methods: list[str], trials_per_method: int, epochs: int = 2, seed=0,
    confirm: str = NO_CONFIRMATION,
):  # fmt: skip
    (directory / "methods").mkdir(parents=True, exist_ok=True)
    for text in (DIVERGING, FAILING, HEALTHY):
        method = text.split()[1]
        (directory / "methods" / f"{method}.yaml").write_text(textwrap.dedent(text))
    path = directory / f"{name}.yaml"
    text = SWEEP.format(
        name=name,
        methods=", ".join(methods),
        seed=seed,
        trials_per_method=trials_per_method,
        epochs=epochs,
        confirm=confirm,
    )
    path.write_text(textwrap.dedent(text))
    return path


def runs_of(uri: str, name: str):
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=[name])
    return runs[runs["tags.peftune.role"] == "sweep"], runs[runs["tags.peftune.role"] == "trial"]


class RayView(tune.Callback):
    """What Ray itself says of each trial: starts, final state and its number of failures."""

    def __init__(self):
        self.started, self.failures, self.ended = [], {}, {}

    def on_trial_start(self, iteration, trials, trial, **info):
        self.started.append(trial.trial_id)

    def on_trial_complete(self, iteration, trials, trial, **info):
        self.failures[trial.trial_id], self.ended[trial.trial_id] = trial.num_failures, "complete"

    def on_trial_error(self, iteration, trials, trial, **info):
        self.failures[trial.trial_id], self.ended[trial.trial_id] = trial.num_failures, "error"


# ----------------------------------------------------------------------------- fast: the rules themselves


def test_divergence_is_a_non_finite_loss_or_one_grown_past_the_bound():
    guard = DivergenceGuard(TrainConfig(method="frozen", tasks=["sst"]), every=16)
    assert guard.check(torch.tensor(2.0 * 16), 16, 0, 0, 15) == 2.0  # the first look is the reference
    assert guard.check(torch.tensor(19.0 * 16), 16, 0, 16, 31) == 19.0  # below 10 x 2
    with pytest.raises(TrainingDiverged, match="grew past"):
        guard.check(torch.tensor(21.0 * 16), 16, 0, 32, 47)
    small_start = DivergenceGuard(TrainConfig(method="frozen", tasks=["sst"]), reference=0.01)
    assert small_start.check(torch.tensor(9.0), 1, 0, 0, 0) == 9.0  # a start near 0 is floored at 1.0
    for bad in (math.nan, math.inf):
        with pytest.raises(TrainingDiverged, match="loss is"):
            guard.check(torch.tensor(bad), 16, 1, 0, 15)


@pytest.mark.parametrize(
    ("statuses", "status"),
    [
        (["completed", "early_stopped", "diverged"], "completed"),
        (["completed", "failed"], "completed_with_failures"),
        (["failed", "failed"], "failed"),
        ([], "completed"),
    ],
)
def test_sweep_status_tells_failures_apart(statuses, status):
    trials = [type("T", (), {"status": s})() for s in statuses]
    assert orchestrator.sweep_status(trials) == status


def test_exit_codes():
    assert sweep_command.exit_code("completed") == 0 and sweep_command.exit_code("interrupted") == 3
    assert sweep_command.exit_code("completed_with_failures") == 4
    assert sweep_command.exit_code("completed_with_failures", allow_failures=True) == 0
    assert sweep_command.exit_code("failed", allow_failures=True) == 4  # never all


# ----------------------------------------------------------------------------- real sweeps


@pytest.fixture(scope="module")
def local_ray():
    start_local_ray()
    yield
    ray.shutdown()


@pytest.mark.slow
def test_diverged_trials_are_results_failed_ones_make_the_sweep_fail(local_ray, tmp_path, tiny_data_dir, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    storage = tmp_path / "ray_results"
    # seed 1 proposes top_k, frozen, bitfit (Optuna samples at random before its 10 startup trials)
    path = write_definition(
        tmp_path / "defs", "faulty", ["frozen", "top_k", "bitfit"], trials_per_method=1, epochs=1, seed=1
    )
    spec = spaces.load_sweep(path)
    view = RayView()
    result = orchestrator.run_sweep(spec, tiny_data_dir, uri, storage_path=storage, callbacks=[view])

    parents, children = runs_of(uri, "faulty")
    assert len(parents) == 1 and len(children) == 3 and children["tags.peftune.trial_id"].is_unique
    assert set(children["tags.peftune.trial_id"]) == set(view.ended)  # every Ray trial exactly once
    by_method = children.groupby("params.method")["tags.peftune.status"].agg(set).to_dict()
    assert by_method == {"frozen": {"diverged"}, "top_k": {"failed"}, "bitfit": {"completed"}}, by_method
    assert children["status"].isin(["FINISHED", "FAILED"]).all()  # every run closed
    for _, run in children.iterrows():
        trial_id, status = run["tags.peftune.trial_id"], run["tags.peftune.status"]
        if status == "diverged":  # a result: never retried, its reason recorded
            assert view.ended[trial_id] == "complete" and view.failures[trial_id] == 0
            assert view.started.count(trial_id) == 1
            assert "lr 10 may be too high" in run["tags.peftune.error"] and run["status"] == "FINISHED"
            assert pd_missing(run.get("tags.peftune.retries"))
        if status == "failed":  # retried once by max_failures: 1; the tag agrees with Ray
            assert view.ended[trial_id] == "error" and view.failures[trial_id] == 2
            assert run["tags.peftune.retries"] == "1"

    # some trials failed: the sweep says so, on the result, the parent run and in its exit code
    assert result.status == "completed_with_failures"
    assert parents.iloc[0]["tags.peftune.status"] == "completed_with_failures"
    assert parents.iloc[0]["status"] == "FINISHED"
    assert "trial(s) failed" in result.summary()
    assert sweep_command.exit_code(result.status) == 4

    # a re-run does not run the diverged trials again (Ray retries the failed ones: resume_errored)
    again_view = RayView()
    again = orchestrator.run_sweep(spec, tiny_data_dir, uri, storage_path=storage, callbacks=[again_view])
    diverged = set(children[children["tags.peftune.status"] == "diverged"]["tags.peftune.trial_id"])
    assert diverged and not diverged & set(again_view.started)
    assert again.status == "completed_with_failures" and again.num_trials == 3

    # the same Tune state with another tracking store: refused up front, naming both places, nothing created
    other = tmp_path / "other" / "mlflow.db"
    with pytest.raises(ValueError, match="no record in") as refused:
        orchestrator.run_sweep(spec, tiny_data_dir, f"sqlite:///{other}", storage_path=storage)
    assert str(storage / "faulty") in str(refused.value) and str(other) in str(refused.value)
    assert "--tracking-uri" in str(refused.value) and "--name" in str(refused.value)
    assert not other.exists()
    argv = [
        "--data-dir",
        str(tiny_data_dir),
        "--tracking-uri",
        f"sqlite:///{other}",
        "--storage-path",
        str(storage),
    ]
    # the command line refuses top_k's k = 8 before anything else: its definition names the sweep without it
    fitting = write_definition(
        tmp_path / "fitting", "faulty", ["frozen", "bitfit"], trials_per_method=1, epochs=1, seed=1
    )
    capsys.readouterr()
    assert sweep_command.job_main(str(fitting), "a test job", argv=argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no record in" in err[0] and not other.exists()


def pd_missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


STOPS = {  # how the driver is stopped, and in which phase
    "ctrl-c": ((signal.SIGINT, signal.SIGINT), "search"),
    "sigterm": ((signal.SIGTERM,), "search"),
    "sigterm-in-confirmation": ((signal.SIGTERM,), "confirmation"),
    "sigterm-twice": ((signal.SIGTERM, signal.SIGTERM), "search"),  # issue 34: the second one made it exit 143
}
LONG_STOPS = {"sigterm"}  # the long tier: in CI, ctrl-c and sigterm-twice stop the search


@pytest.mark.slow
@pytest.mark.parametrize("stop", [pytest.param(s, marks=[pytest.mark.long] if s in LONG_STOPS else []) for s in STOPS])
def test_a_stopped_driver_closes_every_run_as_interrupted(tmp_path, tiny_data_dir, stop, request):
    """A double Ctrl-C, or the SIGTERM of `ray job stop` (in the search or in the confirmation that follows it):
    the sweep is interrupted (exit 3, resumable), not failed."""
    signals, phase = STOPS[stop]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    samples, confirm = 4, NO_CONFIRMATION
    if phase == "confirmation":  # a short search, then two seeds of its best, recorded on a tracking server as
        # under `ray job submit` (with SQLite the old bug hid)
        samples, confirm = 2, "{contenders: 0, anchors: false, top_k: 1, seeds: 2}"
        server = MlflowServer(tmp_path)
        server.first_start()
        request.addfinalizer(server.kill)
        uri = server.uri
    path = write_definition(
        tmp_path / "defs", "twice", ["bitfit"], trials_per_method=samples, epochs=3, confirm=confirm
    )
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    # -v: the line per trial epoch (a trial mid-way through) is a debug line; the console's are per finished trial
    command = [sys.executable, "-m", "peftune.cli.commands", "-v", "sweep", str(path), "--data-dir", str(tiny_data_dir)]
    command += ["--tracking-uri", uri, "--storage-path", str(tmp_path / "ray_results")]
    command += ["--reports-dir", str(tmp_path / "reports")]
    process = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    started, output = threading.Event(), []

    def read():
        in_phase = phase == "search"
        for line in process.stdout:
            output.append(line)
            in_phase = in_phase or "confirmation:" in line
            if in_phase and "epoch 1/3" in line and "peftune.tracking" in line:  # a trial is mid-way through
                started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert started.wait(600), "".join(output[-40:])
        for i, number in enumerate(signals):
            if i:
                threading.Event().wait(1.0)  # Tune is winding down the experiment: the second Ctrl-C lands there
            process.send_signal(number)
        code = process.wait(300)
    finally:
        if process.poll() is None:
            process.kill()
    reader.join(10)
    log = "".join(output)
    assert code == 3, log[-3000:]

    parents, children = runs_of(uri, "twice")
    assert len(parents) == 1 and parents.iloc[0]["tags.peftune.status"] == "interrupted", log[-3000:]
    assert parents.iloc[0]["status"] == "KILLED"
    assert len(children) >= 1 and children["tags.peftune.trial_id"].is_unique
    assert not (children["status"] == "RUNNING").any(), children[["tags.peftune.trial_id", "status"]]


# ----------------------------------------------------------------------------- a tracking-server outage


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """A real ``mlflow server`` on 127.0.0.1 with a SQLite store: killed (SIGKILL) and started again at will."""

    def __init__(self, directory: Path):
        self.directory, self.port = directory, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.process = None
        self.starts = 0

    def __getstate__(self):  # Tune pickles the callbacks with its state: the process stays here
        return {k: v for k, v in self.__dict__.items() if k != "process"}

    def start(self) -> None:
        command = [str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1"]
        command += ["--port", str(self.port), "--workers", "1"]
        command += ["--backend-store-uri", f"sqlite:///{self.directory / 'server.db'}"]
        command += ["--artifacts-destination", str(self.directory / "artifacts")]
        log = (self.directory / f"server-{self.starts}.log").open("w")
        self.process = subprocess.Popen(
            command, cwd=self.directory, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.starts += 1

    def wait_up(self, timeout: float = 180) -> None:
        import http.client
        import urllib.request

        pause = threading.Event()
        for _ in range(int(timeout * 2)):
            if self.process.poll() is not None:  # it could not serve (e.g. another process took the port)
                break
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (OSError, http.client.HTTPException):
                pause.wait(0.5)
        log = (self.directory / f"server-{self.starts - 1}.log").read_text()[-2000:]
        raise RuntimeError(f"mlflow server did not start on port {self.port}: {log}")

    def first_start(self, attempts: int = 3) -> None:
        """Start on a free port; another on a new port if the first was taken meanwhile (nothing depends on it yet)."""
        for attempt in range(attempts):
            self.start()
            try:
                return self.wait_up()
            except RuntimeError:
                self.kill()
                if attempt == attempts - 1:
                    raise
                self.port = free_port()
                self.uri = f"http://127.0.0.1:{self.port}"
                self.starts = 0

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)  # the server and its workers, as a crash would
            self.process.wait(30)


class Outage(tune.Callback):
    """Kills the tracking server at the first trial result and starts it again ``down_for`` results later.

    ``lags``: per result, seconds from the trial's report (Ray's ``timestamp``, whole seconds) to this callback,
    which runs after the driver's MLflow logger: what a write held the trial up by, rounding included."""

    def __init__(self, server: MlflowServer, down_for: int):
        self.server, self.down_for = server, down_for
        self.results, self.while_down = 0, 0
        self.lags: list[float] = []

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self.lags.append(time.time() - result["timestamp"])
        self.results += 1
        if self.results == 1:
            self.server.kill()
        elif self.server.starts == 1:
            self.while_down += 1  # Ray's trials go on reporting while MLflow is down
            if self.while_down == self.down_for:
                self.server.start()  # no waiting: the trials go on while it comes up


@pytest.mark.long
@pytest.mark.slow
def test_a_tracking_server_outage_stops_no_trial_and_loses_or_duplicates_nothing(
    local_ray, tmp_path, tiny_data_dir, monkeypatch, caplog
):
    for key in orchestrator.MLFLOW_FAIL_FAST:  # the driver's own bound on MLflow's retries is what is tested
        monkeypatch.delenv(key, raising=False)
    caplog.set_level(logging.WARNING, logger="peftune.tracking")
    server = MlflowServer(tmp_path)
    try:
        server.first_start()
        path = write_definition(tmp_path / "defs", "outage", ["bitfit"], trials_per_method=3, epochs=2)
        storage = tmp_path / "ray_results"
        view, outage = RayView(), Outage(server, down_for=3)
        result = orchestrator.run_sweep(
            spaces.load_sweep(path), tiny_data_dir, server.uri, storage_path=storage, callbacks=[view, outage]
        )
        assert server.starts == 2 and outage.while_down >= 3  # the trials reported on through the outage
        # no trial waited on a write: every result reached the driver's callbacks within a few seconds ...
        assert max(outage.lags) < 5, outage.lags
        # ... and no write sat in MLflow's own retries for long before the buffer took it back
        attempts = [r.attempt_s for r in caplog.records if hasattr(r, "attempt_s")]
        assert attempts and max(attempts) < 10, attempts
        print(f"lag {max(outage.lags):.1f}s at most; {len(attempts)} failed writes, {max(attempts):.1f}s at most")
        assert result.status == "completed", result.summary()
        assert not (storage / "outage.tracking-pending.jsonl").exists()  # every write reached the server

        parents, children = runs_of(server.uri, "outage")
        assert len(parents) == 1 and parents.iloc[0]["tags.peftune.status"] == "completed"
        assert len(children) == 3 and children["tags.peftune.trial_id"].is_unique
        assert set(children["tags.peftune.trial_id"]) == set(view.ended)  # every Ray trial exactly once
        assert (children["tags.peftune.status"] == "completed").all() and (children["status"] == "FINISHED").all()
        client = mlflow.MlflowClient(server.uri)
        for run_id in children["run_id"]:
            for key in ("score", "train_loss", "sst_accuracy"):  # every epoch once: none lost, none twice
                assert sorted(m.step for m in client.get_metric_history(run_id, key)) == [1, 2], key
            assert len(client.get_metric_history(run_id, "trainable_params_per_task")) == 1
            assert len(client.get_metric_history(run_id, "best_score")) == 1
    finally:
        server.kill()


@pytest.mark.slow
def test_writes_pending_at_the_end_stay_on_disk_and_are_replayed_exactly_once(tmp_path, monkeypatch):
    from peftune.record.writer import SweepRecord, TrialWrites

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    server = MlflowServer(tmp_path)
    try:
        server.first_start()
        client = mlflow.MlflowClient(server.uri)
        experiment_id = client.create_experiment("pending")
        parent = client.create_run(experiment_id, tags={"peftune.role": "sweep", "peftune.sweep": "pending"})
        record = SweepRecord(server.uri, experiment_id, parent.info.run_id, resumed=False)
        server.kill()

        path = tmp_path / "state" / "pending.tracking-pending.jsonl"
        buffer = TrialWrites(record, path)
        buffer.put(
            "trial_run", trial_id="t1", run_name="bitfit-t1", method="bitfit", sweep="pending", params={"lr": "1"}
        )
        for epoch in (1, 2):
            buffer.put("metrics", trial_id="t1", metrics=[("score", 0.1 * epoch, 1000 + epoch, epoch)])
        best = [("best_epoch", 2.0, 1003, 0), ("best_score", 0.2, 1003, 0)]  # as the driver keeps them
        buffer.put("finish", trial_id="t1", status="completed", error=None, retries=0, best=best)
        assert not buffer.flush(2.0) and buffer.pending() == 4 and buffer.failures >= 1  # the server is down
        buffer.stop()
        assert len(path.read_text().splitlines()) == 4  # kept on disk for the next run

        server.start()
        server.wait_up()
        assert TrialWrites(record, path).flush(120) and not path.exists()  # replayed in order, then forgotten

        # replayed again (as if the driver died before noting them applied): still exactly once
        lines = [
            '{"seq": 1, "op": "trial_run", "trial_id": "t1", "run_name": "bitfit-t1", "method": "bitfit", '
            '"sweep": "pending", "params": {"lr": "1"}}',
            '{"seq": 2, "op": "metrics", "trial_id": "t1", "metrics": [["score", 0.1, 1001, 1]]}',
            '{"seq": 3, "op": "finish", "trial_id": "t1", "status": "completed", "error": null, "retries": 0, '
            '"best": [["best_epoch", 2.0, 1003, 0], ["best_score", 0.2, 1003, 0]]}',
            '{"seq": 4, "op": "metrics", "trial_id": "t1", "metr',  # a line the driver did not finish writing
        ]
        path.write_text("\n".join(lines))
        assert TrialWrites(record, path).flush(120)

        runs = client.search_runs([experiment_id], filter_string="tags.`peftune.trial_id` = 't1'")
        assert len(runs) == 1 and runs[0].data.tags["peftune.status"] == "completed"
        assert runs[0].data.tags["mlflow.parentRunId"] == parent.info.run_id
        run_id = runs[0].info.run_id
        assert sorted(m.step for m in client.get_metric_history(run_id, "score")) == [1, 2]
        assert len(client.get_metric_history(run_id, "best_score")) == 1 and runs[0].info.status == "FINISHED"
    finally:
        server.kill()


def test_pending_writes_of_a_sweep_whose_ray_state_is_gone_are_set_aside_not_replayed(tmp_path):
    from peftune.record.tracking_buffer import pending_path, set_aside_stale

    path = pending_path(str(tmp_path), "gone")
    path.write_text('{"seq": 1, "op": "tags", "trial_id": "t1", "tags": {}}\n')
    path.with_name(path.name + ".applied").write_text("0")
    set_aside_stale(path)
    assert not path.exists() and not path.with_name(path.name + ".applied").exists()
    (aside,) = tmp_path.glob("gone.tracking-pending.jsonl.stale-*")
    assert "trial_id" in aside.read_text()
