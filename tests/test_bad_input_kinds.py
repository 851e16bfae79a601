"""Bad input, kind by kind: each is refused before any work starts, in one stderr line naming the file, flag or
key and what was expected, with exit status 2 and nothing written.

Every test runs the real command line in-process (``peftune.cli.commands.main``). Where the work a refusal must come
before is slow (reading the data, training, starting Ray, loading a benchmark), that work is replaced by a
function that fails the test if it is ever called.
"""

from __future__ import annotations

import os
import shutil
import textwrap

import pytest
import torch

from conftest import REPO
from peftune.cli import commands
from peftune.inputs.backbone import DEFAULT_MODEL, resolve_model_dir


def run(capsys, *argv) -> tuple[int, list[str]]:
    """(exit status, stderr's non-empty lines) of ``peftune <argv>``."""
    try:
        code = commands.main([str(arg) for arg in argv])
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, [line for line in err.splitlines() if line.strip()]


def assert_refused(code: int, lines: list[str], *names: str) -> str:
    """Exit 2, one stderr line, naming every one of ``names``; returns that line."""
    assert code == 2, lines
    assert len(lines) == 1, lines
    for name in names:
        assert name in lines[0], f"{name!r} not named in: {lines[0]}"
    return lines[0]


def must_not_run(what: str):
    def fail(*args, **kwargs):
        raise AssertionError(f"{what} ran: the bad input was not refused up front")

    return fail


@pytest.fixture
def no_training(monkeypatch):
    """Training (and, by default, reading the data) fails the test."""
    from peftune.core import train

    monkeypatch.setattr(train, "run_trial", must_not_run("training"))
    monkeypatch.setattr(train, "prepare", must_not_run("reading the data"))
    return monkeypatch


def train_argv(data_dir, output, *extra) -> list:
    return ["train", "--data-dir", data_dir, "--tasks", "sst", "--epochs", "1", "--max-train-examples", "8",
            "--max-dev-examples", "8", "--output", output, *extra]  # fmt: skip


# ----------------------------------------------------------------------------- 1. a model without its tokenizer


@pytest.mark.parametrize("tokenizer", ["none", "another vocabulary"])
def test_kind1_model_without_its_tokenizer_is_refused_before_training(
    capsys, tmp_path, tiny_data_dir, monkeypatch, tokenizer
):
    packaged = resolve_model_dir(DEFAULT_MODEL)
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(packaged / "config.json", model / "config.json")
    os.symlink(packaged / "model.safetensors", model / "model.safetensors")  # 90 MB: linked, not copied
    if tokenizer == "another vocabulary":  # 6 tokens for a model of 30,522: every word would be [UNK]
        (model / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\na\n")
    from peftune.core import train

    monkeypatch.setattr(train, "run_trial", must_not_run("training"))
    if tokenizer == "none":  # refused before even the weights and the data are read
        monkeypatch.setattr(train, "prepare", must_not_run("reading the data"))
    output = tmp_path / "out"
    code, lines = run(capsys, *train_argv(tiny_data_dir, output, "--model", model))
    line = assert_refused(code, lines, str(model))
    assert ("no tokenizer" if tokenizer == "none" else "vocab_size is 30,522") in line
    assert not output.exists()


# ----------------------------------------------------------------------------- 2. --option KEY of a dedicated flag


@pytest.mark.parametrize(
    "option, flag",
    [("dropout=0.9", "--dropout"), ("rank=4", "--rank"), ("alpha=8", "--alpha")],
)
def test_kind2_option_that_a_flag_sets_is_refused(capsys, tmp_path, tiny_data_dir, no_training, option, flag):
    output = tmp_path / "out"
    code, lines = run(capsys, *train_argv(tiny_data_dir, output, "--option", option))
    assert_refused(code, lines, option, flag)
    assert not output.exists()


# ----------------------------------------------------------------------------- 3. NUL in a data file


@pytest.mark.parametrize("where, line", [("sentence", 3), ("header", 1)])
def test_kind3_nul_in_a_sentence_or_header_is_refused(capsys, tmp_path, tiny_data_dir, monkeypatch, where, line):
    from peftune.core import train

    monkeypatch.setattr(train, "run_trial", must_not_run("training"))
    data = tmp_path / "data"
    data.mkdir()
    for name in ("ids-sst-train.csv", "ids-sst-dev.csv"):
        shutil.copy(tiny_data_dir / name, data / name)
    train_file = data / "ids-sst-train.csv"
    rows = train_file.read_text(encoding="utf-8").splitlines(keepends=True)
    if where == "sentence":
        rows[2] = rows[2].replace(" ", " \x00", 1)  # a NUL inside the second row's sentence
    else:
        rows[0] = rows[0].replace("\tid\t", "\tid\x00\t")  # "id\x00" is not "id": ids would go unchecked
    train_file.write_text("".join(rows), encoding="utf-8")
    code, lines = run(capsys, *train_argv(data, tmp_path / "out"))
    assert_refused(code, lines, str(train_file), f"line {line}", "NUL")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- 4. --output under a regular file


def test_kind4_output_under_a_file_is_refused_before_training(capsys, tmp_path, tiny_data_dir, no_training):
    file = tmp_path / "a-file"
    file.write_text("not a directory")
    code, lines = run(capsys, *train_argv(tiny_data_dir, file / "checkpoint"))
    assert_refused(code, lines, "--output", str(file))
    assert file.read_text() == "not a directory"


# ----------------------------------------------------------------------------- 5. devices and method sizes


def _missing_devices() -> list[str]:
    devices = ["meta"]  # holds no data: never a device to train on
    if not torch.backends.mps.is_available():
        devices.append("mps")
    devices.append(f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda")
    return devices


@pytest.mark.parametrize("command", ["train", "evaluate"])
@pytest.mark.parametrize("device", _missing_devices())
def test_kind5_devices_the_machine_lacks_are_refused_up_front(
    capsys, tmp_path, tiny_data_dir, no_training, command, device
):
    import analysis.evaluate

    no_training.setattr(analysis.evaluate, "evaluate_sweep", must_not_run("the evaluation"))
    if command == "train":
        argv = train_argv(tiny_data_dir, tmp_path / "out", "--device", device)
    else:  # an http store is not contacted before the flags are checked
        argv = ["evaluate", "--sweep", "s", "--tracking-uri", "http://127.0.0.1:9", "--data-dir", tiny_data_dir,
                "--test-dir", tiny_data_dir, "--output", tmp_path / "out", "--device", device]  # fmt: skip
    code, lines = run(capsys, *argv)
    assert_refused(code, lines, f"'{device}'")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "method, flag, value, limit",
    [
        ("lora", "--rank", "1000", "at most 384"),
        ("adapter", "--bottleneck", "2000", "at most 1,536"),
        ("hyperformer", "--bottleneck", "2000", "at most 1,536"),
        ("prefix", "--prefix-length", "1000", "at most 512"),
        ("prompt", "--prompt-length", "1000", "at most 512"),
        ("top_k", "--k", "7", "6 layers"),
        # beyond any BERT (issue 47): refused by the config alone, before the model is read
        ("lora", "--rank", "1000000000000", "too large for any BERT; expected at most 8,192"),
        ("adapter", "--bottleneck", "1000000", "too large for any BERT; expected at most 32,768"),
        ("prefix", "--prefix-length", "1000000", "too large for any BERT; expected at most 4,096"),
        ("top_k", "--k", "1000", "too large for any BERT; expected at most 192"),
    ],
)
def test_kind5_method_sizes_beyond_the_backbone_are_refused_up_front(
    capsys, tmp_path, tiny_data_dir, no_training, method, flag, value, limit
):
    argv = train_argv(tiny_data_dir, tmp_path / "out", "--method", method, flag, value)
    code, lines = run(capsys, *argv)
    assert_refused(code, lines, flag.lstrip("-").replace("-", "_"), value, limit)
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- 6. sqlite:/// a file that is not SQLite


@pytest.mark.parametrize("command", ["report", "sweep"])
@pytest.mark.parametrize("content", [b"my notes, not a database\n", b""])
def test_kind6_sqlite_uri_naming_a_non_sqlite_file_is_refused_untouched(
    capsys, tmp_path, tiny_data_dir, monkeypatch, command, content
):
    from peftune.sweep import orchestrator

    monkeypatch.setattr(orchestrator, "run_sweep", must_not_run("the sweep"))
    monkeypatch.chdir(tmp_path)  # nothing a failed command might write lands in the repository
    notes = tmp_path / "notes.txt"
    notes.write_bytes(content)
    uri = f"sqlite:///{notes}"
    if command == "report":
        argv = ["report", "--sweep", "s", "--tracking-uri", uri, "--output", tmp_path / "report"]
    else:
        argv = ["sweep", "smoke", "--data-dir", tiny_data_dir, "--tracking-uri", uri,
                "--storage-path", tmp_path / "ray", "--reports-dir", tmp_path / "reports"]  # fmt: skip
    code, lines = run(capsys, *argv)
    assert_refused(code, lines, str(notes), "not a SQLite database")
    assert notes.read_bytes() == content
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


# ----------------------------------------------------------------------------- 7. bench's numeric flags


@pytest.mark.parametrize("flag, value", [("--repeats", "0"), ("--examples", "0"), ("--batch-size", "-4")])
def test_kind7_bench_numeric_flags_are_checked_before_loading(capsys, tiny_data_dir, no_training, flag, value):
    from peftune.benchmarks import throughput as bench

    no_training.setattr(bench, "resolve_model_dir", must_not_run("loading the model"))
    code, lines = run(capsys, "bench", "--data-dir", tiny_data_dir, flag, value)
    assert_refused(code, lines, flag, "positive integer", value)


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--pack", "1"], ["--pack", "'1'", "from 2 to 64"]),
        (["--pack", "2,x"], ["--pack", "'2,x'", "from 2 to 64"]),
        (["--pack", "65"], ["--pack", "'65'", "from 2 to 64"]),
        (["--pack", "2,4", "--pack-methods", "lora,full"], ["--pack-methods", "'lora,full'", "packable methods"]),
    ],
)
def test_kind7_bench_pack_flags_are_checked_before_loading(capsys, tiny_data_dir, no_training, flags, named):
    from peftune.benchmarks import throughput as bench

    no_training.setattr(bench, "resolve_model_dir", must_not_run("loading the model"))
    code, lines = run(capsys, "bench", "--data-dir", tiny_data_dir, *flags)
    assert_refused(code, lines, *named)


@pytest.mark.parametrize(
    "device, expected",
    [("cuda", "not available"), ("meta", "expected auto, cpu, cuda"), ("not-a-device", "expected auto, cpu, cuda")],
)
def test_kind7_bench_device_is_checked_before_loading(capsys, tiny_data_dir, no_training, device, expected):
    import torch

    from peftune.benchmarks import throughput as bench

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    no_training.setattr(bench, "resolve_model_dir", must_not_run("loading the model"))
    code, lines = run(capsys, "bench", "--data-dir", tiny_data_dir, "--device", device)
    assert_refused(code, lines, "--device", device, expected)


# ----------------------------------------------------------------------------- 8. sweep definitions

SWEEP = """\
name: tiny
tasks: [sst]
methods: [lora]
seed: 0
resources: {cpus_per_trial: 1, gpus_per_trial: 0.25}
train: {warmup_ratio: 0.1}
budget: small
budgets:
  small: {trials_per_method: 2, epochs: 1, batch_size: 16, max_length: 64}
"""


@pytest.mark.parametrize(
    "file, old, new, key, expected",
    [
        ("lora", "lr: {low: 1.0e-5,", "lr: {low: '1e-5',", "lr.low", "expected a number, got a string"),
        ("sweep", "warmup_ratio: 0.1}", "warmup_ratio: 0.1, device: 'cuda:99'}", "train.device", "cuda:0"),
        ("sweep", "warmup_ratio: 0.1}", "warmup_ratio: 0.1, device: meta}", "train.device", "'meta'"),
        ("sweep", "budget: small", "budget: small\nconfirm: {by_budget: ''}", "confirm.by_budget", "a mapping"),
        ("sweep", "small", "1", "budgets.1", "a preset name"),
        ("lora", "  lr: 1.0e-5", "  lr: 1e308", "default.lr", "(0, 10]"),
        ("lora", "lr: {low: 1.0e-5, high: 5.0e-3,", "lr: {low: 1.0e-5, high: 50.0,", "lr", "(0, 10]"),
        ("sweep", "budget: small", "budget: small\nconfirm: {seeds: 1e30}", "confirm.seeds", "expected an int"),
        ("sweep", "budget: small", "budget: small\nconfirm: {seeds: 1001}", "confirm.seeds", "0 to 1,000"),
        ("sweep", "max_length: 64", "max_length: 100000", "budgets.small.max_length", "8 to 512"),
        ("sweep", "epochs: 1", "epochs: 100000", "budgets.small.epochs", "1 to 1,000"),
        ("sweep", "per_method: 2", "per_method: 1000000000", "budgets.small.trials_per_method", "1 to 100,000"),
        ("sweep", "batch_size: 16", "batch_size: 1000000", "budgets.small.batch_size", "1 to 8,192"),
    ],
)
def test_kind8_sweep_yaml_values_are_typed_and_bounded(
    capsys, tmp_path, tiny_data_dir, monkeypatch, file, old, new, key, expected
):
    from peftune.record import stores
    from peftune.sweep import orchestrator

    monkeypatch.setattr(orchestrator, "run_sweep", must_not_run("the sweep (Ray)"))
    monkeypatch.setattr(stores, "check_tracking_uri", must_not_run("the store check, after the definition's"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "methods").mkdir()
    lora = (REPO / "search_spaces" / "methods" / "lora.yaml").read_text()
    texts = {"sweep": textwrap.dedent(SWEEP), "lora": lora}
    assert old in texts[file]
    texts[file] = texts[file].replace(old, new)
    (tmp_path / "methods" / "lora.yaml").write_text(texts["lora"])
    definition = tmp_path / "tiny.yaml"
    definition.write_text(texts["sweep"])
    code, lines = run(capsys, "sweep", definition, "--data-dir", tiny_data_dir)
    named = tmp_path / "methods" / "lora.yaml" if file == "lora" else definition
    assert_refused(code, lines, f"{named}: {key}: ", expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["methods", "tiny.yaml"]
