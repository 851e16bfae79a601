"""The per-method search: equal allocation, defaults first, stopping within a method, state across a restore.

Real Optuna studies in a SQLite storage, real ASHA schedulers fed results, and one real tiny
sweep (Ray Tune + MLflow) whose record must show the equal budget and the control arm.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import mlflow
import pytest
import ray
from ray import tune
from ray.tune.schedulers import ASHAScheduler, TrialScheduler
from ray.tune.search import Searcher

from conftest import start_local_ray
from peftune.base import record_names
from peftune.sweep import orchestrator, search, spaces

SPACES_DIR = spaces.SEARCH_SPACES_DIR / "methods"


def shipped_space(method: str) -> spaces.MethodSpace:
    return spaces.load_method_space(SPACES_DIR / f"{method}.yaml")


def make_searcher(
    tmp_path: Path, methods: list[str], trials_per_method: int, seed: int = 0, asynchronous: bool = True
) -> search.PerMethodSearcher:
    """Asynchronous by default here: these tests hand out many trials before any reports."""
    return search.PerMethodSearcher(
        {m: shipped_space(m) for m in methods},
        sweep="s",
        allocation=search.Allocation("trials", dict.fromkeys(methods, trials_per_method)),
        storage_url=f"sqlite:///{tmp_path / 'optuna.db'}",
        seed=seed,
        n_startup_trials=2,
        asynchronous=asynchronous,
    )


def hand_out(searcher, start: int, count: int) -> list[dict]:
    return [searcher.suggest(f"t{i}") for i in range(start, start + count)]


# ----------------------------------------------------------------------------- the searcher


def test_trials_are_split_equally_and_each_method_starts_with_its_published_default(tmp_path):
    methods = ["frozen", "lora", "adapter"]
    searcher = make_searcher(tmp_path, methods, trials_per_method=3)
    configs = hand_out(searcher, 0, 9)
    assert searcher.suggest("t9") == Searcher.FINISHED
    counts = Counter(c["method"] for c in configs)
    assert sorted(counts.values()) == [3, 3, 3]  # each method its trials_per_method
    # round robin: no method gets a second trial before every method has had its first
    assert [c["method"] for c in configs[:3]] == methods
    for config in configs[:3]:
        method = config["method"]
        assert config["peftune"] == {
            "phase": "search",
            "default": True,
            "config_key": record_names.config_key(method, config[method]),
            "optuna_study": f"s.{method}",  # the way to its Optuna trial (tags of its MLflow run)
            "optuna_trial": 0,
        }
        published = shipped_space(method).default
        assert {k: config[method][k] for k in published} == published
    assert not any(c["peftune"]["default"] for c in configs[3:])
    # the AdaptBert report's settings
    assert configs[0]["frozen"]["lr"] == 1e-3 and configs[0]["frozen"]["dropout"] == 0.3
    assert configs[1]["lora"]["lr"] == 1e-5 and configs[1]["lora"]["rank"] == 8
    assert configs[2]["adapter"]["bottleneck"] == 64
    keys = [c["peftune"]["config_key"] for c in configs]
    assert len(set(keys)) == len(keys)


def test_published_defaults_of_every_shipped_space():
    expected = {
        "full": {"lr": 1e-5},
        "frozen": {"lr": 1e-3},
        "lora": {"lr": 1e-5, "rank": 8},
        "adapter": {"lr": 1e-5, "bottleneck": 64},
        "lora_adapter": {"lr": 1e-5, "rank": 8, "bottleneck": 64},
        "hyperformer": {"lr": 1e-5, "bottleneck": 32, "projected_dim": 64},
        "prompt": {"lr": 0.3, "prompt_length": 100},
    }
    for path in sorted(SPACES_DIR.glob("*.yaml")):
        space = spaces.load_method_space(path)
        assert space.default_source, f"{path.name}: a default without its source"
        assert space.default["dropout"] == 0.3, path.name
        for key, value in expected.get(space.method, {}).items():
            assert space.default[key] == value, (path.name, key)


def test_results_go_to_the_method_study_and_state_survives_a_restore(tmp_path):
    searcher = make_searcher(tmp_path, ["frozen", "lora"], trials_per_method=3)
    first = hand_out(searcher, 0, 3)
    searcher.on_trial_complete("t0", {"score": 0.4})
    searcher.on_trial_complete("t1", None, error=True)
    checkpoint = tmp_path / "searcher.json"
    searcher.save(str(checkpoint))

    # what Tune does on a restore: a fresh (unpickled) searcher, then restore(); the studies come from the storage
    again = make_searcher(tmp_path, ["frozen", "lora"], trials_per_method=3)
    again.restore(str(checkpoint))
    assert again.handed == {"frozen": 2, "lora": 1} and set(again.live) == {"t2"}
    rest = hand_out(again, 3, 3)
    assert again.suggest("t6") == Searcher.FINISHED
    assert Counter(c["method"] for c in first + rest) == {"frozen": 3, "lora": 3}
    assert not any(c["peftune"]["default"] for c in rest), "a default was enqueued twice"
    again.on_trial_complete("t2", {"score": 0.5})
    frozen = again.study("frozen").get_trials(deepcopy=False)
    lora = again.study("lora").get_trials(deepcopy=False)
    assert [t.value for t in frozen[:2]] == [0.4, 0.5] and lora[0].state.name == "FAIL"
    assert len(frozen) == 3 and len(lora) == 3  # no trial asked twice


def test_data_fidelity_rungs():
    assert search.rung_fractions(3, 3) == pytest.approx([1 / 9, 1 / 3])
    assert search.rung_fractions(1, 3) == []
    definition = spaces.load_sweep(spaces.resolve_sweep_path("sst_tuning"))
    scheduler = search.make_scheduler(definition)
    assert scheduler.settings["time_attr"] == "progress" and scheduler.settings["max_t"] == 1.0
    assert orchestrator.trial_settings(definition).train["report_fractions"] == search.rung_fractions(
        definition.scheduler.rungs, definition.scheduler.reduction_factor
    )


def test_synchronous_search_waits_for_a_method_s_trial_before_its_next(tmp_path):
    searcher = make_searcher(tmp_path, ["frozen", "lora"], trials_per_method=2, asynchronous=False)
    first = hand_out(searcher, 0, 2)
    assert [c["method"] for c in first] == ["frozen", "lora"]
    assert searcher.suggest("t2") is None  # both methods have a trial running: wait, do not draw
    searcher.on_trial_complete("t1", {"score": 0.4})  # lora reports first: lora goes on, frozen still waits
    assert searcher.suggest("t2")["method"] == "lora"
    assert searcher.suggest("t3") is None
    searcher.on_trial_complete("t0", {"score": 0.3})
    assert searcher.suggest("t3")["method"] == "frozen"
    for trial in ("t2", "t3"):
        searcher.on_trial_complete(trial, {"score": 0.5})
    assert searcher.suggest("t4") == Searcher.FINISHED


def test_a_rung_under_the_step_floor_is_dropped_not_left_dead():
    # the cpu preset: 2 epochs of 2,400 rows in batches of 32 = 150 steps; 1/9 of them (17) is under min_steps 20
    definition = spaces.load_sweep(spaces.resolve_sweep_path("sst_tuning"), budget="cpu")
    assert definition.scheduler.min_steps == 20
    assert search.live_rungs(definition, 150) == pytest.approx([1 / 3])
    assert orchestrator.trial_settings(definition, 150).train["report_fractions"] == pytest.approx([1 / 3])
    scheduler = search.make_scheduler(definition, steps_per_run=150)
    assert scheduler.settings["grace_period"] == pytest.approx(1 / 3)  # the first live rung is ASHA's grace
    # a longer run keeps every rung; a run too short for any rung is judged at its end only
    assert search.live_rungs(definition, 1000) == pytest.approx([1 / 9, 1 / 3])
    assert search.live_rungs(definition, 50) == []


def test_a_trial_handed_out_after_the_last_saved_state_is_handed_out_again_not_asked_anew(tmp_path):
    searcher = make_searcher(tmp_path, ["frozen", "lora"], trials_per_method=3)
    hand_out(searcher, 0, 3)
    saved = tmp_path / "searcher.json"
    searcher.save(str(saved))  # Tune's last saved state
    lost = hand_out(searcher, 3, 1)[0]  # handed out, then the driver is killed before Tune saves again

    again = make_searcher(tmp_path, ["frozen", "lora"], trials_per_method=3)
    again.restore(str(saved))
    repeated = again.suggest("new-id")
    assert repeated == lost  # the same method, parameters, config key and default mark
    assert again.live["new-id"] == searcher.live["t3"]  # the same Optuna trial
    rest = hand_out(again, 10, 2)
    assert again.suggest("t99") == Searcher.FINISHED
    keys = [c["peftune"]["config_key"] for c in [*rest, repeated]]
    assert len(set(keys)) == 3
    assert sum(len(again.study(m).get_trials(deepcopy=False)) for m in ("frozen", "lora")) == 6


@pytest.mark.parametrize("unit", ["trials", "steps"])
def test_a_trial_asked_and_told_after_the_last_saved_state_counts_once_in_its_methods_budget(tmp_path, unit):
    # a quick method: its trial is asked and told between two of Tune's saves, then the driver is killed. Tune's
    # state (the searcher's with it) predates that trial; the study, which every ask and tell reaches, does not
    def searcher():
        allocation = search.Allocation(unit, {"frozen": 3, "lora": 3}, full_cost=100.0)
        return search.PerMethodSearcher(
            {m: shipped_space(m) for m in ("frozen", "lora")}, sweep="s", allocation=allocation,
            storage_url=f"sqlite:///{tmp_path / 'optuna.db'}", n_startup_trials=2, asynchronous=False,
        )  # fmt: skip

    done = {"score": 0.4, "steps": 100, "train_time_s": 2.0}
    first = searcher()
    hand_out(first, 0, 2)  # frozen #0 (t0), lora #0 (t1)
    saved = tmp_path / "searcher.json"
    first.save(str(saved))  # Tune's last saved state
    first.on_trial_complete("t0", done)
    assert first.suggest("t2")["method"] == "frozen"  # frozen #1: asked and told before the next save
    first.on_trial_complete("t2", done)
    lost = first.suggest("t3")  # frozen #2: asked, then the driver is killed

    again = searcher()
    again.restore(str(saved))
    assert again.handed == {"frozen": 2, "lora": 1}  # frozen #2 is an orphan: counted when handed out again
    assert again.timings()["frozen"] == [2.0, 2.0]
    if unit == "steps":
        assert again.budgets().spent("frozen") == 200.0
    again.on_trial_complete("t0", done)  # Tune ran t0 again (it was running at the save): counted once
    assert again.handed["frozen"] == 2 and again.timings()["frozen"] == [2.0, 2.0]
    assert again.suggest("t4") == lost  # the orphan, not a new trial
    for number in range(5, 20):  # the rest of the search: each trial reports before its method's next
        if (config := again.suggest(f"t{number}")) == Searcher.FINISHED:
            break
        for trial_id in list(again.live) if config is None else ():
            again.on_trial_complete(trial_id, done)
    assert config == Searcher.FINISHED
    for method in ("frozen", "lora"):
        assert len(again.study(method).get_trials(deepcopy=False)) == 3, method  # its budget, not one more
    if unit == "steps":
        assert again.budgets().spent("frozen") == again.budgets().spent("lora") == 300.0


# ----------------------------------------------------------------------------- the scheduler


def trial(trial_id: str, method: str):
    return SimpleNamespace(trial_id=trial_id, config={"method": method})  # what ASHA reads of a Ray trial


def feed(scheduler, trials, score: float, epoch: int = 1, steps: int = 100) -> list[str]:
    for t in trials:
        scheduler.on_trial_add(None, t)
    return [scheduler.on_trial_result(None, t, {"epoch": epoch, "score": score, "steps": steps}) for t in trials]


def test_a_weak_method_is_never_stopped_by_a_strong_methods_scores():
    strong = [trial(f"s{i}", "full") for i in range(4)]
    weak = [trial(f"w{i}", "bitfit") for i in range(2)]
    # a single ASHA over both methods stops the weak method's first trial at the first rung
    shared = ASHAScheduler(metric="score", mode="max", time_attr="epoch", max_t=4, grace_period=1, reduction_factor=2)
    feed(shared, strong, 0.9)
    assert feed(shared, weak[:1], 0.1) == [TrialScheduler.STOP]
    # one ASHA per method: the weak method's trials are compared with each other only
    scheduler = search.PerMethodScheduler(["full", "bitfit"], max_t=4, grace_period=1, reduction_factor=2)
    assert feed(scheduler, strong, 0.9) == [TrialScheduler.CONTINUE] * 4
    assert feed(scheduler, weak[:1], 0.1) == [TrialScheduler.CONTINUE]
    assert feed(scheduler, weak[1:], 0.05) == [TrialScheduler.STOP]  # worse than its own method's first


def test_no_trial_is_judged_below_the_step_floor():
    scheduler = search.PerMethodScheduler(["lora"], max_t=4, grace_period=1, reduction_factor=2, min_steps=50)
    good, bad = trial("a", "lora"), trial("b", "lora")
    assert feed(scheduler, [good], 0.9, steps=60) == [TrialScheduler.CONTINUE]
    assert feed(scheduler, [good], 0.9, epoch=2, steps=120) == [TrialScheduler.CONTINUE]
    assert feed(scheduler, [bad], 0.1, steps=25) == [TrialScheduler.CONTINUE]  # 25 < 50 steps: not judged
    assert feed(scheduler, [bad], 0.1, epoch=2, steps=50) == [TrialScheduler.STOP]


class Recorded:
    def __init__(self, results):
        self._results = results

    def results(self):
        return self._results


def test_the_rungs_are_refilled_from_the_record_after_unpickling():
    history = Recorded({"old": ("lora", [{"epoch": 1, "score": 0.9, "steps": 100}])})
    scheduler = search.PerMethodScheduler(["lora", "frozen"], max_t=4, grace_period=1, history=history)
    # what Tune's pickling does to the scheduler, through the same protocol but without unpickling bytes
    state = scheduler.__getstate__()
    assert set(state) == {"settings"}  # no rung state travels: it is rebuilt from the record
    restored = search.PerMethodScheduler.__new__(search.PerMethodScheduler)
    restored.__setstate__(state)
    assert feed(restored, [trial("new", "lora")], 0.2) == [TrialScheduler.STOP]  # judged against "old"
    assert feed(restored, [trial("other", "frozen")], 0.2) == [TrialScheduler.CONTINUE]


# ----------------------------------------------------------------------------- a real sweep

FROZEN = """\
    method: frozen
    lr: {low: 1.0e-4, high: 1.0e-2, log: true}
    dropout: {low: 0.0, high: 0.3}
    weight_decay: 0.0
    default: {lr: 1.0e-3, dropout: 0.3, source: "AdaptBert report"}
"""
TOP_K = """\
    method: top_k
    lr: {low: 2.0e-4, high: 1.0e-3, log: true}
    dropout: 0.1
    weight_decay: {low: 0.0, high: 0.1}
    options:
      k: {choices: [1, 2]}
    default: {lr: 5.0e-4, weight_decay: 0.0, k: 1, source: "test"}
"""
SWEEP = """\
    name: fair
    tasks: [sst]
    methods: [frozen, top_k]
    seed: 3
    search: {objective: single, sampler: tpe, n_startup_trials: 2, allocation: per_method}
    scheduler: {type: asha, reduction_factor: 2, min_steps: 1, fidelity: data, rungs: 3}
    resources: {cpus_per_trial: 1, max_concurrent_trials: 2}
    max_failures: 0
    checkpoints_per_method: 0
    confirm: {seeds: 0}       # the search alone: confirmation has its own tests
    budget: tiny
    budgets:
      tiny: {trials_per_method: 2, epochs: 2, batch_size: 16, max_length: 32, max_train_examples: 32,
             max_dev_examples: 16}
"""


@pytest.fixture(scope="module")
def local_ray():
    start_local_ray()
    yield
    ray.shutdown()


@pytest.mark.slow
def test_a_real_sweep_gives_each_method_an_equal_budget_and_a_default_trial(local_ray, tmp_path, tiny_data_dir):
    (tmp_path / "methods").mkdir()
    (tmp_path / "methods" / "frozen.yaml").write_text(textwrap.dedent(FROZEN))
    (tmp_path / "methods" / "top_k.yaml").write_text(textwrap.dedent(TOP_K))
    # no cap on concurrent trials, as the shipped definitions: Tune alone decides how many start at once
    (tmp_path / "fair.yaml").write_text(textwrap.dedent(SWEEP).replace("trials: 2}", "trials: null}"))
    definition = spaces.load_sweep(tmp_path / "fair.yaml")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = orchestrator.run_sweep(definition, tiny_data_dir, uri, storage_path=tmp_path / "ray", reports_dir=tmp_path)
    assert result.status == "completed" and orchestrator.PENDING_ENV not in os.environ  # Tune's setting given back

    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["fair"])
    parent = runs[runs["tags.peftune.role"] == "sweep"].iloc[0]
    children = runs[runs["tags.peftune.role"] == "trial"]
    assert len(children) == 4 and children["tags.peftune.trial_id"].is_unique
    assert sorted(Counter(children["tags.peftune.method"]).values()) == [2, 2]
    assert (children["tags.peftune.phase"] == "search").all()
    assert children["tags.peftune.config_key"].is_unique
    # both slots worked: trials shorter than a worker's start-up (seconds) still ran side by side
    spans = sorted(zip(children["start_time"], children["end_time"], strict=True))
    assert any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:], strict=False)), spans
    defaults = children[children["tags.peftune.default"] == "true"]
    assert sorted(defaults["tags.peftune.method"]) == ["frozen", "top_k"]
    frozen = defaults[defaults["tags.peftune.method"] == "frozen"].iloc[0]
    assert float(frozen["params.lr"]) == 1e-3 and float(frozen["params.dropout"]) == 0.3
    top_k = defaults[defaults["tags.peftune.method"] == "top_k"].iloc[0]
    assert float(top_k["params.lr"]) == 5e-4 and int(top_k["params.method.k"]) == 1
    for method, count in Counter(children["tags.peftune.method"]).items():
        assert parent[f"metrics.budget_trials.{method}"] == count
        mine = children[children["tags.peftune.method"] == method]
        # a trial stopped at a rung inside its first epoch has no epoch metrics: its rung's steps count
        steps = mine[["metrics.steps", "metrics.fidelity_steps"]].fillna(0).max(axis=1)
        assert (steps > 0).all() and parent[f"metrics.budget_steps.{method}"] == steps.sum()
        tokens = mine[["metrics.tokens_seen", "metrics.fidelity_tokens_seen"]].fillna(0).max(axis=1)
        assert (tokens >= steps).all() and parent[f"metrics.budget_tokens.{method}"] == tokens.sum()
        seconds = mine[["metrics.train_time_s", "metrics.fidelity_train_time_s"]].fillna(0).max(axis=1)
        assert (seconds > 0).all() and parent[f"metrics.budget_compute_s.{method}"] == pytest.approx(seconds.sum())
    # data fidelity: rungs at 1/4 (within the first epoch), 1/2 and all of the run's examples
    assert children["metrics.fidelity_score"].notna().all() and (children["metrics.fidelity_progress"] == 0.25).all()
    # the studies are in the Optuna storage beside the MLflow store, one per method, each 2 trials told
    import optuna

    for method, count in Counter(children["tags.peftune.method"]).items():
        study = optuna.load_study(study_name=f"fair.{method}", storage=f"sqlite:///{tmp_path / 'optuna.db'}")
        assert len(study.get_trials(deepcopy=False)) == count


def test_no_private_attributes_of_other_libraries_in_the_search_policy():
    import re

    for module in (search, orchestrator):
        source = Path(module.__file__).read_text()
        found = re.findall(r"\b(?:tuner|internal|study|searcher|scheduler|trial|asha)\._[a-z]\w*", source)
        assert not found, (module.__name__, found)


class Interrupt(tune.Callback):
    """Stops the experiment as Ctrl+C does (Tune's SIGUSR1 handler) at the first checkpoint after ``after`` trials."""

    def __init__(self, after: int):
        self.after, self.finished, self.fired = after, 0, False

    def on_trial_complete(self, iteration, trials, trial, **info):
        self.finished += 1

    def on_checkpoint(self, iteration, trials, trial, checkpoint, **info):
        if not self.fired and self.finished >= self.after:
            self.fired = True
            os.kill(os.getpid(), signal.SIGUSR1)


class Started(tune.Callback):
    def __init__(self):
        self.started: list[str] = []

    def on_trial_start(self, iteration, trials, trial, **info):
        self.started.append(trial.trial_id)


@pytest.mark.slow
def test_a_resumed_per_method_sweep_keeps_the_budgets_and_loses_or_repeats_nothing(local_ray, tmp_path, tiny_data_dir):
    (tmp_path / "methods").mkdir()
    (tmp_path / "methods" / "frozen.yaml").write_text(textwrap.dedent(FROZEN))
    (tmp_path / "methods" / "top_k.yaml").write_text(textwrap.dedent(TOP_K))
    (tmp_path / "fair.yaml").write_text(textwrap.dedent(SWEEP).replace("trials_per_method: 2", "trials_per_method: 3"))
    definition = spaces.load_sweep(tmp_path / "fair.yaml")
    uri, storage = f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "ray"
    interrupter = Interrupt(after=2)
    first = orchestrator.run_sweep(definition, tiny_data_dir, uri, storage_path=storage, callbacks=[interrupter])
    assert first.status == "interrupted" and interrupter.fired
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["fair"])
    finished = set(runs[runs["tags.peftune.status"].notna()]["tags.peftune.trial_id"].dropna())
    assert 2 <= len(finished) < 6

    started = Started()
    second = orchestrator.run_sweep(definition, tiny_data_dir, uri, storage_path=storage, callbacks=[started])
    assert second.status == "completed" and second.parent_run_id == first.parent_run_id
    assert not finished & set(started.started), "a finished trial ran again"
    assert interrupter.finished >= 2  # the first run's callback did not come back: it would have counted on

    runs = mlflow.search_runs(experiment_names=["fair"])
    parent = runs[runs["tags.peftune.role"] == "sweep"].iloc[0]
    children = runs[runs["tags.peftune.role"] == "trial"]
    assert len(children) == 6 and children["tags.peftune.trial_id"].is_unique, "a child run was lost or duplicated"
    assert children["tags.peftune.status"].notna().all()
    assert Counter(children["tags.peftune.method"]) == {"frozen": 3, "top_k": 3}
    assert Counter(children[children["tags.peftune.default"] == "true"]["tags.peftune.method"]) == {
        "frozen": 1,
        "top_k": 1,
    }
    assert children["tags.peftune.config_key"].is_unique, "a configuration ran twice"
    import optuna

    for method in ("frozen", "top_k"):
        assert parent[f"metrics.budget_trials.{method}"] == 3
        study = optuna.load_study(study_name=f"fair.{method}", storage=f"sqlite:///{tmp_path / 'optuna.db'}")
        assert len(study.get_trials(deepcopy=False)) == 3, "a study asked for more trials than ran"


DRIVER = """
import sys
from peftune.sweep import console, spaces, orchestrator
definition = spaces.load_sweep(sys.argv[1])
# Tune's status output: its "Trial ... started with configuration" lines are the starts run_driver counts
result = orchestrator.run_sweep(definition, sys.argv[2], sys.argv[3], storage_path=sys.argv[4], reports_dir=sys.argv[4],
                         verbose=console.TUNE_TABLES)
print("SWEEP", result.status, flush=True)
"""


def run_driver(args: list[str], kill_after_starts: int | None) -> str:
    """Run a sweep in its own process (and session); SIGKILL the whole session after that many trial starts."""
    process = subprocess.Popen(
        [sys.executable, "-c", DRIVER, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the driver and the local Ray it starts: killed together, as a crash does
        # a short lease (peftune.sweep.lease): the next driver takes over the killed one's once it lapsed, seconds later
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "PEFTUNE_LEASE_S": "3"},
    )
    lines, starts = [], 0
    try:
        for line in process.stdout:
            lines.append(line)
            starts += "started with configuration" in line
            if kill_after_starts is not None and starts >= kill_after_starts:
                os.killpg(process.pid, signal.SIGKILL)
                break
        process.wait(timeout=600)
    finally:
        if process.poll() is None or kill_after_starts is not None:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # whatever of this session is left
            except ProcessLookupError:
                pass
    return "".join(lines)


@pytest.mark.slow
def test_a_driver_killed_right_after_a_trial_start_leaves_no_ghost_and_runs_no_configuration_twice(
    tmp_path, tiny_data_dir
):
    (tmp_path / "methods").mkdir()
    (tmp_path / "methods" / "frozen.yaml").write_text(textwrap.dedent(FROZEN))
    (tmp_path / "methods" / "top_k.yaml").write_text(textwrap.dedent(TOP_K))
    (tmp_path / "fair.yaml").write_text(textwrap.dedent(SWEEP).replace("trials_per_method: 2", "trials_per_method: 3"))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = [str(tmp_path / "fair.yaml"), str(tiny_data_dir), uri, str(tmp_path / "ray")]
    first = run_driver(args, kill_after_starts=3)
    assert "SWEEP" not in first, first[-3000:]
    threading.Event().wait(3.5)  # the killed driver's lease lapses (PEFTUNE_LEASE_S=3): the next one takes over
    second = run_driver(args, kill_after_starts=None)
    assert "SWEEP completed" in second, second[-3000:]

    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["fair"])
    children = runs[runs["tags.peftune.role"] == "trial"]
    assert len(children) == 6, "a trial was lost or recorded twice (a ghost)"
    assert children["tags.peftune.trial_id"].is_unique and children["tags.peftune.config_key"].is_unique
    assert children["tags.peftune.status"].notna().all() and (children["status"] != "RUNNING").all()
    assert Counter(children["tags.peftune.method"]) == {"frozen": 3, "top_k": 3}
    import optuna

    for method in ("frozen", "top_k"):
        study = optuna.load_study(study_name=f"fair.{method}", storage=f"sqlite:///{tmp_path / 'optuna.db'}")
        trials = study.get_trials(deepcopy=False)
        assert len(trials) == 3 and all(t.state.is_finished() for t in trials), [t.state for t in trials]


def test_within_a_round_the_slowest_method_starts_first_so_the_phase_ends_on_short_trials(tmp_path):
    methods = ["frozen", "lora", "prompt"]
    searcher = make_searcher(tmp_path, methods, trials_per_method=3, asynchronous=False)
    first = hand_out(searcher, 0, 3)
    assert [c["method"] for c in first] == methods  # nothing timed yet: the listed order
    for i, seconds in enumerate((10.0, 20.0, 200.0)):  # a length-100 prompt trains 10-20x longer
        searcher.on_trial_complete(f"t{i}", {"score": 0.4, "train_time_s": seconds})
    assert [c["method"] for c in hand_out(searcher, 3, 3)] == ["prompt", "lora", "frozen"]
    checkpoint = tmp_path / "searcher.json"
    searcher.save(str(checkpoint))  # the timings survive a restore
    again = make_searcher(tmp_path, methods, trials_per_method=3, asynchronous=False)
    again.restore(str(checkpoint))
    assert again.mean_seconds("prompt") == 200.0 and again.mean_seconds("frozen") == 10.0


def test_a_packable_methods_trials_are_handed_out_as_one_round_of_a_pack(tmp_path):
    # not asynchronous: a method's trial waits for its earlier ones, but a pack's round of trials is handed out
    # together (asked of its study with the same trials told), the other methods' trials after it
    searcher = search.PerMethodSearcher(
        {m: shipped_space(m) for m in ("frozen", "bitfit")}, sweep="s",
        allocation=search.Allocation("trials", {"frozen": 4, "bitfit": 4}),
        storage_url=f"sqlite:///{tmp_path / 'optuna.db'}", n_startup_trials=2, asynchronous=False,
        pack_sizes={"bitfit": 3},
    )  # fmt: skip
    first = hand_out(searcher, 0, 4)
    assert [c["method"] for c in first] == ["frozen", "bitfit", "bitfit", "bitfit"]
    assert searcher.suggest("t4") is None  # frozen waits for its trial; bitfit's round is full
    searcher.on_trial_complete("t1", {"score": 0.4})
    assert searcher.suggest("t4") is None  # a round closes when all its trials ended
    for i in (2, 3):
        searcher.on_trial_complete(f"t{i}", {"score": 0.4})
    assert [c["method"] for c in hand_out(searcher, 4, 1)] == ["bitfit"]  # its next round
    state = tmp_path / "searcher.json"
    searcher.save(str(state))
    again = search.PerMethodSearcher(
        {m: shipped_space(m) for m in ("frozen", "bitfit")}, sweep="s",
        allocation=search.Allocation("trials", {"frozen": 4, "bitfit": 4}),
        storage_url=f"sqlite:///{tmp_path / 'optuna.db'}", n_startup_trials=2, asynchronous=False,
        pack_sizes={"bitfit": 3},
    )  # fmt: skip
    again.restore(str(state))
    assert again.open_round("bitfit") == 1 and again.pack_size("bitfit") == 3
