"""One trial: build the model, train it, evaluate on dev after every epoch.

``run_trial(config, prepared, report)`` is what Ray Tune calls (through
``peftune.sweep.orchestrator``) and what ``peftune train`` calls directly. ``prepared``
holds the tokenized data and the pretrained weights, read once by the driver;
a trial never reads a file. After each epoch ``report(metrics, save)`` gets the
dev metrics, the score, the parameter counts and timings, and ``save(dir)``
writes a checkpoint of the trainable parameters there if the caller wants one.
With ``report_fractions`` it also reports within an epoch (``save`` is None there).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import shlex
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pydantic import with_config

from peftune import methods
from peftune.base.errors import UserError
from peftune.base.record_names import DEV, EPOCH, PARTIAL, SCORE, split_metric
from peftune.base.validation import Bound, checked
from peftune.core.model import POOLINGS, MultitaskModel
from peftune.core.optim import ClippedAdamW
from peftune.core.params import count_parameters
from peftune.inputs.backbone import (
    DEFAULT_MODEL,
    BertConfig,
    BertModel,
    cast_frozen,
    check_max_length,
    load_pretrained,
    load_tokenizer,
    native_pooling,
)
from peftune.inputs.data import (
    DEFAULT_MAX_LENGTH,
    SEED,
    DataSettings,
    TaskData,
    bucketed_batches,
    check_files,
    check_role_sizes,
    load_tasks,
    multitask_schedule,
    restore_order,
)
from peftune.inputs.tasks import TaskSpec, get_task, overall_score, parse_tasks
from peftune.methods.base import DROPOUT

log = logging.getLogger("peftune.core.train")

SAMPLING = ("round_robin", "proportional", "temperature")
# TrainConfig's intervals, written once: the search spaces check their lr, dropout and weight decay with these
LR = Bound(0.0, 10.0, "beyond it a trial only diverges", low_open=True)
WEIGHT_DECAY = Bound(0.0, 10.0, "beyond it a trial only forgets")
RATES = {"lr": LR, "head_lr": LR, "dropout": DROPOUT, "weight_decay": WEIGHT_DECAY,
         "warmup_ratio": Bound(0.0, 1.0, high_open=True),
         "max_grad_norm": Bound(0.0, 1e12, "a sane bound on a clip", low_open=True),
         "temperature": Bound(0.0, 1e3, "a sane bound on a sampling temperature", low_open=True)}  # fmt: skip
COUNTS = {"epochs": Bound(1, 1_000, "a sane bound on a trial's epochs"), "seed": SEED,
          "batch_size": Bound(1, 8_192, "a sane bound on a batch"),
          "log_every": Bound(0, 1_000_000_000, "0: no progress lines")}  # fmt: skip
PRECISIONS = ("auto", "bf16", "fp32")


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite, or grew past a bound: the trial stops instead of reporting a garbage score."""


@with_config(use_attribute_docstrings=True)  # each field's docstring: its description in the JSON Schema (the docs)
@dataclass
class TrainConfig:
    method: str = "lora"
    """the PEFT method trained (`peftune methods` lists them)"""
    method_options: dict = field(default_factory=dict)
    """the method's own options, e.g. {"rank": 8}; its "dropout" is set from `dropout`"""
    tasks: list[str] = field(default_factory=lambda: ["sst", "para", "sts"])
    """the tasks trained together: shipped task names or task files"""
    lr: float = 1e-4  # PEFT methods want larger steps than full fine-tuning's 1e-5..2e-5
    """the learning rate"""
    dropout: float = 0.1
    """the dropout of the heads and of the method's own modules (the searched dropout)"""
    weight_decay: float = 0.01
    """AdamW's weight decay"""
    # a head is a fresh linear layer: at an adapter's 1e-5 it barely moves in a short run, at prompt tuning's 0.3
    # it blows up
    head_lr: float | None = None
    """the task heads' own learning rate; null: the method's `lr`. Frozen trains its heads alone: they are its
    method, and train at `lr` (see `heads_lr`)"""
    epochs: int = 3
    """epochs trained"""
    batch_size: int = 32
    """examples per training batch"""
    warmup_ratio: float = 0.1
    """the share of steps the learning rate warms up over, linearly, then decays linearly"""
    max_grad_norm: float = 1.0
    """the gradient-norm clip"""
    sampling: str = "proportional"
    """which task each multitask step trains: `round_robin`, `proportional` or `temperature`"""
    temperature: float = 10.0
    """HyperFormer's T for temperature sampling"""
    pooling: str = "auto"
    """`auto`: the pooling the backbone was trained with (mean for all-MiniLM-L6-v2, the [CLS] pooler for BERT
    checkpoints, as in the CS224N BERT); or `cls` / `mean`"""
    seed: int = 0
    """the run's seed"""
    device: str = "auto"
    """`auto` (CUDA when present, else the CPU), `cpu` or `cuda`"""
    precision: str = "auto"
    """`auto`: bf16 autocast where the hardware multiplies bf16 natively (CPUs with AVX512-BF16 or AMX, GPUs of
    compute capability >= 8.0), else fp32; `bf16` / `fp32` force one (see resolve_precision)"""
    log_every: int = 50
    """steps between progress lines; 0: none"""
    report_fractions: list[float] = field(default_factory=list)
    """data-fidelity rungs: also evaluate and report (without a checkpoint) once this fraction of the run's
    training examples is seen, e.g. [1/9, 1/3]; epoch ends report anyway"""
    eval_splits: list[str] = field(default_factory=lambda: ["dev"])
    """the splits evaluated after each epoch (peftune.inputs.data.SPLITS): the first is the one the run is judged on
    (`score`, the task metrics, the epoch kept); the others are reported beside it as `<split>_score` and
    `<split>_<task metric>` (a search trial: selection; a confirmation run: selection, then decision and dev, whose
    numbers the confirmation takes at the epoch selection chose)"""
    predictions_of: tuple[str, ...] = ()
    """the splits whose per-example predictions every epoch's report carries (`predictions`)"""

    def __post_init__(self):
        self.tasks = [t.name for t in parse_tasks(self.tasks)]
        self._check_types()
        methods.make_method_config(self.method, self.method_options_with_dropout())  # validates
        self._check_head_lr()
        for key, bound in RATES.items():
            if getattr(self, key) is not None:  # head_lr None: the method's lr
                checked("TrainConfig", key, bound, getattr(self, key))
        for key, bound in COUNTS.items():
            checked("TrainConfig", key, bound, getattr(self, key), integer=True)
        if self.sampling not in SAMPLING:
            raise UserError(f"TrainConfig.sampling {self.sampling!r}, expected one of {SAMPLING}")
        if not all(0.0 < f < 1.0 for f in self.report_fractions):
            raise UserError(f"TrainConfig.report_fractions must lie in (0, 1), got {self.report_fractions!r}")
        if self.pooling not in ("auto", *POOLINGS):
            raise UserError(f"TrainConfig.pooling {self.pooling!r}, expected one of {('auto', *POOLINGS)}")
        if not self.eval_splits or len(set(self.eval_splits)) != len(self.eval_splits):
            raise UserError(f"TrainConfig.eval_splits must name distinct splits, got {self.eval_splits!r}")
        if any(split not in ("selection", "decision", "dev") for split in self.eval_splits):
            raise UserError(f"TrainConfig.eval_splits: {self.eval_splits!r}, expected selection, decision, dev")
        if not set(self.predictions_of) <= set(self.eval_splits):
            raise UserError(f"TrainConfig.predictions_of {self.predictions_of!r}: not among the eval_splits")
        try:
            check_device_name(self.device)
        except ValueError as error:
            raise UserError(f"TrainConfig.{error}") from None

    def _check_types(self) -> None:
        """Numbers are numbers (not bools) and finite: NaN and inf pass every `<` check."""
        for spec in dataclasses.fields(self):
            value, kind = getattr(self, spec.name), type(spec.default)
            if kind not in (int, float):
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or (kind is int and isinstance(value, float))
            ):
                raise UserError(
                    f"TrainConfig.{spec.name} must be {'an integer' if kind is int else 'a number'}, "
                    f"got {str(value)[:80]!r}"
                )
            if not math.isfinite(value):
                raise UserError(f"TrainConfig.{spec.name} must be a finite number, got {value!r}")
        if self.precision not in PRECISIONS:
            raise UserError(f"TrainConfig.precision {self.precision!r}, expected one of {PRECISIONS}")

    def _check_head_lr(self) -> None:
        value = self.head_lr
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UserError(f"TrainConfig.head_lr must be a finite number (or None: lr), got {str(value)[:80]!r}")

    @property
    def heads_lr(self) -> float:
        """The rate the heads train at: ``head_lr`` where set, except for frozen (heads only: ``lr``)."""
        return self.lr if self.head_lr is None or self.method == "frozen" else self.head_lr

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

    def build(self, device: torch.device | str = "cpu", copy: bool = True, over: BertModel | None = None) -> BertModel:
        # built on the meta device (no memory, no random initialisation that the weights would
        # overwrite), then the parameters take copies of the pretrained tensors (`assign=True`);
        # copies, so that full fine-tuning never writes into weights that other trials share.
        # copy=False: the parameters ARE the pretrained tensors where they are on `device` already (on the CPU).
        # over: a backbone built so (a pack's frozen one): the parameters ARE its tensors, on its device (a pack's
        # members share them; see peftune.core.pack)
        with torch.device("meta"):
            model = BertModel(self.config)
        if over is not None:
            model.load_state_dict(over.state_dict(), assign=True)
        else:
            model.load_state_dict({k: v.to(device, copy=copy) for k, v in self.state_dict.items()}, assign=True)
        return model


@dataclass
class PreparedData:
    """What the driver reads once and hands to every trial (via Ray's object store)."""

    backbone: PretrainedBackbone
    tasks: dict[str, TaskData]
    pad_token_id: int
    max_length: int
    file_hashes: dict[str, str]  # file name -> sha256, for the record
    specs: tuple[TaskSpec, ...] = ()  # the tasks as read (labels resolved): a worker declares them (shared_data)


def prepare(settings: DataSettings, tasks: Sequence[str]) -> PreparedData:
    """Load the backbone and tokenizer, read and tokenize every task's train and dev file once, as ``settings``
    say (:class:`peftune.inputs.data.DataSettings`: what a budget, the flags or a trial's record give).

    ``invalid_rows="skip"`` drops malformed rows (each listed in a warning) instead of stopping at
    the first; the real quora-train.csv has two. ``selection_examples``: a selection split carved from
    the train file (see :func:`peftune.inputs.data.load_tasks`).
    """
    specs = check_files(settings.data_dir, parse_tasks(tasks), settings.invalid_rows)  # before transformers loads
    check_role_sizes(settings, specs)
    backbone, model_dir = load_pretrained(settings.model)
    check_max_length(backbone.config, settings.max_length)
    tokenizer = load_tokenizer(model_dir)
    data = load_tasks(settings, specs, tokenizer)
    hashes = {Path(split.source).name: split.sha256 for task in data.values() for split in (task.train, task.dev)}
    return PreparedData(
        backbone=PretrainedBackbone(settings.model, backbone.config, backbone.state_dict(), native_pooling(model_dir)),
        tasks=data,
        pad_token_id=tokenizer.pad_token_id or 0,
        max_length=settings.max_length,
        file_hashes=hashes,
        specs=tuple(specs),
    )


# ----------------------------------------------------------------------------- the command that re-runs a trial


def train_command(config: TrainConfig, data: dict, threads: int | None = None) -> str:
    """The ``peftune train`` command line that trains ``config`` on the data ``prepare(**data)`` reads.

    A trial's record keeps it (``peftune.train_command``): the same command, on the same code, data and
    number of threads, gives the trial's epoch scores (another thread count sums in another order: the
    weights differ in their last digits). The run is judged on its first split, as the trial.
    """
    options = dataclasses.asdict(methods.make_method_config(config.method, config.method_options_with_dropout()))
    options.pop("dropout")
    argv = ["peftune", "train", "--method", config.method]
    for key, value in options.items():
        if value is None:  # the option's default: nothing to pass
            continue
        text = json.dumps(list(value)) if isinstance(value, (list, tuple)) else str(value)  # a YAML flow list
        argv += [
            f"--{key.replace('_', '-')}",
            text,
        ]  # every option has a flag (peftune.cli.train_command.add_method_args)
    values = {
        "model": data.get("model", DEFAULT_MODEL),
        "tasks": ",".join(config.tasks),
        "data-dir": data["data_dir"],
        "max-length": data.get("max_length", DEFAULT_MAX_LENGTH),
        "max-train-examples": data.get("max_train_examples"),
        "max-dev-examples": data.get("max_dev_examples"),
        "selection-examples": _selection_flag(data.get("selection_examples", False)),
        "decision-examples": data.get("decision_examples") or None,  # the rows it holds out of train
        "invalid-rows": data.get("invalid_rows", "raise"),
        "data-seed": data.get("seed", config.seed),
        **{name.replace("_", "-"): getattr(config, name) for name in COMMAND_FIELDS},
        "threads": threads,
    }
    for flag, value in values.items():
        if value is not None:
            argv += [f"--{flag}", repr(value) if isinstance(value, float) else str(value)]
    return shlex.join(argv)


# the TrainConfig fields `peftune train` takes by a flag of the same name (--head-lr: head_lr)
COMMAND_FIELDS = ("epochs", "lr", "head_lr", "dropout", "weight_decay", "batch_size", "warmup_ratio",
                   "max_grad_norm", "sampling", "temperature", "pooling", "seed", "precision")  # fmt: skip


def _selection_flag(selection_examples) -> str | None:
    """``--selection-examples``: none (False), ``dev`` (as many as each task's dev set: None) or a count."""
    if selection_examples is False:
        return None
    return "dev" if selection_examples is None else str(selection_examples)


# ----------------------------------------------------------------------------- device


def check_device_name(name) -> None:
    """``auto`` or a torch device string a model can train on (cpu, cuda, cuda:1, mps...); whether this machine
    has it is :func:`select_device`'s check, made where the trial runs (a sweep's driver may have no GPU)."""
    if name == "auto":
        return
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type == "meta":  # meta tensors hold no data: nothing trains there
        raise UserError(
            f"device {str(name)[:80]!r}: expected auto, cpu, cuda, cuda:N or another torch device"
        ) from None


def select_device(name: str = "auto") -> torch.device:
    """The device ``name`` stands for on this machine; a device it lacks (no CUDA, cuda:7 of 2 GPUs, mps off a
    Mac) is a UserError naming it, not a traceback from the first tensor moved there."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check_device_name(name)
    device = torch.device(name)
    if device.type == "cpu":
        return device
    backend = getattr(torch, device.type, None)  # torch.cuda, torch.mps, torch.xpu...
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        kind = "CUDA" if device.type == "cuda" else device.type
        raise UserError(f"device {name!r} was asked for but {kind} is not available on this machine")
    count = getattr(backend, "device_count", None)
    if device.index is not None and count is not None and device.index >= count():
        raise UserError(
            f"device {name!r}: this machine has {count()} {device.type} device(s), "
            f"{device.type}:0 to {device.type}:{count() - 1}"
        )
    return device


def cpu_has_native_bf16() -> bool:
    """True on CPUs whose matrix units multiply bf16 natively (AVX512-BF16 or AMX), read from /proc/cpuinfo.

    On such a CPU a bf16 matmul runs several times faster than an fp32 one; elsewhere bf16 is emulated and far
    slower than fp32, so "auto" keeps fp32 (the two peaks per machine: docs/benchmarks.md, "The main job").
    """
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:  # not Linux: no cheap way to tell, stay with fp32
        pass
    return False


def resolve_precision(device: torch.device, precision: str = "auto") -> str:
    """What a trial on ``device`` computes in ("bf16" or "fp32") for the configured ``precision``."""
    if precision not in PRECISIONS:
        raise UserError(f"precision {precision!r}, expected one of {PRECISIONS}")
    if precision != "auto":
        return precision
    if device.type == "cuda":
        # compute capability 8.0 (Ampere) and later have bf16 tensor cores; older GPUs only emulate it,
        # which torch.cuda.is_bf16_supported() also counts as "supported"
        return "bf16" if torch.cuda.get_device_capability(device) >= (8, 0) else "fp32"
    if device.type == "cpu":
        return "bf16" if cpu_has_native_bf16() else "fp32"
    return "fp32"


def autocast_for(device: torch.device, precision: str = "fp32"):
    """bf16 autocast (matmuls in bf16, reductions and LayerNorm in fp32; same range as fp32, so no
    loss scaling) for ``precision="bf16"``; nothing for fp32."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def cast_for(model: MultitaskModel, precision: str, like: BertModel | None = None) -> None:
    """Cast the model's frozen weights once for what ``autocast_for(precision)`` computes in (``cast_frozen``): the
    same numbers as autocast's cast at every call. A bf16 LoRA step on MiniLM spent 19% of its time in casts and
    copies (``peftune bench --profile``), the frozen weights' part of it at every step. ``like``: a pack's frozen
    backbone, whose casts its members reuse."""
    if precision == "bf16":
        cast_frozen(model if like is None else model.backbone, torch.bfloat16, like=like)


# ----------------------------------------------------------------------------- model + optimizer


def build_model(config: TrainConfig, backbone: BertModel, native_pooling: str = "cls") -> MultitaskModel:
    method_config = methods.make_method_config(config.method, config.method_options_with_dropout())
    specs = [get_task(t) for t in config.tasks]
    pooling = native_pooling if config.pooling == "auto" else config.pooling
    return MultitaskModel(backbone, specs, config.method, method_config, head_dropout=config.dropout, pooling=pooling)


def build_optimizer(model: MultitaskModel, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters: the heads at ``head_lr`` (when set), the rest at ``lr`` times the
    method's factor for that parameter (1 but for LoRA+'s B)."""
    heads = {id(p) for p in model.heads.parameters()}
    head_lr = config.heads_lr
    groups = {}
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        # the usual BERT recipe: no weight decay on biases, LayerNorm gains and 1-D vectors
        decays = not (parameter.ndim < 2 or "LayerNorm" in name)
        lr = head_lr if id(parameter) in heads else config.lr * model.method_config.lr_scale(name, parameter)
        group = groups.setdefault((lr, decays), {"params": [], "lr": lr, "weight_decay": config.weight_decay * decays})
        group["params"].append(parameter)
    # the fused kernel (CPU and CUDA) steps all parameters at once, faster than the default per-tensor loop (docs/
    # benchmarks.md, "Small figures"); the clip is folded into it (peftune.core.optim)
    return ClippedAdamW(list(groups.values()), lr=config.lr, max_grad_norm=config.max_grad_norm)


def linear_schedule(optimizer, total_steps: int, warmup_ratio: float):
    warmup = int(total_steps * warmup_ratio)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ----------------------------------------------------------------------------- evaluation


def predict(
    model: MultitaskModel,
    tasks: dict[str, TaskData],
    split: str,
    batch_size: int,
    device: torch.device,
    precision: str = "auto",
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per task, (predictions, labels) on ``split``, both (N,) on the CPU in the split's order.

    Batches are sorted by length (little padding), run without autograd under the same autocast as
    training (``precision`` as in :func:`resolve_precision`), and the predictions stay on the device
    until the task is done: one transfer per task, not one per batch.
    """
    precision = resolve_precision(device, precision)
    model.eval()
    out = {}
    with torch.inference_mode():
        for name, task_data in tasks.items():
            spec, data = model.tasks[name], task_data.split(split)
            predictions = []
            batches = bucketed_batches(data, batch_size, shuffle=False, pad_id=data.pad_id)
            for batch in batches:
                batch = batch.to(device, non_blocking=True)
                with autocast_for(device, precision):
                    outputs = model(name, batch.input_ids, batch.attention_mask, batch.token_type_ids)
                predictions.append(spec.predict(outputs.float()))
            # bucketed_batches reorders by length: restore the split's order
            out[name] = (restore_order(batches, predictions), data.labels)
    return out


def evaluate(
    model: MultitaskModel,
    tasks: dict[str, TaskData],
    batch_size: int,
    device: torch.device,
    precision: str = "auto",
    split: str = "dev",
) -> dict[str, float]:
    """The metric per task on ``split``, e.g. {"sst_accuracy": 0.41, "sts_pearson": 0.80} (see :func:`predict`)."""
    results = predict(model, tasks, split, batch_size, device, precision)
    return {model.tasks[t].metric_name: model.tasks[t].score(p, y) for t, (p, y) in results.items()}


# ----------------------------------------------------------------------------- the trial

ReportFn = Callable[[dict, Callable[[Path], None] | None], None]  # save is None within an epoch


@dataclass
class TrialResult:
    history: list[dict]  # one metrics dict per epoch
    model: MultitaskModel


def run_trial(
    config: TrainConfig,
    prepared: PreparedData,
    report: ReportFn | None = None,
    resume_from: str | Path | None = None,
) -> TrialResult:
    """Train ``config`` on ``prepared`` data; report the evaluated splits' metrics after every epoch.

    Besides the metrics and parameter counts, every report carries ``precision`` ("bf16" or "fp32", what the
    trial computed in), ``startup_s`` (from this call to the first training step: model build, optimizer,
    batching), ``eval_time_s`` (this epoch's evaluation), ``checkpoint_time_s`` (time spent writing
    checkpoints so far, i.e. in earlier reports' ``save``), the fidelity counters ``steps``, ``examples_seen``
    and ``tokens_seen`` and, on CUDA, ``peak_gpu_memory_mb`` (``torch.cuda.max_memory_allocated`` since the
    trial began, what packing trials onto one GPU must leave room for).
    """
    missing = [t for t in config.tasks if t not in prepared.tasks]
    if missing:
        raise UserError(f"tasks {missing} were not prepared; prepared: {sorted(prepared.tasks)}")
    trial = Trial(config, prepared, report)
    if resume_from is not None:
        trial.resume(resume_from)
    for epoch in range(trial.start_epoch, config.epochs):
        trial.train_epoch(epoch)
    return TrialResult(trial.history, trial.model)


@dataclass
class _Epoch:
    """The epoch a trial is in: its index and length, its clock, and its loss bookkeeping (kept on the device)."""

    index: int
    steps: int
    clock: Callable[[], float]  # the epoch's training seconds so far (its evaluations left out)
    loss_sum: torch.Tensor
    window: torch.Tensor  # the losses since the divergence guard last looked
    window_start: int = 0
    tokens: int = 0


class Trial:
    """One run's state: the model, its optimizer and schedule, the history and the fidelity counters.

    ``train_epoch`` runs an epoch alone. A pack (``peftune.core.pack``) runs its members' epochs in lockstep through the
    same pieces: ``begin_epoch``, its own packed step, then each member's ``update`` and ``after_step`` (the rung
    reports and the divergence guard), and ``finish_epoch`` (evaluation, the report and its checkpoint): a member
    reports, checkpoints and resumes exactly as its solo run."""

    def __init__(self, config: TrainConfig, prepared: PreparedData, report: ReportFn | None,
                 shared: BertModel | None = None):  # fmt: skip
        """``shared``: a pack's frozen backbone (built with ``copy=False``): this trial's backbone is built over its
        tensors and uses its casts, with copies of its own of the pretrained tensors it trains (BitFit's biases)."""
        self.started = time.perf_counter()
        self.config, self.prepared, self.report = config, prepared, report
        torch.manual_seed(config.seed)
        self.device = select_device(config.device)
        self.precision = resolve_precision(self.device, config.precision)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        backbone = prepared.backbone.build(self.device) if shared is None else prepared.backbone.build(over=shared)
        self.model = build_model(config, backbone, prepared.backbone.pooling).to(self.device)
        if shared is not None:
            for name, parameter in self.model.backbone.named_parameters():
                if parameter.requires_grad and name in self.model.pretrained_parameter_names:
                    parameter.data = parameter.data.clone()  # trained: its own, never the pack's
        cast_for(self.model, self.precision, like=shared)
        # a prompt's vectors go through every layer with each example: they count as tokens trained on
        prompt = backbone.embeddings.input_prompt
        self.virtual_tokens = prompt.length if prompt is not None else 0
        self.counts = count_parameters(self.model)
        self.optimizer = build_optimizer(self.model, config)
        self.tasks = {t: prepared.tasks[t] for t in config.tasks}
        first_plan = epoch_plan(config, self.tasks, prepared.pad_token_id, epoch=0)
        self.examples_per_run = config.epochs * sum(len(batch) for batch in first_plan)
        self.scheduler = linear_schedule(self.optimizer, len(first_plan) * config.epochs, config.warmup_ratio)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.history: list[dict] = []
        self.start_epoch = 0
        self.epoch: _Epoch | None = None  # the epoch in progress (begin_epoch to finish_epoch)
        self.guard = DivergenceGuard(config)
        self.train_time, self.startup_s, self.checkpoint_time = 0.0, None, [0.0]
        self.eval_time = 0.0  # every evaluation's, rungs' included (kept out of train_time)
        # the fidelity the schedulers' rungs, floors and budgets count in
        self.progress = {"steps": 0, "examples_seen": 0, "tokens_seen": 0}
        self.fractions = sorted(config.report_fractions)  # data-fidelity rungs still ahead

    def resume(self, directory: str | Path) -> None:
        from peftune.core import checkpoint

        state = checkpoint.load_training_state(
            directory, self.model, self.optimizer, self.scheduler, self.prepared.backbone
        )
        self.start_epoch, self.history = state["epoch"], state["history"]
        last = self.history[-1] if self.history else {}
        self.guard = DivergenceGuard(self.config, reference=self.history[0]["train_loss"] if self.history else None)
        self.train_time = sum(m["epoch_time_s"] for m in self.history)
        self.eval_time = last.get("eval_total_s", 0.0)
        self.progress = {key: last.get(key, 0) for key in self.progress}
        self.fractions = [f for f in self.fractions if f > self.progress["examples_seen"] / self.examples_per_run]

    def train_epoch(self, epoch: int) -> None:
        """One epoch: its steps (with any rung reports within it), then evaluation and the epoch's report."""
        # dropout draws depend on (seed, epoch) only, so a resumed trial continues exactly
        torch.manual_seed(epoch_seed(self.config, epoch))
        plan = epoch_plan(self.config, self.tasks, self.prepared.pad_token_id, epoch)
        self.begin_epoch(epoch, len(plan))
        for step, batch in enumerate(plan):
            self.after_step(step, batch, self.step(batch))
        self.finish_epoch()

    def begin_epoch(self, epoch: int, steps: int, clock: Callable[[], float] | None = None) -> None:
        """Start epoch ``epoch`` of ``steps`` steps. ``clock``: its training seconds so far; by default this trial's
        time from now, its own evaluations left out (a pack gives its members the pack's)."""
        self.model.train()
        if self.startup_s is None:
            self.startup_s = time.perf_counter() - self.started
        if clock is None:
            started, evaluated_before = time.perf_counter(), self.eval_time

            def clock() -> float:
                return time.perf_counter() - started - (self.eval_time - evaluated_before)

        # the loss stays on the device: summed there, looked at every `guard.every` steps (one host sync per look,
        # not per step)
        zero = functools.partial(torch.zeros, (), device=self.device)
        self.epoch = _Epoch(epoch, steps, clock, loss_sum=zero(), window=zero())

    def step(self, batch) -> torch.Tensor:
        """One optimizer step on ``batch``; its loss, detached, on the device."""
        batch = to_device(batch, self.device)
        with autocast_for(self.device, self.precision):
            outputs = self.model(batch.task, batch.input_ids, batch.attention_mask, batch.token_type_ids)
        loss = self.model.tasks[batch.task].loss(outputs.float(), batch.labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.update()
        return loss.detach()

    def update(self) -> None:
        """The optimizer step once the gradients are in: AdamW with the clip (this trial's norm), the schedule."""
        self.optimizer.step()
        self.scheduler.step()
        self.progress["steps"] += 1

    def after_step(self, step: int, batch, loss: torch.Tensor) -> None:
        """A step's bookkeeping: the counters, any rung report it reached, the divergence guard (which raises
        ``TrainingDiverged``). Tokens (the input's and a prompt's) are counted on the host from the CPU-side masks."""
        epoch = self.epoch
        batch_tokens = int(batch.attention_mask.sum()) + self.virtual_tokens * int(batch.input_ids.shape[0])
        epoch.tokens += batch_tokens
        epoch.window = epoch.window + loss
        self.progress["examples_seen"] += int(batch.input_ids.shape[0])
        self.progress["tokens_seen"] += batch_tokens
        self.rung_reports(epoch.index, epoch.clock, within=step + 1 < epoch.steps)  # an epoch's end reports anyway
        first_look = self.guard.reference is None and step == 0  # the first step alone is the reference
        if first_look or (step + 1) % self.guard.every == 0 or step + 1 == epoch.steps:
            window_mean = self.guard.check(epoch.window, step + 1 - epoch.window_start, epoch.index,
                                           epoch.window_start, step)  # fmt: skip
            epoch.loss_sum += epoch.window
            epoch.window, epoch.window_start = torch.zeros((), device=self.device), step + 1
            self.log_progress(epoch, step, window_mean)

    def finish_epoch(self) -> None:
        """The epoch's end: its time, then evaluation and the epoch's report."""
        epoch, self.epoch = self.epoch, None  # its clock refers to this trial: a cycle that kept a finished model
        epoch_time = epoch.clock()
        self.train_time += epoch_time
        self.end_epoch(epoch.index, epoch.loss_sum.item() / max(1, epoch.steps), epoch_time, epoch.tokens)

    def rung_reports(self, epoch: int, trained: Callable[[], float], within: bool) -> None:
        """Report (without a checkpoint) each data-fidelity rung the run has just passed ``within`` the epoch;
        ``trained()``: the epoch's training seconds so far."""
        while self.fractions and self.progress["examples_seen"] / self.examples_per_run >= self.fractions[0]:
            self.fractions.pop(0)
            if self.report is None or not within:
                continue
            evaluating = time.perf_counter()
            metrics = evaluate_splits(self.model, self.tasks, self.config, self.device, self.precision, False)
            self.model.train()
            self.eval_time += time.perf_counter() - evaluating
            progress = {
                **self.progress,
                "train_time_s": self.train_time + trained(),
                "eval_total_s": self.eval_time,
                "startup_s": self.startup_s,
            }
            self.report(_partial_metrics(epoch, metrics, progress, self.examples_per_run), None)

    def log_progress(self, epoch: _Epoch, step: int, loss: float) -> None:
        every = self.config.log_every
        if every and (step + 1) % every < self.guard.every:
            rate = epoch.tokens / max(epoch.clock(), 1e-9)
            log.info("epoch %d step %d/%d loss %.4f %.0f tokens/s", epoch.index + 1, step + 1, epoch.steps, loss, rate)

    def end_epoch(self, epoch: int, train_loss: float, epoch_time: float, tokens: int) -> None:
        """Evaluate, append the epoch to the history and report it with its checkpoint."""
        started_eval = time.perf_counter()
        evaluated = evaluate_splits(self.model, self.tasks, self.config, self.device, self.precision)
        eval_s = time.perf_counter() - started_eval
        self.eval_time += eval_s
        metrics = {
            EPOCH: epoch + 1,
            **evaluated,
            "train_loss": train_loss,
            "epoch_time_s": epoch_time,
            "train_time_s": self.train_time,
            "tokens_per_s": tokens / epoch_time,
            **self.progress,
            "progress": self.progress["examples_seen"] / self.examples_per_run,
            "precision": self.precision,
            "startup_s": self.startup_s,
            "eval_time_s": eval_s,
            "eval_total_s": self.eval_time,
            "checkpoint_time_s": self.checkpoint_time[0],
            **self.counts.summary(),
        }
        if self.device.type == "cuda":
            metrics["peak_gpu_memory_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        self.history.append({k: v for k, v in metrics.items() if k != "predictions"})  # the report carries them
        shown = " ".join(f"{k} {v:.4f}" for k, v in evaluated.items() if k != "predictions")
        log.info("epoch %d/%d %s", epoch + 1, self.config.epochs, shown)
        if self.report is not None:
            self.report(metrics, self.saver(epoch))

    def saver(self, epoch: int) -> Callable[[Path], None]:
        """The report's ``save``: only valid during the report call (the model and optimizer move on after).

        The last epoch's checkpoint has no optimizer state: no step is taken from it, and the state is twice
        the trainable weights (full fine-tuning: 180 of 270 MB written once more by Tune, the slot idle)."""
        from peftune.core import checkpoint

        resumable = epoch + 1 < self.config.epochs
        save = functools.partial(
            checkpoint.save_checkpoint,
            self.model,
            config=self.config,
            backbone=self.prepared.backbone,
            metrics=self.history[-1],
            optimizer=self.optimizer if resumable else None,
            scheduler=self.scheduler if resumable else None,
            epoch=epoch + 1,
            history=list(self.history),
        )
        return _timed(self.checkpoint_time, save)


def evaluate_splits(model, tasks, config: TrainConfig, device, precision: str, with_predictions: bool = True) -> dict:
    """The metrics of ``config.eval_splits`` (see :class:`TrainConfig`): the first split's task metrics and
    ``score`` under their plain names and as ``<split>_score``; every other split's, and dev's always (the
    report reads them by that name), as ``<split>_<name>``; and, for the splits of ``config.predictions_of``,
    ``predictions``: {split: {task: [prediction per example, in file order]}}."""
    metrics: dict = {}
    for i, split in enumerate(config.eval_splits):
        results = predict(model, tasks, split, config.batch_size * 4, device, precision)
        task_metrics = {model.tasks[t].metric_name: model.tasks[t].score(p, y) for t, (p, y) in results.items()}
        values = {**task_metrics, SCORE: overall_score(task_metrics)}
        metrics.update(values if i == 0 else {})
        named = i > 0 or split == DEV
        metrics.update({split_metric(split, key): value for key, value in values.items() if named or key == SCORE})
        if with_predictions and split in config.predictions_of:
            metrics.setdefault("predictions", {})[split] = {t: p.tolist() for t, (p, _) in results.items()}
    return metrics


def _partial_metrics(epoch: int, dev: dict, progress: dict, examples_per_run: int) -> dict:
    """A report within an epoch (a data-fidelity rung): ``epoch`` counts the epochs completed."""
    return {
        EPOCH: epoch,
        **dev,
        **progress,
        "progress": progress["examples_seen"] / examples_per_run,
        PARTIAL: True,
    }


class DivergenceGuard:
    """Stops a trial whose loss is not finite, or whose smoothed loss grew past ``GROWTH`` x its start.

    The loss is looked at every ``every`` steps as the mean over those steps (a smoothed loss, one
    host sync per look). The reference is the trial's first step alone (its first epoch's mean when
    resumed), not a first window: a learning rate that explodes on the second step would otherwise
    make the exploded loss its own reference. A trial whose loss climbs past 10x where it began
    (floored at 1.0) is diverging, whatever the task mix (the tasks' starting losses differ by less
    than that: ~1.6 for 5-way cross-entropy, ~0.7 for BCE, ~2-3 for STS's MSE with the head starting
    at mid-range).
    """

    GROWTH = 10.0

    def __init__(self, config: TrainConfig, reference: float | None = None, every: int = 16):
        self.config = config
        self.reference = reference
        self.every = every

    def check(self, window_sum: torch.Tensor, steps: int, epoch: int, first: int, last: int) -> float:
        mean = window_sum.item() / steps
        where = f"at epoch {epoch + 1}, steps {first + 1}-{last + 1}"
        hint = f"lr {self.config.lr:g} may be too high for method {self.config.method!r}"
        if not math.isfinite(mean):
            raise TrainingDiverged(f"loss is {mean} {where}; {hint}")
        if self.reference is None:
            self.reference = mean
        elif mean > self.GROWTH * max(self.reference, 1.0):
            raise TrainingDiverged(
                f"loss {mean:.4g} {where} grew past {self.GROWTH:g}x its start ({self.reference:.4g}); {hint}"
            )
        return mean


def to_device(batch, device: torch.device):
    """``batch`` on ``device`` (a CPU batch as it is; to CUDA from page-locked memory, asynchronously)."""
    if device.type != "cuda":
        return batch
    # page-locked host memory lets the copy run asynchronously, overlapping the previous step
    pinned = dataclasses.replace(
        batch,
        input_ids=batch.input_ids.pin_memory(),
        attention_mask=batch.attention_mask.pin_memory(),
        token_type_ids=batch.token_type_ids.pin_memory(),
        labels=batch.labels.pin_memory(),
    )
    return pinned.to(device, non_blocking=True)


def _timed(total: list[float], function):
    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - started

    return timed


def epoch_seed(config: TrainConfig, epoch: int) -> int:
    """The seed of a run's ``epoch``: its batch order's (:func:`epoch_plan`) and its global RNG's (dropout)."""
    return config.seed * 1_000_003 + epoch


def epoch_plan(config: TrainConfig, tasks: dict[str, TaskData], pad_id: int, epoch: int) -> list:
    """The batches of one epoch in training order, the same for the same (seed, epoch)."""
    generator = torch.Generator().manual_seed(epoch_seed(config, epoch))
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
