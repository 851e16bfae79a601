"""MultitaskModel = backbone + PEFT method + one head per task.

Every batch belongs to one task; ``forward(task, ...)`` routes it: the task
context tells task-specific method modules (adapters, prefixes, ...) which
parameters to use, and the task's head maps the pooled features to outputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from peftune import methods
from peftune.base.errors import UserError
from peftune.inputs.backbone import BertModel, fingerprint
from peftune.inputs.dropout import Dropout
from peftune.inputs.tasks import TaskSpec
from peftune.methods.base import MethodConfig, TaskContext

POOLINGS = ("cls", "mean")


class MultitaskModel(nn.Module):
    def __init__(
        self,
        backbone: BertModel,
        tasks: Sequence[TaskSpec],
        method: str = "frozen",
        method_config: MethodConfig | None = None,
        head_dropout: float = 0.1,
        pooling: str = "cls",
    ):
        super().__init__()
        if pooling not in POOLINGS:
            raise UserError(f"pooling {pooling!r}, expected one of {POOLINGS}")
        spec = methods.get_method(method)
        self.method = method
        self.method_config = method_config if method_config is not None else spec.config_cls()
        if not isinstance(self.method_config, spec.config_cls):
            raise TypeError(
                f"method {method!r} takes a {spec.config_cls.__name__}, got {type(self.method_config).__name__}"
            )
        self.tasks = {t.name: t for t in tasks}
        self.pooling = pooling
        self.context = TaskContext(list(self.tasks))

        self.backbone = backbone
        # taken before training: full fine-tuning changes the weights it is computed from
        # (a model on the meta device, built only to count parameters, has no weights to identify)
        meta = backbone.embeddings.word_embeddings.weight.is_meta
        self.backbone_fingerprint = None if meta else fingerprint(backbone)
        # names of the pretrained weights, to tell them from what the method adds
        self.pretrained_parameter_names = frozenset(name for name, _ in backbone.named_parameters())
        self.backbone.requires_grad_(False)  # methods unfreeze what they train
        spec.apply(self.backbone, self.method_config, self.context)
        if pooling == "mean" and self.backbone.pooler is not None:
            self.backbone.pooler.requires_grad_(False)  # unused: the heads read mean-pooled tokens

        hidden = backbone.config.hidden_size
        self.heads = nn.ModuleDict(
            {t.name: nn.Sequential(Dropout(head_dropout), nn.Linear(hidden, t.num_outputs)) for t in tasks}
        )
        for task in tasks:
            if task.kind == "regression":
                # start at the middle of the declared range (2.5 for STS): the shared weights then learn
                # from the similarity signal, not from a head still climbing from 0 towards the labels
                nn.init.constant_(self.heads[task.name][1].bias, task.head_center)

    def forward(self, task: str, input_ids, attention_mask, token_type_ids) -> torch.Tensor:
        """(B, T) token tensors of one task -> (B, num_outputs) head outputs.

        ``pooling="cls"``: the heads read the backbone's pooled output, the pooler's output of [CLS], or [CLS]'s
        hidden state itself for a backbone without a pooler (see ``BertModel``)."""
        self.context.task = task
        hidden, mask, pooled = self.backbone(input_ids, attention_mask, token_type_ids)
        # pooling and the head run in fp32 even under bf16 autocast: bf16 keeps ~3 significant digits,
        # which flattens a regression head's outputs around its mid-range start (a constant STS prediction:
        # docs/benchmarks.md, "Small figures") and the mean over tokens; both are a sliver of the compute
        with torch.autocast(hidden.device.type, enabled=False):
            hidden, pooled = hidden.float(), pooled.float()
            if self.pooling == "mean":
                weights = mask.unsqueeze(-1).to(hidden.dtype)  # (B, T', 1)
                pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1.0)  # (B, H)
            return self.heads[task](pooled)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The parameters that train (method + heads): all a checkpoint needs."""
        return {name: p.detach() for name, p in self.named_parameters() if p.requires_grad}
