"""One trial end to end: determinism, reporting, checkpoints that reproduce, resume, divergence."""

import functools
import json

import pytest
import torch

from conftest import tiny_backbone
from peftune.core import checkpoint, train
from peftune.core.model import MultitaskModel
from peftune.inputs.tasks import parse_tasks


def config(**overrides) -> train.TrainConfig:
    values = dict(
        method="lora",
        method_options={"rank": 4},
        tasks=["sst", "para", "sts"],
        lr=3e-3,
        epochs=2,
        batch_size=16,
        seed=0,
        log_every=0,
    )
    return train.TrainConfig(**(values | overrides))


def test_same_seed_same_result(tiny_prepared):
    first = train.run_trial(config(), tiny_prepared).history
    second = train.run_trial(config(), tiny_prepared).history
    drop_times = lambda h: [{k: v for k, v in m.items() if not k.endswith(("_s", "tokens_per_s"))} for m in h]  # noqa: E731
    assert drop_times(first) == drop_times(second)
    other_seed = train.run_trial(config(seed=1), tiny_prepared).history
    assert drop_times(other_seed) != drop_times(first)


def test_heads_train_at_their_own_rate(tiny_prepared):
    """With head_lr, the heads move at their rate and the method's parameters at lr (here: not at all)."""
    cfg = config(method="lora", lr=1e-12, head_lr=3e-2, epochs=1)
    model = train.build_model(cfg, tiny_prepared.backbone.build(), tiny_prepared.backbone.pooling)
    start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trained = train.run_trial(cfg, tiny_prepared).model
    moved = {n: not torch.allclose(p, start[n], atol=1e-6) for n, p in trained.named_parameters() if n in start}
    heads = {n for n in moved if n.startswith("heads.")}
    assert heads and all(moved[n] for n in heads)
    lora_b = [n for n in moved if "lora_B" in n]  # zero at init: any step at lr would move it off zero
    assert lora_b and not any(moved[n] for n in lora_b)


def test_head_lr_defaults_to_lr_and_frozen_heads_train_at_lr():
    groups = train.build_optimizer(train.build_model(config(), tiny_backbone()), config(lr=2e-3)).param_groups
    assert {g["lr"] for g in groups} == {2e-3}
    frozen = config(method="frozen", method_options={}, lr=2e-3, head_lr=1e-1)  # its heads are its method
    groups = train.build_optimizer(train.build_model(frozen, tiny_backbone()), frozen).param_groups
    assert {g["lr"] for g in groups} == {2e-3} and frozen.heads_lr == 2e-3
    with pytest.raises(train.UserError, match="head_lr"):
        config(head_lr=float("nan"))


def test_reports_every_epoch_with_metrics_and_counts(tiny_prepared):
    reports = []
    train.run_trial(config(epochs=3), tiny_prepared, lambda metrics, save: reports.append(metrics))
    assert [m["epoch"] for m in reports] == [1, 2, 3]
    for key in (
        "sst_accuracy",
        "para_accuracy",
        "sts_pearson",
        "score",
        "train_loss",
        "trainable_params_per_task",
        "trainable_params_per_task_pct",
        "stored_params",
        "stored_params_pct",
        "epoch_time_s",
    ):
        assert key in reports[-1], key
    last = reports[-1]
    assert last["score"] == pytest.approx((last["sst_accuracy"] + last["para_accuracy"] + last["sts_pearson"]) / 3)
    assert last["trainable_params_per_task"] == 2 * 3 * 4 * (32 + 32)  # 2 layers x q,k,v x r (d_in + d_out)


def test_reports_at_data_fidelity_rungs_within_an_epoch_without_a_checkpoint(tiny_prepared):
    reports = []
    run = config(epochs=3, batch_size=4, report_fractions=[1 / 9, 1 / 3])
    train.run_trial(run, tiny_prepared, lambda metrics, save: reports.append((metrics, save)))
    partial = [m for m, save in reports if m.get("partial")]
    assert all(save is None for m, save in reports if m.get("partial"))
    assert all(save is not None for m, save in reports if not m.get("partial"))
    # 1/9 of the run falls inside the first epoch; 1/3 is its end, which reports anyway
    assert len(partial) == 1 and partial[0]["epoch"] == 0 and 1 / 9 <= partial[0]["progress"] < 1 / 3
    epochs = [m for m, _ in reports if not m.get("partial")]
    assert [m["progress"] for m in epochs] == pytest.approx([1 / 3, 2 / 3, 1])
    steps = [m["steps"] for m, _ in reports]
    seen = [m["examples_seen"] for m, _ in reports]
    assert steps == sorted(steps) and seen == sorted(seen) and seen[-1] == 3 * seen[1]
    with pytest.raises(ValueError, match="report_fractions"):
        config(report_fractions=[1.0])


def test_rung_evaluations_count_as_evaluation_not_training(tiny_prepared):
    reports = []
    run = config(epochs=2, batch_size=4, report_fractions=[1 / 9])
    train.run_trial(run, tiny_prepared, lambda metrics, save: reports.append(metrics))
    epochs = [m for m in reports if not m.get("partial")]
    (rung,) = [m for m in reports if m.get("partial")]  # a trial stopped here still says where its time went
    assert 0 < rung["eval_total_s"] < epochs[0]["eval_total_s"] and rung["startup_s"] > 0
    totals = [m["eval_total_s"] for m in epochs]
    # the total is cumulative; the rung's evaluation (inside epoch 1) makes it exceed the epochs' own
    assert totals == sorted(totals) and totals[-1] > sum(m["eval_time_s"] for m in epochs) > 0
    assert epochs[-1]["train_time_s"] == pytest.approx(sum(m["epoch_time_s"] for m in epochs))


def test_learns_the_toy_tasks(tiny_prepared):
    # the heads draw their initialisation first now (the backbone is built on the meta device): lr 3e-3
    run = config(method="full", method_options={}, epochs=5, lr=3e-3, pooling="mean")
    history = train.run_trial(run, tiny_prepared).history
    assert history[-1]["train_loss"] < 0.8 * history[0]["train_loss"]
    assert history[-1]["sst_accuracy"] > 0.8  # two well-separated classes in the toy file


def test_checkpoint_reproduces_dev_metrics_exactly(tiny_prepared, tmp_path):
    saved = {}

    def report(metrics, save):
        save(tmp_path / f"epoch{metrics['epoch']}")
        saved[metrics["epoch"]] = metrics

    train.run_trial(config(), tiny_prepared, report)
    model = checkpoint.load_checkpoint(tmp_path / "epoch2", backbone=tiny_prepared.backbone.build())
    dev = train.evaluate(model, tiny_prepared.tasks, 32, torch.device("cpu"))
    assert dev == {k: saved[2][k] for k in dev}
    meta = json.loads((tmp_path / "epoch2" / "peftune.json").read_text())
    assert meta["method"] == "lora" and meta["epoch"] == 2
    # the optimizer state is kept to resume from, so not in the last epoch's checkpoint: no step follows it
    files = {"trainable.safetensors", "peftune.json"}
    assert {p.name for p in (tmp_path / "epoch1").iterdir()} == files | {"optimizer.safetensors"}
    assert {p.name for p in (tmp_path / "epoch2").iterdir()} == files
    finished = train.run_trial(config(), tiny_prepared, resume_from=tmp_path / "epoch2")
    assert [m["epoch"] for m in finished.history] == [1, 2]
    assert train.evaluate(finished.model, tiny_prepared.tasks, 32, torch.device("cpu")) == dev
    # a checkpoint without that state from an epoch before the last is refused: training would go on from it
    checkpoint.save_checkpoint(
        finished.model, tmp_path / "bare", config=config(), epoch=1, history=finished.history[:1]
    )
    with pytest.raises(checkpoint.CheckpointError, match="no optimizer state"):
        train.run_trial(config(), tiny_prepared, resume_from=tmp_path / "bare")


@pytest.mark.parametrize("method, options", [("lora", {"rank": 4}), ("full", {})])
def test_resume_continues_exactly(tiny_prepared, tmp_path, method, options):
    # full fine-tuning changes the backbone itself: its checkpoint must still be accepted
    config = functools.partial(globals()["config"], method=method, method_options=options)
    full_run = train.run_trial(config(epochs=3), tiny_prepared).history

    def stop_after_first(metrics, save):
        if metrics["epoch"] == 1:
            save(tmp_path)
            raise KeyboardInterrupt  # the trial dies after its first checkpoint

    with pytest.raises(KeyboardInterrupt):
        train.run_trial(config(epochs=3), tiny_prepared, stop_after_first)
    resumed = train.run_trial(config(epochs=3), tiny_prepared, resume_from=tmp_path).history
    assert [m["epoch"] for m in resumed] == [1, 2, 3]
    for a, b in zip(full_run, resumed, strict=True):
        assert a["score"] == b["score"] and a["train_loss"] == b["train_loss"]


def test_checkpoint_for_another_backbone_or_method_is_refused(tiny_prepared, tmp_path):
    result = train.run_trial(config(epochs=1), tiny_prepared)
    checkpoint.save_checkpoint(result.model, tmp_path)
    other = tiny_prepared.backbone.build()
    with torch.no_grad():
        other.embeddings.word_embeddings.weight.add_(1.0)
    with pytest.raises(checkpoint.CheckpointError, match="fingerprint"):
        checkpoint.load_checkpoint(tmp_path, backbone=other)
    adapter_model = MultitaskModel(tiny_prepared.backbone.build(), parse_tasks("sst,para,sts"), "adapter")
    with pytest.raises(checkpoint.CheckpointError, match="for method 'lora', not 'adapter'"):
        checkpoint.load_trainable(adapter_model, tmp_path)


def test_divergence_stops_the_trial(tiny_prepared):
    with pytest.raises(train.TrainingDiverged, match="loss is (nan|inf)|grew past 10x"):
        # lr 10: the largest TrainConfig allows
        train.run_trial(config(method="full", method_options={}, lr=10.0, max_grad_norm=1e12), tiny_prepared)


def test_precision_is_resolved_and_reported_with_the_time_shares(tiny_prepared):
    cpu = torch.device("cpu")
    assert train.resolve_precision(cpu, "fp32") == "fp32"
    assert train.resolve_precision(cpu, "bf16") == "bf16"
    assert train.resolve_precision(cpu, "auto") == ("bf16" if train.cpu_has_native_bf16() else "fp32")
    reports = []
    train.run_trial(config(epochs=2, precision="fp32"), tiny_prepared, lambda m, save: reports.append(m))
    assert [m["precision"] for m in reports] == ["fp32", "fp32"]
    for m in reports:
        assert m["startup_s"] > 0 and m["eval_time_s"] > 0 and m["checkpoint_time_s"] == 0.0  # nothing saved
    bf16 = train.run_trial(config(epochs=1, precision="bf16"), tiny_prepared).history
    assert bf16[0]["precision"] == "bf16" and 0.0 <= bf16[0]["sst_accuracy"] <= 1.0


def test_checkpoint_time_counts_the_saves(tiny_prepared, tmp_path):
    reports = []

    def report(metrics, save):
        save(tmp_path / str(metrics["epoch"]))
        reports.append(metrics)

    train.run_trial(config(epochs=2), tiny_prepared, report)
    assert reports[0]["checkpoint_time_s"] == 0.0 and reports[1]["checkpoint_time_s"] > 0.0


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(precision="fp16"), "precision 'fp16'"),
        (dict(lr=0), r"TrainConfig.lr: out of range: expected a number in \(0, 10\]"),
        (dict(dropout=1.0), r"dropout: out of range: expected a number in \[0, 1\)"),
        (dict(sampling="random"), "sampling 'random'"),
        (dict(tasks=["sst", "nope"]), "unknown task 'nope'"),
        (dict(method="lora", method_options={"bottleneck": 8}), "no option 'bottleneck'"),
    ],
)
def test_bad_config_is_refused(bad, message):
    with pytest.raises((ValueError, KeyError), match=message):
        config(**bad)


def test_a_finished_trial_s_model_is_freed_without_the_cycle_collector(tiny_prepared):
    """Tune runs a reused worker's trials one after another: a trial's state in a reference cycle outlived it until
    a full collection, and the README worker grew ~330 MB a trial (an epoch's clock referred back to its trial)."""
    import gc
    import weakref

    config = train.TrainConfig(method="lora", tasks=["sst"], epochs=2, batch_size=16, log_every=0)
    train.Trial(config, tiny_prepared, report=None)  # the first build's lazy imports (torch._dynamo) keep its frames
    gc.disable()
    try:
        trial = train.Trial(config, tiny_prepared, report=None)
        for epoch in range(config.epochs):
            trial.train_epoch(epoch)
        model, optimizer = weakref.ref(trial.model), weakref.ref(trial.optimizer)
        del trial
        assert model() is None and optimizer() is None  # freed by reference counting, at once
    finally:
        gc.enable()
