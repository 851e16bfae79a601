"""One trial specification (issue 31, item 2): a ``TrialSpec`` goes out and comes back in, unchanged, through its
JSON file and through the ``peftune train`` command line; ``peftune train --spec`` re-runs a run exactly; a bad
spec file is one line naming the file and the key."""

from __future__ import annotations

import json
import re
import shlex

import pytest

from peftune.base.record_names import param_text
from peftune.cli import commands, train_command
from peftune.core import trial_spec
from peftune.core.train import TrainConfig
from peftune.core.trial_spec import DataSettings, TrialSpec
from peftune.methods.options import options_from_params


def spec_of(data_dir) -> TrialSpec:
    config = TrainConfig(
        method="lora", method_options={"rank": 4, "targets": ["query", "value"], "use_rslora": True},
        tasks=["sst"], lr=3e-4, dropout=0.05, weight_decay=0.02, head_lr=1e-3, epochs=2, batch_size=8,
        warmup_ratio=0.2, seed=7, eval_splits=["selection", "dev"],
    )  # fmt: skip
    data = DataSettings(str(data_dir), max_length=64, max_train_examples=40, max_dev_examples=16, seed=3,
                        selection_examples=12, decision_examples=8)  # fmt: skip
    return TrialSpec(config, data, threads=1)


def test_a_spec_comes_back_unchanged_from_its_file_and_its_command(tmp_path):
    spec = spec_of(tmp_path)
    assert trial_spec.read(trial_spec.write(spec, tmp_path / "spec.json")) == spec
    argv = shlex.split(spec.command())
    assert argv[:2] == ["peftune", "train"]
    assert train_command.spec_from_args(commands.build_parser().parse_args(argv[1:])) == spec


def test_a_specs_params_give_its_method_options_back_and_every_setting_it_trains_with(tmp_path):
    spec = spec_of(tmp_path)
    params = {key: param_text(value) for key, value in spec.params().items()}  # as the record stores them
    assert options_from_params("lora", params) == spec.config.method_options  # every option, defaults included
    assert {key: params[key] for key in ("method", "lr", "dropout", "weight_decay", "head_lr", "seed")} == {
        "method": "lora", "lr": "0.0003", "dropout": "0.05", "weight_decay": "0.02", "head_lr": "0.001", "seed": "7"
    }  # fmt: skip
    assert params["data.max_train_examples"] == "40" and "data.data_dir" not in params  # another machine's path
    assert params["threads"] == "1" and params["epochs"] == "2" and params["warmup_ratio"] == "0.2"


def test_verbose_goes_with_spec(tmp_path):
    """``peftune -v train --spec FILE``: debug logging is no flag of the trial (it was refused as one)."""
    spec = spec_of(tmp_path)
    path = trial_spec.write(spec, tmp_path / "spec.json")
    assert (
        train_command.spec_from_args(commands.build_parser().parse_args(["-v", "train", "--spec", str(path)])) == spec
    )


def run(capsys, *argv):
    code = commands.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def epoch_lines(out: str) -> list[str]:
    """The epoch lines without their timings (seconds, tokens/s)."""
    return [re.sub(r"\s+\(.*\)$", "", line) for line in out.splitlines() if line.startswith("epoch ")]


def test_train_spec_reruns_a_run_exactly(capsys, tiny_data_dir, tmp_path):
    first = tmp_path / "first"
    code, out, _ = run(
        capsys, "train", "--method", "lora", "--rank", "4", "--tasks", "sst", "--data-dir", tiny_data_dir,
        "--epochs", "2", "--max-train-examples", "32", "--max-dev-examples", "16", "--selection-examples", "8",
        "--seed", "5", "--threads", "1", "--output", first,
    )  # fmt: skip
    assert code == 0, out
    written = first / trial_spec.ARTIFACT
    assert f"the run's spec: {written}" in out
    assert trial_spec.read(written).config.method_options == {
        "rank": 4,
        "alpha": 16.0,
        "targets": ["query", "key", "value"],
        "use_rslora": False,
        "loraplus_lr_ratio": 1.0,
        "init": "lora",
    }
    code, again, _ = run(capsys, "train", "--spec", written, "--output", tmp_path / "again")
    assert code == 0, again
    assert epoch_lines(again) == epoch_lines(out) and len(epoch_lines(out)) == 2
    assert trial_spec.read(tmp_path / "again" / trial_spec.ARTIFACT) == trial_spec.read(written)


@pytest.mark.parametrize(
    "change, where",
    [
        (lambda raw: "{not json", "not valid JSON: line 1"),
        (lambda raw: {**raw, "extra": 1}, "unknown key 'extra'"),
        (lambda raw: {**raw, "format": 2}, "format 2"),
        (lambda raw: {**raw, "train": {**raw["train"], "lr": "fast"}}, "train: TrainConfig.lr"),
        (lambda raw: {**raw, "train": {**raw["train"], "learning_rate": 1.0}}, "train: unknown key 'learning_rate'"),
        (lambda raw: {**raw, "data": {**raw["data"], "max_length": 4}}, "data: DataSettings.max_length"),
        (lambda raw: {**raw, "data": {**raw["data"], "invalid_rows": "ignore"}}, "data: DataSettings.invalid_rows"),
        (lambda raw: {**raw, "threads": 0}, "threads 0"),
        (lambda raw: {**raw, "train": {**raw["train"], "method": "lorax"}}, "train: unknown method 'lorax'"),
    ],
)
def test_a_bad_spec_is_one_line_naming_the_file_and_the_key(capsys, tmp_path, change, where):
    raw = change(spec_of(tmp_path).to_dict())
    path = tmp_path / "bad.json"
    path.write_text(raw if isinstance(raw, str) else json.dumps(raw))
    code, out, err = run(capsys, "train", "--spec", path, "--output", tmp_path / "out")
    assert code == 2 and not out
    assert len(err.strip().splitlines()) == 1 and str(path) in err and where in err, err
    assert not (tmp_path / "out").exists()


def test_a_flag_that_the_spec_gives_is_refused_beside_it(capsys, tmp_path):
    path = trial_spec.write(spec_of(tmp_path), tmp_path / "spec.json")
    for flag in (["--lr", "0.5"], ["--rank", "16"], ["--max-length", "32"]):
        code, out, err = run(capsys, "train", "--spec", path, *flag, "--output", tmp_path / "out")
        assert code == 2 and f"{flag[0]} with --spec" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()
