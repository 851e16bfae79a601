"""Search spaces and sweep definitions: every shipped file validates; every kind of mistake is named."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path

import optuna
import pytest
import yaml

from peftune import methods
from peftune.base import validation
from peftune.cli import commands
from peftune.inputs import tasks
from peftune.sweep import search, spaces
from peftune.sweep.spaces import Choice, FloatRange, IntRange, SpaceError

SHIPPED = spaces.shipped_files()


def _id(path: Path) -> str:
    return str(path.relative_to(spaces.SEARCH_SPACES_DIR))


def test_shipped_files_cover_every_method_and_both_jobs():
    names = {_id(p) for p in SHIPPED}
    assert {f"methods/{m}.yaml" for m in methods.method_names()} <= names
    assert {"sst_tuning.yaml", "multitask_tuning.yaml", "smoke.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=_id)
def test_every_shipped_file_loads_and_validates(path):
    if path.parent.name == "tasks":  # a shipped task's declaration (peftune.inputs.tasks)
        assert tasks.load_task_file(path).name == path.stem == tasks.get_task(path.stem).name
        return
    if path.parent.name == spaces.METHODS_SUBDIR:
        space = spaces.load_method_space(path)
        spec = methods.get_method(space.method)
        assert spec.size_field is None or spec.size_field in space.options
        assert isinstance(space.lr, FloatRange) and space.lr.log, "the learning rate is searched log-uniform"
        return
    definition = spaces.load_sweep(path)
    presets = yaml.safe_load(path.read_text())["budgets"]
    for preset in presets:  # every budget preset resolves too
        resolved = spaces.load_sweep(path, budget=preset)
        assert resolved.budget_name == preset and resolved.budget.trials_per_method >= 1
    assert definition.methods and definition.tasks
    assert yaml.safe_load(definition.to_yaml())["spaces"].keys() == set(definition.methods)


def test_job_definitions_tune_every_method_and_have_the_three_presets():
    for name, expected in (("sst_tuning", ("sst",)), ("multitask_tuning", ("sst", "para", "sts"))):
        definition = spaces.load_sweep(spaces.resolve_sweep_path(name))
        assert definition.tasks == expected
        assert set(definition.methods) == set(methods.method_names())
        for preset in ("smoke", "cpu", "gpu"):
            spaces.load_sweep(spaces.resolve_sweep_path(name), budget=preset)
        smoke = spaces.load_sweep(spaces.resolve_sweep_path(name), budget="smoke").budget
        assert smoke.epochs <= 2 and smoke.max_train_examples <= 64


@pytest.mark.parametrize(
    "preset, fingerprint", [("smoke", "7e80264f2ac3c1ee"), ("cpu", "a0f9ef3f01298b4b"), ("gpu", "09832ea0f7b994ff")]
)
def test_the_shipped_sweeps_fingerprint_is_stable(preset, fingerprint):
    """The shipped SST job's fingerprints since its confirmation became each budget's contenders at the full
    budget (a sweep begun before is another sweep to a resume): a description does not change it, a budget does."""
    definition = spaces.load_sweep(spaces.resolve_sweep_path("sst_tuning"), budget=preset)
    assert definition.fingerprint() == fingerprint
    assert dataclasses.replace(definition, description="another").fingerprint() == fingerprint
    more = definition.with_overrides(trials_per_method=definition.budget.trials_per_method + 1)
    assert more.fingerprint() != fingerprint


# ----------------------------------------------------------------------------- method spaces: errors


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


LORA_OK = """\
    method: lora
    lr: {low: 1e-4, high: 5e-3, log: true}
    dropout: {low: 0.0, high: 0.3}
    weight_decay: 0.01
    options:
      rank: {choices: [2, 4, 8]}
      alpha: 16
"""


def test_method_space_parses_ranges_choices_and_fixed_values(tmp_path):
    space = spaces.load_method_space(write(tmp_path / "lora.yaml", LORA_OK))
    assert space.lr == FloatRange(1e-4, 5e-3, log=True)  # 1e-4 (YAML 1.1 would read a string) is a float
    assert space.options["rank"] == Choice((2, 4, 8))
    assert space.weight_decay == spaces.Fixed(0.01) and space.options["alpha"] == spaces.Fixed(16)
    int_range = write(
        tmp_path / "x" / "top_k.yaml",
        LORA_OK.replace("lora", "top_k")
        .replace("rank: {choices: [2, 4, 8]}", "k: {low: 1, high: 4}")
        .replace("alpha: 16", ""),
    )
    assert spaces.load_method_space(int_range).options["k"] == IntRange(1, 4)


@pytest.mark.parametrize(
    "old, new, key, message",
    [
        ("weight_decay: 0.01", "weight_decay: 0.01\nsurprise: 1", "surprise", "unknown key"),
        ("dropout: {low: 0.0, high: 0.3}", "dropout: {low: 0.0, hihg: 0.3}", "dropout.hihg", "unknown key"),
        ("dropout: {low: 0.0, high: 0.3}", "dropout: {low: 0.3, high: 0.3}", "dropout", "empty range"),
        ("lr: {low: 1e-4, high: 5e-3, log: true}", "lr: {low: 5e-3, high: 1e-4, log: true}", "lr", "inverted range"),
        ("lr: {low: 1e-4, high: 5e-3, log: true}", "lr: {low: 0.0, high: 5e-3}", "lr", "out of range"),
        ("lr: {low: 1e-4, high: 5e-3, log: true}", "lr: {low: 0.0, high: 5e-3, log: true}", "lr.low", "log range"),
        ("dropout: {low: 0.0, high: 0.3}", "dropout: {low: 0.0, high: 1.5}", "dropout", "out of range"),
        ("dropout: {low: 0.0, high: 0.3}", "dropout: high", "dropout", "expected a number"),
        ("dropout: {low: 0.0, high: 0.3}", "dropout: {low: 0.0, high: 0.3, log: yes please}", "dropout.log", "true"),
        ("rank: {choices: [2, 4, 8]}", "rank: {choices: [2, 4.5]}", "options.rank.choices[1]", "integer"),
        ("rank: {choices: [2, 4, 8]}", "rank: {choices: []}", "options.rank.choices", "non-empty"),
        ("rank: {choices: [2, 4, 8]}", "rank: {choices: [0, 4]}", "options.rank", "refused by 'lora'"),
        ("rank: {choices: [2, 4, 8]}", "rank: [2, 4]", "options.rank", "{choices: [...]}"),
        ("rank: {choices: [2, 4, 8]}", "rnak: 4", "options.rnak", "has no option 'rnak'"),
        ("rank: {choices: [2, 4, 8]}", "bottleneck: 4", "options.bottleneck", "has no option"),
        ("rank: {choices: [2, 4, 8]}", "", "options.rank", "must be searched or fixed"),
        ("method: lora", "method: lorra", "method", "unknown method 'lorra'"),
        ("options:", "optoins:", "optoins", "unknown key"),
        ("alpha: 16", "alpha: 16\ndefault: {lr: 1.0e-5}", "default.source", "missing"),
        ("alpha: 16", "alpha: 16\ndefault: {lr: 1.0e-5, source: x, rnak: 8}", "default.rnak", "not a parameter"),
        ("alpha: 16", "alpha: 16\ndefault: {rank: 16, source: x}", "default.rank", "not among"),
        ("alpha: 16", "alpha: 16\ndefault: {lr: .nan, source: x}", "default.lr", "finite"),
        ("alpha: 16", "alpha: 16\ndefault: {lr: 0.0, source: x}", "default.lr", "out of range"),
        ("alpha: 16", "alpha: 16\ndefault: {dropout: 1.5, source: x}", "default.dropout", "out of range"),
        ("alpha: 16", "alpha: 16\ndefault: [1]", "default", "expected a mapping"),
    ],
)
def test_method_space_errors_name_file_and_key(tmp_path, old, new, key, message):
    text = textwrap.dedent(LORA_OK)
    assert old in text
    path = write(tmp_path / ("lorra.yaml" if "lorra" in new else "lora.yaml"), text.replace(old, new))
    with pytest.raises(SpaceError) as caught:
        spaces.load_method_space(path)
    assert caught.value.path == str(path) and caught.value.key == key
    assert message in str(caught.value) and str(path) in str(caught.value)


def test_a_default_block_is_the_published_setting_with_its_source(tmp_path):
    text = LORA_OK + "    default: {lr: 1.0e-5, rank: 8, source: AdaptBert report}\n"
    space = spaces.load_method_space(write(tmp_path / "lora.yaml", text))
    assert space.default == {"lr": 1e-5, "rank": 8} and space.default_source == "AdaptBert report"
    assert space.to_yaml()["default"] == {"lr": 1e-5, "rank": 8, "source": "AdaptBert report"}


def test_method_file_name_must_match_and_yaml_errors_are_named(tmp_path):
    with pytest.raises(SpaceError, match="does not match the file name"):
        spaces.load_method_space(write(tmp_path / "bitfit.yaml", LORA_OK))
    with pytest.raises(SpaceError, match="not valid YAML"):
        spaces.load_method_space(write(tmp_path / "lora.yaml", "method: [lora\n"))
    with pytest.raises(SpaceError, match="file not found"):
        spaces.load_method_space(tmp_path / "nope.yaml")
    with pytest.raises(SpaceError, match="python/name"):  # safe loading: a file never names code
        spaces.load_method_space(write(tmp_path / "lora.yaml", "method: !!python/name:os.system\n"))


# ----------------------------------------------------------------------------- sweep definitions: errors

SWEEP_OK = """\
    name: tiny
    tasks: [sst]
    methods: [lora]
    scheduler: {type: asha, grace_period: 1, reduction_factor: 2}
    resources: {cpus_per_trial: 1, max_concurrent_trials: 2}
    train: {warmup_ratio: 0.1}
    budget: small
    budgets:
      small: {trials_per_method: 2, epochs: 1, max_train_examples: 8}
"""


@pytest.fixture
def sweep_dir(tmp_path) -> Path:
    write(tmp_path / "methods" / "lora.yaml", LORA_OK)
    return tmp_path


def test_sweep_definition_resolves_budget_and_spaces(sweep_dir):
    definition = spaces.load_sweep(write(sweep_dir / "tiny.yaml", SWEEP_OK))
    assert definition.name == "tiny" and definition.tasks == ("sst",) and definition.methods == ["lora"]
    assert definition.budget == spaces.Budget(trials_per_method=2, epochs=1, max_train_examples=8)
    assert definition.resources.max_concurrent_trials == 2 and definition.train == {"warmup_ratio": 0.1}
    multi = definition.with_overrides(multi_objective=True, trials_per_method=5)
    assert multi.multi_objective and multi.scheduler.type == "none" and multi.search_trials == 5
    assert multi.fingerprint() != definition.fingerprint()
    assert definition.with_overrides(name="tiny").fingerprint() == definition.fingerprint()


@pytest.mark.parametrize(
    "old, new, key, message",
    [
        ("methods: [lora]", "methods: [lora, lorra]", "methods[1]", "unknown method 'lorra'"),
        ("methods: [lora]", "methods: [bitfit]", "methods[0]", "no search space for 'bitfit'"),
        ("methods: [lora]", "methods: []", "methods", "non-empty list"),
        ("tasks: [sst]", "tasks: [sst, imdb]", "tasks[1]", "unknown task 'imdb'"),
        ("tasks: [sst]", "tasks: sst", "tasks", "list of task names"),
        ("name: tiny", "name: tiny\nnum_trials: 3", "num_trials", "unknown key"),
        ("grace_period: 1", "grace_priod: 1", "scheduler.grace_priod", "unknown key"),
        ("type: asha", "type: hyperband", "scheduler.type", "expected one of"),
        ("reduction_factor: 2", "reduction_factor: two", "scheduler.reduction_factor", "expected an int"),
        ("cpus_per_trial: 1", "cpus_per_trial: 0", "resources.cpus_per_trial", "in (0, 1024]"),
        ("max_concurrent_trials: 2", "max_concurrent_trials: 0", "resources.max_concurrent_trials", "1 to 100,000"),
        ("warmup_ratio: 0.1", "lr: 0.1", "train.lr", "set by the search space"),
        ("warmup_ratio: 0.1", "warmup: 0.1", "train.warmup", "unknown training setting"),
        ("warmup_ratio: 0.1", "sampling: shuffled", "train.sampling", "sampling"),
        ("budget: small", "budget: huge", "budget", "no budget preset 'huge'"),
        ("epochs: 1,", "epochs: 0,", "budgets.small.epochs", "from 1 to 1,000"),
        ("epochs: 1,", "", "budgets.small.epochs", "missing"),
        ("epochs: 1,", "epochs: 1, max_dev: 3,", "budgets.small.max_dev", "unknown key"),
        # the old total: refused with a pointer to the key that replaced it (one meaning per name)
        ("trials_per_method: 2,", "num_samples: 2,", "budgets.small.num_samples", "give trials_per_method"),
        (
            "scheduler: {type: asha",
            "search: {objective: multi}\nscheduler: {type: asha",
            "scheduler.type",
            "multi-objective",
        ),
        ("name: tiny", "name: tiny sweep", "name", "letters, digits"),
        ("scheduler: {type: asha", "search: {allocation: fair}\nscheduler: {type: asha", "search.allocation", "fair"),
        ("reduction_factor: 2}", "reduction_factor: 2, min_steps: -1}", "scheduler.min_steps", "0 to 1,000,000,000"),
    ],
)
def test_sweep_errors_name_file_and_key(sweep_dir, old, new, key, message):
    text = textwrap.dedent(SWEEP_OK)
    assert old in text
    path = write(sweep_dir / "tiny.yaml", text.replace(old, new))
    with pytest.raises(SpaceError) as caught:
        spaces.load_sweep(path)
    assert caught.value.key == key and message in str(caught.value) and str(path) in str(caught.value)


def test_an_invalid_definition_starts_nothing(sweep_dir, monkeypatch, capsys):
    """The CLI exits 2 naming file and key, before Ray, MLflow or the data are touched."""
    bad = write(sweep_dir / "tiny.yaml", textwrap.dedent(SWEEP_OK).replace("[lora]", "[lora, lorra]"))
    monkeypatch.chdir(sweep_dir)
    assert commands.main(["sweep", str(bad), "--data-dir", str(sweep_dir / "no-data")]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "methods[1]" in err and "lorra" in err
    assert not (sweep_dir / "mlflow.db").exists() and not (sweep_dir / "ray_results").exists()


# ----------------------------------------------------------------------------- the Optuna space


def test_conditional_space_gives_each_method_only_its_own_parameters():
    definition = spaces.load_sweep(spaces.resolve_sweep_path("sst_tuning"))
    space = search.ConditionalSpace(definition.spaces)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    seen = set()
    for _ in range(120):
        trial = study.ask()
        constants = space(trial)
        method = trial.params["method"]
        seen.add(method)
        own = definition.spaces[method]
        searched = {k for k, p in own.params().items() if not isinstance(p, spaces.Fixed)}
        fixed = {k for k, p in own.params().items() if isinstance(p, spaces.Fixed)}
        assert set(trial.params) == {"method"} | {f"{method}/{k}" for k in searched}
        assert set(constants) == {f"{method}/{k}" for k in fixed}
        for key in searched:  # every proposal lies in the space
            value = trial.params[f"{method}/{key}"]
            param = own.params()[key]
            if isinstance(param, Choice):
                assert value in param.choices
            else:
                assert param.low <= value <= param.high
        study.tell(trial, 0.5)
    assert seen == set(definition.methods)


# ----------------------------------------------------------------------------- the JSON Schema (peftune schema)


def test_the_json_schema_names_the_keys_and_holds_every_shipped_definition(tmp_path, capsys):
    jsonschema = pytest.importorskip("jsonschema")  # installed with Ray
    assert commands.main(["schema", "--output", str(tmp_path / "schema.json")]) == 0
    schema = json.loads((tmp_path / "schema.json").read_text())
    assert commands.main(["schema"]) == 0 and json.loads(capsys.readouterr().out) == schema
    assert set(schema["properties"]) == {"name", "description", "tasks", "methods", "model", "seed", "search",
                                         "scheduler", "resources", "max_failures", "checkpoints_per_method", "train",
                                         "budget", "budgets", "confirm", "invalid_rows"}  # fmt: skip
    assert set(schema["required"]) == {"name", "tasks", "methods", "budgets"}
    assert schema["additionalProperties"] is False
    check = jsonschema.Draft202012Validator(schema)
    definitions = [p for p in SHIPPED if p.parent.name not in (spaces.METHODS_SUBDIR, "tasks")]
    assert len(definitions) >= 3
    for path in definitions:
        document = validation.read_yaml(path)  # as the loader reads it (1e-4 is a number)
        assert not list(check.iter_errors(document)), path
    # what the loader refuses, the schema flags too, so an editor shows it: unknown keys, types, names, bounds
    document = validation.read_yaml(spaces.resolve_sweep_path("smoke"))
    for bad in ({"surprise": 1}, {"seed": -1}, {"seed": "0"}, {"methods": ["lorra"]}, {"tasks": []},
                {"search": {"sampler": "random"}}, {"budgets": {"smoke": {"epochs": 1}}},
                {"budgets": {"smoke": {"trials_per_method": 2, "epochs": 1, "max_length": 4096}}},
                {"budgets": {"smoke": {"num_samples": 4, "epochs": 1}}},
                {"confirm": {"margin": 1.0}}, {"name": "a name"}):  # fmt: skip
        assert not check.is_valid({**document, **bad}), bad
        with pytest.raises(SpaceError):
            spaces.load_sweep(write(tmp_path / "bad" / "smoke.yaml", yaml.safe_dump({**document, **bad})),
                              spaces_dir=spaces.SEARCH_SPACES_DIR / spaces.METHODS_SUBDIR)  # fmt: skip
