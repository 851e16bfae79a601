"""A sweep saved before the modules moved into folders resumes: the names Tune pickled then (``peftune.search``,
``peftune.record.trial_name``) read as the modules and attributes they are now, while the sweep runs, and only
then."""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest

from peftune.base import record_names
from peftune.record import legacy
from peftune.sweep import orchestrator, resume, search


def resolved(module: str, name: str) -> object:
    """``module.name`` found as an unpickler finds a class or function Tune's state holds by reference: the module
    imported by its name, then the attribute (no pickle is loaded here)."""
    return getattr(importlib.import_module(module), name)


def test_a_sweep_saved_before_the_move_reads_its_old_names_while_it_resumes():
    with pytest.raises(ModuleNotFoundError):
        resolved("peftune.search", "RunLinks")
    with pytest.raises(AttributeError):
        resolved("peftune.record", "trial_name")

    back = resume.old_names(legacy.MOVED_MODULES)
    try:
        assert resolved("peftune.search", "RunLinks") is search.RunLinks
        assert search.__spec__.name == "peftune.sweep.search"  # the module keeps its own name and spec
        assert resolved("peftune.resume", "RunCallbacks") is resume.RunCallbacks
        assert resolved("peftune.record", "trial_name") is record_names.trial_name  # a package now
        assert resolved("peftune.sweep", "SweepHooks") is orchestrator.SweepHooks
        from peftune.sweep import console  # the package's own modules stay themselves

        assert console.__name__ == "peftune.sweep.console"
    finally:
        back()

    with pytest.raises(ModuleNotFoundError):
        resolved("peftune.search", "RunLinks")
    with pytest.raises(AttributeError):
        resolved("peftune.record", "trial_name")
    assert "peftune.search" not in sys.modules and not hasattr(sys.modules["peftune"], "search")


def test_every_moved_module_is_where_its_entry_says():
    for old, new in legacy.MOVED_MODULES.items():
        assert importlib.util.find_spec(new) is not None, f"{old} -> {new}: no such module"
        assert old not in sys.modules or sys.modules[old].__name__ == old, old
