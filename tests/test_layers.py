"""Every module of the package sits in a folder, and in a layer of an import-linter contract, so ``lint-imports`` sees
every arrow: a module left out of the layers can import upwards (an import circle) without the contract noticing.
The first contract's layers are peftune's folders; each folder's own contract layers that folder's modules."""

from __future__ import annotations

import ast
import re

import pytest

from conftest import REPO

tomllib = pytest.importorskip("tomllib")  # Python 3.11's; on 3.10 the contract is checked by lint-imports alone

PACKAGE = REPO / "platform" / "peftune"


def layered_modules() -> dict[str, list[str]]:
    """The modules named in the layers contracts, by the package they sit in: ``peftune`` -> its folders, a folder
    -> its modules (``peftune.sweep.orchestrator``, ...); a module named twice is listed twice."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    by_package: dict[str, list[str]] = {}
    for contract in config["tool"]["importlinter"]["contracts"]:
        if contract["type"] != "layers":
            continue
        for name in (n.strip() for layer in contract["layers"] for n in re.split(r"[|:]", layer)):
            if name.startswith("peftune."):
                by_package.setdefault(name.rsplit(".", 1)[0], []).append(name)
    return by_package


def packages() -> dict[str, object]:
    """``peftune`` and every package under it (a folder with ``__init__.py``), dotted -> its directory."""
    found = {"peftune": PACKAGE}
    for init in PACKAGE.rglob("*/__init__.py"):
        found[".".join(("peftune", *init.parent.relative_to(PACKAGE).parts))] = init.parent
    return found


def package_modules(dotted: str, directory) -> set[str]:
    """The modules directly in a package: its .py files and its subpackages (a folder with ``__init__.py``)."""
    files = {f"{dotted}.{p.stem}" for p in directory.glob("*.py") if p.stem != "__init__"}
    return files | {f"{dotted}.{p.parent.name}" for p in directory.glob("*/__init__.py")}


def test_every_module_sits_in_a_folder():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules at the top of peftune, in no folder (a folder is a layer): {loose}"


@pytest.mark.parametrize("package", sorted(packages()))
def test_every_module_of_the_package_is_in_one_layer(package):
    modules = package_modules(package, packages()[package])
    layered = layered_modules().get(package, [])
    missing = sorted(modules - set(layered))
    assert not missing, f"modules of {package} in no layer of pyproject.toml's import-linter contracts: {missing}"
    stale = sorted(set(layered) - modules)
    assert not stale, f"layers naming modules of {package} that do not exist: {stale}"
    twice = sorted({m for m in layered if layered.count(m) > 1})
    assert not twice, f"modules in two layers: {twice}"


def test_every_layered_package_exists():
    stale = sorted(set(layered_modules()) - set(packages()))
    assert not stale, f"layers naming modules of packages that do not exist: {stale}"


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
