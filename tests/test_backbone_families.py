"""BERT, RoBERTa, DistilBERT and ELECTRA checkpoints load into the one backbone and equal transformers' models.

Each family's checkpoint here is a tiny random one made with transformers (``save_pretrained``, safetensors) with a
tokenizer built offline beside it: a WordPiece vocabulary for BERT, DistilBERT and ELECTRA, a byte-level BPE trained
on a few sentences for RoBERTa. The loaded backbone must give ``AutoModel``'s hidden states on a padded batch of
sentence pairs, every method must train a step on it, ``peftune methods --model`` must count it as a direct count
does, and any other architecture is refused in one line.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import shutil
import string

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import assert_peft_loads_the_export
from peftune import methods
from peftune.base.errors import UserError
from peftune.cli import commands
from peftune.core import pack, train
from peftune.core.checkpoint import CheckpointError, export_peft, load_checkpoint, read_meta, save_checkpoint
from peftune.core.model import MultitaskModel
from peftune.core.params import count_parameters
from peftune.inputs.backbone import (
    FAMILIES,
    BertConfig,
    BertModel,
    backbone_key,
    check_max_length,
    load_pretrained,
    load_tokenizer,
    read_config,
)
from peftune.inputs.data import DataSettings
from peftune.inputs.tasks import parse_tasks
from peftune.methods.adapter import layernorm_parameter_count

SENTENCES = ["a short one", "a somewhat longer sentence to force padding here", "the cat sat on the mat"]
PAIRS = (["a short one", "a somewhat longer sentence to force padding here"], ["b", "the cat"])
WORDPIECE = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *string.ascii_lowercase]
WORDPIECE += [f"##{c}" for c in string.ascii_lowercase] + ["the", "cat", "sat"]
SHAPE = {"num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
POSITIONS = 64  # every family's usable positions; RoBERTa's table holds two more rows (its offset)

# the tiny checkpoints: one per family, and a RoBERTa without a pooler, as transformers' RobertaFor* models save it
CHECKPOINTS = ("bert", "roberta", "roberta-no-pooler", "distilbert", "electra")
WORDPIECE_TOKENIZERS = {
    "bert": transformers.BertTokenizerFast,
    "distilbert": transformers.DistilBertTokenizerFast,
    "electra": transformers.ElectraTokenizerFast,
}
ALL_METHODS = methods.method_names()
TASKS = parse_tasks("sst,para")


def bpe_tokenizer():
    """A byte-level BPE trained on the sentences above, wrapped as RoBERTa's tokenizer (<s>=0, <pad>=1, </s>=2)."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    bpe.train_from_iterator(SENTENCES * 3, vocab_size=300, min_frequency=1, special_tokens=specials)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(merge.split()) if isinstance(merge, str) else tuple(merge) for merge in model["merges"]]
    return transformers.RobertaTokenizerFast(vocab=model["vocab"], merges=merges)


def make_checkpoint(name: str, directory) -> None:
    """A tiny random ``name`` checkpoint and its tokenizer in ``directory``."""
    torch.manual_seed(CHECKPOINTS.index(name))
    if name.startswith("roberta"):
        tokenizer = bpe_tokenizer()
    else:
        tokenizer = WORDPIECE_TOKENIZERS[name](vocab={token: i for i, token in enumerate(WORDPIECE)})
    vocab_size = max(128, math.ceil(len(tokenizer) / 8) * 8)  # rows past the tokenizer's: padding, as in real models
    if name == "bert":
        model = transformers.BertModel(
            transformers.BertConfig(vocab_size=vocab_size, hidden_size=32, max_position_embeddings=POSITIONS, **SHAPE)
        )
    elif name.startswith("roberta"):
        config = transformers.RobertaConfig(
            vocab_size=vocab_size,
            hidden_size=32,
            type_vocab_size=1,
            max_position_embeddings=POSITIONS + 2,
            layer_norm_eps=1e-5,
            **SHAPE,
        )
        model = transformers.RobertaModel(config, add_pooling_layer=name == "roberta")
    elif name == "distilbert":
        config = transformers.DistilBertConfig(
            vocab_size=vocab_size, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=POSITIONS
        )
        model = transformers.DistilBertModel(config)
    else:  # ELECTRA's discriminator, its embeddings narrower than its encoder
        config = transformers.ElectraConfig(
            vocab_size=vocab_size, embedding_size=16, hidden_size=32, max_position_embeddings=POSITIONS, **SHAPE
        )
        model = transformers.ElectraModel(config)
    with torch.no_grad():  # random LayerNorms and biases too: a dropped one shows in the outputs
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    for name in CHECKPOINTS:
        make_checkpoint(name, root / name)
    return {name: str(root / name) for name in CHECKPOINTS}


def pair_batch(model_dir):
    """Two sentence pairs of different lengths, padded, as the model's own tokenizer encodes them."""
    tokenizer = load_tokenizer(model_dir)
    return tokenizer(*PAIRS, padding=True, return_token_type_ids=True, return_tensors="pt")


def hf_outputs(model_dir, batch):
    hf = transformers.AutoModel.from_pretrained(model_dir).eval()
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    if "token_type_ids" in inspect.signature(hf.forward).parameters:  # DistilBERT's forward takes none
        inputs["token_type_ids"] = batch["token_type_ids"]
    with torch.no_grad():
        return hf(**inputs)


# --------------------------------------------------------------------------- the same function as transformers


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_hidden_states_equal_automodel_on_a_padded_batch_of_pairs(checkpoints, name):
    model, model_dir = load_pretrained(checkpoints[name])
    assert model.config.model_type == name.removesuffix("-no-pooler")
    batch = pair_batch(model_dir)
    ids, mask, types = batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]
    assert not mask.all(), "the batch must be padded"
    if name.startswith("roberta"):
        assert (ids[~mask.bool()] == 1).all()  # RoBERTa pads with its own <pad> id, 1
    if name in ("bert", "distilbert", "electra"):
        assert types.any()  # the tokenizer marks the second sentence: BERT and ELECTRA use it, DistilBERT ignores it
    with torch.no_grad():
        hidden, token_mask, pooled = model.eval()(ids, mask, types)
    expected = hf_outputs(model_dir, batch)
    real = mask.bool()
    torch.testing.assert_close(hidden[real], expected.last_hidden_state[real], rtol=1e-4, atol=1e-4)
    assert torch.equal(token_mask, mask)
    if name in ("bert", "roberta"):  # checkpoints with a pooler: its output
        torch.testing.assert_close(pooled, expected.pooler_output, rtol=1e-4, atol=1e-4)
    else:  # none: the [CLS] position's hidden state
        assert model.pooler is None and torch.equal(pooled, hidden[:, 0])


@pytest.mark.parametrize("name", ["roberta", "distilbert", "electra"])
def test_the_training_batches_of_each_family_give_automodels_hidden_states(checkpoints, name, tiny_data_dir):
    """Through the data pipeline (its tokenizer, bucketing, padding): RoBERTa's batches are padded with its pad id
    1, DistilBERT's carry the tokenizer's token types, ignored, and each batch gives AutoModel's hidden states."""
    prepared = train.prepare(DataSettings(str(tiny_data_dir), model=checkpoints[name], max_length=POSITIONS), ["para"])
    assert prepared.pad_token_id == (1 if name == "roberta" else 0)
    config = train.TrainConfig(method="frozen", tasks=["para"], batch_size=8, device="cpu", log_every=0)
    batch = train.epoch_plan(config, prepared.tasks, prepared.pad_token_id, 0)[0]
    padding = ~batch.attention_mask.bool()
    assert padding.any() and (batch.input_ids[padding] == prepared.pad_token_id).all()
    assert batch.token_type_ids.any() == (name != "roberta")  # RoBERTa's tokenizer gives every token type 0
    backbone = prepared.backbone.build().eval()
    with torch.no_grad():
        hidden = backbone(batch.input_ids, batch.attention_mask, batch.token_type_ids)[0]
    inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
    expected = hf_outputs(checkpoints[name], inputs | {"token_type_ids": batch.token_type_ids})
    torch.testing.assert_close(hidden[~padding], expected.last_hidden_state[~padding], rtol=1e-4, atol=1e-4)


def test_distilberts_attention_output_has_no_dropout_as_in_transformers(checkpoints):
    for name in CHECKPOINTS:
        model, _ = load_pretrained(checkpoints[name])
        expected = 0.0 if name == "distilbert" else model.config.hidden_dropout_prob
        assert all(layer.attention.output.dropout.p == expected for layer in model.encoder.layer), name
        assert all(layer.output.dropout.p == model.config.hidden_dropout_prob for layer in model.encoder.layer), name


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_state_dict_is_exactly_the_checkpoints(checkpoints, name):
    """Nothing made up (no pooler, no token types where the family has none): the checkpoint's tensors, DistilBERT's
    under BERT's names."""
    model, model_dir = load_pretrained(checkpoints[name])
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as weights:
        theirs = {key: weights.get_tensor(key) for key in weights.keys()}
    ours = model.state_dict()
    family = model.config.model_type
    assert ours.keys() == {backbone_key(key, family) for key in theirs}
    for key, tensor in theirs.items():
        assert torch.equal(ours[backbone_key(key, family)], tensor), key
    if family != "distilbert":  # the same names
        assert ours.keys() == theirs.keys()
    else:  # BERT's, where methods find them
        assert {"encoder.layer.1.attention.self.query.weight", "encoder.layer.1.intermediate.dense.bias"} <= ours.keys()


def test_a_task_models_prefixed_checkpoint_loads(tmp_path, checkpoints):
    """A task model's checkpoint (RobertaFor*, DistilBertFor*, ElectraFor*) prefixes the encoder with its family's
    name: the same backbone."""
    for name in ("roberta-no-pooler", "electra", "distilbert"):
        family = name.removesuffix("-no-pooler")
        source = transformers.AutoModel.from_pretrained(checkpoints[name])
        prefixed = tmp_path / name
        prefixed.mkdir()
        save_file(
            {f"{family}.{k}": v.contiguous() for k, v in source.state_dict().items()},
            str(prefixed / "model.safetensors"),
        )
        (prefixed / "config.json").write_text(source.config.to_json_string())
        loaded, _ = load_pretrained(str(prefixed))
        plain, _ = load_pretrained(checkpoints[name])
        for key, tensor in plain.state_dict().items():
            assert torch.equal(loaded.state_dict()[key], tensor), key


def test_roberta_positions_count_from_the_padding_id_and_fill_the_table(checkpoints):
    """RoBERTa's positions start at pad + 1, padding takes pad: a full-length row reaches the table's last row, and
    the same tokens padded further give the same hidden states (transformers' numbering, not the attention mask)."""
    model, model_dir = load_pretrained(checkpoints["roberta"])
    assert model.config.position_offset == 2 and model.config.max_input_length == POSITIONS
    torch.manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (2, POSITIONS))
    ids[:, 0] = 0  # <s>
    mask = torch.ones_like(ids)
    ids[1, 20:], mask[1, 20:] = 1, 0  # padded with <pad>
    expected = transformers.AutoModel.from_pretrained(model_dir).eval()
    with torch.no_grad():
        ours = model.eval()(ids, mask)[0]
        theirs = expected(input_ids=ids, attention_mask=mask).last_hidden_state
        short = model(ids[1:, :20], mask[1:, :20])[0]
    real = mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours[1, :20], short[0], rtol=1e-5, atol=1e-5)
    # one type: whatever token types a tokenizer hands over, every token is type 0
    with torch.no_grad():
        assert torch.equal(model(ids, mask, torch.ones_like(ids))[0], ours)


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_a_max_length_past_the_models_positions_is_refused_not_an_index_error(checkpoints, name):
    model, _ = load_pretrained(checkpoints[name])
    check_max_length(model.config, POSITIONS)
    with pytest.raises(UserError, match=f"max_length={POSITIONS + 1} exceeds the model's {POSITIONS} positions"):
        check_max_length(model.config, POSITIONS + 1)
    ids = torch.full((1, POSITIONS + 1), 5)
    with pytest.raises(UserError, match=f"{POSITIONS + 1} tokens exceeds the model's {POSITIONS} positions"):
        model(ids)


def test_prepare_refuses_a_max_length_past_the_models_positions(checkpoints, tiny_data_dir):
    too_long = POSITIONS + 1  # the table's rows, but two of them are RoBERTa's offset
    with pytest.raises(UserError, match=f"max_length={too_long} exceeds the model's {POSITIONS} positions.*offset 2"):
        train.prepare(DataSettings(str(tiny_data_dir), model=checkpoints["roberta"], max_length=too_long), ["sst"])


def test_a_roberta_tokenizer_padding_with_another_id_is_refused(checkpoints, tmp_path):
    shutil.copytree(checkpoints["roberta"], tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "pad_token_id": 0}))
    with pytest.raises(UserError, match="pads with id 1 but config.json's pad_token_id is 0"):
        load_tokenizer(tmp_path)


# --------------------------------------------------------------------------- every method on every family


@pytest.mark.parametrize("name", CHECKPOINTS)
@pytest.mark.parametrize("method", ALL_METHODS)
def test_every_method_trains_a_step_on_every_family(checkpoints, name, method):
    backbone, model_dir = load_pretrained(checkpoints[name])
    config = methods.make_method_config(method, {"dropout": 0.0})
    model = MultitaskModel(backbone, TASKS, method, config, pooling="cls")  # cls: the pooler, or [CLS] without one
    batch = pair_batch(model_dir)
    labels = torch.tensor([1.0, 0.0])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    loss = model.tasks["para"].loss(
        model("para", batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]), labels
    )
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss)
    trained = {n for n, p in model.named_parameters() if p.requires_grad and not n.startswith("heads.")}
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved <= {n for n, p in model.named_parameters() if p.requires_grad}  # frozen weights stay bit-identical
    if method != "frozen":
        assert moved & trained, f"{method} on {name}: no method parameter moved"


def test_prompt_vectors_start_as_tokens_the_electra_encoder_sees(checkpoints):
    """Prompt tuning's vocabulary init on ELECTRA: vectors of the encoder's width (H), after the projection."""
    backbone, _ = load_pretrained(checkpoints["electra"])
    model = MultitaskModel(backbone, TASKS, "prompt", methods.make_method_config("prompt", {"prompt_length": 4}))
    prompt = model.backbone.embeddings.input_prompt.per_task["sst"].prompt
    assert prompt.shape == (4, backbone.config.hidden_size) and backbone.config.embedding_width == 16
    with torch.no_grad():
        candidates = backbone.token_vectors(torch.arange(backbone.config.vocab_size))  # (V, H)
    assert (prompt[:, None] - candidates[None]).norm(dim=-1).min(dim=1).values.max() < 1e-5


# --------------------------------------------------------------------------- counting


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_methods_command_counts_each_family_as_a_direct_count(checkpoints, name, capsys):
    assert commands.main(["methods", "--model", checkpoints[name], "--tasks", "sst,para"]) == 0
    lines = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[2:]}
    assert set(lines) == set(ALL_METHODS)
    for method in ALL_METHODS:
        backbone, _ = load_pretrained(checkpoints[name])
        counts = count_parameters(MultitaskModel(backbone, TASKS, method))
        assert counts.backbone == checkpoint_size(checkpoints[name])  # the percentages' denominator: its weights
        trainable, trainable_pct, stored, stored_pct = lines[method][-4:]
        assert int(trainable.replace(",", "")) == counts.trainable_per_task, method
        assert int(stored.replace(",", "")) == counts.stored, method
        assert trainable_pct == f"{counts.percent(counts.trainable_per_task):.2f}%", method
        assert stored_pct == f"{counts.percent(counts.stored):.2f}%", method


def checkpoint_size(model_dir: str) -> int:
    """The checkpoint's weights, counted from its safetensors header."""
    with safe_open(os.path.join(model_dir, "model.safetensors"), framework="pt") as weights:
        return sum(math.prod(weights.get_slice(key).get_shape()) for key in weights.keys())


def test_electras_narrow_embedding_layernorm_is_counted_at_its_width(checkpoints):
    backbone, _ = load_pretrained(checkpoints["electra"])
    counts = count_parameters(MultitaskModel(backbone, TASKS, "layernorm"))
    assert counts.trainable_per_task == layernorm_parameter_count(backbone.config) == 2 * 2 * 2 * 32 + 2 * 16


# --------------------------------------------------------------------------- refused architectures


@pytest.mark.parametrize("model_type", ["gpt2", "xlnet"])
def test_other_architectures_are_refused_in_one_line_naming_the_families(tmp_path, model_type):
    config = {
        "model_type": model_type,
        "vocab_size": 128,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError) as refused:
        load_pretrained(str(tmp_path))
    message = str(refused.value)
    assert "\n" not in message and f"model_type {model_type!r} is not supported" in message
    assert all(family in message for family in FAMILIES)
    with pytest.raises(UserError, match="peftune loads bert, roberta, distilbert, electra encoders"):
        BertConfig(model_type=model_type)


def test_a_family_config_without_its_shape_names_the_missing_keys(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "distilbert", "vocab_size": 128, "dim": 32}))
    with pytest.raises(UserError, match="no n_layers, n_heads, hidden_dim; expected a distilbert config.json"):
        read_config(tmp_path)


# --------------------------------------------------------------------------- checkpoints, peft export, packs


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_a_checkpoint_records_the_family_and_loads_onto_it_only(checkpoints, name, tmp_path):
    backbone, model_dir = load_pretrained(checkpoints[name])
    model = MultitaskModel(backbone, TASKS, "lora").eval()
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if "lora_B" in parameter_name:
                parameter.normal_()
    save_checkpoint(model, tmp_path, backbone=train.PretrainedBackbone(checkpoints[name], backbone.config, {}))
    assert read_meta(tmp_path)["backbone"]["config"]["model_type"] == name.removesuffix("-no-pooler")
    loaded = load_checkpoint(tmp_path).eval()
    batch = pair_batch(model_dir)
    inputs = (batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    with torch.no_grad():
        assert torch.equal(loaded("sst", *inputs), model("sst", *inputs))
    other = "electra" if name != "electra" else "bert"
    with pytest.raises(CheckpointError, match="fingerprint"):
        load_checkpoint(tmp_path, backbone=load_pretrained(checkpoints[other])[0])


@pytest.mark.parametrize("name", ["roberta", "electra"])
def test_exported_lora_loads_onto_the_familys_transformers_model(checkpoints, name, tmp_path):
    backbone, model_dir = load_pretrained(checkpoints[name])
    model = MultitaskModel(backbone, parse_tasks("sst"), "lora").eval()
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if "lora_B" in parameter_name:
                parameter.normal_()
    assert_peft_loads_the_export(model, transformers.AutoModel.from_pretrained(model_dir).eval(), tmp_path)


def test_a_distilbert_export_to_peft_is_refused_in_one_line(checkpoints, tmp_path):
    backbone, _ = load_pretrained(checkpoints["distilbert"])
    model = MultitaskModel(backbone, parse_tasks("sst"), "lora")
    with pytest.raises(CheckpointError, match="a DistilBERT's are not BERT's"):
        export_peft(model, tmp_path)
    assert not any(tmp_path.iterdir())


# a random backbone of each family over the toy rows (MiniLM's tokenizer, its pad id 0): a pack's members must still
# train as their solo runs, through RoBERTa's positions, DistilBERT's missing token types and ELECTRA's projection
FAMILY_CONFIGS = {
    "roberta": {"type_vocab_size": 1, "pooler": False, "max_position_embeddings": 40},
    "distilbert": {"type_vocab_size": 0, "pooler": False},
    "electra": {"embedding_size": 16, "pooler": False},
}


@pytest.mark.parametrize("family", FAMILY_CONFIGS)
@pytest.mark.parametrize("method", ["bitfit", "lora"])
def test_a_packs_members_train_as_their_solo_runs_on_every_family(tiny_prepared, family, method):
    base = tiny_prepared.backbone.config
    config = dataclasses.replace(base, model_type=family, **FAMILY_CONFIGS[family])
    torch.manual_seed(0)
    backbone = train.PretrainedBackbone(f"tiny-random-{family}", config, BertModel(config).state_dict())
    prepared = dataclasses.replace(tiny_prepared, backbone=backbone)
    configs = [
        train.TrainConfig(
            method=method,
            method_options=options,
            tasks=["sst", "para", "sts"],
            lr=lr,
            dropout=0.1,
            epochs=1,
            batch_size=16,
            seed=7,
            device="cpu",
            precision="fp32",
            log_every=0,
        )
        for lr, options in ((3e-3, {}), (1e-2, {"rank": 4} if method == "lora" else {}))
    ]
    packed = pack.Pack(configs, prepared)
    plan = packed.begin_epoch(0)[:3]
    losses = [packed.step(batch) for batch in plan]
    for k, config in enumerate(configs):
        trial = train.Trial(config, prepared, None)
        torch.manual_seed(train.epoch_seed(config, 0))
        solo = [trial.step(batch) for batch in train.epoch_plan(config, trial.tasks, prepared.pad_token_id, 0)[:3]]
        assert all(torch.equal(step[k], loss) for step, loss in zip(losses, solo, strict=True)), (family, k)
        ours, theirs = packed.members[k].model.trainable_state_dict(), trial.model.trainable_state_dict()
        assert all(torch.equal(ours[n], theirs[n]) for n in theirs), (family, k)
