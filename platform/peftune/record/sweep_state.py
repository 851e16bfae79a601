"""The sweep's trial runs as the driver knows them: what it decides on while the sweep runs, not the record read back.

The trial logger (``peftune.record.trial_logger.TrialLogger``) sends every write of a trial's run through the write
buffer (``peftune.record.tracking_buffer``) and applies the same write here (:meth:`SweepState.apply`, one method per
operation, as the buffer has). So the state holds what the record holds once the buffer has drained: each run's tags,
params (as the strings MLflow stores), latest metrics (MLflow's rule: the greatest step, then timestamp, then value) and
status, and each trial's best epoch (what its end writes as ``best_*``). A resumed driver starts it from the
record, read once (:meth:`SweepState.from_runs`), and reads a metric's history of a run an earlier driver left at
most once, when something needs it (:meth:`SweepState.history`: the best epoch of a run a trial continues, the
rungs a restored scheduler refills, :meth:`SweepState.rung_results`). Not in it: what the sweep's end writes on
the record itself (the best checkpoints, ``peftune.core.checkpoint``), read by nothing after.

The search's end, the confirmation's candidates and seeds, and the sweep's summary read :meth:`SweepState.runs`:
MLflow ``Run`` entities built in memory (the run ids and start times the buffer got from the server), so the code
that reads a record (``confirm.select_candidates``, the analysis) reads the state the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from peftune.base.record_names import (
    BEST_EPOCH,
    EPOCH,
    ERROR,
    FAILED,
    METHOD,
    PARENT_TAG,
    RETRIES,
    ROLE,
    SCORE,
    SEARCH,
    STATUS,
    SWEEP,
    TRIAL_ID,
    TRIAL_ROLE,
    best_metric,
)
from peftune.record import legacy
from peftune.record.epoch_kept import best_epoch, improves
from peftune.record.reader import run_entity

# the histories a search trial's rungs are read back from (``SweepState.rung_results``)
RUNG_HISTORIES = (SCORE, "steps", "progress", "fidelity_score", "fidelity_steps", "fidelity_progress")

# MLflow's status of a run (``RunInfo.status``), as the buffer's operations set it
RUNNING, FINISHED, MLFLOW_FAILED = "RUNNING", "FINISHED", "FAILED"


@dataclass
class TrialRun:
    """One trial's child run: what the record holds of it."""

    trial_id: str
    run_name: str = ""
    tags: dict[str, str] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, tuple[int, int, float]] = field(default_factory=dict)  # key -> (step, timestamp, value)
    status: str = RUNNING
    run_id: str | None = None  # known once created (read from the record, or from the buffer)
    start_time: int | None = None

    def log_metric(self, key: str, value: float, timestamp: int, step: int) -> None:
        """Keep the metric as MLflow's latest value when it is: by (step, timestamp, value)."""
        new = (int(step), int(timestamp), float(value))
        if key not in self.metrics or new > self.metrics[key]:
            self.metrics[key] = new


class SweepState:
    """Every trial run of the sweep, by Ray trial id (see the module docstring)."""

    def __init__(
        self, parent_run_id: str | None = None, experiment_id: str | None = None, version: int = legacy.RECORD_VERSION
    ):
        self.parent_run_id, self.experiment_id = parent_run_id, experiment_id
        self.version = version  # the record's (peftune.record.legacy): a resumed old sweep's runs may lack their phase
        self.trials: dict[str, TrialRun] = {}
        # trial id -> the epoch kept so far (epoch_kept.improves on the scores logged: the best, the earliest on a tie)
        # and that epoch's metrics as logged: written as best_* when the trial ends, not read back from the record
        self.best: dict[str, tuple[int, dict[str, float]]] = {}
        # (run id, metric) -> {step: value}: a history of a run the record held when the driver started, read once
        # (``history``) and kept up to date by the writes after
        self.histories: dict[tuple[str, str], dict[int, float]] = {}

    @classmethod
    def from_runs(cls, runs, parent_run_id: str | None, experiment_id: str | None, version: int) -> SweepState:
        """The state of a sweep's record of ``version``: its child runs (MLflow ``Run`` entities) with a trial id."""
        state = cls(parent_run_id, experiment_id, version)
        for run in runs:
            trial_id = run.data.tags.get(TRIAL_ID)
            if not trial_id:
                continue
            metrics = {key: (0, 0, value) for key, value in run.data.metrics.items()}  # the latest only: enough
            state.trials[trial_id] = TrialRun(
                trial_id, run.info.run_name or "", dict(run.data.tags), dict(run.data.params), metrics,
                run.info.status, run.info.run_id, run.info.start_time,
            )  # fmt: skip
        return state

    # -- the buffer's operations, applied to the state (their arguments as ``WriteBuffer.put`` takes them)

    def apply(self, op: str, args: dict) -> None:
        getattr(self, f"_op_{op}")(**args)

    def _op_trial_run(self, trial_id: str, run_name: str, method: str, sweep: str, params: dict,
                      tags: dict | None = None, datasets: list | None = None) -> None:  # fmt: skip
        run = self.trials.get(trial_id)
        if run is None:
            base = {PARENT_TAG: self.parent_run_id, ROLE: TRIAL_ROLE, SWEEP: sweep, TRIAL_ID: trial_id}
            run = self.trials[trial_id] = TrialRun(trial_id, run_name, {**base, METHOD: method, **(tags or {})})
        run.params.update(params)

    def _op_metrics(self, trial_id: str, metrics: list) -> None:
        run = self.trials[trial_id]
        for key, value, timestamp, step in metrics:
            run.log_metric(key, value, timestamp, step)
            if (run.run_id, key) in self.histories:
                self.histories[(run.run_id, key)][int(step)] = float(value)
        for epoch in sorted({step for key, _, _, step in metrics if key == SCORE}):  # an epoch's end (a rung's is
            kept = self.best.get(trial_id)  # fidelity_score): the epoch kept if its score improves on the best's
            logged = {key: value for key, value, _, step in metrics if step == epoch}
            if kept is None or improves(logged[SCORE], kept[1][SCORE]):
                self.best[trial_id] = (epoch, logged)

    def _op_tags(self, trial_id: str, tags: dict) -> None:
        run = self.trials[trial_id]
        run.tags.update(tags)
        if tags.get(TRIAL_ID, trial_id) != trial_id:  # the run continues under a new Ray trial (TrialLogger._adopt)
            self.trials[tags[TRIAL_ID]] = self.trials.pop(trial_id)
            run.trial_id = tags[TRIAL_ID]
            if trial_id in self.best:
                self.best[tags[TRIAL_ID]] = self.best.pop(trial_id)

    def _op_delete_tags(self, trial_id: str, keys: list) -> None:
        for key in keys:
            self.trials[trial_id].tags.pop(key, None)

    def _op_run_status(self, trial_id: str, status: str) -> None:
        self.trials[trial_id].status = status

    def _op_finish(self, trial_id: str, status: str, error: str | None, retries: int, best: list | None = None,
                   task_metrics: list | None = None) -> None:  # fmt: skip
        self._op_metrics(trial_id, best or [])
        run = self.trials[trial_id]
        run.tags.update({STATUS: status, **({ERROR: error} if error is not None else {})})
        if retries > 0:
            run.tags[RETRIES] = str(retries)
        run.status = MLFLOW_FAILED if status == FAILED else FINISHED

    def _op_artifact(self, trial_id: str, path: str, text: str) -> None:
        """Artifacts are files of the record: the state does not hold them."""

    # -- what reads it

    def history(self, run_id: str, key: str, read: Callable[[str, str], dict[int, float]]) -> dict[int, float]:
        """A metric's values by step of a run an earlier driver left: ``read(run_id, key)`` from the record the first
        time it is asked for, then kept here."""
        if (run_id, key) not in self.histories:
            self.histories[(run_id, key)] = read(run_id, key)
        return self.histories[(run_id, key)]

    def rung_results(self, read: Callable[[str, str], dict[int, float]]) -> dict[str, tuple[str, list[dict]]]:
        """Ray trial id -> (method, [{"epoch" or "progress", "score", "steps"}, ...] in the order they were reported)
        of every search trial that logged a score: what a restored scheduler refills its rungs from. A rung within
        an epoch is ``fidelity_<score|steps|progress>`` at step = examples seen; an epoch's, ``score``, ``steps`` and
        ``progress`` at step = epoch. The histories come through :meth:`history` (read once)."""
        out = {}
        for trial_id, run in self.trials.items():
            if run.run_id is None or legacy.run_phase(run.tags, self.version, run.run_id) != SEARCH:
                continue
            if SCORE not in run.metrics:
                continue
            metric = {key: self.history(run.run_id, key, read) for key in RUNG_HISTORIES}
            inf = float("inf")
            results = [
                {"progress": metric["fidelity_progress"][seen], SCORE: score,
                 "steps": metric["fidelity_steps"].get(seen, inf)}
                for seen, score in metric["fidelity_score"].items()
                if seen in metric["fidelity_progress"]
            ]  # fmt: skip
            results += [
                {EPOCH: epoch, SCORE: score, "steps": metric["steps"].get(epoch, inf),
                 **({"progress": metric["progress"][epoch]} if epoch in metric["progress"] else {})}
                for epoch, score in metric[SCORE].items()
            ]  # fmt: skip
            results.sort(key=lambda r: (r["steps"], r.get(EPOCH, 0)))
            out[trial_id] = (run.tags.get(METHOD, ""), results)
        return out

    def start_best(self, trial_id: str, histories: dict[str, dict[int, float]]) -> None:
        """The best epoch so far of a run a resumed trial continues, from its ``histories`` ({metric: {epoch:
        value}}, score's among them) as the record holds them (``epoch_kept.best_epoch``'s rule)."""
        kept = best_epoch(histories[SCORE])
        if kept is not None:
            self.best[trial_id] = (kept, {key: values[kept] for key, values in histories.items() if kept in values})

    def best_metrics(self, trial_id: str, task_metrics, timestamp: int) -> list[tuple]:
        """best_epoch, best_score and best_<task metric> of the trial's epoch kept, as (key, value, timestamp, step
        0); none when no score was logged. ``timestamp``: fixed when queued, so a replayed write is identical."""
        if trial_id not in self.best:
            return []
        epoch, logged = self.best[trial_id]
        values = [(key, logged[key]) for key in (SCORE, *task_metrics) if key in logged]
        return [(BEST_EPOCH, float(epoch), timestamp, 0), *((best_metric(k), v, timestamp, 0) for k, v in values)]

    def forget(self, run_id: str) -> list[str]:
        """A run deleted from the record (the confirmation replaces a partial run); the trial ids it had."""
        gone = [key for key, run in self.trials.items() if run.run_id == run_id]
        for trial_id in gone:
            del self.trials[trial_id]
            self.best.pop(trial_id, None)
        self.histories = {key: values for key, values in self.histories.items() if key[0] != run_id}
        return gone

    def runs(self, created: Callable[[str], tuple[str, int] | None] = lambda trial_id: None) -> list:
        """The trial runs as MLflow ``Run`` entities; ``created(trial_id)``: the run id and start time the server
        gave a run this driver created (the write buffer's), None when it has not created it (yet)."""
        out = []
        for trial_id, run in list(self.trials.items()):
            if run.run_id is None and (known := created(trial_id)) is not None:
                run.run_id, run.start_time = known
            if run.run_id is None:
                continue  # not in the record yet: its creation is still queued
            out.append(run_entity(run.run_id, self.experiment_id or "", run.status, run.start_time or 0, run.run_name,
                                  run.metrics, run.params, run.tags))  # fmt: skip
        return sorted(out, key=lambda r: (-r.info.start_time, r.info.run_id))  # search_runs' order: newest first
