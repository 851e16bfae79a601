"""What a restored sweep needs from this run, through Ray Tune's public interfaces only.

- ``RunCallbacks``: ``Tuner.restore`` brings back the callbacks pickled when the sweep started; this one holds
  none and forwards every hook to the callbacks of the sweep running in this process (``installed``).
- ``keep_good_state`` / ``repair_state``: Tune copies its state files to the storage path in place, so a full
  disk can cut one off and Tune would start the experiment again; the complete files are copied beside them
  (``<file>.good``) at each save and put back before a resume (the cut ones kept as ``<file>.set-aside``).
- ``old_names``: the modules' old names, which a state saved by an earlier version pickled, readable again.
- ``CheckpointPruner``: Tune's ``num_to_keep`` forces a save of the whole experiment's state after every
  checkpoint; instead Tune keeps every checkpoint and saves on its own period, and the pruner deletes a trial's
  checkpoint once no saved state can name it (kept: its latest, its best, and the latest as of each of the last
  two saves).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import io
import json
import logging
import os
import pickletools
import re
import sys
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.fs
from ray import tune

from peftune.base.errors import no_space
from peftune.record.epoch_kept import improves

log = logging.getLogger("peftune.sweep.resume")

# the files of Tune's state in an experiment directory, ``<kind>-<session>.<json|pkl>`` (the CKPT_FILE_TMPL of
# TuneController, SearchGenerator, BasicVariantGenerator, Searcher and CallbackList)
KINDS = "experiment_state|search_gen_state|basic-variant-state|searcher-state|callback-states"
STATE_FILE = re.compile(rf"^({KINDS})-(?P<session>.+)\.(json|pkl)$")
GOOD, ASIDE = ".good", ".set-aside"

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

    def get_state(self):
        """Tune asks for it each time it saves the experiment's state, after it wrote the trials' state and before
        it copies the new state over the old at the storage path. Nothing to save itself: it tells the installed
        ``SaveHook`` callbacks."""
        for hook in [callback for callback in _CURRENT if isinstance(callback, SaveHook)]:
            hook.on_state_save()
        return None


class SaveHook(tune.Callback):
    """A callback told each time Tune saves the experiment's state (``on_state_save``). Given to Tune itself,
    Tune's ``get_state`` call tells it; installed behind a ``RunCallbacks``, the forwarder does."""

    def get_state(self):
        self.on_state_save()
        return None  # nothing of its own to save

    def on_state_save(self) -> None:
        raise NotImplementedError


class GoodState(SaveHook):
    """Installed among a run's callbacks (its hooks do nothing): keeps the complete state files of
    ``experiment_path`` (a local directory; object stores replace a file whole) each time Tune saves its state."""

    def __init__(self, experiment_path: str):
        self.directory = None if "://" in experiment_path else Path(experiment_path)

    def on_state_save(self) -> None:
        self.keep()

    def keep(self) -> None:
        if self.directory is None:
            return
        try:
            keep_good_state(self.directory)
        except OSError as error:
            if no_space(error) is not None:
                raise  # into Tune's save: the sweep stops on it, as on any write refused for space
            # a copy not made costs only a fallback; it must not stop a sweep (Tune's sync may be replacing a file)
            log.warning("could not copy Ray Tune's state in %s: %s", self.directory, error)


@dataclass
class _TrialCheckpoints:
    """One trial's checkpoints still on disk, as the pruner tracks them (oldest first)."""

    kept: list = field(default_factory=list)  # the checkpoints still on disk
    best: object = None  # the checkpoint of the best score so far (the earliest on a tie)
    best_score: float | None = None
    saved: deque = field(default_factory=lambda: deque(maxlen=2))  # the latest checkpoint at each of the last 2 saves
    ended_at: int | None = None  # the save count when the trial ended

    @property
    def latest(self):
        return self.kept[-1] if self.kept else None

    def needed(self) -> list:
        return [self.best, self.latest, *self.saved]


class CheckpointPruner(SaveHook):
    """Deletes a trial's checkpoints that nothing can read any more. Kept: the trial's latest (a retry restores
    it), its best by ``score`` (``epoch_kept.improves``: the earliest on a tie; the sweep logs it to MLflow), and the
    latest as of each of the last two saves of Tune's state (a resume restores a trial from the state at the
    storage path, which is the last save's, or the one before while Tune still copies it). ``score=None``: no
    best is kept (the confirmation's runs keep their predictions in the record, not in a checkpoint).

    Only the checkpoints reported while it runs are known to it: a resumed sweep's older ones stay."""

    def __init__(self, score: str | None):
        self.score = score
        self.trials: dict[str, _TrialCheckpoints] = {}
        self.saves = 0

    def on_checkpoint(self, iteration, trials, trial, checkpoint, **info):
        # Tune processes a result before the checkpoint it carries: the trial's last result is that epoch's
        state = self.trials.setdefault(trial.trial_id, _TrialCheckpoints())
        score = trial.last_result.get(self.score) if self.score else None
        state.kept.append(checkpoint)
        if self.score and score is not None and (state.best is None or improves(score, state.best_score)):
            state.best, state.best_score = checkpoint, score
        self._prune(state)

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._ended(trial)

    def on_trial_error(self, iteration, trials, trial, **info):
        self._ended(trial)

    def _ended(self, trial) -> None:
        state = self.trials.get(trial.trial_id)
        if state is not None and state.ended_at is None:
            state.ended_at = self.saves

    def on_state_save(self) -> None:
        self.saves += 1
        for trial_id, state in list(self.trials.items()):
            state.saved.append(state.latest)
            self._prune(state)
            if state.ended_at is not None and self.saves - state.ended_at >= 2:
                del self.trials[trial_id]  # both states a resume may read have it ended: nothing changes any more

    def _prune(self, state: _TrialCheckpoints) -> None:
        needed = {id(checkpoint) for checkpoint in state.needed()}
        stale = [checkpoint for checkpoint in state.kept if id(checkpoint) not in needed]
        state.kept = [checkpoint for checkpoint in state.kept if id(checkpoint) in needed]
        for checkpoint in stale:
            delete_checkpoint(checkpoint)


def delete_checkpoint(checkpoint) -> None:
    """Delete a ``tune.Checkpoint``'s directory from its filesystem (local or an object store); one already gone
    (Tune's own ``num_to_keep`` in a sweep begun before the pruner) is fine."""
    try:
        checkpoint.filesystem.delete_dir(checkpoint.path)
    except FileNotFoundError:
        pass
    except OSError as error:  # a checkpoint left on disk costs space, not a result
        log.warning("could not delete the superseded checkpoint %s: %s", checkpoint.path, error)


def checkpoint_exists(checkpoint) -> bool:
    """Whether a ``tune.Checkpoint`` Tune still lists is on its filesystem (the pruner may have deleted it)."""
    return checkpoint.filesystem.get_file_info(checkpoint.path).type != pyarrow.fs.FileType.NotFound


def state_files(directory: Path) -> dict[str, list[Path]]:
    """Tune's state files in ``directory`` by session."""
    sessions: dict[str, list[Path]] = {}
    for path in sorted(directory.iterdir()) if directory.is_dir() else ():
        match = STATE_FILE.match(path.name)
        if match and path.is_file():
            sessions.setdefault(match["session"], []).append(path)
    return sessions


def complete(path: Path) -> bool:
    """Whether a state file was written to its end: JSON that parses, or a pickle whose opcodes reach STOP (walked,
    not run: nothing is unpickled here). The name does not tell which: Tune pickles ``search_gen_state-*.json``,
    and peftune's searcher writes JSON to ``searcher-state-*.pkl``."""
    try:
        data = path.read_bytes()
    except OSError:
        return False
    try:
        json.loads(data)
        return True
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        pass
    try:
        for _ in pickletools.genops(io.BytesIO(data)):
            pass
    except ValueError:  # a cut pickle, or not a pickle
        return False
    return bool(data)


def keep_good_state(directory: Path) -> None:
    """Copy a session's state files of ``directory`` to ``<file>.good`` (temporary file, then rename) when all of
    them are complete: the copies stay one save's set (the searcher's state with the trials'). A session with an
    incomplete file keeps its last copies. A copy refused for space raises (the sweep stops on it)."""
    for paths in state_files(directory).values():
        if not all(complete(path) for path in paths):
            continue
        for path in paths:
            good = path.with_name(path.name + GOOD)
            data = path.read_bytes()
            if good.is_file() and good.read_bytes() == data:
                continue
            temporary = good.with_name(f".{good.name}.{os.getpid()}.tmp")
            try:
                temporary.write_bytes(data)
                os.replace(temporary, good)
            finally:
                temporary.unlink(missing_ok=True)


def repair_state(directory: Path) -> list[Path]:
    """Before a resume: each session whose state files are not all complete gets its good copies back (the
    files set aside as ``<file>.set-aside``); without complete copies, its incomplete files are set
    aside all the same (Tune then reads an earlier session's state). Returns the files set aside."""
    aside = []
    for session, paths in state_files(directory).items():
        if all(complete(path) for path in paths):
            continue
        goods = {path: path.with_name(path.name + GOOD) for path in paths}
        usable = all(good.is_file() and complete(good) for good in goods.values())
        for path, good in goods.items():
            if complete(path) and not usable:
                continue
            os.replace(path, path.with_name(path.name + ASIDE))
            aside.append(path)
            if usable:
                os.replace(good, path)
        log.warning(
            "Ray Tune's state of session %s in %s was cut off (a disk full?): %s; set aside as *%s",
            session, directory, "its previous complete state is restored" if usable else "no complete copy of it "
            "was kept, so Tune resumes from an earlier session's", ASIDE,
        )  # fmt: skip
    return aside


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


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """An old module name (``search`` at the package's top) imports the module where it lives now (in ``sweep/``)."""

    def __init__(self, moved: Mapping[str, str]):
        self.moved = moved
        self.specs = {}  # the modules' own specs, which the import system overwrites with the alias's

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in self.moved else None

    def create_module(self, spec):
        module = importlib.import_module(self.moved[spec.name])
        self.specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = self.specs[module.__name__]  # it ran when imported under its own name: nothing to run


def old_names(moved: Mapping[str, str]) -> Callable[[], None]:
    """The names a sweep saved by an earlier version pickled (old module -> new, ``legacy.MOVED_MODULES``)
    readable while this process restores it: an old module's name imports the module where it lives now, and an
    old module whose name is a package now (the sweep's, once the orchestrator's module) gives that module's
    attributes through the package. Returns what takes the old names away again."""
    finder = _MovedModules(moved)
    sys.meta_path.append(finder)  # last: asked only for a name no module has now
    hooked = []
    for old, new in moved.items():
        spec = importlib.util.find_spec(old) if old.rsplit(".", 1)[0] in sys.modules else None
        if spec is not None and spec.loader is not finder and spec.submodule_search_locations is not None:
            package = importlib.import_module(old)
            if "__getattr__" not in vars(package):
                package.__getattr__ = _attributes_of(new)
                hooked.append(package)

    def back() -> None:
        sys.meta_path.remove(finder)
        for package in hooked:
            del package.__getattr__
        for old in moved:
            module = sys.modules.get(old)
            if module is not None and module.__name__ != old:  # an old name given to a module of another name
                del sys.modules[old]
                parent, _, name = old.rpartition(".")
                if getattr(sys.modules.get(parent), name, None) is module:
                    delattr(sys.modules[parent], name)

    return back


def _attributes_of(module: str) -> Callable[[str], object]:
    def attribute(name: str) -> object:
        return getattr(importlib.import_module(module), name)

    return attribute
