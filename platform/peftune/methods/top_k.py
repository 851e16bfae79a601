"""Top-k layers: the classic baseline of Houlsby et al.'s accuracy/parameters figure.

The top ``k`` Transformer layers and the pooler (where the backbone has one) train; embeddings and lower
layers stay frozen, so no gradient flows below layer L - k.
"""

from dataclasses import dataclass

from peftune.base.errors import UserError
from peftune.methods.base import (
    BERT_LAYERS,
    MAX_BERT_LAYERS,
    MethodConfig,
    MethodSpec,
    check_positive_int,
    option,
    register_method,
    unfreeze,
)


@dataclass
class TopKConfig(MethodConfig):
    k: int = option(2, "number of top layers to train")  # the top two layers: a small, common baseline budget

    def __post_init__(self):
        super().__post_init__()
        check_positive_int(self, "k", MAX_BERT_LAYERS, BERT_LAYERS)

    def check_backbone(self, bert) -> None:
        if self.k > bert.num_hidden_layers:
            raise UserError(f"TopKConfig.k = {self.k} exceeds the backbone's {bert.num_hidden_layers} layers")
        super().check_backbone(bert)


def apply_top_k(backbone, config: TopKConfig, context) -> None:
    config.check_backbone(backbone.config)
    layers = backbone.encoder.layer
    for layer in layers[len(layers) - config.k :]:
        unfreeze(layer)
    if backbone.pooler is not None:
        unfreeze(backbone.pooler)


register_method(
    MethodSpec(
        "top_k",
        TopKConfig,
        apply_top_k,
        "the top k layers and the pooler",
        size_field="k",
        order=8,
        color="#bcbd22",
        size_symbols={"k": "k"},
    )
)
