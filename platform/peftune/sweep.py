"""One Ray Tune experiment per sweep: Optuna proposes, ASHA stops weak trials, MLflow records.

``run_sweep(definition, data_dir, tracking_uri)`` is the one entry point (jobs and
``peftune sweep`` call it):

1. the definition is already validated (``peftune.spaces.load_sweep``); the driver
   reads, validates and tokenizes the data once (``peftune.train.prepare``) and the
   trials get it, with the pretrained weights, through Ray's object store
   (``tune.with_parameters``): no trial reads a file, no shared file system is assumed;
2. ``OptunaSearch`` with a seeded sampler proposes configurations from a
   define-by-run space (a categorical ``method``, then only that method's
   parameters); ``ASHAScheduler`` on the dev ``score`` stops weak trials after
   their first epoch(s); in multi-objective mode Optuna searches (max ``score``,
   min ``trainable_params_per_task``) directly, without a scheduler;
3. each trial asks for a GPU fraction where the cluster has GPUs, CPUs otherwise,
   under an optional concurrency limit, and reports after each epoch the per-task
   dev metrics, the score, parameter counts and timings with a checkpoint of its
   trainable parameters; ``FailureConfig`` retries a failed trial from its last checkpoint;
4. Tune keeps its state under ``<storage_path>/<sweep name>``: running the same sweep
   again resumes it (``Tuner.restore``): finished trials are not run again,
   interrupted ones continue from their checkpoints;
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
            dict(definition.train),
        )

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


def trainable(config: dict, prepared, settings: TrialSettings) -> None:
    """One Tune trial: train the sampled configuration, report + checkpoint after every epoch."""
    import ray
    import torch
    from ray import tune

    from peftune.train import TrainingDiverged, run_trial

    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
    torch.set_num_threads(max(1, int(cpus)))
    method, sampled = settings.split(config)
    train_config = settings.train_config(method, sampled)

    def report(metrics: dict, save: Callable[[Path], None]) -> None:
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


def trial_resources(resources: spaces.Resources) -> dict[str, float]:
    """A GPU fraction per trial where the cluster has GPUs (several PEFT trials share one), CPUs otherwise."""
    import ray

    if ray.cluster_resources().get("GPU", 0) > 0:
        return {"cpu": resources.cpus_per_trial, "gpu": resources.gpus_per_trial}
    return {"cpu": resources.cpus_per_trial}


def make_searcher(definition: SweepDefinition):
    import warnings

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


def make_scheduler(definition: SweepDefinition):
    if definition.scheduler.type == "none" or definition.multi_objective:
        return None
    from ray.tune.schedulers import ASHAScheduler

    epochs = definition.budget.epochs
    return ASHAScheduler(
        metric="score",
        mode="max",
        time_attr="epoch",
        max_t=epochs,
        grace_period=min(definition.scheduler.grace_period, epochs),
        reduction_factor=definition.scheduler.reduction_factor,
    )


def run_sweep(
    definition: SweepDefinition,
    data_dir: str | Path,
    tracking_uri: str | None = None,
    *,
    storage_path: str | Path = DEFAULT_STORAGE_PATH,
    resume: bool | None = None,
    ray_address: str | None = None,
    callbacks: Sequence = (),
    on_finished: Callable[[SweepResult], None] | None = None,
    reports_dir: str | Path = REPORTS_DIR,
    verbose: int = 1,
    tracking_wait_s: float = TRACKING_WAIT_S,
) -> SweepResult:
    """Run (or resume) ``definition`` as one Ray Tune experiment logged to MLflow.

    ``resume``: None (default) resumes when Tune has state for this sweep name under
    ``storage_path`` and starts it otherwise; True requires that state; False refuses it.
    ``callbacks``: extra ``tune.Callback`` objects (this run only). ``on_finished(result)``
    runs when every trial has finished: the hook for the report. ``tracking_wait_s``: how long the end
    of the sweep waits for MLflow writes still buffered (a tracking-server outage); what is left then
    stays on disk beside Tune's state and is written by the next run of the sweep.
    """
    from ray import tune

    from peftune import tracking
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
    )
    record = tracking.open_sweep(
        tracking_uri,
        definition,
        data_hashes=prepared.file_hashes,
        ray_experiment_path=experiment_path,
        expect_existing=exists,
    )
    settings = TrialSettings.from_definition(definition)
    pending = tracking_buffer.pending_path(storage, definition.name)
    if not exists:
        tracking_buffer.set_aside_stale(pending)
    trial_logger = tracking.TrialLogger(record, settings, _task_metric_names(definition.tasks), pending)
    trial_logger.open_buffer()  # first the writes an earlier run left pending: a resume reads the record
    all_callbacks = [trial_logger, *callbacks]

    try:
        init_ray(ray_address)
        runnable = tune.with_resources(
            tune.with_parameters(trainable, prepared=prepared, settings=settings), trial_resources(definition.resources)
        )
        del prepared  # the object store holds it now
        if exists:
            log.info("resuming sweep %s from %s", definition.name, experiment_path)
            tuner = tune.Tuner.restore(experiment_path, trainable=runnable, resume_unfinished=True, resume_errored=True)
            _restore_callbacks_and_scheduler(tuner, all_callbacks, make_scheduler(definition), record)
        else:
            tuner = tune.Tuner(
                runnable,
                tune_config=tune.TuneConfig(
                    # metric and mode are set on OptunaSearch and ASHA themselves (not here), so that a
                    # resumed sweep can hand Tune an ASHA with its rungs refilled
                    search_alg=make_searcher(definition),
                    scheduler=make_scheduler(definition),
                    num_samples=budget.num_samples,
                    max_concurrent_trials=definition.resources.max_concurrent_trials,
                    reuse_actors=True,  # one worker process runs trial after trial: torch is imported once
                    trial_name_creator=trial_name,
                    trial_dirname_creator=trial_name,
                ),
                run_config=tune.RunConfig(
                    name=definition.name,
                    storage_path=storage,
                    callbacks=all_callbacks,
                    failure_config=tune.FailureConfig(max_failures=definition.max_failures),
                    checkpoint_config=tune.CheckpointConfig(
                        num_to_keep=1, checkpoint_score_attribute="score", checkpoint_score_order="max"
                    ),
                    verbose=verbose,
                ),
            )
        grid = tuner.fit()
        if not trial_logger.flush(tracking_wait_s):
            return _unrecorded(definition, record, tracking_uri, experiment_path, reports_dir, trial_logger, len(grid))
        trials = tracking.trial_records(record)
        finished = [t for t in trials if t.status]
        complete = len(grid) >= budget.num_samples and len(finished) >= len(grid)
        status = sweep_status(trials) if complete else INTERRUPTED
        logged = []
        if complete:
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
    statuses = dict(Counter(trial.status for trial in trials))
    scored = [t for t in trials if t.best_score is not None]
    best = max(scored, key=lambda t: t.best_score) if scored else None
    result = SweepResult(
        name=definition.name,
        status=status,
        tracking_uri=tracking_uri,
        experiment_id=record.experiment_id,
        parent_run_id=record.parent_run_id,
        experiment_path=experiment_path,
        report_dir=Path(reports_dir).resolve() / definition.name,
        num_trials=len(trials),
        statuses=statuses,
        best=dataclasses.asdict(best) if best else None,
        resumed=record.resumed,
        checkpoints_logged=logged,
    )
    if complete and on_finished is not None:
        on_finished(result)  # the report goes here
    return result


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
    return SweepResult(
        name=definition.name,
        status=INTERRUPTED,
        tracking_uri=tracking_uri,
        experiment_id=record.experiment_id,
        parent_run_id=record.parent_run_id,
        experiment_path=experiment_path,
        report_dir=Path(reports_dir).resolve() / definition.name,
        num_trials=num_trials,
        statuses={},
        best=None,
        resumed=record.resumed,
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


def _restore_callbacks_and_scheduler(tuner, callbacks: list, scheduler, record) -> None:
    """Give a restored Tuner this run's callbacks and an ASHA that remembers the epochs already run.

    ``Tuner.restore`` brings back the callbacks and the scheduler pickled when the sweep started.
    This run's tracking callback must be used (it knows this run's MLflow parent run), and a
    callback given for one run (a test's interrupter, a progress hook) must not come back. ASHA's
    rungs are not part of Tune's saved state, so a restored ASHA would let every resumed or new
    trial through its first rung; the scores recorded in MLflow refill them. Ray 2.60 has no public
    way to set either on a restored Tuner: this sets them on its internal configs.
    """
    from types import SimpleNamespace

    from peftune import tracking

    internal = getattr(tuner, "_local_tuner", None)
    if internal is None or not hasattr(internal, "get_run_config") or not hasattr(internal, "_tune_config"):
        raise RuntimeError("this Ray version's Tuner does not expose its configs; peftune needs Ray 2.60")
    internal.get_run_config().callbacks = list(callbacks)
    if scheduler is None:
        return
    for trial_id, scores in tracking.score_history(record).items():
        trial = SimpleNamespace(trial_id=trial_id)  # ASHA keys its rungs by trial id
        scheduler.on_trial_add(None, trial)
        for epoch in sorted(scores):
            scheduler.on_trial_result(None, trial, {"epoch": epoch, "score": scores[epoch]})
    internal._tune_config.scheduler = scheduler


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
        "--ray-address", help="Ray cluster to join (default: $RAY_ADDRESS, as `ray job submit` sets; else a local Ray)"
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
        name=args.name, model=args.model, multi_objective=True if args.multi_objective else None, **overrides
    )


def main_from_args(args, on_finished: Callable[[SweepResult], None] | None = None) -> int:
    """Run the sweep the flags describe; ``on_finished`` is ``run_sweep``'s report hook."""
    definition = definition_from_args(args)  # validated before anything starts
    _warn_relative_paths_in_job(args)
    result = run_sweep(
        definition,
        args.data_dir,
        args.tracking_uri,
        storage_path=args.storage_path,
        resume=True if args.resume else (False if args.fresh else None),
        ray_address=args.ray_address,
        reports_dir=args.reports_dir,
        on_finished=on_finished,
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
    except (ValueError, KeyError, FileNotFoundError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
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
