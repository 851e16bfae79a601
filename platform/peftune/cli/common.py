"""What every command of ``peftune`` (and ``jobs/*.py``) shares: the exit statuses, argparse's types and a
parser whose refusals are one line, the checks made before any work (an output directory, a device), and
running a command (a user error is one line and status 2; an interrupt or SIGTERM, status 3)."""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from peftune.base.errors import DiskFullError, UserError, disk_full, one_line, user_errors
from peftune.core import train
from peftune.inputs.backbone import DEFAULT_MODEL
from peftune.sweep.stopping import sigterm_received, stopped

EXIT_OK, EXIT_USER_ERROR, EXIT_INTERRUPTED, EXIT_FAILURES = 0, 2, 3, 4


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
        help=f"an HF BERT, RoBERTa, DistilBERT or ELECTRA: a local directory, a hub name, or {DEFAULT_MODEL!r} "
        "(packaged, offline; the default)",
    )


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

    Midway through ``ray.shutdown()``, well before it returns, Ray's core worker puts SIGTERM back to the default
    action, whatever Python had set (docs/benchmarks.md, "Small figures behind design choices"): a second SIGTERM
    then (``ray job stop`` twice) killed the driver, status 143. So Ray shuts down in a thread while this one, the
    only one that may set signal handlers, keeps SIGTERM ignored."""
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


def ignore_further_interrupts() -> None:
    """The command is ending, its records closed (Ray shuts down at exit): Ctrl-C and SIGTERM from now on are
    ignored. A second SIGTERM (``ray job stop`` twice) during Ray's shutdown met Ray's core worker rather than
    Python's handler and killed the driver (status 143) instead of its documented exit 3."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
