"""The errors a user can act on, and how the command line prints them.

Only these (and the operating system's errors about files and connections) become a one-line
message with exit status 2: anything else is a bug, and shows its traceback with exit status 1.
The classes also derive from the built-in error a caller would expect (``ValueError`` for a bad
value, ``KeyError`` for an unknown name), so ``except ValueError`` keeps working.
"""

from __future__ import annotations


class PeftuneError(Exception):
    """Base of every error peftune raises about its input or environment (not about itself)."""


class UserError(PeftuneError, ValueError):
    """A bad value: a flag, a file, a key of a definition, a store; the message says which and what was expected."""


class UnknownNameError(PeftuneError, KeyError):
    """An unknown method, task or other registered name; the message lists the valid ones."""

    def __str__(self) -> str:  # KeyError's own str() quotes the message
        return str(self.args[0]) if self.args else ""


class StoreError(UserError):
    """A tracking store that refuses or cannot be reached (MLflow's error, named and kept as the cause)."""


def user_errors() -> tuple[type[BaseException], ...]:
    """What a user's input or environment raises, as opposed to a bug: one line, exit 2."""
    return (PeftuneError, OSError)


def one_line(error: BaseException, limit: int = 500) -> str:
    """The error's message on one line, at most ``limit`` characters."""
    message = " ".join(str(error).split()) or type(error).__name__
    return message if len(message) <= limit else message[: limit - 3] + "..."
