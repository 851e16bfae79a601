"""Confirmation with seeds after the search: real Ray Tune + MLflow on the embedded MiniLM (no mocks).

A tiny sweep (two methods, K=1, S=2) must end with S confirmation runs of each method's best search
configuration, recorded under the parent run with their own seeds; a second sweep is interrupted
during the confirmation and run again: nothing completed runs twice, no (configuration, seed) pair
has two child runs.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import statistics
import time
from pathlib import Path

import mlflow
import pytest
import ray
from ray import tune
from ray.tune.search import Searcher

from conftest import start_local_ray
from peftune.base import record_names
from peftune.core import train
from peftune.record import legacy, reader, trial_logger
from peftune.stats import decisions
from peftune.sweep import confirm, orchestrator, spaces
from tiny_sweep import write_definition

FROZEN = """\
    method: frozen
    lr: {low: 1.0e-3, high: 1.0e-2, log: true}
    dropout: {low: 0.0, high: 0.2}
    weight_decay: 0.0
"""
TOP_K = """\
    method: top_k
    lr: {low: 2.0e-4, high: 1.0e-3, log: true}
    dropout: 0.1
    weight_decay: {low: 0.0, high: 0.1}
    options:
      k: 1
"""
SWEEP = """\
    name: {name}
    tasks: [sst]
    methods: [frozen, top_k]
    seed: 3
    search: {{objective: single, sampler: tpe, n_startup_trials: 10}}
    scheduler: {{type: none}}
    resources: {{cpus_per_trial: 1, max_concurrent_trials: {concurrency}}}
    max_failures: 0
    checkpoints_per_method: 0
    confirm: {{contenders: 0, anchors: false, top_k: 1, seeds: 2{confirm}}}
    budget: tiny
    budgets:
      tiny: {{trials_per_method: 2, epochs: 2, batch_size: 16, max_length: 32, max_train_examples: 48,
              max_dev_examples: 32}}
"""


def definition(directory: Path, name: str, concurrency: int, confirm: str = ""):
    spaces_ = {"frozen": FROZEN, "top_k": TOP_K}
    return write_definition(directory, name, spaces_, SWEEP, concurrency=concurrency, confirm=confirm)


@pytest.fixture(scope="module")
def local_ray():
    start_local_ray()
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("confirm")


def children(uri: str, parent_run_id: str) -> list:
    client = mlflow.MlflowClient(uri)
    experiment = client.get_run(parent_run_id).info.experiment_id
    return client.search_runs([experiment], filter_string=f"tags.`mlflow.parentRunId` = '{parent_run_id}'")


def split(runs) -> tuple[list, list]:
    search = [r for r in runs if r.data.tags.get(record_names.PHASE, "search") == "search"]
    return search, [r for r in runs if r.data.tags.get(record_names.PHASE) == "confirm"]


def best_of_method(search: list) -> dict:
    best = {}
    for run in sorted(search, key=lambda r: r.info.start_time):
        method, score = run.data.params["method"], run.data.metrics["best_score"]
        if method not in best or score > best[method].data.metrics["best_score"]:
            best[method] = run
    return best


@pytest.mark.slow
def test_confirmation_trains_seeds_of_each_methods_best(local_ray, workdir, tiny_data_dir):
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    spec = definition(workdir / "defs", "confirmed", concurrency=2)
    result = orchestrator.run_sweep(spec, tiny_data_dir, uri, storage_path=workdir / "ray_results", verbose=0)
    assert result.status == "completed" and result.num_trials == 4  # the search's trials only
    assert result.confirmation["wanted"] == result.confirmation["finished"] == 4
    assert "confirmation: 4/4 seed runs" in result.summary()

    search, confirmed = split(children(uri, result.parent_run_id))
    assert len(search) == 4 and len(confirmed) == 2 * 2  # K=1 configuration of each of 2 methods, S=2 seeds
    best = best_of_method(search)
    assert set(best) == {"frozen", "top_k"}
    for method, trial in best.items():
        runs = [r for r in confirmed if r.data.params["method"] == method]
        key = trial.data.tags[record_names.CONFIG_KEY]  # the key recorded on the search trial it confirms
        assert {r.data.tags[record_names.CONFIG_KEY] for r in runs} == {key}
        assert {r.data.tags[record_names.CONFIRMS] for r in runs} == {trial.info.run_id}
        assert sorted(r.data.tags[record_names.SEED] for r in runs) == ["4", "5"]  # new seeds: the search used 3
        for run in runs:
            assert run.data.params["seed"] == run.data.tags[record_names.SEED]
            # the same configuration, on the confirmation's rows (every train row not held out) with its own seed
            same = {k: v for k, v in trial.data.params.items() if k not in ("seed", "data.max_train_examples")}
            assert {k: run.data.params[k] for k in same} == same, "a confirmation trains another configuration"
            assert run.data.params["data.max_train_examples"] == "None"
            assert run.data.tags["peftune.status"] == "completed" and run.info.status == "FINISHED"
            history = mlflow.MlflowClient(uri).get_metric_history(run.info.run_id, "score")
            assert sorted(m.step for m in history) == [1, 2]  # the full budget
    # the seeds differ in what they train: dropout, initialisation and batch order
    losses = [r.data.metrics["train_loss"] for r in confirmed if r.data.params["method"] == "top_k"]
    assert losses[0] != losses[1]

    # the report draws these runs: one configuration per method, its std that of its two seeds
    from analysis import report, runs

    built = report.build_report(runs.read_sweep_record("confirmed", uri), reference=False)
    configs = built.configs.set_index("method")
    assert set(configs.index) == {"frozen", "top_k"} and set(configs["seeds"]) == {2}
    for method in ("frozen", "top_k"):
        # the report's numbers are dev's, at the epoch the selection split chose (best_score is selection's)
        scores = [r.data.metrics["best_dev_score"] for r in confirmed if r.data.params["method"] == method]
        assert configs.loc[method, "score_mean"] == pytest.approx(statistics.mean(scores))
        assert configs.loc[method, "score_std"] == pytest.approx(statistics.stdev(scores))
        assert configs.loc[method, "split"] == "dev"
    assert len(built.recommendation) == 3 and len(built.fairness) == 2
    assert built.decisions.outcome is not None and len(built.recommendation) == 3

    # each confirmation run keeps its dev predictions at that epoch: they give back its dev accuracy
    predictions = runs.load_predictions(runs.read_sweep_record("confirmed", uri))
    for run in confirmed:
        mine = predictions[predictions["run_id"] == run.info.run_id]
        assert len(mine) == 32 and set(mine["seed"]) == {int(run.data.tags[record_names.SEED])}  # the 32 dev rows
        accuracy = (mine["prediction"] == mine["label"]).mean()
        assert accuracy == pytest.approx(run.data.metrics["best_dev_sst_accuracy"])
    # search trials select on the selection split and never see dev
    for trial in search:
        assert "selection_score" in trial.data.metrics and "dev_score" not in trial.data.metrics


class InterruptAfterConfirmation(tune.Callback):
    """Stops the experiment as Ctrl+C does once the first confirmation trial has completed; ``added_only``:
    once a trial of an added seed has reported its first epoch (it is then cut short)."""

    def __init__(self, added_only: bool = False):
        self.fired, self.added_only = None, added_only

    def _fire(self, trial) -> None:
        marks = trial.config.get("peftune") or {}
        if self.fired is None and marks.get("phase") == "confirm" and (marks.get("seed_reason") or not self.added_only):
            self.fired = trial.trial_id
            os.kill(os.getpid(), signal.SIGUSR1)

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if self.added_only:
            self._fire(trial)

    def on_trial_complete(self, iteration, trials, trial, **info):
        if not self.added_only:
            self._fire(trial)


class Recorder(tune.Callback):
    def __init__(self):
        self.started: list[dict] = []

    def on_trial_start(self, iteration, trials, trial, **info):
        self.started.append(dict(trial.config.get("peftune") or {}))


@pytest.mark.slow
def test_interrupted_confirmation_resumes_exactly_once(local_ray, workdir, tiny_data_dir):
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    spec = definition(workdir / "defs", "confirm_resume", concurrency=1)
    storage = workdir / "ray_results"
    interrupter = InterruptAfterConfirmation()
    first = orchestrator.run_sweep(spec, tiny_data_dir, uri, storage_path=storage, callbacks=[interrupter], verbose=0)
    assert interrupter.fired and first.status == "interrupted"
    search, confirmed = split(children(uri, first.parent_run_id))
    assert len(search) == 4
    done = {
        (r.data.tags[record_names.CONFIG_KEY], r.data.tags[record_names.SEED]): r.info.run_id
        for r in confirmed
        if r.data.tags.get("peftune.status") == "completed"
    }
    assert 1 <= len(done) < 4

    recorder = Recorder()
    second = orchestrator.run_sweep(spec, tiny_data_dir, uri, storage_path=storage, callbacks=[recorder], verbose=0)
    assert second.status == "completed" and second.parent_run_id == first.parent_run_id
    started = {(c.get("config_key"), str(c.get("seed"))) for c in recorder.started}
    assert all(c.get("phase") == "confirm" for c in recorder.started), "a search trial ran again"
    assert not started & set(done), "a completed confirmation trial ran again"

    search_after, confirmed = split(children(uri, first.parent_run_id))
    assert sorted(r.info.run_id for r in search_after) == sorted(r.info.run_id for r in search)
    pairs = [(r.data.tags[record_names.CONFIG_KEY], r.data.tags[record_names.SEED]) for r in confirmed]
    assert len(pairs) == 4 and len(set(pairs)) == 4, "a confirmation trial has two child runs"
    assert all(r.data.tags.get("peftune.status") == "completed" for r in confirmed)
    kept = {(r.data.tags[record_names.CONFIG_KEY], r.data.tags[record_names.SEED]): r.info.run_id for r in confirmed}
    assert all(kept[pair] == run_id for pair, run_id in done.items()), "a completed run was replaced"

    # a third run finds everything done: nothing trains
    third = Recorder()
    again = orchestrator.run_sweep(spec, tiny_data_dir, uri, storage_path=storage, callbacks=[third], verbose=0)
    assert again.status == "completed" and not third.started
    assert len(split(children(uri, first.parent_run_id))[1]) == 4


# ----------------------------------------------------------------------------- seeds where the answer is open


def seeds_by_config(uri: str, parent_run_id: str) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for run in split(children(uri, parent_run_id))[1]:
        out.setdefault(run.data.tags[record_names.CONFIG_KEY], []).append(int(run.data.tags[record_names.SEED]))
    return {key: sorted(seeds) for key, seeds in out.items()}


class AlwaysOpen:
    """A decision procedure (patched over ``confirm.decide_round``) that keeps one method's best configuration open
    until ``max_seeds``, as a budget that cannot be decided would: it tests the rounds, not the statistics."""

    def __init__(self, method: str, uri: str, name: str):
        self.method, self.uri, self.name = method, uri, name

    def __call__(self, frame, tasks, candidates, settings) -> decisions.Outcome:
        client = mlflow.MlflowClient(self.uri)
        parent = reader.find_parent_run(client, reader.find_experiment_id(client, self.name), self.name)
        search, confirmed = split(children(self.uri, parent.info.run_id))
        key = best_of_method(search)[self.method].data.tags[record_names.CONFIG_KEY]
        seeds = sorted(
            int(r.data.tags[record_names.SEED])
            for r in confirmed
            if r.data.tags[record_names.CONFIG_KEY] == key
            and r.data.tags.get(record_names.STATUS) == record_names.COMPLETED
        )
        answer = decisions.Answer(10.0, [key], best=key, pick=key)
        more = len(seeds) < settings.max_seeds
        wanted = {key: max(seeds) + 1} if more else {}
        return decisions.Outcome([answer], {key: len(seeds)}, {}, wanted, len(seeds), "" if more else "max_seeds")


@pytest.mark.slow
def test_an_open_decision_gets_seeds_up_to_the_cap_and_resume_keeps_the_count(
    local_ray, workdir, tiny_data_dir, monkeypatch
):
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    spec = definition(workdir / "defs", "adaptive", concurrency=2, confirm=", max_seeds: 4")
    storage = workdir / "ray_results"
    monkeypatch.setattr(confirm, "decide_round", AlwaysOpen("top_k", uri, "adaptive"))
    interrupter = InterruptAfterConfirmation(added_only=True)
    run = {"storage_path": storage, "verbose": 0}
    first = orchestrator.run_sweep(spec, tiny_data_dir, uri, callbacks=[interrupter], **run)
    assert interrupter.fired and first.status == "interrupted"  # stopped inside a round of added seeds
    second = orchestrator.run_sweep(spec, tiny_data_dir, uri, **run)
    assert second.status == "completed"
    assert second.confirmation["stopped_by"] == "max_seeds"
    seeds = seeds_by_config(uri, first.parent_run_id)
    search, confirmed = split(children(uri, first.parent_run_id))
    best = {m: r.data.tags[record_names.CONFIG_KEY] for m, r in best_of_method(search).items()}
    assert seeds[best["top_k"]] == [4, 5, 6, 7]  # the open one: seeds 4, 5 then one a round up to max_seeds 4
    assert seeds[best["frozen"]] == [4, 5]  # decided (never open): its first seeds only
    added = [r for r in confirmed if r.data.tags.get("peftune.seed_reason")]
    assert sorted(int(r.data.tags[record_names.SEED]) for r in added) == [6, 7]
    assert all("still open" in r.data.tags["peftune.seed_reason"] for r in added)
    pairs = [(r.data.tags[record_names.CONFIG_KEY], r.data.tags[record_names.SEED]) for r in confirmed]
    assert len(pairs) == len(set(pairs)), "a (configuration, seed) pair has two child runs"
    # the second run's two rounds (seed 6 again, then 7) ran in one Tune experiment, as the first run's did
    assert len(list(storage.glob("adaptive-confirm-*"))) == 2


@pytest.mark.slow
def test_the_time_cap_counts_from_the_first_rounds_end(local_ray, workdir, tiny_data_dir, monkeypatch):
    """``max_seconds: 1``: the first round (its workers start: seconds) does not count, so one round of added
    seeds starts; the decisions after it take 1.5 s, so no second one."""
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    spec = definition(workdir / "defs", "capped", concurrency=2, confirm=", max_seeds: 4, max_seconds: 1")
    always_open, calls = AlwaysOpen("top_k", uri, "capped"), []

    def slow_after_the_first(frame, tasks, candidates, settings):
        calls.append(1)
        time.sleep(1.5 if len(calls) > 1 else 0.0)
        return always_open(frame, tasks, candidates, settings)

    monkeypatch.setattr(confirm, "decide_round", slow_after_the_first)
    result = orchestrator.run_sweep(spec, tiny_data_dir, uri, storage_path=workdir / "ray_results", verbose=0)
    assert result.status == "completed" and result.confirmation["stopped_by"] == "max_seconds"
    search, _ = split(children(uri, result.parent_run_id))
    seeds = seeds_by_config(uri, result.parent_run_id)
    assert seeds[best_of_method(search)["top_k"].data.tags[record_names.CONFIG_KEY]] == [4, 5, 6]


@pytest.mark.slow
def test_the_report_replays_the_seeds_the_confirmation_used(local_ray, workdir, tiny_data_dir, monkeypatch):
    """With the real procedure and a decision split: the report's replay (the same code) uses exactly the seeds
    the confirmation trained, and says why each configuration stopped. The rounds decide on what the driver kept
    of its trials, never reading the record back (issue 31: each round re-read every run), and that is the very
    frame the record holds."""
    from analysis import render, report, runs

    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    spec = definition(workdir / "defs", "adaptive_real", concurrency=2, confirm=", max_seeds: 3")
    spec = dataclasses.replace(spec, budget=dataclasses.replace(spec.budget, decision_examples=16))
    reads, frames = [], []
    decide, read = confirm.decide_round, reader.read_predictions
    monkeypatch.setattr(confirm, "decide_round", lambda frame, *args: frames.append(frame) or decide(frame, *args))
    monkeypatch.setattr(reader, "read_predictions", lambda *where: reads.append(where) or read(*where))
    result = orchestrator.run_sweep(spec, tiny_data_dir, uri, storage_path=workdir / "ray_results", verbose=0)
    assert result.status == "completed"
    assert frames and not reads, "a round read the record back"
    columns = ["config_key", "seed", "task", "example_id", "prediction", "label"]
    kept = frames[-1][columns].sort_values(columns).reset_index(drop=True)
    held = runs.load_predictions(runs.read_sweep_record("adaptive_real", uri), splits=(record_names.DECISION,))
    recorded = held[columns].sort_values(columns).reset_index(drop=True)
    assert len(kept) and kept.equals(recorded)
    built = report.build_report(runs.read_sweep_record("adaptive_real", uri), reference=False)
    outcome = built.decisions.outcome
    trained = {key: len(seeds) for key, seeds in seeds_by_config(uri, result.parent_run_id).items()}
    assert outcome.seeds_used == trained
    assert set(outcome.stop_reason.values()) <= {"decided", "futile", "max_seeds", "in no budget",
                                                 "shown worse by more than the margin"}  # fmt: skip
    # the procedure's own rates, simulated from this record's measured components at its budgets' sizes
    assert max(trained.values()) >= 2 and len(built.own_rates), built.own_world
    assert built.own_world.startswith("sst ") and " examples (effect sd " in built.own_world
    sizes = {len(a.members) for a in outcome.answers if len(a.members) >= 2}
    assert {w.split(",")[0] for w in built.own_rates["what"] if w.startswith("K=")} == {f"K={k}" for k in sizes}
    assert "How often this procedure errs at this sweep's sizes" in "\n".join(render.answer_lines(built))
    predictions = runs.load_predictions(runs.read_sweep_record("adaptive_real", uri))
    assert set(predictions["split"]) == {"decision", "dev"}


# ----------------------------------------------------------------------------- definition and selection (fast)


def test_confirm_section_resolves_per_budget_and_names_bad_keys(workdir):
    spec = definition(workdir / "defs", "sections", concurrency=1)
    assert (spec.confirm.top_k, spec.confirm.seeds, spec.confirm.defaults) == (1, 2, False)
    path = Path(spec.source)
    text = path.read_text().replace(
        "confirm: {contenders: 0, anchors: false, top_k: 1, seeds: 2}",
        "confirm: {top_k: 3, by_budget: {tiny: {seeds: 0, defaults: true}}}",
    )
    path.write_text(text)
    resolved = spaces.load_sweep(path).confirm
    assert (resolved.top_k, resolved.seeds, resolved.defaults) == (3, 0, True)
    assert "confirm" in spaces.load_sweep(path).to_dict()  # part of the fingerprint: a resumed sweep must match
    for bad, key in [
        ("confirm: {seeds: -1}", "confirm.seeds"),
        ("confirm: {top_k: two}", "confirm.top_k"),
        ("confirm: {rounds: 2}", "confirm.rounds"),
        ("confirm: {by_budget: {gpu: {seeds: 1}}}", "confirm.by_budget.gpu"),
        ("confirm: {by_budget: {tiny: {seeds: -2}}}", "confirm.by_budget.tiny.seeds"),
    ]:
        path.write_text(text.replace("confirm: {top_k: 3, by_budget: {tiny: {seeds: 0, defaults: true}}}", bad))
        with pytest.raises(spaces.SpaceError, match=f": {key}: "):
            spaces.load_sweep(path)


def test_configurations_sharing_a_label_are_told_apart_in_the_console_as_in_the_report():
    names = record_names.unique_labels(
        [("318e62bf2c65", "frozen", False), ("f53bf1e315ee", "frozen", False), ("ee5b67d16006", "ia3", False),
         ("aaaaaaaaaaaa", "lora r=8", True), ("bbbbbbbbbbbb", "lora r=8", False)]
    )  # fmt: skip
    assert names == {
        "318e62bf2c65": "frozen [318e62bf]", "f53bf1e315ee": "frozen [f53bf1e3]", "ee5b67d16006": "ia3",
        "aaaaaaaaaaaa": "lora r=8 (default)", "bbbbbbbbbbbb": "lora r=8 [bbbbbbbb]",
    }  # fmt: skip


def test_candidates_are_each_methods_best_distinct_configurations(tmp_path):
    from sweep_record import TrialSpec, counts, record_sweep

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"

    def trial(trial_id, method, accuracy, status="completed", lr=1e-3, options=None):
        return TrialSpec(trial_id, method, options or {}, [{"sst_accuracy": accuracy}], counts(10), status, lr=lr)

    trials = [
        trial("a", "lora", 0.30, options={"rank": 8}),
        trial("b", "lora", 0.50, options={"rank": 4}),
        trial("c", "lora", 0.45, options={"rank": 4}),  # same configuration as b (another seed): counts once
        trial("d", "lora", 0.90, "early_stopped", options={"rank": 2}),  # a partial budget ranks after completed
        trial("e", "lora", 0.99, "failed", options={"rank": 1}),
        trial("f", "bitfit", 0.20),
        trial("g", "bitfit", 0.25, lr=2e-3),
    ]
    trials[2].lr = trials[1].lr
    _, parent, runs = record_sweep(uri, "select", ["sst"], trials, artifact_dir=tmp_path / "artifacts")
    client = mlflow.MlflowClient(uri)
    client.set_tag(runs["a"], record_names.DEFAULT, "true")
    experiment = client.get_run(parent).info.experiment_id
    children = client.search_runs([experiment], filter_string=f"tags.`mlflow.parentRunId` = '{parent}'")

    picked = confirm.select_candidates(children, top_k=3, version=legacy.UNTAGGED)  # sweep_record's: untagged
    assert [(c.method, c.run_id) for c in picked] == [
        ("lora", runs["b"]),
        ("lora", runs["a"]),
        ("lora", runs["d"]),
        ("bitfit", runs["g"]),
        ("bitfit", runs["f"]),
    ]
    with_default = confirm.select_candidates(children, top_k=1, defaults=True, version=legacy.UNTAGGED)
    assert [c.run_id for c in with_default] == [runs["b"], runs["a"], runs["g"]]
    assert with_default[1].default and not with_default[0].default

    # the confirmation starts the longest runs first (from the search trials' seconds per full run)
    seconds = [30.0, 90.0, 0.0, 60.0, 90.0]
    timed = [dataclasses.replace(c, seconds_per_run=t) for c, t in zip(picked, seconds, strict=True)]
    wanted = [(c, seed, "") for c in timed for seed in (1, 2)]
    order = [(c.run_id, seed) for c, seed, _ in confirm.longest_first(wanted)]
    assert order[:4] == [(runs["a"], 1), (runs["a"], 2), (runs["f"], 1), (runs["f"], 2)]  # 90 s each: as listed
    assert order[-2:] == [(runs["d"], 1), (runs["d"], 2)]
    assert sorted(order) == sorted((c.run_id, seed) for c, seed, _ in wanted)  # every one, once

    config = confirm.trial_config(picked[0], seed=7)
    assert config["method"] == "lora" and config["lora"]["rank"] == 4 and config["lora"]["lr"] == trials[1].lr
    assert config["peftune"] == {
        "phase": "confirm",
        "config_key": picked[0].config_key,
        "seed": 7,
        "default": False,
        "confirms": runs["b"],
    }
    # the record tags of that confirmation run: not a default (the string "false" once tagged it "true")
    assert trial_logger.search_tags(config, "lora", config["lora"])["peftune.default"] == "false"
    default_config = confirm.trial_config(with_default[1], seed=7)
    assert trial_logger.search_tags(default_config, "lora", {})["peftune.default"] == "true"
    assert confirm.confirm_seeds(3, 2) == [4, 5]


def test_rounds_start_the_next_round_only_when_every_trial_of_the_last_has_finished():
    """The rounds of added seeds share one Tune experiment: a round is asked for once the last one is over,
    a round with nothing to train is skipped, and no config is handed out twice."""
    later = [[{"seed": 3}], [], [{"seed": 4}, {"seed": 5}], None]
    asked = []

    def next_round():
        asked.append(len(handed))
        return later.pop(0)

    rounds = confirm.Rounds([{"seed": 1}, {"seed": 2}], next_round)
    handed = [rounds.suggest("t1"), rounds.suggest("t2")]
    assert handed == [{"seed": 1}, {"seed": 2}]
    assert rounds.suggest("t3") is None  # t1 and t2 still run: nothing to hand out, nothing decided yet
    rounds.on_trial_complete("t1")
    assert rounds.suggest("t3") is None and not asked  # t2 still runs
    rounds.on_trial_complete("t2", error=True)  # a failed trial ends its round too
    handed.append(rounds.suggest("t3"))
    assert handed[-1] == {"seed": 3} and asked == [2]
    assert rounds.suggest("t4") is None
    rounds.on_trial_complete("t3")
    handed += [rounds.suggest("t4"), rounds.suggest("t5")]  # the empty round is skipped
    assert handed[-2:] == [{"seed": 4}, {"seed": 5}] and asked == [2, 3, 3]
    rounds.on_trial_complete("t5")
    rounds.on_trial_complete("t4")
    assert rounds.suggest("t6") == Searcher.FINISHED and rounds.suggest("t7") == Searcher.FINISHED
    assert asked == [2, 3, 3, 5]  # None ends it: never asked again
    assert [c["seed"] for c in handed] == [1, 2, 3, 4, 5]


def test_a_resume_counts_the_seeds_an_earlier_run_added(monkeypatch):
    """Issue 34, item 9: resumed after a fault, the sweep said "confirmation: 14/14" where the record held 21
    runs; the seeds the first run had added were in no count. The decisions read them: they are counted."""
    from types import SimpleNamespace as NS

    import numpy as np
    import pandas as pd

    def run(key: str, seed: int):
        tags = {record_names.CONFIG_KEY: key, record_names.SEED: str(seed), record_names.STATUS: record_names.COMPLETED}
        return NS(data=NS(tags=tags), info=NS(run_id=f"{key}-{seed}", start_time=seed))

    runs = [run("a", 1), run("a", 2), run("a", 3), run("b", 1), run("b", 2)]  # seed 3 of a: added before the fault
    final = {key: decisions.Values(seeds, {"sst": np.zeros((len(seeds), 4))}) for key, seeds in
             (("a", (1, 2, 3)), ("b", (1, 2)))}  # fmt: skip
    outcome = decisions.Outcome([], {"a": 3, "b": 2}, {}, {}, 2, "decided", final)
    monkeypatch.setattr(confirm, "decide_round", lambda *args: outcome)
    monkeypatch.setattr(reader, "read_predictions", lambda uri, runs: pd.DataFrame())
    candidates = {k: NS(config_key=k, seconds_per_run=1.0, label=k, default=False) for k in "ab"}
    settings = NS(max_seconds=None, report_seeds=0, max_seeds=4)
    confirmation = confirm.Confirmation(
        definition=NS(confirm=settings, tasks=("sst",), seed=0, name="s", budget=NS(decision_examples=4)),
        record=NS(tracking_uri="", version=legacy.UNTAGGED),  # a record whose predictions may be missing: an old one
        runnable=None, trial_logger=NS(flush=lambda wait_s: True, confirmed={}), storage="",
        callbacks=(), verbose=0, flush_s=0.0,
        searched=candidates, candidates=list(candidates.values()),
        earlier={(run.data.tags[record_names.CONFIG_KEY], run.data.tags[record_names.SEED]): run for run in runs},
    )  # fmt: skip
    result = confirmation.run([(candidates[k], seed, "") for k in "ab" for seed in (1, 2)])
    assert (result.wanted, result.finished, result.ran, result.added) == (5, 5, 0, 1)
    assert result.status == record_names.COMPLETED and result.stopped_by == "decided"


def test_each_budget_confirms_its_best_contenders_of_any_method_and_the_anchors(tmp_path):
    """confirm.contenders: under each budget its best configurations by search score, whatever their method;
    confirm.anchors: frozen's and full fine-tuning's best, the floor and the ceiling."""
    from sweep_record import TrialSpec, counts, record_sweep

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"

    def trial(trial_id, method, accuracy, trainable, rank=None):
        options = {"rank": rank} if rank else {}
        return TrialSpec(trial_id, method, options, [{"sst_accuracy": accuracy}], counts(trainable), "completed")

    trials = [
        trial("frozen", "frozen", 0.30, 0),
        trial("full", "full", 0.60, 990_000),
        trial("ia3", "ia3", 0.40, 600),  # 0.06%
        trial("r1", "lora", 0.35, 600, rank=1),  # 0.06%
        trial("r8", "lora", 0.45, 5_000, rank=8),  # 0.5%
        trial("r64", "lora", 0.55, 40_000, rank=64),  # 4%
        trial("top", "top_k", 0.58, 300_000),  # 30%: in no budget
    ]
    _, parent, runs = record_sweep(uri, "contenders", ["sst"], trials, artifact_dir=tmp_path / "artifacts")
    client = mlflow.MlflowClient(uri)
    experiment = client.get_run(parent).info.experiment_id
    children = client.search_runs([experiment], filter_string=f"tags.`mlflow.parentRunId` = '{parent}'")
    picked = confirm.select_candidates(children, contenders=2, anchors=True, version=legacy.UNTAGGED)
    ids = {v: k for k, v in runs.items()}
    # <= 0.1%: ia3, r1; <= 1%: r8, ia3; <= 10%: r64, r8; then the anchors
    assert [ids[c.run_id] for c in picked] == ["ia3", "r1", "r8", "r64", "frozen", "full"]
    one = confirm.select_candidates(children, contenders=1, version=legacy.UNTAGGED)
    assert [ids[c.run_id] for c in one] == ["ia3", "r8", "r64"]
    # the confirmation's log names them as the report does, by method and size
    assert [c.label for c in picked] == ["ia3", "lora r=1", "lora r=8", "lora r=64", "frozen", "full"]


def test_a_confirmation_trains_on_every_row_the_held_out_splits_leave(tiny_data_dir):
    """The search's train rows are a prefix of the confirmation's; both carve the same selection and decision rows."""
    from peftune.core.trial_spec import DataSettings

    search = DataSettings(str(tiny_data_dir), max_train_examples=8, selection_examples=6, decision_examples=6)
    full = dataclasses.replace(search, max_train_examples=None)
    a, b = train.prepare(search, ["sst"]).tasks["sst"], train.prepare(full, ["sst"]).tasks["sst"]

    def lines(split):
        return set(split.lines.tolist())  # each row's line in the train file

    assert len(a.train) == 8 and len(b.train) > len(a.train)
    assert lines(a.train) < lines(b.train)
    assert lines(a.selection) == lines(b.selection) and lines(a.decision) == lines(b.decision)
    assert not (lines(b.selection) | lines(b.decision)) & lines(b.train)


def test_the_start_line_prints_the_margin_and_the_smallest_reachable_one():
    from types import SimpleNamespace

    from peftune.sweep import spaces

    definition = spaces.load_sweep(spaces.resolve_sweep_path("sst_tuning"), budget="cpu")
    prepared = SimpleNamespace(tasks={"sst": SimpleNamespace(decision=[0] * 2000)})
    line = confirm.reachable_margin_line(definition, prepared)
    assert "margin δ = 0.02" in line and "3 to 6 seeds" in line
    assert "NOT reachable within max_seeds" in line and "the smallest reachable margin is about 0.0" in line
    # the assumed components it says are the ones it computes with
    assert f"assuming {decisions.DISAGREEMENT:.0%} disagreement" in line and "24% disagreement" in line


def test_a_confirmation_runs_record_names_the_rows_it_trained_on(tmp_path):
    """The trial logger and the worker read a confirmation run's settings alike: its data settings are the
    confirmation's (every row not held out), so its params and trial_spec.json re-run what it trained."""
    from peftune.sweep import orchestrator, spaces

    definition = spaces.load_sweep(spaces.resolve_sweep_path("sst_tuning"), budget="cpu")
    settings = orchestrator.trial_settings(definition, 100, tmp_path)
    search = settings.for_trial({"method": "ia3", "peftune": {"phase": "search"}})
    confirming = settings.for_trial({"method": "ia3", "peftune": {"phase": "confirm", "seed": 1}})
    assert search.data.max_train_examples == 1600 and confirming.data.max_train_examples is None
    sampled = {"lr": 3e-3, "dropout": 0.1, "weight_decay": 0.0}
    assert confirming.trial_spec("ia3", sampled).params()["data.max_train_examples"] is None
