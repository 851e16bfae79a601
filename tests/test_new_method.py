"""A method added as one module (and its search space) appears everywhere a method shows, touching no other file.

The module is written and registered at test time; the registry is a copy for the test, so no other test sees it.
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest

from analysis import pareto, plots, runs
from peftune.base import record_names
from peftune.cli import commands, train_command
from peftune.methods import base
from peftune.sweep import spaces

MODULE = '''\
"""A test's method: the top ``width`` layers' output LayerNorms train."""

from dataclasses import dataclass

from peftune.methods.base import MethodConfig, MethodSpec, check_positive_int, option, register_method, unfreeze


@dataclass
class TinyConfig(MethodConfig):
    width: int = option(3, "output LayerNorms that train, from the top")

    def __post_init__(self):
        super().__post_init__()
        check_positive_int(self, "width")


def apply_tiny(backbone, config, context) -> None:
    for layer in backbone.encoder.layer[-config.width :]:
        unfreeze(layer.output.LayerNorm)


register_method(
    MethodSpec("tiny", TinyConfig, apply_tiny, "a test's method", "width", order=2.5, color="#123456",
               size_symbols={"width": "w"})
)
'''
SPACE = """\
    method: tiny
    lr: {low: 1.0e-4, high: 1.0e-3, log: true}
    dropout: 0.1
    weight_decay: 0.0
    options:
      width: {choices: [1, 2]}
    default: {lr: 1.0e-3, dropout: 0.1, weight_decay: 0.0, width: 2, source: "a test"}
"""
SWEEP = """\
    name: with_tiny
    tasks: [sst]
    methods: [frozen, tiny]
    budget: small
    budgets:
      small: {trials_per_method: 2, epochs: 1}
"""


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """The module ``tiny_method.py`` registered in a copy of the registry (the test's alone)."""
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    path = tmp_path / "tiny_method.py"
    path.write_text(MODULE)
    module_spec = importlib.util.spec_from_file_location("tiny_method", path)
    module_spec.loader.exec_module(importlib.util.module_from_spec(module_spec))
    return base.get_method("tiny")


def test_a_new_method_is_listed_by_peftune_methods(tiny, capsys):
    assert commands.main(["methods", "--tasks", "sst"]) == 0
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("tiny ")]
    assert "width=3" in row


def test_a_new_method_brings_its_command_line_flag(tiny, capsys):
    with pytest.raises(SystemExit):
        commands.main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--width INT output LayerNorms that train, from the top (default: tiny 3)" in text
    args = commands.build_parser().parse_args(["train", "--data-dir", "d", "--method", "tiny", "--width", "2"])
    assert train_command.method_options(args) == {"width": 2}
    args = commands.build_parser().parse_args(["train", "--data-dir", "d", "--method", "lora", "--width", "2"])
    with pytest.raises(ValueError, match="--width does not apply to method 'lora'"):
        train_command.method_options(args)


def test_a_sweep_definition_takes_a_new_method_with_its_space(tiny, tmp_path):
    (tmp_path / "methods").mkdir()
    (tmp_path / "methods" / "tiny.yaml").write_text(textwrap.dedent(SPACE))
    (tmp_path / "methods" / "frozen.yaml").write_text(
        (spaces.SEARCH_SPACES_DIR / "methods" / "frozen.yaml").read_text()
    )
    (tmp_path / "with_tiny.yaml").write_text(textwrap.dedent(SWEEP))
    definition = spaces.load_sweep(tmp_path / "with_tiny.yaml")
    assert definition.methods == ["frozen", "tiny"] and definition.search_trials == 4  # its own 2, none taken
    assert definition.spaces["tiny"].options["width"].choices == (1, 2)


def test_plots_and_report_show_a_new_method_by_its_spec(tiny):
    assert plots.method_color("tiny") == "#123456"
    assert pareto.ordered_methods(["prompt", "tiny", "frozen", "lora", "adapter"]) == [
        "frozen", "lora", "tiny", "adapter", "prompt"]  # fmt: skip
    assert runs.size_label("tiny", {"method.width": 2}) == "w=2"
    assert runs.size_value("tiny", {"method.width": 2}) == 2.0
    assert record_names.run_label("tiny", runs.size_label("tiny", {"method.width": 2}), "search") == "tiny w=2 · search"


def test_every_methods_recorded_command_parses_back_through_the_generated_flags(tiny):
    """``train_command`` writes each option as its flag; the command line reads it back to the same config."""
    import shlex

    from peftune import methods
    from peftune.core import train

    for method in methods.method_names():
        config = train.TrainConfig(method=method, tasks=["sst"])
        argv = shlex.split(train.train_command(config, {"data_dir": "d"}))[1:]
        assert "--option" not in argv
        back = train_command.config_from_args(commands.build_parser().parse_args(argv))
        expected = methods.make_method_config(method, config.method_options_with_dropout())
        assert methods.make_method_config(method, back.method_options_with_dropout()) == expected, method


def test_the_registry_is_back_without_it_after_a_test():
    assert "tiny" not in base.method_names()
