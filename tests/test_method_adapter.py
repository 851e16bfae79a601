"""Houlsby adapters and LoRA + Adapter: placement, init, reference maths, task routing, freezing, exact counts."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import TINY, random_batch, sequence_output
from peftune.core.model import MultitaskModel
from peftune.inputs.backbone import BertConfig, BertModel
from peftune.inputs.tasks import parse_tasks
from peftune.methods import get_method, make_method_config
from peftune.methods.adapter import AdapterConfig, HoulsbyAdapter, TaskAdapters, adapter_parameter_count
from peftune.methods.base import PER_TASK
from peftune.methods.lora_adapter import LoraAdapterConfig, lora_adapter_parameter_count, lora_parameter_count

TASKS = "sst,para"


def build(method="adapter", config=None, bert=TINY, tasks=TASKS, seed=0):
    torch.manual_seed(seed)
    return MultitaskModel(BertModel(bert), parse_tasks(tasks), method, config)


def randomize_adapters(model, std=0.2):
    """Move the adapters away from their near-identity init so that they matter."""
    with torch.no_grad():
        for name, p in model.backbone.named_parameters():
            if f".{PER_TASK}." in name:
                p.normal_(std=std)


def train_steps(model, steps=4, lr=1e-3):
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    for step in range(steps):
        task = ("sst", "para")[step % 2]
        ids, mask, types = random_batch(seed=10 + step)
        labels = torch.randint(0, 5 if task == "sst" else 2, (ids.shape[0],)).float()
        loss = model.tasks[task].loss(model(task, ids, mask, types), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def counted(model):
    """(shared, {task: per-task}) trainable backbone parameters, by the ``.per_task.<task>.`` convention."""
    trainable = [(n, p.numel()) for n, p in model.backbone.named_parameters() if p.requires_grad]
    shared = sum(k for n, k in trainable if f".{PER_TASK}." not in n)
    per_task = {t: sum(k for n, k in trainable if f".{PER_TASK}.{t}." in n) for t in model.tasks}
    return shared, per_task


# --------------------------------------------------------------------------- config and registry


def test_registered_with_bottleneck_as_size():
    for name, cls in (("adapter", AdapterConfig), ("lora_adapter", LoraAdapterConfig)):
        spec = get_method(name)
        assert spec.config_cls is cls and spec.size_field == "bottleneck"
    config = make_method_config("lora_adapter", {"rank": 4, "bottleneck": 8, "layers": "1, 0"})
    assert (config.rank, config.bottleneck, config.layers, config.targets) == (4, 8, [0, 1], ["query", "key", "value"])


@pytest.mark.parametrize(
    "values, error",
    [
        ({"bottleneck": 0}, "bottleneck must be a positive integer, got 0"),
        ({"bottleneck": 2.5}, "got 2.5"),
        ({"activation": "swish"}, "activation = 'swish'"),
        ({"init_std": -1.0}, "init_std = -1.0"),
        ({"dropout": 1.0}, "dropout: out of range"),
        ({"layers": [0, 0]}, "layers = [0, 0]"),
        ({"layers": [-1]}, "layers = [-1]"),
        ({"layers": "top"}, "layers = 'top'"),
        ({"train_layernorm": "yes"}, "train_layernorm must be true or false, got 'yes'"),
    ],
)
def test_config_names_the_bad_value(values, error):
    with pytest.raises((ValueError, TypeError), match=error.replace("[", r"\[").replace(".", r"\.")):
        AdapterConfig(**values)


def test_lora_adapter_config_validates_both_parts():
    with pytest.raises(ValueError, match="rank must be a positive integer, got 0"):
        LoraAdapterConfig(rank=0)
    with pytest.raises(ValueError, match="bottleneck must be a positive integer, got -3"):
        LoraAdapterConfig(bottleneck=-3)


def test_layer_beyond_backbone_is_an_error():
    with pytest.raises(ValueError, match=r"layers = \[0, 5\]: the backbone has layers 0\.\.1"):
        build(config=AdapterConfig(layers=[0, 5]))


# --------------------------------------------------------------------------- placement and init


@pytest.mark.parametrize("method", ["adapter", "lora_adapter"])
def test_adapters_installed_at_both_positions_of_every_layer(method):
    model = build(method, get_method(method).config_cls(bottleneck=8))
    for layer in model.backbone.encoder.layer:
        for hook in (layer.attention.output.adapter, layer.output.adapter):
            assert isinstance(hook, TaskAdapters)
            assert list(hook.per_task) == ["sst", "para"]
            for adapter in hook.per_task.values():
                assert isinstance(adapter, HoulsbyAdapter)
                assert adapter.down.weight.shape == (8, TINY.hidden_size)
                assert adapter.up.weight.shape == (TINY.hidden_size, 8)
                assert all(p.requires_grad for p in adapter.parameters())


def test_layers_option_leaves_other_layers_plain():
    model = build(config=AdapterConfig(layers=[1]))
    first, second = model.backbone.encoder.layer
    assert isinstance(first.attention.output.adapter, nn.Identity) and isinstance(first.output.adapter, nn.Identity)
    assert isinstance(second.attention.output.adapter, TaskAdapters) and isinstance(second.output.adapter, TaskAdapters)


@pytest.mark.parametrize("method", ["adapter", "lora_adapter"])
def test_near_identity_at_init(method):
    torch.manual_seed(0)
    plain = BertModel(TINY).eval()
    batch = random_batch()
    expected = plain(*batch)[0]

    cls = get_method(method).config_cls
    model = MultitaskModel(copy.deepcopy(plain), parse_tasks(TASKS), method, cls()).eval()
    with torch.no_grad():
        for task in ("sst", "para"):
            got = sequence_output(model, task, batch)
            relative = (got - expected).norm() / expected.norm()
            assert 0 < relative < 1e-2

    # a zero up-projection (and LoRA's zero B) makes the model exactly the backbone
    model = MultitaskModel(copy.deepcopy(plain), parse_tasks(TASKS), method, cls(zero_init_up=True)).eval()
    with torch.no_grad():
        assert torch.equal(sequence_output(model, "sst", batch), expected)


# --------------------------------------------------------------------------- the maths


def test_adapter_matches_reference_formula():
    model = build(config=AdapterConfig(bottleneck=6, activation="gelu")).eval()
    randomize_adapters(model)
    hook = model.backbone.encoder.layer[1].output.adapter
    adapter = hook.per_task["para"]
    x = torch.randn(2, 5, TINY.hidden_size)  # (B, T, d)

    w_down, b_down = adapter.down.weight, adapter.down.bias  # (m, d), (m,)
    w_up, b_up = adapter.up.weight, adapter.up.bias  # (d, m), (d,)
    expected = x + F.gelu(x @ w_down.T + b_down) @ w_up.T + b_up  # (B, T, d)

    model.context.task = "para"
    with torch.no_grad():
        torch.testing.assert_close(hook(x), expected)
        assert not torch.allclose(hook(x), x)
    # the hook routes by task: the same input through sst's adapter differs
    model.context.task = "sst"
    with torch.no_grad():
        torch.testing.assert_close(hook(x), hook.per_task["sst"](x))
        assert not torch.allclose(hook(x), expected)


def test_adapter_sits_before_residual_and_layernorm():
    model = build(config=AdapterConfig(bottleneck=4)).eval()
    randomize_adapters(model)
    model.context.task = "sst"
    block = model.backbone.encoder.layer[0].output  # BertOutput: dense -> adapter -> + residual -> LayerNorm
    hidden, residual = torch.randn(2, 3, TINY.intermediate_size), torch.randn(2, 3, TINY.hidden_size)
    adapter = block.adapter.per_task["sst"]
    y = block.dense(hidden)
    y = y + adapter.up(F.gelu(adapter.down(y)))
    expected = F.layer_norm(y + residual, (TINY.hidden_size,), block.LayerNorm.weight, block.LayerNorm.bias, 1e-12)
    with torch.no_grad():
        torch.testing.assert_close(block(hidden, residual), expected)


@pytest.mark.parametrize("method", ["adapter", "lora_adapter"])
def test_task_switch_and_gradient_isolation(method):
    model = build(method, get_method(method).config_cls(bottleneck=4))
    randomize_adapters(model)
    model.eval()  # no dropout: differences come from the task only
    batch = random_batch()
    with torch.no_grad():
        assert not torch.allclose(sequence_output(model, "sst", batch), sequence_output(model, "para", batch))

    logits = model("sst", *batch)  # (B, 5)
    model.tasks["sst"].loss(logits, torch.tensor([0.0, 3.0, 4.0])).backward()
    grads = {n: p.grad for n, p in model.backbone.named_parameters() if p.requires_grad}
    for name, grad in grads.items():
        if f".{PER_TASK}.para." in name:
            assert grad is None, name
        else:  # sst's adapters and the shared LayerNorms (and LoRA's B) get gradients
            assert grad is not None, name
            if ".per_task.sst." in name or "LayerNorm" in name or "lora_B" in name:
                assert grad.abs().sum() > 0, name
    assert any(".per_task.sst." in n for n in grads) and any("LayerNorm" in n for n in grads)


@pytest.mark.parametrize("method", ["adapter", "lora_adapter"])
def test_only_the_method_weights_move(method):
    model = build(method, get_method(method).config_cls(bottleneck=4))
    trainable = {n for n, p in model.backbone.named_parameters() if p.requires_grad}
    expected = {
        n
        for n, _ in model.backbone.named_parameters()
        if "LayerNorm" in n or f".{PER_TASK}." in n or (method == "lora_adapter" and "lora_" in n)
    }
    assert trainable == expected
    before = {n: p.detach().clone() for n, p in model.backbone.named_parameters()}

    train_steps(model)

    for name, p in model.backbone.named_parameters():
        if name in trainable:
            assert not torch.equal(p, before[name]), f"{name} did not train"
        else:
            assert torch.equal(p, before[name]), f"frozen {name} changed"


# --------------------------------------------------------------------------- parameter counts


def test_closed_forms_on_bert_base():
    bert = BertConfig()  # 768 hidden, 12 layers: per adapter 2md + d + m, 24 adapters per task, 25 LayerNorms
    assert adapter_parameter_count(AdapterConfig(), bert, 3) == {
        "shared": 38_400,
        "per_task": 24 * (2 * 64 * 768 + 768 + 64),
        "total": 38_400 + 3 * 2_379_264,
    }
    assert lora_parameter_count(LoraAdapterConfig(), bert) == 442_368  # METHODS.md: LoRA r=8 on q, k, v
    assert lora_adapter_parameter_count(LoraAdapterConfig(), bert, 3)["shared"] == 442_368 + 38_400


COUNT_CASES = [
    ("adapter", AdapterConfig()),
    ("adapter", AdapterConfig(bottleneck=8, layers=[1], train_layernorm=False)),
    ("lora_adapter", LoraAdapterConfig()),
    (
        "lora_adapter",
        LoraAdapterConfig(
            rank=4, bottleneck=16, targets=["query", "attention.output.dense", "intermediate.dense", "output.dense"]
        ),
    ),
]


def _formula(method, config, bert, num_tasks):
    count = adapter_parameter_count if method == "adapter" else lora_adapter_parameter_count
    return count(config, bert, num_tasks)


@pytest.mark.parametrize("method, config", COUNT_CASES)
@pytest.mark.parametrize("bert", [TINY, BertConfig()], ids=["tiny", "bert-base"])
def test_built_counts_match_closed_form(method, config, bert):
    tasks = "sst,para,sts"
    with torch.device("meta"):  # bert-base's shapes without allocating or initialising its weights
        model = MultitaskModel(BertModel(bert), parse_tasks(tasks), method, config)
    shared, per_task = counted(model)
    formula = _formula(method, config, bert, 3)
    assert shared == formula["shared"]
    assert per_task == {t: formula["per_task"] for t in ("sst", "para", "sts")}
    assert sum(p.numel() for p in model.backbone.parameters() if p.requires_grad) == formula["total"]
