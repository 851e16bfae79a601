"""VeRA (Kopiczko et al. 2024, "Vector-based Random Matrix Adaptation"), shared across all tasks; peft's names.

LoRA's update with A and B frozen, random and shared by every adapted linear, and only two scaling vectors learned
per linear:

    h = W0 x + b + Lambda_b B Lambda_d A dropout(x),     A in R^{r x d_in}, B in R^{d_out x r} (slices of one pair)

so it trains d_out + r parameters per adapted matrix. Lambda_b starts at zero (the model starts as the backbone),
Lambda_d at ``d_initial`` (0.1, the paper's and peft's). A and B are drawn Kaiming-uniform from a generator seeded
with ``projection_seed``, exactly as peft's ``VeraModel`` draws them from ``projection_prng_key`` (same shapes,
same order: A (r, largest d_in) then B (largest d_out, r); each linear takes its top-left slice), so the same seed
gives peft's matrices bit for bit (tested). They are buffers kept out of the state dict: a checkpoint holds the
vectors only, and a fresh build re-draws the matrices from the seed (peft's ``save_projection=False``). The export
to peft's format (``peftune.core.checkpoint.export_peft``) writes them too (``save_projection=True``), so that peft
loads exactly the matrices trained with, whatever its torch draws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from peftune.base.errors import UserError
from peftune.inputs.backbone import BertConfig
from peftune.inputs.dropout import dropout
from peftune.methods.base import (
    BERT_WIDTH,
    MAX_BERT_WIDTH,
    MAX_WIDTH_FACTOR,
    MethodConfig,
    MethodSpec,
    PeftFormat,
    check_at_most,
    check_positive_int,
    check_range,
    option,
    register_method,
)
from peftune.methods.lora import _TARGET_PATHS, LORA_TARGETS, target_regex
from peftune.methods.lora_adapter import _TARGET_SHAPES

# a seed torch.Generator takes (a 64-bit integer), non-negative
MAX_SEED = 2**63 - 1


@dataclass
class VeraConfig(MethodConfig):
    # peft's default r; the paper used 1024 on RoBERTa-base (GLUE): the matrices are frozen, so r costs r per
    # linear, not r (d_in + d_out)
    rank: int = option(256, "rank r")
    # query and value, as the paper's GLUE runs (after the LoRA paper)
    targets: list[str] = field(default_factory=lambda: ["query", "value"])
    d_initial: float = 0.1  # Lambda_d's initial value: the paper's and peft's
    projection_seed: int = 0  # peft's projection_prng_key default

    def __post_init__(self):
        super().__post_init__()
        check_positive_int(self, "rank", MAX_WIDTH_FACTOR * MAX_BERT_WIDTH, f"{MAX_WIDTH_FACTOR} x {BERT_WIDTH}")
        # 0: Lambda_d stays 0, and with it the update and both vectors' gradients (only the heads would learn)
        check_range(self, "d_initial", 0.0, 10.0, low_inclusive=False)
        if isinstance(self.projection_seed, bool) or not isinstance(self.projection_seed, int):
            raise UserError(f"VeraConfig.projection_seed must be an integer, got {self.projection_seed!r}")
        check_range(self, "projection_seed", 0, MAX_SEED)
        if isinstance(self.targets, str):
            self.targets = [t.strip() for t in self.targets.split(",") if t.strip()]
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        if not self.targets or bad:
            raise UserError(f"VeraConfig.targets {self.targets!r}: expected a non-empty subset of {list(LORA_TARGETS)}")

    def check_backbone(self, bert: BertConfig) -> None:
        # r may exceed the hidden size (the paper's 1024 > 768), but a rank 16 x wider than the model is absurd
        limit = MAX_WIDTH_FACTOR * bert.hidden_size
        check_at_most(self, "rank", limit, f"{MAX_WIDTH_FACTOR} x its hidden size {bert.hidden_size}")
        super().check_backbone(bert)


def peft_vera_config(config: VeraConfig, save_projection: bool = False):
    """peft's config of ``config``; ``save_projection``: whether peft's checkpoint holds A and B (the export's, see
    its spec's ``peft_export``) or peft re-draws them from the seed, as our checkpoints do."""
    import peft

    return peft.VeraConfig(
        r=config.rank,
        target_modules=target_regex(config.targets),  # LoRA's anchored patterns for the same targets
        projection_prng_key=config.projection_seed,
        vera_dropout=config.dropout,
        d_initial=config.d_initial,
        save_projection=save_projection,
    )


def _vera_projections(backbone) -> dict[str, torch.Tensor]:
    # the shared A and B under the keys peft's VeraModel saves them with ("base_model.vera_A", "base_model.vera_B")
    return {f"base_model.{name}": buffer for name, buffer in backbone.encoder.vera_projections.named_buffers()}


def kaiming_uniform(shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    """peft's ``_kaiming_init``: U(-b, b), b = sqrt(3) * sqrt(2) / sqrt(fan_in), fan_in = shape[1]."""
    bound = math.sqrt(3.0) * math.sqrt(2) / math.sqrt(shape[1])
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


class VeraProjections(nn.Module):
    """The frozen random A (r, d_in max) and B (d_out max, r) every adapted linear slices; not in the state dict."""

    def __init__(self, rank: int, in_max: int, out_max: int, seed: int, device=None, dtype=None):
        super().__init__()
        if device is not None and torch.device(device).type == "meta":  # shapes only (parameter counts)
            a, b = torch.empty(rank, in_max, device=device), torch.empty(out_max, rank, device=device)
        else:
            generator = torch.Generator(device="cpu").manual_seed(seed)
            a = kaiming_uniform((rank, in_max), generator)  # drawn first, as peft's
            b = kaiming_uniform((out_max, rank), generator)
        self.register_buffer("vera_A", a.to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("vera_B", b.to(device=device, dtype=dtype), persistent=False)


class VeraLinear(nn.Module):
    """``base_layer(x) + lambda_b * (B (lambda_d * (A dropout(x))))``, names as peft's ``vera.Linear``."""

    def __init__(self, base_layer: nn.Linear, projections: VeraProjections, config: VeraConfig):
        super().__init__()
        self.base_layer = base_layer
        # a tuple, not an attribute: the one shared module must not become a submodule of every linear
        self.projections = (projections,)
        device = base_layer.weight.device
        self.vera_lambda_b = nn.ParameterDict(
            {"default": nn.Parameter(torch.zeros(base_layer.out_features, device=device))}
        )
        self.vera_lambda_d = nn.ParameterDict(
            {"default": nn.Parameter(torch.full((config.rank,), config.d_initial, device=device))}
        )
        self.dropout = config.dropout

    def forward(self, x):  # (B, T, in) -> (B, T, out)
        shared = self.projections[0]
        a = shared.vera_A[:, : self.base_layer.in_features]  # (r, in)
        b = shared.vera_B[: self.base_layer.out_features]  # (out, r)
        h = dropout(x, self.dropout, self.training)
        update = self.vera_lambda_b["default"] * F.linear(self.vera_lambda_d["default"] * F.linear(h, a), b)
        return self.base_layer(x) + update


def apply_vera(backbone, config: VeraConfig, context) -> None:
    config.check_backbone(backbone.config)
    sizes = {"d": backbone.config.hidden_size, "d_ff": backbone.config.intermediate_size}
    in_max = max(sizes[_TARGET_SHAPES[t][0]] for t in config.targets)
    out_max = max(sizes[_TARGET_SHAPES[t][1]] for t in config.targets)
    reference = backbone.embeddings.word_embeddings.weight  # the matrices follow its device and dtype
    projections = VeraProjections(
        config.rank, in_max, out_max, config.projection_seed, device=reference.device, dtype=reference.dtype
    )
    backbone.encoder.vera_projections = projections  # one owner, so .to(device) moves the matrices once
    for layer in backbone.encoder.layer:
        for target in config.targets:
            parent_name, _, leaf = _TARGET_PATHS[target].rpartition(".")
            parent = layer.get_submodule(parent_name)
            setattr(parent, leaf, VeraLinear(getattr(parent, leaf), projections, config))
    for name, parameter in backbone.named_parameters():
        parameter.requires_grad_("vera_lambda_" in name)


def vera_parameter_count(config: VeraConfig, bert_config: BertConfig) -> int:
    """Closed form (Kopiczko et al.): d_out + r per adapted linear, in every layer."""
    sizes = {"d": bert_config.hidden_size, "d_ff": bert_config.intermediate_size}
    per_layer = sum(sizes[_TARGET_SHAPES[t][1]] + config.rank for t in config.targets)
    return bert_config.num_hidden_layers * per_layer


register_method(
    MethodSpec(
        "vera",
        VeraConfig,
        apply_vera,
        "VeRA: frozen shared random A and B, trained scaling vectors, on query/value, shared by all tasks",
        "rank",
        order=13,
        color="#3182bd",
        size_symbols={"rank": "r"},
        # VeRA's frozen A and B are saved (peft's save_projection=True), not left to peft to re-draw from
        # projection_prng_key: our module draws them exactly as peft does today, but the draw is torch's CPU
        # generator's (its uniform_ may change between torch versions or platforms; peft warns so when it re-draws),
        # so saving them is what makes the export load exactly everywhere (and with the very values our model
        # computed with, in its dtype), for r (max d_in + max d_out) numbers: 1.5 MB at r = 256 on bert-base, beside
        # the vectors' 98 kB
        peft_export=PeftFormat(partial(peft_vera_config, save_projection=True), "vera_lambda_", _vera_projections),
    )
)
