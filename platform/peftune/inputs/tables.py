"""A task's data file -> validated rows -> labelled examples, read with pandas (CSV, TSV, JSON Lines, Parquet).

1. :func:`read_rows`: pandas parses the file (pyarrow under Parquet); every row is then checked (its field
   count, its texts, its label's kind) and each problem is one :class:`DataError` naming the file, the line and
   what was expected, or, with ``invalid_rows="skip"``, the row is dropped and listed.
2. :func:`split_rows`: one labelled file split into train, dev and test rows, seeded, per class for classes.
3. :func:`labelled`: the rows' labels as ids in the task's label order (its ``labels``, or the train file's).

Tab-separated files follow the CS224N multitask convention: CSV quoting (a quote inside a quoted field
doubled), an unnamed index column, blank lines ignored. Rows keep the line they start on in the file, for
every error and for the record of which rows a split holds.
"""

from __future__ import annotations

import codecs
import io
import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from peftune.base.errors import UserError
from peftune.inputs.tasks import TaskSpec

if TYPE_CHECKING:
    import pandas as pd

INVALID_ROW_POLICIES = ("raise", "skip")
# the longest text accepted (characters): far beyond any sentence or review; a longer one is a broken file (an
# unbalanced quote swallowing rows), and is cut to max_length tokens anyway
MAX_TEXT_CHARS = 20_000
# a number as a data file writes it (3, 1.0, 2.75, 4e-1): ASCII digits only (float() alone takes '٣' and '0_3')
ASCII_NUMBER = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
SEPARATORS = {"csv": ",", "tsv": "\t"}


class DataError(UserError):
    """A data file is missing or malformed; the message says where (file, line) and what was expected."""

    def __init__(self, path: str | os.PathLike, problem: str, line: int | None = None, expected: str | None = None):
        self.path = os.fspath(path)
        self.problem = _bounded_line(problem)  # it may quote the file's own text: tabs, newlines, megabytes
        self.line = line
        self.expected = expected
        where = self.path if line is None else f"{self.path}, line {line}"
        super().__init__(f"{where}: {self.problem}" + (f"; expected {expected}" if expected else ""))

    def __reduce__(self):
        # The default reduce would call DataError(message) and lose the fields; Ray pickles exceptions.
        return (type(self), (self.path, self.problem, self.line, self.expected))


def _bounded_line(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Example(NamedTuple):
    texts: tuple[str, ...]  # one sentence, or two for a pair task; stripped, never empty
    label: float  # a class id, or a regression value


class Problem(NamedTuple):
    """What is wrong with a row, and what was expected there."""

    reason: str
    expected: str


class Rows(NamedTuple):
    """A file's valid rows, in file order, their labels as read (a number, or text), and the rows dropped."""

    texts: list[tuple[str, ...]]
    labels: list[int | float | str]  # int: a whole number (a class task's), float: a value, str: a text label
    lines: list[int]  # 1-based line each row starts on (Parquet: its row number)
    skipped: list[tuple[int, str]]  # (line, reason) of rows dropped with invalid_rows="skip"

    def subset(self, indices: Sequence[int]) -> Rows:
        return Rows(*([column[i] for i in indices] for column in self[:3]), self.skipped)


def check_policy(invalid_rows: str) -> None:
    if invalid_rows not in INVALID_ROW_POLICIES:
        raise UserError(f"invalid_rows={invalid_rows!r}, expected one of {INVALID_ROW_POLICIES}")


# ----------------------------------------------------------------------------- reading


def read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise DataError(path, "file not found", expected="an existing data file") from None
    except IsADirectoryError:
        raise DataError(path, "is a directory", expected="a data file") from None
    except OSError as error:
        raise DataError(path, f"cannot read the file ({error.strerror})", expected="a readable data file") from None
    except ValueError:  # the operating system takes no NUL in a path ("embedded null byte")
        shown = str(path).replace("\0", "\\0")
        raise DataError(shown, "the path holds a NUL byte", expected="a path without NUL bytes") from None


def read_rows(path: Path, data: bytes, spec: TaskSpec, invalid_rows: str) -> Rows:
    """The file's rows for ``spec``, validated; row problems raise (or are skipped), file problems always raise."""
    check_policy(invalid_rows)
    fmt = spec.format_of(path)
    columns = (*spec.text_columns, spec.label_column, *([spec.id_column] if spec.id_column else []))
    if fmt == "parquet":
        frame = _parquet(path, data)
        table, lines, bad, end = _columns_of(frame), list(range(1, len(frame) + 1)), {}, len(frame) + 1
    else:
        text = _decode(path, data)
        if not text.strip():
            raise DataError(path, "the file is empty", line=1, expected=_header_expected(spec, fmt))
        if fmt == "jsonl":
            table, bad = _columns_of(_jsonl(path, text)), {}
            lines = [i for i, line in enumerate(text.split("\n"), 1) if line.strip()]
        else:
            table, lines, bad = _delimited(path, text, fmt, spec)
        end = text.count("\n") + (0 if text.endswith("\n") else 1) + 1
    missing = [name for name in columns if name not in table]
    if missing:
        found = ", ".join(map(str, table))
        raise DataError(
            path,
            f"missing column(s) {', '.join(missing)} for task {spec.name!r} (found: {found})",
            line=1,
            expected=_header_expected(spec, fmt),
        )
    rows = Rows([], [], [], [])
    reject = _rejecter(path, rows.skipped, invalid_rows)
    left_out = sorted(bad.items(), reverse=True)  # rows the parser left out, reported in line order with the rest
    seen_ids: dict = {}  # id -> (line, texts, label): an id names one example
    text_values = [table[name] for name in spec.text_columns]
    ids = table[spec.id_column] if spec.id_column else None
    broken = _line_breaks(table, fmt)
    for i, raw in enumerate(table[spec.label_column]):
        texts = broken.get(i) or _check_texts([values[i] for values in text_values], spec)
        value = _check_label(raw, spec) if not isinstance(texts, Problem) else texts
        while left_out and left_out[-1][0] < lines[i]:
            line, problem = left_out.pop()
            reject(line, *problem)
        if isinstance(value, Problem):
            reject(lines[i], *value)
            continue
        if ids is not None:
            _check_id(path, seen_ids, ids[i], lines[i], (texts, value))
        rows.texts.append(texts)
        rows.labels.append(value)
        rows.lines.append(lines[i])
    for line, problem in reversed(left_out):
        reject(line, *problem)
    if not rows.texts:
        raise DataError(
            path,
            "no valid data rows" if lines else "no data rows",
            line=end if not lines else None,
            expected="examples after the header row" if fmt != "jsonl" else "one JSON object a line",
        )
    return rows


def _rejecter(path: Path, skipped: list, invalid_rows: str):
    def reject(line: int, reason: str, expected: str) -> None:
        if invalid_rows == "skip":
            skipped.append((line, f"{reason}; expected {expected}"))
        else:
            raise DataError(path, reason, line=line, expected=f"{expected} (or pass invalid_rows='skip')")

    return reject


def _decode(path: Path, data: bytes) -> str:
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8) :]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise DataError(
            path, f"byte 0x{data[error.start]:02x} is not valid UTF-8", line=line, expected="UTF-8 encoded text"
        ) from None


def _header_expected(spec: TaskSpec, fmt: str) -> str:
    names = ", ".join((*spec.text_columns, spec.label_column))
    if fmt == "jsonl":
        return f"one JSON object a line with keys {names}"
    if fmt == "parquet":
        return f"columns {names}"
    return f"a {'tab' if fmt == 'tsv' else 'comma'}-separated header row with columns {names}"


def _delimited(path: Path, text: str, fmt: str, spec: TaskSpec) -> tuple[dict[str, list], list[int], dict]:
    """(every column's cells as text, each row's line, {line: Problem} of rows with another field count), read by
    pyarrow's CSV reader (quoted fields may hold the separator; a doubled quote is a quote)."""
    import pyarrow as pa  # here, not at import: a refusal of bad flags does not wait for it
    import pyarrow.csv as pa_csv

    # one thread for both reads: pyarrow's thread pool, once started, can still be running at the interpreter's
    # exit, which then aborts (SIGABRT, "terminate called without an active exception") instead of exiting 2
    data, separator = text.encode("utf-8"), SEPARATORS[fmt]
    parse = {"delimiter": separator, "newlines_in_values": True}
    try:
        header = pa_csv.read_csv(
            io.BytesIO(data.split(b"\n", 1)[0] + b"\n"),
            read_options=pa_csv.ReadOptions(autogenerate_column_names=True, use_threads=False),
            parse_options=pa_csv.ParseOptions(**parse),
        ).to_pylist()[0]
    except (pa.ArrowInvalid, IndexError) as error:  # a quote left open in the header: no columns to name
        needed = ", ".join((*spec.text_columns, spec.label_column))
        raise DataError(
            path,
            f"missing column(s) {needed} for task {spec.name!r} (the header row cannot be read: {error})",
            line=1,
            expected=_header_expected(spec, fmt),
        ) from None
    names = ["" if name is None else str(name).strip() for name in header.values()]
    nul = [name for name in names if "\x00" in name]
    if nul:  # "id\x00" is not "id": the column would silently go unchecked
        raise DataError(path, f"column name {nul[0]!r} holds a NUL character", line=1, expected="column names")
    repeated = sorted({name for name in names if name and names.count(name) > 1})
    if repeated:
        raise DataError(
            path,
            f"column(s) {', '.join(repeated)} appear twice in the header",
            line=1,
            expected=_header_expected(spec, fmt) + ", each once",
        )
    bad = {}  # row number (pyarrow's: the header is 1, blank lines not counted) -> (Problem, lines it spans)

    def other_field_count(row) -> str:
        spans = row.text.count("\n") + 1
        hint = f" (the row spans {spans} lines: is a double quote unbalanced?)" if spans > 1 else ""
        kind = "tab" if separator == "\t" else "comma"
        bad[row.number] = (
            Problem(
                f"{row.actual_columns} fields{hint}",
                f"{row.expected_columns} {kind}-separated fields, as in the header",
            ),
            spans,
        )
        return "skip"

    placeholders = [f"column {i}" for i in range(len(names))]  # the real names may repeat an empty one
    try:
        table = pa_csv.read_csv(
            io.BytesIO(data),
            read_options=pa_csv.ReadOptions(column_names=placeholders, skip_rows=1, use_threads=False),
            parse_options=pa_csv.ParseOptions(**parse, invalid_row_handler=other_field_count),
            convert_options=pa_csv.ConvertOptions(
                column_types=dict.fromkeys(placeholders, pa.string()),
                strings_can_be_null=False,
                quoted_strings_can_be_null=False,
            ),
        )
    except pa.ArrowInvalid as error:
        raise DataError(path, f"unreadable ({error})", expected=_header_expected(spec, fmt)) from None
    columns = {}
    for name, column in zip(names, table.columns, strict=True):
        columns.setdefault(name, column.to_pylist())  # an unnamed column twice: the first (no task reads it)
    lines, problems = _record_lines(text, list(columns.values()), table.num_rows, bad)
    return columns, lines, problems


def _record_lines(text: str, cells: list[list[str]], rows: int, bad: dict) -> tuple[list[int], dict]:
    """(the line each row starts on, {line: Problem} of the rows left out): rows follow the lines after the
    header past blank ones, each taking one line plus the line breaks its quoted fields hold."""
    blank = {i for i, line in enumerate(text.split("\n"), 1) if not line.strip("\r")}
    breaks = [sum(column[i].count("\n") for column in cells) for i in range(rows)]
    lines, problems, line, number = [], {}, 2, 2  # the first row after the header: line 2, pyarrow's row 2
    for extra in breaks:
        while True:
            while line in blank:
                line += 1
            if number not in bad:
                break
            problem, spans = bad.pop(number)
            problems[line] = problem
            line, number = line + spans, number + 1
        lines.append(line)
        line, number = line + 1 + extra, number + 1
    for problem, spans in bad.values():  # rows left out after the last good one
        while line in blank:
            line += 1
        problems[line] = problem
        line += spans
    return lines, problems


def _columns_of(frame: pd.DataFrame) -> dict[str, list]:
    """A pandas frame (JSON Lines, Parquet) as the delimited reader's columns: name -> cells."""
    return {str(name): frame[name].tolist() for name in frame.columns}


def _jsonl(path: Path, text: str) -> pd.DataFrame:
    import pandas as pd

    try:
        frame = pd.read_json(io.StringIO(text), lines=True, dtype=False, convert_dates=False)
    except ValueError:
        for number, line in enumerate(text.split("\n"), 1):  # pandas names no line: find the first bad one
            if line.strip():
                try:
                    if not isinstance(json.loads(line), dict):
                        raise ValueError
                except ValueError:
                    raise DataError(
                        path, "not a JSON object", line=number, expected="one JSON object a line (JSON Lines)"
                    ) from None
        raise DataError(path, "unreadable JSON Lines", expected="one JSON object a line") from None
    return frame


def parquet_frame(data: bytes) -> pd.DataFrame:
    """A Parquet file's bytes as a frame, read from Arrow's own buffer on one thread. Given a Python file object
    (pandas' ``read_parquet`` of bytes), one of Arrow's threads could outlive the interpreter, whose exit then
    aborted (SIGABRT, "terminate called without an active exception") instead of returning its status."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pq.read_table(pa.BufferReader(data), use_threads=False).to_pandas()


def _parquet(path: Path, data: bytes) -> pd.DataFrame:
    try:
        return parquet_frame(data)
    except Exception as error:  # pyarrow raises its own kinds (ArrowInvalid, OSError...) for a damaged file
        raise DataError(
            path, f"not a readable Parquet file ({type(error).__name__})", expected="a Parquet file"
        ) from None


def _line_breaks(columns: dict[str, list], fmt: str) -> dict[int, Problem]:
    """Rows whose field holds a line break: in a delimited file only a quote left open swallows one."""
    if fmt not in SEPARATORS:
        return {}
    out = {}
    for name, values in columns.items():
        for i, value in enumerate(values):
            if "\n" in value or "\r" in value:
                out.setdefault(
                    i,
                    Problem(
                        f"column {name!r} holds a line break (is a double quote unbalanced?)",
                        "one line per row; quotes in a field doubled and the field quoted",
                    ),
                )
    return out


def _check_texts(values: list, spec: TaskSpec):
    """The row's texts, stripped, or what is wrong with them."""
    texts = []
    for column, value in zip(spec.text_columns, values, strict=True):
        if not isinstance(value, str):
            if value is None or (isinstance(value, float) and math.isnan(value)):
                return Problem(f"empty text in column {column!r}", "a non-empty sentence")
            return Problem(f"text in column {column!r} is {type(value).__name__} {value!r}", "text")
        value = value.strip()
        if not value:
            return Problem(f"empty text in column {column!r}", "a non-empty sentence")
        if len(value) > MAX_TEXT_CHARS:
            return Problem(f"text of {len(value):,} characters in column {column!r}", f"at most {MAX_TEXT_CHARS:,}")
        if not any(char.isprintable() and not char.isspace() for char in value):
            return Problem(f"text in column {column!r} has no printable character", "a sentence of words")
        if "\x00" in value:  # invisible in a terminal, and a sign of a binary file
            return Problem(f"column {column!r} holds a NUL character", "text without NUL (\\x00) characters")
        texts.append(value)
    return tuple(texts)


def _check_label(raw, spec: TaskSpec) -> int | float | str | Problem:
    """The label as read, checked against the task's kind (its class membership is :func:`labelled`'s)."""
    value, column = _label_value(raw), spec.label_column
    if value is None:
        return Problem(f"empty label in column {column!r}", _label_expectation(spec))
    if spec.kind == "regression":
        low, high = spec.value_range or (-math.inf, math.inf)
        if isinstance(value, str):
            return Problem(f"label {_shown(raw)} in column {column!r} is not a number", _label_expectation(spec))
        if not (math.isfinite(value) and low <= value <= high):
            return Problem(f"label {_shown(raw)} in column {column!r} is out of range", _label_expectation(spec))
        return float(value)
    if isinstance(value, float):
        return Problem(f"label {_shown(raw)} in column {column!r} is not a class label", _label_expectation(spec))
    return value


def _shown(raw) -> str:
    return repr(raw if not isinstance(raw, str) else raw.strip()[:80])


def _label_value(raw) -> int | float | str | None:
    """A label as read -> an int (a whole number), a float, a str (text), or None (empty). ``"3"``, ``3`` and
    ``3.0`` are the same label in every format; ``True`` is text, never 1."""
    if raw is None or (isinstance(raw, float) and math.isnan(raw)):
        return None
    if isinstance(raw, bool):
        return str(raw).lower()
    if isinstance(raw, (int, np.integer)):
        return int(raw)
    if isinstance(raw, (float, np.floating)):
        raw = float(raw)
        return int(raw) if raw.is_integer() else raw
    text = str(raw).strip()
    if not text:
        return None
    if ASCII_NUMBER.fullmatch(text):
        number = float(text)
        return int(number) if number.is_integer() and math.isfinite(number) else number
    return text


def _label_expectation(spec: TaskSpec) -> str:
    if spec.kind == "regression":
        low, high = spec.value_range or (None, None)
        return "a number" + (f" in [{low:g}, {high:g}]" if low is not None else "") + " in ASCII digits"
    if spec.labels is not None:
        numbers = all(isinstance(label, int) for label in spec.labels)
        return "one of " + ", ".join(map(str, spec.labels)) + (" in ASCII digits" if numbers else "")
    return "a class label: a whole number or a text"


def _check_id(path: Path, seen: dict, example_id, line: int, example) -> None:
    """An id names one example: repeated with the same text and label is a duplicate row, otherwise an error."""
    key = str(example_id).strip()
    first = seen.setdefault(key, (line, example))
    if first[1] != example:
        raise DataError(
            path,
            f"id {key[:80]!r} is repeated with another text or label (first at line {first[0]})",
            line=line,
            expected="one example per id",
        )


# ----------------------------------------------------------------------------- splits and labels


def split_rows(rows: Rows, spec: TaskSpec, path: Path | None = None) -> dict[str, list[int]]:
    """Role (train, dev, test) -> indices of ``rows`` (one file), in file order: each class's rows (all rows of a
    regression task) shuffled with the split's seed, their first ``dev`` share dev, the next ``test`` share test."""
    dev, test, seed = spec.split
    rng = np.random.default_rng(seed)
    keys = [str(label) for label in rows.labels] if spec.kind != "regression" else [""] * len(rows.labels)
    roles: dict[str, list[int]] = {"train": [], "dev": [], "test": []}
    for key in sorted(set(keys)):
        members = np.flatnonzero(np.asarray(keys) == key)
        members = members[rng.permutation(len(members))].tolist()
        n_dev, n_test = round(len(members) * dev), round(len(members) * test)
        roles["dev"] += members[:n_dev]
        roles["test"] += members[n_dev : n_dev + n_test]
        roles["train"] += members[n_dev + n_test :]
    for role in spec.roles:
        if not roles[role]:
            share = {"dev": dev, "test": test, "train": 1 - dev - test}[role]
            raise DataError(
                path or spec.name,
                f"task {spec.name!r}: its split gives the {role} role none of the file's {len(rows.labels)} rows "
                f"({share:g} of them)",
                expected=f"a larger {role} share in `split`, or a larger file",
            )
    return {role: sorted(indices) for role, indices in roles.items()}


def labelled(path: Path, rows: Rows, spec: TaskSpec, role: str, invalid_rows: str) -> tuple[list, list, list]:
    """(examples, their lines, skipped) of ``rows``, each label its id in ``spec.labels`` (a class task) or its
    value; a class that is not among the labels (a dev label the train file never has) raises or is skipped."""
    if spec.kind == "regression":
        return [Example(t, float(v)) for t, v in zip(rows.texts, rows.labels, strict=True)], rows.lines, rows.skipped
    ids = {label: i for i, label in enumerate(spec.labels)}
    examples, lines, skipped = [], [], list(rows.skipped)
    reject = _rejecter(path, skipped, invalid_rows)
    for texts, value, line in zip(rows.texts, rows.labels, rows.lines, strict=True):
        if value not in ids:
            if spec.labels_from_train:
                problem = f"label {value!r} of the {role} split does not occur in the train file"
            else:
                problem = f"label {value!r} in column {spec.label_column!r} is not one of task {spec.name!r}'s labels"
            reject(line, problem, _label_expectation(spec))
            continue
        examples.append(Example(texts, float(ids[value])))
        lines.append(line)
    if not examples:
        raise DataError(path, f"no rows with a known label in the {role} split", expected=f"labels {spec.labels}")
    return examples, lines, skipped
