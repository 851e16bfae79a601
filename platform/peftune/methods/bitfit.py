"""BitFit (Ben Zaken et al. 2021): only the backbone's bias terms train."""

from dataclasses import dataclass

from peftune.methods.base import MethodConfig, MethodSpec, register_method


@dataclass
class BitFitConfig(MethodConfig):
    pass


def apply_bitfit(backbone, config: BitFitConfig, context) -> None:
    for name, parameter in backbone.named_parameters():
        if name.endswith(".bias"):
            parameter.requires_grad_(True)


register_method(MethodSpec("bitfit", BitFitConfig, apply_bitfit, "bias terms only", order=6, color="#9467bd"))
