"""Sweeps, as ``peftune sweep`` and ``jobs/*.py`` run them: the flags both share, the definition they spell, the
checks made before Ray (the spaces against the model, the tracking store, the test files, a resume's saved state,
the lease), the sweep and its final evaluation, and the exit status of the outcome.

Every refusal of bad input comes before Ray, Tune, MLflow and the report's libraries are imported (each import of
them is inside the function that needs it)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from peftune import methods
from peftune.base import record_names
from peftune.base.errors import UserError
from peftune.cli.common import (
    EXIT_FAILURES,
    EXIT_INTERRUPTED,
    EXIT_OK,
    Parser,
    ignore_further_interrupts,
    path_arg,
    run_command,
)
from peftune.inputs.backbone import DEFAULT_MODEL, check_max_length, read_config, resolve_model_dir
from peftune.record import stores
from peftune.sweep import lease, spaces

if TYPE_CHECKING:
    from peftune.sweep.orchestrator import SweepResult

log = logging.getLogger("peftune.cli.sweep_command")


EXIT_CODES_HELP = (
    "exit status: 0 completed (or completed_with_failures with --allow-failures); 2 bad input, nothing started; "
    "3 interrupted (run the same command again to resume); 4 some trials failed (completed_with_failures) "
    "or all did (failed)"
)


def add_arguments(parser, definition_default: str | None = None) -> None:
    """The sweep flags shared by ``jobs/*.py`` and ``peftune sweep``."""
    _add_what_runs(parser, definition_default)
    _add_where_kept(parser)
    _add_after_the_sweep(parser)


def _add_what_runs(parser, definition_default: str | None) -> None:
    """The definition, its budget and the overrides of what the sweep runs."""
    what = "a sweep definition: a name under search_spaces/ (sst_tuning, multitask_tuning, smoke) or a YAML file"
    if definition_default is None:  # `peftune sweep DEFINITION`
        parser.add_argument("definition", help=what)
    else:  # a job: its own definition unless told another ("": jobs/tuning.py, which has none of its own)
        default = definition_default or None
        parser.add_argument("--definition", default=default, required=default is None, help=f"{what} (default: "
                            f"{default or 'none'})")  # fmt: skip
    parser.add_argument(
        "--data-dir",
        type=path_arg,
        help="directory holding the task files (read by the driver only); not needed when every task is a task "
        "file whose data files lie beside it",
    )
    parser.add_argument(
        "--tasks",
        help="the tasks instead of the definition's: comma-separated shipped task names or task files (YAML; "
        "docs/guide.md, 'Your own task')",
    )
    parser.add_argument(
        "--smoke-test",
        action="store_true",
        help="the tiny 'smoke' budget: a few trials on a sliver of the data: the whole code path, not an answer",
    )
    parser.add_argument(
        "--budget", help="a budget preset of the definition (e.g. smoke, cpu, gpu; default: the definition's own)"
    )
    parser.add_argument("--trials-per-method", type=int, help="each method's trials (overrides the budget's)")
    parser.add_argument(
        "--model",
        type=path_arg,
        help=f"backbone: a local HF BERT, RoBERTa, DistilBERT or ELECTRA directory, a hub name or {DEFAULT_MODEL!r} "
        "(default: the definition's)",
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
        default=stores.DEFAULT_STORAGE_PATH,
        help="where Ray Tune keeps the sweep's state and checkpoints (a directory, or s3://... on a "
        f"multi-node cluster; default ./{stores.DEFAULT_STORAGE_PATH})",
    )
    parser.add_argument(
        "--optuna-storage",
        help="database URL of the per-method Optuna studies (default: optuna.db beside a SQLite MLflow store, "
        "else under --storage-path)",
    )
    parser.add_argument(
        "--reports-dir",
        type=path_arg,
        default=record_names.REPORTS_DIR,
        help=f"reports go to <dir>/<sweep>/ (default ./{record_names.REPORTS_DIR})",
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
    if getattr(args, "tasks", None):
        definition = definition.with_tasks(args.tasks.split(","))
    if args.data_dir is None and not definition.declarations:
        raise UserError("--data-dir is required: the sweep's tasks read their files from the data directory")
    overrides = {"trials_per_method": args.trials_per_method} if args.trials_per_method is not None else {}
    return definition.with_overrides(
        name=args.name,
        model=args.model,
        multi_objective=True if args.multi_objective else None,
        invalid_rows=getattr(args, "invalid_rows", None),
        **overrides,
    )


def check_spaces_against_model(definition: spaces.SweepDefinition) -> None:
    """Every value a method's search space can propose, against the model's shape (its config.json alone),
    before Ray: a top_k ``k`` above the backbone's layers or a rank above its width is refused here, naming the
    space's file and key, not by a trial after the cluster started."""
    bert = read_config(resolve_model_dir(definition.model))
    check_max_length(bert, definition.budget.max_length)
    for space in definition.spaces.values():
        for key, param in space.options.items():
            for value in spaces.proposed_values(param):
                try:
                    methods.make_method_config(space.method, {key: value}).check_backbone(bert)
                except UserError as error:
                    raise UserError(
                        f"{space.source}: options.{key}: {value!r} does not fit the model {definition.model} ({error})"
                    ) from None


def main_from_args(args) -> int:
    """Run the sweep the flags describe, and write its report when it has completed.

    Every refusal of bad input (flags, the definition, the data files, the model) comes before Ray, Tune,
    MLflow and the report's libraries are imported: together they take seconds to load (docs/benchmarks.md,
    "Small figures behind design choices"), which a one-line refusal should not wait for; and every refusal that
    does not depend on the data comes before the data is read and tokenized."""
    definition = definition_from_args(args)  # validated before anything starts
    check_spaces_against_model(definition)
    stores.check_tracking_uri(stores.resolve_tracking_uri(args.tracking_uri))
    test_dir = getattr(args, "test_dir", None)
    if test_dir is not None:
        check_test_args(test_dir, definition, args.test_seeds)
    storage = stores.storage_uri(args.storage_path)
    stores.check_storage_uri(storage)  # every refusal before any data is read
    check_resumable(bool(getattr(args, "resume", False)), definition.name, storage)
    lease.Lease(lease.lease_dir(storage), definition.name).check_free()
    prepared = spaces.prepare_data(definition, args.data_dir)
    from analysis.publish import on_sweep_finished
    from peftune.sweep import console

    _warn_relative_paths_in_job(args)
    verbose = getattr(args, "verbose", False)
    with contextlib.nullcontext() if verbose else console.slow_loop_warnings():
        result = _run_sweep(args, definition, prepared, verbose)
    if test_dir is not None and result.status in (record_names.COMPLETED, record_names.COMPLETED_WITH_FAILURES):
        final_evaluation(result, args, definition.invalid_rows, on_sweep_finished)
    ignore_further_interrupts()  # the records are closed: a late Ctrl-C must not turn the exit status into a lie
    print("\n" + result.summary(), flush=True)
    return exit_code(result.status, allow_failures=getattr(args, "allow_failures", False))


# the file of a sweep's Ray Tune state that ``Tuner.can_restore`` looks for under ``<storage>/<sweep>`` (Tune's
# ``tuner.pkl``; tests/test_resume_refusal.py checks the two agree)
TUNER_STATE = "tuner.pkl"


def check_resumable(resume: bool, name: str, storage: str) -> None:
    """``--resume`` of a sweep with no saved Ray Tune state is refused here, before the data is read and Ray is
    imported, as the sweep itself would refuse it (``orchestrator._check_resume``) only after both. An object-store URI
    is left to the sweep's check, which reaches the store through Ray."""
    if not resume or "://" in storage:
        return
    experiment_path = f"{storage.rstrip('/')}/{name}"
    if not (Path(experiment_path) / TUNER_STATE).is_file():
        raise UserError(f"nothing to resume: no Ray Tune state for sweep {name!r} at {experiment_path}")


def _run_sweep(args, definition: spaces.SweepDefinition, prepared, verbose: bool) -> SweepResult:
    from analysis.publish import on_sweep_finished
    from peftune.sweep import console, orchestrator

    return orchestrator.run_sweep(
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
        verbose=console.TUNE_TABLES if verbose else console.TUNE_QUIET,
        prepared=prepared,
    )


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


def exit_code(status: str, allow_failures: bool = False) -> int:
    """See :data:`EXIT_CODES_HELP`; ``allow_failures`` forgives some failed trials, never all."""
    if status == record_names.COMPLETED or (status == record_names.COMPLETED_WITH_FAILURES and allow_failures):
        return EXIT_OK
    return EXIT_INTERRUPTED if status == record_names.INTERRUPTED else EXIT_FAILURES


def job_main(definition: str, description: str, argv: list[str] | None = None) -> int:
    """What ``jobs/*.py`` run: parse the flags, run the sweep and its report, print where everything is.
    ``definition``: the job's own sweep definition (``--definition`` replaces it); "": ``--definition`` is required."""
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
        if value is not None and "://" not in str(value) and not Path(value).is_absolute()
    ]
    uri = stores.resolve_tracking_uri(args.tracking_uri)
    if args.tracking_uri is None and stores.sqlite_path(uri) is not None:
        relative.append("--tracking-uri")
    if relative:
        log.warning(
            "running as a Ray job in %s (a copy of the submitted working directory): %s resolve there; "
            "pass absolute paths to keep the results",
            os.getcwd(),
            ", ".join(relative),
        )
