"""One Ray Tune experiment per sweep: Optuna proposes, ASHA stops weak trials, MLflow records.

``run_sweep(definition, data_dir, tracking_uri)`` is the one entry point (jobs and
``peftune sweep`` call it):

1. the definition is already validated (``peftune.spaces.load_sweep``); the driver
   reads, validates and tokenizes the data once (``peftune.train.prepare``) and the
   trials get it, with the pretrained weights, through Ray's object store
   (``tune.with_parameters``): no trial reads a file, no shared file system is assumed;
2. ``peftune.search`` decides what runs and what stops: with ``allocation: per_method``
   (the default) one seeded TPE study per method, an equal number of trials per method,
   each method's published default first, and ASHA within each method only; with
   ``allocation: joint``, ``OptunaSearch`` over a define-by-run space (a categorical
   ``method``, then only that method's parameters) and one ASHA for all trials; in
   multi-objective mode Optuna searches (max ``score``, min ``trainable_params_per_task``)
   jointly, without a scheduler;
3. each trial asks for a GPU fraction where the cluster has GPUs, CPUs otherwise,
   under an optional concurrency limit, and reports after each epoch the per-task
   dev metrics, the score, parameter counts and timings with a checkpoint of its
   trainable parameters; ``FailureConfig`` retries a failed trial from its last checkpoint;
4. Tune keeps its state under ``<storage_path>/<sweep name>``: running the same sweep
   again resumes it (``Tuner.restore``): finished trials are not run again,
   interrupted ones continue from their checkpoints; the searcher's state comes back
   through its own save/restore, the Optuna studies from their storage, the scheduler's
   rungs from the MLflow record, and the callbacks through ``peftune.resume``;
5. ``peftune.tracking`` logs everything to MLflow from the driver.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peftune import record as record_names
from peftune import spaces, tracking_buffer
from peftune.spaces import SweepDefinition

log = logging.getLogger("peftune.sweep")

DEFAULT_STORAGE_PATH = "ray_results"
REPORTS_DIR = "reports"
DIVERGED_FLAG = "diverged"  # set in a diverged trial's final result
TRACKING_WAIT_S = 600.0  # the end of a sweep waits this long for buffered MLflow writes

# a sweep's statuses (SweepResult.status, the parent run's peftune.status) and the jobs' exit codes
COMPLETED, COMPLETED_WITH_FAILURES, INTERRUPTED = "completed", "completed_with_failures", "interrupted"
FAILED = record_names.FAILED
EXIT_OK, EXIT_USER_ERROR, EXIT_INTERRUPTED, EXIT_FAILURES = 0, 2, 3, 4
EXIT_CODES_HELP = (
    "exit status: 0 completed (or completed_with_failures with --allow-failures); 2 bad input, nothing started; "
    "3 interrupted (run the same command again to resume); 4 some trials failed (completed_with_failures) "
    "or all did (failed)"
)


# ----------------------------------------------------------------------------- what a trial trains


@dataclass(frozen=True)
class TrialSettings:
    """The fixed part of every trial's TrainConfig; the sampled part comes from Optuna."""

    sweep: str
    tasks: tuple[str, ...]
    epochs: int
    batch_size: int
    seed: int
    train: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_definition(cls, definition: SweepDefinition) -> TrialSettings:
        budget = definition.budget
        return cls(
            definition.name,
            tuple(definition.tasks),
            budget.epochs,
            budget.batch_size,
            definition.seed,
            {**definition.train, **fidelity_settings(definition)},
        )

    def for_trial(self, config: dict) -> TrialSettings:
        """These settings with the trial's own seed where its config carries one (a confirmation trial)."""
        seed = (config.get("peftune") or {}).get("seed")
        return self if seed is None else dataclasses.replace(self, seed=int(seed))

    @staticmethod
    def split(config: dict) -> tuple[str, dict[str, Any]]:
        return spaces.sampled_settings(config)

    def train_config(self, method: str, sampled: dict[str, Any]):
        from peftune.train import TrainConfig

        options = dict(sampled)
        common = {key: options.pop(key) for key in ("lr", "dropout", "weight_decay")}
        return TrainConfig(
            method=method,
            method_options=options,
            tasks=list(self.tasks),
            epochs=self.epochs,
            batch_size=self.batch_size,
            seed=self.seed,
            **common,
            **self.train,
        )

    @staticmethod
    def method_fields(config) -> dict[str, Any]:
        """The method's resolved options (defaults included) except its dropout, which is ``dropout``."""
        from peftune import methods

        values = dataclasses.asdict(methods.make_method_config(config.method, config.method_options_with_dropout()))
        values.pop("dropout", None)
        return values


@dataclass(frozen=True)
class SharedData:
    """The sweep's ``PreparedData`` in Ray's object store, passed to trials by reference.

    Wrapped, because Tune resolves a bare object ref among a trainable's parameters for every trial.
    """

    ref: Any  # ray.ObjectRef


# this worker process's copy of the sweep's prepared data: {object ref hex: PreparedData}, one entry
_PREPARED: dict[str, Any] = {}


def worker_prepared(prepared):
    """The prepared data behind ``prepared`` (a SharedData), fetched from the object store once per process.

    Tune hands a reused worker its parameters again for every trial; fetched per trial, the weights
    and data (~100 MB for the embedded model on SST) were copied and deserialized again each time.
    A worker keeps one copy, of the sweep it runs now. (The worker memory growth that ended the
    README's cpu sweep had another cause: see :func:`release_freed_memory`.)
    """
    import ray

    if not isinstance(prepared, SharedData):
        return prepared
    key = prepared.ref.hex()
    if key not in _PREPARED:
        _PREPARED.clear()
        _PREPARED[key] = ray.get(prepared.ref)
    return _PREPARED[key]


def trainable(config: dict, prepared, settings: TrialSettings) -> None:
    """One Tune trial: train the sampled configuration, report + checkpoint after every epoch.

    ``prepared``: the sweep's ``PreparedData``, or a ``SharedData`` reference to it (see :func:`worker_prepared`).
    """
    import ray
    import torch
    from ray import tune

    from peftune.train import TrainingDiverged, run_trial

    prepared = worker_prepared(prepared)
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
    torch.set_num_threads(max(1, int(cpus)))
    settings = settings.for_trial(config)
    method, sampled = settings.split(config)
    train_config = settings.train_config(method, sampled)

    def report(metrics: dict, save: Callable[[Path], None] | None) -> None:
        if save is None:  # a data-fidelity rung within an epoch: a result for the scheduler, no checkpoint
            tune.report(metrics)
            return
        with tempfile.TemporaryDirectory(prefix="peftune-ckpt-") as directory:
            save(Path(directory))
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(directory))

    try:
        checkpoint = tune.get_checkpoint()
        if checkpoint is None:
            run_trial(train_config, prepared, report)
            return
        with tempfile.TemporaryDirectory(prefix="peftune-resume-") as directory:
            checkpoint.to_directory(directory)  # a local copy: Tune may prune the original while we train
            run_trial(train_config, prepared, report, resume_from=directory)
    except TrainingDiverged as error:
        # a result, not a failure: returning normally ends the trial TERMINATED, so FailureConfig does not
        # retry it and a re-run of the sweep does not run it again; no `epoch`, so ASHA ignores it, and
        # Optuna records a NaN objective as a failed trial of its study (no value to model)
        tune.report(diverged_result(str(error)))
    finally:
        release_freed_memory()


def release_freed_memory() -> None:
    """Give the heap's free pages back to the OS (glibc's ``malloc_trim``; a no-op elsewhere).

    Tune runs each trial of a reused worker in a new thread, and glibc gives threads their own malloc
    arenas: what a finished trial freed stayed in its arena, unused by the next trial's thread. On the
    README's cpu sweep the two workers grew to 8.1 and 10.6 GB by the 32nd trial and Ray's OOM killer
    ended the sweep; trimmed after each trial, a worker stayed at ~0.7 GB over 12 trials.
    """
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): its allocator returns memory its own way
        pass


def diverged_result(reason: str) -> dict[str, Any]:
    """The final result of a diverged trial: NaN for the searcher's metrics (Tune requires them), and the reason."""
    return {"score": math.nan, "trainable_params_per_task": math.nan, DIVERGED_FLAG: True, "divergence": reason}


# ----------------------------------------------------------------------------- the sweep


@dataclass
class SweepResult:
    name: str
    status: str  # completed | completed_with_failures | failed (every trial) | interrupted
    tracking_uri: str
    experiment_id: str
    parent_run_id: str
    experiment_path: str  # Ray Tune's state and checkpoints
    report_dir: Path  # where the report of this sweep is written
    num_trials: int
    statuses: dict[str, int]  # peftune.status -> trials (None: unfinished)
    best: dict | None  # best trial: trial_id, method, best_score, run_id, params
    resumed: bool
    checkpoints_logged: list[str] = field(default_factory=list)
    confirmation: dict | None = None  # peftune.confirm.ConfirmationResult as a dict (None: the search did not finish)

    @property
    def ui_address(self) -> str:
        from peftune import tracking

        return tracking.ui_hint(self.tracking_uri, self.experiment_id)[0]

    @property
    def ui_command(self) -> str | None:
        from peftune import tracking

        return tracking.ui_hint(self.tracking_uri, self.experiment_id)[1]

    def summary(self) -> str:
        counts = ", ".join(f"{n} {s or 'unfinished'}" for s, n in sorted(self.statuses.items(), key=str))
        lines = [f"sweep {self.name}: {self.status}; {self.num_trials} trials ({counts})"]
        if self.best:
            lines.append(
                f"best trial: {self.best['method']} ({self.best['trial_id']}) dev score {self.best['best_score']:.4f}"
            )
        if self.confirmation and self.confirmation["status"] != "skipped":
            c = self.confirmation
            lines.append(f"confirmation: {c['finished']}/{c['wanted']} seed runs of the best configurations finished")
        if self.status == INTERRUPTED:
            lines.append("run the same command again to resume it")
        failed = self.statuses.get(FAILED, 0)
        if failed:
            lines.append(f"{failed} trial(s) failed: their errors are the peftune.error tags of their runs")
        lines.append(f"MLflow parent run id: {self.parent_run_id}")
        lines.append(f"MLflow UI: {self.ui_address}")
        if self.ui_command:
            lines.append(f"  start it with: {self.ui_command}")
        lines.append(f"report: {self.report_dir}/")
        lines.append(f"Ray Tune state: {self.experiment_path}")
        return "\n".join(lines)


def init_ray(address: str | None = None) -> None:
    """Connect to a cluster (``address`` or ``RAY_ADDRESS``, as ``ray job submit`` sets) or start Ray locally."""
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
    else:
        # a Ray of this process only (address="local": never join a cluster started on this
        # machine by someone else), dashboard off: nothing listens beyond the driver's needs
        ray.init(address="local", include_dashboard=False, dashboard_host="127.0.0.1")


def check_storage(storage: str, shared: bool) -> None:
    """Refuse a local storage path on a multi-node cluster: worker nodes write trial checkpoints there.

    Ray fails every trial placed on another node at its first checkpoint ("A local path on the head
    node is not accessible by worker nodes") while the sweep ends "completed". A URI (s3://, gs://,
    file:// on a shared mount) or ``shared`` (the path is a mount every node has) is accepted.
    """
    import ray

    nodes = [node for node in ray.nodes() if node.get("Alive")]
    if len(nodes) > 1 and "://" not in storage and not shared:
        raise ValueError(
            f"--storage-path {storage}: a local path on a {len(nodes)}-node Ray cluster; worker nodes write "
            f"trial checkpoints there, so use s3://... / gs://..., or a file system every node mounts "
            f"at this path and say so with --shared-storage"
        )


def trial_resources(resources: spaces.Resources) -> dict[str, float]:
    """A GPU fraction per trial where the cluster has GPUs (several PEFT trials share one), CPUs otherwise."""
    import ray

    if ray.cluster_resources().get("GPU", 0) > 0:
        return {"cpu": resources.cpus_per_trial, "gpu": resources.gpus_per_trial}
    return {"cpu": resources.cpus_per_trial}


def per_method(definition: SweepDefinition) -> bool:
    """An equal budget per method (``peftune.search``); the multi-objective search stays joint."""
    return definition.search.allocation == "per_method" and not definition.multi_objective


def make_searcher(definition: SweepDefinition, storage_url: str | None = None):
    """``storage_url``: the Optuna storage of the per-method studies (needed with ``allocation: per_method``)."""
    import warnings

    if per_method(definition):
        from peftune.search import PerMethodSearcher

        if storage_url is None:
            raise ValueError("a per-method search needs an Optuna storage URL")
        return PerMethodSearcher(
            definition.spaces,
            sweep=definition.name,
            num_samples=definition.budget.num_samples,
            storage_url=storage_url,
            seed=definition.seed,
            n_startup_trials=definition.search.n_startup_trials,
        )

    import optuna
    from ray.tune.search.optuna import OptunaSearch

    # TPE's `group` (conditional spaces) is flagged experimental; it is what a per-method space needs
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning, module="optuna")

    search, seed = definition.search, definition.seed
    space = spaces.ConditionalSpace(definition.spaces)
    if definition.multi_objective:
        metric, mode = (list(x) for x in zip(*spaces.MULTI_OBJECTIVE, strict=True))
        if search.sampler == "nsga2":
            population = max(4, min(50, definition.budget.num_samples // 4))
            sampler = optuna.samplers.NSGAIISampler(seed=seed, population_size=population)
        else:
            sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=search.n_startup_trials)
        return OptunaSearch(space, metric=metric, mode=mode, sampler=sampler)
    # multivariate + group: TPE models each method's parameters jointly, conditioned on the method
    sampler = optuna.samplers.TPESampler(
        seed=seed, n_startup_trials=search.n_startup_trials, multivariate=True, group=True
    )
    return OptunaSearch(space, metric="score", mode="max", sampler=sampler)


def fidelity_settings(definition: SweepDefinition) -> dict[str, Any]:
    """The TrainConfig settings a data-fidelity scheduler needs: reports at its rungs within the run."""
    from peftune.search import rung_fractions

    if definition.scheduler.type == "none" or definition.multi_objective or definition.scheduler.fidelity != "data":
        return {}
    return {"report_fractions": rung_fractions(definition.scheduler.rungs, definition.scheduler.reduction_factor)}


def make_scheduler(definition: SweepDefinition, history=None):
    """``history``: ``tracking.RecordedResults`` of the sweep, from which a per-method scheduler refills its rungs."""
    if definition.scheduler.type == "none" or definition.multi_objective:
        return None
    from peftune.search import PerMethodScheduler, rung_fractions

    # ASHA per method (or one for all, in the joint search) that refills its rungs from the record on a restore
    data = definition.scheduler.fidelity == "data"  # rungs in the fraction of the run's examples seen
    fractions = rung_fractions(definition.scheduler.rungs, definition.scheduler.reduction_factor)
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


def run_sweep(
    definition: SweepDefinition,
    data_dir: str | Path,
    tracking_uri: str | None = None,
    *,
    storage_path: str | Path = DEFAULT_STORAGE_PATH,
    resume: bool | None = None,
    ray_address: str | None = None,
    shared_storage: bool = False,
    callbacks: Sequence = (),
    on_finished: Callable[[SweepResult], None] | None = None,
    reports_dir: str | Path = REPORTS_DIR,
    verbose: int = 1,
    optuna_storage: str | None = None,
    tracking_wait_s: float = TRACKING_WAIT_S,
) -> SweepResult:
    """Run (or resume) ``definition`` as one Ray Tune experiment logged to MLflow.

    ``resume``: None (default) resumes when Tune has state for this sweep name under
    ``storage_path`` and starts it otherwise; True requires that state; False refuses it.
    ``shared_storage``: ``storage_path`` is a directory every node of the cluster shares (NFS).
    ``callbacks``: extra ``tune.Callback`` objects (this run only). ``on_finished(result)``
    runs when every trial has finished: the hook for the report. ``optuna_storage``: the database
    URL of the per-method Optuna studies (default: ``peftune.search.default_storage_url``).
    ``tracking_wait_s``: how long the end of the sweep waits for MLflow writes still buffered (a
    tracking-server outage); what is left then stays on disk beside Tune's state and is written by
    the next run of the sweep.
    """
    import ray
    from ray import tune

    from peftune import confirm, tracking
    from peftune.resume import RunCallbacks, installed
    from peftune.train import prepare

    # num_to_keep=1 makes Tune snapshot its state at each checkpoint, as resuming needs; that is cheap here
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    tracking_uri = tracking.resolve_tracking_uri(tracking_uri)
    storage = _storage_uri(storage_path)
    experiment_path = f"{storage.rstrip('/')}/{definition.name}"
    exists = tune.Tuner.can_restore(experiment_path)
    if resume is True and not exists:
        raise ValueError(f"nothing to resume: no Ray Tune state for sweep {definition.name!r} at {experiment_path}")
    if resume is False and exists:
        raise ValueError(
            f"sweep {definition.name!r} already has Ray Tune state at {experiment_path}: resume it "
            f"(run it again without --fresh) or pick another name"
        )
    if exists and not tracking.has_parent_run(tracking_uri, definition.name):
        raise ValueError(tracking.missing_record_error(definition.name, tracking_uri, experiment_path))

    init_ray(ray_address)
    check_storage(storage, shared_storage)

    budget = definition.budget
    log.info("reading and tokenizing %s from %s (model %s)", ",".join(definition.tasks), data_dir, definition.model)
    prepared = prepare(
        data_dir,
        list(definition.tasks),
        model=definition.model,
        max_length=budget.max_length,
        max_train_examples=budget.max_train_examples,
        max_dev_examples=budget.max_dev_examples,
        seed=definition.seed,
        invalid_rows=definition.invalid_rows,
    )
    skipped = skipped_rows(prepared)
    if skipped:
        log.warning(
            "skipped %d invalid data row(s) (invalid_rows: skip); each is listed in the sweep's parent run "
            "(skipped_rows.json)",
            len(skipped),
        )
    record = tracking.open_sweep(
        tracking_uri,
        definition,
        data_hashes=prepared.file_hashes,
        ray_experiment_path=experiment_path,
        expect_existing=exists,
        skipped_rows=skipped,
    )
    confirm.log_dev_sizes(record, prepared)  # the report's noise rule for single runs needs them
    settings = TrialSettings.from_definition(definition)
    from peftune import search

    optuna_url = optuna_storage or search.default_storage_url(tracking_uri, storage)
    history = tracking.RecordedResults(record)
    pending = tracking_buffer.pending_path(storage, definition.name)
    if not exists:
        tracking_buffer.set_aside_stale(pending)
    trial_logger = tracking.TrialLogger(record, settings, _task_metric_names(definition.tasks), pending)
    trial_logger.open_buffer()  # first the writes an earlier run left pending: a resume reads the record
    all_callbacks = [trial_logger, *callbacks]

    try:
        init_ray(ray_address)
        shared = SharedData(ray.put(prepared))  # each worker fetches it once, not once per trial
        runnable = tune.with_resources(
            tune.with_parameters(trainable, prepared=shared, settings=settings), trial_resources(definition.resources)
        )
        del prepared  # the object store holds it now
        if exists:
            log.info("resuming sweep %s from %s", definition.name, experiment_path)
            # Tune brings back the pickled searcher (and restores its saved state), the scheduler (which
            # refills its rungs from the record) and a RunCallbacks (which forwards to this run's callbacks)
            tuner = tune.Tuner.restore(experiment_path, trainable=runnable, resume_unfinished=True, resume_errored=True)
        else:
            tuner = tune.Tuner(
                runnable,
                tune_config=tune.TuneConfig(
                    # metric and mode are set on the searcher and the scheduler themselves (not here)
                    search_alg=make_searcher(definition, optuna_url),
                    scheduler=make_scheduler(definition, history),
                    num_samples=budget.num_samples,
                    max_concurrent_trials=definition.resources.max_concurrent_trials,
                    reuse_actors=True,  # one worker process runs trial after trial: torch is imported once
                    trial_name_creator=trial_name,
                    trial_dirname_creator=trial_name,
                ),
                run_config=tune.RunConfig(
                    name=definition.name,
                    storage_path=storage,
                    callbacks=[RunCallbacks()],
                    failure_config=tune.FailureConfig(max_failures=definition.max_failures),
                    checkpoint_config=tune.CheckpointConfig(
                        num_to_keep=1, checkpoint_score_attribute="score", checkpoint_score_order="max"
                    ),
                    verbose=verbose,
                ),
            )
        with installed(all_callbacks):
            grid = tuner.fit()
        if not trial_logger.flush(tracking_wait_s):
            return _unrecorded(definition, record, tracking_uri, experiment_path, reports_dir, trial_logger, len(grid))
        confirmation = None
        searched = confirm.search_run_ids(record)
        trials = [t for t in tracking.trial_records(record) if t.run_id in searched]
        complete = len(grid) >= budget.num_samples and len([t for t in trials if t.status]) >= len(grid)
        if complete:  # the search is over: confirm the best configurations of every method with seeds
            confirmation = confirm.run_confirmation(
                definition,
                record,
                runnable,
                trial_logger=trial_logger,
                storage=storage,
                callbacks=callbacks,
                verbose=verbose,
                flush_s=tracking_wait_s,
            )
            if not trial_logger.flush(tracking_wait_s):
                return _unrecorded(
                    definition, record, tracking_uri, experiment_path, reports_dir, trial_logger, len(grid)
                )
            complete = confirmation.status != "interrupted"
        status = sweep_status(trials) if complete else INTERRUPTED
        logged = []
        if complete:
            tracking.log_method_budgets(record)
            logged = tracking.log_best_checkpoints(record, _best_checkpoints(grid), definition.checkpoints_per_method)
        tracking.close_sweep(record, status)
    except BaseException as error:
        # a second Ctrl-C (Tune handles only the first) lands here too: the records are closed all the same
        with _sigint_ignored():
            trial_logger.close_open_runs()
            if trial_logger.flush(tracking_wait_s):
                tracking.close_sweep(record, INTERRUPTED if isinstance(error, KeyboardInterrupt) else FAILED)
            else:
                log.error("MLflow unreachable: the record of sweep %s stays open; %s", definition.name, pending)
        raise
    result = _result(
        definition,
        record,
        (tracking_uri, experiment_path, reports_dir),
        status,
        trials,
        checkpoints_logged=logged,
        confirmation=dataclasses.asdict(confirmation) if confirmation else None,
    )
    if complete and on_finished is not None:
        on_finished(result)  # the report goes here
    return result


def skipped_rows(prepared) -> list[dict[str, Any]]:
    """Every data row dropped under ``invalid_rows: skip``: {file, line, reason}, by file then line."""
    rows = [
        {"file": Path(split.source).name, "line": line, "reason": reason}
        for task in prepared.tasks.values()
        for split in (task.train, task.dev)
        for line, reason in split.skipped
    ]
    return sorted(rows, key=lambda row: (row["file"], row["line"]))


def _unrecorded(definition, record, tracking_uri, experiment_path, reports_dir, trial_logger, num_trials):
    """Every trial ran but MLflow did not take all their writes: they wait on disk for the next run."""
    log.error(
        "MLflow at %s is unreachable: %d write(s) of sweep %s are kept in %s; run the same command again "
        "when it is back to write them (no trial runs again)",
        tracking_uri,
        trial_logger.buffer.pending(),
        definition.name,
        trial_logger.pending_path,
    )
    trial_logger.buffer.stop()
    where = (tracking_uri, experiment_path, reports_dir)
    return _result(definition, record, where, INTERRUPTED, trials=(), num_trials=num_trials)


def _result(definition, record, where: tuple, status: str, trials: Sequence, **extra) -> SweepResult:
    """The sweep's outcome; ``where``: (tracking URI, Ray Tune experiment path, reports directory)."""
    tracking_uri, experiment_path, reports_dir = where
    scored = [t for t in trials if t.best_score is not None]
    best = max(scored, key=lambda t: t.best_score) if scored else None
    return SweepResult(
        name=definition.name,
        status=status,
        tracking_uri=tracking_uri,
        experiment_id=record.experiment_id,
        parent_run_id=record.parent_run_id,
        experiment_path=experiment_path,
        report_dir=Path(reports_dir).resolve() / definition.name,
        num_trials=extra.pop("num_trials", len(trials)),
        statuses=dict(Counter(trial.status for trial in trials)),
        best=dataclasses.asdict(best) if best else None,
        resumed=record.resumed,
        **extra,
    )


def sweep_status(trials: Sequence) -> str:
    """A finished sweep's status: ``failed`` when every trial failed, ``completed_with_failures`` when some did."""
    failed = sum(trial.status == FAILED for trial in trials)
    if trials and failed == len(trials):
        return FAILED
    return COMPLETED_WITH_FAILURES if failed else COMPLETED


@contextlib.contextmanager
def _sigint_ignored():
    """Ctrl-C is ignored while the records are closed (only the main thread may set signal handlers)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def trial_name(trial) -> str:
    """``lora_3f2a1c0d``: the method and Ray's trial id (Ray's default name lists every parameter)."""
    return f"{trial.config.get('method', 'trial')}_{trial.trial_id}"


def _task_metric_names(tasks: Sequence[str]) -> list[str]:
    from peftune.tasks import get_task
    from peftune.train import metric_name

    return [metric_name(get_task(t)) for t in tasks]


def _storage_uri(storage_path: str | Path) -> str:
    text = str(storage_path)
    return text if "://" in text else str(Path(text).expanduser().resolve())


def _best_checkpoints(grid) -> dict[str, tuple[float, Any]]:
    """Ray trial id -> (best score, the checkpoint of that epoch) for every trial that kept one."""
    out = {}
    for result in grid:
        best = [
            (metrics.get("score"), checkpoint)
            for checkpoint, metrics in (result.best_checkpoints or [])
            if metrics.get("score") is not None
        ]
        if best and result.metrics:
            out[result.metrics["trial_id"]] = max(best, key=lambda pair: pair[0])
    return out


# ----------------------------------------------------------------------------- command line (jobs, peftune sweep)


def add_arguments(parser, definition_default: str | None = None) -> None:
    """The sweep flags shared by ``jobs/*.py`` and ``peftune sweep``."""
    from peftune.backbone import DEFAULT_MODEL

    if definition_default is None:
        parser.add_argument(
            "definition",
            help="a sweep definition: a name under search_spaces/ (sst_tuning, "
            "multitask_tuning, smoke) or a path to a YAML file",
        )
    else:
        parser.set_defaults(definition=definition_default)
    parser.add_argument("--data-dir", required=True, help="directory holding the task files (read by the driver only)")
    parser.add_argument(
        "--smoke-test",
        action="store_true",
        help="the tiny 'smoke' budget: a few trials on a sliver of the data, minutes on 2 CPU cores",
    )
    parser.add_argument(
        "--budget", help="a budget preset of the definition (e.g. smoke, cpu, gpu; default: the definition's own)"
    )
    parser.add_argument("--num-samples", type=int, help="number of trials (overrides the budget's)")
    parser.add_argument(
        "--model",
        help=f"backbone: a local HF BERT directory, a hub name or {DEFAULT_MODEL!r} (default: the definition's)",
    )
    parser.add_argument("--name", help="sweep name (default: the definition's); a new name starts a new sweep")
    parser.add_argument(
        "--multi-objective",
        action="store_true",
        help="search (max score, min trainable parameters) with Optuna directly, no scheduler",
    )
    parser.add_argument(
        "--tracking-uri",
        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the working directory)",
    )
    parser.add_argument(
        "--storage-path",
        default=DEFAULT_STORAGE_PATH,
        help="where Ray Tune keeps the sweep's state and checkpoints (a directory, or s3://... on a "
        f"multi-node cluster; default ./{DEFAULT_STORAGE_PATH})",
    )
    parser.add_argument(
        "--optuna-storage",
        help="database URL of the per-method Optuna studies (default: optuna.db beside a SQLite MLflow store, "
        "else under --storage-path)",
    )
    parser.add_argument(
        "--reports-dir", default=REPORTS_DIR, help=f"reports go to <dir>/<sweep>/ (default ./{REPORTS_DIR})"
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--resume",
        action="store_true",
        help="resume the sweep of this name (an error if there is none); running a sweep again resumes it anyway",
    )
    group.add_argument("--fresh", action="store_true", help="refuse to resume: an error if the sweep exists")
    parser.add_argument(
        "--invalid-rows",
        choices=["raise", "skip"],
        help="a malformed data row stops the sweep (raise) or is dropped and recorded in the parent run (skip); "
        "default: the definition's invalid_rows",
    )
    parser.add_argument(
        "--ray-address", help="Ray cluster to join (default: $RAY_ADDRESS, as `ray job submit` sets; else a local Ray)"
    )
    parser.add_argument(
        "--shared-storage",
        action="store_true",
        help="--storage-path is a directory every node of the cluster mounts (NFS); needed for a local "
        "path on a multi-node cluster",
    )
    parser.add_argument(
        "--allow-failures",
        action="store_true",
        help="exit 0 when some (not all) trials failed; without it such a sweep exits 4",
    )


def definition_from_args(args) -> SweepDefinition:
    budget = "smoke" if args.smoke_test else args.budget
    if args.smoke_test and args.budget not in (None, "smoke"):
        raise ValueError(f"--smoke-test uses the smoke budget; it cannot be combined with --budget {args.budget}")
    definition = spaces.load_sweep(spaces.resolve_sweep_path(args.definition), budget=budget)
    overrides = {"num_samples": args.num_samples} if args.num_samples is not None else {}
    return definition.with_overrides(
        name=args.name,
        model=args.model,
        multi_objective=True if args.multi_objective else None,
        invalid_rows=getattr(args, "invalid_rows", None),
        **overrides,
    )


def main_from_args(args, on_finished: Callable[[SweepResult], None] | None = None) -> int:
    """Run the sweep the flags describe; ``on_finished`` is ``run_sweep``'s report hook."""
    from peftune import record

    definition = definition_from_args(args)  # validated before anything starts
    record.check_tracking_uri(record.resolve_tracking_uri(args.tracking_uri))
    _warn_relative_paths_in_job(args)
    result = run_sweep(
        definition,
        args.data_dir,
        args.tracking_uri,
        storage_path=args.storage_path,
        resume=True if args.resume else (False if args.fresh else None),
        ray_address=args.ray_address,
        shared_storage=args.shared_storage,
        reports_dir=args.reports_dir,
        on_finished=on_finished,
        optuna_storage=getattr(args, "optuna_storage", None),
    )
    ignore_further_interrupts()  # the records are closed: a late Ctrl-C must not turn the exit status into a lie
    print("\n" + result.summary(), flush=True)
    return exit_code(result.status, allow_failures=getattr(args, "allow_failures", False))


def ignore_further_interrupts() -> None:
    """The command is ending (Ray shuts down at exit): Ctrl-C from now on is ignored."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def exit_code(status: str, allow_failures: bool = False) -> int:
    """See :data:`EXIT_CODES_HELP`; ``allow_failures`` forgives some failed trials, never all."""
    if status == COMPLETED or (status == COMPLETED_WITH_FAILURES and allow_failures):
        return EXIT_OK
    return EXIT_INTERRUPTED if status == INTERRUPTED else EXIT_FAILURES


def job_main(
    definition: str,
    description: str,
    argv: list[str] | None = None,
    on_finished: Callable[[SweepResult], None] | None = None,
) -> int:
    """What ``jobs/*.py`` run: parse the flags, run the sweep, print where everything is.

    ``on_finished(result)`` runs when the sweep has completed: where the report is written.
    """
    import argparse
    import sys

    from peftune import cli

    parser = argparse.ArgumentParser(
        description=description, epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser, definition_default=definition)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    try:
        return main_from_args(args, on_finished=on_finished)
    except cli.user_errors() as error:
        print(f"{parser.prog}: error: {cli.one_line(error)}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:  # a second Ctrl-C: run_sweep has closed the records
        ignore_further_interrupts()
        print(f"{parser.prog}: interrupted; run the same command again to resume", file=sys.stderr)
        return EXIT_INTERRUPTED


def _warn_relative_paths_in_job(args) -> None:
    """Under ``ray job submit --working-dir .`` the working directory is a temporary copy of yours."""
    if "RAY_JOB_CONFIG_JSON_ENV_VAR" not in os.environ:
        return
    from peftune import tracking

    relative = [
        flag
        for flag, value in (
            ("--data-dir", args.data_dir),
            ("--storage-path", args.storage_path),
            ("--reports-dir", args.reports_dir),
        )
        if "://" not in str(value) and not Path(value).is_absolute()
    ]
    uri = tracking.resolve_tracking_uri(args.tracking_uri)
    if args.tracking_uri is None and tracking.sqlite_path(uri) is not None:
        relative.append("--tracking-uri")
    if relative:
        log.warning(
            "running as a Ray job in %s (a copy of the submitted working directory): %s resolve there; "
            "pass absolute paths to keep the results",
            os.getcwd(),
            ", ".join(relative),
        )
