"""LoRA + Adapter, the AdaptBert report's combination (its best PEFT result).

Shared LoRA (Hu et al. 2021) on query/key/value for transfer across tasks,
plus task-specific Houlsby adapters (Houlsby et al. 2019) for isolation:
``peftune.methods.lora.apply_lora`` first (it sets ``requires_grad`` on the
whole backbone to "is a LoRA weight"), then ``peftune.methods.adapter``'s
adapters and, with ``train_layernorm``, the backbone's LayerNorms.

Placement and init are those of the two methods: LoRA's B starts at zero, the
adapters start near identity (``init_std``), so the model starts as the
backbone. ``dropout`` serves both: LoRA's input dropout and the adapters'
bottleneck dropout.
"""

from __future__ import annotations

from dataclasses import dataclass

from peftune.inputs.backbone import BertConfig, BertModel
from peftune.methods.adapter import AdapterConfig, adapter_parameter_count, apply_adapter
from peftune.methods.base import MethodSpec, TaskContext, register_method
from peftune.methods.lora import LoraConfig, apply_lora

# (input size, output size) of each LoRA target linear, in units of (hidden d, intermediate d_ff)
_TARGET_SHAPES = {
    "query": ("d", "d"),
    "key": ("d", "d"),
    "value": ("d", "d"),
    "attention.output.dense": ("d", "d"),
    "intermediate.dense": ("d", "d_ff"),
    "output.dense": ("d_ff", "d"),
}


@dataclass
class LoraAdapterConfig(AdapterConfig, LoraConfig):
    """LoRA's fields (rank, alpha, targets) and the adapters' (bottleneck, ...).

    The defaults, r = 8 and m = 64, are the report's "r=8 a=64" row.
    """


def apply_lora_adapter(backbone: BertModel, config: LoraAdapterConfig, context: TaskContext) -> None:
    apply_lora(backbone, config, context)  # resets requires_grad everywhere: must come first
    apply_adapter(backbone, config, context)


def lora_parameter_count(config: LoraConfig, bert_config: BertConfig) -> int:
    """Closed form (Hu et al.): r (d_in + d_out) per adapted linear, in every layer."""
    sizes = {"d": bert_config.hidden_size, "d_ff": bert_config.intermediate_size}
    per_layer = sum(config.rank * (sizes[i] + sizes[o]) for i, o in (_TARGET_SHAPES[t] for t in config.targets))
    return bert_config.num_hidden_layers * per_layer


def lora_adapter_parameter_count(config: LoraAdapterConfig, bert_config: BertConfig, num_tasks: int) -> dict[str, int]:
    """``shared`` = LoRA (+ LayerNorms), ``per_task`` = one task's adapters, ``total`` as in the adapter method."""
    counts = adapter_parameter_count(config, bert_config, num_tasks)
    lora = lora_parameter_count(config, bert_config)
    return {"shared": counts["shared"] + lora, "per_task": counts["per_task"], "total": counts["total"] + lora}


register_method(
    MethodSpec(
        "lora_adapter",
        LoraAdapterConfig,
        apply_lora_adapter,
        "shared LoRA on query/key/value plus task-specific Houlsby adapters (AdaptBert)",
        size_field="bottleneck",
        order=4,
        color="#2ca02c",
        size_symbols={"rank": "r", "bottleneck": "m"},
    )
)
