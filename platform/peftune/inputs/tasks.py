"""Tasks as declarations: a YAML task file -> a validated :class:`TaskSpec` (kind, columns, files, metric, labels).

A task is data, never code. Its file names the kind (``multiclass``: cross-entropy over its classes; ``binary``:
one logit, BCE; ``regression``: one output, MSE), the text column(s) (two for a sentence pair, encoded as one
sequence [CLS] a [SEP] b [SEP]), the label column, its files (``train`` and ``dev``, an optional ``test``; or
one ``file`` with a seeded ``split``), their ``format`` and the ``metric``. The shipped tasks (sst, para, sts,
cfimdb: the CS224N multitask files) are such files in ``search_spaces/tasks/``; a user's task is another,
anywhere, named by its path where a sweep or ``peftune train`` takes a task. Every key: docs/configuration.md.

Class labels may be numbers or strings. A task that lists its ``labels`` gives them ids in that order; one that
does not has them read from its train file (:meth:`TaskSpec.resolved`), numbers in numeric order, strings in
code-point order, so the same file always gives the same ids; the record keeps the list.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Annotated

import torch
import torch.nn.functional as F
from pydantic import Field, StrictInt, StrictStr, TypeAdapter

from peftune.base import validation
from peftune.base.errors import UnknownNameError, UserError
from peftune.base.record_names import task_metric
from peftune.base.validation import Float, Section, fail, named, one_of, section

KINDS = ("multiclass", "binary", "regression")
# the record names a task's metric `<task>_<metric>`, so a metric's name holds no "_" (f1 is macro-averaged F1)
METRICS = ("accuracy", "f1", "mcc", "pearson", "spearman")
DEFAULT_METRIC = {"multiclass": "accuracy", "binary": "accuracy", "regression": "pearson"}
CLASS_METRICS = ("accuracy", "f1", "mcc")  # a metric of predicted classes; pearson and spearman: of values
FORMATS = ("csv", "tsv", "jsonl", "parquet")
SUFFIXES = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".parquet": "parquet"}
TASK_FILE_SUFFIXES = (".yaml", ".yml")
# the shipped declarations: package data, like the search spaces (a wheel and a Ray job's code find them)
SHIPPED_DIR = Path(str(importlib.resources.files("peftune") / "search_spaces" / "tasks"))
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"  # no "." or "/": an entry with those names a task file

_Name = Annotated[
    StrictStr,
    validation.rule(lambda v: re.fullmatch(NAME_PATTERN, v), "expected a name of letters, digits, '_' and '-', got {}"),
    Field(json_schema_extra={"pattern": NAME_PATTERN}),
]
_Column = Annotated[StrictStr, Field(min_length=1)]
_Label = StrictInt | Annotated[StrictStr, Field(min_length=1)]
_Texts = Annotated[
    _Column | list[_Column],
    validation.rule(
        lambda v: (
            (isinstance(v, str) and v)
            or (isinstance(v, list) and len(v) == 2 and all(isinstance(c, str) and c for c in v))
        ),
        "expected a column name, or a list of two column names for a sentence pair, got {}",
        before=True,
    ),
]
_Fraction = Annotated[Float, validation.rule(lambda v: 0 < v < 1, "expected a fraction between 0 and 1, got {}")]


@section()
class SplitSettings(Section):
    """How one labelled ``file`` is split into train, dev and (optionally) test rows, per class for classes."""

    dev: _Fraction = 0.1
    """the share of the file's rows that is the dev split"""
    test: Annotated[Float, validation.rule(lambda v: 0 <= v < 1, "expected a fraction from 0 to 1, got {}")] = 0.0
    """the share that is the test split (read only by `peftune evaluate`); 0: none"""
    seed: validation.count(0) = 0
    """the split's own seed: the same file gives the same splits in every sweep"""

    def __post_init__(self):
        if self.dev + self.test >= 1:
            fail(f"dev {self.dev:g} + test {self.test:g} leave no train rows; expected a sum below 1", "dev")


@section(kw_only=True)
class TaskFile(Section):
    """A task file as written (``peftune schema --task`` prints its JSON Schema)."""

    name: _Name
    """the task's name in the record (`<name>_<metric>`), the report and a sweep's `tasks:`; unique among the
    tasks"""
    kind: one_of(KINDS)
    """multiclass: one output per class, cross-entropy; binary: one logit, BCE; regression: one output, MSE"""
    text: _Texts
    """the text column, or a list of two for a sentence pair (encoded together: [CLS] a [SEP] b [SEP])"""
    label: _Column
    """the label column: a class (a whole number or a text) or, for regression, a number"""
    train: _Column | None = None
    """the train file, relative to the task file's folder (else to --data-dir) like every file here; train and
    dev, or `file`"""
    dev: _Column | None = None
    """the dev file: reported on, never selected on (the search carves its own splits)"""
    test: _Column | None = None
    """an optional labelled test file, read only by `peftune evaluate`"""
    file: _Column | None = None
    """instead of train/dev/test: one labelled file, split by `split`"""
    split: SplitSettings | None = None
    """how `file` is split (below: `split`); null: its defaults"""
    format: one_of(FORMATS) | None = None
    """csv, tsv, jsonl or parquet; null: from each file's extension"""
    metric: one_of(METRICS) | None = None
    """the reported metric (f1: macro-averaged); null: the kind's default"""
    id: _Column | None = None
    """a column naming each example (checked for one example per id); null: none"""
    labels: Annotated[list[_Label], Field(min_length=2)] | None = None
    """the class labels in id order (a binary task's: negative, positive); null: the train file's, sorted"""
    range: Annotated[list[Float], Field(min_length=2, max_length=2)] | None = None
    """regression: [low, high], every value checked against it; the head's output starts at its middle"""
    display_name: StrictStr = ""
    """how the report's tables and plots name it ("": its name)"""
    description: StrictStr = ""
    """free text, shown with the task"""

    def __post_init__(self):
        texts = [self.text] if isinstance(self.text, str) else self.text
        if len(set(texts)) != len(texts):
            fail(f"a pair task's two text columns must differ, got {texts}", "text")
        if self.label in texts or self.id in texts or self.id == self.label:
            fail("the text, label and id columns must be different columns", "label")
        if self.file is not None and any(v is not None for v in (self.train, self.dev, self.test)):
            fail("give either `file` (with `split`) or `train` and `dev` files, not both", "file")
        if self.file is None and (self.train is None or self.dev is None):
            fail(
                "missing; expected `train` and `dev` files (or one `file` with a `split`)",
                "train" if self.train is None else "dev",
            )
        if self.split is not None and self.file is None:
            fail("a split applies to one `file`; this task gives train and dev files", "split")
        if self.labels is not None:
            if self.kind == "regression":
                fail("a regression task has values, not class labels; use `range`", "labels")
            if self.kind == "binary" and len(self.labels) != 2:
                fail(f"a binary task has two labels (negative, positive), got {len(self.labels)}", "labels")
            if len({str(v) for v in self.labels}) != len(self.labels):
                fail(f"a label is listed twice in {self.labels}", "labels")
        if self.range is not None:
            if self.kind != "regression":
                fail("`range` bounds a regression task's values; a class task lists `labels`", "range")
            if not self.range[0] < self.range[1]:
                fail(f"expected [low, high] with low < high, got {self.range}", "range")
        if self.metric is not None and (self.metric in CLASS_METRICS) != (self.kind != "regression"):
            expected = ", ".join(CLASS_METRICS) if self.kind != "regression" else "pearson, spearman"
            fail(f"{self.metric} does not score a {self.kind} task; expected one of {expected}", "metric")


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """A task resolved: what the data readers, the model's heads, the losses and the record need."""

    name: str
    kind: str  # "multiclass" (cross-entropy), "binary" (one logit, BCE), "regression" (MSE)
    text_columns: tuple[str, ...]  # one column, or two for a sentence pair
    label_column: str
    train_file: str | None = None  # None: the task reads one `file`, split by `split`
    dev_file: str | None = None
    test_file: str | None = None
    file: str | None = None
    split: tuple[float, float, int] | None = None  # (dev fraction, test fraction, seed) of `file`
    format: str | None = None  # None: each file's extension says
    metric: str = "accuracy"
    id_column: str | None = None
    labels: tuple[int | str, ...] | None = None  # the classes in id order; None until read from train (resolved)
    value_range: tuple[float, float] | None = None  # regression: the values' declared bounds
    display_name: str = ""  # the papers' column (SST, Quora); "": its name
    description: str = ""
    # the task file's folder, where its relative file names are looked up first; None: a shipped task; "": one
    # declared from a record (which keeps no machine path: its files come from the data directory)
    folder: str | None = None
    labels_from_train: bool = False  # the labels were read from the train file (the task file lists none)

    def __post_init__(self):
        if not self.display_name:
            object.__setattr__(self, "display_name", self.name)

    @classmethod
    def from_file(cls, declared: TaskFile, folder: str | None = None) -> TaskSpec:
        """The spec a validated task file declares; ``folder``: where the file lies (None: a shipped task)."""
        split = declared.split or (SplitSettings() if declared.file is not None else None)
        return cls(
            name=declared.name,
            kind=declared.kind,
            text_columns=(declared.text,) if isinstance(declared.text, str) else tuple(declared.text),
            label_column=declared.label,
            train_file=declared.train,
            dev_file=declared.dev,
            test_file=declared.test,
            file=declared.file,
            split=(split.dev, split.test, split.seed) if split is not None else None,
            format=declared.format,
            metric=declared.metric or DEFAULT_METRIC[declared.kind],
            id_column=declared.id,
            labels=tuple(declared.labels) if declared.labels is not None else None,
            value_range=tuple(declared.range) if declared.range is not None else None,
            display_name=declared.display_name,
            description=declared.description,
            folder=folder,
        )

    def declaration(self) -> dict:
        """The task as a task file would write it, its labels resolved (what the record keeps; no machine path)."""
        texts = self.text_columns[0] if len(self.text_columns) == 1 else list(self.text_columns)
        out = {"name": self.name, "kind": self.kind, "text": texts, "label": self.label_column}
        files = {"train": self.train_file, "dev": self.dev_file, "test": self.test_file, "file": self.file}
        out.update({key: value for key, value in files.items() if value is not None})
        if self.split is not None:
            out["split"] = dict(zip(("dev", "test", "seed"), self.split, strict=True))
        optional = {
            "format": self.format,
            "id": self.id_column,
            "display_name": self.display_name,
            "description": self.description,
        }
        out.update({key: value for key, value in optional.items() if value})
        out["metric"] = self.metric
        if self.labels is not None:
            out["labels"] = list(self.labels)
        if self.value_range is not None:
            out["range"] = list(self.value_range)
        return out

    @classmethod
    def from_declaration(cls, declared: dict, where: str = "the record") -> TaskSpec:
        """A spec from :meth:`declaration`'s dict (a record's), validated as a task file is; its files are read
        from the data directory (a record keeps no machine path)."""
        with named(where):
            return cls.from_file(TypeAdapter(TaskFile).validate_python(declared), folder="")

    def resolved(self, train_labels: Iterable[int | str]) -> TaskSpec:
        """This spec with its class labels, read from the train file's labels when the task did not list them:
        numbers in numeric order, strings in code-point order (the same file, the same ids)."""
        if self.kind == "regression" or self.labels is not None:
            return self
        seen = set(train_labels)
        kinds = {type(v) for v in seen}
        if len(kinds) > 1:
            raise UserError(
                f"task {self.name!r}: the train file's labels mix numbers and text ({sorted(map(str, seen))[:6]}); "
                "expected one kind, or list them in the task's `labels`"
            )
        labels = tuple(sorted(seen))
        if self.kind == "binary" and len(labels) != 2:
            raise UserError(
                f"task {self.name!r}: a binary task's train file has {len(labels)} distinct labels "
                f"({', '.join(map(str, labels[:6]))}); expected two"
            )
        if len(labels) < 2:
            raise UserError(
                f"task {self.name!r}: the train file has one label only ({labels[0]!r}); expected two or more"
            )
        return dataclasses.replace(self, labels=labels, labels_from_train=True)

    @property
    def metric_name(self) -> str:
        """The task's metric in the record: ``sst_accuracy``."""
        return task_metric(self.name, self.metric)

    @property
    def num_labels(self) -> int:
        """Classes of a multiclass task (its outputs); 1 for the others."""
        if self.kind != "multiclass":
            return 1
        if self.labels is None:
            raise UserError(f"task {self.name!r}: its labels are read from its train file, which is not read yet")
        return len(self.labels)

    @property
    def num_outputs(self) -> int:
        return self.num_labels

    @property
    def is_pair(self) -> bool:
        return len(self.text_columns) == 2

    @property
    def is_shipped(self) -> bool:
        return self.folder is None

    @property
    def roles(self) -> tuple[str, ...]:
        """The labelled files the task has: train, dev, and test where it names one."""
        has_test = self.test_file is not None or (self.split is not None and self.split[1] > 0)
        return ("train", "dev", "test") if has_test else ("train", "dev")

    def file_of(self, role: str) -> str:
        """The file name ``role`` (train, dev, test) is read from (one `file` serves all three)."""
        name = (
            self.file
            if self.file is not None
            else {"train": self.train_file, "dev": self.dev_file, "test": self.test_file}[role]
        )
        if name is None:
            raise UserError(f"task {self.name!r} has no {role} file; expected `{role}:` in its task file")
        return name

    def format_of(self, path: str | Path) -> str:
        """The file's format: the task's ``format``, else its extension's."""
        if self.format is not None:
            return self.format
        suffix = Path(path).suffix.lower()
        if suffix not in SUFFIXES:
            raise UserError(
                f"{path}: cannot tell the format from {suffix or 'no extension'!r}; expected one of "
                f"{', '.join(SUFFIXES)} or the task's `format` ({', '.join(FORMATS)})"
            )
        return SUFFIXES[suffix]

    @property
    def head_center(self) -> float:
        """Where a regression head's output starts: the middle of the declared range (2.5 for STS), else 0."""
        return sum(self.value_range) / 2 if self.value_range is not None else 0.0

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """outputs: (B, num_outputs) float; labels: (B,) float (class ids, or values)."""
        outputs = outputs.float()
        if self.kind == "multiclass":
            return F.cross_entropy(outputs, labels.long())
        if self.kind == "binary":
            return F.binary_cross_entropy_with_logits(outputs.squeeze(-1), labels)
        return F.mse_loss(outputs.squeeze(-1), labels)

    def predict(self, outputs: torch.Tensor) -> torch.Tensor:
        """(B, num_outputs) -> (B,) predicted class ids or values."""
        outputs = outputs.float()
        if self.kind == "multiclass":
            return outputs.argmax(-1).float()
        if self.kind == "binary":
            return (outputs.squeeze(-1) > 0).float()
        return outputs.squeeze(-1)

    def score(self, predictions: torch.Tensor, labels: torch.Tensor) -> float:
        """The task's metric of (N,) predictions against (N,) labels."""
        if self.metric == "accuracy":
            return (predictions == labels).float().mean().item()
        if self.metric == "pearson":
            return pearson(predictions, labels)
        if self.metric == "spearman":
            return pearson(_ranks(predictions), _ranks(labels))
        classes = self.num_labels if self.kind == "multiclass" else 2
        confusion = torch.zeros(classes, classes, dtype=torch.float64)  # (true, predicted)
        confusion.index_put_(
            (labels.long(), predictions.long()), torch.ones(len(labels), dtype=torch.float64), accumulate=True
        )
        return macro_f1(confusion) if self.metric == "f1" else mcc(confusion)


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denominator = x.norm() * y.norm()
    # a constant prediction has no correlation; report 0 rather than NaN
    return 0.0 if denominator == 0 else float((x * y).sum() / denominator)


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """(N,) -> (N,) float64 ranks, ties given their mean rank (Spearman's rho is Pearson's r of these)."""
    values, inverse, counts = torch.unique(x.double(), return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()  # (U,) the last rank (1-based) of each distinct value
    return (ends - (counts.double() - 1) / 2)[inverse]


def macro_f1(confusion: torch.Tensor) -> float:
    """F1 of each class, averaged (a class neither present nor predicted counts as 1: nothing to get wrong)."""
    true_positive = confusion.diagonal()
    both = confusion.sum(0) + confusion.sum(1)  # predicted + present
    f1 = torch.where(both > 0, 2 * true_positive / both.clamp(min=1), torch.ones_like(both))
    return float(f1.mean())


def mcc(confusion: torch.Tensor) -> float:
    """Matthews' correlation (Gorodkin's form for K classes); 0 where a margin is constant (undefined)."""
    n, correct = confusion.sum(), confusion.diagonal().sum()
    present, predicted = confusion.sum(1), confusion.sum(0)
    numerator = correct * n - (present * predicted).sum()
    denominator = math.sqrt(float(n**2 - (predicted**2).sum())) * math.sqrt(float(n**2 - (present**2).sum()))
    return 0.0 if denominator == 0 else float(numerator) / denominator


def overall_score(metrics: dict[str, float]) -> float:
    """Mean of the per-task dev metrics; the AdaptBert average when all of sst/para/sts ran."""
    if not metrics:
        raise UserError("no task metrics to average")
    return sum(metrics.values()) / len(metrics)


# ----------------------------------------------------------------------------- the declared tasks of this process

_TASKS: dict[str, TaskSpec] = {}  # name -> spec: the shipped ones, then those declared in this process


def _registry() -> dict[str, TaskSpec]:
    if not _TASKS:
        for path in sorted(SHIPPED_DIR.glob("*.yaml")):
            spec = dataclasses.replace(load_task_file(path), folder=None)
            _TASKS[spec.name] = spec
    return _TASKS


def load_task_file(path: str | Path) -> TaskSpec:
    """A task file, validated: a missing key, an unknown one or a bad value is one line naming the file and key."""
    path = Path(path)
    with named(path):
        declared = TypeAdapter(TaskFile).validate_python(validation.read_yaml(path))
    return TaskSpec.from_file(declared, folder=str(path.resolve().parent))


def declare(spec: TaskSpec) -> TaskSpec:
    """Make ``spec`` known by its name in this process (a Ray worker declares the specs its data carries).

    The same spec again is a no-op, and so is its resolved form (its labels read from train) replacing it;
    another task under a name already taken is refused."""
    known = _registry().get(spec.name)
    unresolved = dataclasses.replace(spec, labels=known.labels, labels_from_train=False) if known else None
    if known is not None and known != spec and unresolved != known:
        where = "a shipped task" if known.is_shipped else f"the task file in {known.folder}"
        raise UserError(f"task name {spec.name!r} is taken by {where}; expected a task file with another `name`")
    if known is None or known.labels is None:
        _TASKS[spec.name] = spec
    return _TASKS[spec.name]


def forget_declared() -> None:
    """Drop every task declared in this process but the shipped ones (a test's, or a finished sweep's)."""
    for name in [name for name, spec in _registry().items() if not spec.is_shipped]:
        del _TASKS[name]


def is_task_file(entry: str) -> bool:
    """Whether a task entry (of a sweep's ``tasks:`` or ``--tasks``) names a task file rather than a task."""
    return entry.endswith(TASK_FILE_SUFFIXES) or "/" in entry or "\\" in entry


def resolve_tasks(entries: str | Sequence[str], relative_to: str | Path | None = None) -> list[TaskSpec]:
    """Task names and task file paths -> their specs, in order, each declared; a path is read relative to
    ``relative_to`` (a sweep file's folder) when it is not found as given. Refused: none, or a name twice."""
    if isinstance(entries, str):
        entries = [e.strip() for e in entries.split(",") if e.strip()]
    if not entries:
        raise UserError("no task given; expected a shipped task (" + ", ".join(shipped_names()) + ") or a task file")
    specs = []
    for entry in entries:
        if is_task_file(entry):
            path = Path(entry).expanduser()
            if not path.is_file() and relative_to is not None and (Path(relative_to) / path).is_file():
                path = Path(relative_to) / path
            specs.append(load_task_file(path))
        else:
            specs.append(get_task(entry))
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise UserError(
            f"task name(s) {', '.join(map(repr, twice))} given twice in {list(entries)}; expected "
            "each task once (task files need distinct `name`s)"
        )
    return [declare(spec) for spec in specs]


def get_task(name: str) -> TaskSpec:
    try:
        return _registry()[name]
    except KeyError:
        known = ", ".join(sorted(_registry()))
        raise UnknownNameError(f"unknown task {name!r}; valid tasks: {known} (or a task file's path)") from None


def task_names() -> list[str]:
    return list(_registry())


def shipped_names() -> list[str]:
    return [name for name, spec in _registry().items() if spec.is_shipped]


def parse_tasks(names: str | Sequence[str]) -> list[TaskSpec]:
    """'sst,para,sts', a list of names or task files -> specs, in order, without duplicates."""
    return resolve_tasks(names)
