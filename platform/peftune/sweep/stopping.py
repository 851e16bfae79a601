"""Whether the driver was told to stop: Ctrl-C, or SIGTERM (``ray job stop``, a cluster manager).

The state lives here, in a module with no heavy imports, so the command line can tell a stopped sweep
(exit 3, resumable) from a bug without loading Ray to ask.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass

_SIGTERMS: list[int] = []  # the SIGTERMs this driver received


def note_sigterm() -> None:
    """Note SIGTERM before the handler ``ray.init`` set turns it into ``SystemExit``: an error raised while that
    exit unwinds through Tune can take its place (``ray job stop`` during a confirmation once closed the sweep as
    failed), and a stopped driver must still close its sweep as interrupted. Only the main thread may do this."""
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or getattr(previous, "notes_sigterm", False):
        return

    def noted(signum, frame):
        _SIGTERMS.append(signum)
        if callable(previous):
            previous(signum, frame)
        raise SystemExit(signum)

    noted.notes_sigterm = True
    signal.signal(signal.SIGTERM, noted)


def sigterm_received() -> bool:
    """Whether this driver was sent SIGTERM (``ray job stop``) since Ray started in it."""
    return bool(_SIGTERMS)


def stopped(error: BaseException) -> bool:
    """Whether ``error`` is the driver being stopped: Ctrl-C, or SIGTERM (``ray job stop``; Ray's driver turns it
    into ``SystemExit``), whatever was raised after it. A stopped sweep is interrupted, not failed: running it
    again resumes it."""
    if isinstance(error, KeyboardInterrupt) or sigterm_received():
        return True
    return isinstance(error, SystemExit) and error.code == signal.SIGTERM


@dataclass
class TuneCtrlC:
    """Whether the Ctrl-C that stops a sweep came while Tune's ``fit`` held it (``ctrl_c_through_tune``)."""

    pressed: bool = False


@contextlib.contextmanager
def ctrl_c_through_tune() -> Iterator[TuneCtrlC]:
    """Around a ``Tuner.fit()``: whether Tune took a Ctrl-C, and Ctrl-C the driver's own again afterwards.

    Tune takes the first Ctrl-C of a fit for a graceful stop: it puts back the handler it found and returns as a
    finished run does. A Ctrl-C that came once the trials were done left no trace, and the sweep went on to its
    confirmation. A fit that saw none leaves Tune's handler installed: the next Ctrl-C (in the confirmation, the
    report) did nothing. Tune's handler having put back the one found before the fit is how its Ctrl-C shows
    (``signal.getsignal``); with ``TUNE_DISABLE_SIGINT_HANDLER`` set, or off the main thread, Tune installs none and
    Ctrl-C raises ``KeyboardInterrupt`` in the fit."""
    noted = TuneCtrlC()
    if threading.current_thread() is not threading.main_thread() or os.environ.get(
        "TUNE_DISABLE_SIGINT_HANDLER", "0"
    ) not in ("", "0"):
        yield noted
        return
    before = signal.getsignal(signal.SIGINT)
    try:
        yield noted
        noted.pressed = signal.getsignal(signal.SIGINT) is before
    finally:
        signal.signal(signal.SIGINT, before)
