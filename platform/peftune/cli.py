"""``peftune`` command line: train | methods | bench | sweep | report | evaluate | schema | up | down.

Errors a user can act on (bad data rows, unknown methods or options, missing
models) print one line naming what is wrong and exit with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import yaml
from pydantic import TypeAdapter

from peftune import bench, checkpoint, lease, methods, record, services, spaces, train, trial_spec
from peftune.backbone import DEFAULT_MODEL, BertConfig, BertModel, check_tokenizer_files, read_config, resolve_model_dir
from peftune.errors import DiskFullError, UserError, disk_full, one_line, user_errors
from peftune.model import MultitaskModel
from peftune.params import count_parameters
from peftune.stopping import sigterm_received, stopped
from peftune.tasks import get_task, parse_tasks

if TYPE_CHECKING:
    from peftune.sweep import SweepResult

log = logging.getLogger("peftune.cli")


def finite_float(text: str) -> float:
    """argparse type: a finite number (``nan`` and ``inf`` parse as floats but no setting takes them)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text[:80]!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text[:80]!r}")
    return value


class Parser(argparse.ArgumentParser):
    """argparse's parser, its refusals one line like every other user error (``prog: error: ...``, exit 2): the
    usage block argparse prints first (3 to 20 lines) buried the line that says what is wrong; ``--help`` has it.
    A negative number is a value (``--lr -inf``), not a flag argparse does not know."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {one_line(message)}\n")

    def parse_known_args(self, args=None, namespace=None):
        return super().parse_known_args(numbers_attached(sys.argv[1:] if args is None else list(args)), namespace)


def numbers_attached(argv: list[str]) -> list[str]:
    """``--flag -inf`` as ``--flag=-inf``: argparse takes a word that starts with '-' for a flag unless it looks
    like ``-1`` or ``-.5``, so ``-inf``, ``-nan`` and ``-1e-3`` never reached the flag's own check ("expected one
    argument"). No flag of peftune looks like a number, so such a word is always a value."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":  # what follows is positional as it is
            return out + argv[i:]
        if out and _negative_number(arg) and out[-1].startswith("--") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _negative_number(text: str) -> bool:
    if not text.startswith("-") or text.startswith("--"):
        return False
    try:
        float(text)
    except ValueError:
        return False
    return True


def path_arg(text: str) -> str:
    """argparse type of a path flag: not empty (``--data-dir ''`` was the working directory, silently)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"an empty path {text!r}; expected a path ('.' for the working directory)")
    return text


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        type=path_arg,
        default=DEFAULT_MODEL,
        help=f"HF BERT: a local directory, a hub name, or {DEFAULT_MODEL!r} (packaged, offline; the default)",
    )


def add_method_args(parser: argparse.ArgumentParser) -> None:
    """``--method`` and a flag per option of every registered method, generated from the methods' config fields
    (``--rank``, ``--targets``...): a method registered before the parser is built brings its own."""
    parser.add_argument("--method", default="lora", help=f"one of: {', '.join(methods.method_names())}")
    for name, (first, *rest) in method_flags().items():
        defaults = ", ".join(f"{method} {_shown(option.default)}" for method, option in [first, *rest])
        kind = first[1].type if all(option.type == first[1].type for _, option in rest) else None
        try:
            parser.add_argument(
                first[1].flag,
                dest=_option_dest(name),
                type=_flag_type(kind),
                metavar={int: "INT", float: "X"}.get(kind, "VALUE"),
                help=f"{first[1].help} (default: {defaults})",
            )
        except argparse.ArgumentError as error:  # a method's field named like a flag of the command itself
            raise TypeError(f"method {first[0]!r}: option {name!r} clashes with a flag of peftune: {error}") from None
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of the method's config as KEY=VALUE, as its own flag sets it (the form of the commands "
        "recorded before every option had a flag), e.g. --option targets=query,value",
    )


# options never recorded as --option KEY=VALUE, so there a mistake: dropout (whose flag's default would win) and
# the sizes that had their own flag before every option did (each recorded command spells them so)
FLAG_ONLY = ("dropout", "rank", "alpha", "bottleneck", "prefix_length", "prompt_length", "k")


def method_flags() -> dict[str, list[tuple[str, methods.MethodOption]]]:
    """Every registered method's options by name: each name is one flag, whichever methods have it."""
    flags: dict[str, list] = {}
    for method in methods.method_names():
        for option in methods.get_method(method).options():
            flags.setdefault(option.name, []).append((method, option))
    return flags


def _option_dest(name: str) -> str:
    return f"method.{name}"  # apart from the command's own flags (a method option named like one is refused)


def _flag_type(kind) -> Callable[[str], Any]:
    """How a method option's flag reads its text: numbers as numbers (finite), anything else (a list, a word,
    true/false, or options of one name but of other types in two methods) as a YAML scalar or flow list."""
    if kind is int:
        return int
    return finite_float if kind is float else _flag_value


def _flag_value(text: str):
    try:
        return _parse_value(text)
    except UserError:
        raise argparse.ArgumentTypeError(
            f"expected a number, a word, true/false or [a, b], got {text[:80]!r}"
        ) from None


def _shown(default) -> str:
    return ",".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)


def method_options(args) -> dict:
    """Collect the method options given by flag or ``--option``; an option the method does not have is an error."""
    spec = methods.get_method(args.method)
    valid = {option.name for option in spec.options()}
    options = {}
    for name in method_flags():
        value = getattr(args, _option_dest(name), None)
        if value is None:
            continue
        if name not in valid:
            flag = "--" + name.replace("_", "-")
            raise UserError(f"{flag} does not apply to method {args.method!r} (its options: {', '.join(valid)})")
        options[name] = value
    for item in args.option:
        key, sep, raw = item.partition("=")
        if not sep:
            raise UserError(f"--option {item!r}: expected KEY=VALUE")
        if key in FLAG_ONLY:
            flag = "--" + key.replace("_", "-")
            raise UserError(f"--option {item[:80]!r}: {key} has its own flag; use {flag} {raw[:40]}")
        if key not in valid:
            raise UserError(f"method {args.method!r} has no option {key!r}; valid options: {', '.join(valid)}")
        if key in options:
            flag = "--" + key.replace("_", "-")
            raise UserError(f"--option {item[:80]!r}: {key} is given twice; give it once, by {flag} or --option")
        options[key] = _parse_value(raw)
    return options


def check_output_dir(flag: str, output: Path) -> None:
    """``output`` is a directory, or one that can be created, and written: checked before any work, creating nothing."""
    for place in (output, *output.absolute().parents):
        if not place.exists():
            continue
        if not place.is_dir():
            what = "is an existing file" if place == output else f"lies under {place}, a file"
            raise UserError(f"{flag} {output}: {what}; expected a directory (or one that can be created)")
        if not os.access(place, os.W_OK | os.X_OK):
            raise UserError(f"{flag} {output}: {place} is not writable; expected a directory that can be written")
        return


def check_device(device: str):
    """``--device`` against what this machine has (a form torch refuses, a missing GPU), before any work."""

    try:
        return train.select_device(device)
    except UserError as error:
        raise UserError(f"--device: {error}") from None


def check_model(config, model: str) -> None:
    """The model before the data: its tokenizer files, and the method's sizes against its shape (config.json
    alone), so a LoRA rank of 10**12 is refused here, not by the allocator after the data is read."""

    model_dir = resolve_model_dir(model)
    bert = read_config(model_dir)
    check_tokenizer_files(model_dir)  # whether its vocabulary fits the model: load_tokenizer, once the weights are read
    try:
        methods.make_method_config(config.method, config.method_options_with_dropout()).check_backbone(bert)
    except UserError as error:
        raise UserError(f"--method {config.method} on --model {model}: {error}") from None


def check_spaces_against_model(definition: spaces.SweepDefinition) -> None:
    """Every value a method's search space can propose, against the model's shape (its config.json alone),
    before Ray: a top_k ``k`` above the backbone's layers or a rank above its width is refused here, naming the
    space's file and key, not by a trial after the cluster started."""
    bert = read_config(resolve_model_dir(definition.model))
    for space in definition.spaces.values():
        for key, param in space.options.items():
            for value in spaces.proposed_values(param):
                try:
                    methods.make_method_config(space.method, {key: value}).check_backbone(bert)
                except UserError as error:
                    raise UserError(
                        f"{space.source}: options.{key}: {value!r} does not fit the model {definition.model} ({error})"
                    ) from None


def _parse_value(raw: str):
    # YAML scalars only (numbers, booleans, strings): never objects or code
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        raise UserError(f"--option value {raw[:80]!r}: not a valid value (a number, a word, or [a, b])") from None
    return value if isinstance(value, (int, float, bool, str, list)) else raw


def cmd_train(args) -> int:
    spec = spec_from_args(args)
    config = spec.config
    output = Path(args.output or f"runs/{config.method}-{time.strftime('%Y%m%d-%H%M%S')}")
    check_train_args(args, spec, output)  # all a user can get wrong, before the data is read
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    logging.info("reading and tokenizing %s from %s", ",".join(config.tasks), spec.data.data_dir)
    prepared = spec.data.prepare(config.tasks)
    best = {record.SCORE: float("-inf")}

    def report(metrics, save):
        print(format_metrics(metrics), flush=True)
        if record.improves(metrics[record.SCORE], best[record.SCORE]):
            best.update(metrics)
            save(output)

    counts = train.run_trial(config, prepared, report).history[-1]
    print(
        f"best {config.eval_splits[0]} score {best[record.SCORE]:.4f} at epoch {best[record.EPOCH]}; "
        f"trainable per task {counts[record.TRAINABLE_PER_TASK]:,} "
        f"({counts[record.TRAINABLE_PER_TASK_PCT]:.2f}% of the backbone), "
        f"stored {counts[record.STORED_PARAMS]:,} ({counts[record.STORED_PARAMS_PCT]:.2f}%)"
    )
    trial_spec.write(spec, output / trial_spec.ARTIFACT)  # `peftune train --spec` of it runs this again
    print(f"checkpoint (best epoch): {output}; the run's spec: {output / trial_spec.ARTIFACT}")
    if args.export_peft:
        model = checkpoint.load_checkpoint(output, backbone=prepared.backbone.build())
        path = checkpoint.export_peft(model, output / "peft", base_model_name_or_path=spec.data.model)
        print(f"peft {config.method} adapter: {path}")
    return 0


# what goes with --spec: where the trial runs and what is kept of it (the spec gives everything it trains)
SPEC_COMPANIONS = ("spec", "data_dir", "device", "threads", "output", "overwrite", "export_peft")


def spec_from_args(args) -> trial_spec.TrialSpec:
    """The trial ``peftune train`` runs: the file of ``--spec`` (with the data directory, device and threads
    given beside it), or the trial its flags spell (the inverse of ``TrialSpec.command``)."""
    if args.spec is None:
        if args.data_dir is None:
            raise UserError("--data-dir is required (or --spec FILE, a trial's specification)")
        return trial_spec.TrialSpec(config_from_args(args), data_from_args(args), args.threads)
    parser = Parser(prog="peftune")  # train's flags alone: the top-level -v (debug logging) goes with --spec
    add_train_parser(parser.add_subparsers(dest="command", required=True))
    defaults = parser.parse_args(["train", "--spec", args.spec])
    given = [name for name, value in vars(args).items() if value != getattr(defaults, name, value)]
    extra = [name for name in given if name not in SPEC_COMPANIONS]
    if extra:
        flag = "--" + extra[0].removeprefix("method.").replace("_", "-")
        raise UserError(f"{flag} with --spec: the spec gives the whole trial; beside it only --data-dir, "
                        "--device, --threads, --output, --overwrite and --export-peft")  # fmt: skip
    spec = trial_spec.read(args.spec)
    data_dir = str(args.data_dir) if args.data_dir is not None else spec.data.data_dir
    if data_dir is None:
        raise UserError(f"{args.spec}: the trial's data directory is not recorded; pass --data-dir")
    config = dataclasses.replace(spec.config, device=args.device) if "device" in given else spec.config
    threads = args.threads if args.threads is not None else spec.threads
    return trial_spec.TrialSpec(config, dataclasses.replace(spec.data, data_dir=data_dir), threads)


def data_from_args(args) -> trial_spec.DataSettings:
    """The data settings ``peftune train``'s flags spell; a value out of range names its flag."""
    try:
        return trial_spec.DataSettings(
            data_dir=str(args.data_dir),
            model=args.model,
            max_length=args.max_length,
            max_train_examples=args.max_train_examples,
            max_dev_examples=args.max_dev_examples,
            seed=args.seed if args.data_seed is None else args.data_seed,
            invalid_rows=args.invalid_rows,
            selection_examples=_selection_examples(args.selection_examples),
            decision_examples=args.decision_examples,
        )
    except UserError as error:
        text = str(error)
        key = text.removeprefix("DataSettings.").partition(":")[0].partition(" ")[0]
        flag = "--data-seed" if key == "seed" else "--" + key.replace("_", "-")
        raise UserError(flag + text.removeprefix(f"DataSettings.{key}")) from None


def config_from_args(args) -> train.TrainConfig:
    """The TrainConfig of ``peftune train``'s flags (the inverse of ``train.train_command``)."""
    selection = _selection_examples(args.selection_examples)
    return train.TrainConfig(
        method=args.method,
        method_options=method_options(args),
        tasks=args.tasks,
        **{name: getattr(args, name) for name in train.COMMAND_FIELDS},
        device=args.device,
        # with a selection split the run is judged (and its epoch kept) on it, as a sweep's trial is
        eval_splits=[record.SELECTION, record.DEV] if selection is not False else [record.DEV],
    )


def check_train_args(args, spec: trial_spec.TrialSpec, output: Path) -> None:
    config = spec.config
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads {args.threads}: expected an integer >= 1")
    if output.exists() and not output.is_dir():
        raise UserError(f"--output {output}: is an existing file; expected a checkpoint directory")
    check_output_dir("--output", output)
    if (output / checkpoint.META).exists() and not args.overwrite:
        raise UserError(f"{output} already holds a checkpoint; pass --overwrite or another --output")
    exports = methods.peft_exports()
    if args.export_peft and config.method not in exports:
        names = f"{', '.join(exports[:-1])} or {exports[-1]}"
        raise UserError(f"--export-peft needs --method {names} (got --method {config.method})")
    check_device(config.device)
    check_model(config, spec.data.model)


def _selection_examples(text: str | None):
    """``--selection-examples``: absent (no selection split), ``dev`` (each task's dev size) or a count."""
    if text is None:
        return False
    if text == "dev":
        return None
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise UserError(f"--selection-examples {text[:40]!r}: expected 'dev' or an integer >= 1")
    return count


def format_metrics(metrics: dict) -> str:
    shown = [k for k in metrics if k.endswith(("_accuracy", "_pearson"))] + [record.SCORE, "train_loss"]
    dev_score = record.split_metric(record.DEV, record.SCORE)
    shown += [dev_score] if dev_score in metrics else []  # judged on a selection split: dev beside it
    return (
        f"epoch {metrics[record.EPOCH]}: "
        + "  ".join(f"{k} {metrics[k]:.4f}" for k in shown)
        + f"  ({metrics['epoch_time_s']:.0f}s, {metrics['tokens_per_s']:.0f} tokens/s)"
    )


def cmd_methods(args) -> int:
    if args.bert_base_shape:
        config, label = BertConfig(), "bert-base shape (BertConfig() defaults)"
    else:
        model_dir = resolve_model_dir(args.model)
        config = read_config(model_dir)
        label = args.model
    tasks = parse_tasks(args.tasks)
    print(f"backbone: {label}; tasks: {', '.join(t.name for t in tasks)}")
    print(f"{'method':<13} {'size':<18} {'trainable/task':>15} {'%':>8} {'stored (all tasks)':>19} {'%':>8}")
    for name in methods.method_names():
        spec = methods.get_method(name)
        method_config = spec.config_cls()
        with torch.device("meta"):  # shapes only: no memory, no initialisation
            model = MultitaskModel(BertModel(config), tasks, name, method_config)
        counts = count_parameters(model)
        size = f"{spec.size_field}={getattr(method_config, spec.size_field)}" if spec.size_field else ""
        trainable, stored = counts.trainable_per_task, counts.stored
        print(
            f"{name:<13} {size:<18} {trainable:>15,} {counts.percent(trainable):>7.2f}%"
            f" {stored:>19,} {counts.percent(stored):>7.2f}%"
        )
    return 0


def cmd_bench(args) -> int:
    bench.main(args, check_device(args.device))
    return 0


def cmd_sweep(args) -> int:
    return main_from_args(args)


def cmd_decide(args) -> int:
    """Replay a confirmation's decisions from a predictions file (see ``peftune.decisions``)."""
    from peftune import confirm, decisions

    definition = spaces.load_sweep(spaces.resolve_sweep_path(args.definition), budget=args.budget)
    plan = confirm.plan_of(definition.confirm)
    if args.simulate:
        if args.simulate < 1 or args.simulate > 100_000:
            raise UserError(f"--simulate {args.simulate}: expected a number of simulations from 1 to 100000")
        examples = definition.budget.decision_examples or 2000
        for line in decisions.operating_characteristics(plan, examples, args.simulate):
            print(line, flush=True)
        return 0
    if not (args.predictions and args.configurations and args.output):
        raise UserError("peftune decide: expected --predictions, --configurations and --output (or --simulate N)")
    output = Path(args.output)
    check_output_dir("--output", output)
    kinds = {task: get_task(task).kind for task in definition.tasks}
    try:
        frame = decisions.read_table(args.predictions, "predictions", decisions.PREDICTION_COLUMNS)
        if "split" in frame:
            frame = frame[frame["split"].astype(str) == decisions.DECISION]
        table = decisions.read_table(
            args.configurations, "configurations", ("config", "method", "trainable_pct", "default")
        )
        configurations = decisions.configurations_from_frame(table, args.configurations)
        values = decisions.values_from_frame(frame, kinds)
    except ValueError as error:
        raise UserError(str(error)) from None
    unknown = sorted(set(values) - {c.name for c in configurations})
    if unknown:
        raise UserError(f"{args.predictions}: configuration(s) {unknown[:3]} not in {args.configurations}")
    outcome = decisions.replay(values, configurations, dataclasses.replace(plan, budgets=tuple(args.budgets)))
    output.mkdir(parents=True, exist_ok=True)
    decisions.pair_table(outcome).to_csv(output / "decisions.csv", index=False)
    recommendation = decisions.recommendation_table(outcome)
    recommendation.to_csv(output / "recommendation.csv", index=False)
    decisions.seeds_table(outcome).to_csv(output / "seeds.csv", index=False)
    for r in recommendation.itertuples(index=False):
        print(f"<= {r.budget:g}%: {r.decision}: pick {r.pick} (best {r.best}) {r.needs}".rstrip())
    print(f"looks {outcome.looks}, stopped: {outcome.stopped or 'wants more seeds'}; files in {output}")
    return 0


def cmd_report(args) -> int:
    from analysis.publish import report_sweep
    from peftune.console import quiet_libraries

    quiet_libraries()  # no download bar per artifact read
    args.tracking_uri = record.existing_store_uri(args.tracking_uri)
    if args.output and Path(args.output).exists() and not Path(args.output).is_dir():
        raise UserError(f"--output {args.output}: is an existing file; expected a report directory")
    if args.output:
        check_output_dir("--output", Path(args.output))

    report = report_sweep(
        args.sweep, args.tracking_uri, args.output, reference=args.reference, log_artifacts=args.log_artifacts
    )
    print(f"sweep {args.sweep}: {report.sweep.status_summary()}")
    print(f"report: {report.directory}/report.html ({len(report.files)} files; summary in report.md)")
    if args.log_artifacts:
        print(f"logged under report/ in MLflow run {report.sweep.parent_run_id} ({report.sweep.tracking_uri})")
    return 0


def cmd_evaluate(args) -> int:
    from analysis.evaluate import evaluate_sweep, mean_std_table
    from peftune.console import quiet_libraries

    quiet_libraries()  # no download bar per artifact read
    args.tracking_uri = record.existing_store_uri(args.tracking_uri)
    if args.output and Path(args.output).exists() and not Path(args.output).is_dir():
        raise UserError(f"--output {args.output}: is an existing file; expected a directory")
    if args.output:
        check_output_dir("--output", Path(args.output))
    check_device(args.device)

    evaluation = evaluate_sweep(
        args.sweep,
        args.data_dir,
        args.test_dir,
        seeds=args.seeds,
        top=args.top,
        tracking_uri=args.tracking_uri,
        output=args.output,
        device=args.device,
        restore_checkpoints=args.restore_checkpoints,
        invalid_rows=args.invalid_rows,
    )
    metrics = [record.SCORE, *evaluation.sweep.task_metrics]
    print(mean_std_table(evaluation.summary, metrics).to_string(index=False))
    print(f"evaluation: {evaluation.directory}/evaluation.md (logged under report/evaluation/ in the parent run)")
    return 0


def add_report_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sweep", required=True, help="the sweep's name (its MLflow experiment)")
    parser.add_argument(
        "--tracking-uri",
        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the working directory)",
    )
    parser.add_argument("--output", type=path_arg, help="report directory (default reports/<sweep>)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="peftune", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (add_train_parser, add_methods_parser, add_sweep_parser, add_report_parser, add_evaluate_parser,
                add_bench_parser, add_services_parsers, add_schema_parser, add_decide_parser):  # fmt: skip
        add(sub)
    return parser


def add_train_parser(sub) -> None:
    p = sub.add_parser("train", help="train one configuration and save its best checkpoint")
    add_method_args(p)
    add_model_args(p)
    p.add_argument("--tasks", default="sst,para,sts", help="comma-separated task names (default sst,para,sts)")
    p.add_argument(
        "--spec",
        type=path_arg,
        help="re-run a trial's specification (a sweep run's trial_spec.json) exactly; beside it only --data-dir "
        "(default: the spec's), --device, --threads, --output, --overwrite and --export-peft",
    )
    p.add_argument("--data-dir", type=path_arg, help="directory holding the task files (required without --spec)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=finite_float, default=1e-4)
    p.add_argument("--head-lr", type=finite_float, help="the task heads' learning rate (default: --lr)")
    p.add_argument("--dropout", type=finite_float, default=0.1, help="dropout of the heads and the method's modules")
    p.add_argument("--weight-decay", type=finite_float, default=0.01)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--warmup-ratio", type=finite_float, default=0.1)
    p.add_argument("--max-grad-norm", type=finite_float, default=1.0, help="gradient clipping norm")
    p.add_argument("--sampling", default="proportional", choices=["round_robin", "proportional", "temperature"])
    p.add_argument("--temperature", type=finite_float, default=10.0, help="T of --sampling temperature")
    p.add_argument(
        "--pooling",
        default="auto",
        choices=["auto", "cls", "mean"],
        help="auto (default): the pooling the model was trained with (mean for all-minilm-l6-v2, else [CLS])",
    )
    p.add_argument("--max-length", type=int, default=128, help="tokens per sequence (pairs together)")
    p.add_argument("--max-train-examples", type=int, help="cap per task (a seeded subset): CPU runs need it")
    p.add_argument("--max-dev-examples", type=int, help="cap per task for dev evaluation")
    p.add_argument(
        "--invalid-rows",
        default="raise",
        choices=["raise", "skip"],
        help="a malformed data row stops the run (raise, default) or is dropped with a warning (skip)",
    )
    p.add_argument(
        "--selection-examples",
        help="carve a selection split from the train file, as a sweep does ('dev': as many as each task's dev "
        "set, or a count); the run is then judged on it and also reports dev",
    )
    p.add_argument(
        "--decision-examples",
        type=int,
        default=0,
        help="with --selection-examples: hold that many further train rows out as a sweep's decision split does "
        "(so the run trains on exactly a sweep trial's rows)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-seed", type=int, help="seed of the training subset and selection split (default: --seed)")
    p.add_argument("--threads", type=int, help="torch's CPU threads (default: torch's choice; a trial: its CPUs)")
    p.add_argument("--device", default="auto", help="auto (CUDA if present, else CPU), cpu, cuda, cuda:1...")
    p.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "bf16", "fp32"],
        help="auto: bf16 autocast on CPUs with AVX512-BF16/AMX and GPUs of compute capability >= 8.0, else fp32",
    )
    p.add_argument("--output", type=path_arg, help="checkpoint directory (default runs/<method>-<time>)")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in --output")
    exports = ", ".join(methods.peft_exports())
    p.add_argument("--export-peft", action="store_true", help=f"also export the adapter in peft's format ({exports})")
    p.set_defaults(func=cmd_train)


def add_methods_parser(sub) -> None:
    p = sub.add_parser("methods", help="list the methods with their parameter counts on a backbone")
    add_model_args(p)
    p.add_argument("--tasks", default="sst,para,sts")
    p.add_argument(
        "--bert-base-shape",
        action="store_true",
        help="count on the bert-base shape (BertConfig() defaults) without any download",
    )
    p.set_defaults(func=cmd_methods)


def add_sweep_parser(sub) -> None:
    p = sub.add_parser("sweep", help="run or resume a hyperparameter sweep (Ray Tune + Optuna, logged to MLflow)")
    add_arguments(p)
    p.epilog = EXIT_CODES_HELP
    p.set_defaults(func=cmd_sweep)


def add_report_parser(sub) -> None:
    p = sub.add_parser("report", help="a sweep's Pareto report (tables, plots, HTML), logged to its MLflow parent run")
    add_report_args(p)
    p.add_argument(
        "--reference",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="draw the AdaptBert report's published bert-base points (another backbone) on the plots (default: on)",
    )
    p.add_argument(
        "--log-artifacts",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="log the report directory to the sweep's parent run under report/ (default: on)",
    )
    p.set_defaults(func=cmd_report)


def add_evaluate_parser(sub) -> None:
    p = sub.add_parser(
        "evaluate", help="re-train the dev frontier with several seeds and score it on a held-out labelled test split"
    )
    add_report_args(p)
    p.add_argument(
        "--data-dir", type=path_arg, required=True, help="the directory the sweep trained on (its files are checked)"
    )
    p.add_argument(
        "--test-dir",
        type=path_arg,
        required=True,
        help="directory holding the labelled test files (ids-sst-test.csv, quora-test.csv, sts-test.csv: dev's format)",
    )
    p.add_argument(
        "--seeds", type=int, default=3, help="seeds per configuration: the trial's seed, +1, +2... (default 3)"
    )
    p.add_argument("--top", type=int, help="evaluate only the N best-scoring frontier configurations")
    p.add_argument(
        "--restore-checkpoints",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="restore the trial's logged checkpoint for its own seed instead of re-training it (default: on)",
    )
    p.add_argument("--invalid-rows", default="raise", choices=["raise", "skip"], help="as for train")
    p.add_argument("--device", default="auto", help="auto (CUDA if present, else CPU), cpu, cuda, cuda:1...")
    p.set_defaults(func=cmd_evaluate)


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="training throughput: the core versus the HF Trainer (fp32, bf16, peft LoRA)")
    add_model_args(p)
    p.add_argument("--data-dir", type=path_arg, required=True)
    p.add_argument("--examples", type=int, default=1024, help="SST train examples per measured epoch")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2, help="alternating rounds; the best of each is kept")
    p.add_argument("--device", default="auto", help="auto (CUDA if present, else CPU), cpu, or cuda (one visible GPU)")
    p.add_argument(
        "--profile", action="store_true", help="also the share of training time per op category (torch profiler)"
    )
    p.add_argument(
        "--compile", action="store_true", help="also torch.compile against eager: compile time, step ratio, and "
        "the trial length from which compiling pays"
    )  # fmt: skip
    p.set_defaults(func=cmd_bench)


def add_services_parsers(sub) -> None:
    p = sub.add_parser("up", help="start (or reuse) a local Ray head and MLflow server, both on 127.0.0.1")
    services.add_arguments(p, starting=True)
    p.set_defaults(func=services.cmd_up)
    p = sub.add_parser("down", help="stop the Ray head and MLflow server that `peftune up` started on these ports")
    services.add_arguments(p, starting=False)
    p.set_defaults(func=services.cmd_down)


def add_decide_parser(sub) -> None:
    p = sub.add_parser(
        "decide",
        help="replay a confirmation's decisions from predictions (as a sweep would), or simulate their error rates",
    )
    p.add_argument("--predictions", help="CSV or Parquet: config, seed, task, example_id, prediction, label[, split]")
    p.add_argument("--configurations", help="CSV: config, method, trainable_pct, default")
    p.add_argument("--definition", required=True, help="a sweep definition: its tasks and its confirm section")
    p.add_argument("--budget", help="the definition's budget preset (default: its own)")
    p.add_argument("--budgets", type=float, nargs="+", default=[0.1, 1.0, 10.0], help="trainable %% budgets")
    p.add_argument("--output", help="a directory: decisions.csv, recommendation.csv, seeds.csv")
    p.add_argument("--simulate", type=int, help="instead: N simulations of the procedure's error rates and power")
    p.set_defaults(func=cmd_decide)


def add_schema_parser(sub) -> None:
    p = sub.add_parser("schema", help="print the JSON Schema of a sweep definition (for an editor's YAML checks)")
    p.add_argument("--output", type=Path, help="write it to this file instead of standard output")
    p.set_defaults(func=cmd_schema)


def cmd_schema(args) -> int:
    """The sweep definition's JSON Schema, e.g. for the YAML language server: ``# yaml-language-server: $schema=``."""
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **TypeAdapter(spaces.SweepFile).json_schema()}
    text = json.dumps(schema, indent=2) + "\n"
    if args.output is None:
        sys.stdout.write(text)
    else:
        check_output_dir("--output", args.output.parent)
        args.output.write_text(text, encoding="utf-8")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    return run_command(f"peftune {args.command}", lambda: args.func(args), verbose=args.verbose)


def run_command(prog: str, command: Callable[[], int], verbose: bool = False) -> int:
    """``command()``'s exit status; a user error is one line on stderr and status 2 (with ``verbose``, its
    traceback), a bug keeps its traceback (status 1), and a second Ctrl-C during a sweep, whose records
    are closed by then, or SIGTERM (``ray job stop``), is status 3."""
    try:
        return command()
    except DiskFullError as error:  # a fault, not bad input: the sweep's records are closed, it resumes
        print(f"{prog}: error: {one_line(error)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except user_errors() as error:
        full = disk_full(error)  # a write refused for space outside a sweep's own handling: still a fault
        if full is not None:
            print(f"{prog}: error: {one_line(full)}", file=sys.stderr)
            return EXIT_INTERRUPTED
        if verbose:
            raise
        print(f"{prog}: error: {one_line(error)}", file=sys.stderr)
        return EXIT_USER_ERROR
    except BaseException as error:
        if not stopped(error):
            raise
        ignore_further_interrupts()  # Ray shuts down at exit; a third Ctrl-C or a second SIGTERM must not break that
        print(f"{prog}: interrupted; run the same command again to resume", file=sys.stderr)
        if sigterm_received() or isinstance(error, SystemExit):
            exit_after_sigterm()
        return EXIT_INTERRUPTED


def exit_after_sigterm() -> NoReturn:
    """Exit 3 at once after SIGTERM, the records closed: Ray's core worker, once it has seen the signal,
    aborts the interpreter's normal exit (status -6), so Ray is shut down here and the rest of the exit skipped.

    Midway through ``ray.shutdown()`` Ray's core worker puts SIGTERM back to the default action (measured: 0.3 s
    in, a second before it returns), whatever Python had set: a second SIGTERM then (``ray job stop`` twice)
    killed the driver, status 143. So Ray shuts down in a thread while this one, the only one that may set
    signal handlers, keeps SIGTERM ignored."""
    import ray  # loaded already: a SIGTERM that stops a sweep comes after Ray started

    if threading.current_thread() is not threading.main_thread():
        ray.shutdown()
    else:
        stopping = threading.Thread(target=ray.shutdown, name="peftune-ray-shutdown", daemon=True)
        stopping.start()
        while stopping.is_alive():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            stopping.join(0.001)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)


EXIT_OK, EXIT_USER_ERROR, EXIT_INTERRUPTED, EXIT_FAILURES = 0, 2, 3, 4
EXIT_CODES_HELP = (
    "exit status: 0 completed (or completed_with_failures with --allow-failures); 2 bad input, nothing started; "
    "3 interrupted (run the same command again to resume); 4 some trials failed (completed_with_failures) "
    "or all did (failed)"
)


# ----------------------------------------------------------------------------- sweeps (jobs/*.py, peftune sweep)


def add_arguments(parser, definition_default: str | None = None) -> None:
    """The sweep flags shared by ``jobs/*.py`` and ``peftune sweep``."""
    _add_what_runs(parser, definition_default)
    _add_where_kept(parser)
    _add_after_the_sweep(parser)


def _add_what_runs(parser, definition_default: str | None) -> None:
    """The definition, its budget and the overrides of what the sweep runs."""
    if definition_default is None:
        parser.add_argument(
            "definition",
            help="a sweep definition: a name under search_spaces/ (sst_tuning, "
            "multitask_tuning, smoke) or a path to a YAML file",
        )
    else:
        parser.set_defaults(definition=definition_default)
    parser.add_argument(
        "--data-dir", type=path_arg, required=True, help="directory holding the task files (read by the driver only)"
    )
    parser.add_argument(
        "--smoke-test",
        action="store_true",
        help="the tiny 'smoke' budget: a few trials on a sliver of the data, minutes on 2 CPU cores",
    )
    parser.add_argument(
        "--budget", help="a budget preset of the definition (e.g. smoke, cpu, gpu; default: the definition's own)"
    )
    parser.add_argument("--trials-per-method", type=int, help="each method's trials (overrides the budget's)")
    parser.add_argument(
        "--model",
        type=path_arg,
        help=f"backbone: a local HF BERT directory, a hub name or {DEFAULT_MODEL!r} (default: the definition's)",
    )
    parser.add_argument("--name", help="sweep name (default: the definition's); a new name starts a new sweep")
    parser.add_argument(
        "--multi-objective",
        action="store_true",
        help="search (max score, min trainable parameters) with Optuna directly, no scheduler",
    )
    parser.add_argument(
        "--invalid-rows",
        choices=["raise", "skip"],
        help="a malformed data row stops the sweep (raise) or is dropped and recorded in the parent run (skip); "
        "default: the definition's invalid_rows",
    )


def _add_where_kept(parser) -> None:
    """Where the record, Tune's state, the studies and the reports go, and resuming."""
    parser.add_argument(
        "--tracking-uri",
        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the working directory)",
    )
    parser.add_argument(
        "--storage-path",
        type=path_arg,
        default=record.DEFAULT_STORAGE_PATH,
        help="where Ray Tune keeps the sweep's state and checkpoints (a directory, or s3://... on a "
        f"multi-node cluster; default ./{record.DEFAULT_STORAGE_PATH})",
    )
    parser.add_argument(
        "--optuna-storage",
        help="database URL of the per-method Optuna studies (default: optuna.db beside a SQLite MLflow store, "
        "else under --storage-path)",
    )
    parser.add_argument(
        "--reports-dir",
        type=path_arg,
        default=record.REPORTS_DIR,
        help=f"reports go to <dir>/<sweep>/ (default ./{record.REPORTS_DIR})",
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
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--resume",
        action="store_true",
        help="resume the sweep of this name (an error if there is none); running a sweep again resumes it anyway",
    )
    group.add_argument("--fresh", action="store_true", help="refuse to resume: an error if the sweep exists")


def _add_after_the_sweep(parser) -> None:
    """The final evaluation on held-out test files, and the exit status of a sweep with failures."""
    parser.add_argument(
        "--test-dir",
        type=path_arg,
        help="labelled held-out test files (dev's format: ids-sst-test.csv, quora-test.csv, sts-test.csv); checked "
        "before the sweep, read once after it by the final evaluation (`peftune evaluate`), whose table the "
        "report then includes",
    )
    parser.add_argument(
        "--test-seeds", type=int, default=3, help="seeds per frontier configuration in the final evaluation (default 3)"
    )
    parser.add_argument(
        "--allow-failures",
        action="store_true",
        help="exit 0 when some (not all) trials failed; without it such a sweep exits 4",
    )
    parser.add_argument(  # SUPPRESS: under `peftune -v sweep` the subcommand must not reset the top-level flag
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help="also Ray Tune's per-trial status tables and a line per trial epoch (default: a line per finished "
        "trial with the phase's progress)",
    )


def definition_from_args(args) -> spaces.SweepDefinition:
    budget = "smoke" if args.smoke_test else args.budget
    if args.smoke_test and args.budget not in (None, "smoke"):
        raise UserError(f"--smoke-test uses the smoke budget; it cannot be combined with --budget {args.budget}")
    definition = spaces.load_sweep(spaces.resolve_sweep_path(args.definition), budget=budget)
    overrides = {"trials_per_method": args.trials_per_method} if args.trials_per_method is not None else {}
    return definition.with_overrides(
        name=args.name,
        model=args.model,
        multi_objective=True if args.multi_objective else None,
        invalid_rows=getattr(args, "invalid_rows", None),
        **overrides,
    )


def main_from_args(args) -> int:
    """Run the sweep the flags describe, and write its report when it has completed.

    Every refusal of bad input (flags, the definition, the data files, the model) comes before Ray, Tune,
    MLflow and the report's libraries are imported: together they take seconds to load (10 s on a busy 2-core
    machine), which a one-line refusal should not wait for."""
    definition = definition_from_args(args)  # validated before anything starts
    check_spaces_against_model(definition)
    record.check_tracking_uri(record.resolve_tracking_uri(args.tracking_uri))
    test_dir = getattr(args, "test_dir", None)
    if test_dir is not None:
        check_test_args(test_dir, definition, args.test_seeds)
    lease.Lease(lease.lease_dir(record.storage_uri(args.storage_path)), definition.name).check_free()
    prepared = spaces.prepare_data(definition, args.data_dir)
    from analysis.publish import on_sweep_finished
    from analysis.report import read_predictions
    from peftune import console, sweep

    _warn_relative_paths_in_job(args)
    verbose = getattr(args, "verbose", False)
    result = sweep.run_sweep(
        definition,
        args.data_dir,
        args.tracking_uri,
        storage_path=args.storage_path,
        resume=True if args.resume else (False if args.fresh else None),
        ray_address=args.ray_address,
        shared_storage=args.shared_storage,
        reports_dir=args.reports_dir,
        on_finished=on_sweep_finished,
        optuna_storage=getattr(args, "optuna_storage", None),
        read_predictions=read_predictions,
        verbose=console.TUNE_TABLES if verbose else console.TUNE_QUIET,
        prepared=prepared,
    )
    if test_dir is not None and result.status in (record.COMPLETED, record.COMPLETED_WITH_FAILURES):
        final_evaluation(result, args, definition.invalid_rows, on_sweep_finished)
    ignore_further_interrupts()  # the records are closed: a late Ctrl-C must not turn the exit status into a lie
    print("\n" + result.summary(), flush=True)
    return exit_code(result.status, allow_failures=getattr(args, "allow_failures", False))


def check_test_args(test_dir, definition: spaces.SweepDefinition, seeds: int) -> None:
    """``--test-seeds`` and ``--test-dir``: each task's test file, read and validated before the sweep starts (its
    rows are not used until the end)."""
    from analysis.evaluate import check_test_dir  # deferred: pandas and plotting load slowly

    if seeds < 1:
        raise UserError(f"--test-seeds must be >= 1, got {seeds}")
    check_test_dir(test_dir, definition.tasks, definition.invalid_rows)


def final_evaluation(result: SweepResult, args, invalid_rows: str, on_finished) -> None:
    """The frontier re-trained with ``--test-seeds`` seeds and scored on ``--test-dir``; then the report again,
    which now includes that table. The test split is read here, after every selection was made."""
    from analysis.evaluate import evaluate_sweep  # deferred: pandas and plotting load slowly

    evaluate_sweep(
        result.name,
        args.data_dir,
        args.test_dir,
        seeds=args.test_seeds,
        tracking_uri=result.tracking_uri,
        output=result.report_dir,  # its files go to <report dir>/evaluation/
        invalid_rows=invalid_rows,
    )
    if on_finished is not None:
        on_finished(result)


def ignore_further_interrupts() -> None:
    """The command is ending, its records closed (Ray shuts down at exit): Ctrl-C and SIGTERM from now on are
    ignored. A second SIGTERM (``ray job stop`` twice) during Ray's shutdown met Ray's core worker rather than
    Python's handler and killed the driver (status 143) instead of its documented exit 3."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def exit_code(status: str, allow_failures: bool = False) -> int:
    """See :data:`EXIT_CODES_HELP`; ``allow_failures`` forgives some failed trials, never all."""
    if status == record.COMPLETED or (status == record.COMPLETED_WITH_FAILURES and allow_failures):
        return EXIT_OK
    return EXIT_INTERRUPTED if status == record.INTERRUPTED else EXIT_FAILURES


def job_main(definition: str, description: str, argv: list[str] | None = None) -> int:
    """What ``jobs/*.py`` run: parse the flags, run the sweep and its report, print where everything is."""
    parser = Parser(
        description=description, epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser, definition_default=definition)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    if getattr(args, "verbose", False):
        logging.getLogger("peftune").setLevel(logging.DEBUG)
    return run_command(parser.prog, lambda: main_from_args(args))


def _warn_relative_paths_in_job(args) -> None:
    """Under ``ray job submit --working-dir .`` the working directory is a temporary copy of yours."""
    if "RAY_JOB_CONFIG_JSON_ENV_VAR" not in os.environ:
        return
    relative = [
        flag
        for flag, value in (
            ("--data-dir", args.data_dir),
            ("--storage-path", args.storage_path),
            ("--reports-dir", args.reports_dir),
        )
        if "://" not in str(value) and not Path(value).is_absolute()
    ]
    uri = record.resolve_tracking_uri(args.tracking_uri)
    if args.tracking_uri is None and record.sqlite_path(uri) is not None:
        relative.append("--tracking-uri")
    if relative:
        log.warning(
            "running as a Ray job in %s (a copy of the submitted working directory): %s resolve there; "
            "pass absolute paths to keep the results",
            os.getcwd(),
            ", ".join(relative),
        )


if __name__ == "__main__":
    sys.exit(main())
