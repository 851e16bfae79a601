"""The MLflow UI as the job's printed links open it: a real sweep, a real ``mlflow server``, headless Chromium.

A small sweep (LoRA and adapters, a search and a confirmation with two seeds) runs as ``peftune sweep`` against
an MLflow server started as ``peftune up`` starts it; the links it prints are opened in Chromium and the DOM
after load is read: the trials link lands in the model-training view with every trial and confirmation run
visible, named by method, size, phase and seed, with the score, method, size, trainable-parameter fraction and
phase columns; the sweep's run shows the report's headline as its description; the compare link opens the
frontier's runs; the chart view plots score against size and hyperparameters. Screenshots are kept under
the test's tmp directory (their paths are printed). Skipped only when no Chromium is installed and CI is not set.
"""

from __future__ import annotations

import html
import os
import re
import subprocess

import mlflow
import pytest

from conftest import sweep_command
from peftune.base import record_names
from peftune.cli import services
from test_fresh_machine import free_ports
from test_report_html import find_browser
from tiny_sweep import write_definition

pytestmark = pytest.mark.slow

SPACES = {
    "lora": """\
        method: lora
        lr: {low: 1.0e-3, high: 5.0e-3, log: true}
        dropout: 0.1
        weight_decay: 0.0
        options:
          rank: {choices: [1, 2]}
    """,
    "adapter": """\
        method: adapter
        lr: {low: 1.0e-3, high: 5.0e-3, log: true}
        dropout: 0.1
        weight_decay: 0.0
        options:
          bottleneck: {choices: [4, 8]}
    """,
}
SWEEP = """\
    name: {name}
    tasks: [sst]
    methods: [lora, adapter]
    seed: 0
    search: {{objective: single, sampler: tpe, n_startup_trials: 10}}
    scheduler: {{type: none}}
    resources: {{cpus_per_trial: 1, max_concurrent_trials: 2}}
    max_failures: 0
    checkpoints_per_method: 0
    # no seeds added: a bounded run time
    confirm: {{contenders: 0, anchors: false, top_k: 1, seeds: 2, defaults: false, max_seeds: 2}}
    budget: tiny
    budgets:
      tiny: {{trials_per_method: 2, epochs: 1, batch_size: 16, max_length: 32, max_train_examples: 48,
              max_dev_examples: 32}}
"""


@pytest.fixture
def server(tmp_path):
    """``mlflow server`` as ``peftune up`` starts it (its artifact root, ./mlartifacts, in tmp_path)."""
    port = free_ports(1)[0]
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        services.start_mlflow(port, f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "mlflow-server.log")
    finally:
        os.chdir(cwd)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        services._stop(services.mlflow_processes(port))


def browse(browser: str, url: str, profile, screenshot=None, budget_ms: int = 25_000) -> str:
    """The page after its scripts ran (``--virtual-time-budget``): the DOM, or a screenshot written to ``screenshot``.

    A fresh profile each time: what a user's first visit sees (no view state kept in the browser's storage)."""
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--no-first-run", f"--user-data-dir={profile}",
               "--window-size=1800,1000", f"--virtual-time-budget={budget_ms}"]  # fmt: skip
    command += [f"--screenshot={screenshot}"] if screenshot else ["--dump-dom"]
    done = subprocess.run([*command, url], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def text_of(dom: str) -> str:
    """The page's visible words, one space apart (styles and scripts dropped)."""
    dom = re.sub(r"<(style|script)\b.*?</\1>", " ", dom, flags=re.S)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", dom)))


def printed(output: str, label: str) -> str:
    found = re.search(rf"^{re.escape(label)}.*?(http://\S+)$", output, flags=re.M)
    assert found, f"the job printed no {label!r} link:\n{output[-3000:]}"
    return found.group(1)


@pytest.mark.long
def test_the_printed_links_open_the_trials_the_answer_and_the_frontier(server, tmp_path, tiny_data_dir):
    browser = find_browser()
    definition = write_definition(tmp_path / "defs", "ui_sweep", SPACES, SWEEP)
    command = sweep_command(tmp_path / "defs" / "ui_sweep.yaml", tiny_data_dir, server, tmp_path)
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    trials_link = printed(done.stdout, "MLflow UI:")
    sweep_link = printed(done.stdout, "MLflow sweep run")
    compare_link = printed(done.stdout, "MLflow compare")

    runs = mlflow.MlflowClient(server).search_runs(
        [mlflow.MlflowClient(server).get_experiment_by_name(definition.name).experiment_id],
        filter_string=f"tags.`{record_names.ROLE}` = 'trial'",
    )
    names = sorted(run.info.run_name for run in runs)  # 4 search trials, then each method's best with 2 seeds
    named = re.compile(r"(lora r=[12]|adapter m=[48]) · (search|confirm s\d+)")
    assert len(runs) >= 8 and all(named.fullmatch(name) for name in names), names

    shots = {name: tmp_path / f"{name}.png" for name in ("trials", "sweep_run", "compare")}
    for name, link in (("trials", trials_link), ("sweep_run", sweep_link), ("compare", compare_link)):
        browse(browser, link, tmp_path / f"profile-{name}-shot", screenshot=shots[name])
        print(f"screenshot of {name}: {shots[name]}")
    trials = text_of(browse(browser, trials_link, tmp_path / "profile-trials"))
    (tmp_path / "trials.txt").write_text(trials)

    # the training view (GenAI's side bar has Sessions and Judges), the trials' own columns, every run by name
    assert "Model training" in trials and "Sessions" not in trials and "Judges" not in trials
    for column in ("peftune.phase", "method", "peftune.size", "best_score", "dev_score",
                   "trainable_params_per_task_pct", "Dataset"):  # fmt: skip
        assert column in trials, column
    for name in set(names):
        assert name in trials, name
    assert f"{len(runs)} matching runs" in trials
    assert "ids-sst-train.csv" in trials  # the Dataset column: the training file, logged as an MLflow dataset
    for path in shots.values():
        assert path.stat().st_size > 20_000, path

    # the chart view (the chart button: one click; here its URL parameter) plots the sweep's own charts
    charts = text_of(browse(browser, f"{trials_link}&compareRunsMode=CHART", tmp_path / "profile-charts", None, 60_000))
    assert "Trials: score against size and hyperparameters" in charts and "Parallel Coordinates" in charts
    assert "dev_examples.sst" not in charts  # what it plotted before: the parent's first metric

    answer = text_of(browse(browser, sweep_link, tmp_path / "profile-sweep"))
    (tmp_path / "sweep_run.txt").write_text(answer)
    # its description opens with the report's headline (the tables are under "Show more")
    assert "Pick per budget" in answer and "cheapest first" in answer and "Compare its" in answer
    compare = text_of(browse(browser, compare_link, tmp_path / "profile-compare"))
    frontier = [run.info.run_name for run in runs if run.info.run_id in compare_link]
    assert frontier and all(name in compare for name in frontier)
