"""The sweep driver's own cost as a sweep grows: CPU seconds and MLflow calls per trial, window by window.

The real driver (``orchestrator.run_sweep``: the lease, the MLflow record, the per-method Optuna searchers and ASHA, the
trial logger and its write buffer, the closing reads) runs the shipped SST sweep (budget ``cpu``, no confirmation)
on real Ray Tune, Optuna and MLflow with a throwaway SQLite store. Through ``orchestrator.SweepHooks`` its trials run
:func:`cheap_trainable`, which trains nothing and reports at once what ``worker.trainable`` reports, with a score
that depends on the configuration (so the searchers and schedulers do their real work), and the write buffer's
operations are timed. Measured in the driver process only, per window of ``--window`` finished trials: CPU seconds
per trial and per result, MLflow calls per trial (every public ``MlflowClient`` method, counted in this process),
the writes still queued; then the end of the sweep, and the confirmation's reads on copies of the record taken at
``--record-sizes`` trials. ``--profile`` writes cProfiles of the first and the last window to ``--out``.

Run: ``python -m peftune.benchmarks.driver --trials 2800 [--out DIR]`` (``--data-dir`` or ``PEFTUNE_DATA_DIR``); a
measurement, not a test. What it measured: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import functools
import inspect
import json
import math
import os
import pstats
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

from ray import tune

from peftune.base import record_names
from peftune.inputs.tasks import get_task
from peftune.record import legacy, reader, trial_logger, writer
from peftune.sweep import confirm, console, orchestrator, spaces, worker

SWEEP_NAME = "driver_bench"
WINDOW = 200
RECORD_SIZES = (200, 1400, 2800)
BACKBONE_PARAMS = 22_713_216  # all-minilm-l6-v2's encoder


# ----------------------------------------------------------------------------- the cheap trainable


def synthetic_score(method: str, sampled: dict, seed: int) -> float:
    """A configuration's final selection score: best near lr 1e-3, a per-method offset, a little seed noise."""
    lr = float(sampled.get("lr") or 1e-3)
    offset = (zlib.crc32(method.encode()) % 7) * 0.01
    noise = random.Random(f"{method}|{sorted(sampled.items())}|{seed}").gauss(0.0, 0.01)
    return 0.25 + offset + 0.15 * math.exp(-((math.log10(lr) + 3.0) ** 2)) + noise


def synthetic_counts(method: str) -> dict[str, float]:
    """Parameter counts in the keys of ``params.ParameterCounts.summary`` (a fixed size per method)."""
    trainable = 10 ** (3 + zlib.crc32(method.encode()) % 4)
    pct = 100.0 * trainable / BACKBONE_PARAMS
    return {
        record_names.BACKBONE_PARAMS: BACKBONE_PARAMS,
        record_names.TRAINABLE_PER_TASK: trainable,
        record_names.TRAINABLE_PER_TASK_PCT: pct,
        record_names.STORED_PARAMS: trainable,
        record_names.STORED_PARAMS_PCT: pct,
        record_names.CHECKPOINT_PARAMS: trainable,
        record_names.HEAD_PARAMS: 1925,
    }


def evaluated(task_metrics: list[str], split: str, score: float) -> dict[str, float]:
    """What ``train.evaluate_splits`` returns for a search trial (one split, the one it is judged on)."""
    return {
        **dict.fromkeys(task_metrics, score),
        record_names.SCORE: score,
        record_names.split_metric(split, record_names.SCORE): score,
    }


def cheap_trainable(config: dict, settings: worker.TrialSettings, steps_per_run: int) -> None:
    """A trial that trains nothing and reports at once what ``worker.trainable`` would (``run_trial``'s reports)."""
    console.quiet_trial_logs()
    settings = settings.for_trial(config)
    method, sampled = settings.split(config)
    train_config = settings.train_config(method, sampled)
    granted = worker.granted_resources()
    tasks = [get_task(t).metric_name for t in train_config.tasks]
    epochs, batch = train_config.epochs, train_config.batch_size
    steps_per_epoch = max(1, steps_per_run // epochs)
    examples_per_run, final = steps_per_run * batch, synthetic_score(method, sampled, settings.seed)
    split = train_config.eval_splits[0]

    def progress(steps: int) -> dict:
        seen = steps * batch
        return {"steps": steps, "examples_seen": seen, "tokens_seen": seen * 24, "progress": seen / examples_per_run}

    for epoch in range(epochs):
        for fraction in sorted(train_config.report_fractions):  # a data-fidelity rung within this epoch
            if epoch / epochs < fraction < (epoch + 1) / epochs:
                steps = round(fraction * steps_per_run)
                timings = {"train_time_s": 0.01 * steps, "eval_total_s": 0.001 * steps, "startup_s": 0.5}
                score = final * (0.6 + 0.4 * fraction)
                result = {record_names.EPOCH: epoch, **evaluated(tasks, split, score), **progress(steps), **timings}
                tune.report({**result, record_names.PARTIAL: True, **granted})
        steps = (epoch + 1) * steps_per_epoch
        score = final * (0.6 + 0.4 * (epoch + 1) / epochs)
        result = {
            record_names.EPOCH: epoch + 1,
            **evaluated(tasks, split, score),
            "train_loss": 1.5 - score,
            "epoch_time_s": 0.01 * steps_per_epoch,
            "train_time_s": 0.01 * steps,
            "tokens_per_s": 2400.0,
            **progress(steps),
            "precision": "fp32",
            "startup_s": 0.5,
            "eval_time_s": 0.05,
            "eval_total_s": 0.05 * (epoch + 1),
            "checkpoint_time_s": 0.001 * epoch,
            **synthetic_counts(method),
            **granted,
        }
        with tempfile.TemporaryDirectory(prefix="peftune-bench-ckpt-") as directory:
            (Path(directory) / "trainable.safetensors").write_bytes(b"\0" * 4096)
            (Path(directory) / "peftune.json").write_text(json.dumps({"method": method, "epoch": epoch + 1}))
            tune.report(result, checkpoint=tune.Checkpoint.from_directory(directory))


def cheap_trainable_for(steps_per_run: int):
    """The trainable ``orchestrator.SweepHooks`` runs in place of ``worker.trainable``: :func:`cheap_trainable` (the
    sweep's data, ``prepared``, unused)."""

    def trainable(config: dict, prepared, settings: worker.TrialSettings) -> None:
        cheap_trainable(config, settings, steps_per_run)

    return trainable


# ----------------------------------------------------------------------------- counting


class MlflowCalls:
    """Counts the calls of every public ``MlflowClient`` method in this process (outermost ones only)."""

    def __init__(self):
        self.calls: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._inside = threading.local()
        self._originals: dict[str, object] = {}

    def install(self) -> None:
        MlflowClient = reader.client_class()  # noqa: N806  the class whose methods are counted

        for name, function in list(vars(MlflowClient).items()):
            if inspect.isfunction(function) and not name.startswith("_"):
                self._originals[name] = function
                setattr(MlflowClient, name, self._counted(name, function))

    def uninstall(self) -> None:
        MlflowClient = reader.client_class()  # noqa: N806

        for name, function in self._originals.items():
            setattr(MlflowClient, name, function)
        self._originals.clear()

    def _counted(self, name: str, function):
        @functools.wraps(function)
        def counted(*args, **kwargs):
            if getattr(self._inside, "depth", 0) == 0:
                with self._lock:
                    self.calls[name] += 1
            self._inside.depth = getattr(self._inside, "depth", 0) + 1
            try:
                return function(*args, **kwargs)
            finally:
                self._inside.depth -= 1

        return counted

    def snapshot(self) -> Counter[str]:
        with self._lock:
            return Counter(self.calls)


class BufferOps:
    """The write buffer thread's CPU seconds and count per operation (the buffer's ``around_apply``), and a cProfile
    of that thread while ``profiler`` is set."""

    def __init__(self):
        self.seconds: Counter[str] = Counter()
        self.count: Counter[str] = Counter()
        self.profiler: cProfile.Profile | None = None
        self._lock = threading.Lock()

    def timed(self, item: dict, apply) -> None:
        started, profiler = time.thread_time(), self.profiler
        try:
            if profiler is None:
                apply()
            else:
                profiler.runcall(apply)
        finally:
            with self._lock:
                self.seconds[item["op"]] += time.thread_time() - started
                self.count[item["op"]] += 1

    def snapshot(self) -> tuple[Counter, Counter]:
        with self._lock:
            return Counter(self.seconds), Counter(self.count)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclasses.dataclass
class Mark:
    """The driver's counters when ``finished`` trials had finished."""

    finished: int
    results: int
    cpu_s: float
    wall_s: float
    calls: Counter
    pending: int
    buffer_s: Counter
    buffer_ops: Counter


class Meter(tune.Callback):
    """Installed among the sweep's callbacks: marks the counters at the first trial's start and every ``window``
    finished trials; copies the record at ``snapshot_at`` finished trials; profiles the first and last window."""

    def __init__(
        self,
        window: int,
        trials: int,
        calls: MlflowCalls,
        ops: BufferOps,
        logger_holder: dict,
        snapshot_at: dict[int, Path],
        db: Path,
        profile_dir: Path | None,
    ):
        self.window, self.trials, self.calls, self.ops = window, trials, calls, ops
        self.logger_holder, self.snapshot_at, self.db = logger_holder, snapshot_at, db
        self.profile_dir = profile_dir
        self.results = self.finished = 0
        self.marks: list[Mark] = []  # at the first trial's start, then every window
        self.ended: Mark | None = None  # when Tune's experiment ended (the sweep's closing follows)
        self.copies: list[subprocess.Popen] = []
        self.profiler: cProfile.Profile | None = None
        self.profiled: dict[str, int] = {}  # name -> finished trials at its start
        last = (trials // window - 1) * window
        self.profile_starts = {0: "first", last: "last"} if profile_dir is not None and last > 0 else {}

    def mark(self) -> Mark:
        logger = self.logger_holder.get("logger")
        pending = logger.buffer.pending() if logger is not None and logger.buffer is not None else 0
        seconds, ops = self.ops.snapshot()
        return Mark(
            self.finished, self.results, cpu_seconds(), time.monotonic(), self.calls.snapshot(), pending, seconds, ops
        )

    def on_trial_start(self, iteration, trials, trial, **info):
        if not self.marks:
            self.marks.append(self.mark())
            self._profile()

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self.results += 1

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._finished()

    def on_trial_error(self, iteration, trials, trial, **info):
        self._finished()

    def _finished(self) -> None:
        self.finished += 1
        if self.finished % self.window == 0:
            self._stop_profile()
            self.marks.append(self.mark())
            self._profile()
        if self.finished in self.snapshot_at:  # SQLite's online backup, in a child process: not the driver's CPU
            script = "import sqlite3, sys; sqlite3.connect(sys.argv[1]).backup(sqlite3.connect(sys.argv[2]))"
            target = self.snapshot_at[self.finished]
            self.copies.append(subprocess.Popen([sys.executable, "-c", script, str(self.db), str(target)]))

    def on_experiment_end(self, trials, **info):
        self.ended = self.mark()

    def _profile(self) -> None:
        name = self.profile_starts.get(self.finished) if self.marks else None
        if name is None or self.profiler is not None:
            return
        self.profiler, self.ops.profiler = cProfile.Profile(), cProfile.Profile()
        self.profiled[name] = self.finished
        self.profiler.enable()

    def _stop_profile(self) -> None:
        if self.profiler is None:
            return
        self.profiler.disable()
        name = next(n for n, start in self.profiled.items() if start == self.finished - self.window)
        self.profiler.dump_stats(self.profile_dir / f"{name}.prof")
        self.ops.profiler.dump_stats(self.profile_dir / f"{name}-buffer.prof")
        self.profiler = self.ops.profiler = None

    def wait_for_copies(self) -> None:
        for copy in self.copies:
            copy.wait()


# ----------------------------------------------------------------------------- the sweep


def bench_definition(trials: int, confirmation: bool = False, epochs: int = 3) -> spaces.SweepDefinition:
    """The shipped SST sweep at its cpu budget, ``trials`` search trials of ``epochs`` epochs; without
    ``confirmation``, no confirmation (``confirm.seeds: 0``)."""
    definition = spaces.load_sweep(spaces.resolve_sweep_path("sst_tuning"), budget="cpu")
    per_method = trials // len(definition.methods)  # main() asks for a multiple of the methods
    definition = definition.with_overrides(name=SWEEP_NAME, trials_per_method=per_method, epochs=epochs)
    if confirmation:
        return definition
    return dataclasses.replace(definition, confirm=dataclasses.replace(definition.confirm, seeds=0))


def run_bench_sweep(trials: int, work: Path, data_dir: Path, *, window: int, record_sizes, profile_dir, prepared):
    """Run the sweep with the meter installed; returns (meter, the mark at ``run_sweep``'s return, its result)."""
    definition = bench_definition(trials)
    db = work / "mlflow.db"
    calls, ops, holder = MlflowCalls(), BufferOps(), {}
    snapshot_at = {n: work / f"record-{n}.db" for n in record_sizes if n < trials}
    meter = Meter(window, trials, calls, ops, holder, snapshot_at, db, profile_dir)

    def watching(logger) -> None:  # the sweep's trial logger: the meter reads its queue; its writes are timed
        holder["logger"] = logger
        logger.buffer.around_apply = ops.timed

    trainable = cheap_trainable_for(orchestrator.steps_per_run(definition, prepared))
    calls.install()
    try:
        result = orchestrator.run_sweep(
            definition,
            data_dir,
            f"sqlite:///{db}",
            storage_path=work / "ray_results",
            reports_dir=work / "reports",
            callbacks=[meter],
            prepared=prepared,
            hooks=orchestrator.SweepHooks(trainable=trainable, on_trial_logger=watching),
        )
        returned = meter.mark()  # the end of the sweep: its flush and closing reads
    finally:
        calls.uninstall()
    meter.wait_for_copies()
    if trials in record_sizes:
        shutil.copy(db, work / f"record-{trials}.db")
    return meter, returned, result


# ----------------------------------------------------------------------------- the confirmation's reads


def fake_trial(trial_id: str, config: dict, result: dict | None = None) -> SimpleNamespace:
    """What ``TrialLogger`` reads of a Tune trial."""
    return SimpleNamespace(
        trial_id=trial_id, config=config, last_result=result, num_failures=0, path=None, error_file=None
    )


def write_confirmation_runs(logger, configs: list[dict], examples: dict, tasks: list[str], epochs: int) -> None:
    """Completed confirmation runs of ``configs`` (``confirm.trial_config``) through the real ``TrialLogger``, each
    with one final result and synthetic decision and dev predictions (right at about its search score)."""
    metric_names = [get_task(t).metric_name for t in tasks]
    for config in configs:
        marks = config["peftune"]
        trial = fake_trial(f"cf_{zlib.crc32(json.dumps(config, sort_keys=True).encode()):08x}", config)
        method = config["method"]
        score = synthetic_score(method, config[method], int(marks["seed"]))
        rng = random.Random(f"{marks['config_key']}|{marks['seed']}")
        predictions = {
            split: {
                task: [label if rng.random() < score + 0.3 else (int(label) + 1) % 5 for label in labels]
                for task, (_, labels) in by_task.items()
            }
            for split, by_task in examples.items()
        }
        result = {
            record_names.EPOCH: epochs,
            **evaluated(metric_names, record_names.SELECTION, score),
            **{
                record_names.split_metric(s, record_names.SCORE): score
                for s in (record_names.DECISION, record_names.DEV)
            },
            **{record_names.split_metric(record_names.DEV, m): score for m in metric_names},
            "predictions": predictions,
            **synthetic_counts(method),
        }
        logger.on_trial_start(0, [], trial)
        logger.on_trial_result(0, [], trial, result)
        trial.last_result = {k: v for k, v in result.items() if k != "predictions"}
        logger.on_trial_complete(0, [], trial)
    if not logger.flush(600):
        raise RuntimeError("the confirmation runs were not written")


def record_reads(db: Path, definition, prepared, data_dir: Path, work: Path, calls: MlflowCalls) -> dict:
    """The MLflow calls of the reads that scale with the record, on a copy of it (see the module docstring): a
    resumed driver's (``RecordedResults.results``, ``TrialLogger.setup``), then the confirmation's opening reads
    and two rounds' reads; with the runs the record held."""
    uri = f"sqlite:///{db}"
    client = reader.client(uri)
    experiment_id = reader.find_experiment_id(client, definition.name)
    parent = reader.find_parent_run(client, experiment_id, definition.name)
    version = legacy.record_version(parent.data.tags, parent.info.run_id)
    sweep_record = writer.SweepRecord(
        uri, experiment_id, parent.info.run_id, True, tuple(writer.data_inputs(prepared)), version
    )
    settings = orchestrator.trial_settings(definition, orchestrator.steps_per_run(definition, prepared), data_dir)
    storage = tempfile.mkdtemp(prefix="confirm-", dir=work)
    logger = orchestrator.open_trial_logger(definition, sweep_record, settings, prepared, storage, exists=True)
    examples = orchestrator.split_examples(prepared)
    out: dict = {"record": db.name}

    def counted(what: str, read):
        before, cpu = calls.snapshot(), time.process_time()
        value = read()
        spent = calls.snapshot() - before
        out[what] = {"calls": sum(spent.values()), "by_method": dict(spent), "cpu_s": time.process_time() - cpu}
        return value

    calls.install()
    try:
        runs = reader.child_runs(client, experiment_id, sweep_record.parent_run_id)
        out["search_runs"] = sum(
            legacy.run_phase(r.data.tags, version, r.info.run_id) == record_names.SEARCH for r in runs
        )

        def opening():  # run_confirmation's opening: the driver's state, the candidates; then the first todo
            confirmation, first = confirm.open_confirmation(definition, sweep_record, None, trial_logger=logger,
                                                            storage=storage, verbose=0)  # fmt: skip
            confirmation.wanted = list(first)
            return confirmation, confirmation.todo(first)

        # what a resumed driver reads before its first trial, in Tune's order: the restored scheduler's refill
        # (trial_logger.RecordedResults: the logger reads every child run once, then every search run's rung
        # histories), then TrialLogger.setup (the histories of the unfinished runs it has not read yet)
        counted("resume_rungs", trial_logger.RecordedResults(sweep_record).results)
        counted("resume_logger", logger.setup)
        confirmation, todo = counted("opening", opening)
        out["confirm_runs"] = len(todo)
        for n in (1, 2):
            write_confirmation_runs(logger, todo, examples, list(definition.tasks), definition.budget.epochs)
            todo = counted(f"round_{n}", confirmation.next_round)
            out[f"round_{n}"]["seeds_added"] = len(todo or [])
            if not todo:
                break
    finally:
        calls.uninstall()
        if logger.buffer is not None:
            logger.buffer.stop()
    return out


# ----------------------------------------------------------------------------- the table


def window_rows(marks: list[Mark]) -> list[dict]:
    """One row per window: between consecutive marks."""
    rows = []
    for a, b in zip(marks[:-1], marks[1:], strict=False):
        trials, results = b.finished - a.finished, b.results - a.results
        cpu, calls = b.cpu_s - a.cpu_s, sum((b.calls - a.calls).values())
        buffer_s = b.buffer_s - a.buffer_s
        rows.append(
            {
                "from": a.finished + 1,
                "to": b.finished,
                "results": results,
                "cpu_s": cpu,
                "wall_s": b.wall_s - a.wall_s,
                "cpu_ms_per_trial": 1000 * cpu / trials,
                "cpu_ms_per_result": 1000 * cpu / max(1, results),
                "calls_per_trial": calls / trials,
                "pending": b.pending,
                "buffer_cpu_ms_per_trial": 1000 * sum(buffer_s.values()) / trials,
                "buffer_ms_per_trial_by_op": {op: 1000 * s / trials for op, s in sorted(buffer_s.items())},
                "calls_by_method": dict(b.calls - a.calls),
            }
        )
    return rows


def format_table(rows: list[dict], end: dict, confirmations: list[dict], trials: int, window: int) -> str:
    lines = [
        f"driver cost per window of {window} finished trials ({trials} trials; CPU: the driver process only)",
        f"{'trials':>11} {'results':>7} {'cpu s':>7} {'wall s':>7} {'ms/trial':>9} {'ms/result':>9} "
        f"{'mlflow/trial':>12} {'buffer ms/trial':>15} {'queued':>6}",
    ]
    for r in rows:
        lines.append(
            f"{r['from']:>5}-{r['to']:<5} {r['results']:>7} {r['cpu_s']:>7.1f} {r['wall_s']:>7.1f} "
            f"{r['cpu_ms_per_trial']:>9.1f} {r['cpu_ms_per_result']:>9.1f} {r['calls_per_trial']:>12.2f} "
            f"{r['buffer_cpu_ms_per_trial']:>15.1f} {r['pending']:>6}"
        )
    if len(rows) >= 2:
        first, last = rows[0], rows[-1]
        for key, label in (
            ("cpu_ms_per_trial", "CPU per trial"),
            ("cpu_ms_per_result", "CPU per result"),
            ("calls_per_trial", "MLflow calls per trial"),
            ("buffer_cpu_ms_per_trial", "buffer thread CPU per trial"),
            ("wall_s", "wall time per window"),
        ):
            ratio = last[key] / first[key] if first[key] else math.nan
            second = last[key] / rows[1][key] if len(rows) > 2 and rows[1][key] else math.nan
            lines.append(f"last/first {label}: {ratio:.2f} (last/second: {second:.2f})")
        ops = sorted(set(first["buffer_ms_per_trial_by_op"]) | set(last["buffer_ms_per_trial_by_op"]))
        before, after = first["buffer_ms_per_trial_by_op"], last["buffer_ms_per_trial_by_op"]
        shown = ", ".join(f"{op} {before.get(op, 0):.1f}->{after.get(op, 0):.1f}" for op in ops)
        lines.append(f"buffer thread CPU ms/trial by operation, first->last window: {shown}")
        methods = sorted(set(first["calls_by_method"]) | set(last["calls_by_method"]))
        shown = ", ".join(
            f"{m} {first['calls_by_method'].get(m, 0) / window:.2f}->{last['calls_by_method'].get(m, 0) / window:.2f}"
            for m in methods
        )
        lines.append(f"MLflow calls/trial by method, first->last window: {shown}")
    lines.append(
        f"end of sweep (flush and closing reads): {end['cpu_s']:.1f} s CPU, {end['wall_s']:.1f} s wall, "
        f"{end['calls']} MLflow calls ({', '.join(f'{k} {v}' for k, v in sorted(end['by_method'].items()))})"
    )
    if confirmations:
        lines.append("reads of the record: MLflow calls against the runs in it (a resume's; the confirmation's)")
        parts = ("resume_rungs", "resume_logger", "opening", "round_1", "round_2")
        lines.append(f"{'search runs':>11} {'confirm runs':>12} " + " ".join(f"{p:>13}" for p in parts))
        for c in confirmations:
            counts = " ".join(f"{c[p]['calls'] if p in c else '-':>13}" for p in parts)
            lines.append(f"{c['search_runs']:>11} {c['confirm_runs']:>12} {counts}")
        for c in confirmations:
            for p in parts:
                if p in c:
                    by = ", ".join(f"{k} {v}" for k, v in sorted(c[p]["by_method"].items()))
                    lines.append(f"  {c['search_runs']} search runs, {p}: {by} ({c[p]['cpu_s']:.1f} s CPU)")
    return "\n".join(lines)


def growing_functions(profile_dir: Path, window: int, suffix: str = "", top: int = 15) -> str:
    """The functions whose time per finished trial grew the most from the first to the last window's profile."""

    def per_function(path: Path) -> dict:
        stats = pstats.Stats(str(path)).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
        return {key: (nc / window, 1000 * tt / window, 1000 * ct / window) for key, (_, nc, tt, ct, _) in stats.items()}

    first = per_function(profile_dir / f"first{suffix}.prof")
    last = per_function(profile_dir / f"last{suffix}.prof")
    lines = []
    for column, label in ((2, "cumulative"), (1, "own")):
        growth = sorted(last, key=lambda k: -(last[k][column] - first.get(k, (0, 0, 0))[column]))[:top]
        lines.append(f"{label} ms per trial, first -> last window (calls per trial):")
        for key in growth:
            a, b = first.get(key, (0.0, 0.0, 0.0)), last[key]
            where = f"{_short(key[0])}:{key[1]}({key[2]})"
            lines.append(f"  {a[column]:8.2f} -> {b[column]:8.2f}  ({a[0]:.1f} -> {b[0]:.1f})  {where}")
    return "\n".join(lines)


def _short(path: str) -> str:
    for marker in ("site-packages/", "platform/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(prog="python -m peftune.benchmarks.driver", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--trials", type=int, default=2800, help="search trials (a multiple of the 14 methods and of --window)"
    )
    parser.add_argument("--window", type=int, default=WINDOW, help="finished trials per row of the table")
    parser.add_argument(
        "--record-sizes",
        default=",".join(map(str, RECORD_SIZES)),
        help="finished trials at which the confirmation's reads are measured ('' for none)",
    )
    parser.add_argument("--data-dir", default=os.environ.get("PEFTUNE_DATA_DIR"), help="the SST files (sst_tuning)")
    parser.add_argument("--out", help="a directory for the table, the windows as JSON and the profiles")
    parser.add_argument("--profile", action="store_true", help="cProfile the first and the last window (--out)")
    args = parser.parse_args(argv)
    if not args.data_dir:
        parser.error("--data-dir (or PEFTUNE_DATA_DIR) is needed")
    if args.trials < 2 * args.window or args.trials % args.window:
        parser.error(f"--trials must be a multiple of --window ({args.window}), at least two windows")
    methods = len(spaces.load_sweep(spaces.resolve_sweep_path("sst_tuning"), budget="cpu").methods)
    if args.trials % methods:
        parser.error(f"--trials must be a multiple of the sweep's {methods} methods (each runs as many trials)")
    out = Path(args.out) if args.out else None
    if args.profile and out is None:
        parser.error("--profile writes its profiles to --out")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    sizes = sorted({int(n) for n in args.record_sizes.split(",") if n.strip() and int(n) <= args.trials})
    data_dir = Path(args.data_dir)

    work = Path(tempfile.mkdtemp(prefix="peftune-bench-driver-"))
    try:
        definition = bench_definition(args.trials)
        prepared = spaces.prepare_data(definition, data_dir)
        meter, returned, result = run_bench_sweep(
            args.trials,
            work,
            data_dir,
            window=args.window,
            record_sizes=sizes,
            profile_dir=out if args.profile else None,
            prepared=prepared,
        )
        rows = window_rows(meter.marks)
        ended = meter.ended or meter.marks[-1]
        end = {
            "cpu_s": returned.cpu_s - ended.cpu_s,
            "wall_s": returned.wall_s - ended.wall_s,
            "calls": sum((returned.calls - ended.calls).values()),
            "by_method": dict(returned.calls - ended.calls),
        }
        confirmations = [
            record_reads(
                work / f"record-{n}.db", bench_definition(args.trials, True), prepared, data_dir, work, MlflowCalls()
            )
            for n in sizes
        ]
        table = f"sweep {result.status}: {result.num_trials} trials, {dict(result.statuses)}\n"
        table += format_table(rows, end, confirmations, args.trials, args.window)
        if args.profile:
            for suffix, what in (("", "the driver's main thread"), ("-buffer", "the write buffer's thread")):
                table += f"\nprofile of {what}:\n" + growing_functions(out, args.window, suffix)
        print(table, flush=True)
        if out is not None:
            (out / "table.txt").write_text(table + "\n")
            windows = {"windows": rows, "end": end, "confirmation": confirmations, "trials": args.trials}
            (out / "windows.json").write_text(json.dumps(windows, indent=1, default=str))
        return table
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
