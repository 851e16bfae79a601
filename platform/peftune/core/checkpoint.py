"""Checkpoints: the trainable parameters in safetensors plus the config in JSON.

Never pickle: a checkpoint is ``trainable.safetensors`` (method + heads),
``peftune.json`` (method, its options, tasks, the training config and the
backbone's fingerprint) and, for resuming, ``optimizer.safetensors`` (AdamW
moments by parameter name; not in a run's last epoch's checkpoint, from which
nothing trains). Loading checks the backbone and method before touching any
weight, so a checkpoint meets only the model it was trained on. ``export_peft`` writes a lora, dora, ia3 or vera
model's adapter in peft's own format, for ``peft.PeftModel.from_pretrained`` on ``transformers.BertModel``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from peftune import methods
from peftune.base.errors import UserError
from peftune.core.model import MultitaskModel
from peftune.inputs.backbone import BertConfig, BertModel, fingerprint, load_pretrained, read_json, read_safetensors
from peftune.inputs.tasks import get_task

FORMAT_VERSION = 1
WEIGHTS = "trainable.safetensors"
OPTIMIZER = "optimizer.safetensors"
META = "peftune.json"


class CheckpointError(UserError):
    pass


def save_checkpoint(
    model: MultitaskModel,
    directory: str | Path,
    *,
    config=None,
    backbone=None,
    metrics=None,
    optimizer=None,
    scheduler=None,
    epoch: int | None = None,
    history=None,
) -> Path:
    """Write the trainable parameters and the metadata; optionally the optimizer state to resume."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().cpu().contiguous() for name, t in model.trainable_state_dict().items()}
    meta = {
        "format_version": FORMAT_VERSION,
        "method": model.method,
        "method_config": dataclasses.asdict(model.method_config),
        "tasks": list(model.tasks),
        "pooling": model.pooling,
        "head_dropout": model.heads[next(iter(model.tasks))][0].p,
        "backbone": {
            "name": getattr(backbone, "name", None),
            "config": model.backbone.config.to_dict(),
            "fingerprint": model.backbone_fingerprint,
        },
        "train_config": config.to_dict() if config is not None else None,
        "metrics": metrics,
        "epoch": epoch,
        "history": history,
    }
    _atomic_write(directory / WEIGHTS, lambda path: save_file(state, path))
    if optimizer is not None:
        optimizer_state, optimizer_meta = _optimizer_tensors(model, optimizer)
        meta["optimizer"] = optimizer_meta
        meta["scheduler"] = scheduler.state_dict() if scheduler is not None else None
        _atomic_write(directory / OPTIMIZER, lambda path: save_file(optimizer_state, path))
    # the JSON goes last: a directory with peftune.json is a complete checkpoint
    _atomic_write(directory / META, lambda path: Path(path).write_text(json.dumps(meta, indent=2, default=str)))
    return directory


def read_meta(directory: str | Path) -> dict:
    path = Path(directory) / META
    if not path.is_file():
        raise CheckpointError(f"{directory} is not a peftune checkpoint (no {META})")
    meta = read_json(path)
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format_version {meta.get('format_version')!r}, expected {FORMAT_VERSION}")
    return meta


def load_checkpoint(
    directory: str | Path, backbone: BertModel | None = None, model_name: str | None = None, map_location: str = "cpu"
) -> MultitaskModel:
    """Rebuild the model: the backbone (given, or loaded by the name recorded), the method, the weights."""
    meta = read_meta(directory)
    if backbone is None:
        backbone, _ = load_pretrained(model_name or meta["backbone"]["name"])
    check_backbone(meta, fingerprint(backbone), directory)
    method_config = methods.make_method_config(meta["method"], meta["method_config"])
    model = MultitaskModel(
        backbone,
        [get_task(t) for t in meta["tasks"]],
        meta["method"],
        method_config,
        head_dropout=meta["head_dropout"],
        pooling=meta["pooling"],
    )
    load_trainable(model, directory, map_location)
    return model


def check_backbone(meta: dict, actual: str, directory) -> None:
    expected = meta["backbone"]["fingerprint"]
    if expected != actual:
        raise CheckpointError(
            f"checkpoint {directory} was trained on backbone {meta['backbone']['name']!r} "
            f"(fingerprint {expected}); the backbone given has fingerprint {actual}"
        )


def load_trainable(model: MultitaskModel, directory: str | Path, map_location: str = "cpu") -> None:
    meta = read_meta(directory)
    if meta["method"] != model.method:
        raise CheckpointError(f"checkpoint {directory} is for method {meta['method']!r}, not {model.method!r}")
    state = read_safetensors(Path(directory) / WEIGHTS, device=map_location)
    expected = model.trainable_state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {directory} does not fit this model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise CheckpointError(
                f"checkpoint {directory}: {name} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(expected[name].shape)}"
            )
    with torch.no_grad():
        parameters = dict(model.named_parameters())
        for name, tensor in state.items():
            parameters[name].copy_(tensor)


def load_training_state(directory, model, optimizer, scheduler, backbone) -> dict:
    """Restore weights, optimizer and scheduler (weights only from a checkpoint of the run's last epoch, which
    has no optimizer state); returns {"epoch": done epochs, "history": [...]}."""
    meta = read_meta(directory)
    check_backbone(meta, model.backbone_fingerprint, directory)
    load_trainable(model, directory)
    epoch = meta["epoch"] or 0
    if "optimizer" not in meta:
        planned = (meta.get("train_config") or {}).get("epochs")
        if planned is not None and epoch >= planned:  # the last epoch's: nothing left to train
            return {"epoch": epoch, "history": meta["history"] or []}
        raise CheckpointError(f"checkpoint {directory} has no optimizer state to resume from")
    tensors = read_safetensors(Path(directory) / OPTIMIZER)
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            name = names[id(parameter)]
            state = {k.split("/", 1)[1]: v.to(parameter.device) for k, v in tensors.items() if k.split("/")[0] == name}
            if state:
                optimizer.state[parameter] = state
    if meta.get("scheduler"):
        scheduler.load_state_dict(meta["scheduler"])
        # the scheduler writes a group's lr only when it steps: restore the current one now
        for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
            group["lr"] = lr
    return {"epoch": epoch, "history": meta["history"] or []}


def _optimizer_tensors(model, optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    names = {id(p): n for n, p in model.named_parameters()}
    tensors = {}
    for parameter, state in optimizer.state.items():
        for key, value in state.items():
            if torch.is_tensor(value):
                tensors[f"{names[id(parameter)]}/{key}"] = value.detach().cpu().contiguous()
    return tensors, {"lr": [g["lr"] for g in optimizer.param_groups]}


def _atomic_write(path: Path, write) -> None:
    # write then rename, so an interrupted save never leaves a half-written file
    tmp = path.with_name(path.name + ".tmp")
    write(os.fspath(tmp))
    os.replace(tmp, path)


def peft_key(name: str) -> str:
    """peft's key in adapter_model.safetensors for our backbone parameter ``name``: under PeftModel's
    "base_model.model.", without the adapter name ("default"), and DoRA's magnitude without its ".weight" (peft
    saves the key of its pre-refactor ParameterDict)."""
    key = "base_model.model." + re.sub(r"\.default(?=\.|$)", "", name)
    return key.removesuffix(".weight") if key.endswith(".lora_magnitude_vector.weight") else key


def check_peft_export(config: BertConfig) -> None:
    """Refuse to export for a DistilBERT: peft's format names the modules of the family's transformers model, and
    DistilBERT's (``q_lin``, ``ffn.lin1``, ...) are not the BERT names this backbone trains them under."""
    if config.model_type == "distilbert":
        raise CheckpointError(
            "peft's format names transformers' modules and a DistilBERT's are not BERT's: its adapters stay in "
            "peftune's checkpoint (export to peft works for bert, roberta and electra backbones)"
        )


def export_peft(model: MultitaskModel, directory: str | Path, base_model_name_or_path: str | None = None) -> Path:
    """Write a lora, dora, ia3 or vera model's adapter in peft's format (adapter_config.json and
    adapter_model.safetensors), loadable with ``PeftModel.from_pretrained`` on the family's transformers model
    (``transformers.BertModel``, ``RobertaModel``, ``ElectraModel``: the same module names)."""
    check_peft_export(model.backbone.config)
    form = methods.get_method(model.method).peft_export
    if form is None:
        raise CheckpointError(
            f"only {', '.join(methods.peft_exports())} models export to peft's format; this model uses {model.method!r}"
        )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    peft_config = form.config(model.method_config)
    peft_config.base_model_name_or_path = base_model_name_or_path
    peft_config.save_pretrained(os.fspath(directory))
    tensors = {peft_key(name): p for name, p in model.backbone.named_parameters() if form.trained in name}
    tensors.update(form.extra(model.backbone))
    state = {key: t.detach().cpu().contiguous() for key, t in tensors.items()}
    save_file(state, os.fspath(directory / "adapter_model.safetensors"))
    return directory
