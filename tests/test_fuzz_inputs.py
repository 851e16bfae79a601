"""Issue 9, bad input: the data readers refuse what used to pass silently, and a property-based fuzz of
the readers and the YAML loaders: random bad input raises only DataError / SpaceError, bounded, one line.

Fixed seed (derandomize) and a bounded number of examples, so CI is fast and reproducible
(``PEFTUNE_FUZZ_EXAMPLES`` sets how many per fuzz test: 200 by default). Each fuzz test counts its
inputs and clean errors in FUZZ_COUNTS (printed with ``pytest -s``).
"""

from __future__ import annotations

import os
import string
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peftune.inputs import data
from peftune.inputs.data import DataError
from peftune.inputs.tasks import get_task
from peftune.sweep import spaces
from peftune.sweep.spaces import SpaceError

PARA = get_task("para")
HEADER = "\tid\tsentence1\tsentence2\tis_duplicate\n"
FUZZ = settings(
    max_examples=int(os.environ.get("PEFTUNE_FUZZ_EXAMPLES", "200")),
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
FUZZ_COUNTS: Counter = Counter()
MAX_MESSAGE = 600


def para_file(tmp_path: Path, rows: str, name: str = "quora-train.csv") -> Path:
    path = tmp_path / name
    path.write_text(HEADER + rows, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "rows, line, message",
    [
        ("0\ta\tfine\t\x00\x00\x01\t1\n", 2, "no printable character"),
        ("0\ta\thow are\tyou\t1\n1\tb\t\x07 \x1b\tok\t0\n", 3, "no printable character"),
        ('0\ta\tgood\tfine\t1\n1\tb\t"bad\tx\t0\n2\tc\tugly"\ty\t1\n', 3, "is a double quote unbalanced"),
        ("0\ta\tx\t" + "word " * 200_000 + "\t1\n", 2, "characters"),
        ("0\ta\tone\ttwo\t1\n1\ta\tthree\tfour\t0\n", 3, "id 'a' is repeated with another text or label"),
    ],
)
def test_readers_refuse_what_passed_silently(tmp_path, rows, line, message):
    text = rows
    with pytest.raises(DataError) as caught:
        data.read_task_file(para_file(tmp_path, text), PARA)
    assert (
        f"line {line}" in str(caught.value) and message in str(caught.value) and "quora-train.csv" in str(caught.value)
    )


def test_unbalanced_quote_row_is_skipped_not_swallowed(tmp_path):
    rows = '0\ta\tgood\tfine\t1\n1\tb\t"bad\tx\t0\n2\tc\tugly"\ty\t1\n3\td\tlast\tone\t0\n'
    with pytest.raises(DataError, match="line 3"):
        data.read_task_file(para_file(tmp_path, rows), PARA)
    examples = data.read_task_file(para_file(tmp_path, rows), PARA, invalid_rows="skip")
    assert [e.texts for e in examples] == [("good", "fine"), ("last", "one")]  # the merged rows are reported


def test_a_header_quoting_the_files_text_stays_one_bounded_line(tmp_path):
    # found by the fuzz at 5,000 examples: a quote in the header swallows the rows into its cells
    path = tmp_path / "quora-train.csv"
    path.write_text('\t"\n0\tid0\t\t\t1\n' + "1\tid1\t" + "w " * 5000 + "\t\t0\n", encoding="utf-8")
    with pytest.raises(DataError, match="line 1: missing column") as caught:
        data.read_task_file(path, PARA)
    assert "\n" not in str(caught.value) and "\t" not in str(caught.value) and len(str(caught.value)) < MAX_MESSAGE


def test_a_megabyte_field_names_the_line_and_the_limit(tmp_path):
    path = para_file(tmp_path, "0\ta\tx\ty\t1\n1\tb\t" + "x" * 1_100_000 + "\ty\t0\n")
    with pytest.raises(DataError, match=r"line 3: text of 1,100,000 characters.*at most 20,000"):
        data.read_task_file(path, PARA)


def test_duplicated_header_column_and_identical_duplicate_ids(tmp_path):
    path = tmp_path / "quora-dev.csv"
    path.write_text("\tid\tsentence1\tsentence1\tsentence2\tis_duplicate\n0\ta\tx\ty\tz\t1\n")
    with pytest.raises(DataError, match="line 1.*sentence1 appear twice in the header"):
        data.read_task_file(path, PARA)
    same = para_file(tmp_path, "0\ta\tone\ttwo\t1\n1\ta\tone\ttwo\t1\n")  # an exact repeat is not a conflict
    assert len(data.read_task_file(same, PARA)) == 2


def _bounded(error: Exception) -> bool:
    text = str(error)
    return len(text) <= MAX_MESSAGE and "\n" not in text


# a TSV-ish alphabet: separators, quotes, line breaks, control characters, digits and letters
_CELL = st.text(alphabet=st.sampled_from(list("\t\n\r\"' \x00\x01\x1b\u2028é01-.eaNnif") + ["\ufeff"]), max_size=8)


@FUZZ
@given(
    rows=st.lists(st.lists(_CELL, min_size=2, max_size=5), max_size=6),
    valid_row=st.booleans(),
    header=st.sampled_from([HEADER, "id\tsentence1\tsentence2\tis_duplicate\n", "", "\t\t\n", "sentence1\n"]),
    raw=st.binary(max_size=40),
)
def test_fuzz_data_reader_raises_only_data_errors(tmp_path_factory, rows, valid_row, header, raw):
    path = tmp_path_factory.mktemp("fuzz") / "quora-train.csv"
    lines = [f"{i}\tid{i}\t" + "\t".join(cells) for i, cells in enumerate(rows)]
    lines += ["99\tok\ta good text\tanother text\t1\n"] if valid_row else []
    path.write_bytes(header.encode() + "\n".join(lines).encode("utf-8", "surrogatepass") + raw)
    FUZZ_COUNTS["data: inputs"] += 1
    for policy in ("raise", "skip"):
        try:
            examples = data.read_task_file(path, PARA, invalid_rows=policy)
        except DataError as error:
            assert _bounded(error), str(error)[:1000]
            FUZZ_COUNTS[f"data {policy}: clean errors"] += 1
        else:  # what is accepted is valid: printable, one-line texts and labels in range
            assert examples and all(t.strip() and "\n" not in t for e in examples for t in e.texts)
            assert all(e.label in (0.0, 1.0) for e in examples)
            FUZZ_COUNTS[f"data {policy}: accepted (valid)"] += 1


_SCALAR = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(string.printable, max_size=12),
)  # fmt: skip
_VALUE = st.recursive(
    _SCALAR, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text("abclowhig", max_size=6), inner,
                                                                          max_size=4), max_leaves=12
)  # fmt: skip
_SWEEP_KEYS = sorted(spaces._SWEEP_KEYS) if hasattr(spaces, "_SWEEP_KEYS") else []
_METHOD_KEYS = ["method", "lr", "dropout", "weight_decay", "options", "description"]
_VALID_SWEEP = {
    "name": "fz", "tasks": ["sst"], "methods": ["lora"], "seed": 0, "train": {"warmup_ratio": 0.1},
    "resources": {"cpus_per_trial": 1}, "budget": "s", "budgets": {"s": {"trials_per_method": 1, "epochs": 1}},
}  # fmt: skip
_VALID_LORA = {
    "method": "lora", "lr": {"low": 1e-4, "high": 1e-2, "log": True}, "dropout": 0.1, "weight_decay": 0.0,
    "options": {"rank": {"choices": [2, 4]}, "alpha": 16},
}  # fmt: skip


def _mutate(base: dict, changes: dict) -> dict:
    out = dict(base)
    for key, value in changes.items():
        if value is None and key in out:
            del out[key]
        else:
            out[key] = value
    return out


def _yaml_text(document) -> str:
    import yaml

    return yaml.safe_dump(document, sort_keys=False, allow_unicode=True)


_RAW_YAML = st.lists(
    st.sampled_from(list("&*!{}[]:,-?|>'\"#%@` \n\tab01.e") + ["<<", ".nan", ".inf", "lr", "low", "method: lora\n"]),
    max_size=40,
).map("".join)


@FUZZ
@given(
    sweep_changes=st.dictionaries(st.sampled_from(_SWEEP_KEYS), _VALUE, max_size=3),
    lora_changes=st.dictionaries(st.sampled_from(_METHOD_KEYS), _VALUE, max_size=2),
    raw=_RAW_YAML,
    use_raw=st.booleans(),
)
def test_fuzz_yaml_loaders_raise_only_space_errors(tmp_path_factory, sweep_changes, lora_changes, raw, use_raw):
    folder = tmp_path_factory.mktemp("fuzz")
    (folder / "methods").mkdir()
    (folder / "methods" / "lora.yaml").write_text(raw if use_raw else _yaml_text(_mutate(_VALID_LORA, lora_changes)))
    sweep = folder / "fz.yaml"
    sweep.write_text(_yaml_text(_mutate(_VALID_SWEEP, sweep_changes)) + ("\n" + raw if use_raw else ""))
    FUZZ_COUNTS["yaml: inputs"] += 1
    try:
        definition = spaces.load_sweep(sweep)
    except SpaceError as error:
        assert _bounded(error), str(error)[:1000]
        FUZZ_COUNTS["yaml: clean errors"] += 1
    else:  # what is accepted is finite and in range
        definition.fingerprint()
        assert 0 <= definition.seed <= data.MAX_SEED and definition.resources.cpus_per_trial > 0
        FUZZ_COUNTS["yaml: accepted (valid)"] += 1


def test_fuzz_counts():
    """Runs after the fuzz tests in this module: every generated input was tried and ended cleanly."""
    print(dict(FUZZ_COUNTS))
    wanted = min(100, FUZZ.max_examples)  # hypothesis stops early once its search space is spent
    if FUZZ_COUNTS["data: inputs"]:
        assert FUZZ_COUNTS["data: inputs"] >= wanted
    if FUZZ_COUNTS["yaml: inputs"]:
        assert FUZZ_COUNTS["yaml: inputs"] >= wanted
