"""Tasks as declarations (issue 53): task files, the formats pandas/pyarrow read, label ids, seeded splits, the
metrics, one-line refusals of bad input, and the guide's example task end to end through `peftune train`."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import torch
from scipy import stats

from peftune.base.errors import UserError
from peftune.inputs import data, tasks
from peftune.inputs.data import DataError
from peftune.sweep.spaces import SpaceError

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "questions"

ROWS = [  # (text, label): a small sentiment-like task with text labels
    ("a gripping, tender film", "pos"),
    ("dull and far too long", "neg"),
    ("the cast is wonderful", "pos"),
    ("a mess of a script", "neg"),
    ("I smiled all the way through", "pos"),
    ("tedious, flat, forgettable", "neg"),
    ("it earns every tear", "pos"),
    ("nothing here works", "neg"),
] * 3


pytestmark = pytest.mark.usefixtures("clean_data")  # conftest: no tokenized split or declared task left over


def task_file(folder: Path, body: str, name: str = "task.yaml") -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(body))
    return path


def frame(rows) -> pd.DataFrame:
    return pd.DataFrame({"review": [t for t, _ in rows], "verdict": [y for _, y in rows]})


# ----------------------------------------------------------------------------- shipped declarations


# what the code registered for each task before tasks became files (17f0bba's tasks.py)
REGISTERED = {
    "sst": ("multiclass", ("sentence",), "sentiment", 5, "accuracy", "SST", "ids-sst-test.csv", 0.0),
    "para": ("binary", ("sentence1", "sentence2"), "is_duplicate", 1, "accuracy", "Quora", "quora-test.csv", 0.0),
    "sts": ("regression", ("sentence1", "sentence2"), "similarity", 1, "pearson", "STS", "sts-test.csv", 2.5),
    "cfimdb": ("binary", ("sentence",), "sentiment", 1, "accuracy", "CFIMDB", "ids-cfimdb-test.csv", 0.0),
}


@pytest.mark.parametrize("name", sorted(REGISTERED))
def test_shipped_task_files_declare_what_the_code_registered(name):
    spec = tasks.get_task(name)
    found = (spec.kind, spec.text_columns, spec.label_column, spec.num_outputs, spec.metric, spec.display_name,
             spec.test_file, spec.head_center)  # fmt: skip
    assert found == REGISTERED[name]
    assert spec.is_shipped and spec.metric_name == f"{name}_{spec.metric}"


def test_no_task_is_registered_in_code():
    source = (REPO / "platform" / "peftune" / "inputs" / "tasks.py").read_text()
    assert "TaskSpec(" not in source.split("class TaskSpec", 1)[0] + source.split("_TASKS: dict", 1)[1]
    assert sorted(tasks.shipped_names()) == sorted(p.stem for p in tasks.SHIPPED_DIR.glob("*.yaml"))


# ----------------------------------------------------------------------------- formats and labels


def test_csv_jsonl_and_parquet_of_the_same_data_give_the_same_examples(tmp_path, tokenizer):
    frame(ROWS).to_csv(tmp_path / "reviews.csv", index=False)
    frame(ROWS).to_json(tmp_path / "reviews.jsonl", orient="records", lines=True)
    frame(ROWS).to_parquet(tmp_path / "reviews.parquet")
    hashes, ids = {}, {}
    for suffix in ("csv", "jsonl", "parquet"):
        spec = tasks.load_task_file(task_file(tmp_path, f"""\
            name: reviews-{suffix}
            kind: binary
            text: review
            label: verdict
            train: reviews.{suffix}
            dev: reviews.{suffix}
            """, f"{suffix}.yaml"))  # fmt: skip
        spec = data.resolve_labels(None, spec)
        split = data.encode_split(tmp_path / f"reviews.{suffix}", spec, tokenizer, max_length=16, role="train")
        hashes[suffix], ids[suffix] = split.examples_sha256, split.input_ids
        assert spec.labels == ("neg", "pos")  # code-point order: neg is 0, pos is 1
        assert split.labels.tolist() == [float(y == "pos") for _, y in ROWS]
        data.clear_cache()
    assert len(set(hashes.values())) == 1, hashes
    assert torch.equal(ids["csv"], ids["jsonl"]) and torch.equal(ids["csv"], ids["parquet"])
    assert len({data.file_sha256(tmp_path / f"reviews.{s}") for s in ("csv", "jsonl", "parquet")}) == 3


def test_listed_labels_give_the_ids_in_their_order(tmp_path):
    frame(ROWS).to_csv(tmp_path / "r.csv", index=False)
    spec = tasks.load_task_file(task_file(tmp_path, """\
        name: listed
        kind: binary
        text: review
        label: verdict
        labels: [pos, neg]
        train: r.csv
        dev: r.csv
        """))  # fmt: skip
    examples = data.read_task_file(tmp_path / "r.csv", spec)
    assert [e.label for e in examples] == [float(y == "neg") for _, y in ROWS]
    assert spec.declaration()["labels"] == ["pos", "neg"]


def test_a_dev_label_the_train_file_lacks_is_refused_at_its_line(tmp_path):
    frame(ROWS).to_csv(tmp_path / "train.csv", index=False)
    frame([("fine", "pos"), ("so-so", "meh")]).to_csv(tmp_path / "dev.csv", index=False)
    spec = tasks.load_task_file(task_file(tmp_path, """\
        name: unseen
        kind: multiclass
        text: review
        label: verdict
        train: train.csv
        dev: dev.csv
        """))  # fmt: skip
    with pytest.raises(DataError, match=r"dev.csv, line 3: label 'meh' of the dev split does not occur in the train"):
        data.check_files(None, [spec])


def test_one_file_is_split_per_class_with_its_own_seed(tmp_path):
    rows = [(f"text number {i}", "abc"[i % 3]) for i in range(300)]
    frame(rows).to_csv(tmp_path / "all.csv", index=False)
    body = """\
        name: onefile
        kind: multiclass
        text: review
        label: verdict
        file: all.csv
        split: {dev: 0.2, test: 0.1, seed: SEED}
        """
    spec = tasks.load_task_file(task_file(tmp_path, body.replace("SEED", "3")))
    parts = {role: data.read_task_file(tmp_path / "all.csv", spec, role=role) for role in spec.roles}
    texts = {role: {e.texts for e in examples} for role, examples in parts.items()}
    assert [len(parts[r]) for r in ("train", "dev", "test")] == [210, 60, 30]
    assert not (texts["train"] & texts["dev"] or texts["train"] & texts["test"] or texts["dev"] & texts["test"])
    for role, examples in parts.items():  # stratified: each class a third of every role
        assert {c: sum(e.label == c for e in examples) for c in (0.0, 1.0, 2.0)} == dict.fromkeys(
            (0.0, 1.0, 2.0), len(examples) // 3), role  # fmt: skip
    again = {role: data.read_task_file(tmp_path / "all.csv", spec, role=role) for role in spec.roles}
    assert again == parts  # the same seed, the same split
    other = tasks.load_task_file(task_file(tmp_path, body.replace("SEED", "4"), "other.yaml"))
    assert {e.texts for e in data.read_task_file(tmp_path / "all.csv", other, role="dev")} != texts["dev"]


# ----------------------------------------------------------------------------- metrics


def test_the_metrics_match_their_definitions():
    labels = torch.tensor([0, 0, 1, 1, 2, 2, 2, 1.0])
    predicted = torch.tensor([0, 1, 1, 1, 2, 0, 2, 2.0])
    spec = dict(name="m", kind="multiclass", text_columns=("t",), label_column="y", labels=(0, 1, 2))
    f1 = tasks.TaskSpec(**spec, metric="f1").score(predicted, labels)
    per_class = []
    for c in (0, 1, 2):
        tp = float(((predicted == c) & (labels == c)).sum())
        per_class.append(2 * tp / float((predicted == c).sum() + (labels == c).sum()))
    assert f1 == pytest.approx(sum(per_class) / 3)
    mcc = tasks.TaskSpec(**spec, metric="mcc").score(predicted, labels)
    binary = tasks.TaskSpec(name="b", kind="binary", text_columns=("t",), label_column="y", metric="mcc")
    yb, pb = torch.tensor([1, 1, 0, 0, 1, 0.0]), torch.tensor([1, 0, 0, 1, 1, 0.0])
    tp, tn, fp, fn = 2, 2, 1, 1
    assert binary.score(pb, yb) == pytest.approx((tp * tn - fp * fn) / math.sqrt(3 * 3 * 3 * 3))
    assert -1 <= mcc <= 1 and mcc > 0
    x, y = torch.tensor([0.1, 0.5, 0.5, 2.0, 3.0]), torch.tensor([1.0, 2.0, 3.0, 3.0, 5.0])
    regression = tasks.TaskSpec(name="r", kind="regression", text_columns=("t",), label_column="y", metric="spearman")
    assert regression.score(x, y) == pytest.approx(stats.spearmanr(x.numpy(), y.numpy()).statistic)


# ----------------------------------------------------------------------------- bad input


BAD_TASKS = {  # case -> (task file body, the data it reads, words of the one-line refusal)
    "missing column": ("text: review\nlabel: stars", ROWS, "missing column(s) stars"),
    "float in a multiclass task": (
        "text: review\nlabel: verdict",
        [("good", 1.5), ("bad", 2)] * 4,
        "is not a class label",
    ),
    "text in a regression": ("kind: regression\ntext: review\nlabel: verdict", ROWS, "is not a number"),
    "pair task given one text column": ("text: [review]\nlabel: verdict", ROWS, "text: "),
    "an unknown key": ("text: review\nlabel: verdict\ncolumns: [a]", ROWS, "columns: unknown key"),
    "labels of a regression": ("kind: regression\ntext: review\nlabel: verdict\nlabels: [a, b]", ROWS, "labels: "),
    "an empty file": ("text: review\nlabel: verdict", None, "the file is empty"),
}


@pytest.mark.parametrize("case", [*sorted(BAD_TASKS), "text in a regression, Parquet"])
def test_bad_task_files_are_refused_in_one_line_before_any_work(tmp_path, case):
    body, rows, words = BAD_TASKS[case.removesuffix(", Parquet")]
    name = "d.parquet" if case.endswith("Parquet") else "d.csv"
    if rows is None:
        (tmp_path / name).write_text("")
    elif name.endswith(".parquet"):  # read from Arrow's own buffer: a Python file object could abort the exit
        frame(rows).to_parquet(tmp_path / name)
    else:
        frame(rows).to_csv(tmp_path / name, index=False)
    kind = "" if "kind:" in body else "kind: multiclass\n"
    path = task_file(tmp_path, f"name: bad\n{kind}{body}\ntrain: {name}\ndev: {name}\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = tmp_path / "out"
    command = [sys.executable, "-m", "peftune.cli.commands", "train", "--task", str(path), "--method", "frozen",
               "--output", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    errors = [line for line in done.stderr.splitlines() if ": error: " in line]
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(errors) == 1 and words in errors[0] and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert not out.exists()


def test_a_split_that_leaves_a_role_empty_is_refused(tmp_path):
    frame(ROWS[:6]).to_csv(tmp_path / "all.csv", index=False)
    spec = tasks.load_task_file(task_file(tmp_path, "name: tiny\nkind: binary\ntext: review\nlabel: verdict\n"
                                                    "file: all.csv\nsplit: {dev: 0.05}\n"))  # fmt: skip
    with pytest.raises(DataError, match=r"all.csv: task 'tiny': its split gives the dev role none of the file's 6"):
        data.check_files(None, [spec])


def test_two_tasks_of_one_name_are_refused(tmp_path):
    a = task_file(tmp_path / "a", "name: same\nkind: binary\ntext: review\nlabel: verdict\ntrain: d.csv\ndev: d.csv\n")
    b = task_file(tmp_path / "b", "name: same\nkind: binary\ntext: review\nlabel: verdict\ntrain: e.csv\ndev: e.csv\n")
    with pytest.raises(UserError, match="given twice"):
        tasks.resolve_tasks([str(a), str(b)])
    with pytest.raises(UserError, match="taken by a shipped task"):
        tasks.resolve_tasks([str(task_file(tmp_path / "c", "name: sst\nkind: binary\ntext: r\nlabel: v\n"
                                           "train: d.csv\ndev: d.csv\n"))])  # fmt: skip


def test_a_train_file_too_small_for_the_roles_is_refused_saying_what_fits(tmp_path):
    frame(ROWS).to_csv(tmp_path / "r.csv", index=False)
    spec = tasks.load_task_file(task_file(tmp_path, "name: small\nkind: binary\ntext: review\nlabel: verdict\n"
                                                    "train: r.csv\ndev: r.csv\n"))  # fmt: skip
    settings = data.DataSettings(None, selection_examples=4, decision_examples=20)
    with pytest.raises(DataError, match=r"a decision split of 20 would leave .* expected decision_examples of at most"):
        data.check_role_sizes(settings, [spec])
    data.check_role_sizes(dataclasses.replace(settings, decision_examples=10), [spec])


def test_a_task_file_error_names_the_file_and_key(tmp_path):
    path = task_file(tmp_path, "name: x\nkind: ternary\ntext: a\nlabel: b\ntrain: t.csv\ndev: d.csv\n")
    with pytest.raises(SpaceError) as caught:
        tasks.load_task_file(path)
    assert caught.value.key == "kind" and "task.yaml" in str(caught.value) and "multiclass" in str(caught.value)


# ----------------------------------------------------------------------------- the guide's example


def test_the_guides_example_task_trains_with_peftune_train(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "peftune.cli.commands", "train", "--task", str(EXAMPLE / "task.yaml"),
                           "--method", "lora", "--epochs", "1", "--max-length", "32", "--output", str(tmp_path / "o")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    spec = json.loads((tmp_path / "o" / "trial_spec.json").read_text())
    assert spec["train"]["tasks"] == ["questions"]
    assert "questions_f1" in done.stderr + done.stdout
