"""Write a sweep's MLflow record by hand, exactly as ``peftune.record.writer`` writes it (the analysis' contract).

Used by the report and evaluate tests: a real MLflow store (SQLite in tmp_path), no mocks, and no
Ray run needed to get a parent run with completed, early-stopped and failed child runs.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from peftune.base.record_names import COUNT_METRICS as COUNT_KEYS


@dataclass
class TrialSpec:
    """One trial as the sweep would have run it."""

    trial_id: str
    method: str
    options: dict  # the method config's fields except dropout, e.g. {"rank": 8, "alpha": 16.0, "targets": [...]}
    epochs: list[dict]  # per epoch: task metrics (sst_accuracy, ...) and optionally train_loss
    counts: dict  # trainable_params_per_task, backbone_params, ...
    status: str | None = "completed"  # completed | early_stopped | failed | None (running / interrupted)
    lr: float = 1e-3
    dropout: float = 0.1
    weight_decay: float = 0.01
    seed: int = 0
    error: str | None = None
    checkpoint_dir: Path | None = None  # a peftune checkpoint directory to log under checkpoint/
    mlflow_status: str | None = None  # override the MLflow run status (e.g. "KILLED")
    extra_params: dict = field(default_factory=dict)
    # a confirmation run's dev predictions: task -> (example ids, predictions, labels), logged as the writer does
    predictions: dict | None = None

    def config_key(self) -> str:
        """The key the searcher tags a trial with: its method and sampled hyperparameters (not the seed)."""
        from peftune.base.record_names import config_key

        sampled = {"lr": self.lr, "dropout": self.dropout, "weight_decay": self.weight_decay, **self.options}
        return config_key(self.method, sampled)


def _value(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def record_sweep(
    tracking_uri: str,
    name: str,
    tasks: list[str],
    trials: list[TrialSpec],
    *,
    artifact_dir: Path,
    model: str = "all-minilm-l6-v2",
    budget: dict | None = None,
    data_hashes: dict | None = None,
    train_settings: dict | None = None,
    planned_epochs: int = 2,
    batch_size: int = 16,
    seed: int = 0,
    definition: dict | None = None,
) -> tuple[str, str, dict[str, str]]:
    """Create the experiment, its parent run and one child run per trial; returns (experiment id, parent id, runs)."""
    import mlflow
    import yaml
    from mlflow.entities import Metric, Param

    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    experiment_id = client.create_experiment(name, artifact_location=artifact_dir.as_uri())
    parent = client.create_run(
        experiment_id,
        run_name=name,
        tags={
            "peftune.role": "sweep",
            "peftune.sweep": name,
            "peftune.backbone": model,
            "peftune.code_version": "test",
            "peftune.status": "running",
        },
    )
    parent_id = parent.info.run_id
    budget = {
        "budget": "test",
        "epochs": planned_epochs,
        "batch_size": batch_size,
        "max_length": 32,
        "max_train_examples": None,
        "max_dev_examples": None,
        **(budget or {}),
    }
    params = {
        "tasks": tasks,
        "methods": sorted({t.method for t in trials}),
        "num_samples": len(trials),
        "scheduler": "asha",
        "objective": "single",
        "sampler": "tpe",
        "seed": seed,
        "model": model,
        **budget,
    }
    client.log_batch(parent_id, params=[Param(k, _value(v)) for k, v in params.items()])
    definition = {"name": name, "tasks": tasks, "model": model, "seed": seed, "train": train_settings or {},
                  **(definition or {})}  # fmt: skip
    client.log_text(parent_id, yaml.safe_dump(definition), "sweep.yaml")
    client.log_dict(parent_id, data_hashes or {}, "data_hashes.json")

    runs = {}
    first_epoch = next((trial.epochs[0] for trial in trials if trial.epochs), {})
    metric_names = [key for key in first_epoch if key != "train_loss"]
    for trial in trials:
        run = client.create_run(
            experiment_id,
            run_name=f"{trial.method}-{trial.trial_id}",
            tags={
                "mlflow.parentRunId": parent_id,
                "peftune.role": "trial",
                "peftune.sweep": name,
                "peftune.trial_id": trial.trial_id,
                "peftune.method": trial.method,
                "peftune.config_key": trial.config_key(),
            },
        )
        run_id = run.info.run_id
        runs[trial.trial_id] = run_id
        trial_params = {
            "method": trial.method,
            "lr": trial.lr,
            "dropout": trial.dropout,
            "weight_decay": trial.weight_decay,
            "epochs": planned_epochs,
            "batch_size": batch_size,
            "tasks": tasks,
            "seed": trial.seed,
            "warmup_ratio": 0.1,
            "sampling": "proportional",
            **{f"method.{k}": v for k, v in trial.options.items()},
            **trial.extra_params,
        }
        client.log_batch(run_id, params=[Param(k, _value(v)) for k, v in trial_params.items()])
        now = int(time.time() * 1000)
        elapsed = 0.0
        for epoch, values in enumerate(trial.epochs, start=1):
            task_values = {k: v for k, v in values.items() if k != "train_loss"}
            score = sum(task_values.values()) / len(task_values)
            elapsed += 1.5
            metrics = [Metric(k, float(v), now, epoch) for k, v in task_values.items()]
            metrics += [
                Metric("score", score, now, epoch),
                Metric("train_loss", float(values.get("train_loss", 1.0)), now, epoch),
                Metric("epoch_time_s", 1.5, now, epoch),
                Metric("tokens_per_s", 1000.0, now, epoch),
                Metric("train_time_s", elapsed, now, epoch),
            ]
            if epoch == 1:
                metrics += [Metric(k, float(trial.counts[k]), now, 0) for k in COUNT_KEYS if k in trial.counts]
            client.log_batch(run_id, metrics=metrics)
        if trial.status is not None and trial.epochs:
            scores = [sum(v for k, v in e.items() if k != "train_loss") / len(metric_names) for e in trial.epochs]
            best = max(range(len(scores)), key=lambda i: scores[i])  # the earliest on a tie
            best_metrics = [Metric("best_score", scores[best], now, 0), Metric("best_epoch", best + 1, now, 0)]
            best_metrics += [Metric(f"best_{k}", float(trial.epochs[best][k]), now, 0) for k in metric_names]
            client.log_batch(run_id, metrics=best_metrics)
        if trial.predictions is not None:
            log_predictions(client, run_id, trial.predictions, trial.seed, artifact_dir)
        if trial.checkpoint_dir is not None:
            for file in ("trainable.safetensors", "peftune.json"):
                client.log_artifact(run_id, str(Path(trial.checkpoint_dir) / file), "checkpoint")
            client.set_tag(run_id, "peftune.checkpoint", "checkpoint/")
        if trial.status is not None:
            client.set_tag(run_id, "peftune.status", trial.status)
            if trial.error:
                client.set_tag(run_id, "peftune.error", trial.error)
            client.set_terminated(run_id, status="FAILED" if trial.status == "failed" else "FINISHED")
        elif trial.mlflow_status:
            client.set_terminated(run_id, status=trial.mlflow_status)
    client.set_tag(parent_id, "peftune.status", "completed")
    client.set_terminated(parent_id, status="FINISHED")
    return experiment_id, parent_id, runs


def log_predictions(client, run_id: str, predictions: dict, seed: int, scratch: Path) -> None:
    """The ``predictions/decision.csv.gz`` and ``predictions/dev.csv.gz`` artifacts (the same synthetic
    predictions on both), in the writer's format (``peftune.base.record_names.predictions_csv``)."""
    import gzip

    from peftune.base.record_names import DECISION, DEV, predictions_artifact, predictions_csv

    values = {task: list(p) for task, (_, p, _) in predictions.items()}
    examples = {task: (list(ids), list(labels)) for task, (ids, _, labels) in predictions.items()}
    for split in (DECISION, DEV):
        directory, name = predictions_artifact(split).rsplit("/", 1)
        local = Path(scratch) / f"upload-{run_id}-{split}" / name
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(gzip.compress(predictions_csv(values, examples, seed).encode()))
        client.log_artifact(run_id, str(local), directory)


def counts(trainable: int, stored: int | None = None, backbone: int = 1_000_000) -> dict:
    """Parameter counts as the writer logs them, for a backbone of ``backbone`` parameters."""
    stored = trainable if stored is None else stored
    return {
        "backbone_params": backbone,
        "trainable_params_per_task": trainable,
        "trainable_params_per_task_pct": 100.0 * trainable / backbone,
        "stored_params": stored,
        "stored_params_pct": 100.0 * stored / backbone,
        "checkpoint_params": trainable,
        "head_params": 100,
    }


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())
