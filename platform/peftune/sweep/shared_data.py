"""The sweep's prepared data inside a Ray worker, and the memory a finished trial leaves behind.

The driver puts the ``PreparedData`` (weights and tokenized data) in Ray's object store once
(:class:`SharedData`); each worker process fetches it once (:func:`worker_prepared`), whoever trains on it
(``peftune.sweep.worker``'s trials, ``peftune.sweep.packing``'s packs), and gives back what a finished trial freed
(:func:`release_freed_memory`). Below both, so that neither imports the other for it.
"""

from __future__ import annotations

import ctypes
import gc
from dataclasses import dataclass
from typing import Any

import ray

from peftune.inputs import tasks


@dataclass(frozen=True)
class SharedData:
    """The sweep's ``PreparedData`` in Ray's object store, passed to trials by reference.

    Wrapped, because Tune resolves a bare object ref among a trainable's parameters for every trial.
    """

    ref: Any  # ray.ObjectRef


# this worker process's copy of the sweep's prepared data: {object ref hex: PreparedData}, one entry
_PREPARED: dict[str, Any] = {}


def worker_prepared(prepared):
    """The prepared data behind ``prepared`` (a SharedData), fetched from the object store once per process.

    Tune hands a reused worker its parameters again for every trial: fetched per trial, the weights and data
    would be copied and deserialized again each time. A worker keeps one copy, of the sweep it runs now.
    Anything else (a ``PreparedData`` passed directly) is returned as it is.
    """
    if not isinstance(prepared, SharedData):
        return prepared
    key = prepared.ref.hex()
    if key not in _PREPARED:
        _PREPARED.clear()
        _PREPARED[key] = ray.get(prepared.ref)
        for spec in getattr(_PREPARED[key], "specs", ()):  # a user's task is known here only by its data
            tasks.declare(spec)
    return _PREPARED[key]


def release_freed_memory() -> None:
    """Give the heap's free pages back to the OS (glibc's ``malloc_trim``; a no-op elsewhere).

    Tune runs each trial of a reused worker in a new thread, and glibc gives threads their own malloc
    arenas: what a finished trial freed stays in its arena, unused by the next trial's thread, and a
    worker's memory grows trial after trial until Ray's OOM killer ends the sweep. Trimmed after each
    trial, a worker stays at about one trial's size.
    """
    gc.collect()  # a trial's model in a reference cycle (an epoch's clock, a traceback's frames) is freed only here
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): its allocator returns memory its own way
        pass
