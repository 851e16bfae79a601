"""Disk full is a fault like the others (issue 34): a write refused for space stops the sweep as interrupted, with
one line naming the path (exit 3), the record closed as far as the store can take it, no state file left cut off,
and the same command resumes the sweep once space is freed, every configuration recorded once.

Fast: the rules on simulated refusals (an ``OSError`` with ``ENOSPC`` where the operating system would raise it).
Slow: real sweeps (real Ray, real MLflow) on a small tmpfs; they skip, saying why, where ``mount`` is not allowed.
"""

from __future__ import annotations

import errno
import json
import pickle
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from peftune.base.errors import DiskFullError, disk_full, no_space
from peftune.cli import common
from peftune.record import trial_logger
from peftune.record.tracking_buffer import WriteBuffer
from peftune.sweep import resume


def enospc(path: str | Path | None = None) -> OSError:
    return OSError(errno.ENOSPC, "No space left on device", None if path is None else str(path))


# ----------------------------------------------------------------------------- fast: what counts as disk full


def test_a_refusal_for_space_is_found_through_the_layers_that_wrap_it():
    from ray.tune.error import TuneError

    try:
        try:
            raise enospc("/full/trial/checkpoint.safetensors")
        except OSError as error:
            raise TuneError("The Ray Tune run failed.") from error
    except TuneError as wrapped:
        full = disk_full(wrapped)
    assert isinstance(full, DiskFullError) and full.path == "/full/trial/checkpoint.safetensors"
    assert "/full/trial/checkpoint.safetensors" in str(full) and "run the same command again" in str(full)

    store = sqlite3.OperationalError("database or disk is full")  # SQLite's refusal has no errno, only its name
    store.sqlite_errorname = "SQLITE_FULL"
    try:
        raise RuntimeError("MLflow's error") from store
    except RuntimeError as error:
        assert no_space(error) is store and disk_full(error, "/full/mlflow.db").path == "/full/mlflow.db"

    assert no_space(OSError(errno.ENOENT, "No such file")) is None and disk_full(ValueError("x")) is None
    assert "needs 1,234 bytes more" in str(DiskFullError("/x", 1234))


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ("OSError: [Errno 28] No space left on device: '/full/exp/t1/checkpoint_000001/x.tmp'",
         "/full/exp/t1/checkpoint_000001/x.tmp"),
        ("OSError: [Errno 28] Error writing bytes to file. Detail: [errno 28] No space left on device", "/full/exp/t1"),
    ],
)  # fmt: skip
def test_a_trial_that_failed_for_space_is_told_apart_from_a_failed_trial(text, path):
    found = trial_logger.no_space_text(f"Traceback (most recent call last):\n  ...\n{text}\n", "/full/exp/t1")
    assert found is not None and found.path == path
    assert trial_logger.no_space_text("ValueError: k = 8 > 6 layers", "/full/exp/t1") is None


@pytest.mark.parametrize("raised", [DiskFullError("/full/ray_results/s/x.json", 512), enospc("/full/m.db")])
def test_the_command_line_says_disk_full_in_one_line_and_exits_interrupted(raised, capsys):
    def command():
        raise raised

    assert common.run_command("peftune sweep", command) == common.EXIT_INTERRUPTED == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no space left" in err[0] and "/full/" in err[0], err


# ----------------------------------------------------------------------------- fast: the tracking buffer


class Noted(WriteBuffer):
    """A buffer whose one operation only notes its argument (no MLflow)."""

    def __init__(self, path):
        self.applied: list[int] = []
        super().__init__(record=None, path=path)

    def _op_note(self, value: int) -> None:
        self.applied.append(value)


def test_a_pending_write_refused_for_space_stays_queued_and_leaves_no_line_cut_off(tmp_path, monkeypatch):
    path = tmp_path / "s.tracking-pending.jsonl"
    buffer = Noted(path)
    buffer.put("note", value=1)
    whole = path.read_text()

    def full(fd):
        raise enospc()

    monkeypatch.setattr("peftune.record.tracking_buffer.os.fsync", full)
    buffer.put("note", value=2)  # the append is refused: no exception into Tune's callback, the line taken back
    assert path.read_text() == whole and buffer.pending() == 2
    assert isinstance(buffer.full, DiskFullError) and buffer.full.path == str(path) and buffer.full.needed > 0
    monkeypatch.undo()
    buffer.put("note", value=3)  # space again: the next line is whole, and readable by the next run
    assert [json.loads(line)["seq"] for line in path.read_text().splitlines()] == [1, 3]
    assert buffer.flush(10) and buffer.applied == [1, 2, 3]  # the refused one is written to the store all the same
    buffer.stop()


def test_the_write_thread_survives_a_marker_refused_for_space(tmp_path, monkeypatch):
    """issue 34: the thread died in ``_note_applied`` with a traceback, and nothing was written after."""
    path = tmp_path / "s.tracking-pending.jsonl"
    buffer = Noted(path)
    real = Path.write_text

    def full(self, *args, **kwargs):
        if self.name.endswith(".applied.tmp"):
            real(self, "")  # what the operating system leaves: an empty file
            raise enospc(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    for value in range(3):
        buffer.put("note", value=value)
    assert buffer.flush(10) and buffer.applied == [0, 1, 2]
    assert buffer.full is not None and buffer.full.path.endswith(".applied")
    assert not list(tmp_path.glob("*.tmp"))  # no empty temporary file left behind
    buffer.stop()


@pytest.mark.parametrize("refused", ["database", "artifact"])
def test_a_store_with_no_space_does_not_hold_the_flush_for_its_whole_wait(refused, tmp_path):
    artifact = tmp_path / "mlruns" / "s" / "predictions.json.gz"

    class FullStore(Noted):
        def _op_note(self, value: int) -> None:
            if refused == "artifact":  # MLflow's local artifact store copies the file: the OS names it
                raise enospc(artifact)
            error = sqlite3.OperationalError("database or disk is full")
            error.sqlite_errorname = "SQLITE_FULL"
            raise RuntimeError("(sqlite3.OperationalError) database or disk is full") from error

    buffer = FullStore(tmp_path / "s.tracking-pending.jsonl")
    buffer.record = type("Record", (), {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"})()
    buffer.put("note", value=1)
    started = time.monotonic()
    assert not buffer.flush(60) and time.monotonic() - started < 10
    named = tmp_path / ("mlflow.db" if refused == "database" else "mlruns/s/predictions.json.gz")
    assert buffer.full is not None and buffer.full.path == str(named) and buffer.store_full
    assert buffer.pending() == 1 and (tmp_path / "s.tracking-pending.jsonl").read_text()  # kept for the next run
    buffer.stop()


# ----------------------------------------------------------------------------- fast: Tune's state files


def tune_state(directory: Path, session: str, trials: int) -> None:
    """A session's state files as Ray 2.x and peftune write them: the names do not tell the format (Tune pickles
    ``search_gen_state-*.json``; peftune's searcher writes JSON to ``searcher-state-*.pkl``)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"experiment_state-{session}.json").write_text(json.dumps({"trial_data": list(range(trials))}))
    (directory / f"searcher-state-{session}.pkl").write_text(json.dumps({"trials": trials}))
    (directory / f"search_gen_state-{session}.json").write_bytes(pickle.dumps({"counter": trials}))


def test_state_files_are_complete_whatever_their_names_say(tmp_path):
    tune_state(tmp_path, "s", trials=3)
    files = sorted(tmp_path.iterdir())
    assert len(files) == 3 and all(resume.complete(path) for path in files)  # issue: a .pkl holding JSON set aside
    for path in files:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) - 3])
        assert not resume.complete(path), path.name
    (tmp_path / "empty.json").write_bytes(b"")
    assert not resume.complete(tmp_path / "empty.json")


def test_a_state_file_cut_off_by_a_full_disk_is_replaced_by_its_last_complete_copy(tmp_path):
    experiment = tmp_path / "sweep"
    tune_state(experiment, "2026-01-01_00-00-00", trials=3)
    resume.keep_good_state(experiment)
    tune_state(experiment, "2026-01-01_00-00-00", trials=5)
    state = experiment / "experiment_state-2026-01-01_00-00-00.json"
    text = state.read_text()
    state.write_text(text[: len(text) // 2])  # Tune's copy to the storage path, cut off mid-string
    resume.keep_good_state(experiment)  # an incomplete file never replaces its good copy
    assert not list(experiment.glob(".*.tmp"))

    aside = resume.repair_state(experiment)
    assert json.loads(state.read_text()) == {"trial_data": [0, 1, 2]}  # the previous complete state, as a set:
    searcher = experiment / "searcher-state-2026-01-01_00-00-00.pkl"
    assert json.loads(searcher.read_text()) == {"trials": 3}  # the searcher's of the same save
    assert len(aside) == 3 and state in aside and searcher in aside
    assert (experiment / (state.name + ".set-aside")).read_text() == text[: len(text) // 2]
    assert resume.repair_state(experiment) == []  # complete now: nothing more to do


def test_a_cut_state_without_a_copy_is_set_aside_and_an_earlier_session_is_resumed(tmp_path):
    experiment = tmp_path / "sweep"
    tune_state(experiment, "2026-01-01_00-00-00", trials=3)
    tune_state(experiment, "2026-01-02_00-00-00", trials=5)
    newer = experiment / "experiment_state-2026-01-02_00-00-00.json"
    newer.write_text('{"trial_data": [0, 1, "unterminat')
    resume.repair_state(experiment)
    assert not newer.exists() and (experiment / (newer.name + ".set-aside")).exists()
    assert (experiment / "searcher-state-2026-01-02_00-00-00.pkl").exists()  # complete: it stays
    assert (experiment / "experiment_state-2026-01-01_00-00-00.json").exists()


def test_keeping_the_state_refused_for_space_leaves_the_previous_copy_and_no_temporary_file(tmp_path, monkeypatch):
    experiment = tmp_path / "sweep"
    tune_state(experiment, "s", trials=3)
    resume.keep_good_state(experiment)
    tune_state(experiment, "s", trials=4)
    real = Path.write_bytes

    def full(self, data):
        real(self, data[:3])
        raise enospc(self)

    monkeypatch.setattr(Path, "write_bytes", full)
    with pytest.raises(OSError) as refused:  # raised into Tune's save: the sweep stops on it
        resume.keep_good_state(experiment)
    assert no_space(refused.value) is not None
    monkeypatch.undo()
    assert json.loads((experiment / "experiment_state-s.json.good").read_text()) == {"trial_data": [0, 1, 2]}
    assert not list(experiment.glob(".*.tmp"))


def test_the_lease_renewal_refused_for_space_leaves_no_empty_file(tmp_path, monkeypatch):
    from peftune.sweep import lease

    held = lease.Lease(tmp_path / "leases", "s")
    held.acquire()
    try:
        real = Path.write_text

        def full(self, *args, **kwargs):
            real(self, "")
            raise enospc(self)

        monkeypatch.setattr(Path, "write_text", full)
        with pytest.raises(OSError):
            held.renew()
        monkeypatch.undo()
        assert not list((tmp_path / "leases").glob(".*.tmp")) and held.renew()
    finally:
        held.release()
    assert not [t for t in threading.enumerate() if t.name == "peftune-lease"]


def test_a_state_cut_at_tunes_first_save_is_said_and_not_taken_for_a_new_sweep(tmp_path):
    """A disk full at Tune's first save leaves no complete copy: the sweep says so (exit 2, nothing started) instead
    of "already recorded ... but Ray has no state", which named no cause."""
    from types import SimpleNamespace

    from peftune.base.errors import UserError
    from peftune.sweep import orchestrator

    experiment = tmp_path / "sweep"
    tune_state(experiment, "2026-01-01_00-00-00", trials=1)
    state = experiment / "experiment_state-2026-01-01_00-00-00.json"
    state.write_text('{"trial_data": [0, "unterminat')
    with pytest.raises(UserError, match="was cut off .a full disk.. before a complete copy of it was kept"):
        orchestrator._check_resume(SimpleNamespace(name="s"), None, f"sqlite:///{tmp_path}/m.db", str(experiment))
    assert (experiment / (state.name + ".set-aside")).exists() and not (tmp_path / "m.db").exists()
