"""Confirmation: each budget's contenders re-trained with several seeds at the full budget, after the search.

One search trial is one draw of noise, at the search's cheap fidelity. :func:`run_confirmation` takes, under each
parameter budget, its ``confirm.contenders`` best configurations by search score (and with ``confirm.anchors``
frozen's and full fine-tuning's best), and re-trains each with ``confirm.seeds`` new seeds
(``definition.seed + 1 ..``: the search's own seed would re-count the luck that chose them) on
``confirm.train_examples`` train rows per task (the sweep's ``_confirm_runnable``), as trials of a second Ray
Tune experiment recorded as child runs of the sweep. After each round the decision procedure
(``peftune.stats.decisions``) replays the looks on the decision-split predictions; the configurations it still wants
seeds for get one more each, all of a round in the same experiment (:class:`Rounds`). Then each budget's pick is
re-trained with ``confirm.report_seeds`` fresh seeds for the dev score the report gives it. (config key, seed)
identifies a run: a resume skips the completed pairs and replaces the partial ones. docs/design.md has the record.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ray import tune
from ray.tune.search import Searcher

from peftune.base.record_names import (
    BEST_SCORE,
    BUDGETS_PCT,
    COMPLETED,
    CONFIRM,
    DECISION,
    DEFAULT,
    EARLY_STOPPED,
    FAILED,
    HYPERPARAMETERS,
    INTERRUPTED,
    METHOD,
    REPORT_REASON,
    ROLE,
    SCORE,
    SEARCH,
    SEED,
    SEED_REASON,
    STATUS,
    TRAINABLE_PER_TASK_PCT,
    TRIAL_ROLE,
    is_report_run,
    keeps_predictions,
    trial_name,
    unique_labels,
)
from peftune.inputs.tasks import get_task
from peftune.methods.options import options_from_params
from peftune.methods.sizes import size_label
from peftune.record import legacy, reader
from peftune.stats import decisions
from peftune.sweep import console
from peftune.sweep.resume import CheckpointPruner
from peftune.sweep.stopping import ctrl_c_through_tune

log = logging.getLogger("peftune.sweep.confirm")


# ----------------------------------------------------------------------------- configurations


@dataclass(frozen=True)
class Candidate:
    """A search trial chosen for confirmation."""

    config_key: str
    method: str
    run_id: str  # the search trial's child run
    score: float  # its best selection score in the search
    status: str
    default: bool  # the method's control-arm (default) trial
    params: dict  # its MLflow params, as logged (strings)
    trainable_pct: float = math.inf  # trainable parameters per task, % of the backbone (inf: not recorded)
    seconds_per_run: float = 0.0  # its search trial's training seconds per full run (0: not recorded)

    @property
    def label(self) -> str:
        """``lora r=16``, ``ia3``: its method and size, as the report names it (its key is for machines)."""
        return f"{self.method} {size_label(self.method, self.params)}".strip()


ANCHORS = ("frozen", "full")  # the floor (heads only) and the ceiling (every weight) each report is read against


def select_candidates(
    runs: Sequence,
    top_k: int = 0,
    defaults: bool = False,
    budgets_pct: Sequence[float] = BUDGETS_PCT,
    *,
    contenders: int = 0,
    anchors: bool = False,
    version: int,
) -> list[Candidate]:
    """The configurations to confirm, among the search trials ``runs`` (MLflow child runs of a record of
    ``version``, ``peftune.record.legacy``): under each parameter
    budget of ``budgets_pct`` (% of the backbone trained per task), its ``contenders`` best configurations of any
    method (what that budget's decision compares); with ``anchors``, frozen's and full fine-tuning's best; each
    method's best ``top_k``; with ``defaults``, each method's default.

    Rank: completed before early-stopped, then best selection score, then start time; failed and unfinished
    trials are never candidates. Each configuration once, in the order first picked.
    """
    by_method: dict[str, dict[str, Candidate]] = {}
    for run in sorted(runs, key=lambda r: (r.info.start_time or 0, r.info.run_id)):
        candidate = candidate_of(run, version)
        if candidate is None:
            continue
        known = by_method.setdefault(candidate.method, {})
        if candidate.config_key not in known or rank(candidate) < rank(known[candidate.config_key]):
            known[candidate.config_key] = candidate
    ranked = {method: sorted(found.values(), key=rank) for method, found in by_method.items()}  # stable on ties
    everyone = sorted((c for found in ranked.values() for c in found), key=rank)
    picked: list[Candidate] = []
    for budget in budgets_pct:
        picked += [c for c in everyone if c.trainable_pct <= budget][:contenders]
    if anchors:
        picked += [ranked[m][0] for m in ANCHORS if ranked.get(m)]
    for found in ranked.values():
        picked += found[:top_k]
        if defaults:
            picked += [c for c in found if c.default][:1]
    return list({c.config_key: c for c in picked}.values())  # each once, in the order picked


def candidate_of(run, version: int) -> Candidate | None:
    """A finished search trial (of a record of ``version``) with a finite score, as a candidate; None for anything
    else."""
    tags, metrics = run.data.tags, run.data.metrics
    if tags.get(ROLE, TRIAL_ROLE) != TRIAL_ROLE or legacy.run_phase(tags, version, run.info.run_id) != SEARCH:
        return None
    score, status = metrics.get(BEST_SCORE), tags.get(STATUS)
    if status not in (COMPLETED, EARLY_STOPPED) or score is None or not math.isfinite(score):
        return None
    return Candidate(
        legacy.run_config_key(run, version),
        run.data.params.get("method") or tags.get(METHOD, ""),
        run.info.run_id,
        float(score),
        status,
        tags.get(DEFAULT, "false") == "true",
        dict(run.data.params),
        metrics.get(TRAINABLE_PER_TASK_PCT, math.inf),
        _seconds_per_run(metrics),
    )


def _seconds_per_run(metrics: Mapping[str, float]) -> float:
    """Training seconds of a full run, from a search trial's last report (an epoch's, or a rung's within one)."""
    epoch = (metrics.get("progress", 0.0), metrics.get("train_time_s", 0.0))
    rung = (metrics.get("fidelity_progress", 0.0), metrics.get("fidelity_train_time_s", 0.0))
    progress, seconds = max(epoch, rung)
    return seconds / progress if progress > 0 else 0.0


def longest_first(wanted: Sequence[tuple[Candidate, int, str]]) -> list[tuple[Candidate, int, str]]:
    """The confirmation trials in the order they start: the longest runs first, so that the last minutes of
    the confirmation do not leave one long run (a prompt of length 100) alone on the cluster."""
    return sorted(wanted, key=lambda item: -item[0].seconds_per_run)  # stable: ties keep their order


def rank(candidate: Candidate) -> tuple:
    return (candidate.status != COMPLETED, -candidate.score)


def confirm_seeds(base_seed: int, seeds: int) -> list[int]:
    """The confirmation seeds: new ones (see the module docstring)."""
    return [base_seed + 1 + i for i in range(seeds)]


def trial_config(candidate: Candidate, seed: int, why: str = "") -> dict:
    """The Ray trial config that re-trains ``candidate`` with ``seed`` (the shape the search's trials have);
    ``why``: for a seed added to an open decision, the decision (tagged ``peftune.seed_reason``)."""
    params, method = candidate.params, candidate.method
    sampled = {key: float(params[key]) for key in HYPERPARAMETERS}
    sampled.update(options_from_params(method, params))
    return {
        "method": method,
        method: sampled,
        "peftune": {
            "phase": CONFIRM,
            "config_key": candidate.config_key,
            "seed": seed,
            "default": candidate.default,  # a bool: the record tag is written from it
            "confirms": candidate.run_id,
            **({"seed_reason": why} if why else {}),
            **({"report": True} if is_report_run(why) else {}),
        },
    }


# ----------------------------------------------------------------------------- the confirmation


@dataclass
class ConfirmationResult:
    status: str  # completed | interrupted | skipped (confirm.seeds or top_k is 0)
    wanted: int  # confirmation trials asked for: candidates x seeds, and the seeds added for open decisions
    finished: int  # of those, with a final status (completed or failed)
    ran: int  # trials started by this call
    deleted: list[str]  # partial runs of interrupted or failed pairs, deleted before they ran again
    added: int = 0  # seeds added to configurations of inconclusive decisions (in ``wanted`` too)
    stopped_by: str = ""  # why adding seeds stopped: decided | max_seeds | futile | max_seconds ("": none added)


class Rounds(Searcher):
    """A Tune ``Searcher`` that hands out a round of trial configs, then, once every trial of the round has
    finished, asks ``next_round()`` for the next one: a list of configs (empty: nothing left to train in it,
    ask again), or None (no more rounds: the experiment ends).

    So the rounds of added seeds run in ONE Tune experiment: no experiment is set up again per round, and
    a trial actor stays alive between rounds (``reuse_actors``). A ``Searcher`` (not a variant generator)
    so that Tune applies ``max_concurrent_trials`` to it; between rounds it answers None (not ready yet).
    """

    def __init__(self, first: Sequence[dict], next_round: Callable[[], list[dict] | None]):
        super().__init__(metric=SCORE, mode="max")
        self.queue, self.next_round = [dict(c) for c in first], next_round
        self.running: set[str] = set()
        self.over = False
        self.round_ended = 0.0  # when the round's last trial was reported complete (time.monotonic)

    def suggest(self, trial_id: str):
        while not self.queue and not self.running and not self.over:
            more = self.next_round()  # the round is over: every one of its trials has finished
            self.queue, self.over = [dict(c) for c in more or []], more is None
            log.info(
                "confirmation: round's end handled %.1f s after its last trial", time.monotonic() - self.round_ended
            )
        if self.over:
            return Searcher.FINISHED
        if not self.queue:
            return None  # the round's last trials are still running
        self.running.add(trial_id)
        return self.queue.pop(0)

    def on_trial_complete(self, trial_id: str, result=None, error: bool = False) -> None:
        self.running.discard(trial_id)
        self.round_ended = time.monotonic()


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
    ``callbacks``: extra ``tune.Callback`` objects for this run. After each round, the decision procedure
    (:func:`peftune.stats.decisions.replay`, the one the report and ``peftune decide`` use) replays the looks on the
    decision-split predictions of the completed runs; the configurations it still wants seeds for get one more each,
    all of a round as parallel trials of the same Tune experiment, until every budget is decided, the rest is futile,
    ``confirm.max_seeds`` or ``confirm.max_seconds``. The record holds the seeds, so a resume replays to the same
    point. The rounds decide on what the trial logger kept of this run's trials (``TrialLogger.confirmed``), and on
    the predictions of the runs an earlier run of the sweep completed, read from the record once
    (``reader.read_predictions``). The candidates, and the confirmation runs an earlier run of the sweep
    left, come from the driver's state of the sweep (``TrialLogger.runs``), not from the record either.
    """
    settings = definition.confirm
    if settings.seeds == 0 or not (settings.contenders or settings.anchors or settings.top_k or settings.defaults):
        return ConfirmationResult("skipped", 0, 0, 0, [])
    confirmation, first = open_confirmation(definition, record, runnable, trial_logger=trial_logger, storage=storage,
                                            callbacks=callbacks, verbose=verbose, flush_s=flush_s)  # fmt: skip
    return confirmation.run(first)


def open_confirmation(
    definition,
    record,
    runnable,
    *,
    trial_logger,
    storage: str,
    callbacks: Sequence = (),
    verbose: int = 1,
    flush_s: float = 600.0,
) -> tuple[Confirmation, list[tuple[Candidate, int, str]]]:
    """The confirmation as it opens (:func:`run_confirmation`'s arguments), before its first round: the candidates
    of the driver's state of the sweep, the runs an earlier run of the sweep left, and the first round's (candidate,
    seed, why), which ``Confirmation.run`` takes. The benchmark driver measures this opening's reads."""
    settings = definition.confirm
    runs = trial_logger.runs()  # the record as the driver holds it (the search's writes flushed): not read back
    version = record.version
    candidates = candidates_of(runs, settings, version)
    first = [(c, s, "") for c in candidates for s in confirm_seeds(definition.seed, settings.seeds)]
    log.info("confirmation: %d configuration(s) x %d seed(s)", len(candidates), settings.seeds)
    searched = {c.config_key: c for c in (candidate_of(r, version) for r in runs) if c is not None}
    earlier = {(legacy.run_config_key(r, version), r.data.tags.get(SEED)): r for r in runs
               if legacy.run_phase(r.data.tags, version, r.info.run_id) == CONFIRM}  # fmt: skip
    confirmation = Confirmation(definition, record, runnable, trial_logger, storage, callbacks, verbose, flush_s,
                                searched, candidates, earlier)  # fmt: skip
    return confirmation, first


def candidates_of(runs: Sequence, settings, version: int) -> list[Candidate]:
    """The configurations a sweep's ``confirm`` settings confirm, among its search trials ``runs`` (of a record of
    ``version``)."""
    return select_candidates(runs, settings.top_k, settings.defaults, contenders=settings.contenders,
                             anchors=settings.anchors, version=version)  # fmt: skip


def plan_of(settings) -> decisions.Plan:
    """The decision plan of a sweep's ``confirm`` settings: ``Plan.from_params`` of the parameters the sweep
    records for them (the report reads the same ones back)."""
    params = {"confirm_seeds": settings.seeds, "confirm_max_seeds": settings.max_seeds,
              "decision_margin": settings.margin}  # fmt: skip
    return decisions.Plan.from_params(params, BUDGETS_PCT)


def configurations_of(candidates: Sequence[Candidate]) -> list[decisions.Configuration]:
    return [decisions.Configuration(c.config_key, c.method, c.trainable_pct, c.default) for c in candidates]


def decide_round(frame, tasks: Sequence[str], candidates: Sequence[Candidate], settings) -> decisions.Outcome:
    """The decision procedure replayed on the decision-split predictions there are (``frame``)."""
    frame = frame.rename(columns={"config_key": "config"})
    values = decisions.values_from_frame(frame, {t: get_task(t).kind for t in tasks}) if len(frame) else {}
    return decisions.replay(values, configurations_of(candidates), plan_of(settings))


def _why(key: str, look: int, open_answers) -> str:
    """The seed reason of an added seed: the look and the open budgets the configuration takes part in."""
    budgets = [f"<= {a.budget:g}%" for a in open_answers if key in a.members]
    return f"look {look}: budget {', '.join(budgets) or '?'} still open"


EARLIER_REASON = "added by an earlier run of this sweep"  # a seed read on a resume, not trained by it


@dataclass
class Confirmation:
    """The confirmation's trials in one Tune experiment, round by round (see :class:`Rounds`): the first round
    (every candidate x seed), then one seed more for every configuration of an open decision, while
    the decision procedure wants them, under ``confirm.max_seeds`` and ``confirm.max_seconds``.

    Each round skips the pairs completed (in this run, or in the record an earlier run left) and replaces the
    partial runs of the others (see the module docstring). A round is decided once every write of its trials
    reached the record (a tracking outage holds the next round back), on the same predictions the record holds:
    only an earlier run's predictions are read from the record, once, however many rounds and runs there are."""

    definition: object
    record: object
    runnable: object
    trial_logger: object
    storage: str
    callbacks: Sequence
    verbose: int
    flush_s: float
    searched: Mapping[str, Candidate]  # config key -> its search trial (the seeds added re-train it)
    candidates: Sequence[Candidate] = ()  # the configurations confirmed
    # (config key, seed as tagged) -> the confirmation run an earlier run of the sweep left in the record, as the
    # driver's state holds it at the start; what this run trains, the trial logger keeps (``TrialLogger.confirmed``):
    # no round reads the record back
    earlier: Mapping[tuple[str, str], object] = dataclasses.field(default_factory=dict)
    earlier_predictions: object = None  # their decision-split predictions, read once when first needed
    wanted: list = dataclasses.field(default_factory=list)  # every (candidate, seed, why) asked for so far
    deleted: list = dataclasses.field(default_factory=list)
    ran: int = 0
    added: int = 0
    stopped_by: str = ""
    held_back: bool = False  # a round did not finish in the record: no seeds were added after it
    user_stopped: bool = False  # Ctrl-C (or Tune's SIGUSR1) came during the fit, though its trials may all be done
    reported: bool = False  # the report round (fresh seeds for each budget's pick) was handed out
    adding_since: float | None = None  # when the first round ended: confirm.max_seconds counts from there
    planned: bool = False  # the plan per budget (the first look's seeds for 80% power) was said

    def run(self, first: Sequence[tuple[Candidate, int, str]]) -> ConfirmationResult:
        self.wanted = list(first)
        todo = self.todo(first)
        while todo == []:  # nothing left to train in this round (a resume): the next one, if any
            todo = self.next_round()
        if todo:
            self._fit(Rounds(todo, self.next_round))
        finished = self.finished()
        done = finished == len(self.wanted) and not self.held_back and not self.user_stopped
        status = COMPLETED if done else INTERRUPTED
        stopped_by = self.stopped_by if self.added else ""
        return ConfirmationResult(status, len(self.wanted), finished, self.ran, self.deleted, self.added, stopped_by)

    def todo(self, wanted: Sequence[tuple[Candidate, int, str]]) -> list[dict]:
        """The trial configs of ``wanted`` still to train, longest first; the partial runs among them deleted."""
        todo, deleted = [], []
        for candidate, seed, why in longest_first(wanted):
            pair = (candidate.config_key, seed)
            run = self.earlier.get((candidate.config_key, str(seed)))
            if self.status(pair) == COMPLETED:
                continue
            if run is not None and pair not in self.trial_logger.confirmed:
                # interrupted or failed in an earlier run: it trains again from the start, in one run only
                self.trial_logger.delete(run.info.run_id)
                deleted.append(run.info.run_id)
            todo.append(trial_config(candidate, seed, why))
        replaced = f", {len(deleted)} partial run(s) replaced" if deleted else ""
        log.info("confirmation: %d trial(s) to run%s", len(todo), replaced)
        self.deleted += deleted
        self.ran += len(todo)
        return todo

    def next_round(self) -> list[dict] | None:
        """The trial configs of the next round of added seeds; None when adding stops: decided, a cap, or a
        round that did not finish in the record (a tracking outage holds its writes back)."""
        # the record is read next, so its buffered writes go first
        start = time.monotonic()
        flushed = self.trial_logger.flush(self.flush_s)
        flushed_at = time.monotonic()
        if not flushed or self.finished() < len(self.wanted):
            self.held_back = True
            return None
        if self.adding_since is None:
            self.adding_since = time.monotonic()
        read_at = time.monotonic()
        frame = self.decision_frame()
        settings = self.definition.confirm
        outcome = decide_round(frame, self.definition.tasks, self.candidates, settings)
        decided_at = time.monotonic()
        # the slots wait for this: its parts say which one to make cheaper
        log.info(
            "confirmation: round decided in %.1f s (writes flushed %.1f s, predictions %.1f s, decisions %.1f s)",
            decided_at - start,
            flushed_at - start,
            read_at - flushed_at,
            decided_at - read_at,
        )
        labels = unique_labels([(c.config_key, c.label, c.default) for c in self.candidates])  # as the report

        def named(text: str) -> str:
            for key, label in labels.items():
                text = text.replace(key, label)
            return text

        if not self.planned:  # before the first added seed: what each contender needs, and whether max_seeds does
            self.planned = True
            for budget, line in outcome.plans.items():
                log.info("confirmation: plan, budget <= %g%%: %s", budget, named(line))
        for answer in outcome.answers:
            log.info("confirmation: look %d, budget <= %g%%: %s (pick %s)", outcome.looks, answer.budget,
                     decisions.said(answer), labels.get(answer.pick, answer.pick))  # fmt: skip
        self.count_earlier_seeds(outcome)
        why = {a.budget: a for a in outcome.answers if not a.decided}
        grow = [
            (self.searched[key], seed, _why(key, outcome.looks, why.values()))
            for key, seed in outcome.next_seeds.items()
            if key in self.searched
        ]
        self.stopped_by = "" if grow else (outcome.stopped or "decided")
        max_seconds = settings.max_seconds
        if grow and max_seconds is not None and time.monotonic() - self.adding_since > max_seconds:
            grow, self.stopped_by = [], "max_seconds"
        if not grow:
            log.info("confirmation: no more seeds (%s)", self.stopped_by)
            return self.report_round(outcome)
        log.info("confirmation: %d configuration(s) of open budgets get another seed", len(grow))
        self.wanted += grow
        self.added += len(grow)
        return self.todo(grow)

    def count_earlier_seeds(self, outcome: decisions.Outcome) -> None:
        """The seeds an earlier run of this sweep added, which the decisions just read (a resume): wanted and
        counted like this run's own, so the sweep's count is the record's. After a resume the summary said
        "confirmation: 14/14" where the record held 21 runs: the 7 added before were in no count."""
        asked = {(c.config_key, s) for c, s, _ in self.wanted}
        earlier = [
            (self.searched[key], seed, EARLIER_REASON)
            for key, data in outcome.final.items()
            if key in self.searched
            for seed in data.seeds
            if (key, seed) not in asked
        ]
        self.wanted += earlier
        self.added += len(earlier)

    def report_round(self, outcome: decisions.Outcome) -> list[dict] | None:
        """Once, after the decisions: each budget's pick re-trained with ``confirm.report_seeds`` fresh seeds
        (numbered after ``max_seeds``: no decision ever reads them), evaluated on dev only. None when done."""
        settings = self.definition.confirm
        if self.reported or not settings.report_seeds:
            return None
        self.reported = True
        picks = dict.fromkeys(a.pick for a in outcome.answers if a.pick in self.searched)
        first = self.definition.seed + settings.max_seeds + 1
        wanted = [
            (self.searched[key], first + i, f"{REPORT_REASON}: the pick's dev score, from fresh seeds")
            for key in picks
            for i in range(settings.report_seeds)
        ]
        log.info("confirmation: %d pick(s) x %d fresh seed(s) for their reported dev score", len(picks),
                 settings.report_seeds)  # fmt: skip
        self.wanted += wanted
        return self.todo(wanted)

    def status(self, pair: tuple[str, int]) -> str | None:
        """How the confirmation trial of (config key, seed) ended: in this run, else in the record an earlier run
        left (None: it has not ended)."""
        if pair in self.trial_logger.confirmed:
            return self.trial_logger.confirmed[pair].status
        run = self.earlier.get((pair[0], str(pair[1])))
        return run.data.tags.get(STATUS) if run is not None else None

    def finished(self) -> int:
        """How many of the wanted pairs have a final status (completed or failed)."""
        return sum(self.status((c.config_key, s)) in (COMPLETED, FAILED) for c, s, _ in self.wanted)

    def decision_frame(self):
        """The decision-split predictions of every completed pair (``reader.read_predictions``' columns): those
        of an earlier run of the sweep read from the record once, this run's as its trial logger kept them."""
        import io

        import pandas as pd

        if self.earlier_predictions is None:
            done = sorted(
                ((run, key) for (key, _), run in self.earlier.items() if run.data.tags.get(STATUS) == COMPLETED),
                key=lambda item: (item[0].info.start_time or 0, item[0].info.run_id),
            )  # the report's order: started
            uri = self.record.tracking_uri
            read = reader.read_predictions(uri, {r.info.run_id: k for r, k in done}) if done else pd.DataFrame()
            found = set(read["run_id"]) if len(read) else set()
            for run, _ in done:
                if run.info.run_id not in found:
                    decided = self.definition.budget.decision_examples
                    kept = keeps_predictions(DECISION, run.data.tags.get(SEED_REASON), decided)
                    legacy.missing_predictions(run.info.run_id, DECISION, self.record.version, kept)
            self.earlier_predictions = read
        frames = [self.earlier_predictions] if len(self.earlier_predictions) else []
        for (key, _), pair in self.trial_logger.confirmed.items():
            if pair.status == COMPLETED and pair.decision is not None:
                frames.append(pd.read_csv(io.StringIO(pair.decision)).assign(config_key=key))
        if not frames:
            return pd.DataFrame()
        frame = pd.concat(frames, ignore_index=True)
        return frame.assign(seed=frame["seed"].astype(int))

    def _fit(self, rounds: Rounds) -> None:
        self.user_stopped = fit_rounds(self.definition, self.runnable, rounds, "confirm", console.Progress(
            "confirmation", lambda: self.ran, self.definition.budget.epochs), self.storage, self.trial_logger,
            self.callbacks, self.verbose)  # fmt: skip
        # the record is read next; what a tracking outage still holds back leaves those runs unfinished:
        # the confirmation says interrupted and the next run completes it
        self.trial_logger.flush(self.flush_s)


def fit_rounds(definition, runnable, rounds: Rounds, phase: str, progress, storage: str, trial_logger,
               callbacks: Sequence = (), verbose: int = 1) -> bool:  # fmt: skip
    """Run ``rounds`` as one fresh Tune experiment ``<sweep>-<phase>-<time>`` (no Tune state restored): the
    sweep's trainable, concurrency and retries, recorded by the sweep's trial logger. Whether the user stopped it
    (``stopping.ctrl_c_through_tune``: Tune took a Ctrl-C and returned, however many of its trials were done)."""
    tuner = tune.Tuner(
        runnable,
        param_space={},
        tune_config=tune.TuneConfig(
            search_alg=rounds,
            num_samples=-1,  # until the rounds say there is none left
            max_concurrent_trials=definition.resources.max_concurrent_trials,
            reuse_actors=True,
            trial_name_creator=trial_name,
            trial_dirname_creator=trial_name,
        ),
        run_config=tune.RunConfig(
            name=f"{definition.name}-{phase}-{time.strftime('%Y%m%d-%H%M%S')}",  # a fresh experiment per run
            storage_path=storage,
            callbacks=[
                trial_logger,
                progress,
                CheckpointPruner(score=None),  # a retry needs the latest checkpoint, nothing else
                *callbacks,
            ],
            failure_config=tune.FailureConfig(max_failures=definition.max_failures),
            verbose=verbose,
        ),
    )
    with ctrl_c_through_tune() as ctrl_c:
        tuner.fit()
    return ctrl_c.pressed


def reachable_margin_line(definition, prepared) -> str | None:
    """What the sweep says at start: the margin, and the smallest margin its sizes reach within ``max_seeds``
    (``decisions.reachable_margin``: 80% power for a cheaper configuration truly equal to the best, from
    assumed components; the plan after the first seeds measures them)."""
    settings = definition.confirm
    sizes = [len(data.decision) for data in prepared.tasks.values() if data.decision is not None]
    if settings.seeds == 0 or not sizes:
        return None
    examples = min(sizes) * len(sizes)  # the score averages the tasks: about as many examples in all
    plan = plan_of(settings)
    smallest = decisions.reachable_margin(examples, plan)
    word = "reachable" if settings.margin >= smallest else (
        "NOT reachable within max_seeds: a budget whose contenders are that close will be said to be open")  # fmt: skip
    return (
        f"decisions: margin δ = {settings.margin} (the loss accepted for fewer parameters) on {min(sizes)} decision "
        f"examples per task, {settings.seeds} to {settings.max_seeds} seeds: {word} (the smallest reachable margin "
        f"is about {smallest:.3f}, assuming {decisions.DISAGREEMENT:.0%} disagreement between two configurations, "
        f"{decisions.INTERACTION_SHARE:.0%} of it configuration x example, and a seed sd of {decisions.SEED_SD}; "
        "after the first seeds each budget's plan measures them)"
    )


def search_run_ids(runs, version: int) -> set[str]:
    """Run ids of the sweep's search trials among its trial ``runs`` (every one that is not a confirmation trial) of a
    record of ``version``."""
    return {r.info.run_id for r in runs if legacy.run_phase(r.data.tags, version, r.info.run_id) == SEARCH}
