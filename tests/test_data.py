"""Data pipeline: validation messages, quoting, pair encoding, cache, budgets, bucketing, task schedules.

Small files are written to tmp_path; the tokenizer is the real (offline) default one.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from peftune.inputs import data
from peftune.inputs.data import DataError
from peftune.inputs.tasks import get_task

SST, STS, PARA = get_task("sst"), get_task("sts"), get_task("para")
SENTENCE_HEADER = "\tid\tsentence\tsentiment\n"
PAIR_HEADER = "\tid\tsentence1\tsentence2\tsimilarity\n"


pytestmark = pytest.mark.usefixtures("clean_data")  # conftest: no tokenized split or declared task left over


def write(path: Path, text: str) -> Path:
    path.write_bytes(text.encode("utf-8"))
    return path


def sentence_file(path: Path, sentences, labels=None) -> Path:
    labels = labels if labels is not None else [i % 5 for i in range(len(sentences))]
    rows = "".join(f"{i}\tid{i}\t{s}\t{y}\n" for i, (s, y) in enumerate(zip(sentences, labels, strict=True)))
    return write(path, SENTENCE_HEADER + rows)


def random_sentences(n: int, seed: int = 0, max_words: int = 40) -> list[str]:
    rng = random.Random(seed)
    words = "the movie was good bad long short funny dull and but very quite plot actor scene".split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, max_words))) for _ in range(n)]


# --------------------------------------------------------------------------- reading


def test_quoted_fields_whitespace_and_pairs(tmp_path):
    path = write(
        tmp_path / "pairs.csv",
        PAIR_HEADER
        + '0\ta\t"""How do you use """"who""""?"""\t  plain second  \t4.2\n'
        + '1\tb\t"a\ttab inside quotes"\tx\t0\n',
    )
    examples = data.read_task_file(path, STS)
    # one level of CSV quoting is undone; the files carry a second one, kept as text (as the CS224N loader does)
    assert examples[0].texts == ('"How do you use ""who""?"', "plain second")
    assert examples[0].label == pytest.approx(4.2)
    assert examples[1].texts == ("a\ttab inside quotes", "x")
    texts, label = examples[1]  # plain (texts, label) tuples
    assert label == 0.0


# (file content, task, line number in the message, words of the expectation)
INVALID_FILES = {
    "missing column": ("\tid\tsentence\tlabel\n0\ta\tfine\t1\n", SST, 1, "columns sentence, sentiment"),
    "label out of range": (SENTENCE_HEADER + "0\ta\tfine\t1\n1\tb\tgood\t7\n", SST, 3, "one of 0, 1, 2, 3, 4"),
    "label not integer": (SENTENCE_HEADER + "0\ta\tfine\t1.5\n", SST, 2, "one of 0, 1, 2, 3, 4"),
    "label not a number": (SENTENCE_HEADER + "0\ta\tfine\t1\n1\tb\tgood\tpositive\n", SST, 3, "one of 0, 1, 2, 3, 4"),
    "label nan": (SENTENCE_HEADER + "0\ta\tfine\tnan\n", SST, 2, "one of 0, 1, 2, 3, 4"),
    # float() reads these as 3; the files' format is ASCII digits (issue 34)
    "label arabic-indic digit": (SENTENCE_HEADER + "0\ta\tfine\t1\n1\tb\tgood\t\u0663\n", SST, 3, "ASCII digits"),
    "label fullwidth digit": (SENTENCE_HEADER + "0\ta\tfine\t\uff13\n", SST, 2, "ASCII digits"),
    "label with underscore": (SENTENCE_HEADER + "0\ta\tfine\t0_3\n", SST, 2, "ASCII digits"),
    "similarity fullwidth": (PAIR_HEADER + "0\ta\tone\ttwo\t\uff12.5\n", STS, 2, "a number in [0, 5] in ASCII"),
    "too few fields": (SENTENCE_HEADER + "0\ta\tfine\t1\n1\tb\tgood\n", SST, 3, "4 tab-separated fields"),
    "too many fields": (SENTENCE_HEADER + "0\ta\tfine\t1\textra\n", SST, 2, "4 tab-separated fields"),
    "empty text": (PAIR_HEADER + "0\ta\tone\ttwo\t1\n1\tb\tone\t   \t2\n", STS, 3, "non-empty sentence"),
    "empty file": ("", SST, 1, "header row with columns sentence, sentiment"),
    "header only": (SENTENCE_HEADER, SST, 2, "examples after the header"),
    # an unbalanced quote swallows the next line into the field: reported at the row's first line
    "unbalanced quote": (SENTENCE_HEADER + '0\ta\t"fine\t1\n1\tb\tgood\t2\n', SST, 2, "4 tab-separated fields"),
}


@pytest.mark.parametrize("case", sorted(INVALID_FILES))
def test_validation_errors_name_file_line_and_expectation(tmp_path, case):
    content, spec, line, expectation = INVALID_FILES[case]
    path = write(tmp_path / "bad-file.csv", content)
    with pytest.raises(DataError) as caught:
        data.read_task_file(path, spec)
    message = str(caught.value)
    assert "bad-file.csv" in message and f"line {line}:" in message
    assert "expected" in message and expectation in message, message
    assert isinstance(caught.value, ValueError) and caught.value.line == line


def test_bad_encoding_names_the_line(tmp_path):
    path = tmp_path / "latin1.csv"
    path.write_bytes((SENTENCE_HEADER + "0\ta\tfine\t1\n1\tb\tcaf").encode() + b"\xe9\t2\n")
    with pytest.raises(DataError, match=r"latin1\.csv, line 3: byte 0xe9 is not valid UTF-8; expected UTF-8"):
        data.read_task_file(path, SST)


def test_missing_file_and_missing_directory(tmp_path, tokenizer):
    with pytest.raises(DataError, match=r"nope\.csv: file not found; expected"):
        data.read_task_file(tmp_path / "nope.csv", SST)
    with pytest.raises(DataError, match=r"no-such-dir: data directory not found; expected a directory holding"):
        data.load_tasks(data.DataSettings(str(tmp_path / "no-such-dir")), [SST], tokenizer)


def test_an_empty_data_directory_path_is_refused_not_read_as_the_working_directory(tmp_path, tokenizer, monkeypatch):
    sentence_file(tmp_path / SST.train_file, ["fine"])  # what Path("") would find: the working directory's files
    sentence_file(tmp_path / SST.dev_file, ["fine"])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"data directory '': an empty path; expected a directory"):
        data.load_tasks(data.DataSettings(""), [SST], tokenizer)


def test_data_error_survives_pickling():
    # Ray sends a trial's exception back to the driver pickled: it is rebuilt from __reduce__
    rebuild, args = DataError("f.csv", "bad label", line=3, expected="a number").__reduce__()[:2]
    error = rebuild(*args)
    assert (error.path, error.line, str(error)) == ("f.csv", 3, "f.csv, line 3: bad label; expected a number")


def test_skip_policy_drops_bad_rows_and_records_them(tmp_path, tokenizer):
    path = write(tmp_path / "s.csv", SENTENCE_HEADER + "0\ta\tfine\t1\n1\tb\t\t2\n2\tc\tgood\t9\n3\td\tok\t0\n")
    split = data.encode_split(path, SST, tokenizer, invalid_rows="skip")
    assert len(split) == 2 and split.lines.tolist() == [2, 5]
    assert [line for line, _ in split.skipped] == [3, 4]
    # the strict default still refuses the file, even though a skipping caller already cached it
    with pytest.raises(DataError, match=r"s\.csv, line 3: empty text"):
        data.encode_split(path, SST, tokenizer)


def test_nothing_is_tokenized_when_a_later_file_is_bad(tmp_path, tokenizer, monkeypatch):
    sentence_file(tmp_path / SST.train_file, ["good", "bad"])
    sentence_file(tmp_path / SST.dev_file, ["fine"])
    write(tmp_path / STS.train_file, PAIR_HEADER + "0\ta\tone\ttwo\t1\n")
    write(tmp_path / STS.dev_file, PAIR_HEADER + "0\ta\tone\ttwo\tsix\n")
    calls = []
    monkeypatch.setattr(data, "_tokenize", lambda *args: calls.append(args))
    with pytest.raises(DataError, match=rf"{STS.dev_file}, line 2"):
        data.load_tasks(data.DataSettings(str(tmp_path)), [SST, STS], tokenizer)
    assert calls == []  # every file is validated before the (slow) tokenization starts


# --------------------------------------------------------------------------- encoding


def test_pair_encoding_marks_the_second_sentence(tmp_path, tokenizer):
    path = write(tmp_path / "p.csv", PAIR_HEADER + "0\ta\tA cat sat.\tThe dog ran far away.\t3.5\n")
    split = data.encode_split(path, STS, tokenizer)
    ids, types = split.example(0)
    first = tokenizer("A cat sat.")["input_ids"]  # [CLS] a [SEP]
    second = tokenizer("The dog ran far away.", add_special_tokens=False)["input_ids"] + [tokenizer.sep_token_id]
    assert ids.tolist() == first + second
    assert types.tolist() == [0] * len(first) + [1] * len(second)
    assert split.labels.dtype == torch.float32 and split.labels.tolist() == [3.5]


def test_truncation_to_max_length(tmp_path, tokenizer):
    long = " ".join(["word"] * 300)
    split = data.encode_split(sentence_file(tmp_path / "s.csv", [long, "short"]), SST, tokenizer, max_length=16)
    assert split.lengths.tolist() == [16, 3]
    assert split.example(0)[0][-1].item() == tokenizer.sep_token_id
    assert split.num_tokens() == 19 and split.input_ids.dtype == torch.int32


def test_cache_hit_returns_same_object_without_tokenizing(tmp_path, tokenizer, monkeypatch):
    path = sentence_file(tmp_path / "s.csv", ["one sentence", "another one"])
    calls = []
    tokenize = data._tokenize
    monkeypatch.setattr(data, "_tokenize", lambda *args: calls.append(1) or tokenize(*args))
    first = data.encode_split(path, SST, tokenizer)
    assert data.encode_split(path, SST, tokenizer) is first and len(calls) == 1
    # the key is the tokenizer's content, not the Python object
    import copy

    assert data.encode_split(path, SST, copy.deepcopy(tokenizer)) is first and len(calls) == 1
    assert data.encode_split(path, SST, tokenizer, max_length=64) is not first and len(calls) == 2
    assert data.encode_split(path, SST, tokenizer) is first  # the 64-token call's truncation state is not in the key
    sentence_file(path, ["one sentence", "changed"])  # new content, new hash: never served stale
    changed = data.encode_split(path, SST, tokenizer)
    assert changed is not first and len(calls) == 3
    assert changed.sha256 == data.file_sha256(path) != first.sha256


def test_budget_is_a_seeded_nested_subset(tmp_path, tokenizer):
    path = sentence_file(tmp_path / "s.csv", [f"sentence number {i}" for i in range(200)])
    full = data.encode_split(path, SST, tokenizer)
    small = data.encode_split(path, SST, tokenizer, limit=20, seed=1)
    assert len(small) == 20 and data.encode_split(path, SST, tokenizer, limit=20, seed=1) is small
    lines = small.lines.tolist()
    assert lines == sorted(lines) and lines != list(range(2, 22))  # file order, but not the first rows
    assert set(lines) != set(data.encode_split(path, SST, tokenizer, limit=20, seed=2).lines.tolist())
    assert set(lines) <= set(data.encode_split(path, SST, tokenizer, limit=50, seed=1).lines.tolist())
    for i, line in enumerate(lines):  # each kept example is the same tokens and label as in the full split
        j = full.lines.tolist().index(line)
        assert torch.equal(small.example(i)[0], full.example(j)[0]) and small.labels[i] == full.labels[j]
    assert data.encode_split(path, SST, tokenizer, limit=500) is full


def test_load_tasks_applies_budgets_per_split(tmp_path, tokenizer):
    sentence_file(tmp_path / SST.train_file, random_sentences(60))
    sentence_file(tmp_path / SST.dev_file, random_sentences(30, seed=1))
    rows = [f"{i}\tid{i}\tquestion {i}?\tother question {i}?\t{i % 2}.0\n" for i in range(40)]
    write(tmp_path / PARA.train_file, "\tid\tsentence1\tsentence2\tis_duplicate\n" + "".join(rows))
    write(tmp_path / PARA.dev_file, "\tid\tsentence1\tsentence2\tis_duplicate\n" + "".join(rows[:15]))
    settings = data.DataSettings(os.fspath(tmp_path), max_train_examples=25, max_dev_examples=10)
    tasks = data.load_tasks(settings, ["sst", PARA], tokenizer)
    assert list(tasks) == ["sst", "para"]
    assert [len(tasks[t].train) for t in tasks] == [25, 25] and [len(tasks[t].dev) for t in tasks] == [10, 10]
    assert tasks["para"].train.task == "para" and tasks["para"].train.token_type_ids.max() == 1
    assert len(pickle.dumps(tasks)) < 20_000  # compact: it crosses the Ray object store


# --------------------------------------------------------------------------- batching


@pytest.fixture
def varied_split(tmp_path, tokenizer):
    return data.encode_split(sentence_file(tmp_path / "v.csv", random_sentences(400)), SST, tokenizer)


def padding(batches) -> int:
    return sum(b.input_ids.numel() - int(b.attention_mask.sum()) for b in batches)


def test_batches_cover_every_example_once_with_their_own_tokens(varied_split):
    batches = data.bucketed_batches(varied_split, 16, shuffle=True, generator=torch.Generator().manual_seed(0))
    indices = torch.cat([b.indices for b in batches])
    assert sorted(indices.tolist()) == list(range(len(varied_split)))
    assert sum(len(b) < 16 for b in batches) <= 1
    for batch in batches[:5]:
        assert batch.input_ids.shape == batch.attention_mask.shape == batch.token_type_ids.shape
        assert batch.input_ids.dtype == torch.long and batch.attention_mask.dtype == torch.long
        for row, i in enumerate(batch.indices.tolist()):
            ids, _ = varied_split.example(i)
            n = len(ids)
            assert batch.input_ids[row, :n].tolist() == ids.tolist() and batch.attention_mask[row].sum() == n
            assert (batch.input_ids[row, n:] == varied_split.pad_id).all()
            assert batch.labels[row] == varied_split.labels[i]


def test_batches_are_deterministic_for_a_seed(varied_split):
    def epoch(seed):
        batches = data.bucketed_batches(varied_split, 16, shuffle=True, generator=torch.Generator().manual_seed(seed))
        return [b.indices.tolist() for b in batches]

    assert epoch(3) == epoch(3)
    assert epoch(3) != epoch(4)


def test_bucketing_reduces_padding(varied_split):
    def batches(buckets):
        generator = torch.Generator().manual_seed(0)
        return data.bucketed_batches(
            varied_split, 16, shuffle=True, generator=generator, bucket_size_in_batches=buckets
        )

    random_padding, bucketed_padding = padding(batches(1)), padding(batches(50))  # 1 = plain random batches
    assert bucketed_padding < random_padding / 3, (bucketed_padding, random_padding)


def test_evaluation_batches_restore_file_order(varied_split):
    batches = data.bucketed_batches(varied_split, 32, shuffle=False)
    widths = [b.input_ids.shape[1] for b in batches]
    assert widths == sorted(widths, reverse=True)  # longest first
    restored = data.restore_order(batches, [b.labels for b in batches])
    assert torch.equal(restored, varied_split.labels)
    moved = batches[0].to("cpu")
    assert torch.equal(moved.input_ids, batches[0].input_ids) and moved.indices is batches[0].indices


# --------------------------------------------------------------------------- task schedule


def test_round_robin_uses_each_batch_once_skipping_exhausted_tasks():
    schedule = data.multitask_schedule({"a": 3, "b": 1, "c": 2}, "round_robin")
    assert schedule == ["a", "b", "c", "a", "c", "a"]
    assert data.multitask_schedule({"a": 2, "b": 1}, "round_robin", total=5) == ["a", "b", "a", "a", "b"]


def test_proportional_is_a_seeded_interleaving_of_all_batches():
    counts = {"big": 60, "small": 6}

    def schedule(seed):
        return data.multitask_schedule(counts, "proportional", generator=torch.Generator().manual_seed(seed))

    assert Counter(schedule(0)) == counts and schedule(0) == schedule(0) != schedule(1)
    assert schedule(0)[:6] != ["big"] * 6 or schedule(0)[-6:] != ["small"] * 6  # interleaved, not blocks


def test_temperature_flattens_toward_uniform():
    counts = {"big": 900, "small": 100}

    def small_share(temperature):
        generator = torch.Generator().manual_seed(0)
        schedule = data.multitask_schedule(counts, "temperature", temperature=temperature, generator=generator)
        assert len(schedule) == 1000
        return schedule.count("small") / len(schedule)

    # p(small) = 100^(1/T) / (100^(1/T) + 900^(1/T)): 0.10 at T=1, 0.445 at T=10
    assert small_share(1.0) == pytest.approx(0.10, abs=0.03)
    assert small_share(10.0) == pytest.approx(0.445, abs=0.05)


def test_unknown_strategy_lists_the_valid_ones():
    with pytest.raises(ValueError, match="round_robin, proportional, temperature"):
        data.multitask_schedule({"a": 1}, "uniform")


# --------------------------------------------------------------------------- real data

REAL_DATA = Path(os.environ.get("PEFTUNE_DATA_DIR", Path(__file__).parents[2] / "shared" / "data"))
REAL_ROWS = {
    "sst": (8544, 550),
    "para": (14214, 3000),
    "sts": (6040, 431),
    "cfimdb": (1707, 245),
}


# file -> (examples, sha256 of each example's [texts, label, line], skipped lines): what the csv-module reader this
# project had before pandas/pyarrow (17f0bba) read from the shared files with invalid_rows="skip"
CSV_READER_EXAMPLES = {
    "ids-sst-train.csv": (8544, "6e50c5b03b17f189", []),
    "ids-sst-dev.csv": (550, "44ce59f250d7ad09", []),
    "quora-train.csv": (14212, "807b104e8d96a111", [3296, 11099]),
    "quora-dev.csv": (3000, "44d73861efeee5a5", []),
    "sts-train.csv": (6040, "0ae75b60b3b186c7", []),
    "sts-dev.csv": (431, "5bdfa44074c7c02e", []),
    "ids-cfimdb-train.csv": (1707, "3f5ac8566a24ff0f", []),
    "ids-cfimdb-dev.csv": (245, "777acc28ac7df2e9", []),
}


@pytest.mark.skipif(not REAL_DATA.is_dir(), reason=f"no shared data at {REAL_DATA} (set PEFTUNE_DATA_DIR)")
def test_real_files_give_the_examples_the_csv_reader_gave():
    """The shipped task files, read by pyarrow, give every example (text, label, line) the hand-written csv reader
    gave, and drop the same rows: old records replay on the same examples."""
    seen = set()
    for name, rows in REAL_ROWS.items():
        spec = get_task(name)
        for role, expected_rows in zip(("train", "dev"), rows, strict=True):
            path = REAL_DATA / spec.file_of(role)
            raw = path.read_bytes()
            found = data._role_rows(path, raw, hashlib.sha256(raw).hexdigest(), spec, role, "skip")
            examples, lines, skipped = data.labelled(path, found, spec, role, "skip")
            digest = hashlib.sha256()
            for example, line in zip(examples, lines, strict=True):
                digest.update(json.dumps([example.texts, example.label, line], ensure_ascii=False).encode() + b"\n")
            count, expected_digest, skipped_lines = CSV_READER_EXAMPLES[path.name]
            assert (len(examples), digest.hexdigest()[:16]) == (count, expected_digest), path.name
            assert [line for line, _ in skipped] == skipped_lines, path.name
            # quora-train.csv has two broken rows (lines 3296, 11099); the strict default refuses it
            assert len(examples) + len(skipped) == expected_rows, path.name
            seen.add(path.name)
    assert seen == set(CSV_READER_EXAMPLES)
