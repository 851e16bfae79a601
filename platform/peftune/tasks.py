"""Task registry: what each dataset is, as data (files, columns, head, loss, metric).

CS224N multitask BERT conventions: sst is 5-way sentiment (cross-entropy,
accuracy); para is paraphrase with one logit (BCE, accuracy); sts is
similarity 0..5 with one output (MSE, Pearson r). Sentence pairs are encoded
as one sequence, [CLS] a [SEP] b [SEP].
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from peftune.errors import UnknownNameError, UserError
from peftune.record import task_metric

KINDS = ("multiclass", "binary", "regression")


@dataclass(frozen=True)
class TaskSpec:
    name: str
    train_file: str
    dev_file: str
    text_columns: tuple[str, ...]  # one column, or two for a sentence pair
    label_column: str
    kind: str  # "multiclass" (cross-entropy), "binary" (one logit, BCE), "regression" (MSE)
    num_labels: int = 1  # classes for multiclass; 1 output otherwise
    label_min: float = 0.0
    label_max: float = 1.0
    metric: str = "accuracy"  # "accuracy" or "pearson"
    description: str = ""
    display_name: str = ""  # how the report's tables and plots name it (the papers' column: SST, Quora); "": its name
    # labelled held-out split, same format as dev, read only by `peftune evaluate` (from --test-dir);
    # default: the dev file's name with "-dev" -> "-test" (ids-sst-test.csv, quora-test.csv, sts-test.csv)
    test_file: str | None = None

    def __post_init__(self):
        if not self.display_name:
            object.__setattr__(self, "display_name", self.name)
        if self.test_file is None:
            test_file = self.dev_file.replace("-dev", "-test")
            object.__setattr__(self, "test_file", test_file if test_file != self.dev_file else f"test-{self.dev_file}")
        if self.kind not in KINDS:
            raise UserError(f"task {self.name!r}: kind {self.kind!r}, expected one of {KINDS}")
        if len(self.text_columns) not in (1, 2):
            raise UserError(f"task {self.name!r}: one or two text columns, got {self.text_columns}")
        if self.kind == "multiclass" and self.num_labels < 2:
            raise UserError(f"task {self.name!r}: a multiclass task needs num_labels >= 2")
        if self.metric not in ("accuracy", "pearson"):
            raise UserError(f"task {self.name!r}: metric {self.metric!r}, expected 'accuracy' or 'pearson'")

    @property
    def metric_name(self) -> str:
        """The task's metric in the record: ``sst_accuracy``."""
        return task_metric(self.name, self.metric)

    @property
    def num_outputs(self) -> int:
        return self.num_labels if self.kind == "multiclass" else 1

    @property
    def is_pair(self) -> bool:
        return len(self.text_columns) == 2

    def check_label(self, value: float) -> str | None:
        """None if ``value`` is a valid label, else what was expected."""
        if math.isnan(value) or not (self.label_min <= value <= self.label_max):
            return f"a label in [{self.label_min:g}, {self.label_max:g}]"
        if self.kind in ("multiclass", "binary") and value != int(value):
            return f"an integer class label in [{self.label_min:g}, {self.label_max:g}]"
        return None

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """outputs: (B, num_outputs) float; labels: (B,) float."""
        outputs = outputs.float()
        if self.kind == "multiclass":
            return F.cross_entropy(outputs, labels.long())
        if self.kind == "binary":
            return F.binary_cross_entropy_with_logits(outputs.squeeze(-1), labels)
        return F.mse_loss(outputs.squeeze(-1), labels)

    def predict(self, outputs: torch.Tensor) -> torch.Tensor:
        """(B, num_outputs) -> (B,) predicted labels or values."""
        outputs = outputs.float()
        if self.kind == "multiclass":
            return outputs.argmax(-1).float()
        if self.kind == "binary":
            return (outputs.squeeze(-1) > 0).float()
        return outputs.squeeze(-1)

    def score(self, predictions: torch.Tensor, labels: torch.Tensor) -> float:
        if self.metric == "accuracy":
            return (predictions == labels).float().mean().item()
        return pearson(predictions, labels)


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denominator = x.norm() * y.norm()
    # a constant prediction has no correlation; report 0 rather than NaN
    return 0.0 if denominator == 0 else float((x * y).sum() / denominator)


_TASKS: dict[str, TaskSpec] = {}


def register_task(spec: TaskSpec) -> TaskSpec:
    if spec.name in _TASKS:
        raise UserError(f"task {spec.name!r} is already registered")
    _TASKS[spec.name] = spec
    return spec


def get_task(name: str) -> TaskSpec:
    try:
        return _TASKS[name]
    except KeyError:
        raise UnknownNameError(f"unknown task {name!r}; valid tasks: {', '.join(sorted(_TASKS))}") from None


def task_names() -> list[str]:
    return list(_TASKS)


def parse_tasks(names: str | Sequence[str]) -> list[TaskSpec]:
    """'sst,para,sts' or a list -> specs, in order, without duplicates."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    if not names:
        raise UserError("no task given; valid tasks: " + ", ".join(sorted(_TASKS)))
    if len(set(names)) != len(names):
        raise UserError(f"a task is named twice in {list(names)}")
    return [get_task(n) for n in names]


def overall_score(metrics: dict[str, float]) -> float:
    """Mean of the per-task dev metrics; the AdaptBert average when all of sst/para/sts ran."""
    if not metrics:
        raise UserError("no task metrics to average")
    return sum(metrics.values()) / len(metrics)


register_task(
    TaskSpec(
        "sst",
        "ids-sst-train.csv",
        "ids-sst-dev.csv",
        ("sentence",),
        "sentiment",
        kind="multiclass",
        num_labels=5,
        label_max=4,
        description="SST-5 sentiment, 5 classes",
        display_name="SST",
    )
)
register_task(
    TaskSpec(
        "para",
        "quora-train.csv",
        "quora-dev.csv",
        ("sentence1", "sentence2"),
        "is_duplicate",
        kind="binary",
        description="Quora question paraphrase, one logit",
        display_name="Quora",
    )
)
register_task(
    TaskSpec(
        "sts",
        "sts-train.csv",
        "sts-dev.csv",
        ("sentence1", "sentence2"),
        "similarity",
        kind="regression",
        label_max=5.0,
        metric="pearson",
        description="STS-B similarity 0..5",
        display_name="STS",
    )
)
register_task(
    TaskSpec(
        "cfimdb",
        "ids-cfimdb-train.csv",
        "ids-cfimdb-dev.csv",
        ("sentence",),
        "sentiment",
        kind="binary",
        description="CFIMDB binary movie-review sentiment",
        display_name="CFIMDB",
    )
)
