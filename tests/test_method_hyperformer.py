"""HyperFormer++: placement, generation by hand, once-per-forward generation, task routing, freezing, counts."""

import copy

import pytest
import torch
import torch.nn.functional as F

from conftest import TINY, random_batch, sequence_output
from peftune.core.model import MultitaskModel
from peftune.inputs.backbone import BertConfig, BertModel
from peftune.inputs.tasks import parse_tasks
from peftune.methods import get_method, make_method_config
from peftune.methods.base import PER_TASK
from peftune.methods.hyperformer import LN_EPS, HyperAdapter, HyperformerConfig, hyperformer_parameter_count

TASKS = "sst,para"
SMALL = {"bottleneck": 4, "projected_dim": 8, "task_embedding_dim": 6, "projector_hidden": 10}


def build(config=None, bert=TINY, tasks=TASKS, seed=0):
    torch.manual_seed(seed)
    return MultitaskModel(BertModel(bert), parse_tasks(tasks), "hyperformer", config)


def randomize_hypernetwork(model, std=0.3):
    """Move every hypernetwork parameter away from its near-identity init so that all of them matter."""
    with torch.no_grad():
        for p in model.backbone.hyperformer.parameters():
            p.normal_(std=std)


# --------------------------------------------------------------------------- config and registry


def test_registered_with_bottleneck_as_size():
    spec = get_method("hyperformer")
    assert spec.config_cls is HyperformerConfig and spec.size_field == "bottleneck"
    assert make_method_config("hyperformer", {"bottleneck": 8}).bottleneck == 8


@pytest.mark.parametrize(
    "values, error",
    [
        ({"bottleneck": 0}, "bottleneck must be a positive integer, got 0"),
        ({"projected_dim": 1.5}, "projected_dim must be a positive integer, got 1.5"),
        ({"task_embedding_dim": -2}, "task_embedding_dim must be a positive integer, got -2"),
        ({"projector_hidden": None}, "projector_hidden must be a positive integer, got None"),
        ({"init_std": 2.0}, r"init_std = 2\.0"),
        ({"train_layernorm": 0}, "train_layernorm must be true or false, got 0"),
    ],
)
def test_config_names_the_bad_value(values, error):
    with pytest.raises((ValueError, TypeError), match=error):
        HyperformerConfig(**values)


# --------------------------------------------------------------------------- placement and init


def test_one_shared_hypernetwork_feeds_both_positions_of_every_layer():
    model = build(HyperformerConfig(**SMALL))
    hypernetwork = model.backbone.hyperformer
    for i, layer in enumerate(model.backbone.encoder.layer):
        for j, hook in enumerate((layer.attention.output.adapter, layer.output.adapter)):
            assert isinstance(hook, HyperAdapter)
            assert (hook.layer, hook.position) == (i, j)
            assert hook.hypernetwork is hypernetwork
    # the shared hypernetwork is saved once, under "hyperformer.", not under every adapter
    keys = list(model.backbone.state_dict())
    assert not [k for k in keys if ".adapter." in k]
    assert sum(k.startswith("hyperformer.") for k in keys) == len(list(hypernetwork.state_dict()))
    # a deep copy keeps the sharing, with its own hypernetwork
    clone = copy.deepcopy(model)
    assert clone.backbone.encoder.layer[1].output.adapter.hypernetwork is clone.backbone.hyperformer
    assert clone.backbone.hyperformer is not hypernetwork


def test_near_identity_at_init():
    torch.manual_seed(0)
    plain = BertModel(TINY).eval()
    batch = random_batch()
    expected = plain(*batch)[0]

    model = MultitaskModel(copy.deepcopy(plain), parse_tasks(TASKS), "hyperformer", HyperformerConfig()).eval()
    with torch.no_grad():
        for task in ("sst", "para"):
            relative = (sequence_output(model, task, batch) - expected).norm() / expected.norm()
            assert 0 < relative < 1e-2

    # init_std = 0: the generated gain and bias are zero, the adapters exactly the identity
    config = HyperformerConfig(init_std=0.0)
    model = MultitaskModel(copy.deepcopy(plain), parse_tasks(TASKS), "hyperformer", config).eval()
    with torch.no_grad():
        assert torch.equal(sequence_output(model, "sst", batch), expected)


# --------------------------------------------------------------------------- the maths


def test_generated_adapter_matches_reference():
    model = build(HyperformerConfig(**SMALL)).eval()
    randomize_hypernetwork(model)
    net = model.backbone.hyperformer
    d, m = TINY.hidden_size, SMALL["bottleneck"]
    task, layer, position = "para", 1, 1  # para's adapter after the FFN of the second layer

    # I = LayerNorm(W2 ReLU(W1 [z; l; p] + b1) + b2), by hand
    features = torch.cat(
        [net.per_task[task].embedding, net.layer_embeddings.weight[layer], net.position_embeddings.weight[position]]
    )  # (3e,)
    linear1, _, linear2, norm = net.projector
    y = linear2.weight @ torch.relu(linear1.weight @ features + linear1.bias) + linear2.bias  # (t,)
    I = (y - y.mean()) / torch.sqrt(y.var(unbiased=False) + LN_EPS) * norm.weight + norm.bias  # (t,)

    # the hypernetworks: plain matrix-vector products scaled by 1/t, then split into weights and biases
    t = SMALL["projected_dim"]
    down, up = net.down.weight @ I / t, net.up.weight @ I / t  # (md + m,), (dm + d,)
    w_down, b_down = down[: m * d].view(m, d), down[m * d :]
    w_up, b_up = up[: d * m].view(d, m), up[d * m :]
    gamma, beta = net.gamma.weight @ I / t, net.beta.weight @ I / t  # (d,), (d,)

    x = torch.randn(2, 5, d)  # (B, T, d)
    u = F.gelu(x @ w_down.T + b_down) @ w_up.T + b_up  # (B, T, d)
    u_hat = (u - u.mean(-1, keepdim=True)) / torch.sqrt(u.var(-1, unbiased=False, keepdim=True) + LN_EPS)
    expected = x + gamma * u_hat + beta

    model.context.task = task
    with torch.no_grad():
        generated = net.generate(task)
        torch.testing.assert_close(generated.down_weight[layer, position], w_down)
        torch.testing.assert_close(generated.up_bias[layer, position], b_up)
        torch.testing.assert_close(generated.gamma[layer, position], gamma)
        hook = model.backbone.encoder.layer[layer].output.adapter
        torch.testing.assert_close(hook(x), expected)
        net.clear_cache()


def test_weights_generated_once_per_forward_and_not_kept():
    model = build(HyperformerConfig(**SMALL)).eval()
    net = model.backbone.hyperformer
    calls = []
    net.projector.register_forward_hook(lambda module, args, output: calls.append(output.shape))
    with torch.no_grad():
        sequence_output(model, "sst", random_batch())
        sequence_output(model, "para", random_batch())
    # one projector pass per backbone forward, over all (layer, position) pairs at once
    assert calls == [(TINY.num_hidden_layers, 2, SMALL["projected_dim"])] * 2
    assert net._cache == {}  # cleared when the forward ends: no stale weights, no graph kept alive


def test_task_switch_and_gradient_isolation():
    model = build(HyperformerConfig(**SMALL))
    randomize_hypernetwork(model)
    model.eval()  # no dropout: differences come from the task only
    batch = random_batch()
    with torch.no_grad():
        assert not torch.allclose(sequence_output(model, "sst", batch), sequence_output(model, "para", batch))

    logits = model("sst", *batch)  # (B, 5)
    model.tasks["sst"].loss(logits, torch.tensor([0.0, 3.0, 4.0])).backward()
    for name, p in model.backbone.named_parameters():
        if not p.requires_grad:
            continue
        if name == f"hyperformer.{PER_TASK}.para.embedding":
            assert p.grad is None
        else:  # sst's embedding and every shared part: hypernetworks, projector, embeddings, LayerNorms
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_only_the_method_weights_move():
    model = build(HyperformerConfig(**SMALL))
    trainable = {n for n, p in model.backbone.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in model.backbone.named_parameters() if "LayerNorm" in n or "hyperformer." in n}
    before = {n: p.detach().clone() for n, p in model.backbone.named_parameters()}

    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for step in range(4):  # two batches of each task; every step a new forward, a new generation
        task = ("sst", "para")[step % 2]
        ids, mask, types = random_batch(seed=10 + step)
        labels = torch.randint(0, 5 if task == "sst" else 2, (ids.shape[0],)).float()
        loss = model.tasks[task].loss(model(task, ids, mask, types), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for name, p in model.backbone.named_parameters():
        if name in trainable:
            assert not torch.equal(p, before[name]), f"{name} did not train"
        else:
            assert torch.equal(p, before[name]), f"frozen {name} changed"


# --------------------------------------------------------------------------- parameter counts


def test_closed_form_on_bert_base():
    # t = 64, e = 64, h = 128, m = 32, d = 768, L = 12
    counts = hyperformer_parameter_count(HyperformerConfig(), BertConfig(), 3)
    embeddings = (12 + 2) * 64
    projector = (192 * 128 + 128) + (128 * 64 + 64) + 2 * 64
    hypernetworks = 64 * (32 * 768 + 32) + 64 * (768 * 32 + 768) + 2 * 64 * 768
    assert counts == {
        "shared": embeddings + projector + hypernetworks + 38_400,
        "per_task": 64,
        "total": embeddings + projector + hypernetworks + 38_400 + 3 * 64,
    }


@pytest.mark.parametrize(
    "config",
    [HyperformerConfig(), HyperformerConfig(bottleneck=64), HyperformerConfig(**SMALL, train_layernorm=False)],
    ids=["defaults", "bottleneck64", "small-no-layernorm"],
)
@pytest.mark.parametrize("bert", [TINY, BertConfig()], ids=["tiny", "bert-base"])
def test_built_counts_match_closed_form(config, bert):
    tasks = ("sst", "para", "sts")
    with torch.device("meta"):  # bert-base's shapes without allocating or initialising its weights
        model = MultitaskModel(BertModel(bert), parse_tasks(",".join(tasks)), "hyperformer", config)
    trainable = {n: p.numel() for n, p in model.backbone.named_parameters() if p.requires_grad}
    formula = hyperformer_parameter_count(config, bert, len(tasks))

    # per task: exactly its embedding, nothing else
    per_task = {n: k for n, k in trainable.items() if f".{PER_TASK}." in n}
    assert per_task == {f"hyperformer.{PER_TASK}.{t}.embedding": config.task_embedding_dim for t in tasks}
    assert formula["per_task"] == config.task_embedding_dim
    assert sum(k for n, k in trainable.items() if n not in per_task) == formula["shared"]
    assert sum(trainable.values()) == formula["total"]
