"""Every budget's contenders tuned under it: a method's tuned setting carried down to the sizes of smaller budgets.

A search of a few trials per method lands where it lands: a method whose best configuration is large may be
represented under a small parameter budget only by its default or a random draw at an untuned rate. After the
search, for each method with a size and each budget (``record_names.BUDGETS_PCT``) its best configuration does not fit,
:func:`carried` proposes that configuration with its size set to the largest size of its space that fits the
budget: the rate, dropout, decay and other options the search tuned, at a size the budget allows. Each runs as one
more search trial (the search's data, fidelity and seed; tagged ``peftune.carried_from``), so it competes for its
budget's contenders (``confirm.contenders``) on the same terms as the trials the searcher proposed.

The rate is carried as it is: LoRA's ``alpha / r`` scaling (rsLoRA's ``alpha / sqrt(r)``) is the method's own
answer to a change of rank, and an adapter's bottleneck does not change its update's scale. The proposals are a
function of the searched trials alone (carried trials never propose), so a resume proposes the same ones.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Mapping, Sequence

import torch

from peftune import methods
from peftune.base.record_names import (
    BUDGETS_PCT,
    CARRIED_FROM,
    COMPLETED,
    EARLY_STOPPED,
    FAILED,
    HYPERPARAMETERS,
    SEARCH,
    STATUS,
    config_key,
)
from peftune.core.model import MultitaskModel
from peftune.core.params import count_parameters
from peftune.inputs.backbone import BertModel, read_config, resolve_model_dir
from peftune.inputs.tasks import parse_tasks
from peftune.methods.options import options_from_params
from peftune.record import legacy
from peftune.sweep import console
from peftune.sweep.confirm import Candidate, Rounds, candidate_of, fit_rounds, rank
from peftune.sweep.spaces import Choice, Fixed, IntRange, SweepDefinition

log = logging.getLogger("peftune.sweep.carry")
GRID = 64  # an integer range of sizes offers at most this many of its values (evenly spread, its ends included)


def size_values(param) -> list:
    """The sizes a method's space offers for its size option, largest first."""
    if isinstance(param, Fixed):
        values = [param.value]
    elif isinstance(param, Choice):
        values = list(param.choices)
    elif isinstance(param, IntRange):
        values = list(range(param.low, param.high + 1, param.step))
        if len(values) > GRID:
            values = sorted({values[round(i * (len(values) - 1) / (GRID - 1))] for i in range(GRID)})
    else:
        return []
    return sorted((v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)), reverse=True)


def trainable_pct_of(model: str, tasks: Sequence[str]) -> Callable[[str, Mapping], float]:
    """``(method, options) -> trainable parameters per task, % of the backbone``, counted on the meta device."""
    config = read_config(resolve_model_dir(model))
    specs = parse_tasks(list(tasks))

    @functools.cache
    def pct(method: str, key: str) -> float:
        method_config = methods.make_method_config(method, json.loads(key))
        with torch.device("meta"):  # shapes only: no memory, no initialisation
            counts = count_parameters(MultitaskModel(BertModel(config), specs, method, method_config))
        return counts.percent(counts.trainable_per_task)

    return lambda method, options: pct(method, json.dumps(options, sort_keys=True))  # options hold lists


def carried(definition: SweepDefinition, runs: Sequence, pct: Callable[[str, Mapping], float],
            budgets: Sequence[float] = BUDGETS_PCT, *, version: int) -> list[dict]:  # fmt: skip
    """The Ray trial configs of the carried trials (module docstring), from the sweep's search trials ``runs`` (of a
    record of ``version``, ``peftune.record.legacy``)."""
    best: dict[str, Candidate] = {}
    tried: set[str] = set()
    for run in runs:
        candidate = candidate_of(run, version)
        tried.add(legacy.run_config_key(run, version))
        if candidate is None or run.data.tags.get(CARRIED_FROM):
            continue
        if candidate.method not in best or rank(candidate) < rank(best[candidate.method]):
            best[candidate.method] = candidate
    out: dict[str, dict] = {}
    for method, space in definition.spaces.items():
        field = methods.get_method(method).size_field
        if method not in best or field is None or field not in space.options:
            continue
        top = best[method]
        sampled = {key: float(top.params[key]) for key in HYPERPARAMETERS}
        options = options_from_params(method, top.params)
        sampled.update({key: options[key] for key in space.options if key in options})
        for budget in budgets:
            if top.trainable_pct <= budget:
                continue
            fits = [v for v in size_values(space.options[field]) if pct(method, {**options, field: v}) <= budget]
            if not fits:
                continue
            params = {**sampled, field: fits[0]}
            key = config_key(method, params)
            if key in tried or key in out:
                continue
            marks = {"phase": SEARCH, "default": False, "config_key": key, "carried_from": top.config_key}
            out[key] = {"method": method, method: params, "peftune": marks}
    return list(out.values())


def run_carried(definition: SweepDefinition, runnable, trial_logger, storage: str, callbacks: Sequence = (),
                verbose: int = 1) -> bool:  # fmt: skip
    """Train the carried trials not yet finished in the record (a partial run of one is replaced); return whether
    the user stopped them (Ctrl-C: the sweep is then interrupted). They are search trials: the trial logger records
    them, the confirmation reads them as candidates."""
    runs, version = trial_logger.runs(), trial_logger.record.version
    searched = [r for r in runs if legacy.run_phase(r.data.tags, version, r.info.run_id) == SEARCH]
    wanted = carried(definition, [r for r in searched if not r.data.tags.get(CARRIED_FROM)],
                     trainable_pct_of(definition.model, definition.tasks), version=version)  # fmt: skip
    ended = (COMPLETED, EARLY_STOPPED, FAILED)
    earlier = {legacy.run_config_key(r, version): r for r in searched if r.data.tags.get(CARRIED_FROM)}
    todo = []
    for config in wanted:
        run = earlier.get(config["peftune"]["config_key"])
        if run is not None and run.data.tags.get(STATUS) in ended:
            continue
        if run is not None:  # interrupted: it trains again, in one run only
            trial_logger.delete(run.info.run_id)
        todo.append(config)
    log.info("carried trials: %d proposed (each budget's size for a method's tuned setting), %d to train",
             len(wanted), len(todo))  # fmt: skip
    if not todo:
        return False
    return fit_rounds(definition, runnable, Rounds(todo, lambda: None), "carry",
                      console.Progress("carried", len(todo), definition.budget.epochs), storage, trial_logger,
                      callbacks, verbose)  # fmt: skip
