"""What a restored sweep needs from this run, through Ray Tune's public interfaces only.

``tune.Tuner.restore`` brings back the callbacks pickled when the sweep started, and offers no
public way to hand it new ones. The sweep therefore gives Tune one ``RunCallbacks``, which holds
no callback itself: it forwards every hook to the callbacks of the sweep running in this process
(``installed``). The copy Tune unpickles on a restore forwards to this run's tracking logger (it
knows this run's MLflow client) and to this run's own hooks, and a hook given for one run (a test's
interrupter, a progress bar) does not come back in the next.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

from ray import tune

# the callbacks of the sweep running in this process (one sweep at a time per driver process)
_CURRENT: list = []

HOOKS = (
    "setup",
    "on_step_begin",
    "on_step_end",
    "on_trial_start",
    "on_trial_restore",
    "on_trial_save",
    "on_trial_result",
    "on_trial_complete",
    "on_trial_recover",
    "on_trial_error",
    "on_checkpoint",
    "on_experiment_end",
)


class RunCallbacks(tune.Callback):
    """Forwards Tune's callback hooks to the callbacks installed for the running sweep."""


def _forward(name: str):
    def hook(self, *args, **kwargs):
        for callback in list(_CURRENT):
            getattr(callback, name)(*args, **kwargs)

    hook.__name__ = name
    return hook


for _name in HOOKS:
    setattr(RunCallbacks, _name, _forward(_name))


@contextmanager
def installed(callbacks: Sequence):
    """Make ``callbacks`` the ones every ``RunCallbacks`` forwards to, for the duration of a run."""
    if _CURRENT:
        raise RuntimeError("a sweep is already running in this process")
    _CURRENT[:] = list(callbacks)
    try:
        yield
    finally:
        _CURRENT.clear()
