"""LoRA (Hu et al. 2021), shared across all tasks, written here to save time; peft's format.

W0 + (alpha / r) * B A with B zero-initialised, W0 frozen. Its variants are options a sweep searches, each as peft
0.21 computes it (tested against peft): ``use_rslora`` (alpha / sqrt(r)), ``loraplus_lr_ratio`` (LoRA+: B at that
many times A's learning rate) and ``init`` (``lora``, ``pissa`` or ``olora``; the last two replace W0 by a
residual, deterministic in W0, so a checkpoint of A and B is enough). Each adapted linear is a
:class:`LoraLinear` with peft's parameter names, so an adapter trained here exports to peft's format and loads onto
``transformers.BertModel``. When query, key and value are all adapted, :func:`fused_qkv` computes the three frozen
projections, the three A's (on ONE dropout of the input, where peft draws one per linear) and the three B's in one
matmul each. The variants and why not peft's own layers: docs/methods.md, "LoRA".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from peftune.base.errors import UserError
from peftune.inputs.backbone import stacked_qkv
from peftune.inputs.dropout import dropout
from peftune.methods.base import (
    BERT_WIDTH,
    MAX_BERT_WIDTH,
    MethodConfig,
    MethodSpec,
    PeftFormat,
    check_at_most,
    check_positive_int,
    check_range,
    option,
    register_method,
)

# Linear layers of the backbone LoRA may adapt (leaf names, as in HF BERT)
LORA_TARGETS = ("query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense")
# initialisations of A and B (peft's init_lora_weights: True, "pissa", "olora")
LORA_INITS = ("lora", "pissa", "olora")
# a sane bound on LoRA+'s ratio: its paper's best ratios on encoders were 2 to 2**4 (peft's docs: 16)
MAX_LORAPLUS_RATIO = 2**10


@dataclass
class LoraConfig(MethodConfig):
    rank: int = option(8, "rank r")  # the AdaptBert report's smallest LoRA size
    alpha: float = option(16.0, "LoRA alpha (scale alpha/r)")  # scale alpha / r = 2 at r = 8, peft's usual pairing
    # query, key and value as in the AdaptBert report (the LoRA paper prefers q + v at equal budget)
    targets: list[str] = field(default_factory=lambda: ["query", "key", "value"])
    use_rslora: bool = False  # peft's default: the LoRA paper's alpha / r
    loraplus_lr_ratio: float = 1.0  # 1: plain LoRA, A and B at one rate (LoRA+ off, as peft's LoraConfig)
    init: str = "lora"  # the LoRA paper's init (peft's init_lora_weights=True)
    # DoRA (peftune.methods.dora) sets True: a LoRA config that also learns a magnitude per output
    use_dora: ClassVar[bool] = False

    def __post_init__(self):
        super().__post_init__()
        check_positive_int(self, "rank", MAX_BERT_WIDTH, BERT_WIDTH)
        check_range(self, "alpha", 0.0, low_inclusive=False)  # 0: B A scaled by 0, neither A nor B learns
        if not isinstance(self.use_rslora, bool):
            raise UserError(f"{type(self).__name__}.use_rslora must be true or false, got {self.use_rslora!r}")
        check_range(self, "loraplus_lr_ratio", 1.0, MAX_LORAPLUS_RATIO)
        if self.init not in LORA_INITS:
            raise UserError(f"{type(self).__name__}.init = {self.init!r}; expected one of {list(LORA_INITS)}")
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

    @property
    def scaling(self) -> float:
        """What B A is multiplied by: alpha / r (LoRA), alpha / sqrt(r) (rsLoRA)."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def lr_scale(self, name: str, parameter) -> float:
        # LoRA+ as peft's create_loraplus_optimizer groups it: B, and the 1-D LoRA parameters (DoRA's magnitudes),
        # at ratio x lr; A at lr. The adapters of lora_adapter are not LoRA's: they keep lr
        if "lora_B" in name or ("lora_" in name and parameter.ndim == 1):
            return self.loraplus_lr_ratio
        return 1.0


def target_regex(targets: list[str]) -> str:
    """peft's ``target_modules`` for ``targets``: each pattern anchored right after "encoder.layer.N.", so
    "output.dense" cannot also match "attention.output.dense"."""
    return r".*encoder\.layer\.\d+\.(" + "|".join(_PATTERNS[t] for t in targets) + r")$"


_PATTERNS = {
    "query": r"attention\.self\.query",
    "key": r"attention\.self\.key",
    "value": r"attention\.self\.value",
    "attention.output.dense": r"attention\.output\.dense",
    "intermediate.dense": r"intermediate\.dense",
    "output.dense": r"output\.dense",
}


def peft_lora_config(config: LoraConfig):
    import peft

    return peft.LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=target_regex(config.targets),
        bias="none",
        use_rslora=config.use_rslora,
        use_dora=config.use_dora,
        init_lora_weights=True if config.init == "lora" else config.init,
    )


class LoraLinear(nn.Module):
    """``base_layer(x) + scaling * lora_B(lora_A(dropout(x)))``, names as peft's ``lora.Linear``."""

    def __init__(self, base_layer: nn.Linear, config: LoraConfig):
        super().__init__()
        self.base_layer = base_layer
        device, rank = base_layer.weight.device, config.rank
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base_layer.in_features, rank, bias=False, device=device)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(rank, base_layer.out_features, bias=False, device=device)})
        self.scaling = config.scaling
        self.dropout = config.dropout
        # peft's initialisation: A Kaiming-uniform, B zero, so the adapted model starts as the backbone
        nn.init.kaiming_uniform_(self.lora_A["default"].weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B["default"].weight)
        if config.init != "lora" and device.type != "meta":  # meta: shapes only (parameter counts), no values
            self.init_from_base(config.init)

    @torch.no_grad()
    def init_from_base(self, init: str) -> None:
        """PiSSA / OLoRA: A and B from W0 (as peft's ``pissa_init`` / ``olora_init``), W0 <- W0 - scaling B A."""
        weight = self.base_layer.weight
        w = weight.float()  # (out, in); the decompositions in fp32, as peft's
        r = self.lora_A["default"].out_features
        if init == "pissa":  # W0 = U S V^T; A = sqrt(S_r / s) V_r^T, B = U_r sqrt(S_r / s)
            u, s, vh = torch.linalg.svd(w, full_matrices=False)
            root = torch.sqrt(s[:r] / self.scaling)
            a, b = root[:, None] * vh[:r], u[:, :r] * root[None, :]  # (r, in), (out, r)
        else:  # olora: W0 = Q R; A = R_r, B = Q_r (no division by the scaling: peft's olora_init)
            q, rr = torch.linalg.qr(w)
            a, b = rr[:r], q[:, :r]
        self.lora_A["default"].weight.copy_(a)
        self.lora_B["default"].weight.copy_(b)
        weight.copy_((w - self.scaling * b @ a).to(weight.dtype))  # the model still computes W0 at init

    def forward(self, x):  # (B, T, in) -> (B, T, out)
        h = dropout(x, self.dropout, self.training)
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](h)) * self.scaling


def fused_qkv(attention, x):
    """q, k, v of ``attention`` (a BertSelfAttention whose query/key/value are LoraLinear), fused.

    x: (B, T, H) -> three (B, T, H). Three matmuls instead of nine, one dropout instead of three.
    """
    linears = (attention.query, attention.key, attention.value)
    base_weight, base_bias = stacked_qkv([m.base_layer for m in linears], x)  # (3H, H), (3H,)
    a_weight = torch.cat([m.lora_A["default"].weight for m in linears])  # (3r, H)
    # (3H, 3r): B_q, B_k, B_v on the diagonal, each scaled, zeros elsewhere
    b_weight = torch.block_diag(*(m.lora_B["default"].weight * m.scaling for m in linears))
    first = linears[0]
    h = dropout(x, first.dropout, first.training)
    out = F.linear(x, base_weight, base_bias) + F.linear(F.linear(h, a_weight), b_weight)  # (B, T, 3H)
    return out.split(first.base_layer.out_features, dim=-1)


def apply_lora(backbone, config: LoraConfig, context, linear_cls: type[LoraLinear] = LoraLinear) -> None:
    """Replace each target linear by ``linear_cls`` (LoRA's; DoRA passes its own, which the fused q/k/v cannot
    compute, so it gets none)."""
    config.check_backbone(backbone.config)
    for layer in backbone.encoder.layer:
        for target in config.targets:
            parent_name, _, leaf = _TARGET_PATHS[target].rpartition(".")
            parent = layer.get_submodule(parent_name)
            setattr(parent, leaf, linear_cls(getattr(parent, leaf), config))
        if linear_cls is LoraLinear and {"query", "key", "value"} <= set(config.targets):
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
        "lora",
        LoraConfig,
        apply_lora,
        "LoRA on query/key/value (fused, peft's format), shared by all tasks",
        "rank",
        order=2,
        color="#1f77b4",
        size_symbols={"rank": "r"},
        peft_export=PeftFormat(peft_lora_config, "lora_"),
    )
)
