"""The Tune callback that records a sweep's trials: one child run per trial, from the driver.

:class:`TrialLogger` turns Tune's events (a trial starts, reports, is retried, ends) into the writes of its run,
each queued in the write buffer (``writer.TrialWrites``, which makes them) and applied at once to the driver's
own state of the sweep (``peftune.record.sweep_state``); the record an earlier driver left is read once
(``peftune.record.reader``). It imports no MLflow. The record's schema: docs/design.md, "The MLflow record".
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from ray import tune

from peftune.base.errors import DiskFullError
from peftune.base.record_names import (
    CARRIED_FROM,
    COMPLETED,
    CONFIG_KEY,
    CONFIRM,
    COUNT_METRICS,
    DECISION,
    DEFAULT,
    DIVERGED,
    EARLY_STOPPED,
    EPOCH,
    ERROR,
    FAILED,
    HYPERPARAMETERS,
    PACK_SIZE,
    PACK_SIZE_RESULT,
    PARTIAL,
    PHASE,
    PRECISION,
    RETRIES,
    SCORE,
    SEARCH,
    SIZE_TAG,
    STATUS,
    TRAIN_COMMAND,
    TRAINABLE_PER_TASK,
    TRIAL_ID,
    config_key,
    param_text,
    predictions_artifact,
    predictions_csv,
    run_label,
)
from peftune.core import trial_spec
from peftune.methods.sizes import size_label
from peftune.record import legacy, reader, writer
from peftune.record.epoch_kept import improves
from peftune.record.sweep_state import SweepState

log = logging.getLogger("peftune.tracking")

EPOCH_METRICS = (
    *(SCORE, "train_loss", "epoch_time_s", "tokens_per_s", "train_time_s"),
    *("steps", "examples_seen", "tokens_seen", "progress"),  # the fidelity: steps, examples, tokens, fraction
    # where a trial's time goes besides training, and what packing trials onto a GPU must leave room for
    *("startup_s", "eval_time_s", "eval_total_s", "checkpoint_time_s", "peak_gpu_memory_mb"),
    *("granted_cpu", "granted_gpu"),  # what Ray gave the trial: the sweep's resources, as scheduled
)
# a report within an epoch (a data-fidelity rung), logged at step = examples seen: fidelity_score, ...
PARTIAL_METRICS = (SCORE, "steps", "tokens_seen", "progress", "train_time_s", "eval_total_s", "startup_s")
MAX_TAG_CHARS = 5000


def search_tags(config: dict, method: str, sampled: dict) -> dict[str, str]:
    """``peftune.phase``, ``peftune.default``, ``peftune.config_key`` from the ``"peftune"`` marks of a trial's config.

    A trial without marks (the joint search) is a search trial, not a default, keyed by its method and params.
    """
    marks = config.get("peftune") or {}
    tags = {
        PHASE: str(marks.get("phase", SEARCH)),
        DEFAULT: "true" if marks.get("default") else "false",
        CONFIG_KEY: str(marks.get("config_key") or config_key(method, sampled)),
    }
    if marks.get("carried_from"):  # a carried trial (peftune.sweep.carry): the configuration it carries down
        tags[CARRIED_FROM] = str(marks["carried_from"])
    return tags


@dataclass(frozen=True)
class RecordedResults:
    """The per-epoch results of the sweep's search trials, as the driver running it holds them: a restored scheduler
    refills its rungs from them. Pickled with the scheduler in Tune's state, so it holds only the record it names;
    the running driver's ``TrialLogger`` of that record answers (it reads an earlier driver's record once)."""

    record: writer.SweepRecord

    def results(self) -> dict[str, tuple[str, list[dict]]]:
        """Ray trial id -> (method, [{"epoch" or "progress", "score", "steps"}, ...] in the order they were reported)
        (``SweepState.rung_results``)."""
        logger = TrialLogger.driving.get(self.record.parent_run_id)
        if logger is None:
            raise RuntimeError(f"no trial logger of sweep run {self.record.parent_run_id} in this process")
        return logger.rung_results()


# ----------------------------------------------------------------------------- the Tune callback


def error_text(raw: str | None) -> str:
    """Ray's error file -> the last failure: its exception line first, then the end of its traceback."""
    if not raw:
        return "unknown error (Ray recorded no error text)"
    last = raw.split("Failure # ")[-1]
    lines = [line for line in last.splitlines() if line.strip()]
    if lines and lines[0][:1].isdigit() and "occurred at" in lines[0]:
        lines = lines[1:]
    summary = next((line.strip() for line in reversed(lines) if not line.startswith((" ", "\t"))), "")
    body = "\n".join(lines)
    room = MAX_TAG_CHARS - len(summary) - 2
    return f"{summary}\n\n{body[-room:]}" if summary else body[-MAX_TAG_CHARS:]


@dataclass
class ConfirmedPair:
    """A confirmation trial's outcome as the driver saw it end: its final status and, completed, the decision
    split's predictions of its kept epoch (the text of its ``predictions/decision.csv.gz``)."""

    status: str
    decision: str | None = None


class TrialLogger(tune.Callback):
    """Logs each trial as a child run of the sweep's parent run (see the module docstring).

    ``settings`` (``peftune.sweep.worker.TrialSettings``) turns a trial's sampled config into its
    ``TrainConfig``, as the trainable does, so the params logged are exactly what the trial trains.
    The writes go through a durable write-ahead buffer (``peftune.record.tracking_buffer``, kept at
    ``pending_path``) drained by a background thread: a tracking-server outage never holds up a trial.
    The record an earlier driver left is read once per driver (``load``): at the first Tune experiment's start,
    or at a restored scheduler's refill (``rung_results``) when that comes first.
    """

    # parent run id -> the logger that writes that sweep's record in this process (the last one made): what a
    # scheduler restored from Tune's state finds it through (``RecordedResults``)
    driving: ClassVar[dict[str, TrialLogger]] = {}

    def __init__(
        self,
        record: writer.SweepRecord,
        settings,
        task_metrics: list[str],
        pending_path: str | Path | None = None,
        examples: dict[str, dict[str, tuple[list[int], list[float]]]] | None = None,
    ):
        self.record = record
        self.settings = settings
        self.task_metrics = list(task_metrics)
        self.pending_path = pending_path
        # per split (decision, dev), per task: (example ids, labels), in the order of a trial's predictions
        self.examples = examples or {}
        self.buffer = None
        # (config key, seed) -> how each confirmation trial of this driver ended: what the confirmation decides on
        # between its rounds, instead of reading back the record it wrote (kept across Tune experiments)
        self.confirmed: dict[tuple[str, int], ConfirmedPair] = {}
        self._reset()
        TrialLogger.driving[record.parent_run_id] = self  # not an unpickled copy (__setstate__)

    def _reset(self):
        self._client = None
        self._loaded = False  # the record an earlier driver left is read (load)
        self._last_epoch: dict[str, int] = {}  # trial id -> last epoch logged
        self._counted: set[str] = set()  # trial ids whose parameter counts are logged
        self._partials: dict[str, set[int]] = {}  # trial id -> examples_seen of the rungs logged within epochs
        self._unfinished: dict[str, tuple[str, str]] = {}  # config key -> (trial id, run id) of unfinished runs
        self._predicted: dict[str, float] = {}  # trial id -> score of the epoch whose predictions are logged
        self._decision: dict[str, str] = {}  # trial id -> those predictions on the decision split (CSV text)
        self._full: DiskFullError | None = None  # a trial's write refused for space: the sweep stops on it
        # every trial run as the record holds it once the buffer drains: what the sweep decides on (SweepState)
        self.state = SweepState(self.record.parent_run_id, self.record.experiment_id, self.record.version)

    def __getstate__(self):  # Ray pickles callbacks with the experiment; the client is rebuilt in setup()
        return {
            "record": self.record,
            "settings": self.settings,
            "task_metrics": self.task_metrics,
            "pending_path": self.pending_path,
            "examples": self.examples,
        }

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.buffer = None
        self.confirmed = {}
        self._reset()

    def open_buffer(self, timeout: float = 600.0) -> None:
        """Start the write buffer, first writing what an earlier run of the sweep left pending."""
        if self.buffer is not None:
            return
        self.buffer = writer.TrialWrites(self.record, self.pending_path)
        if not self.buffer.flush(timeout):
            if self.buffer.full is not None:
                raise self.buffer.full
            raise RuntimeError(
                f"{self.buffer.pending()} MLflow write(s) left by an earlier run could not be written to "
                f"{self.record.tracking_uri} in {timeout:.0f}s; they stay in {self.pending_path}"
            )

    def flush(self, timeout: float) -> bool:
        """Wait, at most ``timeout`` s, for every queued write to reach MLflow; False if some are still pending."""
        return self.buffer is None or self.buffer.flush(timeout)

    def known_run_id(self, trial_id: str) -> str | None:
        """The trial's MLflow run id when this driver knows it already (from memory: no call to the store)."""
        run = self.state.trials.get(trial_id)
        known = run.run_id if run is not None else None
        return known or (self.buffer.known_run_id(trial_id) if self.buffer is not None else None)

    def _write(self, op: str, **args) -> None:
        """One write of the record: queued in the buffer, and applied to the driver's state at once."""
        self.open_buffer()
        self.buffer.put(op, **args)
        self.state.apply(op, args)

    def runs(self) -> list:
        """The sweep's trial runs as MLflow ``Run`` entities, from the driver's state (``SweepState``): what the
        record holds once every write queued reached it (flush first), without reading it back."""
        return self.state.runs(self.buffer.created if self.buffer is not None else lambda trial_id: None)

    def delete(self, run_id: str) -> None:
        """A partial run deleted from the record (a confirmation or carried trial trains again, in one run only), and
        forgotten (:meth:`forget`)."""
        writer.delete_run(self.record, run_id)
        self.forget(run_id)

    def forget(self, run_id: str) -> None:
        """A run deleted from the record (the confirmation replaces a partial run): out of the state, and no write
        goes to it again (closing the open runs at an experiment's end)."""
        for trial_id in self.state.forget(run_id):
            self._counted.discard(trial_id)
            for kept in (self._last_epoch, self._partials, self._predicted, self._decision):
                kept.pop(trial_id, None)

    @property
    def client(self):
        if self._client is None:
            self._client = reader.client(self.record.tracking_uri)
        return self._client

    def setup(self, **info):
        """A Tune experiment starts: the record an earlier driver left is read, if it was not yet."""
        self.load()

    def load(self) -> None:
        """Find the child runs of a resumed sweep, so no trial gets a second run: the record read once per driver
        (every write after goes to it and to the state); a fresh sweep's has none."""
        if self._loaded:
            return
        self.open_buffer()  # first the writes an earlier run left pending
        self._loaded = True
        runs = reader.child_runs(self.client, self.record.experiment_id, self.record.parent_run_id)
        self.state = SweepState.from_runs(
            runs, self.record.parent_run_id, self.record.experiment_id, self.record.version
        )
        for run in runs:
            trial_id = run.data.tags.get(TRIAL_ID)
            if not trial_id:
                continue
            # confirmation has its own resume
            searched = legacy.run_phase(run.data.tags, self.record.version, run.info.run_id) == SEARCH
            if searched and not run.data.tags.get(STATUS) and run.data.tags.get(CONFIG_KEY):
                self._unfinished[run.data.tags[CONFIG_KEY]] = (trial_id, run.info.run_id)
            if TRAINABLE_PER_TASK in run.data.metrics:
                self._counted.add(trial_id)
            if run.data.tags.get(STATUS) not in (None, FAILED):
                continue  # ended: what it reports again is not logged (on_trial_result), so no history is read
            if SCORE in run.data.metrics:  # the last epoch logged and the best so far of the run a trial continues
                histories = {key: self._history(run.info.run_id, key) for key in (SCORE, *self.task_metrics)}
                self._last_epoch[trial_id] = max(histories[SCORE])
                self.state.start_best(trial_id, histories)
            if "fidelity_score" in run.data.metrics:
                self._partials[trial_id] = set(self._history(run.info.run_id, "fidelity_score"))

    def _status(self, trial_id: str) -> str | None:
        """The trial's final ``peftune.status`` (its run is closed), None while it has none (or no run yet)."""
        run = self.state.trials.get(trial_id)
        return run.tags.get(STATUS) if run is not None else None

    def _history(self, run_id: str, key: str) -> dict[int, float]:
        """A metric's values by step of a run an earlier driver left: read from the record once (``SweepState``)."""
        return self.state.history(run_id, key, self._read_history)

    def _read_history(self, run_id: str, key: str) -> dict[int, float]:
        return reader.metric_history(self.client, run_id, key)

    def rung_results(self) -> dict[str, tuple[str, list[dict]]]:
        """Every search trial's results by rung (``SweepState.rung_results``): what a restored scheduler refills
        from. Tune restores the scheduler before it starts the experiment's callbacks, so this may read first."""
        self.load()
        return self.state.rung_results(self._read_history)

    # -- run lifecycle

    def _run_for(self, trial) -> None:
        """Queue the creation of the trial's child run (found again by trial id if it exists)."""
        trial_id = trial.trial_id
        if trial_id in self.state.trials:
            return
        method, sampled = self.settings.split(trial.config)
        settings = self.settings.for_trial(trial.config)  # a confirmation trial's own seed and phase
        try:
            spec = settings.trial_spec(method, sampled)
        except (ValueError, TypeError, KeyError) as error:
            # the trial will fail on the same error and be recorded so; the sweep must go on
            log.warning("trial config %s %s is invalid: %s", method, sampled, error)
            spec = None
        params = spec.params() if spec is not None else invalid_params(settings, method, sampled)
        # a confirmation trial's seed and origin; every trial's phase, default mark and config key; its size
        tags = {**trial_tags(trial.config), **search_tags(trial.config, method, sampled)}
        rerunnable = spec is not None and bool(spec.data.data_dir)  # a command and a file that re-run it
        if rerunnable:
            tags[TRAIN_COMMAND] = spec.command()
        tags[SIZE_TAG] = size_label(method, params)
        phase = tags[PHASE]
        name = run_label(method, tags[SIZE_TAG], phase, params["seed"], default=tags[DEFAULT] == "true")
        self._write(
            "trial_run", trial_id=trial_id, run_name=name, method=method, sweep=self.settings.sweep,
            params={k: param_text(v) for k, v in params.items()}, tags=tags,
            datasets=writer.inputs_of(phase, self.record.datasets),
        )  # fmt: skip
        if rerunnable:  # the trial's specification, which `peftune train --spec` re-runs
            self._write("artifact", trial_id=trial_id, path=trial_spec.ARTIFACT, text=spec.to_json())

    def _adopt(self, trial, known: set[str]) -> None:
        """Continue the child run of the same configuration whose Ray trial Tune no longer knows.

        A driver killed after a trial started but before Tune saved its state leaves that trial's
        child run behind; the searcher hands the same configuration out again under a new Ray trial
        id, and its record continues that run (retagged) instead of a second one.
        """
        method, sampled = self.settings.split(trial.config)
        key = search_tags(trial.config, method, sampled)[CONFIG_KEY]
        old_id, run_id = self._unfinished.get(key, (None, None))
        if run_id is None or old_id in known or old_id == trial.trial_id:
            return
        del self._unfinished[key]
        self._write("tags", trial_id=old_id, tags={TRIAL_ID: trial.trial_id})  # the run is found by trial id
        for logged in (self._last_epoch, self._partials):
            if old_id in logged:
                logged[trial.trial_id] = logged.pop(old_id)
        if old_id in self._counted:
            self._counted.add(trial.trial_id)
        log.info("trial %s continues the child run of trial %s (the same configuration)", trial.trial_id, old_id)

    def on_trial_start(self, iteration, trials, trial, **info):
        if trial.trial_id not in self.state.trials:
            self._adopt(trial, {t.trial_id for t in trials})
        existed = trial.trial_id in self.state.trials
        self._run_for(trial)
        if self._status(trial.trial_id) == FAILED:  # Tuner.restore(resume_errored=True) gives it another chance
            self._write("delete_tags", trial_id=trial.trial_id, keys=[STATUS, ERROR])
        if existed and self._status(trial.trial_id) is None:  # an interrupted (or retried) trial goes on
            self._write("run_status", trial_id=trial.trial_id, status="RUNNING")

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self._run_for(trial)
        if self._status(trial.trial_id) is not None:
            return  # its run is closed (a driver stopped before Tune saved that the trial ended re-runs its end)
        if result.get(DIVERGED):
            return  # the final result of a diverged trial carries no epoch's metrics; on_trial_complete records it
        packed = result.get(PACK_SIZE_RESULT)
        if packed is not None and PACK_SIZE not in self.state.trials[trial.trial_id].tags:  # trained in a pack
            self._write("tags", trial_id=trial.trial_id, tags={PACK_SIZE: str(int(packed))})
        if result.get(PARTIAL):
            self._log_partial(trial.trial_id, result)
            return
        epoch = int(result[EPOCH])
        if epoch <= self._last_epoch.get(trial.trial_id, 0):
            return  # logged before the sweep was interrupted; the resumed trial re-ran this epoch
        now = writer.now_ms()  # sent with the metrics, so a re-sent batch is identical and MLflow keeps one copy
        keys = [*self.task_metrics, *EPOCH_METRICS]
        metrics = [(k, float(result[k]), now, epoch) for k in keys if _finite(result.get(k))]
        if trial.trial_id not in self._counted:
            metrics += [(k, float(result[k]), now, 0) for k in COUNT_METRICS if k in result]
            if "precision" in result:  # what the trial computed in: bf16 autocast or fp32
                self._write("tags", trial_id=trial.trial_id, tags={PRECISION: str(result["precision"])})
            self._counted.add(trial.trial_id)
        self._write("metrics", trial_id=trial.trial_id, metrics=metrics)
        self._last_epoch[trial.trial_id] = epoch
        if "predictions" in result:
            self._log_predictions(trial, result)
        shown = " ".join(f"{k} {result[k]:.4f}" for k in self.task_metrics if k in result)
        log.debug(  # the console's line per finished trial is ``console.Progress``'s; this one with --verbose
            "trial %s (%s) epoch %d/%d: %s score %.4f, %.0fs",
            trial.trial_id,
            trial.config.get("method"),
            epoch,
            self.settings.epochs,
            shown,
            result.get(SCORE, float("nan")),
            result.get("epoch_time_s", 0),
        )

    def _log_predictions(self, trial, result: dict) -> None:
        """The dev predictions of the trial's best epoch so far (by ``score``, the earliest on a tie, as
        ``best_*``), one artifact per split (``predictions_artifact``): what the decisions and the report read."""
        score = result.get(SCORE)
        if not _finite(score) or not improves(score, self._predicted.get(trial.trial_id, -math.inf)):
            return
        self._predicted[trial.trial_id] = score
        seed = (trial.config.get("peftune") or {}).get("seed", self.settings.seed)
        for split, predictions in result["predictions"].items():
            text = predictions_csv(predictions, self.examples[split], int(seed))
            self._write("artifact", trial_id=trial.trial_id, path=predictions_artifact(split), text=text)
            if split == DECISION:
                self._decision[trial.trial_id] = text

    def _log_partial(self, trial_id: str, result: dict) -> None:
        """A rung within an epoch, once: ``fidelity_<score|steps|progress>`` at step = examples seen."""
        seen = int(result["examples_seen"])
        logged = self._partials.setdefault(trial_id, set())
        if seen in logged:
            return  # logged before the sweep was interrupted; the resumed trial re-ran this part of its epoch
        now = writer.now_ms()
        keys = [k for k in PARTIAL_METRICS if _finite(result.get(k))]
        metrics = [(f"fidelity_{k}", float(result[k]), now, seen) for k in keys]
        self._write("metrics", trial_id=trial_id, metrics=metrics)
        logged.add(seen)

    def space_refused(self) -> DiskFullError | None:
        """The first write refused for space this driver saw (a trial's checkpoint, or its own record), naming
        the file; None while every write had room."""
        return self._full or (self.buffer.full if self.buffer is not None else None)

    def on_step_end(self, iteration, trials, **info):
        """Stop the experiment (the error leaves Tune's loop; the sweep closes as interrupted) at the first write
        refused for space."""
        full = self.space_refused()
        if full is not None:
            raise full

    def on_trial_recover(self, iteration, trials, trial, **info):
        if self._out_of_space(trial):
            return  # not a failure of the trial: it runs again, from its last checkpoint, when the sweep resumes
        self._run_for(trial)
        # retries so far; the final count is set when the trial ends
        self._write("tags", trial_id=trial.trial_id, tags={RETRIES: str(trial.num_failures)})
        log.warning("trial %s failed and is retried (%d failure(s) so far)", trial.trial_id, trial.num_failures)

    def on_trial_complete(self, iteration, trials, trial, **info):
        last = trial.last_result or {}
        if last.get(DIVERGED):
            self._finish(trial, DIVERGED, error=str(last.get("divergence", DIVERGED))[:MAX_TAG_CHARS])
            return
        status = COMPLETED if int(last.get(EPOCH, 0)) >= self.settings.epochs else EARLY_STOPPED
        self._finish(trial, status)

    def on_trial_error(self, iteration, trials, trial, **info):
        if self._out_of_space(trial):
            return  # its run is closed as interrupted, and the sweep's resume retries it (resume_errored)
        self._finish(trial, FAILED, error=error_text(_read_error(trial)))

    def _out_of_space(self, trial) -> bool:
        """Whether ``trial`` failed writing (its checkpoint) for lack of space; the first such is kept to stop on."""
        full = no_space_text(_read_error(trial) or "", trial.path)
        if full is not None and self._full is None:
            self._full = full
        return full is not None

    def _finish(self, trial, status: str, error: str | None = None) -> None:
        if self._status(trial.trial_id) is not None:
            return
        self._run_for(trial)
        if error is not None:
            log.warning("trial %s %s: %s", trial.trial_id, status, error.splitlines()[0])
        # the retries Ray made: every failure but a final one (Ray's num_failures counts that too)
        retries = trial.num_failures - (1 if status == FAILED else 0)
        self._write(
            "finish", trial_id=trial.trial_id, status=status, error=error, retries=retries,
            best=self.state.best_metrics(trial.trial_id, self.task_metrics, writer.now_ms()),
        )  # fmt: skip
        marks = trial.config.get("peftune") or {}
        if marks.get("phase") == CONFIRM:
            decision = self._decision.get(trial.trial_id) if status == COMPLETED else None
            self.confirmed[(str(marks["config_key"]), int(marks["seed"]))] = ConfirmedPair(status, decision)

    def on_experiment_end(self, trials, **info):
        self.close_open_runs()

    def close_open_runs(self) -> None:
        """Trials still open when the experiment ends were interrupted: KILLED until the sweep resumes."""
        for trial_id in [trial_id for trial_id, run in self.state.trials.items() if STATUS not in run.tags]:
            self._write("run_status", trial_id=trial_id, status="KILLED")


# how an error refused for space reads once Ray has turned it into text: Python's OSError ("[Errno 28] No space left
# on device: 'PATH'") or pyarrow's, which Tune's checkpoint upload raises ("... Detail: [errno 28] No space left")
NO_SPACE_TEXT = re.compile(r"\[errno (?:28|122)\][^\n]*?(?:: '(?P<path>[^'\n]+)')?$", re.IGNORECASE | re.MULTILINE)


def no_space_text(text: str, path: str | None = None) -> DiskFullError | None:
    """A trial's error text as a ``DiskFullError`` when it says a write had no space (the path it names, else
    ``path``); None otherwise."""
    found = NO_SPACE_TEXT.search(text)
    if found is None:
        return None
    return DiskFullError(found.group("path") or path)


def invalid_params(settings, method: str, sampled: dict) -> dict:
    """The params of a trial whose config is invalid (its spec refused it): what was sampled, and the sweep's
    fixed settings, so its failed run says what it was."""
    common = {k: sampled.get(k) for k in HYPERPARAMETERS}
    return {
        "method": method,
        **common,
        "epochs": settings.epochs,
        "batch_size": settings.batch_size,
        "tasks": settings.tasks,
        "seed": settings.seed,
        **{f"method.{k}": v for k, v in sampled.items() if k not in common},
    }


def trial_tags(config: dict) -> dict[str, str]:
    """The trial config's ``"peftune"`` dict as child-run tags: ``{"phase": "confirm"}`` -> ``peftune.phase``."""
    return {f"peftune.{key}": str(value) for key, value in (config.get("peftune") or {}).items()}


def _read_error(trial) -> str | None:
    """The trial's error text: Tune writes it on the driver first, then syncs it to the storage path."""
    if trial.error_file and Path(trial.error_file).is_file():
        return Path(trial.error_file).read_text(errors="replace")
    return trial.get_error()


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
