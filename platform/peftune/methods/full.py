"""Full fine-tuning: every backbone parameter trains, shared by all tasks."""

from dataclasses import dataclass

from peftune.methods.base import MethodConfig, MethodSpec, register_method, unfreeze


@dataclass
class FullConfig(MethodConfig):
    pass


def apply_full(backbone, config: FullConfig, context) -> None:
    unfreeze(backbone)


register_method(
    MethodSpec("full", FullConfig, apply_full, "full fine-tuning of the whole backbone", order=1, color="#8c564b")
)
