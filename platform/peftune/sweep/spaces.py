"""Search spaces and sweep definitions: YAML files -> dataclasses validated by pydantic.

A method's search space, ``methods/<method>.yaml``, holds ``lr``, ``dropout``, ``weight_decay``, the method's
``options`` (its size required) and a ``default`` (the published setting and its ``source``: its first trial),
each a plain value (fixed), ``{low, high[, log][, step]}`` or ``{choices: [...]}`` that the method's config takes.
A sweep definition (``sst_tuning.yaml`` comments each key) is a :class:`SweepFile`; :func:`load_sweep` resolves
it to a :class:`SweepDefinition`. Each rule is a type or validator, written once (see :mod:`peftune.base.validation`).
"""

import dataclasses
import hashlib
import importlib.resources
import json
import logging
import math
import re
from pathlib import Path
from typing import Annotated, Any

import torch
import yaml
from pydantic import AfterValidator, Field, SkipValidation, StrictBool, StrictInt, StrictStr, TypeAdapter

from peftune import methods
from peftune.base import validation
from peftune.base.errors import PeftuneError
from peftune.base.record_names import HYPERPARAMETERS, SCORE, TRAINABLE_PER_TASK
from peftune.base.validation import (
    EMPTY,
    Bound,
    Section,
    SpaceError,
    at,
    count,
    fail,
    named,
    one_of,
    rule,
    section,
    show,
)
from peftune.core import train
from peftune.core.train import RATES, SEED, TrainConfig
from peftune.inputs.backbone import DEFAULT_MODEL, BertConfig
from peftune.inputs.data import DEFAULT_MAX_LENGTH, INVALID_ROW_POLICIES, DataSettings
from peftune.inputs.tasks import is_task_file, resolve_tasks, task_names
from peftune.record import legacy

log = logging.getLogger("peftune.sweep.spaces")

# package data, installed as files (a directory); in a source tree, a link to the top-level search_spaces/
SEARCH_SPACES_DIR = Path(str(importlib.resources.files("peftune") / "search_spaces")).resolve()
METHODS_SUBDIR = "methods"
MULTI_OBJECTIVE = ((SCORE, "max"), (TRAINABLE_PER_TASK, "min"))  # what a multi-objective search optimises
# TrainConfig fields a sweep sets elsewhere (searched, budget, top level), as it does those without a plain default
_SET_ELSEWHERE = {"method", *HYPERPARAMETERS, "epochs", "batch_size", "seed"}
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$"  # anchored: JSON Schema searches
_Name = Annotated[StrictStr, rule(lambda v: re.fullmatch(NAME_PATTERN, v), "expected a name of letters, digits, "
                  "'_', '-', '.', got {}"), Field(json_schema_extra={"pattern": NAME_PATTERN})]  # fmt: skip
_Preset = Annotated[str, rule(lambda v: isinstance(v, str), "expected a preset name (text), got {}", before=True)]
_SEEDS = Bound(0, 1_000, "a sane bound on the seeds per configuration")
# what every method searches, in what interval (upper bounds: beyond them a trial only diverges or forgets)
_COMMON = {key: RATES[key] for key in HYPERPARAMETERS}  # TrainConfig's own intervals


@section()
class Fixed:
    value: Any
    """the value, not searched: the define-by-run space returns it as a constant"""


@section()
class _Range(Section):
    def __post_init__(self):
        if not self.low < self.high:
            what = "empty" if self.low == self.high else "inverted"
            fail(f"{what} range: low ({self.low}) must be < high ({self.high}); use a plain value to fix it")
        if self.log and self.low <= 0:
            fail(f"a log range needs low > 0, got {self.low}", "low")

    def suggest(self, trial, name: str):
        if isinstance(self, IntRange):
            return trial.suggest_int(name, self.low, self.high, step=self.step, log=self.log)
        return trial.suggest_float(name, self.low, self.high, log=self.log)


@section()
class FloatRange(_Range):
    low: validation.Float
    """the range's low end"""
    high: validation.Float
    """its high end"""
    log: StrictBool = False
    """sampled on a log scale (low > 0)"""


@section()
class IntRange(_Range):
    low: StrictInt
    """the range's low end"""
    high: StrictInt
    """its high end (included)"""
    log: StrictBool = False
    """sampled on a log scale (low > 0)"""
    step: count(1, 1_000_000_000, "a sane bound on a step") = 1
    """the spacing of the values from low (high - low a multiple of it)"""

    def __post_init__(self):
        super().__post_init__()
        if self.step != 1 and self.log:
            fail("an integer range takes either log: true or a step, not both", "step")
        if (self.high - self.low) % self.step:
            fail(f"high - low ({self.high - self.low}) is not a multiple of step ({self.step})", "step")


@section()
class Choice(Section):
    choices: Annotated[tuple, rule(len, "expected a non-empty list of choices"),
                       rule(lambda c: not any(isinstance(v, (dict, list)) or v is None for v in c),
                            "choices must be plain numbers, strings or booleans, got {}"),
                       rule(lambda c: len(set(c)) == len(c), "a value is listed twice in {}")]  # fmt: skip
    """the values searched: plain numbers, strings or booleans, each once"""

    def suggest(self, trial, name: str):
        return trial.suggest_categorical(name, list(self.choices))


Param = Fixed | FloatRange | IntRange | Choice
_KINDS = {kind: TypeAdapter(t) for kind, t in validation.SCALARS.items()}  # a value of a field of this type
_LISTS = {kind: TypeAdapter(list[t]) for kind, t in validation.SCALARS.items()}


def proposed_values(param: Param) -> list:
    """What a parameter can propose at its extremes (a range's ends, every choice): every value must make a valid
    config, and (``sweep_command.check_spaces_against_model``) fit the model."""
    return [param.value] if isinstance(param, Fixed) else list(getattr(param, "choices", ()) or (param.low, param.high))


def _parse_param(raw, kind: type | None = None) -> Param:
    """A plain value, ``{low, high[, log][, step]}`` or ``{choices: [...]}`` of ``kind``'s values (None: any)."""
    if not isinstance(raw, dict):
        if isinstance(raw, list) and kind is not None:
            fail("a list is not a parameter; write {choices: [...]} to search over values")
        return Fixed(_KINDS[kind].validate_python(raw))
    if "choices" in raw:  # only `choices`, a list of distinct plain values, each of the field's type
        choices = TypeAdapter(Choice).validate_python(raw).choices
        return Choice(choices=tuple(at(("choices",), _LISTS[kind].validate_python, list(choices))))
    if kind not in (None, int, float):
        fail(f"a {kind.__name__} option cannot take a range; use a value or {{choices: [...]}}")
    integer = kind is int or (kind is None and all(type(raw.get(bound)) is int for bound in ("low", "high")))
    if not integer and "step" in raw:
        fail("step applies to integer ranges only", "step")
    return TypeAdapter(IntRange if integer else FloatRange).validate_python(raw)


def _to_yaml(param: Param):
    """A parameter as written: its fields that differ from their defaults."""
    if isinstance(param, Fixed):
        return param.value
    fields = {f.name: f.default for f in dataclasses.fields(param)}
    return {k: list(v) if k == "choices" else v for k, d in fields.items() if (v := getattr(param, k)) != d}


@section()
class _MethodFile(Section):
    """A method's search space as written; its parameters are parsed once the method's fields are known."""

    method: one_of(methods.method_names, "method")
    """the method, also the file's name (`<method>.yaml`)"""
    lr: Any
    """the learning rate: a value, a range or choices"""
    dropout: Any
    """the dropout of the heads and of the method's own modules"""
    weight_decay: Any
    """AdamW's weight decay"""
    options: Annotated[dict[Any, Any], EMPTY] = dataclasses.field(default_factory=dict)
    """the method's own options (its size required), each a value, a range or choices"""
    description: StrictStr = ""
    """free text, shown with the method"""
    default: dict[Any, Any] | None = None
    """the published setting, the method's first trial, with its `source` (a paper, a report)"""


@dataclasses.dataclass(frozen=True)
class MethodSpace:
    """The search space of one method: lr, dropout, weight decay and the method's own options."""

    method: str
    lr: Param
    dropout: Param
    weight_decay: Param
    options: dict[str, Param] = dataclasses.field(default_factory=dict)
    source: str = ""
    default: dict[str, Any] = dataclasses.field(default_factory=dict)  # the published setting: the first trial
    default_source: str = ""  # where the default comes from (paper, report)

    def params(self) -> dict[str, Param]:
        return {**{key: getattr(self, key) for key in HYPERPARAMETERS}, **self.options}

    def to_yaml(self) -> dict:
        out = {"method": self.method, **{key: _to_yaml(self.params()[key]) for key in _COMMON}}
        if self.options:
            out["options"] = {k: _to_yaml(v) for k, v in self.options.items()}
        return {**out, "default": {**self.default, "source": self.default_source}} if self.default else out


def _config(method: str, options: dict, *loc, refused: str) -> None:
    """The method's config accepts ``options``: its own checks are the rules of its fields."""
    try:
        methods.make_method_config(method, options)
    except (ValueError, TypeError) as error:
        fail(f"{refused} by {method!r}: {error}", *loc)


def load_method_space(path: str | Path) -> MethodSpace:
    path = Path(path)
    with named(path):
        space = TypeAdapter(_MethodFile).validate_python(validation.read_yaml(path))
        if path.stem != space.method:
            fail(f"{show(space.method)} does not match the file name {path.name!r}", "method")
        spec = methods.get_method(space.method)
        params = {key: at((key,), _parse_param, getattr(space, key), float) for key in _COMMON}
        for key, value in ((key, value) for key, param in params.items() for value in proposed_values(param)):
            at((key,), _COMMON[key].check, value)
        kinds = {f.name: type(f.default) if isinstance(f.default, (bool, int, float, str)) else None
                 for f in dataclasses.fields(spec.config_cls) if f.name != "dropout"}  # fmt: skip
        for key, raw in space.options.items():
            if key == "dropout":
                fail("the method's dropout is the top-level `dropout`", "options", key)
            if key not in kinds:
                fail(f"method {space.method!r} has no option {key!r}; valid: {', '.join(kinds)}", "options", key)
            params[key] = at(("options", key), _parse_param, raw, kinds[key])
            for value in proposed_values(params[key]):  # a space never proposes a configuration the method refuses
                _config(space.method, {key: value}, "options", key, refused=f"{show(value)} is refused")
        if spec.size_field and spec.size_field not in params:
            size = f"the size of {space.method!r} ({spec.size_field})"
            fail(f"missing: {size} must be searched or fixed", "options", spec.size_field)
        default, source = _parse_default(space, params) if space.default is not None else ({}, "")
    options = {k: v for k, v in params.items() if k not in _COMMON}
    return MethodSpace(space.method, *(params[k] for k in _COMMON), options, str(path), default, source)


def _parse_default(space: _MethodFile, params: dict[str, Param]) -> tuple[dict[str, Any], str]:
    """``default:``, the published setting (the control arm: a value may lie outside a searched range, but a choice
    is one of its choices and the config takes every value) and its ``source``; the sampler draws the rest."""
    source = space.default.get("source")
    if not isinstance(source, str) or not source.strip():
        fail("missing: say where the default setting comes from", "default", "source")
    values = {}
    for key, value in ((k, v) for k, v in space.default.items() if k != "source"):
        if key not in params:
            fail(f"not a parameter of this space; expected {', '.join(params)}", "default", key)
        values[key] = value = at(("default", key), _KINDS[float if key in _COMMON else None].validate_python, value)
        if isinstance(params[key], Fixed | Choice) and value not in proposed_values(params[key]):
            fail(f"{value!r} is not among {proposed_values(params[key])}", "default", key)
        if key in _COMMON:
            at(("default", key), _COMMON[key].check, value)
    _config(space.method, {k: v for k, v in values.items() if k not in _COMMON}, "default", refused="refused")
    return values, source.strip()


# ----------------------------------------------------------------------------- sweep definitions


SPLIT = "a sane bound on a split"


@section()
class Budget(Section):
    """How much each trial trains, on how much data, and how many trials each method runs."""

    trials_per_method: count(1, 100_000, "a sane bound on a method's trials")
    """each method's trials (its default first): a method added to a sweep brings its own, taking none from the
    others"""
    epochs: count(1, 1_000, "a sane bound on a trial's epochs")
    """epochs each trial trains (a confirmation run too)"""
    batch_size: count(1, 8_192, "a sane bound on a batch") = 32
    """examples per training batch"""
    max_length: count(8, BertConfig.max_position_embeddings, "BERT's position embeddings") = DEFAULT_MAX_LENGTH
    """tokens per sequence (a sentence pair together), longer ones truncated"""
    max_train_examples: count(1, 100_000_000, SPLIT) | None = None
    """per task, a seeded subset of the train rows; null: all"""
    max_dev_examples: count(1, 100_000_000, SPLIT) | None = None
    """per task, a seeded subset of the dev rows; null: all"""
    selection_examples: count(1, 100_000_000, SPLIT) | None = None
    """per task, train rows that judge the trials (null: as dev)"""

    @classmethod
    def renamed_keys(cls) -> dict[str, str]:
        return legacy.RENAMED_BUDGET_KEYS  # num_samples, before trials_per_method

    decision_examples: count(0, 1_000_000, SPLIT) = 0
    """per task, further train rows the confirmation decides on (the best per budget, a cheaper one not worse,
    which configurations get more seeds); dev only reports. 0: none (the confirmation then decides nothing)"""


@section()
class SearchSettings(Section):
    objective: one_of(("single", "multi")) = "single"
    """single: max score; multi: (max score, min trainable params per task)"""
    sampler: one_of(("tpe", "nsga2")) = "tpe"
    """TPE (single or multi-objective) or NSGA-II (multi-objective)"""
    n_startup_trials: count(1, 100_000, "at most a sweep's trials") = 10
    """random trials before TPE models the space"""
    allocation: one_of(("per_method", "joint")) = "per_method"
    """a TPE study per method (equal trials), or one for all the methods"""
    asynchronous: StrictBool = False
    """false: a method's trial waits for its earlier ones (reproducible)"""
    unit: one_of(("trials", "steps", "tokens")) = "trials"
    """per_method's equal share: trials_per_method trials, or that many full trials' worth of optimizer steps or of
    training tokens (a trial stopped early leaves its method budget for more; a long prompt buys fewer trials)"""


@section()
class SchedulerSettings(Section):
    type: one_of(("asha", "none")) = "asha"
    """`asha` stops weak trials early; `none` runs every trial to the end"""
    grace_period: count(1, 1_000, "at most a trial's epochs") = 1
    """epochs every trial gets before ASHA may stop it (at most the budget's epochs)"""
    reduction_factor: count(2, 1_000, "a sane bound on a rung's cut") = 2
    """ASHA's cut: 1 in this many trials of a rung goes on to the next"""
    min_steps: count(0, 1_000_000_000, "a sane bound on a trial's steps") = 0
    """no trial is judged (compared at a rung) before this many optimizer steps"""
    fidelity: one_of(("epochs", "data")) = "epochs"
    """the rungs' unit; data: 1/rf^(rungs-1) ... 1/rf, 1 of it"""
    rungs: count(1, 6, "a sane bound on the rungs") = 3
    """the number of rungs (with `fidelity: data`, the fractions of the run at which trials are compared)"""


@section()
class Resources(Section):
    cpus_per_trial: Bound(0.0, 1024.0, "a sane bound on a node's CPUs", low_open=True).annotated(integer=False) = 1.0
    """CPUs Ray gives each trial (also its torch threads)"""
    gpus_per_trial: Bound(0.0, 8.0, "a GPU fraction", low_open=True).annotated(integer=False) = 0.25
    """the GPU fraction each trial asks for where the cluster has GPUs (0.25: four trials a GPU)"""
    max_concurrent_trials: count(1, 100_000, "at most a sweep's trials") | None = None
    """trials running at once; null: as many as resources allow"""
    pack_size: count(1, 64, "a sane bound on a pack's members") = 1
    """search trials of lora, bitfit and adapter trained K at a time over one frozen backbone (peftune.sweep.packing);
    1: never"""
    pack_wait_s: Bound(0.0, 600.0, "ten minutes").annotated(integer=False) = 10.0
    """a cohort's wait for its members, in seconds"""


@section()
class ConfirmSettings(Section):
    """What the confirmation re-trains after the search, on how much data, and how its decisions are made."""

    contenders: count(0, 1_000, "a sane bound on a budget's contenders") = 3
    """per budget (0.1%, 1%, 10% trainable), its best configurations by search score: the contenders it decides on"""
    anchors: StrictBool = True
    """frozen's and full fine-tuning's best too: the floor and the ceiling of the report"""
    top_k: count(0, 1_000, "a sane bound on a method's confirmed configurations") = 0
    """each method's best top_k configurations too"""
    seeds: _SEEDS.annotated() = 3
    """new seeds each confirmed configuration is trained with"""
    defaults: StrictBool = False
    """each method's default too (the tuning gain then compares seed means)"""
    train_examples: count(1, 100_000_000, SPLIT) | None = None
    """per task, the train rows a confirmation run trains on: null, every train row the selection and decision
    splits leave (the budget a user trains at); the search trains on the budget's max_train_examples of them"""
    margin: Bound(0.0, 1.0, low_open=True, high_open=True).annotated(integer=False) = 0.02
    """δ, the decisions' margin, in the score's units: the loss a user accepts for fewer trainable parameters (0.02:
    two points of accuracy). Never widened to reach a decision: a budget it cannot decide is said to be open"""
    max_seeds: Bound(1, _SEEDS.high, _SEEDS.why).annotated() = 10
    """an open question's seeds, added a look at a time"""
    max_seconds: count(1, 31_536_000, "a year") | None = None
    """no new round of added seeds after this (null: no time cap)"""
    report_seeds: Bound(0, _SEEDS.high, _SEEDS.why).annotated() = 0
    """fresh seeds for each budget's pick once everything is decided: its reported dev score (dev only; 0: none)"""

    def __post_init__(self):
        if self.max_seeds < self.seeds:
            fail(f"expected an integer >= seeds ({self.seeds}), got {self.max_seeds}", "max_seeds")


@section()
class _ConfirmSection(ConfirmSettings):
    by_budget: Annotated[dict[StrictStr, Annotated[ConfirmSettings, EMPTY]], EMPTY] = Field(default_factory=dict)
    """per budget preset, keys that replace these when a run uses it: a smaller preset (smoke) confirms less than
    the full one, in the same file"""


@section(kw_only=True)
class _Settings(Section):
    """What a sweep file says and its resolved definition keeps as is."""

    name: _Name
    """the sweep's name: its MLflow experiment, its Tune state under the storage path, its Optuna studies"""
    description: StrictStr = ""
    """free text, shown with the sweep"""
    model: Annotated[StrictStr, Field(min_length=1)] = DEFAULT_MODEL
    """the backbone: a model name or directory"""
    seed: SEED.annotated() = 0
    """the sweep's seed: Optuna's samplers, the data subsets and splits, every search trial's training"""
    search: Annotated[SearchSettings, EMPTY] = dataclasses.field(default_factory=SearchSettings)
    """how configurations are proposed (below: `search`)"""
    scheduler: Annotated[SchedulerSettings, EMPTY] = dataclasses.field(default_factory=SchedulerSettings)
    """how weak trials are stopped early (below: `scheduler`)"""
    resources: Annotated[Resources, EMPTY] = dataclasses.field(default_factory=Resources)
    """what each trial asks Ray for, and packing (below: `resources`)"""
    max_failures: count(0, 1_000, "a sane bound on retries") = 1
    """retries of a failed trial (from its last checkpoint)"""
    checkpoints_per_method: count(0, 1_000, "a sane bound on stored checkpoints") = 1
    """best trials per method whose checkpoint goes to MLflow"""
    train: Annotated[dict[StrictStr, Any], EMPTY] = dataclasses.field(default_factory=dict)
    """training settings every trial of the sweep shares (below: `train`)"""
    invalid_rows: one_of(INVALID_ROW_POLICIES) = "raise"
    """a malformed data row stops the sweep (raise), or is dropped (skip)"""

    def __post_init__(self):
        if self.search.sampler == "nsga2" and self.search.objective != "multi":
            fail("nsga2 is for objective: multi; use tpe", "search", "sampler")
        if self.scheduler.type == "asha" and self.search.objective == "multi":
            fail("ASHA takes one metric: a multi-objective search needs type: none", "scheduler", "type")
        per_method = self.search.allocation == "per_method" and self.search.objective == "single"
        if self.search.unit != "trials" and not per_method:
            fail("a budget in steps or tokens needs allocation: per_method and objective: single", "search", "unit")


def _task_entry(value: str) -> str:
    if not (is_task_file(value) or value in task_names()):
        fail(f"unknown task {show(value)}; expected one of {', '.join(task_names())} or a task file's path (.yaml)")
    return value


_TaskEntries = Annotated[
    list[Annotated[StrictStr, AfterValidator(_task_entry)]],
    validation.rule(
        lambda v: isinstance(v, list) and v, "expected a non-empty list of task names or task files, got {}", True
    ),
    validation.rule(lambda v: len(set(v)) == len(v), "a task is listed twice in {}"),
    Field(json_schema_extra={"minItems": 1}),
]


@section(kw_only=True)
class SweepFile(_Settings):
    """A sweep definition as written (``peftune schema`` prints its JSON Schema)."""

    tasks: _TaskEntries
    """the tasks trained together, the score the mean of their metrics: shipped task names, or paths of task files
    (relative to this file's folder, else as given)"""
    methods: validation.names_of("method", methods.method_names)
    """the PEFT methods searched, each with its own space `search_spaces/methods/<method>.yaml`"""
    budgets: Annotated[dict[_Preset, Budget], Field(min_length=1)]
    """the budget presets by name (below: `budgets.<preset>`); a run picks one with `--budget`"""
    budget: StrictStr | None = None
    """the preset a run uses unless told another"""
    confirm: Annotated[_ConfirmSection, EMPTY] = dataclasses.field(default_factory=_ConfirmSection)
    """the confirmation after the search (below: `confirm`)"""

    def __post_init__(self):
        super().__post_init__()
        for preset in (p for p in self.confirm.by_budget if p not in self.budgets):
            fail(f"no budget preset {preset!r}; presets: {', '.join(self.budgets)}", "confirm", "by_budget", preset)


@section(kw_only=True)
class SweepDefinition(_Settings):
    """A sweep definition resolved: its budget preset chosen, its method spaces loaded."""

    tasks: tuple[str, ...]  # the tasks' names, in the order listed
    # name -> declaration of each task read from a user's task file (a shipped task is known by its name)
    declarations: SkipValidation[dict[str, dict]] = dataclasses.field(default_factory=dict)
    spaces: SkipValidation[dict[str, MethodSpace]]  # method name -> its space, in the order listed
    budget_name: str
    budget: Budget
    confirm: ConfirmSettings = dataclasses.field(default_factory=ConfirmSettings)  # for the chosen budget
    source: str = ""

    methods = property(lambda self: list(self.spaces), doc="the methods, in the order listed")
    multi_objective = property(lambda self: self.search.objective == "multi")

    @property
    def search_trials(self) -> int:
        """The search's trials in all (Tune's ``num_samples``): each method's ``trials_per_method``."""
        return self.budget.trials_per_method * len(self.spaces)

    def to_dict(self) -> dict:
        """The resolved definition (chosen budget, method spaces inlined): what the sweep really ran."""
        out = {key: getattr(self, key) for key in ("name", "description", "methods", "model", "seed")}
        out.update(tasks=list(self.tasks), budget=self.budget_name)
        if self.declarations:  # only then: a sweep of shipped tasks keeps the fingerprint it always had
            out["task_declarations"] = self.declarations
        out.update({f"budget_{k}": v for k, v in dataclasses.asdict(self.budget).items()})
        out.update({key: dataclasses.asdict(getattr(self, key)) for key in ("search", "scheduler", "resources")})
        out.update(max_failures=self.max_failures, checkpoints_per_method=self.checkpoints_per_method)
        out.update(train=dict(self.train), confirm=dataclasses.asdict(self.confirm), invalid_rows=self.invalid_rows)
        return {**out, "spaces": {name: space.to_yaml() for name, space in self.spaces.items()}}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def fingerprint(self) -> str:
        """What must not change when a sweep resumes (everything but the description)."""
        data = {k: v for k, v in self.to_dict().items() if k != "description"}
        for key in ("pack_size", "pack_wait_s"):  # how trials run, not what is searched: a resume may change them
            data["resources"].pop(key)
        data = legacy.fingerprint_budget(data, len(self.spaces))  # a sweep begun with num_samples resumes
        return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def with_tasks(self, entries: list[str]) -> "SweepDefinition":
        """A copy on other tasks: shipped names or task files (paths relative to the working directory)."""
        specs = resolve_tasks(entries)
        declarations = {spec.name: spec.declaration() for spec in specs if not spec.is_shipped}
        return dataclasses.replace(self, tasks=tuple(spec.name for spec in specs), declarations=declarations)

    def with_overrides(self, *, name=None, model=None, multi_objective=None, invalid_rows=None, **budget):
        """A copy with another name/model/data policy, the multi-objective search (no scheduler), or budget fields."""
        changes = {k: v for k, v in dict(name=name, model=model, invalid_rows=invalid_rows).items() if v is not None}
        if multi_objective:
            changes.update(search=dataclasses.replace(self.search, objective="multi"))
            changes.update(scheduler=SchedulerSettings(type="none"))
        elif multi_objective is False and self.multi_objective:
            changes["search"] = dataclasses.replace(self.search, objective="single", sampler="tpe")
        with named(self.source):
            changes.update({"budget": at(("budget",), dataclasses.replace, self.budget, **budget)} if budget else {})
            return dataclasses.replace(self, **changes)


_SWEEP_KEYS = {f.name for f in dataclasses.fields(SweepFile)}


def load_sweep(path: str | Path, budget: str | None = None, spaces_dir: str | Path | None = None) -> SweepDefinition:
    """Read and validate a sweep definition; ``budget`` picks a preset (default: the file's ``budget``)."""
    path = Path(path)
    own = Path(spaces_dir) if spaces_dir is not None else path.parent / METHODS_SUBDIR
    shipped = SEARCH_SPACES_DIR / METHODS_SUBDIR

    def space_file(method: str) -> Path:  # the folder's own spaces where it has them (or was told), else the shipped
        return (own if own.is_dir() or spaces_dir is not None else shipped) / f"{method}.yaml"

    with named(path):
        data = validation.read_yaml(path)
        sweep = TypeAdapter(SweepFile).validate_python(data)
        for i, method in enumerate(sweep.methods):
            if not space_file(method).is_file():
                missing = f"no search space for {method!r}: {space_file(method)} not found"
                raise SpaceError(path, f"methods[{i}]", missing)
        spaces = {method: load_method_space(space_file(method)) for method in sweep.methods}
        specs = resolve_tasks(sweep.tasks, relative_to=path.parent)
        names = tuple(spec.name for spec in specs)
        _check_train(sweep, names)
        chosen, presets = budget if budget is not None else sweep.budget, ", ".join(sweep.budgets)
        if chosen not in sweep.budgets:
            problem = f"no budget preset {show(chosen)}" if chosen is not None else "no budget chosen"
            fail(f"{problem}; presets: {presets}", "budget" if budget is None else "budgets")
        confirm = ConfirmSettings(**{k: getattr(sweep.confirm, k) for k in ConfirmSettings.__dataclass_fields__})
        if chosen in sweep.confirm.by_budget:  # the keys the preset's override gives replace the section's
            given = data["confirm"]["by_budget"][chosen] or {}
            override = {key: getattr(sweep.confirm.by_budget[chosen], key) for key in given}
            confirm = at(("confirm", "by_budget", chosen), dataclasses.replace, confirm, **override)
        kept = {f.name: getattr(sweep, f.name) for f in dataclasses.fields(_Settings)}
        declarations = {spec.name: spec.declaration() for spec in specs if not spec.is_shipped}
        return SweepDefinition(**kept, tasks=names, declarations=declarations, spaces=spaces, budget_name=chosen,
                               budget=sweep.budgets[chosen], confirm=confirm, source=str(path))  # fmt: skip


def _check_train(sweep: SweepFile, tasks: tuple[str, ...]) -> None:
    """``train:``: TrainConfig's fixed settings, each checked by TrainConfig itself (its rules, written there)."""
    settable = {f.name: type(f.default) for f in dataclasses.fields(TrainConfig)
                if f.name not in _SET_ELSEWHERE and isinstance(f.default, (int, float, str))}  # fmt: skip
    settable["head_lr"] = float  # None by default (the method's lr); a number when set
    for key, value in [*sweep.train.items(), (None, None)]:  # None: all of them together
        if key in TrainConfig.__dataclass_fields__.keys() - settable.keys():
            fail("set by the search space, the budget or the top level, not here", "train", key)
        if key is not None and key not in settable:
            fail(f"unknown training setting; expected one of {', '.join(sorted(settable))}", "train", key)
        if key is not None:
            at(("train", key), _KINDS[settable[key]].validate_python, value)
        try:
            TrainConfig(method=sweep.methods[0], tasks=tasks, **(sweep.train if key is None else {key: value}))
        except PeftuneError as error:
            fail(str(error), "train", *([key] if key else []))
    # a trial sees only the GPUs Ray gives it, from cuda:0 (the device's form is TrainConfig's check)
    device, visible = sweep.train.get("device", "auto"), max(1, math.ceil(sweep.resources.gpus_per_trial))
    if device != "auto" and torch.device(device).type == "cuda" and (torch.device(device).index or 0) >= visible:
        fail(
            f"{show(device)}: a trial sees only the GPU(s) Ray gives it, cuda:0 to cuda:{visible - 1} with "
            f"resources.gpus_per_trial {sweep.resources.gpus_per_trial:g}; expected cuda or auto",
            "train",
            "device",
        )


def prepare_data(definition: SweepDefinition, data_dir: str | Path):
    """The sweep's data, read and tokenized once, and the model's weights: what every trial trains on."""
    where = data_dir or "beside their task files"
    log.info("reading and tokenizing %s from %s (model %s)", ",".join(definition.tasks), where, definition.model)
    return train.prepare(data_settings(definition, data_dir), definition.tasks)


def data_settings(definition: SweepDefinition, data_dir: str | Path | None) -> DataSettings:
    """What every trial of ``definition`` reads: its budget's rows and splits, its model, seed and row policy."""
    budget = definition.budget
    return DataSettings(
        data_dir=str(data_dir) if data_dir is not None else None,
        model=definition.model,
        max_length=budget.max_length,
        max_train_examples=budget.max_train_examples,
        max_dev_examples=budget.max_dev_examples,
        seed=definition.seed,
        invalid_rows=definition.invalid_rows,
        selection_examples=budget.selection_examples,
        decision_examples=budget.decision_examples,
    )


def confirm_data_settings(definition: SweepDefinition, data_dir: str | Path | None) -> DataSettings:
    """What a confirmation run of ``definition`` reads: the search's data settings (the same selection, decision
    and dev rows), with ``confirm.train_examples`` train rows per task (None: every row they leave)."""
    rows = definition.confirm.train_examples
    return dataclasses.replace(data_settings(definition, data_dir), max_train_examples=rows)


def resolve_sweep_path(name_or_path: str | Path) -> Path:
    """``sst_tuning`` -> the shipped sst_tuning.yaml; a path is taken as is."""
    path = Path(name_or_path)
    return path if path.suffix in (".yaml", ".yml") or path.exists() else SEARCH_SPACES_DIR / f"{name_or_path}.yaml"


def shipped_files() -> list[Path]:
    """Every shipped YAML file (method spaces and sweep definitions)."""
    return sorted(SEARCH_SPACES_DIR.rglob("*.yaml"))
