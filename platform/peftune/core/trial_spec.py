"""One trial's specification: what it trains and on what data, in one validated object.

A ``TrialSpec`` is a ``TrainConfig`` (the method, its options, the hyperparameters, the splits it is judged
and reported on), the ``DataSettings`` its data is read with (``train.prepare``'s arguments) and the threads
it ran on. It has one way in and out of each of its forms:

- a JSON file (``to_json`` / ``read``): every sweep run stores it as the artifact ``trial_spec.json``, ``peftune
  train`` writes it beside its checkpoint, and
  ``peftune train --spec FILE`` re-runs it;
- the ``peftune train`` command line (``command``): the run's ``peftune.train_command`` tag, the same trial
  spelled as flags (``peftune.cli.train_command`` reads the flags back into a spec);
- the data it reads (its ``DataSettings``, what ``train.prepare`` takes): one object for the sweep, the command
  line and the evaluation, so the same settings carve the same train, selection and decision rows everywhere.

The same spec, on the same code, data and threads, gives the same epoch scores.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peftune import methods
from peftune.base.errors import PeftuneError, UserError, one_line
from peftune.base.record_names import HYPERPARAMETERS
from peftune.core.train import TrainConfig, train_command
from peftune.inputs.data import DataSettings

FORMAT = 1  # the JSON form's version: a file of another is refused, naming both
# the TrainConfig fields a run's params hold under their own names, after the method and the hyperparameters
PARAM_FIELDS = ("epochs", "batch_size", "tasks", "seed", "warmup_ratio", "sampling")
ARTIFACT = "trial_spec.json"  # the spec of a sweep run, among its artifacts, and beside a checkpoint


@dataclass(frozen=True)
class TrialSpec:
    config: TrainConfig
    data: DataSettings
    threads: int | None = None  # torch's threads (a trial re-runs exactly on as many)

    def __post_init__(self):
        # the method's options resolved (its defaults written out, its dropout the config's): one spec, one form
        resolved = method_fields(self.config)
        if resolved != self.config.method_options:
            object.__setattr__(self, "config", dataclasses.replace(self.config, method_options=resolved))

    def params(self) -> dict[str, Any]:
        """The run's MLflow params (before ``str``): the method, the common hyperparameters, the settings the trial's
        numbers depend on (the heads' rate as it trains: ``heads_lr``), the threads, the method's options as
        ``method.<field>`` (its defaults written out) and the data settings as ``data.<field>`` (but the data
        directory, a path of one machine). Read back by ``peftune.methods.options.options_from_params``."""
        config = self.config
        params = {
            "method": config.method,
            **{key: getattr(config, key) for key in HYPERPARAMETERS},
            **{key: getattr(config, key) for key in PARAM_FIELDS},
            "head_lr": config.heads_lr,
            "max_grad_norm": config.max_grad_norm,
            "precision": config.precision,
            "threads": self.threads,
        }
        params.update({f"method.{key}": value for key, value in config.method_options.items()})
        data = dataclasses.asdict(self.data)
        params.update({f"data.{key}": value for key, value in data.items() if key != "data_dir"})
        return params

    def command(self) -> str:
        """The ``peftune train`` command line of this trial."""
        return train_command(self.config, dataclasses.asdict(self.data), self.threads)

    def to_dict(self) -> dict[str, Any]:
        config = dataclasses.asdict(self.config)
        config["predictions_of"] = list(config["predictions_of"])
        return {"format": FORMAT, "train": config, "data": dataclasses.asdict(self.data), "threads": self.threads}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, raw: Any, source: str = "trial spec") -> TrialSpec:
        """The spec of ``raw`` (``to_dict``'s form), each part validated by its own class; an error names
        ``source`` and the key."""
        if not isinstance(raw, dict):
            raise UserError(f"{source}: expected a JSON object with format, train, data and threads")
        if raw.get("format") != FORMAT:
            raise UserError(f"{source}: format {raw.get('format')!r}; this version of peftune reads format {FORMAT}")
        unknown = sorted(set(raw) - {"format", "train", "data", "threads"})
        if unknown:
            raise UserError(f"{source}: unknown key {unknown[0]!r}; expected format, train, data, threads")
        threads = raw.get("threads")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise UserError(f"{source}: threads {threads!r}, expected a count >= 1 or null")
        train = raw.get("train")
        if isinstance(train, dict) and isinstance(train.get("predictions_of"), list):
            train = {**train, "predictions_of": tuple(train["predictions_of"])}  # JSON has no tuples
        config = _build(TrainConfig, train, f"{source}: train")
        data = _build(DataSettings, raw.get("data"), f"{source}: data")
        return cls(config, data, threads)


def method_fields(config: TrainConfig) -> dict[str, Any]:
    """The method's resolved options (defaults included) except its dropout, which is ``config.dropout``."""
    values = dataclasses.asdict(methods.make_method_config(config.method, config.method_options_with_dropout()))
    values.pop("dropout", None)
    return values


def write(spec: TrialSpec, path: str | Path) -> Path:
    """``spec`` as the JSON file ``path``, written whole or not at all (a temporary file renamed)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(spec.to_json())
    os.replace(tmp, path)
    return path


def read(path: str | Path) -> TrialSpec:
    """The spec in the JSON file ``path`` (a sweep run's ``trial_spec.json``)."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"{path}: cannot be read: {error}") from None
    except json.JSONDecodeError as error:
        raise UserError(f"{path}: not valid JSON: line {error.lineno}, column {error.colno}: {error.msg}") from None
    return TrialSpec.from_dict(raw, str(path))


def _build(cls, values: Any, where: str):
    """``cls(**values)`` with an unknown or missing key, or a value the class refuses, named after ``where``."""
    if not isinstance(values, dict):
        raise UserError(f"{where}: expected a JSON object of {cls.__name__}'s fields")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise UserError(f"{where}: unknown key {unknown[0]!r}; expected some of {', '.join(sorted(names))}")
    try:
        return cls(**values)
    except (PeftuneError, TypeError) as error:  # a value the class refuses; a required field missing
        raise UserError(f"{where}: {one_line(error)}") from None
