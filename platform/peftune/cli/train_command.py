"""``peftune train``: its flags (a flag per option of every registered method, generated from the registry), the
trial they spell or ``--spec`` gives (:class:`peftune.core.trial_spec.TrialSpec`), the checks made before the data is
read, and the run itself, its best epoch's checkpoint kept."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from peftune import methods
from peftune.base import record_names, validation
from peftune.base.errors import UserError
from peftune.cli.common import Parser, add_model_args, check_device, check_output_dir, finite_float, path_arg
from peftune.core import checkpoint, train, trial_spec
from peftune.inputs.backbone import check_max_length, check_tokenizer_files, read_config, resolve_model_dir
from peftune.inputs.data import DEFAULT_MAX_LENGTH
from peftune.inputs.tasks import is_task_file
from peftune.record import epoch_kept
from peftune.record.legacy import FLAG_ONLY


def add_train_parser(sub) -> None:
    p = sub.add_parser("train", help="train one configuration and save its best checkpoint")
    add_method_args(p)
    add_model_args(p)
    p.add_argument(
        "--tasks",
        "--task",
        default="sst,para,sts",
        help="comma-separated shipped task names or task files (YAML; docs/guide.md, 'Your own task'); "
        "default sst,para,sts",
    )
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
    p.add_argument("--max-length", type=int, default=DEFAULT_MAX_LENGTH, help="tokens per sequence (pairs together)")
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


def _parse_value(raw: str):
    # YAML scalars only (numbers, booleans, strings), read as the sweep's files are: never objects or code
    value = validation.yaml_value(raw, "--option value")
    return value if isinstance(value, (int, float, bool, str, list)) else raw


def cmd_train(args) -> int:
    spec = spec_from_args(args)
    config = spec.config
    output = Path(args.output or f"runs/{config.method}-{time.strftime('%Y%m%d-%H%M%S')}")
    check_train_args(args, spec, output)  # all a user can get wrong, before the data is read
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    where = spec.data.data_dir or "beside their task files"
    logging.info("reading and tokenizing %s from %s", ",".join(config.tasks), where)
    prepared = train.prepare(spec.data, config.tasks)
    best = {record_names.SCORE: float("-inf")}

    def report(metrics, save):
        print(format_metrics(metrics), flush=True)
        if epoch_kept.improves(metrics[record_names.SCORE], best[record_names.SCORE]):
            best.update(metrics)
            save(output)

    counts = train.run_trial(config, prepared, report).history[-1]
    print(
        f"best {config.eval_splits[0]} score {best[record_names.SCORE]:.4f} at epoch {best[record_names.EPOCH]}; "
        f"trainable per task {counts[record_names.TRAINABLE_PER_TASK]:,} "
        f"({counts[record_names.TRAINABLE_PER_TASK_PCT]:.2f}% of the backbone), "
        f"stored {counts[record_names.STORED_PARAMS]:,} ({counts[record_names.STORED_PARAMS_PCT]:.2f}%)"
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
        if args.data_dir is None and not all(map(is_task_file, args.tasks.split(","))):
            raise UserError("--data-dir is required for a shipped task (or --spec FILE, a trial's specification)")
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
            data_dir=str(args.data_dir) if args.data_dir is not None else None,
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
        eval_splits=[record_names.SELECTION, record_names.DEV] if selection is not False else [record_names.DEV],
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
    check_model(config, spec.data.model, spec.data.max_length, args.export_peft)


def check_model(config, model: str, max_length: int | None = None, export_peft: bool = False) -> None:
    """The model before the data: its tokenizer files, ``max_length`` and the method's sizes against its shape
    (config.json alone), so a LoRA rank of 10**12 is refused here, not by the allocator after the data is read."""

    model_dir = resolve_model_dir(model)
    bert = read_config(model_dir)
    check_tokenizer_files(model_dir)  # whether its vocabulary fits the model: load_tokenizer, once the weights are read
    if max_length is not None:
        check_max_length(bert, max_length)
    if export_peft:
        checkpoint.check_peft_export(bert)
    try:
        methods.make_method_config(config.method, config.method_options_with_dropout()).check_backbone(bert)
    except UserError as error:
        raise UserError(f"--method {config.method} on --model {model}: {error}") from None


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
    shown = [k for k in metrics if k.endswith(("_accuracy", "_pearson"))] + [record_names.SCORE, "train_loss"]
    dev_score = record_names.split_metric(record_names.DEV, record_names.SCORE)
    shown += [dev_score] if dev_score in metrics else []  # judged on a selection split: dev beside it
    return (
        f"epoch {metrics[record_names.EPOCH]}: "
        + "  ".join(f"{k} {metrics[k]:.4f}" for k in shown)
        + f"  ({metrics['epoch_time_s']:.0f}s, {metrics['tokens_per_s']:.0f} tokens/s)"
    )
