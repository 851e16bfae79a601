"""LayerNorm tuning: only the gains and biases of the backbone's LayerNorms train."""

from dataclasses import dataclass

from torch import nn

from peftune.methods.base import MethodConfig, MethodSpec, register_method, unfreeze


@dataclass
class LayerNormConfig(MethodConfig):
    pass


def apply_layernorm(backbone, config: LayerNormConfig, context) -> None:
    for module in backbone.modules():
        if isinstance(module, nn.LayerNorm):
            unfreeze(module)


register_method(
    MethodSpec(
        "layernorm", LayerNormConfig, apply_layernorm, "LayerNorm gains and biases only", order=7, color="#e377c2"
    )
)
