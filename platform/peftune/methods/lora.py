"""LoRA (Hu et al. 2021) through peft, shared across all tasks.

W0 + (alpha / r) * B A with B zero-initialised, W0 frozen. peft's
``inject_adapter_in_model`` finds the targets by their HF names, which the
backbone keeps, so an adapter trained here loads onto ``transformers.BertModel``
(see ``peftune.checkpoint.export_lora``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from peftune.methods.base import MethodConfig, MethodSpec, check_positive_int, check_range, register_method

# Linear layers of the backbone LoRA may adapt (leaf names, as in HF BERT)
LORA_TARGETS = ("query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense")


@dataclass
class LoraConfig(MethodConfig):
    rank: int = 8  # the AdaptBert report's smallest LoRA size
    alpha: float = 16.0  # scale alpha / r = 2 at r = 8, peft's usual pairing
    # query, key and value as in the AdaptBert report (the LoRA paper prefers q + v at equal budget)
    targets: list[str] = field(default_factory=lambda: ["query", "key", "value"])

    def __post_init__(self):
        super().__post_init__()
        check_positive_int(self, "rank")
        check_range(self, "alpha", 0.0)
        if isinstance(self.targets, str):
            self.targets = [t.strip() for t in self.targets.split(",") if t.strip()]
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        if not self.targets or bad:
            raise ValueError(
                f"LoraConfig.targets {self.targets!r}: expected a non-empty subset of {list(LORA_TARGETS)}"
            )


def peft_lora_config(config: LoraConfig):
    import peft

    # each pattern is anchored right after "encoder.layer.N.", so "output.dense" cannot
    # also match "attention.output.dense"
    patterns = {
        "query": r"attention\.self\.query",
        "key": r"attention\.self\.key",
        "value": r"attention\.self\.value",
        "attention.output.dense": r"attention\.output\.dense",
        "intermediate.dense": r"intermediate\.dense",
        "output.dense": r"output\.dense",
    }
    target_regex = r".*encoder\.layer\.\d+\.(" + "|".join(patterns[t] for t in config.targets) + r")$"
    return peft.LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=target_regex,
        bias="none",
    )


def apply_lora(backbone, config: LoraConfig, context) -> None:
    import peft

    peft.inject_adapter_in_model(peft_lora_config(config), backbone)
    # peft marks only adapter weights trainable; keep that explicit and exact
    for name, parameter in backbone.named_parameters():
        parameter.requires_grad_("lora_" in name)


register_method(
    MethodSpec("lora", LoraConfig, apply_lora, "LoRA on query/key/value (peft), shared by all tasks", size_field="rank")
)
