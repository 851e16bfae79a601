"""The compact encoder equals transformers.BertModel on the same weights."""

import json

import pytest
import torch
import transformers

from conftest import TINY, tiny_backbone
from peftune.inputs.backbone import DEFAULT_MODEL, BertConfig, load_pretrained, load_tokenizer, resolve_model_dir


def hf_twin(model):
    hf = transformers.BertModel(transformers.BertConfig(**model.config.to_dict()), add_pooling_layer=True)
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    assert not missing and not unexpected
    return hf.eval()


def test_state_dict_names_are_hf_bert_names():
    ours = tiny_backbone()
    hf = transformers.BertModel(transformers.BertConfig(**TINY.to_dict()))
    assert set(ours.state_dict()) == set(hf.state_dict())
    for name, tensor in hf.state_dict().items():
        assert ours.state_dict()[name].shape == tensor.shape, name


def test_equals_hf_bert_with_padding_and_pairs():
    ours = tiny_backbone(seed=3).eval()
    hf = hf_twin(ours)
    torch.manual_seed(1)
    ids = torch.randint(1, TINY.vocab_size, (3, 11))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # padded rows
    mask[2, 3:] = 0
    types = torch.zeros_like(ids)
    types[:, 5:] = 1  # a sentence pair
    with torch.no_grad():
        hidden, out_mask, pooled = ours(ids, mask, types)
        expected = hf(input_ids=ids, attention_mask=mask, token_type_ids=types)
    real = mask.bool()
    torch.testing.assert_close(hidden[real], expected.last_hidden_state[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pooled, expected.pooler_output, rtol=1e-5, atol=1e-5)
    assert torch.equal(out_mask, mask)


def test_gradients_equal_hf_bert_for_every_weight():
    # q, k and v are computed by one stacked matmul: each weight must still get exactly its own gradient
    ours = tiny_backbone(seed=4).eval()  # eval: no dropout, so both compute the same function
    hf = hf_twin(ours)
    torch.manual_seed(2)
    ids = torch.randint(1, TINY.vocab_size, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    types = torch.zeros_like(ids)
    hidden, _, pooled = ours(ids, mask, types)
    expected = hf(input_ids=ids, attention_mask=mask, token_type_ids=types)
    weights = torch.randn_like(hidden)  # a loss that weighs every position and feature differently
    ((hidden * weights).sum() + pooled.sum()).backward()
    ((expected.last_hidden_state * weights).sum() + expected.pooler_output.sum()).backward()
    theirs = dict(hf.named_parameters())
    for name, parameter in ours.named_parameters():
        torch.testing.assert_close(parameter.grad, theirs[name].grad, rtol=1e-4, atol=1e-5, msg=name)


def test_packaged_model_loads_offline_and_equals_hf():
    model, model_dir = load_pretrained(DEFAULT_MODEL)
    assert model.config.hidden_size == 384 and model.config.num_hidden_layers == 6
    tokenizer = load_tokenizer(model_dir)
    batch = tokenizer(
        ["a short one", "a somewhat longer sentence to force padding here"],
        ["b", "c"],
        padding=True,
        return_tensors="pt",
    )
    hf = transformers.BertModel.from_pretrained(str(model_dir)).eval()
    with torch.no_grad():
        hidden, _, pooled = model.eval()(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
        expected = hf(**batch)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(hidden[real], expected.last_hidden_state[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pooled, expected.pooler_output, rtol=1e-5, atol=1e-5)


def test_local_directory_loads(tmp_path):
    source = tiny_backbone(seed=5)
    hf = hf_twin(source)
    hf.save_pretrained(tmp_path)  # safetensors by default
    loaded, model_dir = load_pretrained(str(tmp_path))
    assert model_dir == tmp_path
    for name, tensor in source.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_pretrained(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_pretrained(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="HF hub"):
        resolve_model_dir("no-such-org/no-such-bert-model")


def test_pickle_only_checkpoint_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", **TINY.to_dict()}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="safetensors only"):
        load_pretrained(str(tmp_path))


def test_config_validation():
    with pytest.raises(ValueError, match="multiple of"):
        BertConfig(hidden_size=30, num_attention_heads=4)
    with pytest.raises(ValueError, match="hidden_act"):
        BertConfig(hidden_act="swish2")
