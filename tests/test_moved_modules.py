"""A sweep saved before the modules moved into folders resumes: the names Tune pickled then (``peftune.search``,
``peftune.record.trial_name``) read as the modules and attributes they are now, while the sweep runs, and only
then."""

from __future__ import annotations

import importlib.util
import pickle
import sys

import pytest
from ray import cloudpickle

from peftune.base import record_names
from peftune.record import legacy
from peftune.sweep import orchestrator, resume, search


def pickled(module: str, name: str) -> bytes:
    """A pickle of ``module.name`` by reference (protocol 0's GLOBAL), as Tune's state holds a class or function."""
    return f"c{module}\n{name}\n.".encode()


def test_a_sweep_saved_before_the_move_reads_its_old_names_while_it_resumes():
    with pytest.raises(ModuleNotFoundError):
        pickle.loads(pickled("peftune.search", "RunLinks"))
    with pytest.raises(AttributeError):
        pickle.loads(pickled("peftune.record", "trial_name"))

    back = resume.old_names(legacy.MOVED_MODULES)
    try:
        assert pickle.loads(pickled("peftune.search", "RunLinks")) is search.RunLinks
        assert search.__spec__.name == "peftune.sweep.search"  # the module keeps its own name and spec
        assert cloudpickle.loads(pickled("peftune.resume", "RunCallbacks")) is resume.RunCallbacks
        assert pickle.loads(pickled("peftune.record", "trial_name")) is record_names.trial_name  # a package now
        assert pickle.loads(pickled("peftune.sweep", "SweepHooks")) is orchestrator.SweepHooks
        from peftune.sweep import console  # the package's own modules stay themselves

        assert console.__name__ == "peftune.sweep.console"
    finally:
        back()

    with pytest.raises(ModuleNotFoundError):
        pickle.loads(pickled("peftune.search", "RunLinks"))
    with pytest.raises(AttributeError):
        pickle.loads(pickled("peftune.record", "trial_name"))
    assert "peftune.search" not in sys.modules and not hasattr(sys.modules["peftune"], "search")


def test_every_moved_module_is_where_its_entry_says():
    for old, new in legacy.MOVED_MODULES.items():
        assert importlib.util.find_spec(new) is not None, f"{old} -> {new}: no such module"
        assert old not in sys.modules or sys.modules[old].__name__ == old, old
