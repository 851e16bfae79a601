"""Prefix tuning and prompt tuning: references, task routing, freezing, merge, exact parameter counts."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.testing import assert_close

from conftest import TINY
from peftune.core.model import MultitaskModel
from peftune.inputs.backbone import BertConfig, BertModel
from peftune.inputs.tasks import parse_tasks
from peftune.methods.base import get_method, make_method_config
from peftune.methods.prefix import PrefixConfig, merge_prefix, prefix_parameter_count
from peftune.methods.prompt import PromptConfig, prompt_parameter_count

BERT_BASE_PARAMS = 109_482_240  # bert-base-uncased BertModel, as in METHODS.md
CLS_ID = 2


def build(method: str, config, tasks: str = "sst,para", bert: BertConfig = TINY, seed: int = 0) -> MultitaskModel:
    torch.manual_seed(seed)
    return MultitaskModel(BertModel(bert), parse_tasks(tasks), method, config)


def batch(B: int = 3, T: int = 7, seed: int = 1):
    """Random ids with [CLS] first, row 1 padded after 4 tokens, mixed token types."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, TINY.vocab_size, (B, T), generator=g)
    ids[:, 0] = CLS_ID
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 4:] = 0
    ids[1, 4:] = TINY.pad_token_id
    token_types = torch.zeros(B, T, dtype=torch.long)
    token_types[:, T // 2 :] = 1
    return ids, mask, token_types


def per_task_count(model, task: str) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if f".per_task.{task}." in n)


def backbone_keys(bert: BertConfig = TINY) -> set[str]:
    return set(BertModel(bert).state_dict())


# --------------------------------------------------------------------------- configs and registry


@pytest.mark.parametrize(
    ("cls", "values", "named"),
    [
        (PrefixConfig, {"prefix_length": 0}, "prefix_length"),
        (PrefixConfig, {"prefix_length": 2.5}, "prefix_length"),
        (PrefixConfig, {"reparam_hidden": -3}, "reparam_hidden"),
        (PrefixConfig, {"reparam_input_dim": 0}, "reparam_input_dim"),
        (PrefixConfig, {"reparameterize": "yes"}, "reparameterize"),
        (PrefixConfig, {"dropout": 1.0}, "dropout"),
        (PromptConfig, {"prompt_length": 0}, "prompt_length"),
        (PromptConfig, {"init": "zeros"}, "init"),
    ],
)
def test_config_rejects_bad_values_and_names_them(cls, values, named):
    with pytest.raises((ValueError, TypeError)) as error:
        cls(**values)
    message = str(error.value)
    assert named in message and repr(next(iter(values.values()))) in message


def test_registered_with_size_fields():
    assert get_method("prefix").size_field == "prefix_length"
    assert get_method("prompt").size_field == "prompt_length"
    assert make_method_config("prefix", {"prefix_length": 4}).prefix_length == 4
    with pytest.raises(ValueError, match="prefix_length"):
        make_method_config("prefix", {"length": 4})


# --------------------------------------------------------------------------- prefix vs references


@pytest.mark.parametrize("reparameterize", [True, False])
def test_prefix_matches_peft_prefix_tuning(reparameterize):
    """Same weights, same prefix: our backbone equals peft's prefix tuning on transformers.BertModel.

    peft treats the prefix as past tokens and shifts BERT's position ids by l; our prefix has no
    position, so our backbone gets the HF position table shifted by l (both then read the same
    position vectors for the real tokens).
    """
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    l, hidden = 3, 16
    torch.manual_seed(0)
    hf_config = transformers.BertConfig(
        vocab_size=TINY.vocab_size,
        hidden_size=TINY.hidden_size,
        num_hidden_layers=TINY.num_hidden_layers,
        num_attention_heads=TINY.num_attention_heads,
        intermediate_size=TINY.intermediate_size,
        max_position_embeddings=TINY.max_position_embeddings,
    )
    hf = transformers.BertModel(hf_config).eval()
    state = hf.state_dict()
    positions = state["embeddings.position_embeddings.weight"]
    state["embeddings.position_embeddings.weight"] = torch.cat([positions[l:], positions[:l]])
    backbone = BertModel(TINY)
    backbone.load_state_dict(state)
    config = PrefixConfig(prefix_length=l, reparameterize=reparameterize, reparam_hidden=hidden, dropout=0.0)
    model = MultitaskModel(backbone, parse_tasks("sst,para"), "prefix", config).eval()

    peft_config = peft.PrefixTuningConfig(
        task_type="FEATURE_EXTRACTION",
        num_virtual_tokens=l,
        prefix_projection=reparameterize,
        encoder_hidden_size=hidden,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = peft.get_peft_model(hf, peft_config).eval()
    encoder = reference.prompt_encoder["default"]
    ours = model.backbone.prefix_encoder.per_task["sst"]
    with torch.no_grad():
        if reparameterize:
            encoder.embedding.weight.copy_(ours.embedding)
            for i in (0, 2):
                encoder.transform[i].weight.copy_(ours.mlp[i].weight)
                encoder.transform[i].bias.copy_(ours.mlp[i].bias)
        else:
            encoder.embedding.weight.copy_(ours.prefix)

    ids, mask, _ = batch()
    token_types = torch.zeros_like(ids)  # peft drops token_type_ids for prefix tuning
    model.context.task = "sst"
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = reference(input_ids=ids, attention_mask=mask)
        hidden_states, out_mask, pooled = model.backbone(ids, mask, token_types)
    assert_close(hidden_states, expected.last_hidden_state)
    assert_close(pooled, expected.pooler_output)
    assert torch.equal(out_mask, mask)  # prefix tuning adds no query positions


def test_prefix_matches_manual_attention_with_padding():
    """Each layer's self-attention = softmax(Q [Kp; K]^T / sqrt(hd) + mask) [Vp; V], by hand."""
    l = 4
    model = build("prefix", PrefixConfig(prefix_length=l, reparam_hidden=8)).eval()
    model.context.task = "para"
    prefix = model.backbone.prefix_encoder.per_task["para"]()  # (l, 2 * L * d)
    B, T, H, nh = 3, 6, TINY.hidden_size, TINY.num_attention_heads
    hd = H // nh
    x = torch.randn(B, T, H)
    mask = torch.ones(B, T)
    mask[0, 3:] = 0
    mask[2, 5:] = 0
    bias = (1.0 - mask[:, None, None, :]) * torch.finfo(torch.float32).min  # (B, 1, 1, T)

    def heads(t):  # (B, n, H) -> (B, nh, n, hd)
        return t.view(t.shape[0], t.shape[1], nh, hd).transpose(1, 2)

    for index, layer in enumerate(model.backbone.encoder.layer):
        attention = layer.attention.self
        keys = prefix[:, (2 * index) * H : (2 * index + 1) * H]  # (l, H): layer `index` keys
        values = prefix[:, (2 * index + 1) * H : (2 * index + 2) * H]
        q = heads(attention.query(x))
        k = torch.cat([heads(keys.expand(B, l, H)), heads(attention.key(x))], dim=2)  # (B, nh, l + T, hd)
        v = torch.cat([heads(values.expand(B, l, H)), heads(attention.value(x))], dim=2)
        key_mask = torch.cat([torch.ones(B, l), mask], dim=1)  # (B, l + T): the prefix is always visible
        scores = q @ k.transpose(-1, -2) / math.sqrt(hd)  # (B, nh, T, l + T)
        scores = scores.masked_fill(key_mask[:, None, None, :] == 0, float("-inf"))
        expected = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, H)
        with torch.no_grad():
            assert_close(attention(x, bias), expected.detach())
            # padded keys really are ignored: changing them leaves the real tokens' outputs alone
            x2 = x.clone()
            x2[0, 3:] = torch.randn(T - 3, H)
            assert_close(attention(x2, bias)[0, :3], attention(x, bias)[0, :3])


def test_prefix_runs_one_mlp_call_per_forward():
    model = build("prefix", PrefixConfig(prefix_length=2, reparam_hidden=8)).train()
    calls = []
    model.backbone.prefix_encoder.per_task["sst"].mlp.register_forward_hook(lambda *args: calls.append(1))
    ids, mask, token_types = batch()
    model("sst", ids, mask, token_types).sum().backward()
    assert len(calls) == 1  # not once per layer (2 layers here)
    assert model.backbone.prefix_encoder._cache is None  # nothing kept after the forward
    model("sst", ids, mask, token_types)
    assert len(calls) == 2


def test_prefix_dropout_is_applied_in_training_only():
    model = build("prefix", PrefixConfig(prefix_length=3, reparam_hidden=8, dropout=0.5))
    model.context.task = "sst"
    encoder = model.backbone.prefix_encoder
    clean = encoder.per_task["sst"]().detach()
    model.eval()
    kv = encoder.key_values(2)  # (L, 2, B, nh, l, hd)
    assert_close(kv[0, 0, 0].transpose(0, 1).reshape(3, -1), clean[:, : TINY.hidden_size])
    model.train()
    kv = encoder.key_values(2)
    dropped = (kv == 0).float().mean().item()
    assert 0.3 < dropped < 0.7
    assert not torch.equal(kv[:, :, 0], kv[:, :, 1])  # a mask per example


# --------------------------------------------------------------------------- prompt vs hand computation


def test_prompt_equals_plain_backbone_on_inserted_sequence():
    P = 3
    model = build("prompt", PromptConfig(prompt_length=P)).eval()
    backbone = model.backbone
    ids, mask, token_types = batch()
    B, T = ids.shape
    prompt = backbone.embeddings.input_prompt.per_task["sst"].prompt  # (P, H)
    assert backbone.embeddings.input_prompt.length == P

    captured = {}
    backbone.embeddings.register_forward_hook(lambda module, args, output: captured.update(out=output))
    with torch.no_grad():
        outputs = model("sst", ids, mask, token_types)
        hidden, out_mask, pooled = backbone(ids, mask, token_types)

        # the plain embedding of the real tokens, computed by hand (eval: dropout is off)
        emb = backbone.embeddings
        plain = emb.LayerNorm(
            emb.word_embeddings(ids) + emb.token_type_embeddings(token_types) + emb.position_embeddings.weight[:T]
        )  # (B, T, H)
        inserted = torch.cat([plain[:, :1], prompt.expand(B, P, -1), plain[:, 1:]], dim=1)  # (B, T + P, H)
        expected_mask = torch.cat([mask[:, :1], torch.ones(B, P, dtype=mask.dtype), mask[:, 1:]], dim=1)
        bias = (1.0 - expected_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
        expected_hidden = backbone.encoder(inserted, bias)
        expected_pooled = backbone.pooler(expected_hidden)

    x, x_mask = captured["out"]
    assert_close(x[:, 0], plain[:, 0])  # position 0 is still [CLS]
    assert torch.equal(x[:, 1 : 1 + P], prompt.detach().expand(B, P, -1))
    assert_close(x[:, 1 + P :], plain[:, 1:])
    assert torch.equal(x_mask, expected_mask)  # attention sees the prompt
    token_mask = torch.cat([mask[:, :1], torch.zeros(B, P, dtype=mask.dtype), mask[:, 1:]], dim=1)
    assert torch.equal(out_mask, token_mask)  # pooling sees only the input tokens
    assert hidden.shape == (B, T + P, TINY.hidden_size)
    assert_close(hidden, expected_hidden)
    assert_close(pooled, expected_pooled)
    assert_close(outputs, model.heads["sst"](pooled))


def test_prompt_with_mean_pooling_counts_prompt_positions():
    torch.manual_seed(0)
    model = MultitaskModel(
        BertModel(TINY), parse_tasks("sst"), "prompt", PromptConfig(prompt_length=2), pooling="mean"
    ).eval()
    ids, mask, token_types = batch()
    with torch.no_grad():
        model.context.task = "sst"
        hidden, out_mask, _ = model.backbone(ids, mask, token_types)
        weights = out_mask.unsqueeze(-1).float()
        expected = model.heads["sst"]((hidden * weights).sum(1) / weights.sum(1))
        assert_close(model("sst", ids, mask, token_types), expected)


def test_prompt_init_vocab_and_random():
    model = build("prompt", PromptConfig(prompt_length=5, init="vocab"))
    emb = model.backbone.embeddings
    with torch.no_grad():
        candidates = emb.LayerNorm(emb.word_embeddings.weight + emb.token_type_embeddings.weight[0])  # (V, H)
    for task in ("sst", "para"):
        prompt = emb.input_prompt.per_task[task].prompt.detach()  # (5, H)
        distance, token = (prompt[:, None] - candidates[None]).norm(dim=-1).min(dim=1)  # exact distances
        assert distance.max() < 1e-5  # every vector is a vocabulary token's embedding
        assert (token != TINY.pad_token_id).all()
    model = build("prompt", PromptConfig(prompt_length=50, init="random"))
    prompt = model.backbone.embeddings.input_prompt.per_task["sst"].prompt
    assert prompt.abs().max() <= 0.5 and prompt.std() > 0.2


# --------------------------------------------------------------------------- tasks, freezing, training

METHODS = [
    ("prefix", PrefixConfig(prefix_length=3, reparam_hidden=8)),
    ("prefix", PrefixConfig(prefix_length=3, reparameterize=False)),
    ("prompt", PromptConfig(prompt_length=3)),
]
METHOD_IDS = ["prefix-mlp", "prefix-direct", "prompt"]


@pytest.mark.parametrize(("method", "config"), METHODS, ids=METHOD_IDS)
def test_task_switching_routes_outputs_and_gradients(method, config):
    model = build(method, config)
    ids, mask, token_types = batch()
    model.eval()
    with torch.no_grad():
        model.context.task = "sst"
        sst = model.backbone(ids, mask, token_types)[2]
        model.context.task = "para"
        para = model.backbone(ids, mask, token_types)[2]
    assert not torch.allclose(sst, para)

    model.train()
    labels = torch.tensor([0.0, 3.0, 4.0])
    loss = model.tasks["sst"].loss(model("sst", ids, mask, token_types), labels)
    loss.backward()
    names = dict(model.named_parameters())
    sst_params = [n for n in names if ".per_task.sst." in n]
    assert sst_params
    for name, parameter in names.items():
        if ".per_task.sst." in name or name.startswith("heads.sst."):
            assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name
        else:
            assert parameter.grad is None, name  # para's prefix/prompt and head, and the backbone


@pytest.mark.parametrize(("method", "config"), METHODS, ids=METHOD_IDS)
def test_only_method_and_heads_train_backbone_bit_identical(method, config):
    model = build(method, config).train()
    originals = backbone_keys()
    before = {k: v.clone() for k, v in model.backbone.state_dict().items() if k in originals}
    assert len(before) == len(originals)
    trainable_before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert all(".per_task." in n or n.startswith("heads.") for n in trainable_before)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)  # frozen ones have no grad
    ids, mask, token_types = batch()
    for step in range(4):
        task = ("sst", "para")[step % 2]
        labels = torch.tensor([0.0, 1.0, 1.0])
        loss = model.tasks[task].loss(model(task, ids, mask, token_types), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    after = model.backbone.state_dict()
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    for name, parameter in model.named_parameters():
        if name in trainable_before:
            assert not torch.equal(parameter, trainable_before[name]), f"{name} did not move"


# --------------------------------------------------------------------------- merge


def test_merge_prefix_keeps_outputs_and_stores_l_2_L_d():
    l = 4
    config = PrefixConfig(prefix_length=l, reparam_hidden=8)
    model = build("prefix", config)
    ids, mask, token_types = batch()
    # a training step first, so the merged prefix is not just the initial one
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    model.tasks["sst"].loss(model("sst", ids, mask, token_types), torch.tensor([0.0, 2.0, 4.0])).backward()
    optimizer.step()

    model.eval()
    with torch.no_grad():
        before = {task: model(task, ids, mask, token_types) for task in ("sst", "para")}
        merge_prefix(model)
        after = {task: model(task, ids, mask, token_types) for task in ("sst", "para")}
    for task in before:
        assert_close(after[task], before[task])
        assert per_task_count(model, task) == l * 2 * TINY.num_hidden_layers * TINY.hidden_size
        assert per_task_count(model, task) == prefix_parameter_count(config, TINY)["stored_per_task"]
    assert not any("mlp" in n or n.endswith(".embedding") for n, _ in model.named_parameters())
    assert all(p.requires_grad for n, p in model.named_parameters() if ".per_task." in n)

    # the merged form is the reparameterize=False form: its state dict loads there unchanged
    direct = build("prefix", PrefixConfig(prefix_length=l, reparameterize=False), seed=5).eval()
    direct.load_state_dict(model.state_dict())
    with torch.no_grad():
        for task in before:
            assert_close(direct(task, ids, mask, token_types), before[task])


def test_merge_prefix_without_prefix_modules_is_an_error():
    with pytest.raises(ValueError, match="no prefix-tuning modules"):
        merge_prefix(build("prompt", PromptConfig(prompt_length=2)))


def test_apply_twice_is_refused():
    model = build("prefix", PrefixConfig(prefix_length=2, reparam_hidden=4))
    with pytest.raises(ValueError, match="already"):
        get_method("prefix").apply(model.backbone, PrefixConfig(), model.context)


# --------------------------------------------------------------------------- exact parameter counts


def test_closed_forms_on_bert_base_defaults():
    bert = BertConfig()
    prefix = prefix_parameter_count(PrefixConfig(), bert, num_tasks=3)
    # l = 10, L = 12, d = d' = 768, h = 512, S = 2 * 12 * 768 = 18,432
    assert prefix["stored_per_task"] == 10 * 18_432 == 184_320
    assert prefix["trainable_per_task"] == 10 * 768 + (768 * 512 + 512) + (512 * 18_432 + 18_432) == 9_857_024
    assert prefix["trainable_total"] == 3 * 9_857_024 and prefix["stored_total"] == 3 * 184_320
    direct = prefix_parameter_count(PrefixConfig(reparameterize=False), bert)
    assert direct["trainable_per_task"] == direct["stored_per_task"] == 184_320
    prompt = prompt_parameter_count(PromptConfig(), bert, num_tasks=3)
    assert prompt["trainable_per_task"] == prompt["stored_per_task"] == 20 * 768 == 15_360
    assert prompt["stored_total"] == 46_080


CASES = [
    ("bert-base", BertConfig(), "prefix", PrefixConfig()),
    ("bert-base", BertConfig(), "prompt", PromptConfig()),
    ("tiny", TINY, "prefix", PrefixConfig(prefix_length=3, reparam_hidden=8)),
    ("tiny", TINY, "prefix", PrefixConfig(prefix_length=3, reparam_hidden=8, reparam_input_dim=5)),
    ("tiny", TINY, "prefix", PrefixConfig(prefix_length=3, reparameterize=False)),
    ("tiny", TINY, "prompt", PromptConfig(prompt_length=3, init="random")),
]


@pytest.mark.parametrize(
    ("size", "bert", "method", "config"), CASES, ids=[f"{c[0]}-{c[2]}-{i}" for i, c in enumerate(CASES)]
)
def test_parameter_counts_match_closed_forms(size, bert, method, config):
    tasks = "sst,para,sts"
    model = build(method, config, tasks=tasks, bert=bert)
    count = prefix_parameter_count if method == "prefix" else prompt_parameter_count
    expected = count(config, bert, num_tasks=3)
    method_params = {n: p for n, p in model.named_parameters() if ".per_task." in n}
    for task in ("sst", "para", "sts"):
        assert per_task_count(model, task) == expected["trainable_per_task"]
    assert sum(p.numel() for p in method_params.values()) == expected["trainable_total"]
    trainable = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and not n.startswith("heads."))
    assert trainable == expected["trainable_total"]
    backbone_only = sum(p.numel() for n, p in model.backbone.named_parameters() if ".per_task." not in n)
    if size == "bert-base":
        assert backbone_only == BERT_BASE_PARAMS
    if method == "prefix":
        merge_prefix(model)
        for task in ("sst", "para", "sts"):
            assert per_task_count(model, task) == expected["stored_per_task"]
