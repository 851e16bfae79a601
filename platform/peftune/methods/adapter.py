"""Houlsby bottleneck adapters (Houlsby et al. 2019, "Parameter-Efficient Transfer Learning for NLP").

    A(x) = x + W_up · dropout(act(W_down · x + b_down)) + b_up,     W_down: d -> m, W_up: m -> d

(2md + d + m parameters), two per layer at the hooks ``attention.output.adapter`` and ``output.adapter``, on the
sub-layer's output before the residual add and LayerNorm (the paper's Figure 2). Task-specific: one adapter per
task under ``per_task``, routed by ``context.task``; the backbone's LayerNorms train too, shared
(``train_layernorm``). Init near identity: weights N(0, init_std²), init_std 1e-3 by default, biases zero;
``zero_init_up`` makes it exactly the identity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from peftune.base.errors import UserError
from peftune.inputs.backbone import BertConfig, BertModel
from peftune.inputs.dropout import Dropout
from peftune.methods.base import (
    BERT_LAYERS,
    BERT_WIDTH,
    MAX_BERT_LAYERS,
    MAX_BERT_WIDTH,
    MAX_BOTTLENECK_FACTOR,
    MethodConfig,
    MethodSpec,
    TaskContext,
    check_at_most,
    check_positive_int,
    check_range,
    option,
    register_method,
)
from peftune.methods.layernorm import LayerNormConfig, apply_layernorm

ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "tanh": torch.tanh, "silu": F.silu}

# The backbone's hook points, in the order of a layer's forward (paths from a BertLayer)
POSITIONS = ("attention.output", "output")


def check_bool(config, key: str) -> None:
    value = getattr(config, key)
    if not isinstance(value, bool):
        raise UserError(f"{type(config).__name__}.{key} must be true or false, got {value!r}")


@dataclass
class AdapterConfig(MethodConfig):
    # m; the paper's sweep was {8, 64, 256}, 64 its usual middle
    bottleneck: int = option(64, "adapter bottleneck size m")
    activation: str = "gelu"  # the backbone's own non-linearity
    init_std: float = 1e-3  # near identity; the paper found performance robust below 1e-2
    zero_init_up: bool = False  # True: W_up = 0, so the adapter is exactly the identity at init
    train_layernorm: bool = True  # the paper trains the backbone's LayerNorms (shared) with the adapters
    # the layers (0-based) that get adapters; None = all. Upper layers matter most (the paper's ablation)
    layers: list[int] | None = None

    def __post_init__(self):
        super().__post_init__()
        limit, why = MAX_BOTTLENECK_FACTOR * MAX_BERT_WIDTH, f"{MAX_BOTTLENECK_FACTOR} x {BERT_WIDTH}"
        check_positive_int(self, "bottleneck", limit, why)
        if self.activation not in ACTIVATIONS:
            raise UserError(
                f"{type(self).__name__}.activation = {self.activation!r}; expected one of {sorted(ACTIVATIONS)}"
            )
        check_range(self, "init_std", 0.0, 1.0)
        check_bool(self, "zero_init_up")
        check_bool(self, "train_layernorm")
        if self.layers is not None:
            layers = self.layers
            if isinstance(layers, str):  # "8,9,10,11" from a command line
                layers = [int(s) if s.strip().isdigit() else s for s in layers.split(",") if s.strip()]
            layers = list(layers)
            bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < MAX_BERT_LAYERS]
            if not layers or bad or len(set(layers)) != len(layers):
                raise UserError(
                    f"{type(self).__name__}.layers = {self.layers!r}; expected None (all layers) or "
                    f"distinct 0-based layer indices below {MAX_BERT_LAYERS} ({BERT_LAYERS})"
                )
            self.layers = sorted(layers)

    def check_backbone(self, bert: BertConfig) -> None:
        limit = MAX_BOTTLENECK_FACTOR * bert.hidden_size
        check_at_most(self, "bottleneck", limit, f"{MAX_BOTTLENECK_FACTOR} x its hidden size {bert.hidden_size}")
        adapter_layers(self, bert.num_hidden_layers)
        super().check_backbone(bert)


class HoulsbyAdapter(nn.Module):
    """One task's adapter at one position: x + up(dropout(act(down(x))))."""

    def __init__(self, hidden: int, config: AdapterConfig, device=None, dtype=None):
        super().__init__()
        self.down = nn.Linear(hidden, config.bottleneck, device=device, dtype=dtype)
        self.up = nn.Linear(config.bottleneck, hidden, device=device, dtype=dtype)
        self.act = ACTIVATIONS[config.activation]
        self.dropout = Dropout(config.dropout)
        nn.init.normal_(self.down.weight, std=config.init_std)
        if config.zero_init_up:
            nn.init.zeros_(self.up.weight)
        else:
            nn.init.normal_(self.up.weight, std=config.init_std)
        nn.init.zeros_(self.down.bias)
        nn.init.zeros_(self.up.bias)

    def forward(self, x):  # (B, T, d) -> (B, T, d)
        h = self.dropout(self.act(self.down(x)))  # (B, T, m)
        return x + self.up(h)


class TaskAdapters(nn.Module):
    """The module at one hook point: one adapter per task, picked by ``context.task``."""

    def __init__(self, context: TaskContext, adapters: dict[str, nn.Module]):
        super().__init__()
        self.context = context  # a plain object, not a submodule: shared by every hook
        self.per_task = nn.ModuleDict(adapters)  # names contain ".per_task.<task>."

    def forward(self, x):  # (B, T, d) -> (B, T, d)
        return self.per_task[self.context.task](x)


def adapter_layers(config: AdapterConfig, num_layers: int) -> list[int]:
    """The layer indices that get adapters; an index the backbone lacks is an error."""
    if config.layers is None:
        return list(range(num_layers))
    if config.layers[-1] >= num_layers:
        raise UserError(
            f"{type(config).__name__}.layers = {config.layers}: the backbone has layers 0..{num_layers - 1}"
        )
    return config.layers


def install_adapters(backbone: BertModel, config: AdapterConfig, context: TaskContext) -> None:
    """Put a TaskAdapters (trainable) at both hook points of every selected layer."""
    reference = backbone.embeddings.word_embeddings.weight  # new modules follow its device and dtype
    hidden = backbone.config.hidden_size
    for i in adapter_layers(config, len(backbone.encoder.layer)):
        layer = backbone.encoder.layer[i]
        for position in POSITIONS:
            adapters = {
                task: HoulsbyAdapter(hidden, config, device=reference.device, dtype=reference.dtype)
                for task in context.tasks
            }
            layer.get_submodule(position).adapter = TaskAdapters(context, adapters)


def apply_adapter(backbone: BertModel, config: AdapterConfig, context: TaskContext) -> None:
    config.check_backbone(backbone.config)
    if config.train_layernorm:
        apply_layernorm(backbone, LayerNormConfig(), context)
    install_adapters(backbone, config, context)


def layernorm_parameter_count(bert_config: BertConfig) -> int:
    """The backbone's LayerNorms: two per layer, a gain and a bias of size d each, and the embeddings' one, of the
    embeddings' width (d but for an ELECTRA with narrower embeddings)."""
    return 2 * bert_config.num_hidden_layers * 2 * bert_config.hidden_size + 2 * bert_config.embedding_width


def adapter_parameter_count(config: AdapterConfig, bert_config: BertConfig, num_tasks: int) -> dict[str, int]:
    """Closed form (Houlsby et al.): per task, 2 adapters x L_a layers x (2md + d + m).

    Returns ``shared`` (trainable, shared by all tasks: the backbone's
    LayerNorms if trained), ``per_task`` (each task's own adapters) and
    ``total`` = shared + num_tasks * per_task (all trainable backbone parameters).
    """
    d, m = bert_config.hidden_size, config.bottleneck
    num_layers = len(adapter_layers(config, bert_config.num_hidden_layers))
    per_task = len(POSITIONS) * num_layers * (2 * m * d + d + m)
    shared = layernorm_parameter_count(bert_config) if config.train_layernorm else 0
    return {"shared": shared, "per_task": per_task, "total": shared + num_tasks * per_task}


register_method(
    MethodSpec(
        "adapter",
        AdapterConfig,
        apply_adapter,
        "Houlsby bottleneck adapters, two per layer, one set per task; LayerNorms shared",
        size_field="bottleneck",
        order=3,
        color="#ff7f0e",
        size_symbols={"bottleneck": "m"},
    )
)
