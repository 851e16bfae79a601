"""Every registered method, through the same checks (parametrized over the registry).

Each method must build, run forward and backward, learn a small learnable
task, leave every weight it does not train bit-identical, keep task-specific
parameters to their own task, and round-trip its checkpoint.
"""

import pytest
import torch

from conftest import TINY, random_batch, tiny_backbone
from peftune import methods
from peftune.core.checkpoint import load_trainable, save_checkpoint
from peftune.core.model import MultitaskModel
from peftune.core.params import count_parameters, task_of
from peftune.inputs.tasks import parse_tasks

ALL_METHODS = methods.method_names()
TASKS = parse_tasks("sst,para")


def build(method: str, seed: int = 0, **options) -> MultitaskModel:
    config = methods.make_method_config(method, {"dropout": 0.0, **options})
    # mean pooling: the toy signal reaches the head even through a frozen random backbone
    return MultitaskModel(tiny_backbone(seed), TASKS, method, config, head_dropout=0.0, pooling="mean")


def toy_batch(n: int = 32, length: int = 9, seed: int = 0):
    """Label = which half of the vocabulary the words come from: learnable even through a frozen random BERT."""
    g = torch.Generator().manual_seed(seed)
    half = (TINY.vocab_size + 5) // 2
    labels = (torch.rand(n, generator=g) < 0.5).float()
    low = torch.randint(5, half, (n, length), generator=g)
    ids = torch.where(labels[:, None].bool(), low + (TINY.vocab_size - half), low)
    ids[:, 0] = 1  # [CLS]
    mask = torch.ones_like(ids)
    mask[::3, -3:] = 0  # some padding
    return ids, mask, torch.zeros_like(ids), labels


def test_registry_lists_every_method_of_the_issue():
    expected = {
        "frozen",
        "full",
        "bitfit",
        "layernorm",
        "top_k",
        "lora",
        "adapter",
        "lora_adapter",
        "hyperformer",
        "prefix",
        "prompt",
        "dora",
        "ia3",
        "vera",
    }
    assert expected <= set(ALL_METHODS)


def test_unknown_method_and_option_errors_name_the_valid_ones():
    with pytest.raises(KeyError, match="valid methods: .*lora"):
        methods.get_method("loraa")
    with pytest.raises(ValueError, match="no option 'rnak'.*rank"):
        methods.make_method_config("lora", {"rnak": 4})
    with pytest.raises(ValueError, match="already registered"):
        methods.register_method(methods.get_method("lora"))


@pytest.mark.parametrize("method", ALL_METHODS)
def test_forward_backward_and_trainable_set(method):
    model = build(method)
    ids, mask, types, labels = toy_batch()
    out = model("para", ids, mask, types)
    assert out.shape == (ids.shape[0], 1)
    model.tasks["para"].loss(out, labels).backward()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    method_params = {n for n in trainable if not n.startswith("heads.")}
    assert {n for n in trainable if n.startswith("heads.")} == {
        f"heads.{t}.1.{w}" for t in ("sst", "para") for w in ("weight", "bias")
    }
    if method == "frozen":
        assert not method_params
    else:
        assert method_params, f"{method} trains nothing but the heads"
    for name, parameter in model.named_parameters():
        if parameter.requires_grad and task_of(name) in (None, "para") and not name.startswith("heads.sst"):
            assert parameter.grad is not None, f"{name} got no gradient"
        if not parameter.requires_grad:  # frozen weights: autograd must not compute their gradients
            assert parameter.grad is None, f"frozen {name} got a gradient"


@pytest.mark.parametrize("method", ALL_METHODS)
def test_learns_and_leaves_frozen_weights_bit_identical(method):
    torch.manual_seed(0)
    model = build(method)
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trained_before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    ids, mask, types, labels = toy_batch(64)
    losses = []
    model.train()
    for _ in range(80):
        loss = model.tasks["para"].loss(model("para", ids, mask, types), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], f"{method}: loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    for name, before in frozen_before.items():
        assert torch.equal(dict(model.named_parameters())[name], before), f"{method} changed frozen {name}"
    moved = [n for n, p in model.named_parameters() if n in trained_before and not torch.equal(p, trained_before[n])]
    assert any(not n.startswith("heads.") for n in moved) or method == "frozen"


@pytest.mark.parametrize("method", ALL_METHODS)
def test_task_specific_parameters_switch_by_task(method):
    model = build(method)
    ids, mask, types, labels = toy_batch()
    model.tasks["sst"].loss(model("sst", ids, mask, types), labels.long() * 4).backward()
    for name, parameter in model.named_parameters():
        if task_of(name) == "para" or name.startswith("heads.para"):
            assert parameter.grad is None or not parameter.grad.any(), f"an sst batch moved {name}"
    counts = count_parameters(model)
    if any(counts.per_task.values()):
        # a task-specific method: its two tasks' parameters are distinct and equally many
        assert counts.per_task["sst"] == counts.per_task["para"] > 0
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if task_of(name) == "para":
                    parameter.add_(torch.randn_like(parameter))
        model.eval()
        before = model("sst", ids, mask, types)
        model.context.task = "para"
        # the same inputs through sst's head: only the method's task state differs
        hidden_para = model.backbone(ids, mask, types)[2]
        model.context.task = "sst"
        hidden_sst = model.backbone(ids, mask, types)[2]
        assert not torch.allclose(hidden_para, hidden_sst)
        torch.testing.assert_close(model("sst", ids, mask, types), before)


@pytest.mark.parametrize("method", ALL_METHODS)
def test_checkpoint_round_trip(method, tmp_path):
    model = build(method, seed=0)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.add_(0.05 * torch.randn_like(parameter))
    save_checkpoint(model, tmp_path)
    fresh = build(method, seed=0)
    load_trainable(fresh, tmp_path)
    ids, mask, types, _ = toy_batch()
    model.eval(), fresh.eval()
    for task in ("sst", "para"):
        torch.testing.assert_close(fresh(task, ids, mask, types), model(task, ids, mask, types), rtol=0, atol=0)
    assert {p.name for p in tmp_path.iterdir()} == {"trainable.safetensors", "peftune.json"}


@pytest.mark.parametrize("targets", [["query", "key", "value"], ["value", "intermediate.dense"]])
def test_lora_equals_peft_on_the_same_weights(targets):
    """The LoRA written here (fused q/k/v when all three are adapted) computes peft's outputs and gradients."""
    import peft

    from peftune.methods.lora import peft_lora_config

    config = methods.make_method_config("lora", {"rank": 4, "alpha": 8.0, "targets": targets, "dropout": 0.0})
    ours = tiny_backbone(seed=3)
    theirs = tiny_backbone(seed=3)
    methods.get_method("lora").apply(ours, config, None)
    peft.inject_adapter_in_model(peft_lora_config(config), theirs)
    assert {n for n, _ in ours.named_parameters()} == {n for n, _ in theirs.named_parameters()}  # same keys
    torch.manual_seed(5)
    with torch.no_grad():  # B non-zero, so the adapter changes the output
        for name, parameter in ours.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.1)
    theirs.load_state_dict(ours.state_dict())
    batch = random_batch()
    results = []
    for model in (ours, theirs):
        model.eval()  # no dropout draws: the two models see the same computation
        for name, parameter in model.named_parameters():
            parameter.requires_grad_("lora_" in name)
        output = model(*batch)[0]
        output.pow(2).sum().backward()
        results.append((output, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
    assert results[0][1].keys() == results[1][1].keys() and results[0][1]
    for name in results[0][1]:
        torch.testing.assert_close(results[0][1][name], results[1][1][name], rtol=1e-4, atol=1e-5, msg=name)
