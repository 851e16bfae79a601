"""``--resume`` of a sweep with no saved state is refused in one line, exit 2, before the data is read and before Ray,
MLflow or the report's libraries are imported; with saved state it goes on to the data."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO
from peftune.base.errors import UserError
from peftune.cli import commands
from peftune.cli.sweep_command import TUNER_STATE
from peftune.sweep import spaces

HEAVY = ("ray", "mlflow", "optuna", "transformers", "analysis")  # what the refusal must not wait for


def never_read(*args, **kwargs):
    raise AssertionError("the data was read before --resume was refused")


def argv(tmp_path, data_dir) -> list[str]:
    return ["sweep", "smoke", "--resume", "--data-dir", str(data_dir), "--storage-path", str(tmp_path / "results"),
            "--tracking-uri", f"sqlite:///{tmp_path / 'm.db'}"]  # fmt: skip


@pytest.mark.parametrize("data", ["missing", "empty"])
def test_resume_without_saved_state_is_refused_before_the_data_is_read(data, tmp_path, capsys, monkeypatch):
    """Issue 55: it read and tokenized the data first (seconds), and a missing data directory gave a data error."""
    data_dir = tmp_path / "data"
    if data == "empty":
        data_dir.mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(spaces, "prepare_data", never_read)
    assert commands.main(argv(tmp_path, data_dir)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    state = tmp_path / "results" / "smoke"
    assert err == [f"peftune sweep: error: nothing to resume: no Ray Tune state for sweep 'smoke' at {state}"]
    assert not (tmp_path / "m.db").exists() and not (tmp_path / "results").exists(), "nothing written"


def test_resume_names_the_sweep_its_name_flag_gives(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(spaces, "prepare_data", never_read)
    (tmp_path / "results" / "smoke").mkdir(parents=True)
    (tmp_path / "results" / "smoke" / TUNER_STATE).write_bytes(b"")  # another sweep's state
    assert commands.main([*argv(tmp_path, tmp_path / "data"), "--name", "other"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"no Ray Tune state for sweep 'other' at {tmp_path / 'results' / 'other'}" in err[0]


def test_resume_with_saved_state_goes_on_to_the_data(tmp_path, capsys, monkeypatch):
    def reading(*args, **kwargs):
        raise UserError("the data is read")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(spaces, "prepare_data", reading)
    (tmp_path / "results" / "smoke").mkdir(parents=True)
    (tmp_path / "results" / "smoke" / TUNER_STATE).write_bytes(b"")
    assert commands.main(argv(tmp_path, tmp_path / "data")) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["peftune sweep: error: the data is read"]


def test_the_saved_state_looked_for_is_what_ray_tune_restores_from(tmp_path):
    from ray import tune

    assert not tune.Tuner.can_restore(str(tmp_path))
    (tmp_path / TUNER_STATE).write_bytes(b"")
    assert tune.Tuner.can_restore(str(tmp_path))


LOADED = """
import atexit, os, runpy, sys
heavy = set(os.environ["HEAVY"].split(","))  # at exit, after the refusal: which of them the command loaded
atexit.register(lambda: print("loaded:", sorted({m.split(".")[0] for m in sys.modules} & heavy), file=sys.stderr))
sys.argv = sys.argv[1:]
runpy.run_module("peftune.cli.commands", run_name="__main__", alter_sys=True)
"""


def test_the_refusal_loads_none_of_the_heavy_libraries(tmp_path):
    path = f"{REPO / 'platform'}{os.pathsep}{REPO}"
    env = {**os.environ, "PYTHONPATH": path, "HOME": str(tmp_path), "HEAVY": ",".join(HEAVY)}
    done = subprocess.run([sys.executable, "-c", LOADED, "peftune.cli.commands", *argv(tmp_path, tmp_path / "data")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and lines[-1] == "loaded: []", done.stderr[-2000:]
    assert len(lines) == 2 and "nothing to resume: no Ray Tune state for sweep 'smoke'" in lines[0], lines
