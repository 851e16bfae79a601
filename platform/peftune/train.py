"""One trial: build the model, train it, evaluate on dev after every epoch.

``run_trial(config, prepared, report)`` is what Ray Tune calls (through
``peftune.sweep``) and what ``peftune train`` calls directly. ``prepared``
holds the tokenized data and the pretrained weights, read once by the driver;
a trial never reads a file. After each epoch ``report(metrics, save)`` gets the
dev metrics, the score, the parameter counts and timings, and ``save(dir)``
writes a checkpoint of the trainable parameters there if the caller wants one.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from peftune import methods
from peftune.backbone import (
    DEFAULT_MODEL,
    BertConfig,
    BertModel,
    load_pretrained,
    load_tokenizer,
    native_pooling,
)
from peftune.data import TaskData, bucketed_batches, load_tasks, multitask_schedule
from peftune.model import POOLINGS, MultitaskModel
from peftune.params import count_parameters
from peftune.tasks import get_task, overall_score, parse_tasks

log = logging.getLogger("peftune.train")

SAMPLING = ("round_robin", "proportional", "temperature")


# a task's batch loss above this multiple of its first batch loss (at least 1.0) is divergence
DIVERGENCE_GROWTH = 100.0


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite, or grew past a bound: the trial stops instead of reporting a garbage score."""


def check_divergence(loss: float, first_loss: float | None, growth: float = DIVERGENCE_GROWTH) -> str | None:
    """Why ``loss`` means divergence (non-finite, or above ``growth`` x the task's first loss), else None.

    The floor of 1.0 on the first loss keeps a task that starts near zero from tripping on ordinary noise.
    """
    if not math.isfinite(loss):
        return f"loss is {loss}"
    if first_loss is not None and loss > growth * max(first_loss, 1.0):
        return f"loss {loss:.4g} grew past {growth:g} x its first value {first_loss:.4g}"
    return None


@dataclass
class TrainConfig:
    method: str = "lora"
    # the method's own options, e.g. {"rank": 8}; its "dropout" is set from `dropout`
    method_options: dict = field(default_factory=dict)
    tasks: list[str] = field(default_factory=lambda: ["sst", "para", "sts"])
    lr: float = 1e-4  # PEFT methods want larger steps than full fine-tuning's 1e-5..2e-5
    dropout: float = 0.1  # heads and the method's own modules (the searched dropout)
    weight_decay: float = 0.01
    epochs: int = 3
    batch_size: int = 32
    warmup_ratio: float = 0.1  # linear warmup over the first 10% of steps, then linear decay
    max_grad_norm: float = 1.0
    sampling: str = "proportional"
    temperature: float = 10.0  # HyperFormer's T for temperature sampling
    # "auto": the pooling the backbone was trained with (mean for all-MiniLM-L6-v2,
    # the [CLS] pooler for BERT checkpoints, as in the CS224N BERT); or "cls" / "mean"
    pooling: str = "auto"
    seed: int = 0
    device: str = "auto"
    log_every: int = 50  # steps between progress lines

    def __post_init__(self):
        self.tasks = [t.name for t in parse_tasks(self.tasks)]
        methods.make_method_config(self.method, self.method_options_with_dropout())  # validates
        positive = {
            "lr": self.lr,
            "epochs": self.epochs,
            "batch_size": self.batch_size,
            "temperature": self.temperature,
        }
        for key, value in positive.items():
            if not value > 0:
                raise ValueError(f"TrainConfig.{key} must be > 0, got {value!r}")
        for key in ("dropout", "warmup_ratio"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ValueError(f"TrainConfig.{key} must be in [0, 1), got {getattr(self, key)!r}")
        if self.weight_decay < 0 or self.max_grad_norm <= 0:
            raise ValueError("TrainConfig.weight_decay must be >= 0 and max_grad_norm > 0")
        if self.sampling not in SAMPLING:
            raise ValueError(f"TrainConfig.sampling {self.sampling!r}, expected one of {SAMPLING}")
        if self.pooling not in ("auto", *POOLINGS):
            raise ValueError(f"TrainConfig.pooling {self.pooling!r}, expected one of {('auto', *POOLINGS)}")

    def method_options_with_dropout(self) -> dict:
        return {**self.method_options, "dropout": self.dropout}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- data


@dataclass
class PretrainedBackbone:
    """Pretrained weights by value, so trials on any node build the backbone without files."""

    name: str
    config: BertConfig
    state_dict: dict[str, torch.Tensor]
    pooling: str = "cls"  # the pooling the model was trained with (backbone.native_pooling)

    def build(self) -> BertModel:
        model = BertModel(self.config)
        model.load_state_dict(self.state_dict)
        return model


@dataclass
class PreparedData:
    """What the driver reads once and hands to every trial (via Ray's object store)."""

    backbone: PretrainedBackbone
    tasks: dict[str, TaskData]
    pad_token_id: int
    max_length: int
    file_hashes: dict[str, str]  # file name -> sha256, for the record


def prepare(
    data_dir: str | Path,
    tasks: list[str],
    model: str = DEFAULT_MODEL,
    max_length: int = 128,
    max_train_examples: int | None = None,
    max_dev_examples: int | None = None,
    seed: int = 0,
    invalid_rows: str = "raise",
) -> PreparedData:
    """Load the backbone and tokenizer, read and tokenize every task's train and dev file once.

    ``invalid_rows="skip"`` drops malformed rows (each listed in a warning) instead of stopping at
    the first; the real quora-train.csv has two.
    """
    backbone, model_dir = load_pretrained(model)
    tokenizer = load_tokenizer(model_dir)
    data = load_tasks(
        data_dir,
        parse_tasks(tasks),
        tokenizer,
        max_length=max_length,
        max_train_examples=max_train_examples,
        max_dev_examples=max_dev_examples,
        seed=seed,
        invalid_rows=invalid_rows,
    )
    hashes = {Path(split.source).name: split.sha256 for task in data.values() for split in (task.train, task.dev)}
    return PreparedData(
        backbone=PretrainedBackbone(model, backbone.config, backbone.state_dict(), native_pooling(model_dir)),
        tasks=data,
        pad_token_id=tokenizer.pad_token_id or 0,
        max_length=max_length,
        file_hashes=hashes,
    )


# ----------------------------------------------------------------------------- device


def select_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} was asked for but CUDA is not available")
    return device


def autocast_for(device: torch.device):
    # bf16 autocast on GPUs that support it: same range as fp32, no loss scaling needed
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


# ----------------------------------------------------------------------------- model + optimizer


def build_model(config: TrainConfig, backbone: BertModel, native_pooling: str = "cls") -> MultitaskModel:
    method_config = methods.make_method_config(config.method, config.method_options_with_dropout())
    specs = [get_task(t) for t in config.tasks]
    pooling = native_pooling if config.pooling == "auto" else config.pooling
    return MultitaskModel(backbone, specs, config.method, method_config, head_dropout=config.dropout, pooling=pooling)


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        # the usual BERT recipe: no weight decay on biases, LayerNorm gains and 1-D vectors
        (no_decay if parameter.ndim < 2 or "LayerNorm" in name else decay).append(parameter)
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # the fused kernel (CPU and CUDA) steps 22M parameters ~6x faster than the default on 2 CPU cores
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=config.lr, fused=True)


def linear_schedule(optimizer, total_steps: int, warmup_ratio: float):
    warmup = int(total_steps * warmup_ratio)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(
    model: MultitaskModel, tasks: dict[str, TaskData], batch_size: int, pad_token_id: int, device: torch.device
) -> dict[str, float]:
    """Dev metric per task, e.g. {"sst_accuracy": 0.41, "sts_pearson": 0.80}."""
    model.eval()
    results = {}
    for name, task_data in tasks.items():
        spec = model.tasks[name]
        predictions, labels = [], []
        for batch in bucketed_batches(task_data.dev, batch_size, shuffle=False, pad_id=pad_token_id):
            batch = batch.to(device)
            with autocast_for(device):
                outputs = model(name, batch.input_ids, batch.attention_mask, batch.token_type_ids)
            predictions.append(spec.predict(outputs).cpu())
            labels.append(batch.labels.cpu())
        results[metric_name(spec)] = spec.score(torch.cat(predictions), torch.cat(labels))
    return results


def metric_name(spec) -> str:
    return f"{spec.name}_{spec.metric}"


# ----------------------------------------------------------------------------- the trial

ReportFn = Callable[[dict, Callable[[Path], None]], None]


@dataclass
class TrialResult:
    history: list[dict]  # one metrics dict per epoch
    model: MultitaskModel

    @property
    def best(self) -> dict:
        return max(self.history, key=lambda m: m["score"])


def run_trial(
    config: TrainConfig,
    prepared: PreparedData,
    report: ReportFn | None = None,
    resume_from: str | Path | None = None,
) -> TrialResult:
    """Train ``config`` on ``prepared`` data; report dev metrics after every epoch."""
    from peftune import checkpoint

    missing = [t for t in config.tasks if t not in prepared.tasks]
    if missing:
        raise ValueError(f"tasks {missing} were not prepared; prepared: {sorted(prepared.tasks)}")
    torch.manual_seed(config.seed)
    device = select_device(config.device)
    model = build_model(config, prepared.backbone.build(), prepared.backbone.pooling).to(device)
    counts = count_parameters(model)
    optimizer = build_optimizer(model, config)
    tasks = {t: prepared.tasks[t] for t in config.tasks}

    steps_per_epoch = len(_epoch_plan(config, tasks, prepared.pad_token_id, epoch=0))
    scheduler = linear_schedule(optimizer, steps_per_epoch * config.epochs, config.warmup_ratio)
    history: list[dict] = []
    start_epoch = 0
    if resume_from is not None:
        state = checkpoint.load_training_state(resume_from, model, optimizer, scheduler, prepared.backbone)
        start_epoch, history = state["epoch"], state["history"]

    trainable = [p for p in model.parameters() if p.requires_grad]
    train_time = sum(m["epoch_time_s"] for m in history)
    first_loss: dict[str, float] = {}  # task -> its first batch loss in this run: the divergence bound's base
    for epoch in range(start_epoch, config.epochs):
        model.train()
        started = time.perf_counter()
        # dropout draws depend on (seed, epoch) only, so a resumed trial continues exactly
        torch.manual_seed(_epoch_seed(config, epoch))
        plan = _epoch_plan(config, tasks, prepared.pad_token_id, epoch)
        loss_sum, tokens = 0.0, 0
        for step, batch in enumerate(plan):
            batch = batch.to(device)
            with autocast_for(device):
                outputs = model(batch.task, batch.input_ids, batch.attention_mask, batch.token_type_ids)
            loss = model.tasks[batch.task].loss(outputs, batch.labels)
            reason = check_divergence(loss.item(), first_loss.setdefault(batch.task, loss.item()))
            if reason is not None:
                raise TrainingDiverged(
                    f"{reason} at epoch {epoch + 1}, step {step + 1} (task {batch.task}); "
                    f"lr {config.lr:g} may be too high for method {config.method!r}"
                )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, config.max_grad_norm)
            optimizer.step()
            scheduler.step()
            loss_sum += loss.item()
            tokens += int(batch.attention_mask.sum())
            if config.log_every and (step + 1) % config.log_every == 0:
                elapsed = time.perf_counter() - started
                log.info(
                    "epoch %d step %d/%d loss %.4f %.0f tokens/s",
                    epoch + 1,
                    step + 1,
                    len(plan),
                    loss_sum / (step + 1),
                    tokens / elapsed,
                )
        epoch_time = time.perf_counter() - started
        train_time += epoch_time
        dev = evaluate(model, tasks, config.batch_size * 2, prepared.pad_token_id, device)
        metrics = {
            "epoch": epoch + 1,
            **dev,
            "score": overall_score(dev),
            "train_loss": loss_sum / max(1, len(plan)),
            "epoch_time_s": epoch_time,
            "train_time_s": train_time,
            "tokens_per_s": tokens / epoch_time,
            **counts.summary(),
        }
        history.append(metrics)
        log.info(
            "epoch %d/%d %s",
            epoch + 1,
            config.epochs,
            " ".join(f"{k} {v:.4f}" for k, v in dev.items()) + f" score {metrics['score']:.4f}",
        )
        if report is not None:
            # `save` is only valid during the report call: the model and optimizer move on afterwards
            save = functools.partial(
                checkpoint.save_checkpoint,
                model,
                config=config,
                backbone=prepared.backbone,
                metrics=metrics,
                optimizer=optimizer,
                scheduler=scheduler,
                epoch=epoch + 1,
                history=list(history),
            )
            report(metrics, save)
    return TrialResult(history, model)


def _epoch_seed(config: TrainConfig, epoch: int) -> int:
    return config.seed * 1_000_003 + epoch


def _epoch_plan(config: TrainConfig, tasks: dict[str, TaskData], pad_id: int, epoch: int) -> list:
    """The batches of one epoch in training order, the same for the same (seed, epoch)."""
    generator = torch.Generator().manual_seed(_epoch_seed(config, epoch))
    per_task = {
        name: bucketed_batches(data.train, config.batch_size, shuffle=True, generator=generator, pad_id=pad_id)
        for name, data in tasks.items()
    }
    order = multitask_schedule(
        {n: len(b) for n, b in per_task.items()}, config.sampling, temperature=config.temperature, generator=generator
    )
    cursors = dict.fromkeys(per_task, 0)
    plan = []
    for name in order:
        batches = per_task[name]
        plan.append(batches[cursors[name] % len(batches)])  # temperature sampling may revisit a task
        cursors[name] += 1
    return plan
