"""Final evaluation: the frontier configurations, re-trained with several seeds, scored on a held-out test split.

``peftune evaluate --sweep NAME --data-dir DIR --test-dir DIR --seeds 3`` calls :func:`evaluate_sweep`. The data
roles are the sweep's: the same train rows (its selection and decision splits held out as it did), the epoch kept
by the selection score, dev reported; the test split is read here and nowhere else, once, after every selection is
made. The configurations are the frontier of the seed means when the sweep confirmed (each re-trained with the
seeds its confirmation used), else of the completed trials. The data must hash to the sweep's record, and the test
files must differ from every file the sweep read. Output: ``<report dir>/evaluation/`` (also logged to the parent
run). Seeds, data and outputs in detail: docs/report.md, "The final evaluation".
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

from analysis import confirmed, pareto, plots
from analysis.publish import ARTIFACT_PATH
from analysis.render import to_markdown
from analysis.runs import SweepRuns, read_sweep_record
from peftune.base.errors import UserError
from peftune.base.record_names import (
    COMPLETED,
    DEV,
    EARLY_STOPPED,
    REPORTS_DIR,
    SCORE,
    SELECTION,
    metric_task,
)
from peftune.core import trial_spec
from peftune.core.checkpoint import CheckpointError, load_checkpoint, load_trainable
from peftune.core.train import TrainConfig, evaluate, prepare, run_trial, select_device
from peftune.core.trial_spec import TrialSpec
from peftune.inputs.backbone import load_tokenizer, resolve_model_dir
from peftune.inputs.data import (
    DEFAULT_MAX_LENGTH,
    DataError,
    DataSettings,
    TaskData,
    encode_split,
    read_task_file,
    task_path,
)
from peftune.inputs.tasks import get_task, overall_score
from peftune.record import legacy, reader, writer
from peftune.record.epoch_kept import improves

log = logging.getLogger("analysis.evaluate")

# the summary's rows per configuration, in order (not peftune.inputs.data.SPLITS): the trial's figure on the split it
# selected on, re-trained dev, test
SUMMARY_SPLITS = ("selection (sweep)", "dev", "test")


@dataclass
class Evaluation:
    sweep: SweepRuns
    configurations: pd.DataFrame  # the frontier trials evaluated (rows of sweep.trials)
    runs: pd.DataFrame  # one row per (configuration, seed, split)
    summary: pd.DataFrame  # mean and std per (configuration, split)
    directory: Path
    files: list[Path]


# ----------------------------------------------------------------------------- configurations


def select_configurations(sweep: SweepRuns, top: int | None = None) -> pd.DataFrame:
    """The dev frontier (sorted by cost); ``top``: its ``top`` best-scoring members.

    With confirmation runs in the record, the frontier of the seed means (:mod:`analysis.confirmed`), each
    configuration represented by its search trial; else the frontier of the completed search trials.
    """
    front = _confirmed_frontier(sweep)
    if front is None:
        front = pareto.frontier(sweep.trials, SCORE)
    if front.empty:
        raise UserError(
            f"sweep {sweep.name!r} has no completed trial with a dev score and parameter counts "
            f"({sweep.status_summary()}): nothing to evaluate"
        )
    if top is not None:
        if top < 1:
            raise UserError(f"--top must be >= 1, got {top}")
        by = "seed_mean" if "seed_mean" in front else SCORE  # confirmed: the best seed means
        front = front.sort_values(by, ascending=False, kind="stable").head(top)
        front = front.sort_values([pareto.COST, SCORE], ascending=[True, False], kind="stable")
    return front


def answer_configurations(sweep: SweepRuns) -> pd.DataFrame:
    """Each budget's pick, its best and the best of the others (the rival the pick was compared with), by the
    decision procedure replayed on the record; each represented by its search trial, with the budgets it stands
    for in ``answer_role``. Where the pick is the best, the rival is what tells whether the answer transfers."""
    from analysis import report

    configs = confirmed.configurations(sweep)
    if not len(configs) or configs["source"].iloc[0] != "confirmed":
        raise UserError(f"sweep {sweep.name!r} has no confirmation runs: --answer needs its answer per budget")
    outcome = report.decide(sweep, configs).outcome
    roles: dict[str, list[str]] = {}
    for a in outcome.answers if outcome is not None else ():
        for role, key in (("pick", a.pick), ("best", a.best), ("rival", rival(a))):
            if key is not None:
                roles.setdefault(key, []).append(f"{role} <= {a.budget:g}%")
    if not roles:
        raise UserError(f"sweep {sweep.name!r}: no budget has a pick to evaluate")
    search = pareto.eligible(sweep.trials, (COMPLETED, EARLY_STOPPED))
    search = search[search["config_key"].isin(roles)].sort_values(SCORE, ascending=False, kind="stable")
    chosen = search.drop_duplicates("config_key")
    chosen = chosen.assign(answer_role=chosen["config_key"].map(lambda k: ", ".join(dict.fromkeys(roles[k]))))
    return chosen.sort_values([pareto.COST, SCORE], ascending=[True, False], kind="stable")


def rival(answer) -> str | None:
    """The best of the others under the budget on the decision split: the configuration, other than the pick,
    whose estimate lies highest against it (from the pairs of the budget's family); None without one."""
    gaps = {}  # other config -> its estimate minus the pick's
    for row in answer.pairs:
        if answer.pick in (row["a"], row["b"]):
            other = row["b"] if row["a"] == answer.pick else row["a"]
            gaps[other] = row["diff_mean"] if row["a"] == other else -row["diff_mean"]
    return max(gaps, key=gaps.__getitem__) if gaps else None


def _confirmed_frontier(sweep: SweepRuns) -> pd.DataFrame | None:
    """The search trials of the configurations on the frontier of the seed means; None without confirmation runs."""
    configs = confirmed.configurations(sweep)
    if not len(configs) or configs["source"].iloc[0] != "confirmed":
        return None
    means = confirmed.seed_mean_frontier(configs).set_index("config_key")["score_mean"]
    search = pareto.eligible(sweep.trials, (COMPLETED, EARLY_STOPPED))
    search = search[search["config_key"].isin(means.index)].sort_values(SCORE, ascending=False, kind="stable")
    front = search.drop_duplicates("config_key").assign(seed_mean=lambda t: t["config_key"].map(means))
    return front.sort_values([pareto.COST, SCORE], ascending=[True, False], kind="stable")


def evaluation_seeds(sweep: SweepRuns, trial: pd.Series, seeds: int) -> list[int]:
    """The seeds to re-train ``trial`` with: those its confirmation used (the first ``seeds``), so that dev and test
    are means over the same runs the report's seed means are; without confirmation runs, the trial's seed + 0, 1, ..."""
    runs = sweep.confirmations if sweep.confirmations is not None else pd.DataFrame()
    if len(runs):
        mine = runs[(runs["config_key"] == trial["config_key"]) & (runs["status"] == COMPLETED)]
        confirmed_seeds = sorted(int(s) for s in mine["seed"].dropna())
        if confirmed_seeds:
            return confirmed_seeds[:seeds]
    base_seed = int(trial["seed"]) if pd.notna(trial["seed"]) else 0
    return [base_seed + i for i in range(seeds)]


def rerun_splits(epochs: int, selecting: bool) -> list[str]:
    """As the sweep's confirmation: selection keeps the epoch (with more than one), dev is reported."""
    return [SELECTION, DEV] if epochs > 1 and selecting else [DEV]


def recorded_config(text: str, source: str, seed: int, device: str, selecting: bool = True) -> TrainConfig:
    """The ``TrainConfig`` the trial trained, from its stored specification (``text``, the run's
    ``trial_spec.json``), with another seed, on ``device``: exactly what it trained, nothing rebuilt."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as error:
        raise UserError(f"{source}: not valid JSON: line {error.lineno}: {error.msg}") from None
    config = TrialSpec.from_dict(raw, source).config
    # no rungs: a re-run is judged at its epochs' ends, as a confirmation run is (a rung's report saves nothing)
    return dataclasses.replace(config, seed=seed, device=device, eval_splits=rerun_splits(config.epochs, selecting),
                               predictions_of=(), report_fractions=[])  # fmt: skip


def rerun_config(row: pd.Series, seed: int, train_settings: dict, device: str, selecting: bool = True):
    """The ``TrainConfig`` a trial of a record without stored specifications trained, with another seed, evaluated
    as a re-run is (:func:`rerun_splits`): ``peftune.record.legacy.rerun_config``."""
    return legacy.rerun_config(row, seed, train_settings, device, rerun_splits(int(row["epochs"]), selecting))


# ----------------------------------------------------------------------------- data


@contextlib.contextmanager
def _quiet_downloads():
    """MLflow draws a progress bar per download on stderr; a few small files do not need one."""
    key = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
    before = os.environ.get(key)
    os.environ[key] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def _artifact_text(client, run_id: str, path: str) -> str | None:
    """A run's text artifact; None where it is absent."""
    with _quiet_downloads():
        return reader.artifact_text(client, run_id, path)


def check_data(prepared, recorded: dict[str, str] | None, test_hashes: dict[str, str], data_dir) -> None:
    """The training/dev files must be the sweep's; a test file must be none of them."""
    if recorded:
        differ = sorted(
            name for name, digest in prepared.file_hashes.items() if recorded.get(name) not in (None, digest)
        )
        if differ:
            raise UserError(
                f"{', '.join(differ)} in {data_dir} differ from the files sweep was run on (data_hashes.json): "
                f"re-training must use the same data"
            )
    known = {**prepared.file_hashes, **(recorded or {})}
    for test_name, digest in test_hashes.items():
        same = [name for name, d in known.items() if d == digest]
        if same:
            raise UserError(
                f"test file {test_name} has the same content as {same[0]}, which the sweep trained or selected on: "
                f"a test split must be held out"
            )


def check_test_dir(test_dir, tasks: Sequence[str], invalid_rows: str) -> None:
    """Every task's test file is there and valid (read and checked; a job does this before its sweep)."""
    for task, path in test_files(test_dir, tasks).items():
        read_task_file(path, get_task(task), invalid_rows=invalid_rows, role="test")


def test_files(test_dir, tasks: Sequence[str]) -> dict[str, Path]:
    """Task name -> its test file: a task file's own `test` (or its one split file) beside it, else ``test_dir``'s."""
    test_dir = Path(test_dir)
    files = {task: task_path(test_dir, get_task(task), "test") for task in tasks}
    if not test_dir.is_dir() and any(path.parent == test_dir for path in files.values()):
        raise DataError(test_dir, "test directory not found", expected="a directory holding the labelled test files")
    return files


def load_test_splits(test_dir, tasks: Sequence[str], tokenizer, max_length: int, invalid_rows: str) -> dict:
    """Task name -> EncodedSplit of its test file (:func:`test_files`; all rows, validated like any data file)."""
    return {
        task: encode_split(path, get_task(task), tokenizer, max_length, invalid_rows=invalid_rows, role="test")
        for task, path in test_files(test_dir, tasks).items()
    }


# ----------------------------------------------------------------------------- the evaluation


def evaluate_sweep(
    name: str,
    data_dir: str | Path,
    test_dir: str | Path | None,
    *,
    seeds: int = 3,
    top: int | None = None,
    answer: bool = False,
    epochs: int | None = None,
    tracking_uri: str | None = None,
    output: str | Path | None = None,
    device: str = "auto",
    restore_checkpoints: bool = True,
    invalid_rows: str | None = None,
    log_artifacts: bool = True,
) -> Evaluation:
    """Re-train (or restore) the frontier configurations of sweep ``name`` with ``seeds`` seeds; score dev and test.

    ``answer``: each budget's pick, its best and the best of the others instead of the frontier (whether the
    answer transfers);
    ``epochs``: train each that many epochs instead of its recorded ones (no checkpoint is restored then);
    ``invalid_rows`` None: the sweep's own setting (its definition's ``invalid_rows``), so its rows are read again;
    ``test_dir`` None: dev only."""

    if seeds < 1:
        raise UserError(f"--seeds must be >= 1, got {seeds}")
    if epochs is not None and not 1 <= epochs <= 1_000:
        raise UserError(f"--epochs must be from 1 to 1000, got {epochs}")
    sweep = read_sweep_record(name, tracking_uri)
    client = reader.client(sweep.tracking_uri)
    configurations = answer_configurations(sweep) if answer else select_configurations(sweep, top)
    log.info(
        "evaluating %d configuration(s) of sweep %s with %d seed(s): %s",
        len(configurations),
        name,
        seeds,
        ", ".join(configurations["label"]),
    )
    data = _evaluation_data(sweep, client, data_dir, test_dir, invalid_rows, device, epochs)
    rows, todo = [], []
    for _, trial in configurations.iterrows():
        recorded_dev = {m: trial[m] for m in [SCORE, *sweep.task_metrics]}
        rows.append(_row(trial, None, "selection (sweep)", "sweep record", recorded_dev))
        base_seed = int(trial["seed"]) if pd.notna(trial["seed"]) else 0
        for i, seed in enumerate(evaluation_seeds(sweep, trial, seeds)):
            restore = i == 0 and seed == base_seed and restore_checkpoints and bool(trial.get("has_checkpoint"))
            restore = restore and epochs is None  # a checkpoint holds the recorded epochs' training
            todo.append((i, trial, seed, restore))
    # every configuration's first seed, then every second one: a long evaluation's log has them all early
    for _, trial, seed, restore in sorted(todo, key=lambda job: job[0]):
        rows += _evaluate_seed(data, trial, seed, restore)
    runs = pd.DataFrame(rows)
    summary = summarize(runs, [SCORE, *sweep.task_metrics])
    directory = Path(output or Path(REPORTS_DIR) / name) / "evaluation"
    evaluation = Evaluation(sweep, configurations, runs, summary, directory, [])
    write_evaluation(evaluation, test_dir=test_dir, seeds=seeds)
    if log_artifacts:
        uri, run_id = sweep.tracking_uri, sweep.parent_run_id
        writer.log_report_files(uri, run_id, directory, f"{ARTIFACT_PATH}/evaluation")
    return evaluation


@dataclass
class _EvaluationData:
    """What every re-training of a sweep's configurations shares: its data, the test split, the device."""

    client: object  # the client of the sweep's store (reader.client)
    prepared: object  # peftune.core.train.PreparedData: the sweep's training and dev data, its backbone
    test_tasks: dict  # task -> TaskData whose ``dev`` is the test split
    train_settings: dict  # the sweep definition's ``train`` section
    device: str  # as asked (a TrainConfig's device)
    torch_device: object  # as selected on this machine
    version: int  # the sweep's record version (peftune.record.legacy): what old paths its runs take
    epochs: int | None = None  # each re-training's epochs (None: as recorded)


def _evaluation_data(sweep: SweepRuns, client, data_dir, test_dir, invalid_rows: str | None, device: str,
                     epochs: int | None = None) -> _EvaluationData:  # fmt: skip
    """Read the sweep's data with its recorded budget, then the test split (once, after every selection)."""

    definition = yaml.safe_load(_artifact_text(client, sweep.parent_run_id, "sweep.yaml") or "{}") or {}
    # the rows the sweep trained on: a preset that skips malformed rows (the multitask one) is read the same way
    invalid_rows = invalid_rows or definition.get("invalid_rows") or "raise"
    p = sweep.parent_params
    model = str(p.get("model") or sweep.backbone)
    max_length = int(p.get("max_length") or DEFAULT_MAX_LENGTH)
    confirmed_rows = confirmation_train_rows(sweep, client)
    selection_examples, decision_examples = legacy.split_sizes(p, sweep.record_version, sweep.parent_run_id)
    data = DataSettings(
        data_dir=str(data_dir) if data_dir is not None else None,
        model=model,
        max_length=max_length,
        # the rows the report's numbers trained on: the confirmation's where it ran, else the search's
        max_train_examples=p.get("max_train_examples") if confirmed_rows is False else confirmed_rows,
        max_dev_examples=p.get("max_dev_examples"),
        seed=int(p.get("seed") or 0),
        invalid_rows=invalid_rows,
        # the sweep's own carving: the same train rows, and a selection split to keep each run's epoch on
        selection_examples=selection_examples,
        decision_examples=decision_examples,
    )
    prepared = prepare(data, sweep.tasks)
    recorded = _artifact_text(client, sweep.parent_run_id, "data_hashes.json")
    tokenizer = load_tokenizer(resolve_model_dir(model))
    # the one place the test split is read: every configuration is chosen before, on dev
    tests = {} if test_dir is None else load_test_splits(test_dir, sweep.tasks, tokenizer, max_length, invalid_rows)
    # named by the file read (a split's own `source` is the first file of that content the tokenize cache saw); a
    # one-file task's test rows are its seeded split's own, apart from train and dev by construction
    test_hashes = {Path(s.source).name: s.sha256 for task, s in tests.items() if get_task(task).file is None}
    check_data(prepared, json.loads(recorded) if recorded else None, test_hashes, data_dir)
    test_tasks = {t: TaskData(train=prepared.tasks[t].train, dev=tests[t]) for t in tests}
    return _EvaluationData(client, prepared, test_tasks, definition.get("train") or {}, device, select_device(device),
                           sweep.record_version, epochs)  # fmt: skip


def confirmation_train_rows(sweep: SweepRuns, client) -> int | None | bool:
    """The train rows per task the sweep's confirmation runs trained on (None: every row not held out), from a
    completed confirmation run's recorded data settings; False without one (the search's rows are the report's)."""
    runs = sweep.confirmations if sweep.confirmations is not None else pd.DataFrame()
    done = runs[runs["status"] == COMPLETED] if len(runs) else runs
    if not len(done):
        return False
    run_id = str(done["run_id"].iloc[0])
    value = reader.run_params(client, run_id).get("data.max_train_examples")
    return legacy.confirmation_rows(run_id, value, sweep.record_version)


def _evaluate_seed(data: _EvaluationData, trial: pd.Series, seed: int, restore: bool) -> list[dict]:
    """The dev and test rows of ``trial`` with ``seed``: its checkpoint restored when asked and accepted, else
    re-trained."""

    started = time.perf_counter()
    batch_size = int(trial["batch_size"]) * 2
    model = _restore(data.client, trial, data.prepared, data.torch_device) if restore else None
    if model is not None:
        source = "checkpoint"
        dev = evaluate(model, data.prepared.tasks, batch_size, data.torch_device)
        dev[SCORE] = overall_score(dev)
        # the sweep recorded the trial's score on the split it was judged on: selection where there is one
        judged = SELECTION if next(iter(data.prepared.tasks.values())).selection is not None else DEV
        again = overall_score(evaluate(model, data.prepared.tasks, batch_size, data.torch_device, split=judged))
        if abs(again - trial[SCORE]) > 1e-4:
            log.warning(
                "%s: the restored checkpoint scores %.4f on %s, the sweep recorded %.4f: data or code differ",
                *(trial["label"], again, judged, trial[SCORE]),
            )
    else:
        source = "retrained"
        selecting = next(iter(data.prepared.tasks.values())).selection is not None
        stored = _artifact_text(data.client, trial["run_id"], trial_spec.ARTIFACT)
        if stored is not None:
            where = f"run {trial['run_id']}: {trial_spec.ARTIFACT}"
            config = recorded_config(stored, where, seed, data.device, selecting)
        else:
            legacy.unspecified(trial["run_id"], reader.run_tags(data.client, trial["run_id"]), data.version)
            config = rerun_config(trial, seed, data.train_settings, data.device, selecting)
        if data.epochs is not None:
            config = dataclasses.replace(config, epochs=data.epochs, eval_splits=rerun_splits(data.epochs, selecting))
        model, dev = _retrain(config, data.prepared)
    test = evaluate(model, data.test_tasks, batch_size, data.torch_device) if data.test_tasks else {}
    if test:
        test[SCORE] = overall_score(test)
    seconds = time.perf_counter() - started
    log.info(
        "%s seed %d (%s, %.0fs): dev score %.4f%s",
        *(trial["label"], seed, source, seconds, dev[SCORE], f", test score {test[SCORE]:.4f}" if test else ""),
    )
    rows = ", ".join(f"{task} {len(split.train)}" for task, split in data.prepared.tasks.items())
    rows += f" x {data.epochs} epoch(s)" if data.epochs is not None else ""
    scored = (("dev", dev), ("test", test)) if test else (("dev", dev),)
    return [{**_row(trial, seed, split, source, metrics), "train_rows": rows} for split, metrics in scored]


def _row(trial: pd.Series, seed: int | None, split: str, source: str, metrics: dict) -> dict:
    return {
        "run_id": trial["run_id"],
        "label": trial["label"] + (f" ({trial['answer_role']})" if isinstance(trial.get("answer_role"), str) else ""),
        "method": trial["method"],
        "size": trial["size"],
        pareto.COST: trial[pareto.COST],
        pareto.COST_PCT: trial[pareto.COST_PCT],
        "seed": seed,
        "split": split,
        "source": source,
        **{k: float(v) for k, v in metrics.items()},
    }


def _restore(client, trial: pd.Series, prepared, device):
    """The trial's best-epoch model from its ``checkpoint/`` artifact; None (and a warning) if peftune refuses it.

    A refused checkpoint (another backbone, a method mismatch) is re-trained with the trial's seed instead:
    the evaluation stays complete, and the warning says why.
    """

    with tempfile.TemporaryDirectory(prefix="peftune-ckpt-") as directory, _quiet_downloads():
        local = reader.download_artifact(client, trial["run_id"], "checkpoint", directory)
        try:
            model = load_checkpoint(local, backbone=prepared.backbone.build())
        except CheckpointError as error:
            log.warning("%s: its checkpoint cannot be restored (%s); re-training its seed", trial["label"], error)
            return None
    return model.to(device)


def _retrain(config, prepared):
    """Train ``config``; return the model at its best epoch on its first split (selection where there is one, as
    the sweep; via a temporary checkpoint) and that epoch's dev metrics."""

    best: dict = {SCORE: -math.inf}
    with tempfile.TemporaryDirectory(prefix="peftune-eval-") as directory:

        def report(metrics, save):
            if improves(metrics[SCORE], best[SCORE]):  # the sweep's rule
                best.clear()
                best.update(metrics)
                save(Path(directory))

        result = run_trial(config, prepared, report)
        load_trainable(result.model, directory)
    if config.eval_splits[0] != DEV:  # judged on selection: dev's numbers are the dev_ ones
        best = {k[len("dev_") :]: v for k, v in best.items() if k.startswith("dev_")}
    metrics = {k: best[k] for k in best if k == SCORE or k.endswith(("_accuracy", "_pearson"))}
    return result.model, metrics


def summarize(runs: pd.DataFrame, metrics: Sequence[str]) -> pd.DataFrame:
    """Mean, sample standard deviation (ddof 1; NaN with one seed) and count per (configuration, split)."""
    keys = ["run_id", "label", "method", "size", pareto.COST, pareto.COST_PCT, "split"]
    keys += ["train_rows"] if "train_rows" in runs.columns else []  # the budget the runs trained at
    grouped = runs.groupby(keys, sort=False, dropna=False)[list(metrics)]
    mean = grouped.mean().add_suffix("_mean")
    std = grouped.std(ddof=1).add_suffix("_std")
    count = grouped.size().rename("n")
    out = pd.concat([mean, std, count], axis=1).reset_index()
    half = out["n"].map(confirmed.interval_factor)  # the report's t-based 95% interval of the mean
    for metric in metrics:
        out[f"{metric}_ci_low"] = out[f"{metric}_mean"] - half * out[f"{metric}_std"]
        out[f"{metric}_ci_high"] = out[f"{metric}_mean"] + half * out[f"{metric}_std"]
    out["split"] = pd.Categorical(out["split"], categories=list(SUMMARY_SPLITS), ordered=True)
    out = out.sort_values([pareto.COST, "label", "split"], kind="stable").reset_index(drop=True)
    out["split"] = out["split"].astype(str)
    return out


def mean_std_table(summary: pd.DataFrame, metrics: Sequence[str]) -> pd.DataFrame:
    """Readable strings: ``0.512 ± 0.010`` per metric (``0.512`` alone for a single value)."""
    table = pd.DataFrame(
        {
            "Method": summary["label"],
            "Params/task %": summary[pareto.COST_PCT].map(lambda v: f"{v:.3g}"),
            "Split": summary["split"],
        }
    )
    for metric in metrics:
        name = "Score" if metric == SCORE else plots.task_name(metric_task(metric)[0], metric)
        table[name] = [
            f"{m:.3f}" if pd.isna(s) else f"{m:.3f} ± {s:.3f}"
            for m, s in zip(summary[f"{metric}_mean"], summary[f"{metric}_std"], strict=True)
        ]
    if "train_rows" in summary.columns:  # what each run trained on (the sweep's own row: its search's budget)
        table["Trained on (rows per task)"] = summary["train_rows"].fillna("the search's")
    table["Seeds"] = summary["n"].astype(int).astype(str)
    table["Run id"] = summary["run_id"].str[:12]
    return table


def write_evaluation(evaluation: Evaluation, *, test_dir, seeds: int) -> None:
    sweep = evaluation.sweep
    directory = evaluation.directory
    directory.mkdir(parents=True, exist_ok=True)
    metrics = [SCORE, *sweep.task_metrics]
    files = [
        directory / "evaluation_runs.csv",
        directory / "evaluation.csv",
        directory / "evaluation.md",
        directory / "evaluation.png",
    ]
    evaluation.runs.to_csv(files[0], index=False)
    evaluation.summary.to_csv(files[1], index=False)
    table = mean_std_table(evaluation.summary, metrics)
    answer = "answer_role" in evaluation.configurations
    what = "each budget's pick, best and best of the others" if answer else "the dev frontier"
    files[2].write_text(
        f"# Sweep {sweep.name}: final evaluation of {what}\n\n"
        f"- backbone `{sweep.backbone}`; {len(evaluation.configurations)} configuration(s), {seeds} seed(s) "
        f"each; {f'test files from `{test_dir}`' if test_dir is not None else 'dev only (no test split given)'}\n"
        "- `selection (sweep)`: the trial's own figure on the split that selected it (the selection split; dev in "
        "records older than it); `dev` and `test`: mean ± sample std over the "
        "seeds (the first seed restored from the trial's checkpoint when it has one), each run at its epoch best on "
        "the split that selects, as the sweep chose (the selection split; dev in records older than it)\n\n"
        + to_markdown(table)
        + "\n![dev vs test](evaluation.png)\n"
    )
    evaluation_png(evaluation.summary, files[3], metrics, sweep=sweep.name, backbone=sweep.backbone, seeds=seeds)
    evaluation.files[:] = files


# each split's mark in evaluation.png, side by side around its configuration's tick
SPLIT_STYLES = {
    "selection (sweep)": {"marker": "*", "offset": -0.22, "filled": True},
    "dev": {"marker": "o", "offset": 0.0, "filled": True},
    "test": {"marker": "s", "offset": 0.22, "filled": False},
}


def evaluation_png(
    summary: pd.DataFrame, path: Path, metrics: Sequence[str], *, sweep: str, backbone: str, seeds: int
) -> Path:
    """One panel per metric: each configuration's sweep dev figure, re-trained dev and test, mean ± std."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, axes = plt.subplots(
        1, len(metrics), figsize=(4.2 * len(metrics) + 1.8, 4.6), dpi=150, layout="constrained", squeeze=False
    )
    for ax, metric in zip(axes[0], metrics, strict=True):
        _evaluation_panel(ax, summary, metric)
    handles = [
        Line2D([], [], ls="", marker="*", ms=9, color="dimgrey", label="dev, the sweep's trial (selection)"),
        Line2D([], [], ls="", marker="o", ms=6, color="dimgrey", label=f"dev, mean ± std over {seeds} seed(s)"),
        Line2D(
            [],
            [],
            ls="",
            marker="s",
            ms=6,
            color="dimgrey",
            mfc="white",
            label=f"test, mean ± std over {seeds} seed(s)",
        ),
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=8.5, frameon=False)
    fig.suptitle(
        f"Sweep {sweep}: dev frontier configurations (x: method, size, trainable params per task), dev vs test\n"
        f"backbone {backbone}; colour = method",
        fontsize=11,
    )
    fig.savefig(path)
    plt.close(fig)
    return path


def _evaluation_panel(ax, summary: pd.DataFrame, metric: str) -> None:
    """One metric: per configuration (x), its three splits side by side, mean ± std, in the method's colour."""
    configs = list(dict.fromkeys(summary["label"]))
    first = summary.drop_duplicates("label").set_index("label")
    for i, label in enumerate(configs):
        color = plots.method_color(first.loc[label, "method"])
        for split, style in SPLIT_STYLES.items():
            row = summary[(summary["label"] == label) & (summary["split"] == split)]
            if row.empty:
                continue
            mean, std = row[f"{metric}_mean"].iloc[0], row[f"{metric}_std"].iloc[0]
            ax.errorbar(
                i + style["offset"],
                mean,
                yerr=None if pd.isna(std) else std,
                marker=style["marker"],
                ms=8 if style["marker"] == "*" else 6,
                color=color,
                capsize=3,
                lw=1.2,
                mfc=color if style["filled"] else "white",
            )
    ticks = [f"{c}\n{first.loc[c, pareto.COST_PCT]:.3g}%" for c in configs]
    ax.set_xticks(range(len(configs)), ticks, fontsize=8, rotation=30, ha="right")
    ax.set_xlim(-0.6, len(configs) - 0.4)
    ax.set_xlabel("frontier configuration, trainable params per task (% of backbone)", fontsize=8.5)
    ax.set_ylabel(plots.metric_label(metric).replace("dev ", "") if metric != SCORE else "score (mean of tasks)")
    ax.set_title("score" if metric == SCORE else plots.metric_label(metric).removeprefix("dev "), fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
