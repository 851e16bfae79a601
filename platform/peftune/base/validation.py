"""A user's YAML file, read and validated: the hardened loader, the rules' vocabulary, one-line errors.

The loader is a safe one (a file never names code to import) that also refuses duplicate keys (YAML says
they are an error; PyYAML keeps the last), aliases (a few nested ones expand to gigabytes) and files over
:data:`MAX_BYTES`, reads ``1e-4`` as a float (YAML 1.1 wants ``1.0e-4``), refuses YAML 1.1's octal ``010``
and base-60 ``1:30`` (numbers the user did not write), and reports a broken file as one line with its line
and column. The models of the files (``peftune.sweep.spaces``) are pydantic dataclasses built from the types
here: strict scalars, finite numbers, intervals (:class:`Bound`), names among a registry (:func:`one_of`)
and sections that refuse unknown keys (:class:`Section`). Under :func:`named`, pydantic's first error
becomes one :class:`SpaceError` line naming the file, the key path and what was expected.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
import reprlib
from pathlib import Path
from typing import Annotated, Any, NoReturn

import yaml
from pydantic import (
    AfterValidator,
    AllowInfNan,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic.dataclasses import dataclass
from pydantic_core import PydanticCustomError

from peftune.base.errors import UserError, one_line

MAX_SHOWN = 80  # characters of a user's value echoed in an error message
MAX_BYTES = 1_000_000  # a sweep definition is a few kilobytes: anything near this is not one
MAX_DEPTH = 64  # nesting a YAML file may have (the shipped ones: 4); far below where Python's recursion gives out


class SpaceError(UserError):
    """A search space or sweep file is invalid: names the file, the key and what was expected."""

    def __init__(self, path: str | Path, key: str | None, problem: str):
        self.path, self.key, self.problem = str(path), key, problem
        # bounded and on one line whatever the input: keys and problems may quote a user's file
        key, problem = one_line(key, MAX_SHOWN) if key else key, one_line(problem, 4 * MAX_SHOWN)
        super().__init__(f"{path}: {key}: {problem}" if key else f"{path}: {problem}")

    def __reduce__(self):
        return SpaceError, (self.path, self.key, self.problem)


_REPR = reprlib.Repr()  # walks at most a few levels and items: cheap even on a huge nested value
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, MAX_SHOWN, MAX_SHOWN


def show(value) -> str:
    """``repr(value)`` cut to MAX_SHOWN characters: an error message never echoes an unbounded value."""
    return one_line(_REPR.repr(value), MAX_SHOWN)


# ----------------------------------------------------------------------------- the YAML loader


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses aliases and duplicate keys, and reads ``1e-4`` as a float."""

    depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, f"aliases are not allowed (*{one_line(event.anchor, MAX_SHOWN)})", event.start_mark
            )
        # composing is recursive: 3,000 levels ran out of Python's stack (a RecursionError, with no line)
        if self.depth >= MAX_DEPTH:
            raise yaml.composer.ComposerError(
                None, None, f"nested too deep (more than {MAX_DEPTH} levels)", self.peek_event().start_mark
            )
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: the base class names it
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {show(key)}", key_node.start_mark)
        return super().construct_mapping(node, deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)

# YAML 1.1 numbers a reader of YAML 1.2 (or of the file) would not see: ``010`` (octal 8) and ``1:30`` (base 60: 90)
_YAML_1_1_ONLY = re.compile(r"[-+]?(?:0[0-7_]+|[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?)")


def _number(construct):
    """``construct`` (PyYAML's int or float) refusing a YAML 1.1-only form, with its line, rather than reading it
    as a number the user did not write."""

    def checked(loader, node):
        if _YAML_1_1_ONLY.fullmatch(node.value):
            kind = "a base-60 number" if ":" in node.value else "an octal number"
            raise yaml.constructor.ConstructorError(
                None, None, f"{show(node.value)} reads as {kind} ({construct(loader, node)}) in YAML 1.1; write the "
                "number in plain decimals, or quote it for text", node.start_mark,
            )  # fmt: skip
        return construct(loader, node)

    return checked


_Loader.add_constructor("tag:yaml.org,2002:int", _number(yaml.SafeLoader.construct_yaml_int))
_Loader.add_constructor("tag:yaml.org,2002:float", _number(yaml.SafeLoader.construct_yaml_float))


def yaml_value(text: str, what: str):
    """One value written in YAML's flow style (a flag's ``KEY=VALUE``), read by the files' loader; ``what`` names it
    in the one-line :class:`UserError` a broken value raises."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as error:
        problem = (error.problem or error.context) if isinstance(error, yaml.MarkedYAMLError) else error
        raise UserError(f"{what} {show(text)}: not a valid value ({one_line(problem, 2 * MAX_SHOWN)})") from None


def read_yaml(path: str | Path) -> dict:
    """The mapping a YAML file holds; anything else (no file, broken YAML, a list) is a :class:`SpaceError`."""
    path = Path(path)
    if path.is_dir():
        raise SpaceError(path, None, "is a directory; expected a YAML file")
    if not path.is_file():
        raise SpaceError(path, None, "file not found")
    if path.stat().st_size > MAX_BYTES:
        raise SpaceError(path, None, f"{path.stat().st_size:,} bytes; expected a YAML file of at most {MAX_BYTES:,}")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)  # a SafeLoader: no Python objects
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise SpaceError(path, None, f"not valid YAML: {where}{error.problem or error.context}") from None
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError) as error:
        raise SpaceError(path, None, f"not valid YAML: {type(error).__name__}: {error}") from None
    if data is None:  # no document, or only comments
        raise SpaceError(path, None, "the file is empty; expected a YAML mapping (key: value lines)")
    if not isinstance(data, dict):
        raise SpaceError(path, None, f"expected a mapping at the top level, got {type(data).__name__}")
    return data


# ----------------------------------------------------------------------------- errors: one line, file and key


def fail(message: str, *loc) -> NoReturn:
    """A problem ``loc`` below where validation is, as pydantic's own kind of error (pydantic adds the rest)."""
    raise PydanticCustomError("peftune", "{message}", {"message": message, "loc": loc})


_EXPECTED = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false", "string_type": "text",
             "dict_type": "a mapping", "dataclass_type": "a mapping", "list_type": "a list", "tuple_type": "a list",
             "finite_number": "a finite number"}  # fmt: skip
_WORDS = {"missing": "missing", "missing_argument": "missing", "unexpected_keyword_argument": "unknown key"}


def _problem(error: ValidationError | PydanticCustomError) -> tuple[tuple, str]:
    """(location, what was expected) of pydantic's first error, or of :func:`fail`'s."""
    if isinstance(error, PydanticCustomError):
        first = {"loc": (), "ctx": error.context, "type": "peftune", "msg": error.message()}
    else:
        first = error.errors(include_url=False)[0]
    loc = (*first["loc"], *(first.get("ctx") or {}).get("loc", ()))
    if first["type"] not in _EXPECTED:
        return loc, _WORDS.get(first["type"], first["msg"])
    return loc, f"expected {_EXPECTED[first['type']]}, got {_got(first['input'])}"


def key_path(loc: tuple) -> str:
    """pydantic's location -> the key path a user reads: ``budgets.cpu.epochs``, ``tasks[1]``, ``budgets.1``."""
    key = "".join(f"[{p}]" if isinstance(p, int) and loc[i + 1 : i + 2] != ("[key]",) else f".{p}"
                  for i, p in enumerate(loc) if p != "[key]")  # fmt: skip
    return key.lstrip(".")


def _got(value) -> str:
    """What a user wrote: a quoted number is named a string, not shown as a number."""
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            float(value)
            return f"a string, {show(value)} (write a number without quotes)"
    return show(value)


def at(loc: tuple, function, *args, **kwargs):
    """``function(...)``, its first problem located ``loc`` below where validation is."""
    try:
        return function(*args, **kwargs)
    except (ValidationError, PydanticCustomError) as error:
        inner, message = _problem(error)
        fail(message, *loc, *inner)


@contextlib.contextmanager
def named(path):
    """The first problem in this block -> one SpaceError naming the file, the key path and what was expected."""
    try:
        yield
    except (ValidationError, PydanticCustomError) as error:
        loc, message = _problem(error)
        raise SpaceError(path, key_path(loc) or None, message) from None


# ----------------------------------------------------------------------------- the rules' vocabulary


def _inherited_descriptions(schema: dict, cls: type) -> None:
    """pydantic reads a field's docstring in the field's own class only: a key a section inherits takes the
    description the section that declares it gives it."""
    for key, prop in schema.get("properties", {}).items():
        for base in cls.__mro__[1:]:
            field = vars(base).get("__pydantic_fields__", {}).get(key)
            if "description" not in prop and field is not None and field.description:
                prop["description"] = field.description


# each key's meaning is the docstring under its field: the JSON Schema's description (`peftune schema`, the docs)
CONFIG = ConfigDict(
    extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True, json_schema_extra=_inherited_descriptions
)
section = functools.partial(dataclass, frozen=True, config=CONFIG)  # a validated dataclass: `@section()`
Float = Annotated[float, Strict(), AllowInfNan(False)]  # an integer is a float too (1 -> 1.0); a bool is not
EMPTY = BeforeValidator(lambda value: {} if value is None else value)  # `search:` alone: the section's defaults


def rule(ok, message: str, before: bool = False):
    """A check of a value: ``message`` (``{}``: the value, cut short) when ``ok(value)`` is false."""

    def check(value):
        if not ok(value):
            fail(message.format(show(value)))
        return value

    return BeforeValidator(check) if before else AfterValidator(check)


# a strict value of a config field of this type (from its default); None: any value (a float among them finite)
_FINITE = rule(lambda v: not isinstance(v, float) or math.isfinite(v), "expected a finite number, got {}")
SCALARS = {int: StrictInt, float: Float, bool: StrictBool, str: StrictStr, None: Annotated[Any, _FINITE]}


@dataclasses.dataclass(frozen=True)
class Bound:
    """The interval a number lies in, written once: its check, its message, its JSON Schema."""

    low: float
    high: float | None = None
    why: str = ""
    low_open: bool = False
    high_open: bool = False

    def check(self, value, integer: bool = False):
        above = self.high is not None and (value >= self.high if self.high_open else value > self.high)
        if above or (value <= self.low if self.low_open else value < self.low):
            why = f" ({self.why})" if self.why else ""
            fail(f"out of range: expected {'an integer' if integer else 'a number'} {self.where(integer)}{why}, "
                 f"got {show(value)}")  # fmt: skip
        return value

    def where(self, integer: bool = False) -> str:
        """``>= 1``, ``from 1 to 1,000``, ``in (0, 10]``."""
        low = f"{self.low:,}" if integer else f"{self.low:g}"
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {low}"
        if integer:
            return f"from {low} to {self.high:,}"
        return f"in {'(' if self.low_open else '['}{low}, {self.high:g}{')' if self.high_open else ']'}"

    def annotated(self, integer: bool = True):
        """The type of a value in this interval (an integer by default), with its JSON Schema."""
        schema = {"type": "integer" if integer else "number"}
        schema["exclusiveMinimum" if self.low_open else "minimum"] = self.low
        if self.high is not None:
            schema["exclusiveMaximum" if self.high_open else "maximum"] = self.high
        check = AfterValidator(lambda value: self.check(value, integer))
        return Annotated[StrictInt if integer else Float, check, WithJsonSchema(schema)]


def checked(owner: str, key: str, bound: Bound, value, integer: bool = False):
    """``bound.check`` outside a model of a file (``TrainConfig``, a method config): a UserError ``owner.key: ...``.
    A bool is no number here (``True`` is no count of 1), nor a float an integer."""
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise UserError(f"{owner}.{key}: expected {'an integer' if integer else 'a number'}, got {show(value)}")
    try:
        return bound.check(value, integer)
    except PydanticCustomError as error:
        raise UserError(f"{owner}.{key}: {error.message()}") from None


def count(low: int, high: int | None = None, why: str = ""):
    """An integer >= ``low`` (and <= ``high``, for the reason ``why``)."""
    return Bound(low, high, why).annotated()


def one_of(names, what: str = ""):
    """A string among ``names``, which the JSON Schema lists (an editor completes them); ``what`` they name.

    ``names``: the names, or a function that returns them (a registry's, read when a value is checked: a method
    registered after this module's import is valid)."""
    current = names if callable(names) else (lambda fixed=tuple(names): fixed)

    def check(value):
        if value not in current():
            listed = ", ".join(current())
            fail(f"unknown {what} {show(value)}; expected one of {listed}" if what else
                 f"expected one of {listed}, got {show(value)}")  # fmt: skip
        return value

    return Annotated[StrictStr, AfterValidator(check), _NamesSchema(current)]


@dataclasses.dataclass(frozen=True)
class _NamesSchema:
    """The JSON Schema of :func:`one_of`: ``enum``, the names as they are when the schema is written."""

    names: Any

    def __get_pydantic_json_schema__(self, core_schema, handler):
        return {"type": "string", "enum": list(self.names())}


def names_of(what: str, valid):
    """A non-empty list of distinct names among ``valid`` (tasks, methods)."""
    listed = rule(lambda v: isinstance(v, list) and v, f"expected a non-empty list of {what} names, got {{}}", True)
    distinct = rule(lambda v: len(set(v)) == len(v), f"a {what} is listed twice in {{}}")
    return Annotated[list[one_of(valid, what)], listed, distinct, Field(json_schema_extra={"minItems": 1})]


@section()
class Section:
    """A mapping of known keys: an unknown one is refused, naming those it knows."""

    @classmethod
    def renamed_keys(cls) -> dict[str, str]:
        """Keys the section no longer takes -> what replaces them: a pointer, not the list of known keys (a
        method, not a class attribute: dataclasses list an annotated one among the keys)."""
        return {}

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any):
        for key in data if isinstance(data, dict) else ():
            if key in cls.renamed_keys():
                fail(cls.renamed_keys()[key], key)
            if key not in cls.__dataclass_fields__:
                fail(f"unknown key; expected one of {', '.join(cls.__dataclass_fields__)}", key)
        return data
