"""What a sweep prints: the lines a person follows, not the libraries' own chatter.

By default a sweep prints, per phase, a progress line with the phase's done / total, the elapsed time, an
estimate of what is left and the best score per method so far: at the first finished trial, at each tenth of
the phase, at a failure, at its end and at least once a minute between (every trial's with ``--verbose``);
the confirmation's rounds and decisions (``peftune.sweep.confirm``), warnings, and at the end where to look. Ray
Tune's per-trial status tables (thousands of lines for the cpu job) come back with ``--verbose``; MLflow's
per-run links and download bars are off unless the user sets them (``quiet_libraries``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterator

import optuna
from ray import tune

from peftune.base import record_names

log = logging.getLogger(__name__)

# MLflow prints a run's and its experiment's links each time a run ends, and a progress bar per artifact read:
# 142 and 241 lines of the SST cpu job. A user's own setting wins.
QUIET_MLFLOW = {"MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}
TUNE_QUIET, TUNE_TABLES = 0, 1  # Ray Tune's ``verbose``: nothing, or its status tables
TUNE_NEW_OUTPUT = "RAY_AIR_NEW_OUTPUT"  # "0": Tune's older console reporter, which prints nothing at verbose 0
BEST_SHOWN = 3  # methods listed in the "best so far" part of a progress line
# a progress line is printed at least this often while trials finish, and at each tenth of the phase: a line per
# trial was 158 of the SST cpu job's 315 lines
PROGRESS_EVERY_S, PROGRESS_STEPS = 60.0, 10


def quiet_libraries() -> None:
    for key, value in QUIET_MLFLOW.items():
        os.environ.setdefault(key, value)
    # Optuna says "A new study created" once per method: the progress lines name the methods already
    optuna.logging.set_verbosity(optuna.logging.WARNING)


def quiet_tune(verbose: int) -> Callable[[], None]:
    """At ``TUNE_QUIET``, Ray Tune's own output says nothing: its newer reporter prints an experiment box, the
    results path and a TensorBoard hint at each fit whatever ``verbose`` is (9 lines a phase, "Number of trials
    9223372036854775807" for the confirmation's open-ended rounds); the older one honours 0. A user's own
    ``RAY_AIR_NEW_OUTPUT`` wins. Returns what puts the environment back: a later sweep of this process (with
    Tune's tables) and the processes it starts get Tune's default reporter."""
    if verbose != TUNE_QUIET or TUNE_NEW_OUTPUT in os.environ:
        return lambda: None
    os.environ[TUNE_NEW_OUTPUT] = "0"
    return lambda: os.environ.pop(TUNE_NEW_OUTPUT, None)


def quiet_trial_logs() -> None:
    """In a trial's process: Ray Train's "Checkpoint successfully created" line per checkpoint (107 lines of the
    SST cpu job) is kept at debug level; its warnings still show. An exit that could not be raised is dropped
    (:class:`DropUnraisedExit`)."""
    logging.getLogger("ray.train").setLevel(logging.WARNING)
    if not isinstance(sys.unraisablehook, DropUnraisedExit):  # a worker process runs many trials: install once
        sys.unraisablehook = DropUnraisedExit(sys.unraisablehook)


class DropUnraisedExit:
    """``sys.unraisablehook`` for a trial's process. Ray's SIGTERM handler raises ``SystemExit`` wherever the
    worker is; when Tune stops an idle worker while a garbage-collection callback runs, Python cannot raise it
    there and prints it as "Exception ignored in ...": a 9-line traceback in the job's console (after the
    multitask job's carried trials; at the end of an SST confirmation round) for an exit that failed to happen.
    The raylet follows its SIGTERM with a SIGKILL, so the worker ends all the same: that exit is dropped without
    a word; every other unraisable exception goes to the hook that was there."""

    def __init__(self, previous: Callable):
        self.previous = previous

    def __call__(self, unraisable) -> None:
        if not isinstance(unraisable.exc_value, SystemExit):
            self.previous(unraisable)


class SlowLoopWarnings(logging.Filter):
    """Ray Tune warns each time a step of its loop (a callback, a scheduler's decision, a result's processing) took
    over half a second, "which may be a performance bottleneck": on a busy 2-core machine that was 24 of the SST
    cpu job's 204 lines, several per slow result. The first warning of each kind shows; the others are counted and
    told in one line when the sweep ends (:func:`slow_loop_warnings`); ``--verbose`` shows every one."""

    LOGGER = "ray.tune.utils.util"  # where Tune's ``warn_if_slow`` logs
    SECONDS = re.compile(r"(\d+(?:\.\d+)?) s\b")

    def __init__(self):
        super().__init__()
        self.seen: dict[str, int] = {}  # the warning's text without its duration -> how many times
        self.slowest = 0.0

    def filter(self, entry: logging.LogRecord) -> bool:
        text = entry.getMessage()
        if "bottleneck" not in text:
            return True
        kind = self.SECONDS.sub("N s", text)
        self.seen[kind] = self.seen.get(kind, 0) + 1
        if (took := self.SECONDS.search(text)) is not None:
            self.slowest = max(self.slowest, float(took.group(1)))
        return self.seen[kind] == 1

    def summary(self) -> str | None:
        """One line for the warnings held back; None when there were none."""
        held = sum(count - 1 for count in self.seen.values())
        if held == 0:
            return None
        return (f"Ray Tune warned {held} more time(s) that a step of its loop was slow (the slowest {self.slowest:.1f}"
                " s): the driver shared its cores; --verbose shows each warning")  # fmt: skip


@contextlib.contextmanager
def slow_loop_warnings() -> Iterator[SlowLoopWarnings]:
    """Ray Tune's slow-step warnings, the first of each kind shown and the rest told in one line at the end."""
    counted = SlowLoopWarnings()
    logger = logging.getLogger(SlowLoopWarnings.LOGGER)
    logger.addFilter(counted)
    try:
        yield counted
    finally:
        logger.removeFilter(counted)
        if (line := counted.summary()) is not None:
            log.warning(line)


def duration(seconds: float) -> str:
    """``42s``, ``7m05s``, ``1h02m``."""
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress(tune.Callback):
    """The progress line of a phase, as a trial finishes (when due: :meth:`_due`): ``search 23/70 (8 stopped
    early) 12m05s elapsed, ~25m left: lora 0.4109; best so far: full 0.4527, top_k 0.4436, lora_adapter
    0.4109``. ``total`` is a number or a callable (the confirmation learns its size as its rounds go); the
    estimate is the mean time per finished trial so far times the trials left (trials run side by side, so it
    is a wall-clock rate)."""

    def __init__(self, phase: str, total: int | Callable[[], int | None] | None, epochs: int, metric: str = "score"):
        self.phase, self.total, self.epochs, self.metric = phase, total, epochs, metric
        self.started = self.said = time.monotonic()
        self.done = self.stopped_early = self.failed = 0
        self.best: dict[str, float] = {}

    def _total(self) -> int | None:
        return self.total() if callable(self.total) else self.total

    def on_trial_complete(self, iteration, trials, trial, **info):
        result = trial.last_result or {}
        method = (trial.config or {}).get("method", "?")
        score = result.get(self.metric)
        self.done += 1
        if int(result.get("epoch", 0)) < self.epochs:  # ASHA stopped it at a rung
            self.stopped_early += 1
        if isinstance(score, (int, float)) and math.isfinite(score):
            self.best[method] = max(score, self.best.get(method, -math.inf))
        self._line(f"{method} {score:.4f}" if isinstance(score, (int, float)) else f"{method} (no score)")

    def on_trial_error(self, iteration, trials, trial, **info):
        self.done += 1
        self.failed += 1
        self._line(f"{(trial.config or {}).get('method', '?')} {record_names.FAILED}", failed=True)

    def _due(self, now: float, total: int | None, failed: bool) -> bool:
        """Whether this trial's line is printed (at info level; the others at debug): see the module docstring."""
        if failed or self.done == 1 or now - self.said >= PROGRESS_EVERY_S:
            return True
        if not total:
            return False
        tenth = self.done * PROGRESS_STEPS // total  # the step this trial reached; a new one is due
        return self.done >= total or tenth > (self.done - 1) * PROGRESS_STEPS // total

    def _line(self, what: str, failed: bool = False) -> None:
        now = time.monotonic()
        elapsed = now - self.started
        total = self._total()
        due = self._due(now, total, failed)
        if due:
            self.said = now
        count = f"{self.done}/{total}" if total else f"{self.done}"
        notes = [
            f"{n} {w}" for n, w in ((self.stopped_early, "stopped early"), (self.failed, record_names.FAILED)) if n
        ]
        left = ""
        if total and total > self.done:
            left = f", ~{duration(elapsed / self.done * (total - self.done))} left"
        best = sorted(self.best.items(), key=lambda kv: -kv[1])[:BEST_SHOWN]
        shown = ", ".join(f"{m} {s:.4f}" for m, s in best)
        log.log(
            logging.INFO if due else logging.DEBUG,
            "%s %s%s %s elapsed%s: %s%s",
            self.phase,
            count,
            f" ({', '.join(notes)})" if notes else "",
            duration(elapsed),
            left,
            what,
            f"; best so far: {shown}" if shown else "",
        )
