"""DoRA (Liu et al. 2024, "Weight-Decomposed Low-Rank Adaptation"), shared across all tasks; peft's format.

Each adapted weight is a direction, LoRA's W0 + s B A normalised row by row, times a learned magnitude m per
output row (initialised to the rows' norms):

    W' = m / ||W0 + s B A||_row  *  (W0 + s B A),       s = alpha / r (or alpha / sqrt(r) with rsLoRA)

so it trains LoRA's r (d_in + d_out) plus d_out parameters per adapted matrix; the norm is detached in backward,
as in the paper and peft. Every LoRA option applies, with peft's parameter names
(``<linear>.lora_magnitude_vector.default.weight``), so an adapter trained here exports to peft's format and
computes what ``LoraConfig(use_dora=True)`` computes (tested). It does not use LoRA's fused q/k/v: each adapted
linear needs its own norms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from peftune.inputs.dropout import dropout
from peftune.methods.base import MethodSpec, PeftFormat, register_method
from peftune.methods.lora import LoraConfig, LoraLinear, apply_lora, peft_lora_config
from peftune.methods.lora_adapter import _TARGET_SHAPES, lora_parameter_count


@dataclass
class DoraConfig(LoraConfig):
    """LoRA's fields; the defaults are LoRA's (r = 8, alpha = 16 on query/key/value), so DoRA and LoRA compare at
    one size (the DoRA paper's own runs used LoRA's settings of each benchmark)."""

    use_dora: ClassVar[bool] = True


class Magnitude(nn.Module):
    """m, one value per output row; a module only so that the parameter's name is peft's (``...default.weight``)."""

    def __init__(self, out_features: int, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, device=device))


class DoraLinear(LoraLinear):
    """``m / ||W0 + s B A||_row * (W0 x + s B A dropout(x)) + bias``, computed as peft's DoRA does."""

    def __init__(self, base_layer: nn.Linear, config: LoraConfig):
        super().__init__(base_layer, config)  # LoRA's A, B and init (PiSSA / OLoRA change W0 first)
        device = base_layer.weight.device
        self.lora_magnitude_vector = nn.ModuleDict({"default": Magnitude(base_layer.out_features, device=device)})
        if device.type != "meta":  # m starts at the rows' norms, so the model starts as the backbone
            with torch.no_grad():
                self.lora_magnitude_vector["default"].weight.copy_(self.weight_norm())

    def weight_norm(self) -> torch.Tensor:  # (out,), of W0 + s B A, no gradient (the paper's section 4.3)
        with torch.no_grad():
            a, b = self.lora_A["default"].weight, self.lora_B["default"].weight
            weight = self.base_layer.weight.float() + self.scaling * (b.float() @ a.float())  # (out, in)
            return torch.linalg.norm(weight, dim=1)

    def forward(self, x):  # (B, T, in) -> (B, T, out)
        base = self.base_layer(x)
        h = dropout(x, self.dropout, self.training)
        scale = (self.lora_magnitude_vector["default"].weight / self.weight_norm()).to(base.dtype)  # (out,)
        if self.dropout == 0 or not self.training:  # no dropout: W0 x is the base output less its bias (as peft)
            plain = base if self.base_layer.bias is None else base - self.base_layer.bias
        else:  # peft's DoRA rescales W0 applied to the dropped-out input
            plain = F.linear(h, self.base_layer.weight)
        lora = self.lora_B["default"](self.lora_A["default"](h)) * self.scaling
        return base + (scale - 1) * plain + scale * lora


def apply_dora(backbone, config: DoraConfig, context) -> None:
    apply_lora(backbone, config, context, linear_cls=DoraLinear)  # "lora_" in the magnitudes' names: they train


def dora_parameter_count(config: DoraConfig, bert_config) -> int:
    """Closed form: LoRA's r (d_in + d_out) plus d_out (the magnitudes) per adapted linear, in every layer."""
    sizes = {"d": bert_config.hidden_size, "d_ff": bert_config.intermediate_size}
    magnitudes = sum(sizes[_TARGET_SHAPES[t][1]] for t in config.targets)
    return lora_parameter_count(config, bert_config) + bert_config.num_hidden_layers * magnitudes


register_method(
    MethodSpec(
        "dora",
        DoraConfig,
        apply_dora,
        "DoRA: LoRA on query/key/value plus a learned magnitude per output row (peft's format), shared by all tasks",
        "rank",
        order=11,
        color="#843c39",
        size_symbols={"rank": "r"},
        peft_export=PeftFormat(peft_lora_config, "lora_"),  # peft's LoraConfig(use_dora=True)
    )
)
