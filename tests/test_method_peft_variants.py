"""DoRA, (IA)^3, VeRA and LoRA's variants (rsLoRA, LoRA+, PiSSA, OLoRA) compute what peft computes.

Each test builds one configuration twice on the same tiny BERT: with the method written here and with peft's own
(``peft.inject_adapter_in_model``), gives both the same trainable weights (moved off their identity init, so the
adapter does something), and checks equal outputs and equal gradients of every trainable parameter. The generic
checks (build, learn, freeze, task routing, checkpoint round trip) run over the registry in ``test_methods``.
"""

import peft
import pytest
import torch
import transformers

from conftest import TINY, assert_peft_loads_the_export, random_batch, tiny_backbone
from peftune import methods
from peftune.core.model import MultitaskModel
from peftune.core.train import TrainConfig, build_optimizer
from peftune.inputs.tasks import parse_tasks
from peftune.methods.ia3 import peft_ia3_config
from peftune.methods.lora import peft_lora_config
from peftune.methods.vera import peft_vera_config

PEFT_CONFIGS = {"lora": peft_lora_config, "dora": peft_lora_config, "ia3": peft_ia3_config, "vera": peft_vera_config}
# what each method trains, by a part of its parameters' names (peft's names)
TRAINED = {"lora": "lora_", "dora": "lora_", "ia3": "ia3_l", "vera": "vera_lambda_"}


def inject(method: str, config, model) -> None:
    """peft's method into ``model``, in place: ``inject_adapter_in_model``, except for VeRA, whose shared matrices
    live on its tuner (peft refuses to inject it alone): its public tuner class ``peft.VeraModel`` does the same."""
    if method == "vera":
        peft.VeraModel(model, peft_vera_config(config), "default")
    else:
        peft.inject_adapter_in_model(PEFT_CONFIGS[method](config), model)


def ours_and_peft(method: str, options: dict, seed: int = 3):
    """(ours, peft's): the same backbone weights, the method applied by each, then our trainable weights in both."""
    config = methods.make_method_config(method, {"dropout": 0.0, **options})
    ours, theirs = tiny_backbone(seed=seed), tiny_backbone(seed=seed)
    methods.get_method(method).apply(ours, config, None)
    inject(method, config, theirs)
    names = {n for n, _ in ours.named_parameters()}
    assert names == {n for n, _ in theirs.named_parameters()}, names ^ {n for n, _ in theirs.named_parameters()}
    # the initialisations agree before anything is copied (PiSSA and OLoRA also rewrite W0: compared too), but for
    # LoRA's random A (Kaiming-uniform, drawn by each)
    random = "lora_A" if config.__dict__.get("init") == "lora" else None
    init_ours, init_theirs = (
        {n: p for n, p in m.named_parameters() if not random or random not in n} for m in (ours, theirs)
    )
    torch.testing.assert_close(init_ours, init_theirs, rtol=1e-5, atol=1e-5)
    torch.manual_seed(5)
    with torch.no_grad():  # off the identity init: B (and the vectors) non-zero, so every path carries signal
        for name, parameter in ours.named_parameters():
            if TRAINED[method] in name:
                parameter.add_(0.1 * torch.randn_like(parameter))
    theirs.load_state_dict(ours.state_dict(), strict=False)  # VeRA's matrices: not in the state dict (both re-draw)
    return ours, theirs


def outputs_and_gradients(model, trained: str):
    model.eval()  # no dropout draws: the two models see the same computation
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(trained in name)
    output = model(*random_batch())[0]
    output.pow(2).sum().backward()
    return output, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def assert_same_as_peft(method: str, options: dict):
    ours, theirs = ours_and_peft(method, options)
    (out_ours, grads_ours), (out_theirs, grads_theirs) = (
        outputs_and_gradients(model, TRAINED[method]) for model in (ours, theirs)
    )
    torch.testing.assert_close(out_ours, out_theirs, rtol=1e-5, atol=1e-5)
    assert grads_ours.keys() == grads_theirs.keys() and grads_ours
    for name in grads_ours:
        torch.testing.assert_close(grads_ours[name], grads_theirs[name], rtol=1e-4, atol=1e-5, msg=name)
    bare = tiny_backbone(seed=3).eval()
    assert not torch.allclose(out_ours, bare(*random_batch())[0], atol=1e-3)  # the method changed the output


@pytest.mark.parametrize(
    "options",
    [
        {"use_rslora": True, "rank": 4, "alpha": 8.0},
        {"init": "pissa", "rank": 4, "alpha": 8.0},
        {"init": "olora", "rank": 4, "alpha": 8.0, "targets": ["query", "value", "intermediate.dense"]},
        {"init": "pissa", "use_rslora": True, "rank": 2, "alpha": 4.0, "targets": ["output.dense"]},
    ],
)
def test_lora_variants_equal_peft(options):
    assert_same_as_peft("lora", options)


@pytest.mark.parametrize(
    "options",
    [
        {"rank": 4, "alpha": 8.0},  # q, k, v
        {"rank": 2, "alpha": 4.0, "targets": ["value", "intermediate.dense", "output.dense"], "use_rslora": True},
        {"rank": 4, "alpha": 8.0, "init": "pissa"},
    ],
)
def test_dora_equals_peft(options):
    assert_same_as_peft("dora", options)


def test_ia3_equals_peft():
    assert_same_as_peft("ia3", {})


@pytest.mark.parametrize(
    "options",
    [
        {"rank": 16},  # q, v
        {"rank": 48, "targets": ["value", "intermediate.dense", "output.dense"], "projection_seed": 7},
    ],
)
def test_vera_equals_peft(options):
    assert_same_as_peft("vera", options)


def test_vera_draws_peft_matrices_from_the_seed():
    """The frozen shared A and B are peft's bit for bit (same seed): never stored, re-drawn alike everywhere."""
    config = methods.make_method_config("vera", {"rank": 8, "targets": ["query", "intermediate.dense"]})
    ours, theirs = tiny_backbone(), tiny_backbone()
    methods.get_method("vera").apply(ours, config, None)
    inject("vera", config, theirs)
    query = theirs.encoder.layer[0].attention.self.query
    assert torch.equal(ours.encoder.vera_projections.vera_A, query.vera_A["default"])  # (r, d) of the largest d_in
    assert torch.equal(ours.encoder.vera_projections.vera_B, query.vera_B["default"])  # (d_ff, r): largest d_out
    assert ours.encoder.vera_projections.vera_B.shape == (TINY.intermediate_size, 8)
    assert not any("vera_A" in key or "vera_B" in key for key in ours.state_dict())
    other = methods.make_method_config(
        "vera", {"rank": 8, "targets": ["query", "intermediate.dense"], "projection_seed": 1}
    )
    again = tiny_backbone()
    methods.get_method("vera").apply(again, other, None)
    assert not torch.equal(again.encoder.vera_projections.vera_A, ours.encoder.vera_projections.vera_A)


def test_rslora_scaling_does_not_shrink_with_the_rank():
    plain = methods.make_method_config("lora", {"rank": 64, "alpha": 16.0})
    stable = methods.make_method_config("lora", {"rank": 64, "alpha": 16.0, "use_rslora": True})
    assert plain.scaling == 0.25 and stable.scaling == 2.0


def test_pissa_and_olora_start_as_the_backbone():
    """They rewrite W0 to the residual, so the adapted model computes the backbone's function at init."""
    bare = tiny_backbone(seed=4).eval()
    expected = bare(*random_batch())[0]
    for init in ("pissa", "olora"):
        model = tiny_backbone(seed=4)
        config = methods.make_method_config("lora", {"rank": 4, "init": init, "dropout": 0.0})
        methods.get_method("lora").apply(model, config, None)
        assert model.encoder.layer[0].attention.self.query.lora_B["default"].weight.abs().sum() > 0  # B is not zero
        torch.testing.assert_close(model.eval()(*random_batch())[0], expected, rtol=1e-4, atol=1e-4)


def test_loraplus_learning_rates_are_peft_groups():
    """B (and DoRA's magnitudes) at ratio x lr, A at lr, as ``peft.optimizers.create_loraplus_optimizer``; heads at
    head_lr."""
    from peft.optimizers import create_loraplus_optimizer

    for method in ("lora", "dora"):
        config = methods.make_method_config(method, {"rank": 4, "loraplus_lr_ratio": 16.0})
        model = MultitaskModel(tiny_backbone(), parse_tasks("sst"), method, config)
        ours = build_optimizer(model, TrainConfig(method=method, lr=1e-4, head_lr=1e-3, weight_decay=0.01))
        lr_of = {id(p): group["lr"] for group in ours.param_groups for p in group["params"]}
        theirs = create_loraplus_optimizer(
            model.backbone, torch.optim.AdamW, lr=1e-4, loraplus_lr_ratio=16.0, weight_decay=0.01
        )
        peft_lr = {id(p): group["lr"] for group in theirs.param_groups for p in group["params"]}
        backbone = {id(p) for p in model.backbone.parameters() if p.requires_grad}
        assert backbone and {k: lr_of[k] for k in backbone} == {k: peft_lr[k] for k in backbone}
        assert sorted(set(peft_lr.values())) == [1e-4, 16 * 1e-4]
        assert all(lr_of[id(p)] == 1e-3 for p in model.heads.parameters())
    plain = MultitaskModel(tiny_backbone(), parse_tasks("sst"), "lora_adapter")
    optimizer = build_optimizer(plain, TrainConfig(method="lora_adapter", lr=1e-4, head_lr=1e-3))
    assert {g["lr"] for g in optimizer.param_groups} == {1e-4, 1e-3}  # ratio 1: LoRA+ off by default


def trained_model(method: str, options: dict, backbone):
    """Our model of ``method`` on ``backbone``, its trainable weights moved off their init, as if trained."""
    config = methods.make_method_config(method, options)
    model = MultitaskModel(backbone, parse_tasks("sst"), method, config).eval()
    torch.manual_seed(5)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if TRAINED[method] in name:
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model


@pytest.mark.parametrize(
    "method, options",
    [
        ("dora", {"rank": 4, "alpha": 8.0}),
        ("lora", {"rank": 4, "alpha": 8.0, "init": "pissa", "use_rslora": True}),
        ("ia3", {}),
        ("vera", {"rank": 16}),  # q, v: A (16, d), B (d, 16)
        # the largest d_in and d_out differ (A (48, d_ff), B (d_ff, 48)), another seed
        ("vera", {"rank": 48, "targets": ["value", "intermediate.dense", "output.dense"], "projection_seed": 7}),
    ],
)
def test_exported_variant_loads_in_peft_on_hf_bert(tmp_path, method, options):
    """export_peft writes DoRA's magnitudes, the variants' options, (IA)^3's vectors and VeRA's vectors and shared
    matrices under peft's keys: peft loads them onto HF BERT, and it computes what our model computes."""
    backbone = tiny_backbone(seed=2)
    hf = transformers.BertModel(transformers.BertConfig(**TINY.to_dict())).eval()
    hf.load_state_dict(backbone.state_dict())  # the pretrained W0: peft re-runs PiSSA on it when it loads
    model = trained_model(method, options, backbone)
    loaded, ids, mask = assert_peft_loads_the_export(model, hf, tmp_path)
    real = mask.bool()
    with torch.no_grad():
        theirs = loaded(input_ids=ids, attention_mask=mask).last_hidden_state
        with loaded.disable_adapter():
            without = loaded(input_ids=ids, attention_mask=mask).last_hidden_state
    assert not torch.allclose(theirs[real], without[real], atol=1e-3)  # the adapter does something


def test_exported_vera_carries_its_matrices(tmp_path):
    """The export saves VeRA's A and B (save_projection): peft computes with the matrices the model was trained
    with, not with its own draw from the seed. Shown with matrices no seed draws: the outputs still agree."""
    import json

    backbone = tiny_backbone(seed=2)
    hf = transformers.BertModel(transformers.BertConfig(**TINY.to_dict())).eval()
    hf.load_state_dict(backbone.state_dict())
    model = trained_model("vera", {"rank": 8}, backbone)
    with torch.no_grad():
        for buffer in model.backbone.encoder.vera_projections.buffers():
            buffer.mul_(-2.0)  # not what peft re-draws from projection_prng_key
    loaded, _, _ = assert_peft_loads_the_export(model, hf, tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["save_projection"] is True
    state = peft.get_peft_model_state_dict(loaded)
    assert torch.equal(state["base_model.vera_A"], model.backbone.encoder.vera_projections.vera_A)
    assert torch.equal(state["base_model.vera_B"], model.backbone.encoder.vera_projections.vera_B)


@pytest.mark.parametrize(
    "method, options, message",
    [
        ("lora", {"init": "gaussian"}, "init = 'gaussian'"),
        ("lora", {"loraplus_lr_ratio": 0.5}, "loraplus_lr_ratio = 0.5 is out of range"),
        ("lora", {"use_rslora": "yes"}, "use_rslora must be true or false"),
        ("dora", {"rank": 0}, "rank must be a positive integer"),
        ("vera", {"d_initial": -1.0}, "d_initial = -1.0 is out of range"),
        ("vera", {"targets": ["pooler"]}, "targets"),
        ("vera", {"projection_seed": 1.5}, "projection_seed must be an integer"),
        ("ia3", {"rank": 8}, "no option 'rank'"),
    ],
)
def test_bad_options_are_refused_by_name(method, options, message):
    with pytest.raises(ValueError, match=message):
        methods.make_method_config(method, options)


def test_vera_rank_bounded_by_the_backbone():
    config = methods.make_method_config("vera", {"rank": 16 * TINY.hidden_size + 1})
    with pytest.raises(ValueError, match="rank"):
        MultitaskModel(tiny_backbone(), parse_tasks("sst"), "vera", config)
