"""Every module of the package sits in a layer of the import-linter contract, so ``lint-imports`` sees every arrow:
a module left out of the layers can import upwards (an import circle) without the contract noticing."""

from __future__ import annotations

import ast
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


# the record's two sides: the only modules of peftune and analysis that import MLflow (docs/design.md, "The MLflow
# record"); every other module reads and writes the record through them
MLFLOW_MODULES = {"peftune.record.reader", "peftune.record.writer"}


def imported_roots(path) -> set[str]:
    """The top-level package of every module ``path`` imports, wherever in the module the import is (a function's
    deferred import too); relative imports are the project's own."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_only_the_reader_and_the_writer_import_mlflow():
    modules = {}
    for package, root in (("peftune", REPO / "platform" / "peftune"), ("analysis", REPO / "analysis")):
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join((package, *parts))
            modules[name.removesuffix(".__init__")] = path
    assert MLFLOW_MODULES <= set(modules), "the reader or the writer is missing"
    importing = sorted(name for name, path in modules.items() if "mlflow" in imported_roots(path))
    assert set(importing) == MLFLOW_MODULES, f"modules importing mlflow (only the reader and writer may): {importing}"
