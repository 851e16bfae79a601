"""Frozen backbone: only the task heads train (the AdaptBert "pretrain" baseline)."""

from dataclasses import dataclass

from peftune.methods.base import MethodConfig, MethodSpec, register_method


@dataclass
class FrozenConfig(MethodConfig):
    pass


def apply_frozen(backbone, config: FrozenConfig, context) -> None:
    pass  # the backbone arrives frozen; the heads are trained by the model


register_method(
    MethodSpec("frozen", FrozenConfig, apply_frozen, "backbone frozen, task heads only", order=0, color="#7f7f7f")
)
