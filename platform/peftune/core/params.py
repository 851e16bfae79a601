"""Parameter accounting in the AdaptBert tables' columns.

Trainable per task: what one task's training updates (shared trainable parameters plus that task's own; heads
counted apart, as the papers' percentages exclude them). Additional stored: what the method adds to the backbone
for all tasks (none for methods that only modify backbone weights). Checkpoint: every trainable parameter but the
heads. A module whose stored form differs from its training form (prefix tuning's merged MLP) says so with
``stored_parameter_count()``. Percentages are of the pretrained backbone's parameter count, the papers'
denominator. In full: docs/design.md, "Parameter accounting".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from peftune.base import record_names
from peftune.methods.base import PER_TASK


@dataclass(frozen=True)
class ParameterCounts:
    backbone: int
    shared: int  # trainable, not task-specific, excluding heads
    per_task: dict[str, int]  # each task's own method parameters, while training
    added_shared: int  # of `shared`, the parameters the method added (not backbone weights)
    heads: dict[str, int]
    stored_per_task: dict[str, int]  # each task's own parameters kept after training

    @property
    def trainable_per_task(self) -> int:
        # every task trains the same amount in all methods here; report the largest
        return self.shared + max(self.per_task.values(), default=0)

    @property
    def stored(self) -> int:
        return self.added_shared + sum(self.stored_per_task.values())

    @property
    def checkpoint(self) -> int:
        return self.shared + sum(self.per_task.values())

    def percent(self, count: int) -> float:
        return 100.0 * count / self.backbone

    def summary(self) -> dict[str, float]:
        """Flat numbers for logs and MLflow."""
        return {
            record_names.BACKBONE_PARAMS: self.backbone,
            record_names.TRAINABLE_PER_TASK: self.trainable_per_task,
            record_names.TRAINABLE_PER_TASK_PCT: self.percent(self.trainable_per_task),
            record_names.STORED_PARAMS: self.stored,
            record_names.STORED_PARAMS_PCT: self.percent(self.stored),
            record_names.CHECKPOINT_PARAMS: self.checkpoint,
            record_names.HEAD_PARAMS: sum(self.heads.values()),
        }

    def to_dict(self) -> dict:
        return asdict(self) | self.summary()


def pretrained_name(name: str) -> str:
    # peft moves a wrapped linear's own weight to "<name>.base_layer.weight"
    return name.replace(".base_layer.", ".")


def count_parameters(model) -> ParameterCounts:
    """Account a ``MultitaskModel``'s parameters (see the module docstring)."""
    pretrained = model.pretrained_parameter_names
    backbone = shared = added_shared = 0
    per_task = {task: 0 for task in model.tasks}
    for name, parameter in model.backbone.named_parameters():
        n = parameter.numel()
        is_pretrained = pretrained_name(name) in pretrained
        backbone += n if is_pretrained else 0
        if not parameter.requires_grad:
            continue
        task = task_of(name)
        if task is not None:
            per_task[task] += n
        else:
            shared += n
            added_shared += 0 if is_pretrained else n
    heads = {task: sum(p.numel() for p in head.parameters()) for task, head in model.heads.items()}
    stored_per_task = dict(per_task)
    for name, module in model.backbone.named_modules():
        task = task_of(name + ".")
        if hasattr(module, "stored_parameter_count") and task is not None:
            training = sum(p.numel() for p in module.parameters() if p.requires_grad)
            stored_per_task[task] += module.stored_parameter_count() - training
    return ParameterCounts(backbone, shared, per_task, added_shared, heads, stored_per_task)


def task_of(name: str) -> str | None:
    """The task a parameter belongs to, from the ``per_task.<task>.`` convention; None if shared."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == PER_TASK:
            return parts[i + 1]
    return None
