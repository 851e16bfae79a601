"""``peftune`` command line: train | methods | bench | sweep | report | evaluate | schema | up | down.

Errors a user can act on (bad data rows, unknown methods or options, missing
models) print one line naming what is wrong and exit with status 2.

The entry points: ``main`` (the ``peftune`` script) and ``job_main`` (what ``jobs/*.py`` run, from
``peftune.cli.sweep_command``). ``peftune train`` is ``peftune.cli.train_command``, the sweep flags and
``peftune sweep`` are ``peftune.cli.sweep_command``, and what every command shares (argparse's types, the exit
statuses, running a command) is ``peftune.cli.common``; the small commands are here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

import torch
from pydantic import TypeAdapter

from peftune import methods
from peftune.base import record_names
from peftune.base.errors import UserError
from peftune.benchmarks import throughput
from peftune.cli import services
from peftune.cli.common import EXIT_OK, Parser, add_model_args, check_device, check_output_dir, path_arg, run_command
from peftune.cli.sweep_command import EXIT_CODES_HELP, add_arguments, job_main, main_from_args
from peftune.cli.train_command import add_train_parser
from peftune.core.model import MultitaskModel
from peftune.core.params import count_parameters
from peftune.inputs import tables, tasks
from peftune.inputs.backbone import BertConfig, BertModel, read_config, resolve_model_dir
from peftune.inputs.tasks import get_task, parse_tasks
from peftune.record import stores
from peftune.sweep import spaces

__all__ = ["build_parser", "job_main", "main"]  # job_main: jobs/*.py call cli.job_main


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    return run_command(f"peftune {args.command}", lambda: args.func(args), verbose=args.verbose)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="peftune", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (add_train_parser, add_methods_parser, add_sweep_parser, add_report_parser, add_evaluate_parser,
                add_bench_parser, add_services_parsers, add_schema_parser, add_decide_parser):  # fmt: skip
        add(sub)
    return parser


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


def add_sweep_parser(sub) -> None:
    p = sub.add_parser("sweep", help="run or resume a hyperparameter sweep (Ray Tune + Optuna, logged to MLflow)")
    add_arguments(p)
    p.epilog = EXIT_CODES_HELP
    p.set_defaults(func=cmd_sweep)


def cmd_sweep(args) -> int:
    return main_from_args(args)


def add_report_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sweep", required=True, help="the sweep's name (its MLflow experiment)")
    parser.add_argument(
        "--tracking-uri",
        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the working directory)",
    )
    parser.add_argument("--output", type=path_arg, help="report directory (default reports/<sweep>)")


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


def cmd_report(args) -> int:
    from analysis.publish import report_sweep
    from peftune.sweep.console import quiet_libraries

    quiet_libraries()  # no download bar per artifact read
    args.tracking_uri = stores.existing_store_uri(args.tracking_uri)
    if args.output:  # an existing file, or a directory that cannot be written: refused before any work
        check_output_dir("--output", Path(args.output))

    report = report_sweep(
        args.sweep, args.tracking_uri, args.output, reference=args.reference, log_artifacts=args.log_artifacts
    )
    print(f"sweep {args.sweep}: {report.sweep.status_summary()}")
    print(f"report: {report.directory}/report.html ({len(report.files)} files; summary in report.md)")
    if args.log_artifacts:
        print(f"logged under report/ in MLflow run {report.sweep.parent_run_id} ({report.sweep.tracking_uri})")
    return 0


def add_evaluate_parser(sub) -> None:
    p = sub.add_parser(
        "evaluate", help="re-train the dev frontier with several seeds and score it on a held-out labelled test split"
    )
    add_report_args(p)
    p.add_argument(
        "--data-dir",
        type=path_arg,
        help="the directory the sweep's data files are in (they are checked against the record's hashes); for a "
        "declared task, the folder holding its files: the record keeps its declaration, not where it lay",
    )
    p.add_argument(
        "--test-dir",
        type=path_arg,
        help="directory holding the labelled test files (ids-sst-test.csv, quora-test.csv, sts-test.csv: dev's "
        "format; for a declared task, the folder holding its `test` file or its one split file); without it, dev only",
    )
    p.add_argument(
        "--answer",
        action="store_true",
        help="evaluate each budget's pick, its best and the best of the others (does the answer transfer?) instead "
        "of the frontier",
    )
    p.add_argument("--epochs", type=int, help="train each configuration this many epochs (default: as it was)")
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
    p.add_argument(
        "--invalid-rows",
        choices=["raise", "skip"],
        help="as for train (default: the sweep's own, its definition's invalid_rows)",
    )
    p.add_argument("--device", default="auto", help="auto (CUDA if present, else CPU), cpu, cuda, cuda:1...")
    p.set_defaults(func=cmd_evaluate)


def cmd_evaluate(args) -> int:
    from analysis.evaluate import evaluate_sweep, mean_std_table
    from peftune.sweep.console import quiet_libraries

    quiet_libraries()  # no download bar per artifact read
    args.tracking_uri = stores.existing_store_uri(args.tracking_uri)
    if args.output:  # an existing file, or a directory that cannot be written: refused before any work
        check_output_dir("--output", Path(args.output))
    check_device(args.device)

    evaluation = evaluate_sweep(
        args.sweep,
        args.data_dir,
        args.test_dir,
        seeds=args.seeds,
        top=args.top,
        answer=args.answer,
        epochs=args.epochs,
        tracking_uri=args.tracking_uri,
        output=args.output,
        device=args.device,
        restore_checkpoints=args.restore_checkpoints,
        invalid_rows=args.invalid_rows,
    )
    metrics = [record_names.SCORE, *evaluation.sweep.task_metrics]
    print(mean_std_table(evaluation.summary, metrics).to_string(index=False))
    print(f"evaluation: {evaluation.directory}/evaluation.md (logged under report/evaluation/ in the parent run)")
    return 0


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
    p.add_argument(
        "--pack", nargs="?", const="2,4,8", metavar="K,...", help="instead: packed training (peftune.core.pack) of K "
        "members against the same K run one after another, for each K (alone: 2,4,8; with --profile: a step's time "
        "per op category, packed against solo, at the largest K)"
    )  # fmt: skip
    p.add_argument("--pack-methods", default=",".join(throughput.PACK_METHODS), help="the methods --pack measures")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    throughput.main(args, check_device(args.device))
    return 0


def add_services_parsers(sub) -> None:
    p = sub.add_parser("up", help="start (or reuse) a local Ray head and MLflow server, both on 127.0.0.1")
    services.add_arguments(p, starting=True)
    p.set_defaults(func=services.cmd_up)
    p = sub.add_parser("down", help="stop the Ray head and MLflow server that `peftune up` started on these ports")
    services.add_arguments(p, starting=False)
    p.set_defaults(func=services.cmd_down)


def add_schema_parser(sub) -> None:
    p = sub.add_parser("schema", help="print the JSON Schema of a sweep definition (for an editor's YAML checks)")
    p.add_argument("--task", action="store_true", help="a task file's schema instead (docs/guide.md, 'Your own task')")
    p.add_argument("--output", type=Path, help="write it to this file instead of standard output")
    p.set_defaults(func=cmd_schema)


def cmd_schema(args) -> int:
    """The sweep definition's (or a task file's) JSON Schema, e.g. for the YAML language server:
    ``# yaml-language-server: $schema=``."""
    model = tasks.TaskFile if args.task else spaces.SweepFile
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **TypeAdapter(model).json_schema()}
    text = json.dumps(schema, indent=2) + "\n"
    if args.output is None:
        sys.stdout.write(text)
    else:
        check_output_dir("--output", args.output.parent)
        args.output.write_text(text, encoding="utf-8")
    return EXIT_OK


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
    p.add_argument(
        "--simulate",
        type=int,
        help="instead: N simulations of each scenario's claim rates at each budget's size (with --predictions and "
        "--configurations: that record's components, sizes and seed sds; else the README job's components)",
    )
    p.add_argument("--sizes", type=int, nargs="+", help="with --simulate: the family sizes K (default: the budgets')")
    p.add_argument("--max-seeds", type=int, help="with --simulate: the plan's max_seeds (default: the definition's)")
    p.add_argument(
        "--seed-sds",
        type=float,
        nargs=2,
        metavar=("CHEAPEST", "OTHERS"),
        help="with --simulate: the seed sd of a score of the cheapest configuration and of the others (default: the "
        "record's largest and pooled, else 0.03 and the README job's)",
    )
    p.add_argument(
        "--scenarios", nargs="+", help="with --simulate: which of boundary, half, two, equal, power (default: all)"
    )
    p.add_argument("--simulation-seed", type=int, default=0, help="with --simulate: the random seed (default 0)")
    p.set_defaults(func=cmd_decide)


def read_table(path, what: str, columns):
    """A CSV (or Parquet, by extension) with at least ``columns``; UserError naming the file otherwise."""
    import pandas as pd

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: {what} file not found" if not path.exists() else f"{path}: is not a file")
    try:
        frame = tables.parquet_frame(path.read_bytes()) if path.suffix == ".parquet" else pd.read_csv(path)
    except Exception as error:  # noqa: BLE001 -- pandas' parsers raise many kinds: one line names the file
        raise UserError(f"{path}: cannot be read as {what} ({str(error).splitlines()[0][:120]})") from None
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise UserError(f"{path}: {what} lacks the column(s) {missing}; expected {list(columns)}")
    return frame


def configurations_from_frame(frame, source) -> list:
    """``--configurations`` of ``peftune decide``: one row per configuration (config, method, trainable_pct,
    default); UserError naming the file and line otherwise."""
    import math

    import pandas as pd

    from peftune.stats.decisions import Configuration

    out = []
    for line, r in zip(range(2, len(frame) + 2), frame.itertuples(index=False), strict=True):
        pct = pd.to_numeric(pd.Series([r.trainable_pct]), errors="coerce").iloc[0]
        if not (isinstance(pct, float) and math.isfinite(pct) and pct >= 0):
            raise UserError(f"{source}: line {line}: trainable_pct {r.trainable_pct!r}, expected a number >= 0")
        default = str(r.default).strip().lower()
        if default not in ("true", "false", "1", "0"):
            raise UserError(f"{source}: line {line}: default {r.default!r}, expected true or false")
        out.append(Configuration(str(r.config), str(r.method), float(pct), default in ("true", "1")))
    names = [c.name for c in out]
    if len(set(names)) != len(names):
        raise UserError(f"{source}: configuration {sorted({n for n in names if names.count(n) > 1})[0]!r} is "
                        "listed twice; expected one row per configuration")  # fmt: skip
    return out


def _decision_record(args, definition):
    """(values, configurations) of ``--predictions`` and ``--configurations``."""
    from peftune.stats import decisions

    kinds = {task: get_task(task).kind for task in definition.tasks}
    frame = read_table(args.predictions, "predictions", decisions.PREDICTION_COLUMNS)
    if "split" in frame:
        frame = frame[frame["split"].astype(str) == decisions.DECISION]
    table = read_table(args.configurations, "configurations", ("config", "method", "trainable_pct", "default"))
    configurations = configurations_from_frame(table, args.configurations)
    try:
        values = decisions.values_from_frame(frame, kinds)
    except ValueError as error:
        raise UserError(f"{args.predictions}: {error}") from None
    unknown = sorted(set(values) - {c.name for c in configurations})
    if unknown:
        raise UserError(f"{args.predictions}: configuration(s) {unknown[:3]} not in {args.configurations}")
    return values, configurations


def _budget_sizes(definition, budgets, configurations=None) -> list[int]:
    """The family size K of each budget: the record's configurations under it, else as many as the definition's
    confirmation can put under it (its contenders per budget and the anchors)."""
    if configurations is not None:
        return [sum(c.trainable_pct <= b for c in configurations) for b in budgets]
    settings = definition.confirm
    per_budget = settings.contenders * len(budgets) + 2 * settings.anchors if settings.contenders else 0
    return [max(2, min(len(definition.methods) * max(settings.top_k, 1), per_budget or len(definition.methods)))]


def cmd_decide(args) -> int:
    """Replay a confirmation's decisions from a predictions file (see ``peftune.stats.decisions``), or simulate the
    procedure's claim rates (``peftune.stats.simulate.scenario_rates``)."""
    from peftune.stats import decisions
    from peftune.sweep import confirm

    definition = spaces.load_sweep(spaces.resolve_sweep_path(args.definition), budget=args.budget)
    plan = dataclasses.replace(confirm.plan_of(definition.confirm), budgets=tuple(args.budgets))
    if args.simulate is not None:
        return _simulate(args, definition, plan)
    if not (args.predictions and args.configurations and args.output):
        raise UserError("peftune decide: expected --predictions, --configurations and --output (or --simulate N)")
    output = Path(args.output)
    check_output_dir("--output", output)
    values, configurations = _decision_record(args, definition)
    outcome = decisions.replay(values, configurations, plan)
    output.mkdir(parents=True, exist_ok=True)
    decisions.pair_table(outcome).to_csv(output / "decisions.csv", index=False)
    decisions.recommendation_table(outcome).to_csv(output / "recommendation.csv", index=False)
    decisions.seeds_table(outcome).to_csv(output / "seeds.csv", index=False)
    for a in outcome.answers:
        print(f"<= {a.budget:g}%: {decisions.said(a)}: pick {a.pick} (best {a.best}) {a.needs}".rstrip())
        if a.plan:
            print(f"<= {a.budget:g}% plan (first look): {a.plan}")
    print(f"looks {outcome.looks}, stopped: {outcome.stopped or 'wants more seeds'}; files in {output}")
    return 0


def _simulate(args, definition, plan) -> int:
    from peftune.stats import simulate

    if args.simulate < 1 or args.simulate > 100_000:
        raise UserError(f"--simulate {args.simulate}: expected a number of simulations from 1 to 100000")
    scenarios = args.scenarios or list(simulate.SCENARIOS)
    unknown = sorted(set(scenarios) - set(simulate.SCENARIOS))
    if unknown:
        raise UserError(f"--scenarios {unknown[0]}: expected some of {', '.join(simulate.SCENARIOS)}")
    if args.sizes and min(args.sizes) < 2:
        raise UserError(f"--sizes {min(args.sizes)}: expected family sizes of 2 or more")
    if args.max_seeds is not None:
        if not plan.seeds <= args.max_seeds <= 100:
            raise UserError(f"--max-seeds {args.max_seeds}: expected a number from confirm.seeds ({plan.seeds}) to 100")
        plan = dataclasses.replace(plan, max_seeds=args.max_seeds)
    cheap, others = simulate.CHEAP_SD, None
    if args.predictions or args.configurations:
        if not (args.predictions and args.configurations):
            raise UserError("peftune decide --simulate: expected both --predictions and --configurations, or neither")
        values, configurations = _decision_record(args, definition)
        world = simulate.Measured.from_values(values)
        if world is None:
            raise UserError(f"{args.predictions}: no configuration has 2 seeds: no seed variance to simulate from")
        sds = simulate.seed_sds(values)
        cheap = max(world.seed_sd, max(sds.values(), default=0.0))
        sizes = args.sizes or _budget_sizes(definition, plan.budgets, configurations)
    else:
        examples = definition.budget.decision_examples or 2000
        world = simulate.reference_world(definition.tasks, examples)
        sizes = args.sizes or _budget_sizes(definition, plan.budgets)
    if args.seed_sds is not None:
        if min(args.seed_sds) < 0 or max(args.seed_sds) > 1:
            raise UserError(f"--seed-sds {args.seed_sds}: expected two seed sds from 0 to 1 (score units)")
        cheap, others = args.seed_sds
    lines = simulate.operating_characteristics(plan, world, sizes, args.simulate, cheap_sd=cheap, others_sd=others,
                                               seed=args.simulation_seed, only=scenarios)  # fmt: skip
    for line in lines:
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
