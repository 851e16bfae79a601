"""Issue 9: every user error on the command line ends in one line on stderr and exit 2, never a traceback.

Table-driven: each row is a command with one mistake, run in-process through ``peftune.cli.commands.main``.
Every mistake is caught before any training, sweep or store work starts.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from peftune.cli import commands
from peftune.sweep import lease

CASES = {
    "lr inf": ["train", "--lr", "inf"],
    "weight decay nan": ["train", "--weight-decay", "nan"],
    "alpha nan": ["train", "--alpha", "nan"],
    "dropout nan": ["train", "--dropout", "nan"],
    "warmup -inf": ["train", "--warmup-ratio", "-inf"],
    "lr word": ["train", "--lr", "fast"],
    "lr negative": ["train", "--lr", "-1"],
    "dropout above 1": ["train", "--dropout", "1.5"],
    "device tpu": ["train", "--device", "tpu"],
    "option unbalanced list": ["train", "--option", "rank=[1"],
    "option without value": ["train", "--option", "rank"],
    "option unknown": ["train", "--option", "ranks=4"],
    "rank zero": ["train", "--rank", "0"],
    "rank for bitfit": ["train", "--method", "bitfit", "--rank", "4"],
    "unknown method": ["train", "--method", "lorra"],
    "unknown task": ["train", "--tasks", "sst,imdb"],
    "no tasks": ["train", "--tasks", ""],
    "epochs zero": ["train", "--epochs", "0"],
    "batch size negative": ["train", "--batch-size", "-1"],
    "seed negative": ["train", "--seed", "-1"],
    "seed too large": ["train", "--seed", "4294967296"],
    "export-peft with adapter": ["train", "--method", "adapter", "--export-peft"],
    "output is a file": ["train", "--output", "{file}"],
    "missing model": ["train", "--model", "{missing}"],
    "corrupt config.json": ["train", "--model", "{bad_config}"],
    "corrupt safetensors": ["train", "--model", "{bad_weights}"],
    "methods missing model": ["methods", "--model", "{missing}"],
    "methods unknown task": ["methods", "--tasks", "sst,imdb"],
    "methods corrupt config": ["methods", "--model", "{bad_config}"],
    "empty config.json": ["train", "--model", "{empty_config}"],
    "methods empty config.json": ["methods", "--model", "{empty_config}"],
    "report garbage uri": ["report", "--sweep", "s", "--tracking-uri", "garbage://x"],
    "report unreachable server": ["report", "--sweep", "s", "--tracking-uri", "http://127.0.0.1:9"],
    "report missing sqlite": ["report", "--sweep", "s", "--tracking-uri", "sqlite:///{missing}/mlflow.db"],
    "report output is a file": ["report", "--sweep", "s", "--tracking-uri", "sqlite:///{db}", "--output", "{file}"],
    "report unknown sweep": ["report", "--sweep", "nosuchsweep", "--tracking-uri", "sqlite:///{db}"],
    "evaluate garbage uri": ["evaluate", "--sweep", "s", "--tracking-uri", "garbage://x", "--data-dir", "{data}",
                             "--test-dir", "{data}"],
    "sweep missing definition": ["sweep", "{missing}.yaml", "--data-dir", "{data}"],
    "sweep unknown budget": ["sweep", "smoke", "--budget", "huge", "--data-dir", "{data}"],
    "sweep smoke with budget": ["sweep", "smoke", "--smoke-test", "--budget", "cpu", "--data-dir", "{data}"],
    "sweep garbage uri": ["sweep", "smoke", "--data-dir", "{data}", "--tracking-uri", "garbage://x"],
    "sweep bad invalid-rows": ["sweep", "smoke", "--data-dir", "{data}", "--invalid-rows", "ignore"],
    "sweep zero trials": ["sweep", "smoke", "--data-dir", "{data}", "--trials-per-method", "0"],
    "sweep bad name": ["sweep", "smoke", "--data-dir", "{data}", "--name", "a b/c"],
    # issue 34: argparse's own refusals (one line, no usage block), negative numbers as values
    "lr -inf": ["train", "--lr", "-inf"],
    "lr -nan": ["train", "--lr", "-nan"],
    "lr negative exponent": ["train", "--lr", "-1e-3"],
    "alpha inf": ["train", "--alpha", "inf"],
    "alpha -inf": ["train", "--alpha", "-inf"],
    "unknown flag": ["train", "--bogus"],
    "flag without its value": ["train", "--lr"],
    "unknown command": ["bogus"],
    "sweep without data-dir": ["sweep", "smoke"],
    "sweep bad choice": ["sweep", "smoke", "--data-dir", "{data}", "--invalid-rows", "maybe"],
    "report without sweep": ["report"],
    "methods xlnet": ["methods", "--model", "{xlnet}"],
    "train xlnet": ["train", "--model", "{xlnet}"],
    "data-dir empty": ["train", "--data-dir", ""],
    "sweep data-dir empty": ["sweep", "smoke", "--data-dir", ""],
    "sweep storage-path empty": ["sweep", "smoke", "--data-dir", "{data}", "--storage-path", ""],
    "evaluate test-dir empty": ["evaluate", "--sweep", "s", "--data-dir", "{data}", "--test-dir", ""],
    "sweep definition is a directory": ["sweep", "{tmp}", "--data-dir", "{data}"],
    "sweep storage scheme": ["sweep", "smoke", "--data-dir", "{data}", "--storage-path", "garbage://x",
                             "--tracking-uri", "sqlite:///{tmp}/m.db"],
}  # fmt: skip
if torch.cuda.is_available():
    del CASES["device tpu"]
else:
    CASES["device cuda without CUDA"] = ["train", "--device", "cuda"]


# what a message must name: the damaged file (its directory alone leaves the user guessing), the flag and why
NAMES_FILE = {
    "corrupt config.json": "config.json: line 1",
    "methods corrupt config": "config.json: line 1",
    "empty config.json": "config.json: no vocab_size, hidden_size, num_hidden_layers",
    "methods empty config.json": "config.json: no vocab_size, hidden_size, num_hidden_layers",
    "corrupt safetensors": "model.safetensors",
    "methods xlnet": "config.json: model_type 'xlnet' is not supported; peftune loads bert, roberta, distilbert",
    "train xlnet": "config.json: model_type 'xlnet' is not supported; peftune loads bert, roberta, distilbert",
    "lr -inf": "argument --lr: expected a finite number, got '-inf'",
    "lr negative exponent": "TrainConfig.lr: out of range",
    "alpha -inf": "argument --alpha: expected a finite number, got '-inf'",
    "data-dir empty": "argument --data-dir: an empty path ''",
    "sweep data-dir empty": "argument --data-dir: an empty path ''",
    "sweep storage-path empty": "argument --storage-path: an empty path ''",
    "evaluate test-dir empty": "argument --test-dir: an empty path ''",
    "sweep definition is a directory": ": is a directory; expected a YAML file",
    "sweep storage scheme": "--storage-path garbage://x: pyarrow (Ray Tune's storage) cannot open it",
    "export-peft with adapter": "--export-peft needs --method lora, dora, ia3 or vera (got --method adapter)",
}


@pytest.fixture
def places(tmp_path, tiny_data_dir):
    import mlflow

    file = tmp_path / "a-file"
    file.write_text("not a directory")
    bad_config = tmp_path / "bad_config"
    bad_config.mkdir()
    (bad_config / "config.json").write_text('{"model_type": "bert", "hidden_size": ')
    bad_weights = tmp_path / "bad_weights"
    bad_weights.mkdir()
    (bad_weights / "config.json").write_text(
        '{"model_type": "bert", "vocab_size": 120, "hidden_size": 16, "num_hidden_layers": 1, '
        '"num_attention_heads": 2, "intermediate_size": 32}'
    )
    (bad_weights / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage")
    (bad_weights / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\na\n")
    db = tmp_path / "mlflow.db"
    mlflow.MlflowClient(f"sqlite:///{db}").search_experiments()  # an existing, empty store
    empty_config = tmp_path / "empty_config"  # a complete model folder whose config.json says nothing
    shutil.copytree(bad_weights, empty_config)
    (empty_config / "config.json").write_text("{}")
    xlnet = tmp_path / "xlnet"  # a complete model folder, but of no family the backbone loads
    shutil.copytree(bad_weights, xlnet)
    config = json.loads((xlnet / "config.json").read_text())
    (xlnet / "config.json").write_text(json.dumps({**config, "model_type": "xlnet"}))
    return {
        "xlnet": str(xlnet),
        "empty_config": str(empty_config),
        "tmp": str(tmp_path),
        "file": str(file),
        "missing": str(tmp_path / "missing"),
        "bad_config": str(bad_config),
        "bad_weights": str(bad_weights),
        "db": str(db),
        "data": str(tiny_data_dir),
    }


@pytest.mark.parametrize("name", list(CASES))
def test_user_error_is_one_line_and_exit_2(name, places, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing a failed command might write lands in the repository
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # an unreachable server fails now, not in minutes
    monkeypatch.setenv(lease.DIR_ENV, str(tmp_path / "leases"))  # an object-storage URI's lease: not in ~/.peftune
    argv = [arg.format(**places) for arg in CASES[name]]
    if argv[0] == "train" and "--data-dir" not in argv:
        argv += ["--data-dir", places["data"], "--epochs" if "--epochs" not in argv else "--seed", "1"]
        argv += ["--max-train-examples", "8", "--max-dev-examples", "8"]
    try:
        code = commands.main(argv)
    except SystemExit as exit_:  # argparse's own errors (wrong type, bad choice)
        code = exit_.code
    _, err = capsys.readouterr()
    assert code == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and len(errors[0]) <= 600, err
    assert err.strip().splitlines() == errors, f"more than the error line (argparse's usage block?):\n{err}"
    assert not (tmp_path / "missing").exists(), "a reading command created the store it was asked to read"
    if name in NAMES_FILE:
        assert NAMES_FILE[name] in errors[0], f"the error does not say {NAMES_FILE[name]!r}: {errors[0]}"
    assert not list(tmp_path.glob("runs/*")), "a refused train command wrote a checkpoint"


def test_a_storage_uri_pyarrow_cannot_open_is_refused_before_the_lease_ray_or_record(
    tmp_path, tiny_data_dir, capsys, monkeypatch
):
    """Issue 34: ``--storage-path garbage://x`` was pyarrow's 39-line traceback from Tune, exit 1, after the
    sweep's lease folder was made under ~/.peftune/leases."""
    import ray

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(lease.DIR_ENV, str(tmp_path / "leases"))  # where an object-storage URI's lease goes
    db = tmp_path / "m.db"
    argv = ["sweep", "smoke", "--data-dir", str(tiny_data_dir), "--name", "x", "--storage-path", "garbage://x"]
    assert commands.main([*argv, "--tracking-uri", f"sqlite:///{db}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Unrecognized filesystem type in URI: garbage://x" in err[0], err
    assert not (tmp_path / "leases").exists() and not db.exists() and not ray.is_initialized()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_storage_uri_is_refused_before_any_data_is_read(tmp_path, tiny_data_dir, capsys, monkeypatch):
    """Issue 47: ``--storage-path garbage://x`` was refused in one line, but after the data was read and tokenized."""
    from peftune.sweep import spaces

    def reading(*args, **kwargs):
        raise AssertionError("the data was read before the storage path was checked")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(spaces, "prepare_data", reading)
    argv = ["sweep", "smoke", "--data-dir", str(tiny_data_dir), "--storage-path", "garbage://x"]
    assert commands.main([*argv, "--tracking-uri", f"sqlite:///{tmp_path / 'm.db'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--storage-path garbage://x: pyarrow (Ray Tune's storage) cannot open it" in err[0], err


# what a one-line refusal must not wait for: seconds of imports on a 2-core machine (issue 34, item 12)
HEAVY = ("ray", "mlflow", "optuna", "pandas", "pyarrow", "transformers", "analysis")
REFUSED_LIGHT = {
    "train flag": ["-m", "peftune.cli.commands", "train", "--lr", "nan"],
    "sweep data row": ["-m", "peftune.cli.commands", "sweep", "smoke", "--data-dir", "{bad_data}"],
    "sweep definition": ["-m", "peftune.cli.commands", "sweep", "{bad_yaml}", "--data-dir", "{data}"],
    "job flag": ["{repo}/jobs/sst_tuning.py", "--data-dir", "{data}", "--num-samples", "x"],
    "job data row": ["{repo}/jobs/sst_tuning.py", "--data-dir", "{bad_data}", "--smoke-test"],
    "methods xlnet": ["-m", "peftune.cli.commands", "methods", "--model", "{xlnet}"],
    "second driver": [
        "-m",
        "peftune.cli.commands",
        "sweep",
        "smoke",
        "--data-dir",
        "{data}",
        "--name",
        "held",
        "--storage-path",
        "{tmp}/ray_results",
        "--tracking-uri",
        "sqlite:///{tmp}/m.db",
    ],
}
LOADED = """
import atexit, os, runpy, sys
heavy = set(os.environ["HEAVY"].split(","))  # at exit, after the refusal: which of them the command loaded
atexit.register(lambda: print("loaded:", sorted({m.split(".")[0] for m in sys.modules} & heavy), file=sys.stderr))
if sys.argv[1] == "-m":  # python -c LOADED -m MODULE ARGS...
    sys.argv = sys.argv[2:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:  # python -c LOADED SCRIPT ARGS...
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("name", list(REFUSED_LIGHT))
def test_a_refusal_comes_before_the_heavy_imports(name, places, tmp_path):
    """A bad flag, data row or definition file is refused before Ray, Tune, MLflow, Optuna, pandas, pyarrow,
    transformers or the report are imported: on main 0507cb1 `peftune --help` alone took 10.8 s on a busy 2-core
    machine, most of it those imports."""
    import subprocess
    import sys

    from conftest import REPO

    bad_data = tmp_path / "bad_data"
    shutil.copytree(places["data"], bad_data)
    rows = (bad_data / "ids-sst-train.csv").read_text().splitlines()
    rows[2] = rows[2].rsplit("\t", 1)[0] + "\t9"  # a label out of 0..4 on line 3
    (bad_data / "ids-sst-train.csv").write_text("\n".join(rows) + "\n")
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("tasks: [sst]\nmethods: [lora]\nbudgets: {smoke: {epochs: many}}\n")
    argv = [arg.format(bad_data=bad_data, bad_yaml=bad_yaml, repo=REPO, **places) for arg in REFUSED_LIGHT[name]]
    path = f"{REPO / 'platform'}{os.pathsep}{REPO}"
    # refusing a data row means reading the file: pyarrow, its reader, is the one heavy library that may load then
    heavy = [module for module in HEAVY if not (module == "pyarrow" and name.endswith("data row"))]
    env = {**os.environ, "PYTHONPATH": path, "HOME": str(tmp_path), "HEAVY": ",".join(heavy)}
    held = lease.Lease(tmp_path / "ray_results", "held")  # this process: a live driver of sweep "held"
    held.acquire()
    try:
        done = subprocess.run([sys.executable, "-c", LOADED, *argv], cwd=tmp_path, env=env, capture_output=True,
                              text=True)  # fmt: skip
    finally:
        held.release()
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and lines[-1] == "loaded: []", done.stderr[-2000:]
    errors = [line for line in lines if ": error: " in line]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    if name == "sweep data row" or name == "job data row":
        assert "ids-sst-train.csv, line 3" in errors[0], errors
    if name == "second driver":
        assert "is being run by another driver" in errors[0], errors
        assert not (tmp_path / "m.db").exists()
