"""The MLflow UI on first open: a real `mlflow server`, a sweep's record, headless Chromium.

The experiment opens in the model-training view (the tag ``open_sweep`` sets) with the sweep's
parent run; the README's search lists the trials ranked by their score. Skipped only when no
Chromium is installed and CI is not set.
"""

from __future__ import annotations

import os
import re
import subprocess
import urllib.parse

import pytest

from peftune import services, tracking
from sweep_record import TrialSpec, counts, record_sweep
from test_fresh_machine import free_ports
from test_report_html import find_browser

pytestmark = pytest.mark.slow


@pytest.fixture
def server(tmp_path):
    port = free_ports(1)[0]
    cwd = os.getcwd()
    os.chdir(tmp_path)  # the server's artifact root (./mlartifacts) goes here
    try:
        services.start_mlflow(port, f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "mlflow-server.log")
    finally:
        os.chdir(cwd)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        services._stop(services.mlflow_processes(port))


def browse(browser: str, url: str, profile, screenshot=None) -> str:
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--no-first-run", f"--user-data-dir={profile}",
               "--window-size=2800,1200", "--virtual-time-budget=20000"]  # fmt: skip
    command += [f"--screenshot={screenshot}"] if screenshot else ["--dump-dom"]
    done = subprocess.run([*command, url], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_runs_page_shows_trials_and_scores(server, tmp_path):
    import mlflow

    browser = find_browser()
    trials = [
        TrialSpec("t1", "lora", {"rank": 8}, [{"sst_accuracy": 0.41}], counts(1000)),
        TrialSpec("t2", "adapter", {"bottleneck": 16}, [{"sst_accuracy": 0.37}], counts(3000), status="early_stopped"),
    ]
    experiment_id, parent_id, runs = record_sweep(server, "ui_sweep", ["sst"], trials, artifact_dir=tmp_path / "a")
    client = mlflow.MlflowClient(server)
    client.set_experiment_tag(experiment_id, tracking.EXPERIMENT_KIND_TAG, tracking.EXPERIMENT_KIND)
    tracking.log_sweep_summary(client, tracking.SweepRecord(server, experiment_id, parent_id, resumed=False))

    # first open: the training view with the sweep's parent run (MLflow 3.17 shows no metric columns
    # until picked; the parent's summary metrics are in its row's "Show more columns" and run page)
    url = f"{server}/#/experiments/{experiment_id}/runs"
    first = browse(browser, url, tmp_path / "profile1")
    (tmp_path / "first.html").write_text(first)
    # the trials, best first: the README's way (search the trials, sort by best_score)
    query = urllib.parse.urlencode(
        {"searchFilter": "tags.`peftune.role` = 'trial'", "orderByKey": "metrics.`best_score`", "orderByAsc": "false"}
    )
    browse(browser, f"{url}?{query}", tmp_path / "profile2", screenshot=tmp_path / "trials.png")
    ranked = browse(browser, f"{url}?{query}", tmp_path / "profile3")
    (tmp_path / "trials.html").write_text(ranked)

    assert "Training runs" in first and "ui_sweep" in first
    assert (tmp_path / "trials.png").stat().st_size > 10_000
    assert "lora-t1" in ranked and "adapter-t2" in ranked
    assert ranked.index("lora-t1") < ranked.index("adapter-t2")  # sorted by score, best first
    assert "Sort: best_score" in re.sub(r"<[^>]+>", "", ranked)  # the ranking the table applies
    # (MLflow 3.17 shows metric columns only once picked under "Columns": not asserted here)
