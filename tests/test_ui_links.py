"""What the MLflow UI is given: run names, the links the job prints, the shared view, the datasets (fast, real MLflow).

The browser itself opens them in ``test_mlflow_ui.py`` (slow tier).
"""

from __future__ import annotations

import json
import urllib.parse

import mlflow
import pytest

from peftune.base import record_names
from peftune.core.train import prepare
from peftune.inputs.data import DataSettings
from peftune.methods.sizes import size_label
from peftune.record import ui_links, writer
from peftune.record.writer import TrialWrites
from tiny_sweep import write_definition

LORA = """\
    method: lora
    lr: {low: 1.0e-3, high: 5.0e-3, log: true}
    dropout: 0.1
    weight_decay: 0.0
    options:
      rank: {choices: [2, 8]}
"""
SWEEP = """\
    name: {name}
    tasks: [sst]
    methods: [lora]
    seed: 0
    scheduler: {{type: none}}
    budget: tiny
    budgets:
      tiny: {{trials_per_method: 2, epochs: 1, batch_size: 16, max_length: 32, max_train_examples: 16,
              max_dev_examples: 8}}
"""


@pytest.mark.parametrize(
    ("method", "params", "phase", "seed", "default", "name"),
    [
        ("lora", {"method.rank": 8}, "search", 0, False, "lora r=8 · search"),
        ("adapter", {"method.bottleneck": 32.0}, "confirm", 3, False, "adapter m=32 · confirm s3"),
        ("lora_adapter", {"method.rank": 4, "method.bottleneck": 16}, "search", 0, True,
         "lora_adapter r=4 m=16 · search default"),
        ("bitfit", {}, "confirm", 1, False, "bitfit · confirm s1"),
        ("prefix", {"method.prefix_length": 10}, "search", 0, False, "prefix l=10 · search"),
    ],
)  # fmt: skip
def test_a_run_name_says_method_size_phase_and_seed(method, params, phase, seed, default, name):
    assert record_names.run_label(method, size_label(method, params), phase, seed, default) == name


def test_links_open_the_training_view_the_trials_and_the_compare_page():
    trials = ui_links.trials_address("http://127.0.0.1:5000/", "7")
    assert trials.startswith("http://127.0.0.1:5000/#/experiments/7/runs?")
    query = urllib.parse.parse_qs(trials.split("?", 1)[1])
    assert query == {"workflowType": ["machine_learning"], "viewStateShareKey": [record_names.TRIALS_VIEW_KEY]}
    # a local store: the address `mlflow ui` serves, and the command that serves it
    assert ui_links.ui_hint("sqlite:////tmp/x/mlflow.db", "7") == (
        "http://127.0.0.1:5000/#/experiments/7/runs?" + urllib.parse.urlencode(query, doseq=True),
        "mlflow ui --backend-store-uri sqlite:////tmp/x/mlflow.db --host 127.0.0.1 --port 5000",
    )
    compare = ui_links.compare_address("http://h:5000", "7", ["a1", "b2"])
    fields = urllib.parse.parse_qs(compare.split("?", 1)[1])
    assert compare.startswith("http://h:5000/#/compare-runs?")
    assert json.loads(fields["runs"][0]) == ["a1", "b2"] and json.loads(fields["experiments"][0]) == ["7"]


def test_the_sweep_record_holds_the_shared_view_and_the_data_as_datasets(tmp_path, tiny_data_dir):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    definition = write_definition(tmp_path / "defs", "ui_record", {"lora": LORA}, SWEEP)
    settings = DataSettings(str(tiny_data_dir), max_length=32, max_train_examples=16, max_dev_examples=8)
    prepared = prepare(settings, ["sst"])
    datasets = writer.data_inputs(prepared)
    opened = writer.open_sweep(
        uri, definition, data_hashes=prepared.file_hashes, ray_experiment_path=str(tmp_path / "ray"),
        expect_existing=False, datasets=datasets,
    )  # fmt: skip
    client = mlflow.MlflowClient(uri)

    tags = client.get_experiment(opened.experiment_id).tags
    view = json.loads(tags[record_names.SHARED_VIEW_TAG + record_names.TRIALS_VIEW_KEY])
    assert view == ui_links.trials_view() and view["searchFilter"] == "tags.`peftune.role` = 'trial'"

    # the parent: both files, digests from data_hashes.json, what each was for
    inputs = client.get_run(opened.parent_run_id).inputs.dataset_inputs
    seen = {(i.dataset.name, i.dataset.digest, i.tags[0].value) for i in inputs}
    hashes = prepared.file_hashes
    assert seen == {
        ("ids-sst-train.csv", hashes["ids-sst-train.csv"][:12], "training"),
        ("ids-sst-dev.csv", hashes["ids-sst-dev.csv"][:12], "dev"),
    }
    assert all(json.loads(i.dataset.profile)["sha256"] == hashes[i.dataset.name] for i in inputs)

    # a trial run through the write buffer, written twice (a retried write): one run, one input per file
    buffer = TrialWrites(opened, None)
    for _ in range(2):
        buffer.put("trial_run", trial_id="t1", run_name="lora r=8 · confirm s1", method="lora", sweep=definition.name,
                   params={"lr": "0.001"}, tags={record_names.SIZE_TAG: "r=8"},
                   datasets=writer.inputs_of("confirm", opened.datasets))  # fmt: skip
    assert buffer.flush(120)
    buffer.stop()
    runs = client.search_runs([opened.experiment_id], f"tags.`{record_names.TRIAL_ID}` = 't1'")
    assert len(runs) == 1 and runs[0].info.run_name == "lora r=8 · confirm s1"
    assert sorted(i.dataset.name for i in runs[0].inputs.dataset_inputs) == ["ids-sst-dev.csv", "ids-sst-train.csv"]
    assert [d["context"] for d in writer.inputs_of("search", opened.datasets)] == ["training"]
