"""Every Optuna study of a sweep in the Optuna storage, its trials pointing at their Ray trials and MLflow runs.

One real tiny sweep per search (per-method TPE, joint TPE, multi-objective NSGA-II): afterwards the studies
load from the storage (as optuna-dashboard does), every Optuna trial carries the Ray trial id and the MLflow
run id of one trial run of the record, and every trial run names its study and Optuna trial back.
"""

from __future__ import annotations

import mlflow
import optuna
import pytest
import ray

from conftest import start_local_ray
from peftune.sweep import orchestrator, search
from tiny_sweep import FROZEN_AND_TOP_K, write_definition

METHODS = FROZEN_AND_TOP_K
SWEEP = """\
    name: {name}
    tasks: [sst]
    methods: [frozen, top_k]
    seed: 5
    search: {search}
    scheduler: {{type: none}}
    resources: {{cpus_per_trial: 1, max_concurrent_trials: 2}}
    max_failures: 0
    checkpoints_per_method: 0
    confirm: {{seeds: 0}}
    budget: tiny
    budgets:
      tiny: {{trials_per_method: 2, epochs: 1, batch_size: 16, max_length: 32, max_train_examples: 32,
              max_dev_examples: 16}}
"""
SEARCHES = {
    "per_method": "{objective: single, sampler: tpe, n_startup_trials: 2, allocation: per_method}",
    "joint": "{objective: single, sampler: tpe, n_startup_trials: 2, allocation: joint}",
    "nsga2": "{objective: multi, sampler: nsga2}",
}


@pytest.fixture(scope="module")
def local_ray():
    start_local_ray()
    yield
    ray.shutdown()


@pytest.mark.parametrize("kind", ["per_method", *(pytest.param(k, marks=pytest.mark.slow) for k in ("joint", "nsga2"))])
def test_every_study_is_stored_and_its_trials_link_ray_and_mlflow(kind, local_ray, tmp_path, tiny_data_dir):
    definition = write_definition(tmp_path / "defs", kind, METHODS, SWEEP, search=SEARCHES[kind])
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = orchestrator.run_sweep(definition, tiny_data_dir, uri, storage_path=tmp_path / "ray", reports_dir=tmp_path)
    assert result.status == "completed", result.summary()

    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=[kind])
    children = runs[runs["tags.peftune.role"] == "trial"]
    assert len(children) == 4
    run_of = dict(zip(children["tags.peftune.trial_id"], children["run_id"], strict=True))

    storage = f"sqlite:///{tmp_path / 'optuna.db'}"  # beside the SQLite MLflow store, where dashboard looks
    names = search.study_names(definition)
    assert names == (["per_method.frozen", "per_method.top_k"] if kind == "per_method" else [kind])
    assert sorted(optuna.get_all_study_names(storage)) == names
    linked = {}
    for name in names:
        for trial in optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False):
            assert trial.state.is_finished(), (name, trial.number, trial.state)
            ray_id = trial.user_attrs[search.RAY_TRIAL_ATTR]
            assert trial.user_attrs[search.MLFLOW_RUN_ATTR] == run_of[ray_id], (name, trial.number)
            linked[ray_id] = (name, trial.number)
    assert sorted(linked) == sorted(run_of)  # every trial run has exactly one Optuna trial, and back
    for _, run in children.iterrows():  # and each MLflow run names its study and trial
        name, number = linked[run["tags.peftune.trial_id"]]
        assert (run["tags.peftune.optuna_study"], run["tags.peftune.optuna_trial"]) == (name, str(number))
    if kind == "nsga2":
        (study,) = (optuna.load_study(study_name=kind, storage=storage),)
        assert len(study.directions) == 2 and study.best_trials  # both objectives told, a Pareto front
