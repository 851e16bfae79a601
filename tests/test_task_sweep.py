"""A user's own task through the whole sweep (issue 53): the guide's example task file, with its CSVs beside it and
no data directory, runs the smoke sweep as `jobs/tuning.py` runs it; the record keeps the task's declaration; the
report, read in another process that has no task file, names the task; `peftune evaluate` scores its test file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "questions"


@pytest.mark.slow
def test_the_example_task_runs_the_smoke_sweep_and_its_record_names_it(tmp_path):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    job = [sys.executable, str(REPO / "jobs" / "tuning.py"), "--definition", str(EXAMPLE / "sweep.yaml"),
           "--smoke-test", "--tracking-uri", uri, "--storage-path", str(tmp_path / "ray_results"),
           "--reports-dir", str(tmp_path / "reports")]  # fmt: skip
    done = subprocess.run(job, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    report = (tmp_path / "reports" / "questions_tuning" / "report.md").read_text()
    assert "questions" in report

    client = mlflow.MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("questions_tuning")
    parent = [r for r in client.search_runs([experiment.experiment_id]) if r.data.tags.get("peftune.role") == "sweep"]
    assert len(parent) == 1
    artifact = client.download_artifacts(parent[0].info.run_id, "tasks.json", str(tmp_path))
    recorded = json.loads(Path(artifact).read_text())
    task = recorded["questions"]
    assert task["declaration"]["labels"] == ["description", "location", "number", "person"]
    assert task["declaration"]["metric"] == "f1" and task["rows"]["dev"] == 16 and task["rows"]["decision"] == 16
    assert len(task["examples_sha256"]["train"]) == 64

    # another process, elsewhere, without the task file: the record declares the task
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    again = subprocess.run([sys.executable, "-m", "peftune.cli.commands", "report", "--sweep", "questions_tuning",
                            "--tracking-uri", uri, "--output", str(elsewhere / "report")],
                           cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert "questions_f1" in (elsewhere / "report" / "report.md").read_text() + "".join(
        p.read_text() for p in (elsewhere / "report").glob("*.csv"))  # fmt: skip

    # the final evaluation scores the task's own test file (beside its task file), in yet another process
    # (the record keeps the task's declaration, not where its files were: --data-dir names their folder)
    command = [sys.executable, "-m", "peftune.cli.commands", "evaluate", "--sweep", "questions_tuning",
               "--tracking-uri", uri, "--data-dir", str(EXAMPLE), "--test-dir", str(EXAMPLE), "--seeds", "1", "--top",
               "1", "--output", str(elsewhere / "evaluation")]  # fmt: skip
    evaluated = subprocess.run(command, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=900)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    import pandas as pd

    runs = pd.read_csv(elsewhere / "evaluation" / "evaluation" / "evaluation_runs.csv")  # <output>/evaluation/
    test = runs[runs["split"] == "test"]
    assert len(test) == 1 and 0 <= float(test["questions_f1"].iloc[0]) <= 1, runs.to_string()
