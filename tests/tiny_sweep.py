"""A sweep definition on disk for the Ray tests: method spaces under ``methods/`` and the sweep's YAML."""

from __future__ import annotations

import textwrap
from pathlib import Path

from peftune.sweep import spaces


def write_definition(directory: Path, name: str, method_spaces: dict[str, str], sweep: str, **fields):
    """Write ``method_spaces`` (method -> YAML) and ``sweep`` (YAML formatted with ``name`` and ``fields``) into
    ``directory``; return the loaded, validated definition."""
    (directory / "methods").mkdir(parents=True, exist_ok=True)
    for method, text in method_spaces.items():
        (directory / "methods" / f"{method}.yaml").write_text(textwrap.dedent(text))
    path = directory / f"{name}.yaml"
    path.write_text(textwrap.dedent(sweep).format(name=name, **fields))
    return spaces.load_sweep(path)


# two small methods for the Ray tests' sweeps: frozen (searched lr and dropout) and top_k (searched lr, wd and k)
FROZEN_AND_TOP_K = {
    "frozen": """\
        method: frozen
        lr: {low: 1.0e-4, high: 1.0e-2, log: true}
        dropout: {low: 0.0, high: 0.3}
        weight_decay: 0.0
    """,
    "top_k": """\
        method: top_k
        lr: {low: 2.0e-4, high: 1.0e-3, log: true}
        dropout: 0.1
        weight_decay: {low: 0.0, high: 0.1}
        options:
          k: {choices: [1, 2]}
    """,
}
