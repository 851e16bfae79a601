"""What runs inside a Ray worker: one Tune trial of a sweep, from its sampled config to its reports.

``trainable`` is the function Tune runs: it turns the trial's config (the searcher's sample, or a
confirmation's fixed configuration and seed) into a ``TrainConfig`` through :class:`TrialSettings`,
trains it with ``peftune.core.train.run_trial`` and reports every epoch with a checkpoint. The sweep's data
reaches it through Ray's object store (``peftune.sweep.shared_data``), fetched once per worker process, and a
worker gives back what a finished trial freed before the next one.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch
from ray import tune

from peftune.base import record_names
from peftune.core.train import TrainConfig, TrainingDiverged, run_trial, select_device
from peftune.core.trial_spec import DataSettings, TrialSpec
from peftune.inputs.tasks import TaskSpec, declare
from peftune.sweep import console
from peftune.sweep.packing import PackSettings, packed_trial
from peftune.sweep.shared_data import release_freed_memory, worker_prepared

log = logging.getLogger("peftune.sweep.worker")


@dataclass(frozen=True)
class TrialSettings:
    """The fixed part of every trial's TrainConfig; the sampled part comes from Optuna."""

    sweep: str
    tasks: tuple[str, ...]
    epochs: int
    batch_size: int
    seed: int
    train: dict[str, Any] = field(default_factory=dict)
    phase: str = record_names.SEARCH  # a confirmation run also evaluates dev and keeps its predictions
    data: DataSettings | None = None  # what the sweep's data was read with (None: unknown to these settings)
    # what a confirmation run's data is read with (``confirm.train_examples`` train rows); None: ``data``
    confirm_data: DataSettings | None = None
    threads: int | None = None  # torch's threads in a trial: its CPUs (a trial re-runs exactly on as many)
    # a report run (``record_names.REPORT_REASON``): dev only, no decision split, no predictions
    reporting: bool = False
    # how search trials of packable methods pack (peftune.sweep.packing); None: never
    packing: PackSettings | None = None
    # the tasks read from a user's task files (labels resolved): a worker process knows only the shipped ones
    task_specs: tuple[TaskSpec, ...] = ()

    def for_trial(self, config: dict) -> TrialSettings:
        """These settings with the trial's own seed and phase where its config carries them (a confirmation)."""
        marks = config.get("peftune") or {}
        seed = int(marks["seed"]) if marks.get("seed") is not None else self.seed
        reporting = bool(marks.get("report"))
        phase = marks.get("phase") or self.phase
        data = self.confirm_data if phase == record_names.CONFIRM and self.confirm_data is not None else self.data
        return dataclasses.replace(self, seed=seed, phase=phase, reporting=reporting, data=data)

    @staticmethod
    def split(config: dict) -> tuple[str, dict[str, Any]]:
        """A trial's config (as Ray gives it) -> (method, {lr, dropout, weight_decay, <options>})."""
        return config["method"], dict(config.get(config["method"]) or {})

    def train_config(self, method: str, sampled: dict[str, Any]) -> TrainConfig:
        for spec in self.task_specs:
            declare(spec)
        options = dict(sampled)
        common = {key: options.pop(key) for key in record_names.HYPERPARAMETERS}
        return TrainConfig(
            method=method,
            method_options=options,
            tasks=list(self.tasks),
            epochs=self.epochs,
            batch_size=self.batch_size,
            seed=self.seed,
            **common,
            **{**self.train, **self.evaluation()},  # the phase's evaluation overrides the sweep's rungs
        )

    def evaluation(self) -> dict[str, Any]:
        """What a trial evaluates: a search trial the selection split only (it selects, also at the rungs); a
        confirmation run the decision split (what the confirmation decides on) and dev (the reported numbers),
        keeping both splits' predictions, after selection when there is an
        epoch to choose. No scheduler stops a confirmation run, so it evaluates at no rung, and with one epoch
        a selection pass would choose nothing: each would cost an evaluation for nothing."""
        if self.phase == record_names.CONFIRM:
            decision = self.data is not None and self.data.decision_examples > 0
            decided = [record_names.DECISION] if decision and not self.reporting else []
            # the first split is the one the run is judged on: selection picks the epoch; with one epoch there is
            # nothing to pick, and dev's numbers keep their plain names
            splits = (
                [record_names.SELECTION, *decided, record_names.DEV]
                if self.epochs > 1
                else [record_names.DEV, *decided]
            )
            kept = (*decided, record_names.DEV) if not self.reporting else ()  # a report run decides nothing
            return {"eval_splits": splits, "predictions_of": kept, "report_fractions": []}
        return {"eval_splits": [record_names.SELECTION]}

    def trial_spec(self, method: str, sampled: dict[str, Any]) -> TrialSpec:
        """The trial's whole specification: its record keeps it, as params (``TrialSpec.params``), as a file
        (``trial_spec.ARTIFACT``) and as the ``peftune train`` command line (these two where the data directory is
        known). Without the sweep's data settings, the defaults' (no data directory)."""
        return TrialSpec(self.train_config(method, sampled), self.data or DataSettings(None), self.threads)


def trainable(config: dict, prepared, settings: TrialSettings) -> None:
    """One Tune trial: train the sampled configuration, report + checkpoint after every epoch.

    ``prepared``: the sweep's ``PreparedData``, or a ``shared_data.SharedData`` reference to it.
    """
    console.quiet_trial_logs()
    settings = settings.for_trial(config)
    granted = granted_resources()
    torch.set_num_threads(settings.threads or max(1, int(granted["granted_cpu"])))
    method, sampled = settings.split(config)
    train_config = settings.train_config(method, sampled)
    check_granted_gpu(granted, train_config.device)

    def report(metrics: dict, save: Callable[[Path], None] | None) -> None:
        metrics = {**metrics, **granted}
        if save is None:  # a data-fidelity rung within an epoch: a result for the scheduler, no checkpoint
            tune.report(metrics)
            return
        with tempfile.TemporaryDirectory(prefix="peftune-ckpt-") as directory:
            save(Path(directory))
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(directory))

    try:
        checkpoint = tune.get_checkpoint()
        packing = settings.packing
        if checkpoint is None and packing is not None and packing.packs(config):
            packed_trial(train_config, packing, report)  # a pack's runner trains it (a resumed trial: alone)
            return
        prepared = worker_prepared(prepared)
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


def granted_resources() -> dict[str, float]:
    """The CPUs and GPU fraction Ray granted this trial (what the sweep's ``resources`` asked for, if it fit)."""
    assigned = ray.get_runtime_context().get_assigned_resources()
    return {"granted_cpu": float(assigned.get("CPU", 1)), "granted_gpu": float(assigned.get("GPU", 0))}


def check_granted_gpu(granted: dict[str, float], device: str) -> None:
    """A trial Ray gave a GPU on a node without CUDA (a GPU declared with ``ray start --num-gpus``, a driver
    missing): with ``device: auto`` it trains on the CPU and says so in one line; a ``cuda`` device refuses."""
    if not granted["granted_gpu"] or torch.cuda.is_available():
        return
    line = (f"Ray granted this trial {granted['granted_gpu']:g} GPU (ids {ray.get_gpu_ids()}) but CUDA is not "
            f"available on node {ray.util.get_node_ip_address()}")  # fmt: skip
    if device == "auto":
        log.warning("%s: it trains on the CPU", line)
        return
    select_device(device)  # "cuda": the one-line UserError naming the device


def diverged_result(reason: str) -> dict[str, Any]:
    """The final result of a diverged trial: NaN for the searcher's metrics (Tune requires them), and the reason."""
    return {
        record_names.SCORE: math.nan,
        record_names.TRAINABLE_PER_TASK: math.nan,
        record_names.DIVERGED: True,
        "divergence": reason,
    }
