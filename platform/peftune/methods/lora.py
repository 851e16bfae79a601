"""LoRA (Hu et al. 2021), shared across all tasks, written here to save time; peft's format.

W0 + (alpha / r) * B A with B zero-initialised, W0 frozen. Each adapted linear becomes a
:class:`LoraLinear` with peft's parameter names (``<linear>.base_layer``,
``<linear>.lora_A.default``, ``<linear>.lora_B.default``), so checkpoints keep their keys and
an adapter trained here exports to peft's format and loads onto ``transformers.BertModel``
(see ``peftune.checkpoint.export_lora``); it computes what peft's LoRA computes (tested on the
same weights, outputs and gradients).

Why not peft's own: peft runs each adapted linear alone (its dropout, then A, then B: three
small matmuls and a dropout per linear), which made the core's forward ~20% slower. When query,
key and value are all adapted, :func:`fused_qkv` computes the three frozen projections in one
matmul, the three A's in one matmul on ONE dropout of the input (peft draws a dropout mask per
linear: the only difference, and none at evaluation or with dropout 0), and the three B's in one
block-diagonal matmul.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from peftune.backbone import stacked_qkv
from peftune.dropout import dropout
from peftune.errors import UserError
from peftune.methods.base import (
    MethodConfig,
    MethodSpec,
    check_at_most,
    check_positive_int,
    check_range,
    register_method,
)

# Linear layers of the backbone LoRA may adapt (leaf names, as in HF BERT)
LORA_TARGETS = ("query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense")


@dataclass
class LoraConfig(MethodConfig):
    rank: int = 8  # the AdaptBert report's smallest LoRA size
    alpha: float = 16.0  # scale alpha / r = 2 at r = 8, peft's usual pairing
    # query, key and value as in the AdaptBert report (the LoRA paper prefers q + v at equal budget)
    targets: list[str] = field(default_factory=lambda: ["query", "key", "value"])

    def __post_init__(self):
        super().__post_init__()
        check_positive_int(self, "rank")
        check_range(self, "alpha", 0.0)
        if isinstance(self.targets, str):
            self.targets = [t.strip() for t in self.targets.split(",") if t.strip()]
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        if not self.targets or bad:
            raise UserError(f"LoraConfig.targets {self.targets!r}: expected a non-empty subset of {list(LORA_TARGETS)}")

    def check_backbone(self, bert) -> None:
        # B A has rank at most min(d_in, d_out) of the adapted linear: a larger r only adds parameters
        limit = min(bert.hidden_size, bert.intermediate_size)
        check_at_most(self, "rank", limit, "the smallest side of the adapted linears")
        super().check_backbone(bert)


def peft_lora_config(config: LoraConfig):
    import peft

    # each pattern is anchored right after "encoder.layer.N.", so "output.dense" cannot
    # also match "attention.output.dense"
    patterns = {
        "query": r"attention\.self\.query",
        "key": r"attention\.self\.key",
        "value": r"attention\.self\.value",
        "attention.output.dense": r"attention\.output\.dense",
        "intermediate.dense": r"intermediate\.dense",
        "output.dense": r"output\.dense",
    }
    target_regex = r".*encoder\.layer\.\d+\.(" + "|".join(patterns[t] for t in config.targets) + r")$"
    return peft.LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=target_regex,
        bias="none",
    )


class LoraLinear(nn.Module):
    """``base_layer(x) + scaling * lora_B(lora_A(dropout(x)))``, names as peft's ``lora.Linear``."""

    def __init__(self, base_layer: nn.Linear, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.base_layer = base_layer
        device = base_layer.weight.device
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base_layer.in_features, rank, bias=False, device=device)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(rank, base_layer.out_features, bias=False, device=device)})
        self.scaling = alpha / rank
        self.dropout = dropout
        # peft's initialisation: A Kaiming-uniform, B zero, so the adapted model starts as the backbone
        nn.init.kaiming_uniform_(self.lora_A["default"].weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B["default"].weight)

    def forward(self, x):  # (B, T, in) -> (B, T, out)
        h = dropout(x, self.dropout, self.training)
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](h)) * self.scaling


def fused_qkv(attention, x):
    """q, k, v of ``attention`` (a BertSelfAttention whose query/key/value are LoraLinear), fused.

    x: (B, T, H) -> three (B, T, H). Three matmuls instead of nine, one dropout instead of three.
    """
    linears = (attention.query, attention.key, attention.value)
    base_weight, base_bias = stacked_qkv([m.base_layer for m in linears])  # (3H, H), (3H,)
    a_weight = torch.cat([m.lora_A["default"].weight for m in linears])  # (3r, H)
    # (3H, 3r): B_q, B_k, B_v on the diagonal, each scaled, zeros elsewhere
    b_weight = torch.block_diag(*(m.lora_B["default"].weight * m.scaling for m in linears))
    first = linears[0]
    h = dropout(x, first.dropout, first.training)
    out = F.linear(x, base_weight, base_bias) + F.linear(F.linear(h, a_weight), b_weight)  # (B, T, 3H)
    return out.split(first.base_layer.out_features, dim=-1)


def apply_lora(backbone, config: LoraConfig, context) -> None:
    config.check_backbone(backbone.config)
    for layer in backbone.encoder.layer:
        for target in config.targets:
            parent_name, _, leaf = _TARGET_PATHS[target].rpartition(".")
            parent = layer.get_submodule(parent_name)
            setattr(parent, leaf, LoraLinear(getattr(parent, leaf), config.rank, config.alpha, config.dropout))
        if {"query", "key", "value"} <= set(config.targets):
            layer.attention.self.qkv_projection = fused_qkv
    # only the adapter's weights train; keep that explicit and exact
    for name, parameter in backbone.named_parameters():
        parameter.requires_grad_("lora_" in name)


# where each target sits inside an encoder layer
_TARGET_PATHS = {
    "query": "attention.self.query",
    "key": "attention.self.key",
    "value": "attention.self.value",
    "attention.output.dense": "attention.output.dense",
    "intermediate.dense": "intermediate.dense",
    "output.dense": "output.dense",
}


register_method(
    MethodSpec(
        "lora", LoraConfig, apply_lora, "LoRA on query/key/value (fused, peft's format), shared by all tasks", "rank"
    )
)
