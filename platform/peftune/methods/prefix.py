"""Prefix tuning (Li & Liang 2021, "Prefix-Tuning: Optimizing Continuous Prompts for Generation").

Every layer's self-attention gets ``prefix_length`` extra key and value vectors (after the key/value projections,
the paper's activations P) that every query may attend to (the ``kv_prefix`` hook); real tokens keep positions
0..T-1; the backbone stays frozen. Each task has its own prefix (``prefix_encoder.per_task.<task>``). During
training P = MLP(P') (the paper's reparameterisation, one MLP per task); ``merge_prefix`` folds it into the stored
(l, 2 * L * d) tensor, laid out as peft's ``PrefixEncoder`` (tested against peft with its position shift). The
prefix of all layers comes out of one MLP call per forward, cached until the backbone's forward returns.
Layout, init and dropout: docs/methods.md, "Prefix tuning".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from peftune.base.errors import UserError
from peftune.inputs.backbone import BertConfig, BertModel
from peftune.inputs.dropout import Dropout
from peftune.methods.base import (
    BERT_POSITIONS,
    BERT_WIDTH,
    MAX_BERT_POSITIONS,
    MAX_BERT_WIDTH,
    MAX_WIDTH_FACTOR,
    MethodConfig,
    MethodSpec,
    TaskContext,
    check_at_most,
    check_positive_int,
    option,
    register_method,
)

DIRECT_INIT_STD = 0.02  # BERT's initializer_range, for a prefix optimised without the MLP


@dataclass
class PrefixConfig(MethodConfig):
    # Li & Liang's table-to-text length: gains stop near 10 there (200 for summarisation);
    # sentence classification with short inputs sits at the small end.
    prefix_length: int = option(10, "prefix length")
    # train through P = MLP(P'), as the paper does (direct optimisation was unstable)
    reparameterize: bool = True
    # the MLP's hidden width; 512 is the mid_dim of Li & Liang's released code
    reparam_hidden: int = 512
    # d', the width of P'; None = the backbone's hidden size, as in Li & Liang's code and peft
    reparam_input_dim: int | None = None

    def __post_init__(self):
        super().__post_init__()
        check_positive_int(self, "prefix_length", MAX_BERT_POSITIONS, BERT_POSITIONS)
        if not isinstance(self.reparameterize, bool):
            raise UserError(f"PrefixConfig.reparameterize must be true or false, got {self.reparameterize!r}")
        width, why = MAX_WIDTH_FACTOR * MAX_BERT_WIDTH, f"{MAX_WIDTH_FACTOR} x {BERT_WIDTH}"
        check_positive_int(self, "reparam_hidden", width, why)
        if self.reparam_input_dim is not None:
            check_positive_int(self, "reparam_input_dim", width, why)

    def check_backbone(self, bert: BertConfig) -> None:
        check_at_most(self, "prefix_length", bert.max_position_embeddings, "its max_position_embeddings")
        d = bert.hidden_size
        for key in ("reparam_hidden", "reparam_input_dim"):
            check_at_most(self, key, MAX_WIDTH_FACTOR * d, f"{MAX_WIDTH_FACTOR} x its hidden size {d}")
        super().check_backbone(bert)


def _input_dim(config: PrefixConfig, bert_config: BertConfig) -> int:
    return config.reparam_input_dim or bert_config.hidden_size


def prefix_parameter_count(config: PrefixConfig, bert_config: BertConfig, num_tasks: int = 1) -> dict[str, int]:
    """Closed-form parameter counts of prefix tuning (task heads excluded).

    With l = prefix_length, L = layers, d = hidden size, d' = reparam_input_dim,
    h = reparam_hidden, and S = 2 * L * d (one key and one value per layer):

    - stored_per_task = l * S  (the merged prefix, all that inference needs)
    - trainable_per_task = l * d' + (d' * h + h) + (h * S + S)  with the MLP,
      else l * S
    - *_total = num_tasks * *_per_task (nothing is shared across tasks)
    """
    l = config.prefix_length
    size = 2 * bert_config.num_hidden_layers * bert_config.hidden_size  # S
    stored = l * size
    if config.reparameterize:
        d_in, h = _input_dim(config, bert_config), config.reparam_hidden
        trainable = l * d_in + (d_in * h + h) + (h * size + size)
    else:
        trainable = stored
    return {
        "trainable_per_task": trainable,
        "stored_per_task": stored,
        "trainable_total": num_tasks * trainable,
        "stored_total": num_tasks * stored,
    }


class TaskPrefix(nn.Module):
    """One task's prefix: ``forward()`` -> (l, 2 * L * d), through the MLP or stored directly."""

    def __init__(self, length: int, size: int, reparameterize: bool, input_dim: int, hidden: int):
        super().__init__()
        if reparameterize:
            self.embedding = nn.Parameter(torch.randn(length, input_dim))  # P': (l, d')
            self.mlp = nn.Sequential(nn.Linear(input_dim, hidden), nn.Tanh(), nn.Linear(hidden, size))
        else:
            self.prefix = nn.Parameter(torch.randn(length, size) * DIRECT_INIT_STD)  # P: (l, 2Ld)

    @property
    def reparameterized(self) -> bool:
        return hasattr(self, "mlp")

    def forward(self) -> torch.Tensor:
        if self.reparameterized:
            return self.mlp(self.embedding)  # (l, d') -> (l, 2Ld)
        return self.prefix  # (l, 2Ld)

    def stored_parameter_count(self) -> int:
        """What this prefix keeps after training: the merged (l, 2Ld) tensor (see ``peftune.core.params``)."""
        length = (self.embedding if self.reparameterized else self.prefix).shape[0]
        size = self.mlp[-1].out_features if self.reparameterized else self.prefix.shape[1]
        return length * size

    @torch.no_grad()
    def merge(self) -> None:
        """Replace P' and the MLP by the prefix they produce (the paper drops the MLP after training)."""
        if not self.reparameterized:
            return
        requires_grad = self.embedding.requires_grad
        prefix = self.mlp(self.embedding).detach().clone()  # (l, 2Ld)
        del self.embedding, self.mlp
        self.prefix = nn.Parameter(prefix, requires_grad=requires_grad)


class PrefixEncoder(nn.Module):
    """All tasks' prefixes; serves the current task's keys/values to every layer's hook."""

    def __init__(self, config: PrefixConfig, bert_config: BertConfig, context: TaskContext):
        super().__init__()
        self.context = context
        self.length = config.prefix_length
        self.num_layers = bert_config.num_hidden_layers
        self.num_heads = bert_config.num_attention_heads
        self.head_dim = bert_config.head_dim
        size = 2 * self.num_layers * bert_config.hidden_size
        self.per_task = nn.ModuleDict(
            {
                task: TaskPrefix(
                    self.length,
                    size,
                    config.reparameterize,
                    _input_dim(config, bert_config),
                    config.reparam_hidden,
                )
                for task in context.tasks
            }
        )
        self.dropout = Dropout(config.dropout)
        # the current forward's prefix, (L, 2, B, nh, l, hd); only kept between the backbone's pre/post hooks
        self._in_forward = False
        self._cache: torch.Tensor | None = None

    def key_values(self, batch_size: int) -> torch.Tensor:
        """The current task's prefix for all layers: (L, 2, B, nh, l, hd), one MLP call."""
        if self._in_forward and self._cache is not None and self._cache.shape[2] == batch_size:
            return self._cache
        prefix = self.per_task[self.context.task]()  # (l, 2Ld)
        prefix = self.dropout(prefix.expand(batch_size, -1, -1))  # (B, l, 2Ld), a mask per example
        B, l = batch_size, self.length
        kv = prefix.view(B, l, self.num_layers, 2, self.num_heads, self.head_dim)
        kv = kv.permute(2, 3, 0, 4, 1, 5)  # (L, 2, B, nh, l, hd)
        if self._in_forward:
            self._cache = kv
        return kv

    @torch.no_grad()
    def merge(self) -> None:
        for prefix in self.per_task.values():
            prefix.merge()

    # forward pre-/post-hooks of the backbone: the cache lives for one forward only
    def begin_forward(self, module, args) -> None:
        self._in_forward, self._cache = True, None

    def end_forward(self, module, args, output) -> None:
        self._in_forward, self._cache = False, None


class LayerPrefix(nn.Module):
    """The ``kv_prefix`` hook of one layer: its slice of the shared ``PrefixEncoder`` output."""

    def __init__(self, encoder: PrefixEncoder, layer_index: int):
        super().__init__()
        # a plain reference, not a submodule: the encoder is registered once, on the backbone
        object.__setattr__(self, "encoder", encoder)
        self.layer_index = layer_index

    def forward(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self.encoder.key_values(batch_size)[self.layer_index]  # (2, B, nh, l, hd)
        return kv[0], kv[1]  # keys, values: (B, nh, l, hd) each

    def extra_repr(self) -> str:
        return f"layer={self.layer_index}"


def apply_prefix(backbone: BertModel, config: PrefixConfig, context: TaskContext) -> None:
    layers = [layer.attention.self for layer in backbone.encoder.layer]
    if hasattr(backbone, "prefix_encoder") or any(attention.kv_prefix is not None for attention in layers):
        raise UserError("the backbone already has a kv_prefix installed; prefix tuning applies once")
    config.check_backbone(backbone.config)
    encoder = PrefixEncoder(config, backbone.config, context)
    backbone.prefix_encoder = encoder  # parameters: prefix_encoder.per_task.<task>.*
    for index, attention in enumerate(layers):
        attention.kv_prefix = LayerPrefix(encoder, index)
    backbone.register_forward_pre_hook(encoder.begin_forward)
    backbone.register_forward_hook(encoder.end_forward)


def merge_prefix(model: nn.Module) -> nn.Module:
    """Fold every task's MLP into its plain prefix tensor (in place), for inference and storage.

    Afterwards each task holds l * 2 * L * d parameters; outputs are unchanged.
    ``model`` is a ``MultitaskModel``, a backbone, or anything containing a ``PrefixEncoder``.
    """
    encoders = [module for module in model.modules() if isinstance(module, PrefixEncoder)]
    if not encoders:
        raise UserError(f"{type(model).__name__} has no prefix-tuning modules to merge")
    for encoder in encoders:
        encoder.merge()
    return model


register_method(
    MethodSpec(
        "prefix",
        PrefixConfig,
        apply_prefix,
        "prefix tuning: per-task key/value prefixes at every layer, MLP-reparameterised while training",
        size_field="prefix_length",
        order=9,
        color="#17becf",
        size_symbols={"prefix_length": "l"},
    )
)
