"""(IA)^3 (Liu et al. 2022, "Few-Shot Parameter-Efficient Fine-Tuning is Better and Cheaper than In-Context
Learning"), shared across all tasks; peft's parameter names.

Three learned vectors per layer rescale the keys, the values and the feed-forward activation:

    k' = l_k * k,   v' = l_v * v,   FFN(x) = W_out (l_ff * act(W_in x)),     l_k, l_v in R^d, l_ff in R^d_ff

so it trains 2d + d_ff parameters per layer (55,296 on bert-base), all initialised to one: the model starts as the
backbone. Placement is peft's for BERT (``IA3Config`` target ``key``, ``value``, ``output.dense`` with
``output.dense`` feed-forward, i.e. scaling the input of the FFN's down-projection), anchored as LoRA's targets are,
so the attention's own ``output.dense`` is not also matched. Each adapted linear is an :class:`IA3Linear` with
peft's names (``<linear>.base_layer``, ``<linear>.ia3_l.default``), tested against peft's ``IA3Config`` on the same
weights; a trained model exports to peft's format with ``peftune.core.checkpoint.export_peft``. (IA)^3 has no dropout
of its own: the config's ``dropout`` (common to every method) is unused here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from peftune.inputs.backbone import BertConfig, stacked_qkv
from peftune.methods.base import MethodConfig, MethodSpec, PeftFormat, register_method

# (path in a layer, feed-forward?): a feed-forward target scales its linear's input, the others its output
IA3_TARGETS = (("attention.self.key", False), ("attention.self.value", False), ("output.dense", True))


@dataclass
class IA3Config(MethodConfig):
    """No options: the paper fixes where the vectors go and that they start at one (peft's defaults too)."""


def peft_ia3_config(config: IA3Config):
    import peft

    # anchored after "encoder.layer.N." like LoRA's patterns: "output.dense" alone would match the attention's too
    return peft.IA3Config(
        target_modules=r".*encoder\.layer\.\d+\.(attention\.self\.key|attention\.self\.value|output\.dense)$",
        feedforward_modules=r".*encoder\.layer\.\d+\.output\.dense$",
    )


class IA3Linear(nn.Module):
    """``base_layer(x) * l`` (keys, values) or ``base_layer(x * l)`` (feed-forward), names as peft's ``ia3.Linear``."""

    def __init__(self, base_layer: nn.Linear, feedforward: bool):
        super().__init__()
        self.base_layer = base_layer
        self.feedforward = feedforward
        shape = (1, base_layer.in_features) if feedforward else (base_layer.out_features, 1)  # peft's shapes
        self.ia3_l = nn.ParameterDict({"default": nn.Parameter(torch.ones(shape, device=base_layer.weight.device))})

    def forward(self, x):  # (B, T, in) -> (B, T, out)
        scale = self.ia3_l["default"].flatten()
        if self.feedforward:
            return self.base_layer(x * scale)
        return self.base_layer(x) * scale


def fused_ia3_qkv(attention, x):
    """q, k, v in one matmul (the frozen weights stacked), then k and v rescaled. x: (B, T, H) -> three (B, T, H)."""
    key, value = attention.key, attention.value
    weight, bias = stacked_qkv((attention.query, key.base_layer, value.base_layer), x)  # (3H, H), (3H,)
    q, k, v = F.linear(x, weight, bias).split(attention.query.out_features, dim=-1)
    return q, k * key.ia3_l["default"].flatten(), v * value.ia3_l["default"].flatten()


def apply_ia3(backbone, config: IA3Config, context) -> None:
    for layer in backbone.encoder.layer:
        for path, feedforward in IA3_TARGETS:
            parent_name, _, leaf = path.rpartition(".")
            parent = layer.get_submodule(parent_name)
            setattr(parent, leaf, IA3Linear(getattr(parent, leaf), feedforward))
        layer.attention.self.qkv_projection = fused_ia3_qkv
    for name, parameter in backbone.named_parameters():
        parameter.requires_grad_("ia3_l" in name)


def ia3_parameter_count(bert_config: BertConfig) -> int:
    """Closed form: 2d + d_ff per layer (keys, values, the FFN activation)."""
    return bert_config.num_hidden_layers * (2 * bert_config.hidden_size + bert_config.intermediate_size)


register_method(
    MethodSpec(
        "ia3",
        IA3Config,
        apply_ia3,
        "(IA)^3: learned rescaling of keys, values and the FFN activation (peft's names), shared by all tasks",
        order=12,
        color="#8c6d31",
        peft_export=PeftFormat(peft_ia3_config, "ia3_l"),
    )
)
