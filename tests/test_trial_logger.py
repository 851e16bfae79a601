"""The driver keeps each trial's best epoch in its state of the sweep and writes it at the trial's end: no read.

The rule is ``epoch_kept.best_epoch``'s (the best logged score, the earliest on a tie, a score the record does not hold
never kept); what reaches the write buffer is checked here, the buffer itself in ``test_faults``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from peftune.record import legacy
from peftune.record.epoch_kept import best_epoch
from peftune.record.trial_logger import TrialLogger


class Buffer:
    """The write buffer's interface, keeping what is put."""

    full = None

    def __init__(self):
        self.ops = []

    def put(self, op, **args):
        self.ops.append((op, args))

    def flush(self, timeout):
        return True


def logger_with(trial_id: str) -> TrialLogger:
    settings = SimpleNamespace(epochs=9, seed=0)
    record = SimpleNamespace(parent_run_id="parent", experiment_id="1", version=legacy.RECORD_VERSION)
    logger = TrialLogger(record=record, settings=settings, task_metrics=["sst_accuracy", "dev_score"])
    logger.buffer = Buffer()
    logger.state.apply("trial_run", {"trial_id": trial_id, "run_name": trial_id, "method": "lora", "sweep": "s",
                                     "params": {}})  # fmt: skip
    logger._counted.add(trial_id)
    return logger


def trial(trial_id: str):
    return SimpleNamespace(trial_id=trial_id, num_failures=0, config={"method": "lora"}, last_result={"epoch": 5})


@pytest.mark.parametrize(
    "scores",
    [
        [0.5, 0.7, 0.7, 0.6],  # a tie: the earliest
        [0.5, math.nan, 0.4, 0.8],  # a NaN score is not logged, so never kept
        [math.inf, 0.3, 0.9],  # nor an infinite one
        [0.9, 0.1],
    ],
)
def test_the_best_epoch_written_at_the_end_is_the_records_rule_on_what_was_logged(scores):
    logger = logger_with("t1")
    for epoch, score in enumerate(scores, start=1):
        result = {"epoch": epoch, "score": score, "sst_accuracy": score / 2, "dev_score": epoch / 10}
        logger.on_trial_result(0, [], trial("t1"), result)
    logger._finish(trial("t1"), "completed")

    logged = {}  # {epoch: score} as the record holds it: what the metrics ops carried
    for op, args in logger.buffer.ops:
        if op == "metrics":
            logged.update({step: value for key, value, _, step in args["metrics"] if key == "score"})
    kept = best_epoch(logged)
    ((_, finish),) = [(op, args) for op, args in logger.buffer.ops if op == "finish"]
    best = {key: value for key, value, _, step in finish["best"]}
    assert {step for *_, step in finish["best"]} == {0}
    assert best == {
        "best_epoch": kept,
        "best_score": logged[kept],
        "best_sst_accuracy": logged[kept] / 2,
        "best_dev_score": kept / 10,
    }


def test_a_trial_without_a_logged_score_ends_without_best_metrics():
    logger = logger_with("t2")
    logger.on_trial_result(0, [], trial("t2"), {"epoch": 1, "score": math.nan})
    logger._finish(trial("t2"), "completed")
    ((_, finish),) = [(op, args) for op, args in logger.buffer.ops if op == "finish"]
    assert finish["best"] == []


# ----------------------------------------------------------------------------- a resumed driver reads the record once


class Record:
    """An MLflow client over a sweep's record as an earlier driver left it, counting what is read."""

    def __init__(self, runs: dict[str, tuple[dict, dict[str, dict[int, float]]]]):
        from mlflow.entities import Metric, Run, RunData, RunInfo, RunTag

        self.histories = {run_id: histories for run_id, (_, histories) in runs.items()}
        self.runs = [
            Run(
                RunInfo(run_id, "1", "", "RUNNING", n, None, "active", run_name=run_id),
                RunData(
                    metrics=[Metric(key, values[max(values)], 0, max(values)) for key, values in histories.items()],
                    tags=[RunTag(k, v) for k, v in {"mlflow.parentRunId": "parent", **tags}.items()],
                ),
            )
            for n, (run_id, (tags, histories)) in enumerate(runs.items())
        ]
        self.searches, self.reads = 0, []

    def search_runs(self, experiment_ids, filter_string, max_results, page_token):
        from mlflow.store.entities import PagedList

        self.searches += 1
        return PagedList(self.runs, None)

    def get_metric_history(self, run_id, key):
        from mlflow.entities import Metric

        self.reads.append((run_id, key))
        return [Metric(key, value, 0, step) for step, value in self.histories[run_id].get(key, {}).items()]


def resumed_logger(client) -> TrialLogger:
    settings = SimpleNamespace(epochs=3, seed=0)
    record = SimpleNamespace(parent_run_id="parent", experiment_id="1", version=legacy.RECORD_VERSION)
    logger = TrialLogger(record=record, settings=settings, task_metrics=["sst_accuracy"])
    logger.buffer, logger._client = Buffer(), client
    return logger


def test_a_resumed_driver_reads_each_run_and_history_once_for_the_rungs_and_the_trials_it_continues():
    from peftune.record.trial_logger import RecordedResults

    search = {"peftune.phase": "search", "peftune.method": "lora"}
    client = Record({
        "ended": ({**search, "peftune.trial_id": "t1", "peftune.status": "completed"},
                  {"score": {1: 0.4, 2: 0.5}, "steps": {1: 10, 2: 20}, "progress": {1: 0.5, 2: 1.0},
                   "sst_accuracy": {1: 0.4, 2: 0.5},
                   "fidelity_score": {64: 0.3}, "fidelity_steps": {64: 5}, "fidelity_progress": {64: 0.25}}),
        "open": ({**search, "peftune.trial_id": "t2", "peftune.config_key": "k2"},
                 {"score": {1: 0.6}, "steps": {1: 10}, "sst_accuracy": {1: 0.7},
                  "fidelity_score": {64: 0.2}, "fidelity_steps": {64: 5}, "fidelity_progress": {64: 0.25}}),
        "seed": ({"peftune.phase": "confirm", "peftune.trial_id": "t3", "peftune.method": "lora",
                  "peftune.status": "completed"},
                 {"score": {1: 0.9}, "sst_accuracy": {1: 0.9}}),
    })  # fmt: skip
    logger = resumed_logger(client)

    # Tune restores the scheduler first: its refill is the first read; then each experiment's setup
    results = RecordedResults(logger.record).results()
    logger.setup()
    logger.setup()  # the confirmation's experiment, in the same driver: nothing read again

    assert client.searches == 1
    assert len(client.reads) == len(set(client.reads))  # no history read twice
    assert {run for run, _ in client.reads} == {"ended", "open"}  # an ended confirmation run's is never needed
    assert results == {
        "t1": ("lora", [{"progress": 0.25, "score": 0.3, "steps": 5},
                        {"epoch": 1, "score": 0.4, "steps": 10, "progress": 0.5},
                        {"epoch": 2, "score": 0.5, "steps": 20, "progress": 1.0}]),
        "t2": ("lora", [{"progress": 0.25, "score": 0.2, "steps": 5}, {"epoch": 1, "score": 0.6, "steps": 10}]),
    }  # fmt: skip
    # the trial the open run continues: its last epoch and best so far, and its rungs within epochs
    assert logger._last_epoch == {"t2": 1} and logger._partials == {"t2": {64}}
    assert logger.state.best["t2"] == (1, {"score": 0.6, "sst_accuracy": 0.7})

    # what the continued trial logs after is in the state's histories, not read back
    reads = len(client.reads)
    logger.on_trial_result(0, [], trial("t2"), {"epoch": 2, "score": 0.8, "sst_accuracy": 0.8, "steps": 20})
    assert logger.state.rung_results(client.get_metric_history)["t2"][1][-1] == {"epoch": 2, "score": 0.8,
                                                                                 "steps": 20}  # fmt: skip
    assert len(client.reads) == reads
