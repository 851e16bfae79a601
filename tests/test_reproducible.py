"""The same definition, seed, data and code give the same record, whatever the number of workers.

Real Ray Tune, Optuna and MLflow: one small sweep (two methods, three trials each, TPE after one random
draw, per-method ASHA on data-fidelity rungs) run twice, once one trial at a time and once two at a
time. In the default (synchronous) mode a method's next trial waits for its earlier ones, so both runs
must draw the same configurations, stop the same trials at the same rungs and score them the same.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import ray

from conftest import start_local_ray
from peftune.base import record_names
from peftune.core import trial_spec
from peftune.sweep import orchestrator
from tiny_sweep import write_definition

FROZEN = """\
    method: frozen
    lr: {low: 1.0e-3, high: 3.0e-2, log: true}
    dropout: {low: 0.0, high: 0.3}
    weight_decay: 0.0
"""
LORA = """\
    method: lora
    lr: {low: 1.0e-4, high: 1.0e-2, log: true}
    dropout: 0.1
    weight_decay: 0.0
    options:
      rank: {choices: [1, 2, 4]}
"""
SWEEP = """\
    name: {name}
    tasks: [sst]
    methods: [frozen, lora]
    seed: 5
    search: {{objective: single, sampler: tpe, n_startup_trials: 1}}
    scheduler: {{type: asha, fidelity: data, rungs: 2, reduction_factor: 2, min_steps: 0}}
    resources: {{cpus_per_trial: 1, max_concurrent_trials: {concurrency}}}
    max_failures: 0
    checkpoints_per_method: 0
    confirm: {{seeds: 0}}
    budget: tiny
    budgets:
      tiny: {{trials_per_method: 3, epochs: 2, batch_size: 16, max_length: 32, max_train_examples: 48,
              max_dev_examples: 32}}
"""


def definition(directory: Path, name: str, concurrency: int):
    return write_definition(directory, name, {"frozen": FROZEN, "lora": LORA}, SWEEP, concurrency=concurrency)


def recorded(uri: str, parent_run_id: str) -> list[tuple]:
    """Every trial as (method, configuration, status, best score, steps): what a rerun must give again."""
    client = mlflow.MlflowClient(uri)
    experiment = client.get_run(parent_run_id).info.experiment_id
    runs = client.search_runs([experiment], filter_string=f"tags.`mlflow.parentRunId` = '{parent_run_id}'")
    return sorted(
        (
            r.data.params["method"],
            r.data.tags[record_names.CONFIG_KEY],
            r.data.tags[record_names.STATUS],
            round(r.data.metrics.get("best_score", float("nan")), 6),
            r.data.metrics.get("steps"),
        )
        for r in runs
    )


@pytest.mark.long
@pytest.mark.slow
def test_one_or_two_workers_give_the_same_trials_stops_and_scores(tmp_path, tiny_data_dir):
    start_local_ray()
    try:
        records = {}
        for concurrency in (1, 2):
            name = f"repro{concurrency}"
            uri = f"sqlite:///{tmp_path / f'{name}.db'}"
            spec = definition(tmp_path / "defs", name, concurrency)
            result = orchestrator.run_sweep(spec, tiny_data_dir, uri, storage_path=tmp_path / "ray", verbose=0)
            assert result.status == "completed" and result.num_trials == 6
            records[concurrency] = recorded(uri, result.parent_run_id)
    finally:
        ray.shutdown()
    assert len(records[1]) == 6 and len({row[1] for row in records[1]}) == 6  # six configurations, none twice
    assert records[1] == records[2], "the record depends on the number of workers"
    assert {row[2] for row in records[1]} <= {"completed", "early_stopped"}
    assert_record_reruns(uri, result.parent_run_id, tmp_path / "rerun")


def assert_record_reruns(uri: str, parent_run_id: str, output: Path) -> None:
    """A completed search trial's recorded ``peftune train`` command scores what the trial scored, epoch by epoch;
    so does ``peftune train --spec`` of its ``trial_spec.json``, the same trial as the command."""
    client = mlflow.MlflowClient(uri)
    experiment = client.get_run(parent_run_id).info.experiment_id
    runs = client.search_runs(
        [experiment], filter_string=f"tags.`mlflow.parentRunId` = '{parent_run_id}' and params.method = 'lora'"
    )
    run = next(r for r in runs if r.data.tags[record_names.STATUS] == "completed")
    argv = shlex.split(run.data.tags[record_names.TRAIN_COMMAND])
    assert argv[:2] == ["peftune", "train"] and "--threads" in argv and "--selection-examples" in argv
    spec_file = client.download_artifacts(run.info.run_id, trial_spec.ARTIFACT, str(output.parent))
    assert trial_spec.read(spec_file).command() == run.data.tags[record_names.TRAIN_COMMAND]
    history = client.get_metric_history(run.info.run_id, "score")
    trial = {int(m.step): round(m.value, 4) for m in history if float(m.step).is_integer() and m.step >= 1}
    for way, args in (("command", argv[1:]), ("spec", ["train", "--spec", spec_file])):
        command = [
            sys.executable,
            "-m",
            "peftune.cli.commands",
            *args,
            "--output",
            str(output / way),
            "--device",
            "cpu",
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        rerun = {int(e): float(v) for e, v in re.findall(r"^epoch (\d+): .*?  score ([0-9.]+)", done.stdout, re.M)}
        assert rerun and rerun == {e: v for e, v in trial.items() if e in rerun}, (way, rerun, trial)
