"""The search and scheduling policy of a sweep: an equal budget per method, stopping within a method.

``sweep/orchestrator.py`` runs the Ray Tune experiment; this module decides what runs and what stops.
:class:`PerMethodSearcher` keeps one seeded Optuna TPE study per method in a storage that outlives the driver,
enqueues each method's published default as its first trial, and hands trials out round-robin over the methods
with budget left (``trials_per_method`` trials, or that many full trials' worth of steps or tokens:
:class:`Allocation`). :class:`PerMethodScheduler` keeps one ASHA per method, so a trial is compared only with its
own method's, never before ``min_steps``. The joint and multi-objective searches (``StoredOptunaSearch``) keep one
study. Every trial's config carries its ``"peftune"`` tags (phase, default, config key, study and trial), and each
Optuna trial its Ray trial id and MLflow run id. Across a resume: Tune saves and restores the searcher, the studies
live in their storage, and the scheduler refills its rungs from the driver's record of results.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import optuna
from ray import tune
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, TrialScheduler
from ray.tune.search import Searcher
from ray.tune.search.optuna import OptunaSearch

from peftune.base.errors import UserError
from peftune.base.record_names import (
    DEFAULT,
    SCORE,
    SEARCH,
    config_key,
)
from peftune.core.pack import PACKABLE
from peftune.record.stores import sqlite_path
from peftune.sweep import spaces
from peftune.sweep.spaces import MethodSpace

METRIC, MODE = SCORE, "max"
DEFAULT_ATTR = DEFAULT  # user attribute of an enqueued default trial in its Optuna study: the record's tag's name
# user attributes linking an Optuna trial to its Ray trial and MLflow run (optuna-dashboard shows them); the
# MLflow run carries the way back as tags: peftune.optuna_study, peftune.optuna_trial (the trial's number)
RAY_TRIAL_ATTR, MLFLOW_RUN_ATTR = "ray_trial_id", "mlflow_run_id"
# user attribute of a trial the searcher was told had ended: what it spent in the budget's unit and its training
# seconds (None when unknown). A restore counts the method's spend from it (PerMethodSearcher.recount).
SPENT_ATTR = "peftune.spent"
ALL = "*"  # the one group of a scheduler shared by all methods (the joint search)


def study_name(sweep: str, method: str | None = None) -> str:
    """``<sweep>.<method>`` for a per-method study; ``<sweep>`` for the joint or multi-objective one."""
    return sweep if method is None else f"{sweep}.{method}"


def study_names(definition: spaces.SweepDefinition) -> list[str]:
    if per_method(definition):
        return [study_name(definition.name, method) for method in definition.methods]
    return [study_name(definition.name)]


def set_user_attr(storage, study: str, number: int, key: str, value: Any) -> None:
    """Set a user attribute of trial ``number`` of ``study`` through the storage's public interface (a finished or
    frozen trial included)."""
    trial_id = storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(study), number)
    storage.set_trial_user_attr(trial_id, key, value)


def default_storage_url(tracking_uri: str, storage_path: str) -> str:
    """SQLite beside the MLflow store when that is SQLite, else ``<storage path>/optuna.db`` (a local path)."""
    db = sqlite_path(tracking_uri)
    if db is not None:
        return f"sqlite:///{db.parent / 'optuna.db'}"
    if "://" in storage_path:
        raise UserError(
            f"the Optuna studies need a database: the tracking store ({tracking_uri}) is not SQLite and the "
            f"storage path {storage_path} is not local; pass --optuna-storage <database URL>"
        )
    Path(storage_path).mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{Path(storage_path).resolve() / 'optuna.db'}"


def rung_fractions(rungs: int, reduction_factor: int) -> list[float]:
    """The data-fidelity rungs below the whole run: ``rungs=3, reduction_factor=3`` -> [1/9, 1/3].

    The same floats as ASHA's milestones (grace period 1/rf^(rungs-1), times rf^k), so a trial
    reporting at a fraction reaches the rung of that fraction.
    """
    grace = float(reduction_factor) ** -(rungs - 1)
    return [grace * reduction_factor**k for k in range(rungs - 1)]


SPENT_RESULT = {"steps": "steps", "tokens": "tokens_seen"}  # the trial result a budget in that unit counts


@dataclass
class Allocation:
    """Each method's share of the search budget and what its trials spent: who may start a trial next.

    ``unit`` "trials": ``budget[m]`` trials. "steps" or "tokens": ``budget[m]`` full trials' worth of optimizer steps
    or training tokens (``full_cost`` each: a full run on the reference input, no virtual tokens). A finished trial
    counts what it trained (one that ASHA stopped early, its part), a running one reserves its method's expected
    cost (the mean of its finished trials' costs; ``full_cost`` before any), and a method starts a trial while at
    least half that cost is left: each method's spend ends within about half a trial of its share. A method gets at
    most ``cap`` trials (as if every one stopped at ``min_fraction``, the first rung).
    """

    unit: str
    budget: dict[str, int]  # method -> its share: trials_per_method of the unit
    full_cost: float = 1.0
    min_fraction: float = 1.0
    steps_per_run: int = 0  # a full trial's optimizer steps (the rungs that stay depend on them: live_rungs)
    costs: dict[str, list[float]] = field(default_factory=dict)  # method -> each finished trial's cost (if it trained)

    def cap(self, method: str) -> int:
        if self.unit == "trials":
            return self.budget[method]
        return math.ceil(self.budget[method] / self.min_fraction)

    def spent(self, method: str) -> float:
        """The steps or tokens the finished trials of ``method`` trained."""
        return sum(self.costs.get(method, ()))

    def expected(self, method: str) -> float:
        costs = self.costs.get(method)
        return sum(costs) / len(costs) if costs else self.full_cost

    def cost(self, result: dict) -> float | None:
        """What a finished trial whose last result is ``result`` spent of its method's share (None: not counted,
        the unit is trials or it failed before it trained)."""
        if self.unit == "trials":
            return None
        cost = float(result.get(SPENT_RESULT[self.unit]) or 0.0)
        return cost if cost > 0 else None

    def record(self, method: str, result: dict) -> None:
        """A finished trial of ``method`` with its last ``result`` (empty when it failed before reporting)."""
        cost = self.cost(result)
        if cost is not None:
            self.costs.setdefault(method, []).append(cost)

    def may_start(self, method: str, handed: int, running: int) -> bool:
        if handed >= self.cap(method):
            return False
        if self.unit == "trials":
            return True
        left = self.budget[method] * self.full_cost - self.spent(method) - running * self.expected(method)
        return left >= self.expected(method) / 2

    def exhausted(self, method: str, handed: int, running: int) -> bool:
        """No trial of ``method`` will start again (one running may still free its reservation otherwise)."""
        if self.unit == "trials":
            return handed >= self.cap(method)
        return running == 0 and not self.may_start(method, handed, 0)

    def trials_bound(self) -> int:
        """The most trials the search can run: Tune's ``num_samples``."""
        return sum(self.cap(m) for m in self.budget)

    def state(self) -> dict:
        return {"costs": {m: list(c) for m, c in self.costs.items()}}


def allocation(definition: spaces.SweepDefinition, steps_per_run: int = 0, tokens_per_run: int = 0) -> Allocation:
    """The per-method budget of ``definition``: ``steps_per_run`` and ``tokens_per_run`` are a full trial's, on
    the reference input (``orchestrator.steps_per_run``, ``orchestrator.tokens_per_run``)."""
    unit = definition.search.unit
    full_cost = {"trials": 1.0, "steps": float(steps_per_run), "tokens": float(tokens_per_run)}[unit]
    if full_cost <= 0:
        raise UserError(f"search.unit {unit}: a full trial's {unit} are unknown (no training rows?)")
    budget = dict.fromkeys(definition.methods, definition.budget.trials_per_method)
    return Allocation(unit, budget, full_cost, min_fraction(definition, steps_per_run), steps_per_run)


def min_fraction(definition: spaces.SweepDefinition, steps_per_run: int | None = None) -> float:
    """The smallest part of a full run at which the scheduler can stop a trial (1: it never stops one)."""
    scheduler = definition.scheduler
    if scheduler.type == "none" or definition.multi_objective:
        return 1.0
    if scheduler.fidelity == "data":
        return min(live_rungs(definition, steps_per_run), default=1.0)
    return min(1.0, scheduler.grace_period / definition.budget.epochs)


def search_finished(allocation: Allocation, results: list[tuple[str, dict]]) -> bool:
    """Whether a per-method search whose trials ended with ``results`` ((method, last result) each) is over."""
    allocation = dataclasses.replace(allocation, costs={})  # counted from ``results`` alone
    handed: dict[str, int] = {}
    for method, result in results:
        handed[method] = handed.get(method, 0) + 1
        allocation.record(method, result)
    return all(allocation.exhausted(m, handed.get(m, 0), 0) for m in allocation.budget)


# ----------------------------------------------------------------------------- the searcher


class PerMethodSearcher(Searcher):
    """One seeded TPE study per method; round-robin over the methods that still have budget, within a round the
    slowest method (its finished trials' mean training seconds) first, so that the phase does not end on one long
    trial (a length-100 prompt) running alone while the other slots idle.

    A fresh sweep seeds method ``i``'s sampler with ``seed + i``; a resumed one adds a multiple of
    the trials its study already holds, so that the restarted sampler draws new configurations.

    Reproducible by default: a method's next trial is asked only once its earlier trials have all
    reported, so each study's draws (TPE counts only finished trials, also to end its random start)
    and each method's ASHA decisions (taken on earlier trials that all finished) do not depend on
    timing or on the number of workers; the methods run side by side, so the slots stay busy while
    there are at least as many methods as slots. ``asynchronous``: hand out the next trial of a
    method while others of it still run (more parallel for few methods on many workers; the draws
    then depend on which results came first).
    """

    def __init__(
        self,
        method_spaces: dict[str, MethodSpace],
        *,
        sweep: str,
        allocation: Allocation,
        storage_url: str,
        seed: int = 0,
        n_startup_trials: int = 10,
        asynchronous: bool = False,
        pack_sizes: dict[str, int] | None = None,
    ):
        super().__init__(metric=METRIC, mode=MODE)
        self.asynchronous = asynchronous
        # method -> how many of its trials may train as one pack (peftune.sweep.packing): they are handed out as a
        # round, one after another, asked of its study with the same trials told
        self.pack_sizes = dict(pack_sizes or {})
        self.rounds: dict[str, int] = {}  # method -> trials handed in its open round
        self.spaces = dict(method_spaces)
        self.sweep, self.storage_url, self.seed = sweep, storage_url, seed
        self.n_startup_trials = n_startup_trials
        self.allocation = allocation  # each method's share of the search, and what its trials spent
        self.budget = self.allocation.budget  # method -> its trials (one dict: a restore updates both)
        self.handed = {m: 0 for m in self.spaces}  # trials handed out per method
        self.live: dict[str, list] = {}  # Ray trial id -> [method, Optuna trial number]
        self.seconds: dict[str, list[float]] = {}  # method -> its finished trials' training seconds
        self._studies: dict[str, Any] = {}
        self._storage = None

    # the studies are rebuilt from the storage after unpickling (Tune pickles the searcher)
    def __getstate__(self):
        state = dict(self.__dict__)
        state["_studies"], state["_storage"] = {}, None
        return state

    def storage(self):
        if getattr(self, "_storage", None) is None:  # a searcher pickled before it kept its storage has none
            self._storage = optuna.storages.RDBStorage(self.storage_url)
        return self._storage

    def study(self, method: str):
        if method not in self._studies:
            warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning, module="optuna")
            index = list(self.spaces).index(method)
            storage = self.storage()
            try:  # a resumed study: its sampler must not replay the random draws of the first session
                asked = len(optuna.load_study(study_name=study_name(self.sweep, method), storage=storage).trials)
            except KeyError:
                asked = 0
            sampler = optuna.samplers.TPESampler(
                seed=self.seed + index + 7919 * asked, n_startup_trials=self.n_startup_trials, multivariate=True
            )
            study = optuna.create_study(
                study_name=study_name(self.sweep, method),
                storage=storage,
                sampler=sampler,
                direction="maximize",
                load_if_exists=True,
            )
            default = self.spaces[method].default
            if default and not study.get_trials(deepcopy=False):
                study.enqueue_trial(default, user_attrs={DEFAULT_ATTR: True})
            self._studies[method] = study
        return self._studies[method]

    def next_method(self) -> str | None:
        """The method with the fewest trials handed out among those with budget left and, unless ``asynchronous``,
        none of its trials running; None when every open method is running. Ties: the slowest method first (one
        not yet timed before any timed one), then the listed order."""
        asynchronous = getattr(self, "asynchronous", True)  # a searcher pickled before the option was async
        running = self.running()
        ready = [m for m in self.spaces if self.budgets().may_start(m, self.handed[m], running[m])]
        filling = [m for m in ready if running[m] and self.open_round(m) < self.pack_size(m)]
        if filling:  # a pack's round is being handed out: its next member first
            return filling[0]
        ready = [m for m in ready if asynchronous or not running[m]]
        return min(ready, key=lambda m: (self.handed[m], -self.mean_seconds(m))) if ready else None

    def pack_size(self, method: str) -> int:
        return getattr(self, "pack_sizes", {}).get(method, 1)  # a searcher pickled before packing: 1

    def open_round(self, method: str) -> int:
        """The trials of ``method`` handed in its current round (a round opens when none of its trials runs)."""
        return getattr(self, "rounds", {}).get(method, 0)

    def mean_seconds(self, method: str) -> float:
        """The mean training seconds of ``method``'s finished trials; inf before any (unknown: maybe the longest)."""
        seconds = self.timings().get(method)
        return sum(seconds) / len(seconds) if seconds else math.inf

    def timings(self) -> dict[str, list[float]]:
        if getattr(self, "seconds", None) is None:  # a searcher pickled before it timed trials
            self.seconds = {}
        return self.seconds

    def budgets(self) -> Allocation:
        if getattr(self, "allocation", None) is None:  # a searcher pickled before budgets had units: in trials
            self.allocation = Allocation("trials", self.budget)
        return self.allocation

    def running(self) -> dict[str, int]:
        return {m: sum(method == m for method, _ in self.live.values()) for m in self.spaces}

    def finished(self) -> bool:
        running = self.running()
        return all(self.budgets().exhausted(m, self.handed[m], running[m]) for m in self.spaces)

    def suggest(self, trial_id: str) -> dict | str | None:
        if self.finished():
            return Searcher.FINISHED
        method = self.next_method()
        if method is None:
            return None  # every open method has a trial running: Tune asks again when one reports
        orphan = self.orphan(method)
        if orphan is not None:  # asked after Tune's last state save, then the driver died: the same trial again
            known = {**orphan.params, **_fixed(self.spaces[method])}
            params = {name: known[name] for name in self.spaces[method].params()}
            number, is_default = orphan.number, bool(orphan.user_attrs.get(DEFAULT_ATTR))
        else:
            optuna_trial = self.study(method).ask()
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Fixed parameter .* is out of range")  # a default outside
                params = _suggest(optuna_trial, self.spaces[method])
            number, is_default = optuna_trial.number, bool(optuna_trial.user_attrs.get(DEFAULT_ATTR))
        self.handed[method] += 1
        if not hasattr(self, "rounds"):  # a searcher pickled before packing
            self.rounds = {}
        self.rounds[method] = self.open_round(method) + 1 if self.running()[method] else 1
        self.live[trial_id] = [method, number]
        name = study_name(self.sweep, method)
        set_user_attr(self.storage(), name, number, RAY_TRIAL_ATTR, trial_id)  # an orphan's: its new Ray trial
        marks = {"phase": SEARCH, "default": is_default, "config_key": config_key(method, params)}
        marks.update(optuna_study=name, optuna_trial=number)
        return {"method": method, method: params, "peftune": marks}

    def orphan(self, method: str):
        """An Optuna trial of ``method`` asked but neither told nor held by a live Ray trial, if any.

        That is a trial handed out after Tune's last saved state, by a driver that was then killed:
        handing it out again (same parameters, same Optuna trial) runs no configuration twice.
        """

        held = {number for m, number in self.live.values() if m == method}
        searched = set(self.spaces[method].params()) - set(_fixed(self.spaces[method]))
        study = self.study(method)
        for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            if trial.number in held:
                continue
            if set(trial.params) >= searched:
                return trial
            study.tell(trial.number, state=optuna.trial.TrialState.FAIL)  # killed before its parameters were drawn
        return None

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        entry = self.live.pop(trial_id, None)
        if entry is None:
            return
        method, number = entry
        storage = self.storage()
        study_id = storage.get_study_id_from_name(study_name(self.sweep, method))
        optuna_id = storage.get_trial_id_from_study_id_trial_number(study_id, number)
        if storage.get_trial(optuna_id).state.is_finished():  # told by a driver killed before Tune saved: run again
            return
        result = result or {}
        seconds = result.get("train_time_s") or result.get("fidelity_train_time_s")  # the latter: stopped at a rung
        # the study first: it is what a restore counts from (recount), Tune's saved state can be older
        storage.set_trial_user_attr(optuna_id, SPENT_ATTR, {"cost": self.budgets().cost(result), "seconds": seconds})
        self.budgets().record(method, result)
        if seconds:
            self.timings().setdefault(method, []).append(float(seconds))
        score = result.get(METRIC)
        if error or score is None or not math.isfinite(score):
            self.study(method).tell(number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
        else:  # a trial stopped early counts with its last score, as OptunaSearch does
            self.study(method).tell(number, float(score), skip_if_finished=True)

    def recount(self) -> None:
        """Each method's trials handed out, what they spent and their timings, counted again from its study.

        Every ask and tell reaches the study at once, while Tune saves its state (and this searcher's) every few
        seconds: a trial asked and told between a save and a killed driver is in the study only. Counted from the
        saved state, its method would get it again on top of its budget. A trial counts once handed out (it has
        its Ray trial id), unless it is an orphan, which is counted when it is handed out again.
        """
        held = {tuple(entry) for entry in self.live.values()}
        for method in self.spaces:
            handed, costs, seconds, complete = 0, [], [], True
            for trial in self.study(method).get_trials(deepcopy=False):
                if RAY_TRIAL_ATTR not in trial.user_attrs:
                    continue  # asked, then the driver was killed before it was handed out (orphan tells it FAIL)
                if not trial.state.is_finished():
                    handed += (method, trial.number) in held
                    continue
                handed += 1
                spent = trial.user_attrs.get(SPENT_ATTR)
                if spent is None:  # ended in a sweep begun before the study kept it: the saved state's costs stand
                    complete = False
                    continue
                if spent["cost"] is not None:
                    costs.append(float(spent["cost"]))
                if spent["seconds"]:
                    seconds.append(float(spent["seconds"]))
            self.handed[method] = max(handed, self.handed[method])  # a study from before the Ray ids: the saved count
            for kept, counted in ((self.budgets().costs, costs), (self.timings(), seconds)) if complete else ():
                kept.pop(method, None)
                if counted:
                    kept[method] = counted

    def get_state(self) -> dict:
        state = {"handed": dict(self.handed), "live": dict(self.live), "budget": dict(self.budget)}
        state["seconds"] = {m: list(v) for m, v in self.timings().items()}
        state["rounds"] = dict(getattr(self, "rounds", {}))  # each pack's round handed so far
        return {**state, "allocation": self.budgets().state()}

    def set_state(self, state: dict) -> None:
        self.handed.update(state["handed"])
        self.live = {k: list(v) for k, v in state["live"].items()}
        self.budget.update(state["budget"])
        self.seconds = {m: list(v) for m, v in state.get("seconds", {}).items()}
        self.rounds = dict(state.get("rounds", {}))
        self.budgets().costs.update(state.get("allocation", {}).get("costs", {}))
        self.recount()

    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "w") as file:
            json.dump(self.get_state(), file)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path) as file:
            self.set_state(json.load(file))


def _fixed(space: MethodSpace) -> dict[str, Any]:
    return {name: param.value for name, param in space.params().items() if isinstance(param, spaces.Fixed)}


def _suggest(optuna_trial, space: MethodSpace) -> dict[str, Any]:
    """The method's parameters (plain names: the study is the method's own); fixed ones as constants."""
    return {
        name: param.value if isinstance(param, spaces.Fixed) else param.suggest(optuna_trial, name)
        for name, param in space.params().items()
    }


class RunLinks(tune.Callback):
    """Gives each Optuna trial its MLflow run id (``MLFLOW_RUN_ATTR``) at its first result after the record knows
    the run: while the trial still runs, since Optuna freezes a told trial's attributes.

    ``run_id(ray trial id)`` answers from the driver's memory (the tracking buffer), never from the store, so a
    tracking outage holds up nothing; a trial whose run the store took only after the trial ended keeps its Ray
    trial id alone (its MLflow run still names its study and Optuna trial).
    """

    def __init__(self, storage_url: str, run_id: Callable[[str], str | None]):
        self.storage_url, self.run_id = storage_url, run_id
        self.linked: set[str] = set()
        self._storage = None

    def on_trial_result(self, iteration, trials, trial, result, **info):
        marks = trial.config.get("peftune") or {}
        if trial.trial_id in self.linked or "optuna_trial" not in marks:
            return  # linked already, or not an Optuna trial (a confirmation run)
        run_id = self.run_id(trial.trial_id)
        if run_id is None:
            return
        if self._storage is None:
            self._storage = optuna.storages.RDBStorage(self.storage_url)
        with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):  # told already: it stays unlinked
            set_user_attr(self._storage, marks["optuna_study"], int(marks["optuna_trial"]), MLFLOW_RUN_ATTR, run_id)
        self.linked.add(trial.trial_id)


class StoredOptunaSearch(OptunaSearch):
    """Ray's ``OptunaSearch`` (the joint and the multi-objective search) on a study in the Optuna storage.

    The study outlives the driver like the per-method ones (``optuna-dashboard`` opens it, a resume goes on
    with it); each Optuna trial gets its Ray trial id as a user attribute, and each Ray trial's config the
    study's name and the Optuna trial's number (the ``peftune`` marks: tags of its MLflow run).
    """

    def __init__(self, space, *, storage_url: str, study: str, **options):
        storage = optuna.storages.RDBStorage(storage_url)
        super().__init__(space, storage=storage, study_name=study, **options)
        self.peftune_storage, self.peftune_study = storage, study
        self.numbers: dict[str, int] = {}  # Ray trial id -> Optuna trial number

    def suggest(self, trial_id: str) -> dict | None:
        config = super().suggest(trial_id)
        if not isinstance(config, dict):
            return config
        if trial_id not in self.numbers:
            self.numbers[trial_id] = self._just_asked()
            set_user_attr(self.peftune_storage, self.peftune_study, self.numbers[trial_id], RAY_TRIAL_ATTR, trial_id)
        marks = {"phase": SEARCH, "optuna_study": self.peftune_study, "optuna_trial": self.numbers[trial_id]}
        return {**config, "peftune": marks}

    def _just_asked(self) -> int:
        """The trial OptunaSearch has just asked: the newest running one not yet given to a Ray trial (one driver
        per sweep asks in this study, and it asks one trial at a time)."""
        study_id = self.peftune_storage.get_study_id_from_name(self.peftune_study)
        running = self.peftune_storage.get_all_trials(
            study_id, deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)
        )
        return max(t.number for t in running if RAY_TRIAL_ATTR not in t.user_attrs)


# ----------------------------------------------------------------------------- the scheduler


class PerMethodScheduler(FIFOScheduler):
    """One stock ASHA per method, so a trial is only stopped by comparison with its own method's trials.

    ``per_method=False`` (the joint search) keeps one ASHA for all trials, with the same floor and refill.

    ``history``: an object with ``results() -> {trial_id: (method, [result, ...])}`` (the sweep's results so
    far); the rungs are refilled from it after a restore.
    """

    def __init__(
        self,
        methods: list[str],
        *,
        max_t: int,
        grace_period: int = 1,
        reduction_factor: int = 2,
        time_attr: str = "epoch",
        min_steps: int = 0,
        history=None,
        per_method: bool = True,
    ):
        super().__init__()
        self.settings = dict(
            methods=list(methods) if per_method else [ALL],
            max_t=max_t,
            grace_period=grace_period,
            reduction_factor=reduction_factor,
            time_attr=time_attr,
            min_steps=min_steps,
            history=history,
        )
        self._fresh()

    def _fresh(self) -> None:
        s = self.settings
        self.min_steps = s["min_steps"]
        self.history = s["history"]
        self.by_method = {
            m: ASHAScheduler(
                metric=METRIC,
                mode=MODE,
                time_attr=s["time_attr"],
                max_t=s["max_t"],
                grace_period=min(s["grace_period"], s["max_t"]),
                reduction_factor=s["reduction_factor"],
            )
            for m in s["methods"]
        }
        self.added: set[str] = set()
        self.refilled = self.history is None

    def __getstate__(self):  # rungs are rebuilt from the record, not pickled
        return {"settings": self.settings}

    def __setstate__(self, state):
        FIFOScheduler.__init__(self)
        self.settings = state["settings"]
        self._fresh()

    @property
    def metric(self):
        return METRIC

    def set_search_properties(self, metric, mode, **spec) -> bool:
        return metric in (None, METRIC) and mode in (None, MODE)

    def _asha(self, trial) -> ASHAScheduler:
        return self.by_method[trial.config["method"] if ALL not in self.by_method else ALL]

    def refill(self) -> None:
        """Feed each method's ASHA the results recorded before a restore, as if it had seen them."""
        self.refilled = True
        for trial_id, (method, results) in self.history.results().items():
            if method not in self.by_method and ALL not in self.by_method:
                continue
            trial = SimpleNamespace(trial_id=trial_id, config={"method": method})  # ASHA keys rungs by trial id
            self._add(None, trial)
            for result in results:
                self.on_trial_result(None, trial, result)

    def _add(self, tune_controller, trial) -> None:
        if trial.trial_id not in self.added:
            self.added.add(trial.trial_id)
            self._asha(trial).on_trial_add(tune_controller, trial)

    def on_trial_add(self, tune_controller, trial) -> None:
        if not self.refilled:
            self.refill()
        self._add(tune_controller, trial)

    def on_trial_result(self, tune_controller, trial, result: dict) -> str:
        if result.get("steps", math.inf) < self.min_steps:
            return TrialScheduler.CONTINUE  # below the floor: not judged yet
        self._add(tune_controller, trial)
        return self._asha(trial).on_trial_result(tune_controller, trial, result)

    def on_trial_complete(self, tune_controller, trial, result: dict) -> None:
        if trial.trial_id in self.added:
            self.added.discard(trial.trial_id)
            self._asha(trial).on_trial_complete(tune_controller, trial, result)

    def on_trial_error(self, tune_controller, trial) -> None:
        self.on_trial_remove(tune_controller, trial)

    def on_trial_remove(self, tune_controller, trial) -> None:
        if trial.trial_id in self.added:
            self.added.discard(trial.trial_id)
            self._asha(trial).on_trial_remove(tune_controller, trial)

    def debug_string(self) -> str:
        return "Per-method ASHA: " + "; ".join(f"{m}: {a.debug_string()}" for m, a in self.by_method.items())


# ----------------------------------------------------------------------------- building them for a sweep


def per_method(definition: spaces.SweepDefinition) -> bool:
    """An equal budget per method (``peftune.sweep.search``); the multi-objective search stays joint."""
    return definition.search.allocation == "per_method" and not definition.multi_objective


@dataclass
class ConditionalSpace:
    """Optuna define-by-run space: ``method``, then that method's own parameters as ``<method>/<param>`` (TPE
    models each method's lr apart); a module-level class, not a closure: Ray pickles the searcher with it."""

    spaces: dict[str, MethodSpace]

    def __call__(self, trial) -> dict[str, Any]:
        method = trial.suggest_categorical("method", list(self.spaces))
        constants = {}
        for name, param in self.spaces[method].params().items():
            if isinstance(param, spaces.Fixed):  # returned, not suggested: Optuna has nothing to learn
                constants[f"{method}/{name}"] = param.value
            else:
                param.suggest(trial, f"{method}/{name}")
        return constants


def make_searcher(
    definition: spaces.SweepDefinition, storage_url: str | None = None, budgets: Allocation | None = None
):
    """``storage_url``: the Optuna storage of the sweep's studies (needed with ``allocation: per_method``; without
    it the joint or multi-objective study stays in memory, which only a test that never resumes should want);
    ``budgets``: the per-method budget (:func:`allocation`; default: ``trials_per_method`` trials each)."""
    if per_method(definition):
        if storage_url is None:
            raise UserError("a per-method search needs an Optuna storage URL")
        return PerMethodSearcher(
            definition.spaces,
            sweep=definition.name,
            allocation=budgets or allocation(definition),
            storage_url=storage_url,
            seed=definition.seed,
            n_startup_trials=definition.search.n_startup_trials,
            asynchronous=definition.search.asynchronous,
            pack_sizes=pack_sizes(definition),
        )

    # TPE's `group` (conditional spaces) is flagged experimental; it is what a per-method space needs
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning, module="optuna")

    search, seed = definition.search, definition.seed
    space = ConditionalSpace(definition.spaces)
    if definition.multi_objective:
        metric, mode = (list(x) for x in zip(*spaces.MULTI_OBJECTIVE, strict=True))
        if search.sampler == "nsga2":
            population = max(4, min(50, definition.search_trials // 4))
            sampler = optuna.samplers.NSGAIISampler(seed=seed, population_size=population)
        else:
            sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=search.n_startup_trials)
    else:  # multivariate + group: TPE models each method's parameters jointly, conditioned on the method
        metric, mode = METRIC, MODE
        sampler = optuna.samplers.TPESampler(
            seed=seed, n_startup_trials=search.n_startup_trials, multivariate=True, group=True
        )
    if storage_url is None:
        return OptunaSearch(space, metric=metric, mode=mode, sampler=sampler)
    return StoredOptunaSearch(
        space, storage_url=storage_url, study=study_name(definition.name), metric=metric, mode=mode, sampler=sampler
    )


def pack_sizes(definition: spaces.SweepDefinition) -> dict[str, int]:
    """Each method whose trials may pack, and how many to a pack (``resources.pack_size``; see
    peftune.sweep.packing)."""
    size = definition.resources.pack_size
    return {method: size for method in definition.spaces if size > 1 and method in PACKABLE}


def live_rungs(definition: spaces.SweepDefinition, steps_per_run: int | None = None) -> list[float]:
    """The data-fidelity rungs (fractions of the run) a trial of ``steps_per_run`` optimizer steps can be judged
    at: those under the ``min_steps`` floor are dropped, so a cheap budget gets fewer rungs, not dead ones
    (the cpu preset's 1/9 of 150 steps is 17, under its floor of 20). ``steps_per_run`` None: all of them."""
    scheduler = definition.scheduler
    fractions = rung_fractions(scheduler.rungs, scheduler.reduction_factor)
    if not steps_per_run:
        return fractions
    return [f for f in fractions if f * steps_per_run >= scheduler.min_steps]


def fidelity_settings(definition: spaces.SweepDefinition, steps_per_run: int | None = None) -> dict[str, Any]:
    """The TrainConfig settings a data-fidelity scheduler needs: reports at its rungs within the run."""
    if definition.scheduler.type == "none" or definition.multi_objective or definition.scheduler.fidelity != "data":
        return {}
    return {"report_fractions": live_rungs(definition, steps_per_run)}


def make_scheduler(definition: spaces.SweepDefinition, history=None, steps_per_run: int | None = None):
    """``history``: ``trial_logger.RecordedResults`` of the sweep, from which a per-method scheduler refills its rungs;
    ``steps_per_run``: a trial's optimizer steps, which decides the rungs that stay (:func:`live_rungs`)."""
    if definition.scheduler.type == "none" or definition.multi_objective:
        return None
    # ASHA per method (or one for all, in the joint search) that refills its rungs from the sweep's results on a restore
    data = definition.scheduler.fidelity == "data"  # rungs in the fraction of the run's examples seen
    fractions = live_rungs(definition, steps_per_run)
    return PerMethodScheduler(
        definition.methods,
        max_t=1.0 if data else definition.budget.epochs,
        grace_period=(fractions[0] if fractions else 1.0) if data else definition.scheduler.grace_period,
        time_attr="progress" if data else "epoch",
        reduction_factor=definition.scheduler.reduction_factor,
        min_steps=definition.scheduler.min_steps,
        history=history,
        per_method=per_method(definition),
    )
