"""A method's options back from the params a run logged: the one reader of ``method.<field>`` params.

The writer logs each option of a method config as an MLflow param ``method.<field>`` holding ``str(value)``
(lists comma-joined). The confirmation (``peftune.sweep.confirm``, re-training a search trial) and the final
evaluation (``analysis.evaluate``) both need those options back with the types the config declares.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping

from peftune.methods.base import get_method


def options_from_params(method: str, params: Mapping[str, str]) -> dict:
    """The ``method.<field>`` params of a run -> ``{field: value}`` typed as ``method``'s config declares.

    ``dropout`` is left out: it is a common hyperparameter, logged (and set) on its own.
    """
    config_cls = get_method(method).config_cls
    hints = typing.get_type_hints(config_cls)
    options = {}
    for field in dataclasses.fields(config_cls):
        key = f"method.{field.name}"
        if field.name != "dropout" and key in params:
            options[field.name] = option_from_param(str(params[key]), hints[field.name])
    return options


def option_from_param(text: str, hint):
    """One logged param (``str(value)``, lists comma-joined) -> the type ``hint`` (a config field's) declares."""
    if text == "None":
        return None
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    if typing.get_origin(hint) in (list, tuple):
        item = (typing.get_args(hint) or (str,))[0]
        return [option_from_param(part.strip(), item) for part in text.split(",") if part.strip()]
    if hint is bool:
        return text == "True"
    if hint is int:
        return int(float(text))  # a column with gaps reads 8 back as 8.0
    if hint is float:
        return float(text)
    return text
