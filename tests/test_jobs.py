"""The SST job's command line: its held-out test directory (the job itself runs end to end in
``test_fresh_machine``, through ``peftune up`` and ``ray job submit`` as the README runs it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import NEGATIVE, POSITIVE, write_task_file

REPO = Path(__file__).resolve().parents[1]


def held_out_dir(directory: Path) -> Path:
    """A labelled SST test file in dev's format, with sentences of its own (a test split must be held out)."""
    directory.mkdir(parents=True, exist_ok=True)
    rows = [[f"{text} , said reviewer {i}", 4 if text in POSITIVE else 0] for i, text in enumerate(POSITIVE + NEGATIVE)]
    write_task_file(directory / "ids-sst-test.csv", ["sentence", "sentiment"], rows)
    return directory


def test_a_bad_test_dir_is_refused_before_the_sweep_starts(tiny_data_dir, tmp_path):
    """A missing test file exits 2 with a one-line error, before Ray starts or a record is written."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    command = [
        sys.executable, "jobs/sst_tuning.py", "--smoke-test", "--data-dir", str(tiny_data_dir), "--tracking-uri", uri,
        "--storage-path", str(tmp_path / "ray_results"), "--test-dir", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "ids-sst-test.csv" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "ray_results").exists()
