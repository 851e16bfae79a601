"""Task data: read and validate the tab-separated files, tokenize once, batch by length, schedule tasks.

1. ``read_task_file``: TSV with CSV quoting (the CS224N multitask format), read with :mod:`csv`; every problem is
   one :class:`DataError` naming file, line and what was expected, before anything is returned.
2. ``encode_split``: tokenization runs once per (file content, tokenizer, max length) in a process; token ids are
   stored flat with offsets, so an :class:`EncodedSplit` is small enough for Ray's object store.
3. ``bucketed_batches``: batches padded only to their longest member, of similar lengths, in a seeded random order.
4. ``multitask_schedule``: which task each training step of an epoch uses.

Why each step looks the way it does: docs/design.md, "Data pipeline".
"""

from __future__ import annotations

import codecs
import csv
import hashlib
import io
import itertools
import json
import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from peftune.errors import UserError
from peftune.tasks import TaskSpec, get_task

logger = logging.getLogger(__name__)

INVALID_ROW_POLICIES = ("raise", "skip")
SCHEDULES = ("round_robin", "proportional", "temperature")
DEFAULT_MAX_LENGTH = 128
# longest text accepted (characters): the longest in the shipped files is ~2,200 (a CFIMDB review);
# anything far longer is a broken file (e.g. an unbalanced quote), and is cut to max_length anyway
MAX_TEXT_CHARS = 20_000
# a label as the data files write it (3, 1.0, 2.75, 4e-1): ASCII digits only
ASCII_NUMBER = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


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
    label: float


@dataclass(frozen=True, eq=False)
class EncodedSplit:
    """One data file, tokenized. Shared through a cache and the Ray object store: treat as read-only.

    Example ``i`` is ``input_ids[offsets[i]:offsets[i + 1]]``: [CLS] a [SEP] (b [SEP]), no padding.
    """

    task: str
    input_ids: torch.Tensor  # (total_tokens,) int32, all examples concatenated
    token_type_ids: torch.Tensor  # (total_tokens,) int8, 0 on [CLS] a [SEP], 1 on b [SEP]
    offsets: torch.Tensor  # (N + 1,) int64, offsets[0] == 0, offsets[-1] == total_tokens
    labels: torch.Tensor  # (N,) float32
    lines: torch.Tensor  # (N,) int32, 1-based line of each example in the source file (file order kept)
    source: str  # path of the file read
    sha256: str  # of the file's bytes: log it to say exactly which data a run used
    max_length: int
    pad_id: int  # the tokenizer's pad token id; batches pad with it
    skipped: tuple[tuple[int, str], ...] = ()  # (line, reason) of rows dropped with invalid_rows="skip"

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    @property
    def lengths(self) -> torch.Tensor:  # (N,) int64, tokens per example
        return self.offsets[1:] - self.offsets[:-1]

    def num_tokens(self) -> int:
        """Non-pad tokens in the split (what a batch of it costs, without padding)."""
        return int(self.offsets[-1])

    def example(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, token_type_ids) of example ``i``, each (L_i,)."""
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.input_ids[start:end], self.token_type_ids[start:end]

    def subset(self, indices: torch.Tensor) -> EncodedSplit:
        """The examples at ``indices`` (1-D), in that order, as a new compact split."""
        indices = torch.as_tensor(indices, dtype=torch.long)
        starts, lengths = self.offsets[indices], self.lengths[indices]  # (K,), (K,)
        offsets = torch.zeros(len(indices) + 1, dtype=torch.long)
        torch.cumsum(lengths, 0, out=offsets[1:])
        # flat source position of every kept token: start of its example + position within it
        within = torch.arange(int(offsets[-1])) - torch.repeat_interleave(offsets[:-1], lengths)
        positions = torch.repeat_interleave(starts, lengths) + within  # (K_tokens,)
        return replace(
            self,
            input_ids=self.input_ids[positions],
            token_type_ids=self.token_type_ids[positions],
            offsets=offsets,
            labels=self.labels[indices],
            lines=self.lines[indices],
        )


@dataclass
class Batch:
    """A padded batch of one task. ``indices`` are the examples' positions in their EncodedSplit."""

    task: str
    input_ids: torch.Tensor  # (B, T) long, T = longest example in the batch, padded with the pad id
    attention_mask: torch.Tensor  # (B, T) long, 1 on real tokens
    token_type_ids: torch.Tensor  # (B, T) long, 0 on padding
    labels: torch.Tensor  # (B,) float32
    indices: torch.Tensor  # (B,) long, stays on the CPU

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """Model inputs and labels on ``device``; ``indices`` stay on the CPU for bookkeeping."""

        def move(t):
            return t.to(device, non_blocking=non_blocking)

        return replace(
            self,
            input_ids=move(self.input_ids),
            attention_mask=move(self.attention_mask),
            token_type_ids=move(self.token_type_ids),
            labels=move(self.labels),
        )


@dataclass
class TaskData:
    """A task's splits, each in one role: ``train`` trains; ``selection`` (rows of the train file that
    ``train`` does not hold) is what a search selects on (TPE, rungs, the epoch kept); ``decision`` (other
    such rows) is what the confirmation decides on (the best per budget, a cheaper one not worse, which
    configurations get more seeds); ``dev`` is only reported. ``selection`` and ``decision`` are None where
    nothing is selected or decided (``peftune train``)."""

    train: EncodedSplit
    dev: EncodedSplit
    selection: EncodedSplit | None = None
    decision: EncodedSplit | None = None

    def split(self, name: str) -> EncodedSplit:
        """``train``, ``selection`` or ``dev``; a missing selection split is an error, never dev instead."""
        split = getattr(self, name, None) if name in SPLITS else None
        if split is None:
            raise UserError(f"no {name!r} split prepared for task {self.train.task!r}")
        return split


SPLITS = ("train", "selection", "decision", "dev")


# --------------------------------------------------------------------------- reading and validation


def file_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes (what the sweep logs so a run names the exact data it used)."""
    return hashlib.sha256(_read_bytes(Path(path))).hexdigest()


def read_task_file(path: str | os.PathLike, spec: TaskSpec, *, invalid_rows: str = "raise") -> list[Example]:
    """All rows of one task file as validated examples, in file order.

    Raises :class:`DataError` on the first problem. With ``invalid_rows="skip"``
    a row-level problem (field count, empty text, bad label) drops the row with a
    logged warning instead; file-level problems (missing file or column, bad
    encoding, no rows) always raise.
    """
    path = Path(path)
    examples, _, skipped = _parse(path, _read_bytes(path), spec, invalid_rows)
    _warn_skipped(path, skipped)
    return examples


def _read_bytes(path: Path) -> bytes:
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


def _parse(
    path: Path, data: bytes, spec: TaskSpec, invalid_rows: str
) -> tuple[list[Example], list[int], list[tuple[int, str]]]:
    """(examples, their 1-based start lines, skipped (line, reason)) of one file's bytes."""
    _check_policy(invalid_rows)
    text = _decode(path, data)
    if not text.strip():
        raise DataError(path, "the file is empty", line=1, expected=_header_expected(spec))
    # newline="" hands line endings to csv, so quoted fields may hold them and line_num counts physical lines
    reader = csv.reader(io.StringIO(text, newline=""), delimiter="\t")
    try:
        header = _checked_header(path, [name.strip() for name in next(reader)], spec)
        examples, lines, skipped = _read_rows(path, reader, header, spec, invalid_rows)
    except csv.Error as error:
        if "field larger than field limit" in str(error):
            raise DataError(
                path,
                f"a field longer than {csv.field_size_limit():,} characters",
                line=reader.line_num,
                expected=f"texts of at most {MAX_TEXT_CHARS:,} characters",
            ) from None
        raise DataError(path, f"unreadable CSV ({error})", line=reader.line_num, expected="tab-separated CSV") from None
    if not examples:
        raise DataError(path, "no data rows", line=reader.line_num + 1, expected="examples after the header row")
    return examples, lines, skipped


def _header_expected(spec: TaskSpec) -> str:
    return "a tab-separated header row with columns " + ", ".join((*spec.text_columns, spec.label_column))


def _checked_header(path: Path, header: list[str], spec: TaskSpec) -> list[str]:
    """The header row, refused when a column the task needs is missing, repeated, or holds a NUL."""
    expected = _header_expected(spec)
    nul = [name for name in header if "\x00" in name]
    if nul:  # "id\x00" is not "id": the column would silently go unchecked
        raise DataError(path, f"column name {nul[0]!r} holds a NUL character", line=1, expected=expected)
    repeated = sorted({name for name in header if name and header.count(name) > 1})
    if repeated:
        raise DataError(
            path,
            f"column(s) {', '.join(repeated)} appear twice in the header",
            line=1,
            expected=expected + ", each once",
        )
    missing = [name for name in (*spec.text_columns, spec.label_column) if name not in header]
    if missing:
        found = ", ".join(header)
        raise DataError(
            path, f"missing column(s) {', '.join(missing)} for task {spec.name!r} (found: {found})", line=1,
            expected=expected,
        )  # fmt: skip
    return header


def _read_rows(path: Path, reader, header: list[str], spec: TaskSpec, invalid_rows: str):
    """The data rows after the header: (examples, their start lines, skipped (line, reason))."""
    text_at = [header.index(name) for name in spec.text_columns]
    label_at = header.index(spec.label_column)
    id_at = header.index("id") if "id" in header else None
    examples, lines, skipped = [], [], []
    seen_ids: dict[str, tuple[int, Example]] = {}  # id -> (line, example): an id names one example
    end_of_previous = reader.line_num
    for row in reader:
        line, end_of_previous = end_of_previous + 1, reader.line_num
        if not row:  # a blank line is not a row (as in pandas)
            continue
        checked = _check_row(row, len(header), text_at, label_at, spec, header, spans=reader.line_num - line + 1)
        if isinstance(checked, Example):
            if id_at is not None:
                _check_id(path, seen_ids, row[id_at].strip(), line, checked)
            examples.append(checked)
            lines.append(line)
        elif invalid_rows == "skip":
            skipped.append((line, "; expected ".join(checked)))
        else:
            reason, expected = checked
            raise DataError(path, reason, line=line, expected=f"{expected} (or pass invalid_rows='skip')")
    return examples, lines, skipped


def _check_id(path: Path, seen: dict, example_id: str, line: int, example: Example) -> None:
    """An id names one example: repeated with the same text and label is a duplicate row, otherwise an error."""
    first = seen.setdefault(example_id, (line, example))
    if first[1] != example:
        raise DataError(
            path,
            f"id {example_id[:80]!r} is repeated with another text or label (first at line {first[0]})",
            line=line,
            expected="one example per id",
        )


def _check_policy(invalid_rows: str) -> None:
    if invalid_rows not in INVALID_ROW_POLICIES:
        raise UserError(f"invalid_rows={invalid_rows!r}, expected one of {INVALID_ROW_POLICIES}")


def _check_row(row, num_fields, text_at, label_at, spec, header, spans) -> Example | tuple[str, str]:
    """The row as an Example, or (problem, expectation)."""
    if len(row) != num_fields:
        hint = f" (the row spans {spans} lines: is a double quote unbalanced?)" if spans > 1 else ""
        return f"{len(row)} fields{hint}", f"{num_fields} tab-separated fields, as in the header"
    broken = [header[i] for i, value in enumerate(row) if "\n" in value or "\r" in value]
    if broken:  # only a quoted field holds these: a quote left open swallowed the following line(s)
        return (
            f"column {broken[0]!r} holds a line break (the row spans {spans} line(s): is a double quote unbalanced?)",
            "one line per row; quotes in a field doubled and the field quoted",
        )
    texts = tuple(row[i].strip() for i in text_at)
    for i, value in zip(text_at, texts, strict=True):
        if not value:
            return f"empty text in column {header[i]!r}", "a non-empty sentence"
        if len(value) > MAX_TEXT_CHARS:
            return f"text of {len(value):,} characters in column {header[i]!r}", f"at most {MAX_TEXT_CHARS:,}"
        if not any(char.isprintable() and not char.isspace() for char in value):
            return f"text in column {header[i]!r} has no printable character", "a sentence of words"
    nul = [header[i] for i, value in enumerate(row) if "\x00" in value]
    if nul:  # invisible in a terminal, and a NUL in an id makes another id
        return f"column {nul[0]!r} holds a NUL character", "text without NUL (\\x00) characters: is it a binary file?"
    raw = row[label_at].strip()
    if not ASCII_NUMBER.fullmatch(raw):  # float() alone takes '٣', '３' and '0_3' for 3
        return f"label {raw!r} in column {spec.label_column!r} is not a number", _label_expectation(spec)
    label = float(raw)
    wrong = spec.check_label(label)
    if wrong is not None:
        return f"label {raw!r} in column {spec.label_column!r} is invalid for task {spec.name!r}", wrong
    return Example(texts, label)


def _label_expectation(spec: TaskSpec) -> str:
    kind = "an integer class label" if spec.kind in ("multiclass", "binary") else "a number"
    return f"{kind} in [{spec.label_min:g}, {spec.label_max:g}] in ASCII digits"


def _warn_skipped(path: Path, skipped: Sequence[tuple[int, str]]) -> None:
    if skipped:
        shown = "; ".join(f"line {line}: {reason}" for line, reason in skipped[:5])
        more = f" (and {len(skipped) - 5} more)" if len(skipped) > 5 else ""
        logger.warning("%s: skipped %d invalid row(s): %s%s", path, len(skipped), shown, more)


# --------------------------------------------------------------------------- tokenization and cache

# (sha256, tokenizer fingerprint, max_length, spec, limit, seed) -> EncodedSplit; limit None = the whole file
_CACHE: dict[tuple, EncodedSplit] = {}
# (sha256, spec, invalid_rows) -> a file's rows read by check_files, held until load_tasks tokenizes them
_PARSED: dict[tuple, tuple[list[Example], list[int], list[tuple[int, str]]]] = {}


def clear_cache() -> None:
    """Forget every tokenized split (tests; or to free memory after changing tokenizer)."""
    _CACHE.clear()
    _PARSED.clear()


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of everything in a fast tokenizer that decides the ids it produces.

    Content, not ``id(tokenizer)``: two loads of the same tokenizer share cache
    entries, and an object id reused after garbage collection cannot alias.
    The truncation/padding state is left out because transformers rewrites it
    on every call (we always pass those settings explicitly).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise UserError(f"{type(tokenizer).__name__} is not a fast (Rust-backed) tokenizer; load one with use_fast")
    state = _without_call_state(backend.to_str())
    # Python-side settings: where __call__ truncates, and the pad id batches use
    state += f"\ntruncation_side={tokenizer.truncation_side}\npad_token_id={tokenizer.pad_token_id}"
    return hashlib.sha256(state.encode()).hexdigest()


def _without_call_state(serialized: str) -> str:
    """The tokenizer JSON minus its top-level "truncation" and "padding" values.

    The tokenizers library writes them first ({"version", "truncation",
    "padding", "added_tokens", ...}), so only that small head is decoded: a full
    parse of the vocabulary would cost ~100 ms per cache lookup. Anything
    unexpected falls back to the full parse.
    """
    decoder = json.JSONDecoder()
    try:
        kept, position = ["{"], 1
        while serialized[position] == '"':
            key, colon = decoder.raw_decode(serialized, position)
            if key not in ("version", "truncation", "padding") or serialized[colon] != ":":
                break
            _, end = decoder.raw_decode(serialized, colon + 1)
            if key == "version":
                kept.append(serialized[position : end + 1])
            position = end + 1  # past the ","
        return "".join(kept) + serialized[position:]
    except (ValueError, IndexError):
        state = json.loads(serialized)
        state.pop("truncation", None)
        state.pop("padding", None)
        return json.dumps(state, sort_keys=True)


class _Pending(NamedTuple):
    """A file read and validated (phase 1) but not yet tokenized (phase 2)."""

    path: Path
    sha256: str
    spec: TaskSpec
    examples: list[Example]
    lines: list[int]
    skipped: list[tuple[int, str]]


def _prepare_file(
    path: Path, spec: TaskSpec, fingerprint: str, max_length: int, invalid_rows: str
) -> tuple[tuple, EncodedSplit | _Pending]:
    """(cache key, the cached split of the file or the file validated and ready to tokenize)."""
    _check_policy(invalid_rows)
    data = _read_bytes(path)
    sha256 = hashlib.sha256(data).hexdigest()
    key = (sha256, fingerprint, max_length, spec)
    cached = _CACHE.get((*key, None, None))
    if cached is None:
        examples, lines, skipped = _parsed(path, data, sha256, spec, invalid_rows)
        _PARSED.pop((sha256, spec, invalid_rows))
        return key, _Pending(path, sha256, spec, examples, lines, skipped)
    _PARSED.pop((sha256, spec, invalid_rows), None)  # read by check_files, tokenized already
    if cached.skipped and invalid_rows == "raise":
        # cached by an earlier invalid_rows="skip" call; this caller wants to know
        line, reason = cached.skipped[0]
        raise DataError(path, reason + " (or pass invalid_rows='skip')", line=line)
    return key, cached


def _parsed(path: Path, data: bytes, sha256: str, spec: TaskSpec, invalid_rows: str):
    """A file's (examples, their lines, skipped rows), parsed once whether check_files or load_tasks reads it first."""
    key = (sha256, spec, invalid_rows)
    if key not in _PARSED:
        _PARSED[key] = _parse(path, data, spec, invalid_rows)
        _warn_skipped(path, _PARSED[key][2])
    return _PARSED[key]


def _tokenize(tokenizer, columns: Sequence[list[str]], max_length: int) -> tuple[list[list[int]], list[list[int]]]:
    """Batch-encode one or two text columns; pairs become [CLS] a [SEP] b [SEP], longest part truncated first."""
    encoded = tokenizer(
        *columns,
        truncation=True,
        max_length=max_length,
        padding=False,
        return_attention_mask=False,
        return_token_type_ids=True,
    )
    return encoded["input_ids"], encoded["token_type_ids"]


def _finish(key: tuple, prepared: EncodedSplit | _Pending, tokenizer, limit: int | None, seed: int) -> EncodedSplit:
    """Tokenize a pending file (and cache it), then apply the example budget."""
    if isinstance(prepared, EncodedSplit):
        return _limited(prepared, key, limit, seed)
    max_length = key[2]  # key: (sha256, tokenizer fingerprint, max_length, spec)
    columns = [list(column) for column in zip(*(example.texts for example in prepared.examples), strict=True)]
    ids, types = _tokenize(tokenizer, columns, max_length)
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))  # (N,)
    total = int(lengths.sum())
    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    split = EncodedSplit(
        task=prepared.spec.name,
        input_ids=torch.from_numpy(np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=total)),
        token_type_ids=torch.from_numpy(np.fromiter(itertools.chain.from_iterable(types), dtype=np.int8, count=total)),
        offsets=torch.from_numpy(offsets),
        labels=torch.tensor([example.label for example in prepared.examples], dtype=torch.float32),
        lines=torch.tensor(prepared.lines, dtype=torch.int32),
        source=os.fspath(prepared.path),
        sha256=prepared.sha256,
        max_length=max_length,
        pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        skipped=tuple(prepared.skipped),
    )
    _CACHE[(*key, None, None)] = split
    return _limited(split, key, limit, seed)


def _limited(split: EncodedSplit, key: tuple, limit: int | None, seed: int) -> EncodedSplit:
    """A seeded random subset of ``limit`` examples, kept in file order (cached too).

    The subset is the first ``limit`` of one seeded permutation, so for a fixed
    seed a smaller budget is contained in a larger one: budget sweeps compare
    nested data, not unrelated samples.
    """
    if limit is None or limit >= len(split):
        return split
    subset_key = (*key, limit, seed)
    cached = _CACHE.get(subset_key)
    if cached is None:
        order = torch.randperm(len(split), generator=torch.Generator().manual_seed(seed))
        cached = _CACHE[subset_key] = split.subset(order[:limit].sort().values)
    return cached


def _check_encoding_args(spec: TaskSpec, tokenizer, max_length: int, limit: int | None) -> None:
    room = tokenizer.num_special_tokens_to_add(pair=spec.is_pair) + len(spec.text_columns)
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < room:
        raise UserError(f"max_length={max_length!r}: task {spec.name!r} needs at least {room} tokens")
    model_max = getattr(tokenizer, "model_max_length", None)
    if model_max is not None and model_max < 1_000_000 and max_length > model_max:  # HF uses 1e30 for "unknown"
        raise UserError(f"max_length={max_length} exceeds the tokenizer's model_max_length {model_max}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise UserError(f"an example budget must be a positive integer or None, got {limit!r}")


def encode_split(
    path: str | os.PathLike,
    spec: TaskSpec,
    tokenizer,
    max_length: int = DEFAULT_MAX_LENGTH,
    limit: int | None = None,
    seed: int = 0,
    *,
    invalid_rows: str = "raise",
) -> EncodedSplit:
    """Read, validate and tokenize one file; cached per (file sha256, tokenizer, max_length).

    ``limit`` keeps a seeded random subset of that many examples (in file
    order). A cache hit returns the very same object without re-reading rows
    or re-tokenizing; only the file's bytes are re-hashed, so an edited file is
    never served stale.
    """
    _check_encoding_args(spec, tokenizer, max_length, limit)
    key, prepared = _prepare_file(Path(path), spec, tokenizer_fingerprint(tokenizer), max_length, invalid_rows)
    return _finish(key, prepared, tokenizer, limit, seed)


def load_tasks(
    data_dir: str | os.PathLike,
    specs: Iterable[TaskSpec | str],
    tokenizer,
    max_length: int = DEFAULT_MAX_LENGTH,
    max_train_examples: int | None = None,
    max_dev_examples: int | None = None,
    seed: int = 0,
    *,
    invalid_rows: str = "raise",
    selection_examples: int | None | bool = False,
    decision_examples: int = 0,
) -> dict[str, TaskData]:
    """Train and dev splits of every task, keyed by task name, in the order given.

    All files are read and validated before any is tokenized, so a bad last
    file fails in a fraction of a second and nothing is returned half-loaded.
    ``max_*_examples`` cap each task with a seeded random subset (see ``_limited``).
    ``selection_examples``: carve a selection split of that many train rows per task (``None``: as
    many as the task's dev split; ``False``: none), disjoint from the train rows (see :func:`carve`);
    ``decision_examples``: a decision split of that many further train rows per task (0: none; it needs a
    selection split), or all the rows left when the file holds fewer (said in a warning).
    """
    files = task_files(data_dir, specs)
    for spec, limit in itertools.product({spec for spec, _, _ in files}, (max_train_examples, max_dev_examples)):
        _check_encoding_args(spec, tokenizer, max_length, limit)

    fingerprint = tokenizer_fingerprint(tokenizer)
    prepared = {  # phase 1: read + validate everything (cheap)
        (spec.name, part): _prepare_file(path, spec, fingerprint, max_length, invalid_rows)
        for spec, part, path in files
    }
    selecting = selection_examples is not False
    limits = {"train": None if selecting else max_train_examples, "dev": max_dev_examples}
    splits = {  # phase 2: tokenize what the cache did not have
        (name, part): _finish(key, item, tokenizer, limits[part], seed)
        for (name, part), (key, item) in prepared.items()
    }
    names = dict.fromkeys(spec.name for spec, _, _ in files)
    tasks = {name: TaskData(train=splits[name, "train"], dev=splits[name, "dev"]) for name in names}
    if selecting:
        for data in tasks.values():
            size = len(data.dev) if selection_examples is None else selection_examples
            data.train, data.selection, data.decision = carve(
                data.train, max_train_examples, size, seed, decision_examples
            )
    return tasks


def task_files(data_dir: str | os.PathLike, specs: Iterable[TaskSpec | str]) -> list[tuple[TaskSpec, str, Path]]:
    """(task, "train" or "dev", path) of every file the tasks read from ``data_dir``, in order; refused when the
    directory is not one or a task is named twice."""
    if not os.fspath(data_dir).strip():  # Path("") is the working directory: read from there only when told
        raise UserError(f"data directory {os.fspath(data_dir)!r}: an empty path; expected a directory")
    if "\0" in os.fspath(data_dir):  # not "not found": no directory can be named so
        raise DataError(os.fspath(data_dir).replace("\0", "\\0"), "the path holds a NUL byte", expected="a directory")
    data_dir = Path(data_dir)
    specs = [get_task(s) if isinstance(s, str) else s for s in specs]
    if not specs:
        raise UserError("no task to load")
    if len({s.name for s in specs}) != len(specs):
        raise UserError(f"a task is named twice in {[s.name for s in specs]}")
    if not data_dir.is_dir():
        problem = "is not a directory" if data_dir.exists() else "data directory not found"
        files = ", ".join(f for s in specs for f in (s.train_file, s.dev_file))
        raise DataError(data_dir, problem, expected=f"a directory holding {files}")
    return [(spec, part, data_dir / name) for spec in specs for part, name in (("train", spec.train_file),
                                                                               ("dev", spec.dev_file))]  # fmt: skip


def check_files(data_dir: str | os.PathLike, specs: Iterable[TaskSpec | str], invalid_rows: str = "raise") -> None:
    """Read and validate every task file without a tokenizer, so a bad row is refused before the tokenizer's
    library loads (seconds). The rows read are kept for :func:`load_tasks`, which then does not parse them again."""
    _check_policy(invalid_rows)
    for spec, _, path in task_files(data_dir, specs):
        data = _read_bytes(path)
        _parsed(path, data, hashlib.sha256(data).hexdigest(), spec, invalid_rows)


def carve(
    train: EncodedSplit, limit: int | None, selection: int, seed: int, decision: int = 0
) -> tuple[EncodedSplit, EncodedSplit, EncodedSplit | None]:
    """(train, selection, decision): disjoint seeded subsets of a train file, each in file order.

    One seeded permutation of the rows: the selection split is its last ``selection`` rows, the decision
    split the ``decision`` rows before them, train the first ``limit`` rows of the rest (all of the rest
    with ``limit`` None). Where the budget leaves enough unused rows, train is exactly the subset
    ``_limited`` gives without these splits, so they cost the training nothing; where the budget would use
    those rows, they are held out of it. A file too small for the decision split it asks for gives it what
    the train rows leave (at least half of the rows stay for training), with a warning. The held-out splits
    do not depend on ``limit``: a search (a few rows) and its confirmation (every row not held out) carve the
    same selection and decision rows, and the search's train rows are a prefix of the confirmation's.
    """
    n = len(train)
    if not isinstance(selection, int) or isinstance(selection, bool) or not 1 <= selection < n:
        raise DataError(
            train.source, f"selection_examples {selection!r} of {n} rows", expected=f"an integer from 1 to {n - 1}"
        )
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    if decision:
        room = max(0, n - selection - max(1, (n - selection) // 2))
        if room < decision:
            logger.warning(
                "%s: %d rows leave %d for a decision split of %d: the decision split has %d",
                train.source, n, room, decision, room,
            )  # fmt: skip
            decision = room
    kept = order[: min(limit or n, n - selection - decision)]
    chosen = order[n - selection - decision : n - selection].sort().values
    decided = train.subset(chosen) if decision else None
    return train.subset(kept.sort().values), train.subset(order[n - selection :].sort().values), decided


# --------------------------------------------------------------------------- batching


def bucketed_batches(
    split: EncodedSplit,
    batch_size: int,
    *,
    shuffle: bool,
    generator: torch.Generator | None = None,
    pad_id: int | None = None,
    bucket_size_in_batches: int = 50,
) -> list[Batch]:
    """One epoch of padded batches covering every example exactly once.

    Training (``shuffle=True``): shuffle, cut into buckets of
    ``bucket_size_in_batches * batch_size`` examples, sort each bucket by
    length, cut it into batches, shuffle the batch order. Batches then hold
    similar lengths (little padding) yet differ from epoch to epoch; all
    randomness comes from ``generator`` (same seed, same batches).
    ``bucket_size_in_batches=1`` gives plain random batches.

    Evaluation (``shuffle=False``): sorted by length, longest first so the
    memory peak comes at once; ``Batch.indices`` (and :func:`restore_order`)
    put outputs back in file order. Only the last batch may be smaller.
    """
    if batch_size < 1 or bucket_size_in_batches < 1:
        raise UserError(f"batch_size={batch_size} and bucket_size_in_batches={bucket_size_in_batches}: need >= 1")
    pad_id = split.pad_id if pad_id is None else pad_id
    lengths = split.lengths  # (N,)
    if shuffle:
        order = torch.randperm(len(split), generator=generator)
        bucket = batch_size * bucket_size_in_batches
        groups = []
        for start in range(0, len(split), bucket):
            members = order[start : start + bucket]
            members = members[torch.sort(lengths[members], stable=True).indices]
            groups.extend(members.split(batch_size))
        groups = [groups[i] for i in torch.randperm(len(groups), generator=generator).tolist()]
    else:
        groups = list(torch.sort(lengths, descending=True, stable=True).indices.split(batch_size))
    return [_make_batch(split, indices, pad_id) for indices in groups]


def _make_batch(split: EncodedSplit, indices: torch.Tensor, pad_id: int) -> Batch:
    """Gather examples ``indices`` (B,) from the flat storage into (B, T) tensors, vectorized."""
    starts = split.offsets[indices]  # (B,)
    lengths = split.offsets[indices + 1] - starts  # (B,)
    positions = torch.arange(int(lengths.max()))  # (T,)
    mask = positions[None, :] < lengths[:, None]  # (B, T) bool
    flat = (starts[:, None] + positions[None, :]).masked_fill_(~mask, 0)  # (B, T) positions in the flat storage
    return Batch(
        task=split.task,
        input_ids=split.input_ids[flat].long().masked_fill_(~mask, pad_id),
        attention_mask=mask.long(),
        token_type_ids=split.token_type_ids[flat].long().masked_fill_(~mask, 0),
        labels=split.labels[indices],
        indices=indices,
    )


def restore_order(batches: Sequence[Batch], values: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-batch outputs (each (B_i, ...)) -> one (N, ...) tensor in the split's (file) order."""
    if len(batches) != len(values):
        raise RuntimeError(f"{len(batches)} batches but {len(values)} output tensors")
    if not values:
        raise RuntimeError("no batches")
    indices = torch.cat([batch.indices for batch in batches])  # (N,)
    flat = torch.cat([v.detach().cpu() for v in values])  # (N, ...)
    if len(flat) != len(indices):
        raise RuntimeError(f"{len(flat)} outputs for {len(indices)} examples")
    out = torch.empty_like(flat)
    out[indices] = flat
    return out


# --------------------------------------------------------------------------- multitask schedule


def multitask_schedule(
    num_batches: Mapping[str, int],
    strategy: str,
    *,
    temperature: float = 10.0,
    generator: torch.Generator | None = None,
    total: int | None = None,
) -> list[str]:
    """Task name of each training step of an epoch; ``total`` steps, by default ``sum(num_batches)``.

    - ``round_robin``: cycle through the tasks in the given order, skipping a
      task once it has had its ``n`` batches; when all have, start again.
      With the default total every batch of every task is used exactly once.
    - ``proportional``: a random interleaving of all batches (as if each step
      drew a task with p proportional to its remaining batches); exactly ``n``
      steps per task with the default total, passes repeat beyond it.
    - ``temperature``: every step independently draws a task with
      p proportional to ``n ** (1 / temperature)`` (HyperFormer, T=10): T=1 is
      proportional, large T tends to uniform, so small tasks are seen more
      often than their size alone would give.

    The schedule names tasks only: the trainer takes that task's next batch
    and starts a new pass (reshuffled) over a task whose batches ran out.
    """
    if strategy not in SCHEDULES:
        raise UserError(f"unknown schedule strategy {strategy!r}; valid: {', '.join(SCHEDULES)}")
    for name, n in num_batches.items():
        if not isinstance(n, int) or n < 0:
            raise UserError(f"task {name!r}: {n!r} batches, expected an integer >= 0")
    tasks = [name for name, n in num_batches.items() if n > 0]
    counts = [num_batches[name] for name in tasks]
    total = sum(counts) if total is None else total
    if total < 0:
        raise UserError(f"total={total}, expected >= 0")
    if total == 0:
        return []
    if not tasks:
        raise UserError(f"no task has a batch: {dict(num_batches)}")

    if strategy == "round_robin":
        one_pass = []
        for turn in range(max(counts)):
            one_pass.extend(name for name, n in zip(tasks, counts, strict=True) if turn < n)
        return list(itertools.islice(itertools.cycle(one_pass), total))
    if strategy == "proportional":
        one_pass = [name for name, n in zip(tasks, counts, strict=True) for _ in range(n)]
        schedule = []
        while len(schedule) < total:
            schedule.extend(one_pass[i] for i in torch.randperm(len(one_pass), generator=generator).tolist())
        return schedule[:total]
    if temperature <= 0:
        raise UserError(f"temperature={temperature}, expected > 0")
    weights = torch.tensor(counts, dtype=torch.float64) ** (1.0 / temperature)  # (K,)
    draws = torch.multinomial(weights, total, replacement=True, generator=generator)  # (total,)
    return [tasks[i] for i in draws.tolist()]
