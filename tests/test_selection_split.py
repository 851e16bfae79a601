"""Three roles of data: the selection split is carved from train rows no trial trains on, apart from dev.

On the real SST files (the cpu budget's shape: 2,400 of 8,544 train rows) and on the toy files: the
selection rows are disjoint from the training rows and from dev, the same for the same seed (so a
resumed sweep selects on the same rows), nested with the training subset a budget gives without one,
and held out of training when the budget uses the whole file.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import SHARED_DATA
from peftune.core import train
from peftune.core.trial_spec import DataSettings
from peftune.inputs.data import DataError, carve, load_tasks
from peftune.inputs.tasks import parse_tasks


def lines(split) -> set[int]:
    return set(split.lines.tolist())


def load(directory, tokenizer, **budget):
    return load_tasks(DataSettings(str(directory), max_length=32, **budget), parse_tasks(["sst"]), tokenizer)["sst"]


def test_selection_rows_are_train_rows_no_trial_trains_on(tiny_data_dir, tokenizer):
    task = load(tiny_data_dir, tokenizer, max_train_examples=40, selection_examples=None)
    assert len(task.selection) == len(task.dev) == 32  # as many as dev has, by default
    assert len(task.train) == 40
    assert not lines(task.selection) & lines(task.train)
    assert task.selection.source == task.train.source != task.dev.source  # from the train file, never dev
    # the same rows for the same seed: a resumed sweep selects on what it selected on before
    again = load(tiny_data_dir, tokenizer, max_train_examples=40, selection_examples=None)
    assert torch.equal(again.selection.lines, task.selection.lines)
    other = load(tiny_data_dir, tokenizer, max_train_examples=40, selection_examples=None, seed=1)
    assert not torch.equal(other.selection.lines, task.selection.lines)


def test_the_training_rows_do_not_change_where_the_budget_leaves_room(tiny_data_dir, tokenizer):
    without = load(tiny_data_dir, tokenizer, max_train_examples=40)
    with_selection = load(tiny_data_dir, tokenizer, max_train_examples=40, selection_examples=20)
    assert torch.equal(without.train.lines, with_selection.train.lines)
    assert without.selection is None


def test_a_budget_that_uses_the_whole_file_gives_up_the_selection_rows(tiny_data_dir, tokenizer):
    task = load(tiny_data_dir, tokenizer, selection_examples=16)  # 96 train rows, no cap
    assert len(task.train) == 80 and len(task.selection) == 16
    assert lines(task.train) | lines(task.selection) == lines(load(tiny_data_dir, tokenizer).train)


def test_a_selection_split_that_leaves_nothing_to_train_on_is_refused(tiny_data_dir, tokenizer):
    full = load(tiny_data_dir, tokenizer)
    with pytest.raises(DataError, match="selection_examples 96 of 96 rows"):
        carve(full.train, None, 96, seed=0)


def test_a_split_that_was_not_prepared_is_never_replaced_by_another(tiny_data_dir, tokenizer):
    task = load(tiny_data_dir, tokenizer)
    with pytest.raises(ValueError, match="no 'selection' split"):
        task.split("selection")


@pytest.mark.skipif(not (SHARED_DATA / "ids-sst-train.csv").is_file(), reason="the real data is not here")
def test_on_the_real_sst_files_the_cpu_budget_keeps_its_2400_rows(tokenizer):
    task = load(SHARED_DATA, tokenizer, max_train_examples=2400, selection_examples=None)
    assert len(task.train) == 2400 and len(task.selection) == len(task.dev) == 550
    assert not lines(task.selection) & lines(task.train)
    plain = load(SHARED_DATA, tokenizer, max_train_examples=2400)
    assert torch.equal(plain.train.lines, task.train.lines)  # the selection split cost the training nothing


def test_a_search_trial_is_judged_on_selection_and_a_confirmation_run_reports_dev(tiny_prepared):
    search = train.TrainConfig(method="frozen", tasks=["sst"], epochs=1, batch_size=16, eval_splits=["selection"])
    metrics = train.run_trial(search, tiny_prepared).history[-1]
    assert "selection_score" in metrics and metrics["selection_score"] == metrics["score"]
    assert not any(key.startswith("dev_") for key in metrics)  # a search trial never sees dev
    confirm = train.TrainConfig(
        method="frozen",
        tasks=["sst"],
        epochs=1,
        batch_size=16,
        eval_splits=["selection", "dev"],
        predictions_of=("dev",),
    )
    reports = []
    train.run_trial(confirm, tiny_prepared, lambda metrics, save: reports.append(metrics))
    final = reports[-1]
    assert final["score"] == final["selection_score"] and "dev_score" in final and "dev_sst_accuracy" in final
    predicted = final["predictions"]["dev"]["sst"]
    labels = tiny_prepared.tasks["sst"].dev.labels.tolist()
    assert len(predicted) == len(labels)
    accuracy = sum(p == y for p, y in zip(predicted, labels, strict=True)) / len(labels)
    assert accuracy == pytest.approx(final["dev_sst_accuracy"])  # the predictions are the dev score's


def test_a_one_epoch_confirmation_run_evaluates_dev_once_and_names_its_numbers_dev(tiny_prepared, monkeypatch):
    """With one epoch there is no epoch for selection to choose and no scheduler to serve at a rung: the run's
    one evaluation is dev's, and its numbers carry dev's name as in a run that also evaluated selection."""
    from peftune.base import record_names
    from peftune.sweep import worker

    settings = worker.TrialSettings("s", ("sst",), epochs=1, batch_size=16, seed=0, phase=record_names.CONFIRM,
                                    train={"report_fractions": [1 / 3]})  # fmt: skip
    config = settings.train_config("frozen", {"lr": 1e-3, "dropout": 0.0, "weight_decay": 0.0})
    assert config.eval_splits == ["dev"] and config.predictions_of == ("dev",) and config.report_fractions == []
    data = DataSettings("data", selection_examples=8, decision_examples=8)
    decided = dataclasses.replace(settings, data=data).train_config(
        "frozen", {"lr": 1e-3, "dropout": 0.0, "weight_decay": 0.0}
    )
    assert decided.eval_splits == ["dev", "decision"] and decided.predictions_of == ("decision", "dev")
    two = dataclasses.replace(settings, epochs=2).train_config(
        "frozen", {"lr": 1e-3, "dropout": 0.0, "weight_decay": 0.0}
    )
    assert two.eval_splits == ["selection", "dev"]  # two epochs: selection chooses one
    search = dataclasses.replace(settings, phase=record_names.SEARCH)
    searched = search.train_config("frozen", {"lr": 1e-3, "dropout": 0.0, "weight_decay": 0.0})
    assert searched.eval_splits == ["selection"] and searched.report_fractions == [1 / 3]

    evaluated, reports = [], []
    predict = train.predict

    def counted(model, tasks, split, *args, **kwargs):
        evaluated.append(split)
        return predict(model, tasks, split, *args, **kwargs)

    monkeypatch.setattr(train, "predict", counted)
    train.run_trial(config, tiny_prepared, lambda metrics, save: reports.append(metrics))
    assert evaluated == ["dev"]
    final = reports[-1]
    assert final["score"] == final["dev_score"] and "dev_sst_accuracy" in final and "selection_score" not in final
    labels = tiny_prepared.tasks["sst"].dev.labels.tolist()
    accuracy = sum(p == y for p, y in zip(final["predictions"]["dev"]["sst"], labels, strict=True)) / len(labels)
    assert accuracy == pytest.approx(final["dev_sst_accuracy"])
