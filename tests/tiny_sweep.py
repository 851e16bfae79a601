"""A sweep definition on disk for the Ray tests: method spaces under ``methods/`` and the sweep's YAML."""

from __future__ import annotations

import textwrap
from pathlib import Path

from peftune import spaces


def write_definition(directory: Path, name: str, method_spaces: dict[str, str], sweep: str, **fields):
    """Write ``method_spaces`` (method -> YAML) and ``sweep`` (YAML formatted with ``name`` and ``fields``) into
    ``directory``; return the loaded, validated definition."""
    (directory / "methods").mkdir(parents=True, exist_ok=True)
    for method, text in method_spaces.items():
        (directory / "methods" / f"{method}.yaml").write_text(textwrap.dedent(text))
    path = directory / f"{name}.yaml"
    path.write_text(textwrap.dedent(sweep).format(name=name, **fields))
    return spaces.load_sweep(path)
