"""What earlier versions of peftune wrote, and how it is still read: every path kept for an old record, in one place.

A record carries no version tag: its version is what it holds. Each function below names the versions it serves
(a record of :data:`RECORD_VERSION` never takes its old path); a path goes once no record it serves is kept.

1. a run's ``peftune.phase`` and ``peftune.config_key`` tags: the confirmation's runs beside the search's;
2. the selection split (the search judged on it, not on dev) and the decision plan's params of the parent run;
3. ``trials_per_method`` in a sweep definition (before it, ``num_samples``: all methods' trials together);
4. each run's ``trial_spec.json`` (its whole specification) and a flag for every method option;
5. each run's ``data.<field>`` params (the rows it read).

Methods the registry no longer knows (a record of any version, the published reference) keep a colour here too.
Imports of the model side are deferred: the report reads this module without loading torch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

RECORD_VERSION = 5  # what this code writes (the list above)

# ----------------------------------------------------------------------------- version 3: sweep definitions

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


# ----------------------------------------------------------------------------- version 4: commands and specs

# method options a command recorded before version 4 never spelled ``--option KEY=VALUE`` (each had its own flag
# then, or is the common ``--dropout``, whose flag's default would win): given so, a mistake, refused
FLAG_ONLY = ("dropout", "rank", "alpha", "bottleneck", "prefix_length", "prompt_length", "k")


def rerun_config(row: Mapping, seed: int, train_settings: dict, device: str, eval_splits: Sequence[str]):
    """The ``TrainConfig`` a trial of a record before version 4 (no ``trial_spec.json``) trained, with another
    ``seed``: its params (``row``: the trial's row, ``method.<field>`` among them), the sweep's fixed ``train``
    settings, the ``device`` and what it evaluates (``eval_splits``)."""
    from peftune.methods.options import options_from_params
    from peftune.record import HYPERPARAMETERS
    from peftune.train import TrainConfig

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


# ----------------------------------------------------------------------------- version 2: splits and the plan

# the split of a confirmation's seed means in a record before version 2, where dev selected the epoch too
DEV_SELECTED = "dev (runs written before the selection split existed: dev selected too)"
# the decision plan of a record before version 2, which logged none of it: 3 seeds, no seeds added, a 0.05 margin
PLAN_DEFAULTS = {"confirm_seeds": 3, "decision_margin": 0.05}


def plan_params(params: Mapping[str, Any]) -> tuple[int, int, float]:
    """(seeds, max seeds, margin) of the decision plan a sweep ran with, from its parent run's params; the
    defaults of a record before version 2 where a param is missing."""

    def number(key, default, kind):
        value = params.get(key)
        return kind(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default

    seeds = number("confirm_seeds", PLAN_DEFAULTS["confirm_seeds"], int)
    margin = number("decision_margin", PLAN_DEFAULTS["decision_margin"], float)
    return seeds, max(seeds, number("confirm_max_seeds", seeds, int)), margin


# ----------------------------------------------------------------------------- any version: unknown methods


def method_color(method: str) -> str:
    """The registry's colour of ``method`` (its spec's ``color``); a method it does not know (a record's from a
    version that had it, the published table's) gets a stable colour from its name."""
    from peftune.errors import UnknownNameError
    from peftune.methods.base import fallback_color, get_method

    try:
        return get_method(method).display_color
    except UnknownNameError:
        return fallback_color(method)
