"""Search spaces and sweep definitions: YAML files -> validated dataclasses.

``search_spaces/`` holds YAML only (read with a safe loader; a file never names
code to import). Two kinds of file:

**A method's search space**, ``search_spaces/methods/<method>.yaml``::

    method: lora                               # must match the file name
    lr: {low: 1.0e-4, high: 5.0e-3, log: true} # learning rate, log-uniform
    dropout: {low: 0.0, high: 0.3}             # heads and the method's own modules
    weight_decay: {low: 0.0, high: 0.1}
    options:                                   # the method's config fields (peftune.methods)
      rank: {choices: [1, 2, 4, 8, 16, 32, 64]}  # the size field is required
      alpha: 16                                # a plain value is held fixed

A parameter is a plain value (fixed), ``{low, high}`` with optional ``log``
(and ``step`` for integers) or ``{choices: [...]}``. Integer or float follows the
config field's type. Every endpoint and choice is checked by building the
method's config with it, so a space cannot propose a configuration the method
refuses.

**A sweep definition**, e.g. ``search_spaces/sst_tuning.yaml``: which methods
and tasks, the backbone, the seed, the search (TPE, single or multi-objective),
the scheduler (ASHA or none), resources per trial, retries, fixed training
settings, and named budget presets (epochs, batch size, data caps, number of
trials); see the shipped files. ``load_sweep(path, budget="smoke")`` returns a
:class:`SweepDefinition` with the chosen preset resolved and every method's
space loaded from ``methods/<name>.yaml`` beside it.

Every problem -- an unknown key, a wrong type, an empty or inverted range, an
unknown method or task -- raises :class:`SpaceError` naming the file and the key
before anything starts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from peftune.errors import UserError

MAX_SEED = 2**32 - 1  # numpy's seed range; torch takes it too
SEARCH_SPACES_DIR = Path(__file__).resolve().parents[2] / "search_spaces"
METHODS_SUBDIR = "methods"
OBJECTIVES = ("single", "multi")
SAMPLERS = ("tpe", "nsga2")
SCHEDULERS = ("asha", "none")
ALLOCATIONS = ("per_method", "joint")
FIDELITIES = ("epochs", "data")
# (metric, mode) pairs the multi-objective search optimises
MULTI_OBJECTIVE = (("score", "max"), ("trainable_params_per_task", "min"))
# TrainConfig fields a sweep sets elsewhere (searched, budget, top level), so not in `train:`
_TRAIN_FIELDS_SET_ELSEWHERE = {
    "method",
    "method_options",
    "tasks",
    "lr",
    "dropout",
    "weight_decay",
    "epochs",
    "batch_size",
    "seed",
    "report_fractions",  # from the scheduler's data-fidelity rungs
}


class SpaceError(UserError):
    """A search space or sweep file is invalid: names the file, the key and what was expected."""

    def __init__(self, path: str | Path, key: str | None, problem: str):
        self.path, self.key, self.problem = str(path), key, problem
        # bounded and on one line whatever the input: keys and problems may quote a user's file
        key, problem = _one_line(key, MAX_SHOWN) if key else key, _one_line(problem, 4 * MAX_SHOWN)
        super().__init__(f"{path}: {key}: {problem}" if key else f"{path}: {problem}")

    def __reduce__(self):
        return SpaceError, (self.path, self.key, self.problem)


MAX_SHOWN = 80  # characters of a user's value echoed in an error message


_REPR = reprlib.Repr()  # walks at most a few levels and items: cheap even on a huge nested value
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, MAX_SHOWN, MAX_SHOWN


def _show(value) -> str:
    """``repr(value)`` cut to MAX_SHOWN characters: an error message never echoes an unbounded value."""
    return _one_line(_REPR.repr(value), MAX_SHOWN)


def _got(value) -> str:
    """What a user wrote, for "expected a number, got ...": a quoted number is named a string, not shown as one."""
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return _show(value)
        return f"a string, {_show(value)} (write a number without quotes)"
    return _show(value)


def _one_line(text: str, limit: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ----------------------------------------------------------------------------- YAML


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also reads ``1e-4`` as a float (YAML 1.1 wants ``1.0e-4``), refuses
    duplicate keys (YAML says they are an error; PyYAML keeps the last) and refuses aliases (``*name``):
    a few nested aliases expand to gigabytes, and nothing in a space or sweep file needs them."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, f"aliases are not allowed (*{_one_line(event.anchor, MAX_SHOWN)})", event.start_mark
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: the base class names it
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {_show(key)}", key_node.start_mark)
        return super().construct_mapping(node, deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise SpaceError(path, None, "file not found")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)  # a SafeLoader: no Python objects
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise SpaceError(path, None, f"not valid YAML: {where}{error.problem or error.context}") from None
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError) as error:
        raise SpaceError(path, None, f"not valid YAML: {type(error).__name__}: {error}") from None
    if not isinstance(data, dict):
        raise SpaceError(path, None, f"expected a mapping at the top level, got {type(data).__name__}")
    return data


# ----------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class Fixed:
    value: Any  # not searched: the define-by-run space returns it as a constant

    def values(self) -> list:
        return [self.value]


@dataclass(frozen=True)
class FloatRange:
    low: float
    high: float
    log: bool = False

    def suggest(self, trial, name: str) -> float:
        return trial.suggest_float(name, self.low, self.high, log=self.log)

    def values(self) -> list:
        return [self.low, self.high]


@dataclass(frozen=True)
class IntRange:
    low: int
    high: int
    log: bool = False
    step: int = 1

    def suggest(self, trial, name: str) -> int:
        return trial.suggest_int(name, self.low, self.high, step=self.step, log=self.log)

    def values(self) -> list:
        return [self.low, self.high]


@dataclass(frozen=True)
class Choice:
    choices: tuple

    def suggest(self, trial, name: str):
        return trial.suggest_categorical(name, list(self.choices))

    def values(self) -> list:
        return list(self.choices)


Param = Fixed | FloatRange | IntRange | Choice


def param_to_yaml(param: Param):
    if isinstance(param, Fixed):
        return param.value
    if isinstance(param, Choice):
        return {"choices": list(param.choices)}
    out = {"low": param.low, "high": param.high}
    if param.log:
        out["log"] = True
    if isinstance(param, IntRange) and param.step != 1:
        out["step"] = param.step
    return out


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_scalar(path, key, value, kind: type | None):
    """A plain value of the expected kind (int, float, bool, str) or any scalar when kind is None."""
    if isinstance(value, float) and not math.isfinite(value):
        raise SpaceError(path, key, f"expected a finite number, got {_show(value)}")
    if kind is float:
        if not _is_number(value):
            raise SpaceError(path, key, f"expected a number, got {_got(value)}")
        return float(value)
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpaceError(path, key, f"expected an integer, got {_got(value)}")
        return value
    if kind is not None and not isinstance(value, kind):
        raise SpaceError(path, key, f"expected a {kind.__name__}, got {_show(value)}")
    return value


def parse_param(path, key: str, raw, kind: type | None) -> Param:
    """One parameter: a plain value, {low, high[, log][, step]} or {choices: [...]}."""
    if not isinstance(raw, dict):
        if isinstance(raw, list) and kind is not None:
            raise SpaceError(path, key, "a list is not a parameter; write {choices: [...]} to search over values")
        return Fixed(_check_scalar(path, key, raw, kind))
    if "choices" in raw:
        extra = sorted(set(raw) - {"choices"}, key=str)
        if extra:
            raise SpaceError(path, f"{key}.{extra[0]}", "unknown key next to 'choices' (choices take no other key)")
        choices = raw["choices"]
        if not isinstance(choices, list) or not choices:
            raise SpaceError(path, f"{key}.choices", f"expected a non-empty list, got {_show(choices)}")
        values = [_check_scalar(path, f"{key}.choices[{i}]", c, kind) for i, c in enumerate(choices)]
        if any(isinstance(v, (dict, list)) or v is None for v in values):
            raise SpaceError(path, f"{key}.choices", "choices must be plain numbers, strings or booleans")
        if len(set(values)) != len(values):
            raise SpaceError(path, f"{key}.choices", f"a value is listed twice in {_show(values)}")
        return Choice(tuple(values))
    allowed = {"low", "high", "log", "step"}
    unknown = sorted(set(raw) - allowed, key=str)
    if unknown:
        raise SpaceError(path, f"{key}.{unknown[0]}", "unknown key; expected low, high, log, step or choices")
    for bound in ("low", "high"):
        if bound not in raw:
            raise SpaceError(path, f"{key}.{bound}", "missing (a range needs low and high)")
    log = raw.get("log", False)
    if not isinstance(log, bool):
        raise SpaceError(path, f"{key}.log", f"expected true or false, got {_show(log)}")
    integer = kind is int or (
        kind is None and all(isinstance(raw[b], int) and not isinstance(raw[b], bool) for b in ("low", "high"))
    )
    if kind not in (None, int, float):
        raise SpaceError(path, key, f"a {kind.__name__} option cannot take a range; use a value or {{choices: [...]}}")
    low = _check_scalar(path, f"{key}.low", raw["low"], int if integer else float)
    high = _check_scalar(path, f"{key}.high", raw["high"], int if integer else float)
    if not all(math.isfinite(v) for v in (low, high)):
        raise SpaceError(path, key, "low and high must be finite numbers")
    if not low < high:
        what = "empty" if low == high else "inverted"
        raise SpaceError(path, key, f"{what} range: low ({low}) must be < high ({high}); use a plain value to fix it")
    if log and low <= 0:
        raise SpaceError(path, f"{key}.low", f"a log range needs low > 0, got {low}")
    if not integer:
        if "step" in raw:
            raise SpaceError(path, f"{key}.step", "step applies to integer ranges only")
        return FloatRange(low, high, log)
    step = raw.get("step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise SpaceError(path, f"{key}.step", f"expected a positive integer, got {_show(step)}")
    if step != 1 and log:
        raise SpaceError(path, f"{key}.step", "an integer range takes either log: true or a step, not both")
    if (high - low) % step:
        raise SpaceError(path, f"{key}.step", f"high - low ({high - low}) is not a multiple of step ({step})")
    return IntRange(low, high, log, step)


# ----------------------------------------------------------------------------- method spaces

# the hyperparameters every method searches, with their valid intervals: (low, high, low included, high included);
# the upper bounds of lr and weight_decay are sane bounds (beyond them a trial only diverges or erases its weights)
_COMMON = {
    "lr": (0.0, 10.0, False, True),
    "dropout": (0.0, 1.0, True, False),
    "weight_decay": (0.0, 10.0, True, True),
}


def _out_of_range(key: str, value) -> str | None:
    """The interval of common parameter ``key`` when ``value`` lies outside it, else None."""
    low, high, low_included, high_included = _COMMON[key]
    if (value < low if low_included else value <= low) or (value > high if high_included else value >= high):
        return ("[" if low_included else "(") + f"{low:g}, {high:g}" + ("]" if high_included else ")")
    return None


@dataclass(frozen=True)
class MethodSpace:
    """The search space of one method: lr, dropout, weight decay and the method's own options."""

    method: str
    lr: Param
    dropout: Param
    weight_decay: Param
    options: dict[str, Param] = field(default_factory=dict)
    source: str = ""
    default: dict[str, Any] = field(default_factory=dict)  # the published setting: each method's first trial
    default_source: str = ""  # where the default comes from (paper, report)

    def params(self) -> dict[str, Param]:
        return {"lr": self.lr, "dropout": self.dropout, "weight_decay": self.weight_decay, **self.options}

    def to_yaml(self) -> dict:
        out = {
            "method": self.method,
            "lr": param_to_yaml(self.lr),
            "dropout": param_to_yaml(self.dropout),
            "weight_decay": param_to_yaml(self.weight_decay),
        }
        if self.options:
            out["options"] = {k: param_to_yaml(v) for k, v in self.options.items()}
        if self.default:
            out["default"] = {**self.default, "source": self.default_source}
        return out


def _option_kind(config_cls, name: str) -> type | None:
    """int/float/bool/str from the config field's default; None (any scalar) when it has none."""
    default = next(f.default for f in dataclasses.fields(config_cls) if f.name == name)
    if default is dataclasses.MISSING or default is None:
        return None
    return type(default) if isinstance(default, (bool, int, float, str)) else None


def load_method_space(path: str | Path) -> MethodSpace:
    from peftune import methods

    path = Path(path)
    data = read_yaml(path)
    allowed = {"method", "lr", "dropout", "weight_decay", "options", "description", "default"}
    unknown = sorted(set(data) - allowed, key=str)
    if unknown:
        raise SpaceError(path, unknown[0], f"unknown key; expected {', '.join(sorted(allowed))}")
    if not isinstance(data.get("description", ""), str):
        raise SpaceError(path, "description", "expected text")
    name = data.get("method")
    if not isinstance(name, str):
        raise SpaceError(path, "method", f"expected the method's name, got {_show(name)}")
    if name not in methods.method_names():
        raise SpaceError(
            path, "method", f"unknown method {_show(name)}; valid methods: {', '.join(methods.method_names())}"
        )
    if path.stem != name:
        raise SpaceError(path, "method", f"{_show(name)} does not match the file name {path.name!r}")
    spec = methods.get_method(name)

    common = {}
    for key in _COMMON:
        if key not in data:
            raise SpaceError(path, key, "missing (every method space searches or fixes lr, dropout, weight_decay)")
        param = parse_param(path, key, data[key], float)
        for value in param.values():
            interval = _out_of_range(key, value)
            if interval:
                raise SpaceError(path, key, f"{_show(value)} is out of range; expected values in {interval}")
        common[key] = param

    raw_options = {} if data.get("options") is None else data["options"]
    if not isinstance(raw_options, dict):
        raise SpaceError(path, "options", f"expected a mapping of {name}'s config fields, got {_show(raw_options)}")
    valid = [f.name for f in dataclasses.fields(spec.config_cls) if f.name != "dropout"]
    options = {}
    for key, raw in raw_options.items():
        if key == "dropout":
            raise SpaceError(path, "options.dropout", "the method's dropout is the top-level `dropout`")
        if key not in valid:
            raise SpaceError(
                path, f"options.{key}", f"method {_show(name)} has no option {key!r}; valid: {', '.join(valid)}"
            )
        options[key] = parse_param(path, f"options.{key}", raw, _option_kind(spec.config_cls, key))
    if spec.size_field and spec.size_field not in options:
        raise SpaceError(
            path,
            f"options.{spec.size_field}",
            f"missing: the size of {_show(name)} ({spec.size_field}) must be searched or fixed",
        )
    # every value the space can propose must make a valid config
    for key, param in options.items():
        for value in param.values():
            try:
                methods.make_method_config(name, {key: value})
            except (ValueError, TypeError) as error:
                raise SpaceError(
                    path, f"options.{key}", f"{_show(value)} is refused by {_show(name)}: {error}"
                ) from None
    params = {**common, **options}
    default, default_source = parse_default(path, name, data.get("default"), params)
    return MethodSpace(
        name, common["lr"], common["dropout"], common["weight_decay"], options, str(path), default, default_source
    )


def parse_default(path, method: str, raw, params: dict[str, Param]) -> tuple[dict[str, Any], str]:
    """The ``default:`` block: the method's published setting and its ``source``.

    Its values may lie outside a searched range (the control arm is the published setting,
    not the nearest point of our space), but a choice must be one of its choices and every
    value must make a valid config. Parameters it leaves out are drawn by the sampler.
    """
    from peftune import methods

    if raw is None:
        return {}, ""
    if not isinstance(raw, dict) or not raw:
        raise SpaceError(path, "default", f"expected a mapping of parameters and a source, got {_show(raw)}")
    source = raw.get("source")
    if not isinstance(source, str) or not source.strip():
        raise SpaceError(path, "default.source", "missing: say where the default setting comes from")
    values = {}
    for key, value in raw.items():
        if key == "source":
            continue
        if key not in params:
            raise SpaceError(path, f"default.{key}", f"not a parameter of this space; expected {', '.join(params)}")
        param = params[key]
        kind = float if key in _COMMON else None
        value = _check_scalar(path, f"default.{key}", value, kind)
        if isinstance(value, float) and not math.isfinite(value):
            raise SpaceError(path, f"default.{key}", f"expected a finite number, got {value!r}")
        if isinstance(param, (Fixed, Choice)) and value not in param.values():
            raise SpaceError(path, f"default.{key}", f"{value!r} is not among {param.values()}")
        if key in _COMMON and _out_of_range(key, value):
            raise SpaceError(
                path,
                f"default.{key}",
                f"{_show(value)} is out of range; expected a value in {_out_of_range(key, value)}",
            )
        values[key] = value
    options = {k: v for k, v in values.items() if k not in _COMMON}
    try:
        methods.make_method_config(method, options)
    except (ValueError, TypeError) as error:
        raise SpaceError(path, "default", f"refused by {method!r}: {error}") from None
    return values, source.strip()


# ----------------------------------------------------------------------------- sweep definitions


@dataclass(frozen=True)
class Budget:
    """How much each trial trains, on how much data, and how many trials run."""

    num_samples: int
    epochs: int
    batch_size: int = 32
    max_length: int = 128
    max_train_examples: int | None = None  # per task, a seeded subset; None = all
    max_dev_examples: int | None = None
    # per task, the selection split (TPE, rungs, the epoch kept): train-file rows the trials do not train
    # on (peftune.data.carve); None: as many as the task's dev split
    selection_examples: int | None = None


@dataclass(frozen=True)
class SearchSettings:
    objective: str = "single"  # "single": max score; "multi": (max score, min trainable params per task)
    sampler: str = "tpe"  # TPE (single or multi-objective) or NSGA-II (multi-objective)
    n_startup_trials: int = 10  # random trials before TPE models the space
    # per_method: one seeded TPE study per method, num_samples split equally (±1) across the methods;
    # joint: one TPE over a categorical method (num_samples trials in all, shared as TPE likes)
    allocation: str = "per_method"
    # false (reproducible): a method's next trial starts once its earlier ones have reported, so the same
    # definition gives the same trials and stops whatever the timing; true: no waiting (big clusters)
    asynchronous: bool = False


@dataclass(frozen=True)
class SchedulerSettings:
    type: str = "asha"  # "asha" stops weak trials early; "none" runs every trial to the end
    grace_period: int = 1  # epochs every trial gets before ASHA may stop it (at most the budget's epochs)
    reduction_factor: int = 2
    min_steps: int = 0  # the floor: no trial is judged (compared at a rung) before this many optimizer steps
    # the rungs' unit: "epochs" (grace_period, then x reduction_factor) or "data": the fractions of the run's
    # training examples 1/rf^(rungs-1) ... 1/rf, 1 (rungs: 3, reduction_factor: 3 -> 1/9, 1/3, all)
    fidelity: str = "epochs"
    rungs: int = 3


@dataclass(frozen=True)
class Resources:
    cpus_per_trial: float = 1.0
    gpus_per_trial: float = 0.25  # used only where the cluster has GPUs: 4 PEFT trials share a GPU
    max_concurrent_trials: int | None = None  # None: as many as resources allow


@dataclass(frozen=True)
class ConfirmSettings:
    """Confirmation after the search: the best ``top_k`` configurations of every method, each re-trained
    with ``seeds`` new seeds at the full budget (``seeds: 0`` turns it off); ``defaults`` also confirms each
    method's default (control-arm) trial, so the tuning gain compares seed means on both sides."""

    top_k: int = 2
    seeds: int = 3
    defaults: bool = False
    # two configurations whose difference's 95% interval lies inside +-margin are "equivalent"
    margin: float = 0.01
    # while a decision of the report is inconclusive, its configurations get one more seed a round, up to
    # max_seeds each, and no new round starts after max_seconds of added seeds (null: no time cap)
    max_seeds: int = 10
    max_seconds: int | None = None


@dataclass(frozen=True)
class SweepDefinition:
    name: str
    tasks: tuple[str, ...]
    spaces: dict[str, MethodSpace]  # method name -> its space, in the order listed
    budget_name: str
    budget: Budget
    model: str = "all-minilm-l6-v2"
    seed: int = 0
    search: SearchSettings = field(default_factory=SearchSettings)
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    resources: Resources = field(default_factory=Resources)
    max_failures: int = 1  # retries of a failed trial (from its last checkpoint)
    checkpoints_per_method: int = 1  # best trials per method whose checkpoint goes to MLflow
    train: dict[str, Any] = field(default_factory=dict)  # fixed TrainConfig settings (warmup_ratio, sampling...)
    description: str = ""
    confirm: ConfirmSettings = field(default_factory=ConfirmSettings)  # for the chosen budget
    source: str = ""
    invalid_rows: str = "raise"  # a malformed data row stops the sweep (raise) or is dropped and recorded (skip)

    @property
    def methods(self) -> list[str]:
        return list(self.spaces)

    @property
    def multi_objective(self) -> bool:
        return self.search.objective == "multi"

    def to_dict(self) -> dict:
        """The resolved definition (chosen budget, method spaces inlined): what the sweep really ran."""
        return {
            "name": self.name,
            "description": self.description,
            "tasks": list(self.tasks),
            "methods": self.methods,
            "model": self.model,
            "seed": self.seed,
            "budget": self.budget_name,
            **{f"budget_{k}": v for k, v in dataclasses.asdict(self.budget).items()},
            "search": dataclasses.asdict(self.search),
            "scheduler": dataclasses.asdict(self.scheduler),
            "resources": dataclasses.asdict(self.resources),
            "max_failures": self.max_failures,
            "checkpoints_per_method": self.checkpoints_per_method,
            "train": dict(self.train),
            "confirm": dataclasses.asdict(self.confirm),
            "invalid_rows": self.invalid_rows,
            "spaces": {name: space.to_yaml() for name, space in self.spaces.items()},
        }

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def fingerprint(self) -> str:
        """What must not change when a sweep resumes (everything but the description)."""
        data = {k: v for k, v in self.to_dict().items() if k != "description"}
        return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def with_overrides(
        self,
        *,
        name: str | None = None,
        model: str | None = None,
        multi_objective: bool | None = None,
        invalid_rows: str | None = None,
        **budget,
    ) -> SweepDefinition:
        """A copy with another name/model/data policy, the multi-objective search (no scheduler), or budget fields."""
        changes: dict[str, Any] = {}
        if invalid_rows is not None:
            changes["invalid_rows"] = _check_invalid_rows(self.source, "invalid_rows", invalid_rows)
        if name is not None:
            _check_name(self.source, "name", name)
            changes["name"] = name
        if model is not None:
            changes["model"] = model
        if multi_objective:
            changes["search"] = dataclasses.replace(self.search, objective="multi")
            changes["scheduler"] = SchedulerSettings(type="none")
        elif multi_objective is False and self.multi_objective:
            changes["search"] = dataclasses.replace(self.search, objective="single")
        if budget:
            unknown = sorted(set(budget) - {f.name for f in dataclasses.fields(Budget)}, key=str)
            if unknown:
                raise UserError(f"unknown budget field {unknown[0]!r}")
            changes["budget"] = _check_budget(self.source, "budget", dataclasses.replace(self.budget, **budget))
        return dataclasses.replace(self, **changes)


_SWEEP_KEYS = {
    "name",
    "description",
    "tasks",
    "methods",
    "model",
    "seed",
    "search",
    "scheduler",
    "resources",
    "max_failures",
    "checkpoints_per_method",
    "train",
    "budget",
    "budgets",
    "confirm",
    "invalid_rows",
}


def _check_invalid_rows(path, key: str, value) -> str:
    from peftune.data import INVALID_ROW_POLICIES

    if value not in INVALID_ROW_POLICIES:
        raise SpaceError(path, key, f"expected one of {', '.join(INVALID_ROW_POLICIES)}, got {_show(value)}")
    return value


def _section(path, raw, key: str, cls):
    """A nested mapping -> dataclass; unknown keys and wrong types named as `key.field`."""
    raw = {} if raw is None else raw  # `search: false` is a mistake, not the defaults
    if not isinstance(raw, dict):
        raise SpaceError(path, key, f"expected a mapping, got {_show(raw)}")
    kinds = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for name, value in raw.items():
        if name not in kinds:
            raise SpaceError(path, f"{key}.{name}", f"unknown key; expected one of {', '.join(kinds)}")
        default = kinds[name].default
        nullable = default is None or "None" in str(kinds[name].type)
        if value is None and nullable:
            values[name] = None
            continue
        kind = type(default) if default not in (None, dataclasses.MISSING) else int
        if kind is float and _is_number(value):
            value = float(value)
            if not math.isfinite(value):
                raise SpaceError(path, f"{key}.{name}", f"expected a finite number, got {_show(value)}")
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise SpaceError(
                path,
                f"{key}.{name}",
                f"expected {'a' if kind is not int else 'an'} "
                f"{kind.__name__}{' or null' if nullable else ''}, got {_got(value)}",
            )
        values[name] = value
    for name, spec in kinds.items():
        if spec.default is dataclasses.MISSING and name not in values:
            raise SpaceError(path, f"{key}.{name}", "missing")
    return cls(**values)


def _check_fidelity(path, scheduler: SchedulerSettings) -> None:
    if scheduler.fidelity not in FIDELITIES:
        raise SpaceError(path, "scheduler.fidelity", f"{scheduler.fidelity!r}; expected one of {FIDELITIES}")
    _positive_int(path, "scheduler.rungs", scheduler.rungs)
    if scheduler.rungs > 6:
        raise SpaceError(path, "scheduler.rungs", f"expected at most 6 rungs, got {scheduler.rungs}")


def _check_allocation(path, search: SearchSettings) -> None:
    if search.allocation not in ALLOCATIONS:
        raise SpaceError(path, "search.allocation", f"{search.allocation!r}; expected one of {ALLOCATIONS}")


def _check_trial_device(path, device: str, resources: Resources) -> None:
    """``train.device`` as a trial sees it (its form is TrainConfig's check): Ray shows a trial only the GPUs it
    was given, numbered from 0, so ``cuda:1`` with ``gpus_per_trial: 0.25`` (or ``cuda:99``) never exists there."""
    import torch

    if device == "auto" or torch.device(device).type != "cuda" or torch.device(device).index is None:
        return
    visible = max(1, math.ceil(resources.gpus_per_trial))
    if torch.device(device).index >= visible:
        raise SpaceError(
            path,
            "train.device",
            f"{_show(device)}: a trial sees only the GPU(s) Ray gives it, cuda:0 to cuda:{visible - 1} with "
            f"resources.gpus_per_trial {resources.gpus_per_trial:g}; expected cuda or auto",
        )


def _check_name(path, key: str, name) -> str:
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}", name):
        raise SpaceError(path, key, f"expected a name of letters, digits, '_', '-', '.', got {_show(name)}")
    return name


def _positive_int(path, key: str, value, *, allow_none: bool = False, minimum: int = 1, maximum=None):
    """An integer >= ``minimum`` (or None with ``allow_none``); ``maximum``: (bound, why), one of :data:`_MAXIMA`."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpaceError(
            path, key, f"expected an integer >= {minimum}{' or null' if allow_none else ''}, got {_got(value)}"
        )
    if maximum is not None and value > maximum[0]:
        bound, why = maximum
        raise SpaceError(path, key, f"expected an integer from {minimum} to {bound:,} ({why}), got {value:,}")
    return value


# upper bounds of a sweep's counts, and why: beyond them a value is a typo, not a plan
MAX_LENGTH = 512  # BERT's position embeddings; `peftune train --max-length` has the same bound
_MAXIMA = {
    "num_samples": (100_000, "a sane bound on a sweep's trials"),
    "epochs": (1_000, "a sane bound on a trial's epochs"),
    "batch_size": (8_192, "a sane bound on a batch"),
    "max_length": (MAX_LENGTH, "BERT's position embeddings"),
    "seeds": (1_000, "a sane bound on the seeds per configuration"),
}


def _check_budget(path, key: str, budget: Budget) -> Budget:
    for name in ("num_samples", "epochs", "batch_size"):
        _positive_int(path, f"{key}.{name}", getattr(budget, name), maximum=_MAXIMA[name])
    _positive_int(path, f"{key}.max_length", budget.max_length, minimum=8, maximum=_MAXIMA["max_length"])
    for name in ("max_train_examples", "max_dev_examples", "selection_examples"):
        _positive_int(path, f"{key}.{name}", getattr(budget, name), allow_none=True)
    return budget


def load_sweep(path: str | Path, budget: str | None = None, spaces_dir: str | Path | None = None) -> SweepDefinition:
    """Read and validate a sweep definition; ``budget`` picks a preset (default: the file's ``budget``)."""
    from peftune import methods
    from peftune.train import TrainConfig

    path = Path(path)
    data = read_yaml(path)
    unknown = sorted(set(data) - _SWEEP_KEYS, key=str)
    if unknown:
        raise SpaceError(path, unknown[0], f"unknown key; expected one of {', '.join(sorted(_SWEEP_KEYS))}")
    name = _check_name(path, "name", data.get("name"))
    description = data.get("description", "")
    if not isinstance(description, str):
        raise SpaceError(path, "description", "expected text")

    raw_tasks = data.get("tasks")
    if not isinstance(raw_tasks, list) or not raw_tasks:
        raise SpaceError(path, "tasks", f"expected a non-empty list of task names, got {_show(raw_tasks)}")
    from peftune.tasks import task_names

    for i, task in enumerate(raw_tasks):
        if task not in task_names():
            raise SpaceError(path, f"tasks[{i}]", f"unknown task {_show(task)}; valid tasks: {', '.join(task_names())}")
    if len(set(raw_tasks)) != len(raw_tasks):
        raise SpaceError(path, "tasks", f"a task is listed twice in {_show(raw_tasks)}")

    raw_methods = data.get("methods")
    if not isinstance(raw_methods, list) or not raw_methods:
        raise SpaceError(path, "methods", f"expected a non-empty list of method names, got {_show(raw_methods)}")
    if len(set(map(str, raw_methods))) != len(raw_methods):
        raise SpaceError(path, "methods", f"a method is listed twice in {_show(raw_methods)}")
    spaces_dir = Path(spaces_dir) if spaces_dir is not None else path.parent / METHODS_SUBDIR
    spaces = {}
    for i, method in enumerate(raw_methods):
        if method not in methods.method_names():
            raise SpaceError(
                path,
                f"methods[{i}]",
                f"unknown method {_show(method)}; valid methods: {', '.join(methods.method_names())}",
            )
        space_file = spaces_dir / f"{method}.yaml"
        if not space_file.is_file():
            raise SpaceError(path, f"methods[{i}]", f"no search space for {_show(method)}: {space_file} not found")
        spaces[method] = load_method_space(space_file)

    model = data.get("model", "all-minilm-l6-v2")
    if not isinstance(model, str) or not model:
        raise SpaceError(path, "model", f"expected a model name or directory, got {_show(model)}")
    seed = _positive_int(path, "seed", data.get("seed", 0), minimum=0)
    if seed > MAX_SEED:
        raise SpaceError(
            path, "seed", f"expected an integer in [0, {MAX_SEED}] (numpy's and torch's range), got {seed}"
        )
    max_failures = _positive_int(path, "max_failures", data.get("max_failures", 1), minimum=0)
    top_n = _positive_int(path, "checkpoints_per_method", data.get("checkpoints_per_method", 1), minimum=0)
    invalid_rows = _check_invalid_rows(path, "invalid_rows", data.get("invalid_rows", "raise"))

    search = _section(path, data.get("search"), "search", SearchSettings)
    if search.objective not in OBJECTIVES:
        raise SpaceError(path, "search.objective", f"{search.objective!r}; expected one of {OBJECTIVES}")
    if search.sampler not in SAMPLERS:
        raise SpaceError(path, "search.sampler", f"{search.sampler!r}; expected one of {SAMPLERS}")
    if search.sampler == "nsga2" and search.objective != "multi":
        raise SpaceError(path, "search.sampler", "nsga2 is for objective: multi; use tpe")
    _positive_int(path, "search.n_startup_trials", search.n_startup_trials)
    _check_allocation(path, search)
    scheduler = _section(path, data.get("scheduler"), "scheduler", SchedulerSettings)
    if scheduler.type not in SCHEDULERS:
        raise SpaceError(path, "scheduler.type", f"{scheduler.type!r}; expected one of {SCHEDULERS}")
    if scheduler.type == "asha" and search.objective == "multi":
        raise SpaceError(path, "scheduler.type", "ASHA takes one metric: a multi-objective search needs type: none")
    _positive_int(path, "scheduler.grace_period", scheduler.grace_period)
    _positive_int(path, "scheduler.reduction_factor", scheduler.reduction_factor, minimum=2)
    _positive_int(path, "scheduler.min_steps", scheduler.min_steps, minimum=0)
    _check_fidelity(path, scheduler)
    resources = _section(path, data.get("resources"), "resources", Resources)
    if not resources.cpus_per_trial > 0:
        raise SpaceError(path, "resources.cpus_per_trial", f"expected > 0, got {resources.cpus_per_trial}")
    if not 0 < resources.gpus_per_trial <= 8:
        raise SpaceError(
            path, "resources.gpus_per_trial", f"expected a GPU fraction in (0, 8], got {resources.gpus_per_trial}"
        )
    _positive_int(path, "resources.max_concurrent_trials", resources.max_concurrent_trials, allow_none=True)

    train = {} if data.get("train") is None else data["train"]
    if not isinstance(train, dict):
        raise SpaceError(path, "train", f"expected a mapping of training settings, got {_show(train)}")
    train_fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for key, value in train.items():
        if key in _TRAIN_FIELDS_SET_ELSEWHERE:
            raise SpaceError(path, f"train.{key}", "set by the search space, the budget or the top level, not here")
        if key not in train_fields:
            settable = sorted(set(train_fields) - _TRAIN_FIELDS_SET_ELSEWHERE, key=str)
            raise SpaceError(path, f"train.{key}", f"unknown training setting; expected one of {', '.join(settable)}")
        kind = type(train_fields[key].default)
        if not (isinstance(value, kind) or (kind is float and _is_number(value))) or isinstance(value, bool) != (
            kind is bool
        ):
            raise SpaceError(path, f"train.{key}", f"expected a {kind.__name__}, got {_got(value)}")
    try:  # the fixed settings must make a valid TrainConfig
        TrainConfig(method=raw_methods[0], tasks=list(raw_tasks), **train)
    except (ValueError, TypeError) as error:
        field_name = re.match(r"TrainConfig\.(\w+)", str(error))  # name the key: train.<field>
        key = f"train.{field_name.group(1)}" if field_name and field_name.group(1) in train else "train"
        raise SpaceError(path, key, str(error)) from None
    _check_trial_device(path, train.get("device", "auto"), resources)

    budgets = data.get("budgets")
    if not isinstance(budgets, dict) or not budgets:
        raise SpaceError(path, "budgets", "expected a mapping of named presets, e.g. smoke: {num_samples: 2, ...}")
    parsed_budgets = {}
    for preset in budgets:
        if not isinstance(preset, str):  # `1:` is the integer 1, which `--budget 1` (a string) never names
            raise SpaceError(path, f"budgets.{preset}", f"expected a preset name (text), got {_show(preset)}")
        parsed = _section(path, budgets[preset], f"budgets.{preset}", Budget) if budgets[preset] else None
        if parsed is None:
            raise SpaceError(path, f"budgets.{preset}", "empty preset")
        parsed_budgets[preset] = _check_budget(path, f"budgets.{preset}", parsed)
    chosen = budget if budget is not None else data.get("budget")
    if chosen is None:
        raise SpaceError(path, "budget", f"no budget chosen; presets: {', '.join(parsed_budgets)}")
    if not isinstance(chosen, str) or chosen not in parsed_budgets:
        key = "budget" if budget is None else "budgets"
        raise SpaceError(path, key, f"no budget preset {_show(chosen)}; presets: {', '.join(parsed_budgets)}")

    confirm = _confirm_section(path, data.get("confirm"), chosen, parsed_budgets)
    return SweepDefinition(
        name=name,
        tasks=tuple(raw_tasks),
        spaces=spaces,
        budget_name=chosen,
        budget=parsed_budgets[chosen],
        model=model,
        seed=seed,
        search=search,
        scheduler=scheduler,
        resources=resources,
        max_failures=max_failures,
        checkpoints_per_method=top_n,
        train=dict(train),
        description=description,
        source=str(path),
        confirm=confirm,
        invalid_rows=invalid_rows,
    )


def _confirm_section(path, raw, budget: str, presets) -> ConfirmSettings:
    """``confirm: {top_k, seeds, defaults, by_budget: {<preset>: {...}}}`` resolved for ``budget``.

    ``by_budget`` lets a small preset (smoke) confirm less than the full one, in the same file.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SpaceError(path, "confirm", f"expected a mapping, got {_show(raw)}")
    raw = dict(raw)
    by_budget = raw.pop("by_budget", None)
    by_budget = {} if by_budget is None else by_budget  # '' or 0 is a mistake, not "no overrides"
    if not isinstance(by_budget, dict):
        raise SpaceError(path, "confirm.by_budget", f"expected a mapping of budget presets, got {_show(by_budget)}")
    settings = _checked_confirm(path, "confirm", _section(path, raw, "confirm", ConfirmSettings))
    for preset, override in by_budget.items():
        key = f"confirm.by_budget.{preset}"
        if preset not in presets:
            raise SpaceError(path, key, f"no budget preset {preset!r}; presets: {', '.join(presets)}")
        parsed = _checked_confirm(path, key, _section(path, override, key, ConfirmSettings))
        if preset == budget:
            settings = dataclasses.replace(settings, **{k: getattr(parsed, k) for k in override or {}})
    return settings


def _checked_confirm(path, key: str, settings: ConfirmSettings) -> ConfirmSettings:
    _positive_int(path, f"{key}.top_k", settings.top_k, minimum=0)
    _positive_int(path, f"{key}.seeds", settings.seeds, minimum=0, maximum=_MAXIMA["seeds"])
    _positive_int(
        path, f"{key}.max_seeds", settings.max_seeds, minimum=max(settings.seeds, 1), maximum=_MAXIMA["seeds"]
    )
    _positive_int(path, f"{key}.max_seconds", settings.max_seconds, allow_none=True)
    if not 0.0 < settings.margin < 1.0:  # a score lies in [0, 1]: a margin of 1 calls everything equivalent
        raise SpaceError(path, f"{key}.margin", f"expected a number in (0, 1), got {_show(settings.margin)}")
    return settings


def resolve_sweep_path(name_or_path: str | Path) -> Path:
    """``sst_tuning`` -> search_spaces/sst_tuning.yaml; a path is taken as is."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return path
    return SEARCH_SPACES_DIR / f"{name_or_path}.yaml"


def shipped_files() -> list[Path]:
    """Every YAML file under search_spaces/ (method spaces and sweep definitions)."""
    return sorted(SEARCH_SPACES_DIR.rglob("*.yaml"))


# ----------------------------------------------------------------------------- the Optuna space


class ConditionalSpace:
    """Optuna define-by-run space: a categorical ``method``, then that method's own parameters only.

    Parameter names are ``<method>/<param>`` (``lora/lr``, ``lora/rank``), so TPE models each
    method's learning rate separately (full fine-tuning and prompt tuning want lr decades apart)
    and Ray unflattens the config to ``{"method": "lora", "lora": {"lr": ..., "rank": ...}}``.
    A plain module-level class, not a closure: Ray pickles the searcher with the experiment.
    """

    def __init__(self, spaces: dict[str, MethodSpace]):
        self.spaces = dict(spaces)

    def __call__(self, trial) -> dict[str, Any]:
        method = trial.suggest_categorical("method", list(self.spaces))
        constants = {}
        for name, param in self.spaces[method].params().items():
            key = f"{method}/{name}"
            if isinstance(param, Fixed):
                constants[key] = param.value  # returned, not suggested: Optuna has nothing to learn
            else:
                param.suggest(trial, key)
        return constants


def sampled_settings(config: dict) -> tuple[str, dict[str, Any]]:
    """A trial's config (as Ray gives it) -> (method, {lr, dropout, weight_decay, <options>})."""
    method = config["method"]
    return method, dict(config.get(method) or {})
