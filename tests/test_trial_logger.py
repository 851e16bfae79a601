"""The driver keeps each trial's best epoch in its state of the sweep and writes it at the trial's end: no read.

The rule is ``record.best_epoch``'s (the best logged score, the earliest on a tie, a score the record does not hold
never kept); what reaches the write buffer is checked here, the buffer itself in ``test_faults``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from peftune.record import best_epoch
from peftune.tracking import TrialLogger


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
    record = SimpleNamespace(parent_run_id="parent", experiment_id="1")
    logger = TrialLogger(record=record, settings=settings, task_metrics=["sst_accuracy", "dev_score"])
    logger.buffer = Buffer()
    logger._runs[trial_id] = "run"  # its run exists: results only log metrics
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
