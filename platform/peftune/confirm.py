"""Confirmation: the best configurations of every method, re-trained with several seeds after the search.

One search trial is one draw of noise: on a dev set of a few hundred examples a single accuracy
moves by about +-0.02 from seed to seed, as much as most gaps between methods. So after the search,
:func:`run_confirmation` takes the best ``confirm.top_k`` configurations of EVERY method (not only
the global frontier: a method's rank must not rest on one lucky run), and re-trains each with
``confirm.seeds`` new seeds at the full budget, as trials of a second Ray Tune experiment (same
trainable, resources, ``TrialLogger`` and concurrency as the search: the cluster stays full),
recorded as child runs of the sweep's parent run.

Which trials are candidates: search trials with a best score, ``completed`` ones first (they ran
the full budget), then ``early_stopped`` ones, each group by best dev score; one per configuration
key (a configuration tried twice counts once). With ``confirm.defaults`` each method's default
(control-arm) trial is confirmed as well, so the tuning gain compares seed means on both sides.

Seeds: ``definition.seed + 1 .. + S``. The search trained every trial with ``definition.seed``, and
the candidates were chosen because that run scored well: re-using its seed would re-count the lucky
draw that selected them (the winner's curse); new seeds give unbiased means.

The record (see ``peftune.tracking``): a confirmation trial's child run has the tags
``peftune.phase=confirm``, ``peftune.config_key=<key of the search trial it confirms>``,
``peftune.seed=<seed>``, ``peftune.default=true|false`` and ``peftune.confirms=<run id of that
search trial>``, and the search trial's params with its own ``seed``. A search trial written before
``peftune.config_key`` existed counts as its own configuration.

Resuming: (config key, seed) identifies a confirmation trial. A re-run skips every pair whose run
is ``completed`` in MLflow; a pair whose run was interrupted or failed is trained again, and its
earlier partial run is deleted from the record first (MLflow's soft delete: ``mlflow runs restore``
brings it back), so the record holds exactly one child run per pair. Each run of the confirmation
is a fresh Tune experiment (``<sweep>-confirm-<n>``): no Tune state is restored, so nothing depends
on Ray's private objects or on callbacks pickled by an earlier run.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from peftune.record import COMPLETED, EARLY_STOPPED, FAILED, ROLE, STATUS

log = logging.getLogger("peftune.confirm")

PHASE, DEFAULT, CONFIG_KEY, SEED, CONFIRMS = (
    "peftune.phase",
    "peftune.default",
    "peftune.config_key",
    "peftune.seed",
    "peftune.confirms",
)
SEARCH, CONFIRM = "search", "confirm"
COMMON = ("lr", "dropout", "weight_decay")  # the hyperparameters every method has


# ----------------------------------------------------------------------------- configurations


def run_phase(tags: Mapping[str, str]) -> str:
    """A child run's phase; runs written before the tag existed are search trials."""
    return tags.get(PHASE) or SEARCH


def run_config_key(run) -> str:
    """The run's ``peftune.config_key`` tag (see :func:`peftune.search.config_key`).

    A run without the tag (written before it existed) is its own configuration: re-hashing logged
    params would not give the key the search computed from the sampled ones.
    """
    return run.data.tags.get(CONFIG_KEY) or f"run:{run.info.run_id}"


@dataclass(frozen=True)
class Candidate:
    """A search trial chosen for confirmation."""

    config_key: str
    method: str
    run_id: str  # the search trial's child run
    score: float  # its best dev score in the search
    status: str
    default: bool  # the method's control-arm (default) trial
    params: dict  # its MLflow params, as logged (strings)


def select_candidates(runs: Sequence, top_k: int, defaults: bool = False) -> list[Candidate]:
    """The best ``top_k`` configurations of every method among the search trials ``runs`` (MLflow child runs).

    Order within a method: completed before early-stopped, then best dev score, then start time; failed
    and unfinished trials are never candidates. With ``defaults``, each method's default trial is added.
    """
    by_method: dict[str, dict[str, Candidate]] = {}
    for run in sorted(runs, key=lambda r: (r.info.start_time or 0, r.info.run_id)):
        tags, metrics = run.data.tags, run.data.metrics
        if tags.get(ROLE, "trial") != "trial" or run_phase(tags) != SEARCH:
            continue
        score, status = metrics.get("best_score"), tags.get(STATUS)
        if status not in (COMPLETED, EARLY_STOPPED) or score is None or not math.isfinite(score):
            continue
        candidate = Candidate(
            run_config_key(run),
            run.data.params.get("method") or tags.get("peftune.method", ""),
            run.info.run_id,
            float(score),
            status,
            tags.get(DEFAULT, "false") == "true",
            dict(run.data.params),
        )
        known = by_method.setdefault(candidate.method, {})
        if candidate.config_key not in known or _rank(candidate) < _rank(known[candidate.config_key]):
            known[candidate.config_key] = candidate
    chosen = []
    for candidates in by_method.values():
        ranked = sorted(candidates.values(), key=_rank)  # stable: the earlier trial first on a tie
        picked = ranked[:top_k]
        if defaults:
            picked += [c for c in ranked[top_k:] if c.default][:1]
        chosen += picked
    return chosen


def _rank(candidate: Candidate) -> tuple:
    return (candidate.status != COMPLETED, -candidate.score)


def confirm_seeds(base_seed: int, seeds: int) -> list[int]:
    """The confirmation seeds: new ones (see the module docstring)."""
    return [base_seed + 1 + i for i in range(seeds)]


def method_options(method: str, params: Mapping[str, str]) -> dict:
    """The ``method.<field>`` params of a run, typed back into the method config's fields."""
    from peftune.methods import get_method

    config_cls = get_method(method).config_cls
    hints = typing.get_type_hints(config_cls)
    options = {}
    for field in dataclasses.fields(config_cls):
        key = f"method.{field.name}"
        if field.name != "dropout" and key in params:
            options[field.name] = parse_value(str(params[key]), hints[field.name])
    return options


def parse_value(text: str, hint):
    """A logged param (``str(value)``, lists comma-joined) -> the type a config field declares."""
    if text == "None":
        return None
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    if typing.get_origin(hint) in (list, tuple):
        item = (typing.get_args(hint) or (str,))[0]
        return [parse_value(part.strip(), item) for part in text.split(",") if part.strip()]
    if hint is bool:
        return text == "True"
    if hint is int:
        return int(float(text))
    if hint is float:
        return float(text)
    return text


def trial_config(candidate: Candidate, seed: int) -> dict:
    """The Ray trial config that re-trains ``candidate`` with ``seed`` (the shape the search's trials have)."""
    params, method = candidate.params, candidate.method
    sampled = {key: float(params[key]) for key in COMMON}
    sampled.update(method_options(method, params))
    return {
        "method": method,
        method: sampled,
        "peftune": {
            "phase": CONFIRM,
            "config_key": candidate.config_key,
            "seed": seed,
            "default": candidate.default,  # a bool: the record tag is written from it
            "confirms": candidate.run_id,
        },
    }


# ----------------------------------------------------------------------------- the confirmation


@dataclass
class ConfirmationResult:
    status: str  # completed | interrupted | skipped (confirm.seeds or top_k is 0)
    wanted: int  # confirmation trials the definition asks for: candidates x seeds
    finished: int  # of those, with a final status (completed or failed) in the record
    ran: int  # trials started by this call
    deleted: list[str]  # partial runs of interrupted or failed pairs, deleted before they ran again


def config_list_searcher(configs: Sequence[dict]):
    """A Tune ``Searcher`` that hands out ``configs`` in order, then reports itself finished.

    A ``Searcher`` (not a variant generator) so that Tune applies ``max_concurrent_trials`` to it.
    """
    from ray.tune.search import Searcher

    class ConfigList(Searcher):
        def __init__(self, configs):
            super().__init__(metric="score", mode="max")
            self.configs = [dict(c) for c in configs]

        def suggest(self, trial_id: str):
            return self.configs.pop(0) if self.configs else Searcher.FINISHED

        def on_trial_complete(self, trial_id: str, result=None, error: bool = False) -> None:
            pass  # nothing to learn: every configuration is fixed

    return ConfigList(configs)


def confirmation_runs(client, record) -> list:
    """The confirmation child runs of the sweep (active ones)."""
    from peftune.tracking import child_runs

    runs = child_runs(client, record.experiment_id, record.parent_run_id)
    return [r for r in runs if run_phase(r.data.tags) == CONFIRM]


def run_confirmation(
    definition,
    record,
    runnable,
    *,
    trial_logger,
    storage: str,
    callbacks: Sequence = (),
    verbose: int = 1,
    flush_s: float = 600.0,
) -> ConfirmationResult:
    """Confirm the best configurations of every method of the finished search (see the module docstring).

    ``runnable``: the search's trainable with its parameters and resources; ``trial_logger``: the search's
    ``TrialLogger`` (it records these trials too); ``storage``: the search's Tune storage URI;
    ``callbacks``: extra ``tune.Callback`` objects for this run.
    """
    from ray import tune

    from peftune.sweep import trial_name
    from peftune.tracking import child_runs

    settings = definition.confirm
    if settings.seeds == 0 or (settings.top_k == 0 and not settings.defaults):
        return ConfirmationResult("skipped", 0, 0, 0, [])
    client = _mlflow_client(record.tracking_uri)
    runs = child_runs(client, record.experiment_id, record.parent_run_id)
    candidates = select_candidates(runs, settings.top_k, settings.defaults)
    seeds = confirm_seeds(definition.seed, settings.seeds)
    wanted = [(c, s) for c in candidates for s in seeds]
    existing = {(run_config_key(r), r.data.tags.get(SEED)): r for r in runs if run_phase(r.data.tags) == CONFIRM}
    todo, deleted = [], []
    for candidate, seed in wanted:
        run = existing.get((candidate.config_key, str(seed)))
        if run is not None and run.data.tags.get(STATUS) == COMPLETED:
            continue
        if run is not None:  # interrupted or failed: it trains again from the start, in one run only
            client.delete_run(run.info.run_id)
            deleted.append(run.info.run_id)
        todo.append(trial_config(candidate, seed))
    log.info(
        "confirmation: %d configuration(s) x %d seed(s); %d trial(s) to run%s",
        len(candidates),
        len(seeds),
        len(todo),
        f", {len(deleted)} partial run(s) replaced" if deleted else "",
    )
    if todo:
        tuner = tune.Tuner(
            runnable,
            param_space={},
            tune_config=tune.TuneConfig(
                search_alg=config_list_searcher(todo),
                num_samples=len(todo),
                max_concurrent_trials=definition.resources.max_concurrent_trials,
                reuse_actors=True,
                trial_name_creator=trial_name,
                trial_dirname_creator=trial_name,
            ),
            run_config=tune.RunConfig(
                name=f"{definition.name}-confirm-{time.strftime('%Y%m%d-%H%M%S')}",  # a fresh experiment per run
                storage_path=storage,
                callbacks=[trial_logger, *callbacks],
                failure_config=tune.FailureConfig(max_failures=definition.max_failures),
                checkpoint_config=tune.CheckpointConfig(num_to_keep=1),
                verbose=verbose,
            ),
        )
        tuner.fit()
        # the record is read next, so its buffered writes go first; what a tracking outage still holds
        # back leaves those runs unfinished: the confirmation says interrupted and the next run completes it
        trial_logger.flush(flush_s)
    final = {
        (run_config_key(r), r.data.tags.get(SEED))
        for r in confirmation_runs(client, record)
        if r.data.tags.get(STATUS) in (COMPLETED, FAILED)
    }
    finished = sum((c.config_key, str(s)) in final for c, s in wanted)
    status = COMPLETED if finished == len(wanted) else "interrupted"
    return ConfirmationResult(status, len(wanted), finished, len(todo), deleted)


def log_dev_sizes(record, prepared) -> None:
    """Parent metrics ``dev_examples.<task>``: the dev set sizes the report's noise rule needs without seeds."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    metrics = [Metric(f"dev_examples.{task}", len(data.dev), now, 0) for task, data in prepared.tasks.items()]
    _mlflow_client(record.tracking_uri).log_batch(record.parent_run_id, metrics=metrics)


def search_run_ids(record) -> set[str]:
    """Run ids of the sweep's search trials (every child run that is not a confirmation trial)."""
    from peftune.tracking import child_runs

    runs = child_runs(_mlflow_client(record.tracking_uri), record.experiment_id, record.parent_run_id)
    return {r.info.run_id for r in runs if run_phase(r.data.tags) == SEARCH}


def _mlflow_client(uri: str):
    import mlflow

    return mlflow.MlflowClient(tracking_uri=uri)
