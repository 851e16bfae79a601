"""The method registry and what every PEFT method shares.

A method is a config dataclass plus an ``apply`` function that installs the method into a backbone whose
parameters are all frozen on entry: ``apply`` unfreezes what the method trains and installs new modules at the
backbone's hook points (see ``peftune.inputs.backbone``). So that parameter accounting, task switching and checkpoints
work without knowing the method: task-specific parameters live under an ``nn.ModuleDict`` named ``per_task`` keyed
by task name (every other trainable parameter is shared), and a module that depends on the current task reads
``context.task``, which ``MultitaskModel.forward`` sets for each batch (a batch always holds one task).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import torch
from torch import nn

from peftune.base.errors import UnknownNameError, UserError
from peftune.base.validation import Bound, checked
from peftune.inputs.backbone import BertConfig, BertModel

DROPOUT = Bound(0.0, 1.0, high_open=True)  # of a method's modules and the heads (TrainConfig, every search space)

PER_TASK = "per_task"


class TaskContext:
    """The task of the batch being processed, shared by all task-dependent modules."""

    def __init__(self, tasks: Sequence[str]):
        self.tasks = list(tasks)
        self._task: str | None = None

    @property
    def task(self) -> str:
        if self._task is None:
            raise RuntimeError("no task is set: call the model with a task name")
        return self._task

    @task.setter
    def task(self, name: str) -> None:
        if name not in self.tasks:
            raise UnknownNameError(f"unknown task {name!r}; this model serves {self.tasks}")
        self._task = name

    @property
    def task_index(self) -> int:
        return self.tasks.index(self.task)


@dataclass
class MethodConfig:
    """Base of every method config. ``dropout`` is the method's own modules' dropout."""

    dropout: float = 0.1

    def __post_init__(self):
        _coerce_declared_floats(self)
        for spec in fields(self):  # NaN and inf slip through every range check: refuse them first
            value = getattr(self, spec.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise UserError(f"{type(self).__name__}.{spec.name} must be a finite number, got {value!r}")
        checked(type(self).__name__, "dropout", DROPOUT, self.dropout)

    def check_backbone(self, bert: BertConfig) -> None:
        """Refuse sizes this backbone cannot hold (a LoRA rank above its hidden size, k above its layers...),
        before anything is allocated; each method with a size checks its own, then calls ``super()``."""

    def lr_scale(self, name: str, parameter) -> float:
        """The factor on the learning rate of the trainable backbone parameter ``name``: 1 for every method but one
        that trains some of its parameters faster (LoRA+ trains B at ``loraplus_lr_ratio`` x lr)."""
        return 1.0


# widths of a method's own modules, in multiples of the backbone's hidden size: an adapter bottleneck wider
# than the FFN (4 x hidden) is no bottleneck; a hypernetwork or reparameterisation MLP 16 x wider is absurd
MAX_BOTTLENECK_FACTOR = 4
MAX_WIDTH_FACTOR = 16


def _coerce_declared_floats(config: MethodConfig) -> None:
    """An integer given for a float field becomes that float, whatever the route (a sweep's YAML, ``--option``,
    a record's params, a library call): a method builds its tensors from the value (an int tensor cannot train)."""
    for name in _float_fields(type(config)):
        value = getattr(config, name)
        if isinstance(value, int) and not isinstance(value, bool):  # a bool stays, for the field's check to refuse
            setattr(config, name, float(value))


@functools.cache
def _float_fields(cls: type) -> tuple[str, ...]:
    hints = typing.get_type_hints(cls)
    return tuple(spec.name for spec in fields(cls) if _without_none(hints[spec.name]) is float)


# sizes no BERT holds, refused by a config alone (a search space's every value, before any model is read;
# ``check_backbone`` then holds each size to the model's own shape): BERT-large is 1,024 wide, 24 layers deep and
# 512 positions long, and these leave 8x room above it for any wider, deeper or longer BERT checkpoint
MAX_BERT_WIDTH = 8 * 1_024
MAX_BERT_LAYERS = 8 * 24
MAX_BERT_POSITIONS = 8 * 512
BERT_WIDTH = f"the widest hidden size taken, {MAX_BERT_WIDTH:,} = 8 x BERT-large's"
BERT_LAYERS = "8 x BERT-large's layers"
BERT_POSITIONS = "8 x BERT's positions"


def check_at_most(config, key: str, limit: int, what: str) -> None:
    """``config.key`` <= ``limit``, the backbone's ``what`` (named in the error)."""
    value = getattr(config, key)
    if value is not None and value > limit:
        raise UserError(
            f"{type(config).__name__}.{key} = {value!r} is too large for the backbone; expected at most {limit:,} "
            f"({what})"
        )


def check_range(
    config, key: str, low: float, high: float | None = None, *, high_inclusive: bool = True, low_inclusive: bool = True
) -> None:
    value = getattr(config, key)
    kind = type(config).__name__
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{kind}.{key} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise UserError(f"{kind}.{key} must be a finite number, got {value!r}")
    too_high = high is not None and (value > high if high_inclusive else value >= high)
    if (value < low if low_inclusive else value <= low) or too_high:
        bracket = "]" if high_inclusive else ")"
        upper = "inf)" if high is None else f"{high}{bracket}"
        raise UserError(f"{kind}.{key} = {value!r} is out of range; expected a value in {'[' if low_inclusive else '('}"
                        f"{low}, {upper}")  # fmt: skip


def check_positive_int(config, key: str, at_most: int | None = None, why: str = "") -> None:
    """``config.key`` an integer >= 1 and, for a size, ``<= at_most`` (``why``: the bound's reason, e.g.
    :data:`BERT_WIDTH`): a size beyond any model is refused with its key before a model is read."""
    value, kind = getattr(config, key), type(config).__name__
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{kind}.{key} must be a positive integer, got {value!r}")
    if at_most is not None and value > at_most:
        raise UserError(f"{kind}.{key} = {value!r} is too large for any BERT; expected at most {at_most:,} ({why})")


ApplyFn = Callable[[BertModel, Any, TaskContext], None]

# colours of a method the registry does not know (one in an old record or the published reference table),
# picked from its name so that it keeps one colour across reports
FALLBACK_COLORS = ("#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d")


def option(default, help: str, **kwargs):
    """A config field with the help its command-line flag shows (``peftune train --help``); ``kwargs``: as
    ``dataclasses.field``'s (``default_factory`` for a list: pass ``default=dataclasses.MISSING``)."""
    if default is not dataclasses.MISSING:
        kwargs["default"] = default
    return dataclasses.field(metadata={"help": help}, **kwargs)


@dataclass(frozen=True)
class MethodOption:
    """One option of a method's config as the command line offers it: generated from the config's field."""

    name: str
    type: Any  # the field's type, ``None`` stripped from an optional one (``int | None``: int)
    default: Any
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _no_extra(backbone: BertModel) -> dict[str, torch.Tensor]:
    return {}


class PeftFormat(NamedTuple):
    """How a method's adapter is written in peft's format (``peftune train --export-peft``)."""

    config: Callable  # our method config -> peft's config (saved as adapter_config.json)
    trained: str  # in the names of the backbone parameters peft saves (its tuner's prefix)
    # peft's keys and values of the tensors it needs beyond those parameters (VeRA's shared projections)
    extra: Callable[[BertModel], dict[str, torch.Tensor]] = _no_extra


@dataclass(frozen=True)
class MethodSpec:
    """A method's identity, all of it in one place: what it is, how it installs, and how every report shows it."""

    name: str
    config_cls: type[MethodConfig]
    apply: ApplyFn
    description: str
    # the config field that sets the method's size (what a sweep searches), if any
    size_field: str | None = None
    # where the report's tables and plots list it (ascending; the AdaptBert tables' order first); unset: after
    # every ordered method, alphabetically
    order: float = math.inf
    color: str | None = None  # its colour in every plot of every report; None: a stable one from its name
    # the fields its size label shows, in order, with their symbols (``lora_adapter``: r=8 m=64); default: the
    # size field under its own name
    size_symbols: dict[str, str] = dataclasses.field(default_factory=dict, hash=False)
    peft_export: PeftFormat | None = None  # how its adapters export to peft's format; None: they do not

    def __post_init__(self):
        if not self.size_symbols and self.size_field:
            object.__setattr__(self, "size_symbols", {self.size_field: self.size_field})

    @property
    def display_color(self) -> str:
        return self.color or fallback_color(self.name)

    def options(self) -> tuple[MethodOption, ...]:
        """The config's fields as command-line options, ``dropout`` aside (a common hyperparameter, set by
        ``--dropout`` for the heads and the method alike)."""
        hints = typing.get_type_hints(self.config_cls)
        out = []
        for spec in fields(self.config_cls):
            if spec.name == "dropout":
                continue
            default = spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default
            help_text = spec.metadata.get("help") or spec.name.replace("_", " ")
            out.append(MethodOption(spec.name, _without_none(hints[spec.name]), default, help_text))
        return tuple(out)


def _without_none(hint):
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return hint


def fallback_color(name: str) -> str:
    return FALLBACK_COLORS[sum(map(ord, name)) % len(FALLBACK_COLORS)]


_REGISTRY: dict[str, MethodSpec] = {}


def register_method(spec: MethodSpec) -> MethodSpec:
    if spec.name in _REGISTRY:
        raise UserError(f"method {spec.name!r} is already registered")
    if not (dataclasses.is_dataclass(spec.config_cls) and issubclass(spec.config_cls, MethodConfig)):
        raise TypeError(f"method {spec.name!r}: config_cls must be a MethodConfig dataclass")
    known = {f.name for f in fields(spec.config_cls)}
    unknown = [name for name in [spec.size_field, *spec.size_symbols] if name is not None and name not in known]
    if unknown or (spec.size_field and spec.size_field not in spec.size_symbols):
        raise TypeError(f"method {spec.name!r}: size fields {unknown or [spec.size_field]} are not in its label")
    _REGISTRY[spec.name] = spec
    return spec


def get_method(name: str) -> MethodSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownNameError(f"unknown method {name!r}; valid methods: {', '.join(sorted(_REGISTRY))}") from None


def method_names() -> list[str]:
    return list(_REGISTRY)


def peft_exports() -> list[str]:
    """The methods whose adapters export to peft's format, in registration order."""
    return [name for name, spec in _REGISTRY.items() if spec.peft_export is not None]


def display_order(names) -> list[str]:
    """Distinct ``names`` as every report lists methods: by their spec's ``order``, then by name (a method the
    registry does not know, from an old record, after every registered one)."""
    present = list(dict.fromkeys(names))
    return sorted(present, key=lambda n: (_REGISTRY[n].order, 0, n) if n in _REGISTRY else (math.inf, 1, n))


def make_method_config(name: str, values: dict | None = None) -> MethodConfig:
    """Build and validate a method's config; an unknown key names the valid ones."""
    spec = get_method(name)
    values = dict(values or {})
    known = {f.name for f in fields(spec.config_cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise UserError(
            f"method {name!r} has no option {', '.join(map(repr, unknown))}; valid options: {', '.join(sorted(known))}"
        )
    return spec.config_cls(**values)


def unfreeze(module: nn.Module) -> None:
    for parameter in module.parameters():
        parameter.requires_grad_(True)
