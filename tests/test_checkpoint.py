"""A LoRA adapter trained here loads onto transformers.BertModel with peft and gives the same outputs."""

import pytest
import torch
import transformers

from conftest import TINY, assert_peft_loads_the_export, tiny_backbone
from peftune import methods
from peftune.core.checkpoint import CheckpointError, export_peft
from peftune.core.model import MultitaskModel
from peftune.inputs.tasks import parse_tasks


@pytest.mark.parametrize("targets", [["query", "key", "value"], ["query", "value", "output.dense"]])
def test_exported_lora_equals_peft_on_hf_bert(tmp_path, targets):
    backbone = tiny_backbone(seed=2)
    hf = transformers.BertModel(transformers.BertConfig(**TINY.to_dict())).eval()
    hf.load_state_dict(backbone.state_dict())
    config = methods.make_method_config("lora", {"rank": 4, "alpha": 8.0, "targets": targets})
    model = MultitaskModel(backbone, parse_tasks("sst"), "lora", config).eval()
    with torch.no_grad():  # as if trained: B is no longer zero
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_()
    loaded, ids, mask = assert_peft_loads_the_export(model, hf, tmp_path)
    real = mask.bool()
    with torch.no_grad():
        theirs = loaded(input_ids=ids, attention_mask=mask).last_hidden_state
        with loaded.disable_adapter():
            without_lora = loaded(input_ids=ids, attention_mask=mask).last_hidden_state
    assert not torch.allclose(theirs[real], without_lora[real], atol=1e-3)  # the adapter does something


@pytest.mark.parametrize("method", ["adapter", "lora_adapter"])
def test_only_methods_with_a_peft_format_export(tmp_path, method):
    """lora_adapter's config is a LoraConfig, but its adapters have no peft format: refused, not half-exported."""
    model = MultitaskModel(tiny_backbone(), parse_tasks("sst"), method)
    with pytest.raises(CheckpointError, match=f"only lora, dora, ia3, vera models export.*uses '{method}'"):
        export_peft(model, tmp_path)
    assert not any(tmp_path.iterdir())
