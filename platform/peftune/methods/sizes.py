"""A method's size as the papers' tables write it (``lora r=8``, ``adapter m=64``): one labelling for the
MLflow run names (``peftune.record.writer``) and the report's tables (``analysis.runs``), from the registry's
``size_symbols`` of each method."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from peftune.base.errors import UnknownNameError
from peftune.methods.base import get_method


def size_fields(method: str) -> tuple[str, ...]:
    """The config fields that make a method's size, as its label shows them (LoRA's rank, then the bottleneck,
    for lora_adapter); none for a method the registry does not know (a record written by another version)."""
    try:
        return tuple(get_method(method).size_symbols)
    except UnknownNameError:
        return ()


def size_field(method: str) -> str | None:
    """The config field a sweep searches as the method's size (what orders its sizes); None without one."""
    try:
        return get_method(method).size_field
    except UnknownNameError:
        return None


def size_label(method: str, params: Mapping[str, Any]) -> str:
    """``r=8``, ``m=64``, ``r=8 m=64`` (lora_adapter), ``l=10``; empty for methods without a size (full, bitfit...).

    ``params``: a run's params, the method's options as ``method.<field>`` (``method.rank``).
    """
    parts = []
    for name in size_fields(method):
        value = params.get(f"method.{name}")
        if value is not None:
            parts.append(f"{get_method(method).size_symbols[name]}={_format_number(value)}")
    return " ".join(parts)


def _format_number(value) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)
