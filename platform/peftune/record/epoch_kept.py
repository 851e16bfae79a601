"""The epoch a trial keeps: its best score, the earliest on a tie. One rule for the trial's checkpoints
(``peftune.sweep.resume``), the driver's state of the sweep (``peftune.record.sweep_state``), the predictions the record
keeps (``peftune.record.writer``), a single trial (``peftune train``) and the report's reading of an unclosed run."""

from __future__ import annotations

from collections.abc import Mapping


def improves(score: float, kept: float) -> bool:
    """Whether an epoch's score replaces the epoch kept so far: only a higher one does, so that of two epochs with
    the best score the earliest is kept (a later one trained longer for nothing). A NaN score never replaces one."""
    return score > kept


def best_epoch(scores: Mapping[int, float]) -> int | None:
    """The epoch kept of ``scores`` ({epoch: score}) by :func:`improves`: the best score, the earliest on a tie;
    None without any epoch. The first epoch is kept until one improves on it (a NaN first score included)."""
    kept = None
    for epoch in sorted(scores):
        if kept is None or improves(scores[epoch], scores[kept]):
            kept = epoch
    return kept
