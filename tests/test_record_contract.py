"""The record's names are spelled in one place, ``peftune.base.record_names`` (issue 31): a tag, status or metric name,
or the hyperparameters every method has, written out again elsewhere could drift from what the writer writes and the
reader reads. Every other module of the library, the analysis and the jobs uses the names from there."""

from __future__ import annotations

import ast
from pathlib import Path

from peftune.base import record_names
from peftune.record import epoch_kept

ROOT = Path(__file__).resolve().parents[1]
SOURCES = (ROOT / "platform" / "peftune", ROOT / "analysis", ROOT / "jobs")
CONTRACT = ROOT / "platform" / "peftune" / "base" / "record_names.py"


def constants() -> dict[str, str]:
    """The names no module but ``peftune.base.record_names`` may spell: value -> the constant that holds it.

    Not among them (yet): ``score`` and the task metrics, a column of nearly every table of the analysis, and words
    of the record that are also ordinary words of the code (the splits, the phases, ``trial``, ``report``)."""
    names = {
        value: key
        for key, value in vars(record_names).items()
        if key.isupper() and isinstance(value, str) and value.startswith(("peftune.", "mlflow."))
    }  # the tags
    statuses = ("COMPLETED", "EARLY_STOPPED", "FAILED", "DIVERGED", "UNFINISHED", "PARTIAL")
    statuses += ("COMPLETED_WITH_FAILURES", "INTERRUPTED")
    names.update({getattr(record_names, key): key for key in statuses})
    names.update({record_names.BEST_SCORE: "BEST_SCORE", record_names.BEST_EPOCH: "BEST_EPOCH"})
    names.update({name: "COUNT_METRICS" for name in record_names.COUNT_METRICS})
    names.update({name: "split_metric_names" for name in record_names.split_metric_names([])})
    return names


def sources() -> list[Path]:
    return sorted(path for root in SOURCES for path in root.rglob("*.py") if path != CONTRACT)


def docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstrings' nodes: prose may name the record's names."""
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, kinds) and node.body and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }  # fmt: skip


def loggers(tree: ast.AST) -> set[int]:
    """The ids of the loggers' names (``logging.getLogger("peftune.sweep")``): a module's name, not a tag."""
    calls = (node for node in ast.walk(tree) if isinstance(node, ast.Call))
    return {id(arg) for call in calls if getattr(call.func, "attr", None) == "getLogger" for arg in call.args}


def spelled_out(path: Path, names: dict[str, str]) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    prose = docstrings(tree) | loggers(tree)
    return [
        f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r} (record_names.{names[node.value]})"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
        and id(node) not in prose
    ]  # fmt: skip


def hyperparameters_spelled_out(path: Path) -> list[str]:
    """A tuple, list, set or dict of exactly the common hyperparameters (``record_names.HYPERPARAMETERS``)."""
    wanted = set(record_names.HYPERPARAMETERS)
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
        if not isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)) or not items:
            continue
        values = {item.value for item in items if isinstance(item, ast.Constant)}
        if values == wanted and len(items) == len(wanted):
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {sorted(values)} (record_names.HYPERPARAMETERS)")
    return out


def test_the_scan_finds_a_spelled_out_name(tmp_path):
    """The scan itself: a status, a tag and the hyperparameters written out are found; prose is not."""
    module = tmp_path / "module.py"
    module.write_text(
        '"""Sets peftune.method and the status diverged."""\n'
        'STATUS = "diverged"\n'
        'TAGS = {"peftune.method": "lora"}\n'
        'COMMON = ("lr", "dropout", "weight_decay")\n'
    )
    names = constants()
    global ROOT
    root, ROOT = ROOT, tmp_path
    try:
        found = spelled_out(module, names) + hyperparameters_spelled_out(module)
    finally:
        ROOT = root
    assert [line.split(": ")[1] for line in found] == ["'diverged' (record_names.DIVERGED)", "'peftune.method' "
                                                       "(record_names.METHOD)", "['dropout', 'lr', 'weight_decay'] "
                                                       "(record_names.HYPERPARAMETERS)"]  # fmt: skip


def test_record_names_are_spelled_only_in_record():
    names = constants()
    assert {"peftune.method", "diverged", "partial", "best_epoch", "dev_score", "stored_params_pct"} <= set(names)
    found = [line for path in sources() for line in spelled_out(path, names) + hyperparameters_spelled_out(path)]
    assert not found, "use the names of peftune.base.record_names instead:\n" + "\n".join(found)


def test_best_epoch_is_the_earliest_best():
    assert epoch_kept.best_epoch({}) is None
    assert epoch_kept.best_epoch({3: 0.5, 1: 0.7, 2: 0.7}) == 1
    assert epoch_kept.best_epoch({1: 0.2, 2: 0.9, 3: 0.1}) == 2
    assert not epoch_kept.improves(0.7, 0.7) and epoch_kept.improves(0.71, 0.7)


def test_a_task_metric_reads_back_with_underscores_in_the_task():
    for task, metric in (("sst", "accuracy"), ("my_task", "pearson"), ("a_b_c", "accuracy")):
        assert record_names.metric_task(record_names.task_metric(task, metric)) == (task, metric)
