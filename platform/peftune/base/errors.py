"""The errors a user can act on, and how the command line prints them.

Only these (and the operating system's errors about files and connections) become a one-line
message with exit status 2: anything else is a bug, and shows its traceback with exit status 1.
The classes also derive from the built-in error a caller would expect (``ValueError`` for a bad
value, ``KeyError`` for an unknown name), so ``except ValueError`` keeps working.
"""

from __future__ import annotations

import errno
from pathlib import Path


class PeftuneError(Exception):
    """Base of every error peftune raises about its input or environment (not about itself)."""


class UserError(PeftuneError, ValueError):
    """A bad value: a flag, a file, a key of a definition, a store; the message says which and what was expected."""


class UnknownNameError(PeftuneError, KeyError):
    """An unknown method, task or other registered name; the message lists the valid ones."""

    def __str__(self) -> str:  # KeyError's own str() quotes the message
        return str(self.args[0]) if self.args else ""


class RecordError(UserError):
    """A sweep's record that is not what its version says: a version tag this peftune did not write, or a piece a
    record of its version always holds missing (a record that lost a piece, not an old one); names the run."""


class StoreError(UserError):
    """A tracking store that refuses or cannot be reached (MLflow's error, named and kept as the cause)."""


class DiskFullError(PeftuneError):
    """A write that failed for lack of space (a checkpoint, Tune's state, the tracking store, a pending write).

    Not bad input: the sweep stops as interrupted (its runs closed as such where the store can still take it,
    exit status 3) and the same command resumes it once space is freed. ``path`` is where the write went;
    ``needed`` the bytes it asked for, where known."""

    def __init__(self, path: str | Path | None, needed: int | None = None):
        self.path, self.needed = (str(path) if path is not None else None), needed
        where = f"writing {self.path}" if self.path else "writing the sweep's files"
        size = f" (needs {needed:,} bytes more)" if needed else ""
        super().__init__(
            f"no space left on the device {where}{size}; the sweep is interrupted: free space there and run "
            f"the same command again to resume it"
        )


# errno of a write refused for space: the device is full, or the user's quota is
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


def no_space(error: BaseException | None) -> BaseException | None:
    """The error in ``error``'s chain (its causes and contexts) that says a write had no space, or None.

    Several layers wrap it before it reaches the driver: Tune (``TuneError`` from the failed run), MLflow
    (``MlflowException`` over SQLAlchemy over sqlite3, whose ``SQLITE_FULL`` carries no errno)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, DiskFullError):
            return error
        if isinstance(error, OSError) and error.errno in NO_SPACE:
            return error
        if getattr(error, "sqlite_errorname", None) == "SQLITE_FULL":
            return error
        error = error.__cause__ or error.__context__
    return None


def disk_full(error: BaseException, path: str | Path | None = None) -> DiskFullError | None:
    """``error`` as a ``DiskFullError`` naming the file the operating system named, else ``path`` (a database's
    refusal names none), or None when nothing in its chain is a write refused for space."""
    found = no_space(error)
    if found is None or isinstance(found, DiskFullError):
        return found
    named = getattr(found, "filename", None) if isinstance(found, OSError) else None
    return DiskFullError(named if named is not None else path)


def user_errors() -> tuple[type[BaseException], ...]:
    """What a user's input or environment raises, as opposed to a bug: one line, exit 2."""
    return (PeftuneError, OSError)


def one_line(error: BaseException, limit: int = 500) -> str:
    """The error's message on one line, at most ``limit`` characters."""
    message = " ".join(str(error).split()) or type(error).__name__
    return message if len(message) <= limit else message[: limit - 3] + "..."
