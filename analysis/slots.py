"""Where a sweep's slot time went, per phase: the trials' own timers against the phase's wall time x slots.

A phase's span runs from its first run's start to its last run's end (MLflow's times); its slots are the
most runs that were open at once. Slot time = span x slots. The trials' timers cover training
(``train_time_s``), evaluation (``eval_total_s``: every evaluation, rungs' included), start-up (data and
model, ``startup_s``) and checkpoints. The rest is outside every trial: Ray starting and stopping trial
actors, reporting and logging, and a slot left idle while the other finishes the phase.
"""

from __future__ import annotations

import pandas as pd

TIMERS = ("train_time_s", "eval_total_s", "startup_s", "checkpoint_time_s")
COLUMNS = (
    "phase",
    "runs",
    "span_s",
    "slots",
    "slot_s",
    "train_s",
    "eval_s",
    "other_timers_s",
    "outside_share",
    "eval_share",
)


def most_at_once(runs: pd.DataFrame) -> int:
    """The most runs open at once (a run ending at the instant another starts does not overlap it)."""
    events = [(t, 1) for t in runs["start_time"]] + [(t, -1) for t in runs["end_time"]]
    open_now = most = 0
    for _, change in sorted(events):  # at a tie the end (-1) sorts before the start (+1)
        open_now += change
        most = max(most, open_now)
    return most


def phase_use(phase: str, runs: pd.DataFrame | None) -> dict | None:
    """One row of :func:`slot_table` (None when no run of the phase has both times)."""
    if runs is None or not len(runs):
        return None
    timed = runs.dropna(subset=["start_time", "end_time"])
    if not len(timed):
        return None
    span = (timed["end_time"].max() - timed["start_time"].min()).total_seconds()
    slots = most_at_once(timed)
    seconds = {key: float(timed[key].fillna(0.0).sum()) if key in timed else 0.0 for key in TIMERS}
    in_trials = sum(seconds.values())
    slot_s = span * slots
    return {
        "phase": phase,
        "runs": len(timed),
        "span_s": span,
        "slots": slots,
        "slot_s": slot_s,
        "train_s": seconds["train_time_s"],
        "eval_s": seconds["eval_total_s"],
        "other_timers_s": seconds["startup_s"] + seconds["checkpoint_time_s"],
        "outside_share": 1.0 - in_trials / slot_s if slot_s > 0 else float("nan"),
        "eval_share": seconds["eval_total_s"] / in_trials if in_trials > 0 else float("nan"),
    }


def slot_table(trials: pd.DataFrame, confirmations: pd.DataFrame | None) -> pd.DataFrame:
    """Per phase (search, confirmation, and the sweep over both): span, slots, the timers' seconds, the share
    of slot time outside every trial's timers and evaluation's share of the trials' time."""
    rows = [phase_use("search", trials), phase_use("confirmation", confirmations)]
    if rows[0] and rows[1]:
        rows.append(phase_use("sweep", pd.concat([trials, confirmations], ignore_index=True)))
    return pd.DataFrame([row for row in rows if row], columns=list(COLUMNS))
