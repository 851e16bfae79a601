"""Task data: read and validate each task's files, tokenize once, batch by length, schedule tasks.

1. Reading (:mod:`peftune.inputs.tables`): pandas reads each file the task declares (CSV, TSV, JSON Lines, Parquet);
   every problem is one :class:`DataError` naming file, line and what was expected, before anything is returned.
   A task that declares one ``file`` has it split here into train, dev and test rows; a class task that lists no
   ``labels`` has them read from its train file first (:func:`resolve_labels`).
2. ``encode_split``: tokenization runs once per (file content, tokenizer, max length) in a process; token ids are
   stored flat with offsets, so an :class:`EncodedSplit` is small enough for Ray's object store.
3. ``bucketed_batches``: batches padded only to their longest member, of similar lengths, in a seeded random order.
4. ``multitask_schedule``: which task each training step of an epoch uses.

Why each step looks the way it does: docs/design.md, "Data pipeline".
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from peftune.base.errors import UserError
from peftune.base.validation import Bound, checked
from peftune.inputs.backbone import DEFAULT_MODEL, BertConfig
from peftune.inputs.tables import (
    INVALID_ROW_POLICIES,
    MAX_TEXT_CHARS,
    DataError,
    Example,
    Rows,
    check_policy,
    labelled,
    read_bytes,
    read_rows,
    split_rows,
)
from peftune.inputs.tasks import TaskSpec, declare, get_task

__all__ = ["INVALID_ROW_POLICIES", "MAX_TEXT_CHARS", "DataError", "Example"]  # read from here by the callers

logger = logging.getLogger(__name__)

SCHEDULES = ("round_robin", "proportional", "temperature")
DEFAULT_MAX_LENGTH = 128  # tokens per sequence (a pair together): what BERT's fine-tuning recipes use
MAX_SEED = 2**32 - 1  # numpy's seed range; torch takes it too
SEED = Bound(0, MAX_SEED, "numpy's and torch's range")
# DataSettings' intervals (a sweep's budget checks the same in its file: peftune.sweep.spaces.Budget)
ROWS = Bound(1, 100_000_000, "a sane bound on a split")
COUNTS = {"max_length": Bound(8, BertConfig.max_position_embeddings, "BERT's position embeddings"),
          "max_train_examples": ROWS, "max_dev_examples": ROWS, "seed": SEED,
          "decision_examples": Bound(0, 1_000_000, "a sane bound on a split")}  # fmt: skip


@dataclass(frozen=True)
class DataSettings:
    """What a run reads, in one object from the YAML (a budget) or the flags to :func:`load_tasks`: the data
    directory, the model (whose tokenizer), the rows kept, and the splits carved from train."""

    data_dir: str | None  # None: each task reads beside its task file (or a record that kept no data directory)
    model: str = DEFAULT_MODEL
    max_length: int = DEFAULT_MAX_LENGTH
    max_train_examples: int | None = None
    max_dev_examples: int | None = None
    seed: int = 0  # the data's seed: which rows are kept and carved into selection and decision
    invalid_rows: str = "raise"
    selection_examples: int | None | bool = False  # False: no selection split; None: as many as dev
    decision_examples: int = 0

    def __post_init__(self):
        for key, bound in COUNTS.items():
            if getattr(self, key) is not None:  # None: every row
                checked("DataSettings", key, bound, getattr(self, key), integer=True)
        if self.selection_examples not in (False, None):
            checked("DataSettings", "selection_examples", ROWS, self.selection_examples, integer=True)
        if self.decision_examples and self.selection_examples is False:
            raise UserError(f"DataSettings.decision_examples {self.decision_examples}: expected 0 without a selection "
                            "split (selection_examples)")  # fmt: skip
        if self.invalid_rows not in INVALID_ROW_POLICIES:
            raise UserError(f"DataSettings.invalid_rows {self.invalid_rows!r}, expected one of {INVALID_ROW_POLICIES}")
        if not isinstance(self.model, str) or not (self.data_dir is None or isinstance(self.data_dir, str)):
            raise UserError(f"DataSettings: model {self.model!r}, data_dir {self.data_dir!r}: expected paths")


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
    examples_sha256: str  # of the examples (texts, labels): the same data in another format has the same one
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
    return hashlib.sha256(read_bytes(Path(path))).hexdigest()


def read_task_file(
    path: str | os.PathLike, spec: TaskSpec, *, invalid_rows: str = "raise", role: str = "train"
) -> list[Example]:
    """All rows of one task file (its ``role`` part, for a task of one split file) as validated examples.

    Raises :class:`DataError` on the first problem. With ``invalid_rows="skip"`` a row-level problem (field
    count, empty text, bad label) drops the row with a logged warning instead; file-level problems (missing
    file or column, bad encoding, no rows) always raise. A class task whose labels are not known yet takes
    them from these rows.
    """
    path = Path(path)
    data = read_bytes(path)
    rows = _role_rows(path, data, hashlib.sha256(data).hexdigest(), spec, role, invalid_rows)
    spec = spec if spec.kind == "regression" or spec.labels is not None else spec.resolved(rows.labels)
    examples, _, skipped = labelled(path, rows, spec, role, invalid_rows)
    _warn_skipped(path, skipped)
    return examples


def _warn_skipped(path: Path, skipped: Sequence[tuple[int, str]]) -> None:
    if skipped:
        shown = "; ".join(f"line {line}: {reason}" for line, reason in skipped[:5])
        more = f" (and {len(skipped) - 5} more)" if len(skipped) > 5 else ""
        logger.warning("%s: skipped %d invalid row(s): %s%s", path, len(skipped), shown, more)


def task_path(data_dir: str | os.PathLike | None, spec: TaskSpec, role: str) -> Path:
    """Where ``role``'s file of ``spec`` is: beside the task file when it is there, else in ``data_dir``."""
    name = spec.file_of(role)
    beside = Path(spec.folder) / name if spec.folder else None
    if beside is not None and (beside.exists() or data_dir is None):
        return beside
    if data_dir is None:
        raise UserError(f"task {spec.name!r} reads {name} from the data directory; expected --data-dir (the folder "
                        f"holding {name})")  # fmt: skip
    return Path(data_dir) / name


def resolve_labels(data_dir, spec: TaskSpec, invalid_rows: str = "raise") -> TaskSpec:
    """``spec`` with its class labels read from its train file where it lists none, declared in this process."""
    if spec.kind == "regression" or spec.labels is not None:
        return spec
    path = task_path(data_dir, spec, "train")
    data = read_bytes(path)
    rows = _role_rows(path, data, hashlib.sha256(data).hexdigest(), spec, "train", invalid_rows)
    return declare(spec.resolved(rows.labels))


def _role_rows(path: Path, data: bytes, sha256: str, spec: TaskSpec, role: str, invalid_rows: str) -> Rows:
    """``role``'s rows of the file: all of them, or its part of a task's one split file."""
    rows = _parsed(path, data, sha256, spec, invalid_rows)
    return rows if spec.file is None else rows.subset(split_rows(rows, spec, path)[role])


def examples_sha256(examples: Sequence[Example]) -> str:
    """A hash of the examples themselves (texts and labels, in order): the same data in CSV, JSON Lines or
    Parquet has the same one, where each file's bytes differ."""
    digest = hashlib.sha256()
    for example in examples:
        digest.update(json.dumps([example.texts, example.label], ensure_ascii=False).encode())
        digest.update(b"\n")
    return digest.hexdigest()


# --------------------------------------------------------------------------- tokenization and cache

# (sha256, tokenizer fingerprint, max_length, spec, role, limit, seed) -> EncodedSplit; limit None = every row
_CACHE: dict[tuple, EncodedSplit] = {}
# (sha256, spec as read, invalid_rows) -> a file's rows read by check_files, held until load_tasks tokenizes them
_PARSED: dict[tuple, Rows] = {}


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
    parse of the whole vocabulary would cost far more per cache lookup. Anything
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
    path: Path, spec: TaskSpec, role: str, fingerprint: str, max_length: int, invalid_rows: str
) -> tuple[tuple, EncodedSplit | _Pending]:
    """(cache key, the cached split of the file or the file validated and ready to tokenize)."""
    check_policy(invalid_rows)
    data = read_bytes(path)
    sha256 = hashlib.sha256(data).hexdigest()
    key = (sha256, fingerprint, max_length, spec, role)
    cached = _CACHE.get((*key, None, None))
    if cached is None:
        rows = _role_rows(path, data, sha256, spec, role, invalid_rows)
        examples, lines, skipped = labelled(path, rows, spec, role, invalid_rows)
        return key, _Pending(path, sha256, spec, examples, lines, skipped)
    if cached.skipped and invalid_rows == "raise":
        # cached by an earlier invalid_rows="skip" call; this caller wants to know
        line, reason = cached.skipped[0]
        raise DataError(path, reason + " (or pass invalid_rows='skip')", line=line)
    return key, cached


def _parsed(path: Path, data: bytes, sha256: str, spec: TaskSpec, invalid_rows: str) -> Rows:
    """A file's rows, parsed once whether check_files or load_tasks reads it first (its labels do not change
    how it is read: the key leaves them out, so a task's labels resolved from train do not read it again)."""
    key = (sha256, replace(spec, labels=None), invalid_rows)
    if key not in _PARSED:
        _PARSED[key] = read_rows(path, data, spec, invalid_rows)
        _warn_skipped(path, _PARSED[key].skipped)
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
        examples_sha256=examples_sha256(prepared.examples),
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
    role: str = "dev",
) -> EncodedSplit:
    """Read, validate and tokenize one file (``role``'s part of a task's one split file); cached per (file sha256,
    tokenizer, max_length, task, role).

    ``limit`` keeps a seeded random subset of that many examples (in file
    order). A cache hit returns the very same object without re-reading rows
    or re-tokenizing; only the file's bytes are re-hashed, so an edited file is
    never served stale.
    """
    _check_encoding_args(spec, tokenizer, max_length, limit)
    fingerprint = tokenizer_fingerprint(tokenizer)
    key, prepared = _prepare_file(Path(path), spec, role, fingerprint, max_length, invalid_rows)
    return _finish(key, prepared, tokenizer, limit, seed)


def load_tasks(settings: DataSettings, specs: Iterable[TaskSpec | str], tokenizer) -> dict[str, TaskData]:
    """Train and dev splits of every task, keyed by task name, in the order given, read as ``settings`` say.

    All files are read and validated before any is tokenized, so a bad last
    file fails in a fraction of a second and nothing is returned half-loaded.
    ``max_*_examples`` cap each task with a seeded random subset (see ``_limited``).
    ``selection_examples``: carve a selection split of that many train rows per task (``None``: as
    many as the task's dev split; ``False``: none), disjoint from the train rows (see :func:`carve`);
    ``decision_examples``: a decision split of that many further train rows per task (0: none; it needs a
    selection split); a train file too small for them is refused (:func:`check_roles`).
    """
    files = task_files(settings.data_dir, specs, settings.invalid_rows)
    for spec, limit in itertools.product({s for s, _, _ in files}, (settings.max_train_examples,
                                                                     settings.max_dev_examples)):  # fmt: skip
        _check_encoding_args(spec, tokenizer, settings.max_length, limit)

    fingerprint = tokenizer_fingerprint(tokenizer)
    prepared = {  # phase 1: read + validate everything (cheap)
        (spec.name, part): _prepare_file(path, spec, part, fingerprint, settings.max_length, settings.invalid_rows)
        for spec, part, path in files
    }
    _PARSED.clear()  # the rows are in `prepared` now, or tokenized already
    selecting = settings.selection_examples is not False
    limits = {"train": None if selecting else settings.max_train_examples, "dev": settings.max_dev_examples}
    splits = {  # phase 2: tokenize what the cache did not have
        (name, part): _finish(key, item, tokenizer, limits[part], settings.seed)
        for (name, part), (key, item) in prepared.items()
    }
    names = dict.fromkeys(spec.name for spec, _, _ in files)
    tasks = {name: TaskData(train=splits[name, "train"], dev=splits[name, "dev"]) for name in names}
    if selecting:
        for data in tasks.values():
            size = len(data.dev) if settings.selection_examples is None else settings.selection_examples
            data.train, data.selection, data.decision = carve(
                data.train, settings.max_train_examples, size, settings.seed, settings.decision_examples
            )
    return tasks


def task_files(
    data_dir: str | os.PathLike | None, specs: Iterable[TaskSpec | str], invalid_rows: str = "raise"
) -> list[tuple[TaskSpec, str, Path]]:
    """(task, "train" or "dev", path) of every task's files, in order, each class task's labels resolved (read
    from its train file where it lists none); refused when a task is named twice, or when the data directory a
    task reads from is not one. A task file's own files are read beside it (``data_dir`` may then be None)."""
    if data_dir is not None and not os.fspath(data_dir).strip():  # Path("") is the working directory
        raise UserError(f"data directory {os.fspath(data_dir)!r}: an empty path; expected a directory")
    if data_dir is not None and "\0" in os.fspath(data_dir):  # not "not found": no directory can be named so
        raise DataError(os.fspath(data_dir).replace("\0", "\\0"), "the path holds a NUL byte", expected="a directory")
    specs = [get_task(s) if isinstance(s, str) else s for s in specs]
    if not specs:
        raise UserError("no task to load")
    if len({s.name for s in specs}) != len(specs):
        raise UserError(f"a task is named twice in {[s.name for s in specs]}")
    paths = {(spec.name, role): task_path(data_dir, spec, role) for spec in specs for role in ("train", "dev")}
    if data_dir is not None and not Path(data_dir).is_dir():
        needed = [path.name for path in paths.values() if path.parent == Path(data_dir)]
        if needed:
            problem = "is not a directory" if Path(data_dir).exists() else "data directory not found"
            raise DataError(data_dir, problem, expected=f"a directory holding {', '.join(dict.fromkeys(needed))}")
    specs = [resolve_labels(data_dir, spec, invalid_rows) for spec in specs]
    return [(spec, role, paths[spec.name, role]) for spec in specs for role in ("train", "dev")]


def check_files(
    data_dir: str | os.PathLike | None, specs: Iterable[TaskSpec | str], invalid_rows: str = "raise"
) -> list[TaskSpec]:
    """Read and validate every task file without a tokenizer, so a bad row is refused before the tokenizer's
    library loads (seconds); returns the tasks, their labels resolved. The rows read are kept for
    :func:`load_tasks`, which then does not parse them again."""
    check_policy(invalid_rows)
    files = task_files(data_dir, specs, invalid_rows)
    for spec, role, path in files:
        data = read_bytes(path)
        rows = _role_rows(path, data, hashlib.sha256(data).hexdigest(), spec, role, invalid_rows)
        labelled(path, rows, spec, role, invalid_rows)  # a dev label the train file lacks is refused here too
    return list(dict.fromkeys(spec for spec, _, _ in files))


def carve(
    train: EncodedSplit, limit: int | None, selection: int, seed: int, decision: int = 0
) -> tuple[EncodedSplit, EncodedSplit, EncodedSplit | None]:
    """(train, selection, decision): disjoint seeded subsets of a train file, each in file order.

    One seeded permutation of the rows: the selection split is its last ``selection`` rows, the decision
    split the ``decision`` rows before them, train the first ``limit`` rows of the rest (all of the rest
    with ``limit`` None). Where the budget leaves enough unused rows, train is exactly the subset
    ``_limited`` gives without these splits, so they cost the training nothing; where the budget would use
    those rows, they are held out of it. A file too small for the roles is refused (:func:`check_roles`: at least
    half of what the held-out splits leave stays for training), naming what would fit. The held-out splits
    do not depend on ``limit``: a search (a few rows) and its confirmation (every row not held out) carve the
    same selection and decision rows, and the search's train rows are a prefix of the confirmation's.
    """
    n = len(train)
    if not isinstance(selection, int) or isinstance(selection, bool) or not 1 <= selection < n:
        raise DataError(
            train.source, f"selection_examples {selection!r} of {n} rows", expected=f"an integer from 1 to {n - 1}"
        )
    check_roles(train.task, n, selection, decision, where=train.source)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    kept = order[: min(limit or n, n - selection - decision)]
    chosen = order[n - selection - decision : n - selection].sort().values
    decided = train.subset(chosen) if decision else None
    return train.subset(kept.sort().values), train.subset(order[n - selection :].sort().values), decided


def check_roles(task: str, rows: int, selection: int, decision: int, where: str = "") -> None:
    """Refuse a train file too small for the roles carved from it: the selection split, the decision split, and
    at least half of what they leave for training. The message says what would fit."""
    if selection >= rows:
        raise DataError(
            where or task,
            f"task {task!r}: {rows} train rows cannot hold a selection split of {selection} and train rows",
            expected=f"selection_examples of at most {rows - 1} (as large as dev unless set), or a larger train file",
        )
    room = max(0, rows - selection - max(1, (rows - selection) // 2))
    if decision > room:
        raise DataError(
            where or task,
            f"task {task!r}: {rows} train rows leave {rows - selection} after a selection split of {selection}; a "
            f"decision split of {decision} would leave fewer than half of those to train on",
            expected=f"decision_examples of at most {room}, or a larger train file",
        )


def check_role_sizes(settings: DataSettings, specs: Sequence[TaskSpec]) -> None:
    """:func:`check_roles` for every task, from the rows :func:`check_files` read (before any tokenization)."""
    invalid_rows, selection_examples = settings.invalid_rows, settings.selection_examples
    if selection_examples is False:
        return
    files = task_files(settings.data_dir, specs, invalid_rows)
    rows = {}
    for spec, role, path in files:
        data = read_bytes(path)
        found = _role_rows(path, data, hashlib.sha256(data).hexdigest(), spec, role, invalid_rows)
        rows[spec.name, role] = len(labelled(path, found, spec, role, "skip")[0])
    for name in dict.fromkeys(name for name, _ in rows):
        dev = min(rows[name, "dev"], settings.max_dev_examples or rows[name, "dev"])
        selection = dev if selection_examples is None else selection_examples
        check_roles(name, rows[name, "train"], selection, settings.decision_examples)


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
