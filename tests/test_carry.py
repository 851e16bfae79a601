"""Each budget's contenders tuned under it: a method's tuned setting carried to the sizes of smaller budgets."""

from __future__ import annotations

import mlflow

from peftune.record import legacy
from peftune.sweep import carry, spaces
from sweep_record import TrialSpec, counts, record_sweep

PCT = {1: 0.06, 2: 0.12, 4: 0.24, 8: 0.49, 16: 0.97, 32: 1.95, 64: 3.9}  # lora's rank -> trainable % per task


def children(tmp_path, trials):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _, parent, runs = record_sweep(uri, "carry", ["sst"], trials, artifact_dir=tmp_path / "artifacts")
    client = mlflow.MlflowClient(uri)
    experiment = client.get_run(parent).info.experiment_id
    return client, runs, client.search_runs([experiment], filter_string=f"tags.`mlflow.parentRunId` = '{parent}'")


def test_a_methods_best_setting_is_carried_to_the_largest_size_each_smaller_budget_allows(tmp_path):
    import dataclasses

    definition = spaces.load_sweep(spaces.resolve_sweep_path("sst_tuning"))
    definition = dataclasses.replace(definition, spaces={"lora": definition.spaces["lora"]})
    trials = [
        TrialSpec("best", "lora", {"rank": 64}, [{"sst_accuracy": 0.46}], counts(39_000), "completed", lr=5e-4),
        TrialSpec("default", "lora", {"rank": 8}, [{"sst_accuracy": 0.33}], counts(4_900), "completed", lr=1e-5),
    ]
    _, runs, found = children(tmp_path, trials)
    # sweep_record writes no version tag (nor phase tags): an untagged record
    proposed = carry.carried(definition, found, lambda method, options: PCT[options["rank"]], version=legacy.UNTAGGED)
    by_rank = {c["lora"]["rank"]: c for c in proposed}
    assert sorted(by_rank) == [1, 16]  # <= 0.1%: rank 1; <= 1%: rank 16; <= 10%: the best itself fits
    for config in proposed:
        assert config["lora"]["lr"] == 5e-4  # the tuned rate, not the default's
        assert config["peftune"]["carried_from"] and config["peftune"]["phase"] == "search"
    # carried trials never propose: the same searched trials give the same proposals on a resume
    assert carry.carried(definition, found, lambda m, o: PCT[o["rank"]], version=legacy.UNTAGGED) == proposed
