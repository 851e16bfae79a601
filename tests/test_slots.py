"""Where a phase's slot time went: the share outside every run's timers and evaluation's share."""

import math

import pandas as pd
import pytest

from analysis import slots

T0 = pd.Timestamp("2026-01-01T00:00:00Z")


def runs(*rows):
    """(start s, end s, train s, eval s) -> a frame shaped as analysis.runs' trial rows."""
    return pd.DataFrame(
        {
            "start_time": [T0 + pd.Timedelta(seconds=r[0]) for r in rows],
            "end_time": [T0 + pd.Timedelta(seconds=r[1]) for r in rows],
            "train_time_s": [r[2] for r in rows],
            "eval_total_s": [r[3] for r in rows],
            "startup_s": [1.0] * len(rows),
            "checkpoint_time_s": [0.0] * len(rows),
        }
    )


def test_two_slots_with_one_idle_at_the_end():
    # slot A: 0-100 then 100-200; slot B: 0-100, then idle 100-200
    phase = runs((0, 100, 80, 10), (100, 200, 80, 10), (0, 100, 80, 10))
    use = slots.phase_use("search", phase)
    assert use["slots"] == 2 and use["span_s"] == 200 and use["slot_s"] == 400
    assert use["outside_share"] == pytest.approx(1 - 3 * 91 / 400)  # B's idle 100 s and every run's 9 untimed
    assert use["eval_share"] == pytest.approx(30 / 273)


def test_a_run_ending_as_another_starts_shares_its_slot():
    assert slots.most_at_once(runs((0, 10, 1, 1), (10, 20, 1, 1), (10, 20, 1, 1))) == 2
    assert slots.most_at_once(runs((0, 11, 1, 1), (10, 20, 1, 1), (10, 20, 1, 1))) == 3


def test_the_table_has_a_row_per_phase_with_runs_and_skips_untimed_runs():
    unfinished = runs((0, 50, 40, 5)).assign(end_time=[pd.NaT])
    table = slots.slot_table(runs((0, 50, 40, 5)), pd.concat([runs((60, 90, 20, 5)), unfinished]))
    assert list(table["phase"]) == ["search", "confirmation", "sweep"] and list(table["runs"]) == [1, 1, 2]
    assert slots.slot_table(runs((0, 50, 40, 5)), None)["phase"].tolist() == ["search"]
    old = runs((0, 50, 40, 5)).drop(columns=["eval_total_s"])  # a record without the timer
    assert math.isclose(slots.phase_use("search", old)["eval_share"], 0.0)


def test_the_sweep_row_counts_the_hand_over_between_the_phases_as_outside():
    search = runs((0, 100, 90, 0), (0, 100, 90, 0))  # two slots, 10 s untimed in each run
    confirmation = runs((130, 230, 90, 0), (130, 230, 90, 0))  # starts 30 s after the search ended
    table = slots.slot_table(search, confirmation).set_index("phase")
    assert table.loc["search", "outside_share"] == pytest.approx(0.09)  # 1 s of start-up is timed
    assert table.loc["sweep", "span_s"] == 230 and table.loc["sweep", "slots"] == 2
    assert table.loc["sweep", "outside_share"] == pytest.approx(1 - 4 * 91 / 460)  # the 30 s gap x 2 slots too


def test_the_report_shows_spans_in_minutes_with_one_decimal():
    from analysis.render import _slot_lines

    lines = _slot_lines(slots.slot_table(runs((0, 318, 300, 10)), runs((320, 1116, 700, 90))))
    table = lines[-1]  # the Markdown table, one string
    assert "| search | 1 | 1 | 5.3 |" in table and "| sweep | 2 | 1 | 18.6 |" in table
