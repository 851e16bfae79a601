"""Every module of the package sits in a layer of the import-linter contract, so ``lint-imports`` sees every arrow:
a module left out of the layers can import upwards (an import circle) without the contract noticing."""

from __future__ import annotations

import re

import pytest

from conftest import REPO

tomllib = pytest.importorskip("tomllib")  # Python 3.11's; on 3.10 the contract is checked by lint-imports alone

CONTRACT = "layers point down"


def layered_modules() -> list[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["name"].startswith(CONTRACT)]
    return [name.strip() for layer in contract["layers"] for name in re.split(r"[|:]", layer)]


def package_modules() -> set[str]:
    """The modules directly in ``peftune``: its .py files and its subpackages (a folder with ``__init__.py``)."""
    root = REPO / "platform" / "peftune"
    files = {f"peftune.{p.stem}" for p in root.glob("*.py") if p.stem != "__init__"}
    return files | {f"peftune.{p.parent.name}" for p in root.glob("*/__init__.py")}


def test_every_module_of_the_package_is_in_one_layer():
    layered = layered_modules()
    missing = sorted(package_modules() - set(layered))
    assert not missing, f"modules in no layer of pyproject.toml's import-linter contract: {missing}"
    stale = sorted(m for m in layered if m.startswith("peftune.") and m not in package_modules())
    assert not stale, f"layers naming modules that do not exist: {stale}"
    assert len(layered) == len(set(layered)), "a module is in two layers"
