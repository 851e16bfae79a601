"""Parameter accounting against closed-form counts on the bert-base shape (no download)."""

import pytest
import torch

from peftune import methods
from peftune.core.model import MultitaskModel
from peftune.core.params import count_parameters
from peftune.inputs.backbone import BertConfig, BertModel
from peftune.inputs.tasks import parse_tasks

BASE = BertConfig()  # bert-base-uncased's shape
D, L, FFN, V, P = BASE.hidden_size, BASE.num_hidden_layers, BASE.intermediate_size, BASE.vocab_size, 512
BERT_BASE_PARAMS = 109_482_240  # the AdaptBert tables' denominator
TASKS = parse_tasks("sst,para,sts")


def counts_for(method: str, **options):
    with torch.device("meta"):  # exact shapes, no memory, no initialisation cost
        model = MultitaskModel(BertModel(BASE), TASKS, method, methods.make_method_config(method, options))
    return count_parameters(model)


def layer_params() -> int:
    attention = 4 * (D * D + D) + 2 * D
    ffn = (D * FFN + FFN) + (FFN * D + D) + 2 * D
    return attention + ffn


def test_bert_base_backbone_count():
    assert counts_for("frozen").backbone == BERT_BASE_PARAMS
    embeddings = (V + P + 2) * D + 2 * D
    assert embeddings + L * layer_params() + (D * D + D) == BERT_BASE_PARAMS


@pytest.mark.parametrize(
    "method, options, trainable, stored",
    [
        ("frozen", {}, 0, 0),
        ("full", {}, BERT_BASE_PARAMS, 0),
        # biases: q, k, v, attention output, intermediate, output, two LayerNorms per layer; embedding LN; pooler
        ("bitfit", {}, L * (4 * D + FFN + D + 2 * D) + D + D, 0),
        ("layernorm", {}, L * 2 * 2 * D + 2 * D, 0),
        ("top_k", {"k": 2}, 2 * layer_params() + D * D + D, 0),
        # LoRA on q, k, v: r (d + d) per matrix; the AdaptBert report's r=8 figure is 442,368 = 0.40%
        ("lora", {"rank": 8}, 442_368, 442_368),
        ("lora", {"rank": 16, "targets": ["query", "value"]}, L * 2 * 16 * 2 * D, L * 2 * 16 * 2 * D),
        # the FFN pair: intermediate (d -> 4d) and output (4d -> d), each r (d + 4d)
        (
            "lora",
            {"rank": 4, "targets": ["intermediate.dense", "output.dense"]},
            L * 2 * 4 * (D + FFN),
            L * 2 * 4 * (D + FFN),
        ),
        # Houlsby: two adapters of 2md + d + m per layer and task; LayerNorms train too but are backbone weights
        (
            "adapter",
            {"bottleneck": 64},
            2 * L * (2 * 64 * D + D + 64) + (2 * L + 1) * 2 * D,
            3 * 2 * L * (2 * 64 * D + D + 64),
        ),
        # prefix: trains P' (l x d) and an MLP d -> 512 -> 2Ld per task; stores only the merged l x 2Ld prefix
        ("prefix", {"prefix_length": 10}, 10 * D + (D * 512 + 512) + (512 * 2 * L * D + 2 * L * D), 3 * 10 * 2 * L * D),
        ("prompt", {"prompt_length": 20}, 20 * D, 3 * 20 * D),
        # DoRA: LoRA's r (d + d) plus a magnitude of d_out per matrix; on q, k, v at r=8: 442,368 + 27,648
        ("dora", {"rank": 8}, 470_016, 470_016),
        ("dora", {"rank": 4, "targets": ["intermediate.dense"]}, L * (4 * (D + FFN) + FFN), L * (4 * (D + FFN) + FFN)),
        # (IA)^3: keys, values (d each) and the FFN activation (d_ff) per layer: 55,296 on bert-base
        ("ia3", {}, 55_296, 55_296),
        # VeRA: d_out + r per adapted matrix (the random A and B are frozen, re-drawn from the seed: not stored)
        ("vera", {}, L * 2 * (D + 256), L * 2 * (D + 256)),
        (
            "vera",
            {"rank": 1024, "targets": ["value", "intermediate.dense"]},
            L * (D + FFN + 2 * 1024),
            L * (D + FFN + 2 * 1024),
        ),
        # LoRA's variants change no count: rsLoRA a scale, LoRA+ a learning rate, PiSSA / OLoRA an init
        ("lora", {"rank": 8, "use_rslora": True, "loraplus_lr_ratio": 16.0, "init": "pissa"}, 442_368, 442_368),
    ],
)
def test_closed_form_counts(method, options, trainable, stored):
    counts = counts_for(method, **options)
    assert counts.trainable_per_task == trainable
    assert counts.stored == stored
    assert counts.heads == {"sst": D * 5 + 5, "para": D + 1, "sts": D + 1}


def test_lora_percent_matches_the_report():
    counts = counts_for("lora", rank=8)
    assert round(counts.percent(counts.trainable_per_task), 2) == 0.40


def test_closed_forms_of_the_new_methods_agree_with_the_models():
    from peftune.methods.dora import dora_parameter_count
    from peftune.methods.ia3 import ia3_parameter_count
    from peftune.methods.vera import vera_parameter_count

    assert ia3_parameter_count(BASE) == L * (2 * D + FFN) == 55_296  # the figure
    for method, closed_form in (("dora", dora_parameter_count), ("vera", vera_parameter_count)):
        config = methods.make_method_config(method, {"targets": ["query", "output.dense"]})
        assert counts_for(method, targets=["query", "output.dense"]).trainable_per_task == closed_form(config, BASE)
