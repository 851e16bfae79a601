"""One Ray Tune experiment per sweep: Optuna proposes, ASHA stops weak trials, MLflow records.

``run_sweep(definition, data_dir, tracking_uri)`` is the one entry point (jobs and ``peftune sweep`` call it). The
driver reads, validates and tokenizes the data once and hands it to the trials through Ray's object store;
``peftune.sweep.search`` decides what runs and what stops; each trial asks for a GPU fraction where the cluster has
GPUs, CPUs otherwise, reports after each epoch with a checkpoint of its trainable parameters, and is retried from it on
failure; ``peftune.sweep.confirm`` re-trains the contenders with new seeds; ``peftune.record.writer`` records everything
from the driver. Tune's state under ``<storage_path>/<sweep name>`` makes running the same sweep again resume it. The
driver holds the sweep's lease (``peftune.sweep.lease``) and ships the code it imported to every trial. The phases in
order: docs/design.md, "The sweep's phases".
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import json
import logging
import math
import os
import signal
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray import tune

import peftune
from peftune.base import record_names
from peftune.base.errors import UserError, disk_full, no_space, one_line
from peftune.base.record_names import (
    BEST_SCORE,
    COMPLETED,
    COMPLETED_WITH_FAILURES,
    FAILED,
    INTERRUPTED,
    SCORE,
    UNFINISHED,
)
from peftune.core import train
from peftune.inputs.tasks import get_task
from peftune.record import legacy, reader, stores, tracking_buffer, ui_links, writer
from peftune.record.stores import DEFAULT_STORAGE_PATH
from peftune.record.trial_logger import RecordedResults, TrialLogger
from peftune.sweep import carry, confirm, console, lease, packing, search, spaces, worker
from peftune.sweep.resume import (
    CheckpointPruner,
    GoodState,
    RunCallbacks,
    checkpoint_exists,
    installed,
    old_names,
    repair_state,
)
from peftune.sweep.shared_data import SharedData
from peftune.sweep.spaces import SweepDefinition, prepare_data
from peftune.sweep.stopping import ctrl_c_through_tune, note_sigterm, stopped

log = logging.getLogger("peftune.sweep")

MLFLOW_FAIL_FAST = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                    "MLFLOW_HTTP_REQUEST_TIMEOUT": "15"}  # fmt: skip
PENDING_ENV = "TUNE_MAX_PENDING_TRIALS_PG"  # Tune's bound on trials waiting for a worker (see every_slot_pending)
TRACKING_WAIT_S = 600.0  # the end of a sweep waits this long for buffered MLflow writes


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
    # peftune.sweep.confirm.ConfirmationResult as a dict (None: the search did not finish)
    confirmation: dict | None = None

    @property
    def ui_address(self) -> str:
        return ui_links.ui_hint(self.tracking_uri, self.experiment_id)[0]

    @property
    def ui_command(self) -> str | None:
        return ui_links.ui_hint(self.tracking_uri, self.experiment_id)[1]

    @property
    def parent_address(self) -> str:
        """The sweep's own run in the UI: the report's headline is its description."""
        return ui_links.run_address(self.tracking_uri, self.experiment_id, self.parent_run_id)

    def summary(self) -> str:
        counts = ", ".join(f"{n} {s or UNFINISHED}" for s, n in sorted(self.statuses.items(), key=str))
        lines = [f"sweep {self.name}: {self.status}; {self.num_trials} trials ({counts})"]
        if self.best:
            best = self.best  # a search trial: judged on the selection split (the report's numbers are dev's)
            score = f"selection score {best[BEST_SCORE]:.4f}"
            lines.append(f"best search trial: {best['method']} ({best['trial_id']}) {score}")
        if self.confirmation and self.confirmation["status"] != "skipped":
            c = self.confirmation
            lines.append(f"confirmation: {c['finished']}/{c['wanted']} seed runs of the best configurations finished")
        if self.status == INTERRUPTED:
            lines.append("run the same command again to resume it")
        failed = self.statuses.get(FAILED, 0)
        if failed:
            lines.append(f"{failed} trial(s) failed: their errors are the peftune.error tags of their runs")
        lines.append(f"MLflow parent run id: {self.parent_run_id}")
        lines.append(f"MLflow UI: {self.ui_address}")  # the trials ranked by score, their columns shown
        lines.append(f"MLflow sweep run (the answer in its description): {self.parent_address}")
        if self.ui_command:
            lines.append(f"  start it with: {self.ui_command}")
        lines.append(f"report: {self.report_dir}/")
        lines.append(f"Ray Tune state: {self.experiment_path}")
        return "\n".join(lines)


def init_ray(address: str | None = None) -> None:
    """Connect to a cluster (``address`` or ``RAY_ADDRESS``, as ``ray job submit`` sets) or start Ray locally.

    Either way the trials run this driver's own code and settings (:func:`trial_runtime_env`), not a copy a node
    has installed.
    """
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    runtime_env = trial_runtime_env()
    if address:
        ray.init(address=address, runtime_env=runtime_env)
    else:
        # a Ray of this process only (address="local": never join a cluster started on this
        # machine by someone else), dashboard off: nothing listens beyond the driver's needs
        ray.init(address="local", include_dashboard=False, dashboard_host="127.0.0.1", runtime_env=runtime_env)
    note_sigterm()


# Tune waits this long (seconds) for a reused worker's previous trial thread to end before the next trial may use the
# worker. A trial Tune stops ends at its blocked report and unwinds (its checkpoint directory removed, its memory
# given back: worker.trainable's `finally`); on a loaded machine that took longer than Tune's default wait, and a
# late thread fails the *next* trial ("Could not re-use actor"), which ends the sweep interrupted (docs/benchmarks.md,
# "Small figures behind design choices"). Waiting costs nothing when the thread ends sooner: the join returns then.
THREAD_TIMEOUT_VAR = "TUNE_FUNCTION_THREAD_TIMEOUT_S"
THREAD_TIMEOUT_S = 120


def trial_runtime_env() -> dict[str, Any]:
    """Ray's runtime environment for the trials: the driver's ``peftune`` (and ``analysis``), and Tune's wait for
    a reused worker's previous trial (:data:`THREAD_TIMEOUT_S`).

    ``py_modules``: Ray zips each package directory this process imports from (a few hundred kB; uploaded to
    the cluster once per content hash), unpacks it on each node and puts it first on the workers' path, so a
    node's installed copy, or none, does not matter; the dependencies must be on the node (README). Nothing
    is added when the job's own runtime environment already sets ``py_modules`` (Ray refuses to merge two),
    and no variable the job's ``env_vars`` or this process's environment already sets (theirs stands).
    """
    job = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}").get("runtime_env") or {}
    env: dict[str, Any] = {}
    if THREAD_TIMEOUT_VAR not in (job.get("env_vars") or {}):
        env["env_vars"] = {THREAD_TIMEOUT_VAR: os.environ.get(THREAD_TIMEOUT_VAR) or str(THREAD_TIMEOUT_S)}
    if "py_modules" in job:
        log.info("the job sets py_modules itself: the trials import peftune from there")
        return env
    here = Path(peftune.__file__).resolve().parent  # the package, not this module's folder
    # the analysis package runs on the driver; shipped too, from beside peftune, for whatever a job hands the trials
    # (found without importing it: the library does not import analysis)
    spec = importlib.util.find_spec("analysis")
    found = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    return {**env, "py_modules": [str(here), *(str(p) for p in found[:1])]}


def check_storage(storage: str, shared: bool) -> None:
    """Refuse a local storage path on a multi-node cluster: worker nodes write trial checkpoints there.

    Ray fails every trial placed on another node at its first checkpoint ("A local path on the head
    node is not accessible by worker nodes") while the sweep ends "completed". A URI (s3://, gs://,
    file:// on a shared mount) or ``shared`` (the path is a mount every node has) is accepted.
    """
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    if len(nodes) > 1 and "://" not in storage and not shared:
        raise UserError(
            f"--storage-path {storage}: a local path on a {len(nodes)}-node Ray cluster; worker nodes write "
            f"trial checkpoints there, so use s3://... / gs://..., or a file system every node mounts "
            f"at this path and say so with --shared-storage"
        )


def trial_resources(resources: spaces.Resources) -> dict[str, float]:
    """A GPU fraction per trial where the cluster has GPUs (several PEFT trials share one), CPUs otherwise."""
    if ray.cluster_resources().get("GPU", 0) > 0:
        return {"cpu": resources.cpus_per_trial, "gpu": resources.gpus_per_trial}
    return {"cpu": resources.cpus_per_trial}


def trial_slots(resources: spaces.Resources) -> int:
    """How many trials the cluster holds at once (its CPUs, and GPUs where it has them, per trial's request)."""
    cluster = ray.cluster_resources()
    fits = [int(cluster.get(name.upper(), 0) // need) for name, need in trial_resources(resources).items() if need]
    slots = max(1, min(fits, default=1))
    return min(slots, resources.max_concurrent_trials or slots)


@contextlib.contextmanager
def every_slot_pending(resources: spaces.Resources):
    """Let Tune start a trial for every slot at once (a user's ``TUNE_MAX_PENDING_TRIALS_PG`` wins).

    With a searcher of its own and no ``max_concurrent_trials``, Tune keeps one trial pending: a trial
    shorter than a new worker's start-up (importing torch: seconds) then ends first, the pending trial takes
    its worker, and the other slots stay idle: the search runs one trial at a time (measured on the smoke sweep:
    docs/benchmarks.md, "Small figures behind design choices"). Tune reads this setting only from the environment.
    """
    if PENDING_ENV in os.environ:
        yield
        return
    os.environ[PENDING_ENV] = str(trial_slots(resources) * resources.pack_size)  # a slot holds a pack's members
    try:
        yield
    finally:
        os.environ.pop(PENDING_ENV, None)


def trial_settings(
    definition: SweepDefinition, steps_per_run: int | None = None, data_dir: str | Path | None = None
) -> worker.TrialSettings:
    """What every trial of ``definition`` trains with besides its sample: the budget, the seed, the fixed
    ``train:`` settings, the reports the scheduler's rungs need (``steps_per_run``: see ``search.live_rungs``)
    and, for the record's ``peftune train`` command, the data read (``data_dir``) and the threads."""
    budget = definition.budget
    train = {**definition.train, **search.fidelity_settings(definition, steps_per_run)}
    data = spaces.data_settings(definition, data_dir)
    confirm_data = spaces.confirm_data_settings(definition, data_dir)
    declared = tuple(get_task(name) for name in definition.declarations)  # as read: their labels resolved
    return worker.TrialSettings(definition.name, tuple(definition.tasks), budget.epochs, budget.batch_size,
                                definition.seed, train, data=data, confirm_data=confirm_data,
                                threads=max(1, int(definition.resources.cpus_per_trial)),
                                task_specs=declared)  # fmt: skip


def steps_per_run(definition: SweepDefinition, prepared) -> int:
    """A full trial's optimizer steps on ``prepared``: every task's training rows, once per epoch, in batches."""
    examples = sum(len(task.train) for task in prepared.tasks.values())
    return definition.budget.epochs * math.ceil(examples / definition.budget.batch_size)


def tokens_per_run(definition: SweepDefinition, prepared) -> int:
    """A full trial's training tokens on ``prepared`` (every task's training rows once per epoch, no padding)."""
    return definition.budget.epochs * sum(int(task.train.input_ids.numel()) for task in prepared.tasks.values())


def search_over(definition: SweepDefinition, grid, budgets: search.Allocation) -> bool:
    """Whether the search has run its whole budget (``grid``: Tune's results of the search trials)."""
    if budgets.unit == "trials":
        return len(grid) >= definition.search_trials
    return search.search_finished(budgets, [(result.config.get("method"), result.metrics or {}) for result in grid])


@dataclass(frozen=True)
class SweepHooks:
    """What a measurement of the driver (``peftune.benchmarks.driver``) puts in a real sweep instead of patching this
    module: ``trainable`` runs every trial in place of ``worker.trainable`` (the same arguments: the trial's config,
    ``prepared`` and ``settings``); ``on_trial_logger(logger)`` sees the ``TrialLogger`` the sweep records
    through, once its write buffer is open. The defaults are the sweep's own."""

    trainable: Callable[..., None] = worker.trainable
    on_trial_logger: Callable[[TrialLogger], None] | None = None


def one_driver(run: Callable[..., SweepResult]) -> Callable[..., SweepResult]:
    """``run`` under the sweep's lease (``peftune.sweep.lease``): a second driver of a running sweep is refused at
    once."""

    @functools.wraps(run)
    def holding_the_lease(definition, data_dir, tracking_uri=None, *, storage_path=DEFAULT_STORAGE_PATH, **options):
        storage = stores.storage_uri(storage_path)
        stores.check_storage_uri(storage)  # before the lease: an object-storage lease is a local folder
        with lease.held(storage, definition.name):
            return run(definition, data_dir, tracking_uri, storage_path=storage_path, **options)

    return holding_the_lease


@one_driver
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
    reports_dir: str | Path = record_names.REPORTS_DIR,
    verbose: int = console.TUNE_QUIET,
    optuna_storage: str | None = None,
    tracking_wait_s: float = TRACKING_WAIT_S,
    prepared=None,
    hooks: SweepHooks | None = None,
) -> SweepResult:
    """Run (or resume) ``definition`` as one Ray Tune experiment logged to MLflow.

    One driver per sweep: the sweep's lease (``peftune.sweep.lease``) is held from start to end; while another
    driver holds it, ``lease.LeaseHeld`` (a user error) is raised before anything starts.
    ``resume``: None (default) resumes when Tune has state for this sweep name under
    ``storage_path`` and starts it otherwise; True requires that state; False refuses it.
    ``shared_storage``: ``storage_path`` is a directory every node of the cluster shares (NFS).
    ``callbacks``: extra ``tune.Callback`` objects (this run only). ``on_finished(result)``
    runs when every trial has finished: the hook for the report. ``optuna_storage``: the database
    URL of the per-method Optuna studies (default: ``peftune.sweep.search.default_storage_url``).
    ``tracking_wait_s``: how long the end of the sweep waits for MLflow writes still buffered (a
    tracking-server outage); what is left then stays on disk beside Tune's state and is written by
    the next run of the sweep. ``prepared``: ``spaces.prepare_data(definition, data_dir)``,
    when the caller has read the data already (the command line does, to refuse a bad file before loading Ray).
    ``hooks``: a measurement's stand-ins (:class:`SweepHooks`); None: the sweep's own.
    """
    hooks = hooks or SweepHooks()
    _set_environment()
    tracking_uri = stores.resolve_tracking_uri(tracking_uri)
    storage = stores.storage_uri(storage_path)
    experiment_path = f"{storage.rstrip('/')}/{definition.name}"
    exists = _check_resume(definition, resume, tracking_uri, experiment_path)
    if prepared is None:  # a bad file or a missing model is refused before Ray starts
        prepared = prepare_data(definition, data_dir)
    init_ray(ray_address)
    check_storage(storage, shared_storage)
    record = _open_record(definition, prepared, tracking_uri, experiment_path, exists)
    steps = steps_per_run(definition, prepared)
    budgets = search.allocation(definition, steps, tokens_per_run(definition, prepared))
    settings = trial_settings(definition, steps, data_dir)
    optuna_url = optuna_storage or search.default_storage_url(tracking_uri, storage)
    trial_logger = open_trial_logger(definition, record, settings, prepared, storage, exists)
    if hooks.on_trial_logger is not None:
        hooks.on_trial_logger(trial_logger)
    links = search.RunLinks(optuna_url, trial_logger.known_run_id)  # each Optuna trial gets its MLflow run id
    where = (tracking_uri, experiment_path, reports_dir)
    tune_output_back = console.quiet_tune(verbose)  # this sweep's fits only
    # a sweep saved before the modules moved into folders: Tune's pickled state names them as they were
    old_names_back = old_names(legacy.MOVED_MODULES) if exists else lambda: None
    try:
        init_ray(ray_address)
        runnable = _runnable(definition, prepared, settings, trainable=hooks.trainable)
        del prepared  # the object store holds it now
        tuner = _tuner(definition, runnable, storage, exists, optuna_url, RecordedResults(record),
                       budgets, verbose)  # fmt: skip
        progress = console.Progress("search", _search_trials(definition, budgets), definition.budget.epochs)
        state = [GoodState(experiment_path), CheckpointPruner(SCORE)]  # Tune's saved state and the checkpoints
        with (
            installed([trial_logger, links, progress, *state, *callbacks]),
            every_slot_pending(definition.resources),
            ctrl_c_through_tune() as ctrl_c,
        ):
            grid = tuner.fit()
        if not trial_logger.flush(tracking_wait_s):
            return _unrecorded(definition, record, *where, trial_logger, len(grid))
        runs = trial_logger.runs()  # the record as the driver holds it: every write reached it (flushed)
        searched = confirm.search_run_ids(runs, record.version)
        trials = [t for t in writer.trial_records(runs, record.version) if t.run_id in searched]
        # a Ctrl-C Tune took stops the sweep, even with every trial done
        complete = not ctrl_c.pressed and search_over(definition, grid, budgets)
        complete = complete and len([t for t in trials if t.status]) >= len(grid)
        confirmation = None
        if complete and definition.confirm.contenders and definition.confirm.seeds:
            # each budget's contenders tuned under it: the methods' tuned settings at smaller budgets' sizes
            complete = not carry.run_carried(definition, runnable, trial_logger, storage, callbacks, verbose)
            if not trial_logger.flush(tracking_wait_s):
                return _unrecorded(definition, record, *where, trial_logger, len(grid))
        packing.stop_hubs()  # the search's packs are over (the confirmation never packs)
        if complete:  # the search is over: confirm each budget's contenders with seeds, at the full budget
            confirming = _confirm_runnable(definition, data_dir, settings, runnable, hooks.trainable)
            with every_slot_pending(definition.resources):
                confirmation = confirm.run_confirmation(
                    definition, record, confirming, trial_logger=trial_logger, storage=storage, callbacks=callbacks,
                    verbose=verbose, flush_s=tracking_wait_s,
                )  # fmt: skip
            if not trial_logger.flush(tracking_wait_s):
                return _unrecorded(definition, record, *where, trial_logger, len(grid))
            complete = confirmation.status != INTERRUPTED
        status = sweep_status(trials) if complete else INTERRUPTED
        logged = _close(definition, record, trial_logger, grid, status, complete)
    except BaseException as error:
        _close_after(error, definition, record, trial_logger, tracking_wait_s)
        full = disk_full(error)
        if full is not None and full.path is None:  # it names no file: a write after the first refused one (Tune's
            # own, stopping), or a database's refusal. The first refused write the driver saw names its file
            full = trial_logger.space_refused() or disk_full(error, path=_databases(tracking_uri, optuna_url))
        if full is not None and full is not error:
            raise full from error  # one line for the command line, naming the path: interrupted, exit 3
        raise
    finally:
        packing.stop_hubs()  # on every way out, the early returns of an unrecorded sweep included
        tune_output_back()
        old_names_back()
    confirmed = dataclasses.asdict(confirmation) if confirmation else None
    result = _result(definition, record, where, status, trials, checkpoints_logged=logged, confirmation=confirmed)
    if complete and on_finished is not None:
        on_finished(result)  # the report goes here
    return result


def open_trial_logger(definition, record, settings, prepared, storage: str, exists: bool) -> TrialLogger:
    """The callback that records every trial, with the writes an earlier run of the sweep left pending."""
    pending = tracking_buffer.pending_path(storage, definition.name)
    if not exists:
        tracking_buffer.set_aside_stale(pending)
    task_metrics = _task_metric_names(definition.tasks)
    logged_metrics = [*task_metrics, *record_names.split_metric_names(task_metrics)]
    trial_logger = TrialLogger(record, settings, logged_metrics, pending, split_examples(prepared))
    trial_logger.open_buffer()  # first the writes an earlier run left pending: a resume reads the record
    return trial_logger


def _confirm_runnable(definition: SweepDefinition, data_dir, settings: worker.TrialSettings, search_runnable,
                      trainable: Callable[..., None] = worker.trainable):  # fmt: skip
    """The confirmation's trainable: the search's, on ``confirm.train_examples`` train rows per task (the budget a
    user trains at; the same selection, decision and dev rows), read here once and never packed. Its trials'
    settings read that data (``TrialSettings.confirm_data``), and so does their record."""
    data = settings.confirm_data
    if data is None or data == settings.data or (data_dir is None and not definition.declarations):
        return search_runnable  # the same rows, or data handed in prepared (no directory to read the rows from)
    prepared = train.prepare(data, definition.tasks)
    rows = ", ".join(f"{task} {len(split.train)}" for task, split in prepared.tasks.items())
    log.info("confirmation: every run trains on %s train rows, %d epoch(s)", rows, definition.budget.epochs)
    return _runnable(definition, prepared, settings, packs=False, trainable=trainable)


def _runnable(definition: SweepDefinition, prepared, settings: worker.TrialSettings, packs: bool = True,
              trainable: Callable[..., None] = worker.trainable):  # fmt: skip
    """Tune's trainable: the data put once in the object store (each worker fetches it once, not per trial), and
    with ``resources.pack_size`` > 1 the hub where search trials of packable methods form packs."""
    shared = SharedData(ray.put(prepared))
    resources = definition.resources
    if packs and resources.pack_size > 1:
        hub = packing.start_hub(shared, settings.threads or 1, resources.pack_size, resources.pack_wait_s,
                                resources.cpus_per_trial)  # fmt: skip
        settings = dataclasses.replace(settings, packing=hub)
    trainable = tune.with_parameters(trainable, prepared=shared, settings=settings)
    per_trial = packing.TrialResources(**trial_resources(resources), packing=settings.packing)
    return tune.with_resources(trainable, per_trial)


def _set_environment() -> None:
    # a sweep begun with num_to_keep=1 (before peftune.sweep.resume.CheckpointPruner) makes Tune snapshot its state at
    # each checkpoint when it resumes: a cost at thousands of trials, not something to warn about each time
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    # MLflow's own retries (7, with backoff: minutes) would hold every write of a tracking outage; the write
    # buffer (peftune.record.tracking_buffer) retries instead, so a write fails fast into it. A user's setting wins.
    for key, value in MLFLOW_FAIL_FAST.items():
        os.environ.setdefault(key, value)
    console.quiet_libraries()


def _check_resume(definition: SweepDefinition, resume: bool | None, tracking_uri: str, experiment_path: str) -> bool:
    """Whether Tune has state for this sweep (a resume), checked against ``resume`` and the MLflow record."""
    # a state file a full disk cut off: its previous complete copy comes back
    aside = repair_state(Path(experiment_path)) if "://" not in experiment_path else []
    exists = tune.Tuner.can_restore(experiment_path)
    if aside and not exists:  # cut at Tune's first save, before a complete copy of it could be kept
        raise UserError(
            f"sweep {definition.name!r}: Ray Tune's state at {experiment_path} was cut off (a full disk?) before "
            "a complete copy of it was kept (the cut files are kept as *.set-aside), so its trials cannot be "
            "resumed; free space and run it under another name (--name) to start again"
        )
    if resume is True and not exists:
        raise UserError(f"nothing to resume: no Ray Tune state for sweep {definition.name!r} at {experiment_path}")
    if resume is False and exists:
        raise UserError(
            f"sweep {definition.name!r} already has Ray Tune state at {experiment_path}: resume it "
            f"(run it again without --fresh) or pick another name"
        )
    with reader.store_errors(tracking_uri):
        if exists and not reader.has_parent_run(tracking_uri, definition.name):
            raise UserError(writer.missing_record_error(definition.name, tracking_uri, experiment_path))
    return exists


def _open_record(definition: SweepDefinition, prepared, tracking_uri: str, experiment_path: str, exists: bool):
    """The sweep's parent run (opened or found again), with its data, skipped rows and split sizes."""
    skipped = skipped_rows(prepared)
    if skipped:
        log.warning(
            "skipped %d invalid data row(s) (invalid_rows: skip); each is listed in the sweep's parent run "
            "(skipped_rows.json)",
            len(skipped),
        )
    with reader.store_errors(tracking_uri):
        record = writer.open_sweep(
            tracking_uri,
            definition,
            data_hashes=prepared.file_hashes,
            ray_experiment_path=experiment_path,
            expect_existing=exists,
            skipped_rows=skipped,
            datasets=writer.data_inputs(prepared),
            tasks=writer.task_record(prepared),
        )
    writer.log_dev_sizes(record, prepared, definition.seed)  # split sizes and the selection seed
    line = confirm.reachable_margin_line(definition, prepared)
    if line:
        log.info("%s", line)
    return record


def _search_trials(definition: SweepDefinition, budgets) -> int:
    """The search's trials as Tune counts them (per method: the allocation's bound; else the budget's)."""
    return budgets.trials_bound() if search.per_method(definition) else definition.search_trials


def _tuner(definition, runnable, storage: str, exists: bool, optuna_url: str, history, budgets, verbose):
    """A new Tuner for the search, or the saved one restored (its searcher, scheduler and callbacks with it)."""
    experiment_path = f"{storage.rstrip('/')}/{definition.name}"
    if exists:
        log.info("resuming sweep %s from %s", definition.name, experiment_path)
        # Tune brings back the pickled searcher (and restores its saved state), the scheduler (which
        # refills its rungs from the record) and a RunCallbacks (which forwards to this run's callbacks)
        return tune.Tuner.restore(experiment_path, trainable=runnable, resume_unfinished=True, resume_errored=True)
    return tune.Tuner(
        runnable,
        tune_config=tune.TuneConfig(
            # metric and mode are set on the searcher and the scheduler themselves (not here)
            search_alg=search.make_searcher(definition, optuna_url, budgets),
            scheduler=search.make_scheduler(definition, history, budgets.steps_per_run),
            num_samples=_search_trials(definition, budgets),
            max_concurrent_trials=definition.resources.max_concurrent_trials,
            reuse_actors=True,  # one worker process runs trial after trial: torch is imported once
            trial_name_creator=record_names.trial_name,
            trial_dirname_creator=record_names.trial_name,
        ),
        run_config=tune.RunConfig(
            name=definition.name,
            storage_path=storage,
            callbacks=[RunCallbacks()],
            failure_config=tune.FailureConfig(max_failures=definition.max_failures),
            # no num_to_keep: Tune would snapshot the whole experiment after every checkpoint;
            # peftune.sweep.resume.CheckpointPruner deletes the superseded ones instead
            checkpoint_config=tune.CheckpointConfig(checkpoint_score_attribute=SCORE, checkpoint_score_order="max"),
            verbose=verbose,
        ),
    )


def _close(definition: SweepDefinition, record, trial_logger, grid, status: str, complete: bool) -> list:
    """Close the sweep's record with ``status``; a complete sweep first logs its budgets and best checkpoints."""
    logged = []
    runs = trial_logger.runs()
    if complete:
        writer.log_method_budgets(record, runs)
        checkpoints = _best_checkpoints(grid)
        logged = writer.log_best_checkpoints(record, runs, checkpoints, definition.checkpoints_per_method)
    writer.close_sweep(record, status, runs)
    return logged


def _close_after(error: BaseException, definition, record, trial_logger, wait_s: float) -> None:
    """The records closed all the same after ``error`` (a second Ctrl-C, which Tune does not handle, included)."""
    # a write refused for space stops the sweep as a Ctrl-C does: nothing about the trials failed, and the same
    # command resumes it once space is freed
    interrupted = stopped(error) or no_space(error) is not None
    with _interrupts_ignored():
        trial_logger.close_open_runs()
        if trial_logger.flush(wait_s):
            _close_sweep_if_room(definition, record, INTERRUPTED if interrupted else FAILED)
        else:
            full = trial_logger.buffer is not None and trial_logger.buffer.store_full
            log.error(
                "MLflow %s: the record of sweep %s stays open; its writes wait in %s for the next run",
                "has no space left" if full else "unreachable", definition.name, trial_logger.pending_path,
            )  # fmt: skip


def _databases(tracking_uri: str, optuna_url: str) -> str | None:
    """The SQLite files a sweep writes (the MLflow store, the Optuna studies): a database refusing a write for
    space names no file, so a disk-full message names these."""
    paths = (stores.sqlite_path(tracking_uri), stores.sqlite_path(optuna_url))
    files = [str(path) for path in paths if path is not None]
    return " or ".join(files) or None


def _close_sweep_if_room(definition, record, status: str) -> None:
    """Close the parent run with ``status``; a store with no space left keeps it open (said, not raised: the error
    that stopped the sweep is the one to show), and the next run of the sweep closes it."""
    try:
        writer.close_sweep(record, status)
    except Exception as error:
        if no_space(error) is None:
            raise
        log.error("the tracking store has no space left: the record of sweep %s stays open (%s)", definition.name,
                  one_line(error, 200))  # fmt: skip


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
def _interrupts_ignored():
    """Ctrl-C and SIGTERM are ignored while the records are closed: the driver is stopping already, and one
    more (``ray job stop`` sent twice) would cut the closing short (only the main thread may set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {number: signal.signal(number, signal.SIG_IGN) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def split_examples(prepared) -> dict[str, dict[str, tuple[list[int], list[float]]]]:
    """Per split whose predictions are kept (decision, dev), per task: the example ids (file lines) and labels,
    in the order of a trial's predictions."""
    out: dict[str, dict] = {}
    for task, data in prepared.tasks.items():
        for split in (record_names.DECISION, record_names.DEV):
            rows = getattr(data, split)
            if rows is not None:
                out.setdefault(split, {})[task] = (rows.lines.tolist(), rows.labels.tolist())
    return out


def _task_metric_names(tasks: Sequence[str]) -> list[str]:
    return [get_task(t).metric_name for t in tasks]


def _best_checkpoints(grid) -> dict[str, tuple[float, Any]]:
    """Ray trial id -> (best score, the checkpoint of that epoch) for every trial that kept one."""
    out = {}
    for result in grid:
        best = [
            (metrics.get(SCORE), checkpoint)
            for checkpoint, metrics in (result.best_checkpoints or [])
            if metrics.get(SCORE) is not None and checkpoint_exists(checkpoint)  # Tune lists the pruned ones too
        ]
        if best and result.metrics:
            out[result.metrics["trial_id"]] = max(best, key=lambda pair: pair[0])
    return out
