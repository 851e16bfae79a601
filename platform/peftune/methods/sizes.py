"""A method's size as the papers' tables write it (``lora r=8``, ``adapter m=64``): one labelling for the
MLflow run names (``peftune.tracking``) and the report's tables (``analysis.runs``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from peftune.methods.base import get_method

# Short symbols of the size fields (lora r=8, adapter m=64, prefix l=10, top_k k=2)
SIZE_SYMBOLS = {"rank": "r", "bottleneck": "m", "prefix_length": "l", "prompt_length": "l", "k": "k"}
# sizes shown before the registry's size field: LoRA + adapters has a rank and a bottleneck
EXTRA_SIZE_FIELDS = {"lora_adapter": ("rank",)}


def size_fields(method: str) -> tuple[str, ...]:
    """The config fields that make a method's size: the registry's ``size_field`` (+ LoRA's rank for lora_adapter)."""
    try:
        spec = get_method(method)
    except KeyError:
        return ()
    return EXTRA_SIZE_FIELDS.get(method, ()) + ((spec.size_field,) if spec.size_field else ())


def size_label(method: str, params: Mapping[str, Any]) -> str:
    """``r=8``, ``m=64``, ``r=8 m=64`` (lora_adapter), ``l=10``; empty for methods without a size (full, bitfit...).

    ``params``: a run's params, the method's options as ``method.<field>`` (``method.rank``).
    """
    parts = []
    for name in size_fields(method):
        value = params.get(f"method.{name}")
        if value is not None:
            parts.append(f"{SIZE_SYMBOLS.get(name, name)}={_format_number(value)}")
    return " ".join(parts)


def _format_number(value) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)
