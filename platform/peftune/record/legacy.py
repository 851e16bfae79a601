"""What earlier versions of peftune wrote, and how it is still read: every path kept for an old record, in one place.

The sweep tags its parent run with the version it writes (:data:`RECORD_VERSION`, read by :func:`record_version`);
each function below takes a record's version and names those it serves. An untagged record (:data:`UNTAGGED`) is
told apart by what it holds; a tagged one never takes an old path, and a piece it lacks is refused naming the run
(a record that lost a piece is not an old one). A path goes once no record it serves is kept.

1. a run's ``peftune.phase`` and ``peftune.config_key`` tags: the confirmation's runs beside the search's;
2. the selection split (the search judged on it, not on dev), the decision plan's params, the predictions;
3. ``trials_per_method`` in a sweep definition (before it, ``num_samples``), a run's ``eval_total_s``;
4. each run's ``trial_spec.json`` (its whole specification) and a flag for every method option;
5. each run's ``data.<field>`` params (the rows it read);
6. the parent run carries its record version (``peftune.record_version``).

Methods the registry no longer knows keep a colour here too. Model-side imports are deferred: no torch for the report.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from peftune.base.errors import RecordError
from peftune.base.record_names import (
    CONFIG_KEY,
    DEV,
    PHASE,
    RECORD_VERSION_TAG,
    SCORE,
    SEARCH,
    SELECTION,
    TRAIN_COMMAND,
    split_metric,
)

RECORD_VERSION = 6  # what this code writes (the list above), in the parent run's record-version tag
# a record whose parent run has no version tag: version 5 or earlier, each told apart by what it holds
UNTAGGED = 5

# ----------------------------------------------------------------------------- version 6: the record's version


def record_version(tags: Mapping[str, str], run_id: str) -> int:
    """The version of the record whose parent run ``run_id`` has ``tags``: its version tag, :data:`UNTAGGED` without
    one. A tag this peftune cannot read (not an integer from 6 to :data:`RECORD_VERSION`: a newer peftune's, or one
    edited) is refused."""
    raw = tags.get(RECORD_VERSION_TAG)
    if raw is None:
        return UNTAGGED
    version = int(raw) if raw.isascii() and raw.isdigit() else None
    if version is None or not UNTAGGED < version <= RECORD_VERSION:
        newer = "; a newer peftune wrote it: read it with that one" if version and version > RECORD_VERSION else ""
        raise RecordError(
            f"sweep run {run_id}: tag {RECORD_VERSION_TAG} is {raw!r}; expected an integer from {UNTAGGED + 1} to "
            f"{RECORD_VERSION}{newer}"
        )
    return version


def old(version: int) -> bool:
    """Whether a record of ``version`` may take an old path: an untagged one."""
    return version <= UNTAGGED


def lost(run_id: str, what: str, version: int, parent: bool = False) -> RecordError:
    """The refusal of a tagged record's run (the sweep's ``parent`` run) without a piece every record of its
    ``version`` holds."""
    return RecordError(
        f"{'sweep run' if parent else 'run'} {run_id}: no {what}, which every record of version {version} holds; "
        f"the record lost it (an old record, which may lack it, has no {RECORD_VERSION_TAG} tag)"
    )


def recorded_tasks(parent, children: Sequence, version: int) -> list[str]:
    """A sweep's tasks: its parent run's ``tasks`` param; where an untagged record has none (a partial one), the
    tasks its first trial that has them ran."""
    tasks = _split_list(parent.data.params.get("tasks", ""))
    if tasks:
        return tasks
    if not old(version):
        raise lost(parent.info.run_id, "param tasks", version, parent=True)
    return next((_split_list(c.data.params["tasks"]) for c in children if c.data.params.get("tasks")), [])


def _split_list(raw: str) -> list[str]:
    return [part.strip() for part in raw.split(",") if part.strip()]


# ----------------------------------------------------------------------------- version 1: phases and config keys


def run_phase(tags: Mapping[str, str], version: int, run_id: str | None) -> str:
    """A trial run's ``peftune.phase`` tag; a run of a record before version 1 has none: a search trial."""
    phase = tags.get(PHASE)
    if phase or old(version):
        return phase or SEARCH
    raise lost(str(run_id), f"tag {PHASE}", version)


def run_config_key(run, version: int) -> str:
    """A trial run's ``peftune.config_key`` tag (``record_names.config_key``). A run of a record before version 1 has
    none and is its own configuration (``run:<id>``): re-hashing its logged params would not give the key the
    search computed from the sampled ones."""
    key = run.data.tags.get(CONFIG_KEY)
    if key or old(version):
        return key or f"run:{run.info.run_id}"
    raise lost(run.info.run_id, f"tag {CONFIG_KEY}", version)


# ----------------------------------------------------------------------------- version 2: splits and the plan

# the split of a confirmation's seed means in a record before version 2, where dev selected the epoch too
DEV_SELECTED = "dev (runs written before the selection split existed: dev selected too)"
# the decision plan of a record before version 2, which logged none of it: 3 seeds, no seeds added, a 0.05 margin
PLAN_DEFAULTS = {"confirm_seeds": 3, "decision_margin": 0.05}


def plan_params(params: Mapping[str, Any], version: int = RECORD_VERSION, run_id: str = "") -> tuple[int, int, float]:
    """(seeds, max seeds, margin) of the decision plan a sweep ran with, from its parent run's (``run_id``) params;
    the defaults of a record before version 2 where a param is missing."""

    def number(key, default, kind):
        value = params.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return kind(value)
        if old(version):
            return default
        raise lost(run_id, f"number in param {key}", version, parent=True)

    seeds = number("confirm_seeds", PLAN_DEFAULTS["confirm_seeds"], int)
    margin = number("decision_margin", PLAN_DEFAULTS["decision_margin"], float)
    return seeds, max(seeds, number("confirm_max_seeds", seeds, int)), margin


def dev_judged(run_id: str, metrics: Mapping[str, float], version: int) -> dict[str, Any]:
    """The split of a run's numbers that no split names (``analysis.runs.split_numbers``): dev, no selection score.
    A run of a record before version 2 selected on dev; in a later one, a run that logged no score yet, or a
    one-epoch confirmation run's dev numbers. A later record's score with neither split named is refused."""
    if not old(version) and SCORE in metrics and split_metric(DEV, SCORE) not in metrics:
        raise lost(run_id, f"metric {split_metric(SELECTION, SCORE)} or {split_metric(DEV, SCORE)} beside its score",
                   version)  # fmt: skip
    return {split_metric(SELECTION, SCORE): math.nan, "split": DEV}


def trials_split(trials, version: int) -> str:
    """The split the search trials' numbers come from: selection; in a record before version 2, dev."""
    if not old(version):
        return SELECTION
    return SELECTION if "split" in trials and (trials["split"] == SELECTION).any() else DEV


def split_sizes(params: Mapping[str, Any], version: int, run_id: str) -> tuple[int | None | bool, int]:
    """(selection examples, decision examples) per task of a sweep, from its parent run's (``run_id``) params, as
    ``DataSettings`` takes them: a record before version 2 carved no selection split (False) and none decides."""
    missing = [key for key in ("selection_examples", "decision_examples") if key not in params]
    if missing and not old(version):
        raise lost(run_id, f"param {missing[0]}", version, parent=True)
    selection = params["selection_examples"] if "selection_examples" in params else False
    return selection, int(params.get("decision_examples") or 0)


def missing_predictions(run_id: str, split: str, version: int, kept: bool) -> None:
    """A completed confirmation run without its predictions on ``split``: a run of a record before version 2 kept
    none (and one before version 3 none on the decision split), left out of that split; in a later record, refused
    where the sweep keeps them (``kept``: ``record_names.keeps_predictions``)."""
    if kept and not old(version):
        raise lost(run_id, f"artifact predictions on the {split} split", version)


def undecided(version: int) -> str:
    """Why a budget's answer decides nothing where its configurations have no decision-split predictions."""
    older = ", or an older record" if old(version) else ", or no confirmation ran"
    return f"no decision-split predictions in the record (decision_examples: 0{older})"


# ----------------------------------------------------------------------------- version 3: definitions, timers

# a budget's keys before version 3 -> what replaces them (``spaces.Budget.renamed_keys``): the total of all methods'
# trials, so a method added to the list silently took trials from the others
RENAMED_BUDGET_KEYS = {
    "num_samples": "no longer taken (it was all methods' trials together); give trials_per_method, each method's "
    "trials (70 for 14 methods: trials_per_method: 5)"
}


def fingerprint_budget(data: dict, methods: int) -> dict:
    """A resolved definition's ``to_dict`` as fingerprinted (version < 3 and on): the budget's trials spelled as
    ``num_samples``, all ``methods``' together, so that a sweep begun before version 3 resumes under its
    fingerprint."""
    data["budget_num_samples"] = data.pop("budget_trials_per_method") * methods
    return data


def eval_seconds(run_id: str, metrics: Mapping[str, float], total: float, version: int) -> float:
    """A trial's seconds of every evaluation: ``total`` (its latest ``eval_total_s``); a run of a record before
    version 3 holds its last epoch's evaluation only (``eval_time_s``)."""
    if not math.isnan(total):
        return total
    if "eval_time_s" in metrics and not old(version):
        raise lost(run_id, "metric eval_total_s beside its eval_time_s", version)
    return metrics.get("eval_time_s", math.nan)


# ----------------------------------------------------------------------------- version 4: commands and specs

# method options a command recorded before version 4 never spelled ``--option KEY=VALUE`` (each had its own flag
# then, or is the common ``--dropout``, whose flag's default would win): given so, a mistake, refused
FLAG_ONLY = ("dropout", "rank", "alpha", "bottleneck", "prefix_length", "prompt_length", "k")


def rerun_config(row: Mapping, seed: int, train_settings: dict, device: str, eval_splits: Sequence[str]):
    """The ``TrainConfig`` a trial of a record before version 4 (no ``trial_spec.json``) trained, with another
    ``seed``: its params (``row``: the trial's row, ``method.<field>`` among them), the sweep's fixed ``train``
    settings, the ``device`` and what it evaluates (``eval_splits``)."""
    from peftune.base.record_names import HYPERPARAMETERS
    from peftune.core.train import TrainConfig
    from peftune.methods.options import options_from_params

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    settings = {k: v for k, v in train_settings.items() if k in fields and k not in ("eval_splits", "predictions_of")}
    for key in ("warmup_ratio", "sampling"):
        if row.get(key) is not None and not _missing(row.get(key)):
            settings[key] = row[key]
    return TrainConfig(
        eval_splits=list(eval_splits),
        method=row["method"],
        method_options=options_from_params(row["method"], method_params(row)),
        tasks=str(row["tasks"]).split(","),
        **{key: float(row[key]) for key in HYPERPARAMETERS},
        epochs=int(row["epochs"]),
        batch_size=int(row["batch_size"]),
        seed=seed,
        device=device,
        **settings,
    )


def method_params(row: Mapping) -> dict[str, str]:
    """A trial's ``method.<field>`` params as MLflow logged them (``str(value)``), for
    ``peftune.methods.options.options_from_params``; the columns of other methods (NaN in this row) left out."""
    return {key: str(value) for key, value in row.items() if str(key).startswith("method.") and not _missing(value)}


def _missing(value) -> bool:
    return isinstance(value, float) and math.isnan(value)  # a column of other runs' params: NaN in this row


def unspecified(run_id: str, tags: Mapping[str, str], version: int) -> None:
    """A run without ``trial_spec.json``: in a record before version 4 none had one, and a sweep that read no data
    directory stores none (nor a command to re-run it): :func:`rerun_config` builds it from its params. A later
    record's run whose command tag says it had one is refused."""
    if TRAIN_COMMAND in tags and not old(version):
        raise lost(run_id, "artifact trial_spec.json (its train command tag says it was stored)", version)


# ----------------------------------------------------------------------------- version 5: data settings


def confirmation_rows(run_id: str, value: str | None, version: int) -> int | None | bool:
    """The train rows per task a confirmation run trained on, from its ``data.max_train_examples`` param (``value``,
    as stored; None: every row not held out); False where a run of a record before version 5 has none (the
    search's rows are then the report's)."""
    if value is None:
        if not old(version):
            raise lost(run_id, "param data.max_train_examples", version)
        return False
    return None if value == "None" else int(value)


# ----------------------------------------------------------------------------- any version: unknown methods


def method_color(method: str) -> str:
    """The registry's colour of ``method`` (its spec's ``color``); a method it does not know (a record's from a
    version that had it, the published table's) gets a stable colour from its name."""
    from peftune.base.errors import UnknownNameError
    from peftune.methods.base import fallback_color, get_method

    try:
        return get_method(method).display_color
    except UnknownNameError:
        return fallback_color(method)


# ----------------------------------------------------------------------------- Tune's state: modules moved

# The library's modules before they moved into folders by layer (issue 55) -> where each lives now. A sweep saved
# before the move names the old modules in the state Tune pickled (its searcher and scheduler, the callbacks, the
# trial-name function, a failed trial's error); a resumed sweep reads them through ``peftune.sweep.resume.old_names``.
# The command line's modules are not here: nothing of the sweep's saved state comes from them.
MOVED_MODULES = {
    f"peftune.{old}": f"peftune.{folder}.{new or old}"
    for folder, names in {
        "base": ("errors", "validation", "record:record_names"),
        "inputs": ("dropout", "backbone", "tasks", "tables", "data"),
        "core": ("model", "params", "optim", "checkpoint", "train", "pack", "trial_spec"),
        "record": ("record_reader:reader", "record_writer:writer", "tracking_buffer", "trial_logger", "sweep_state")
        + ("stores", "ui_links", "epoch_kept", "legacy"),
        "stats": ("decisions", "simulate"),
        "sweep": ("sweep:orchestrator", "spaces", "search", "packing", "worker", "resume", "confirm", "carry")
        + ("shared_data", "stopping", "console", "lease"),
    }.items()
    for old, _, new in (name.partition(":") for name in names)
}
