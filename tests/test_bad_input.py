"""Issue 9, bad input: NaN/inf, out-of-range sweep fields, duplicate keys, aliases, wrong section types.

Every case is refused while loading, naming the file and the key (or line), in a bounded one-line message.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from peftune import methods
from peftune.core import train
from peftune.sweep import spaces
from peftune.sweep.spaces import SpaceError

LORA = """\
method: lora
lr: {low: 1e-4, high: 5e-3, log: true}
dropout: {low: 0.0, high: 0.3}
weight_decay: 0.01
options:
  rank: {choices: [2, 4, 8]}
  alpha: 16
"""

SWEEP = """\
name: tiny
tasks: [sst]
methods: [lora]
seed: 0
resources: {cpus_per_trial: 1}
train: {warmup_ratio: 0.1}
budget: small
budgets:
  small: {trials_per_method: 2, epochs: 1}
"""


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.parametrize(
    "old, new, key",
    [
        ("lr: {low: 1e-4, high: 5e-3, log: true}", "lr: {low: 1e-4, high: .inf, log: true}", "lr.high"),
        ("lr: {low: 1e-4, high: 5e-3, log: true}", "lr: .nan", "lr"),
        ("lr: {low: 1e-4, high: 5e-3, log: true}", "lr: {choices: [1.0e-4, .nan]}", "lr.choices[1]"),
        ("weight_decay: 0.01", "weight_decay: -.inf", "weight_decay"),
        ("alpha: 16", "alpha: .nan", "options.alpha"),
        ("alpha: 16", "alpha: {choices: [8.0, .inf]}", "options.alpha.choices[1]"),
    ],
)
def test_method_space_refuses_nan_and_inf(tmp_path, old, new, key):
    assert old in LORA
    with pytest.raises(SpaceError, match="finite") as caught:
        spaces.load_method_space(write(tmp_path / "lora.yaml", LORA.replace(old, new)))
    assert caught.value.key == key and "lora.yaml" in str(caught.value)


def test_adapter_init_std_nan_is_refused(tmp_path):
    text = "method: adapter\nlr: 1e-3\ndropout: 0.1\nweight_decay: 0.0\noptions:\n  bottleneck: 8\n  init_std: .nan\n"
    with pytest.raises(SpaceError, match="finite") as caught:
        spaces.load_method_space(write(tmp_path / "adapter.yaml", text))
    assert caught.value.key == "options.init_std"


@pytest.fixture
def sweep_dir(tmp_path) -> Path:
    write(tmp_path / "methods" / "lora.yaml", LORA)
    return tmp_path


@pytest.mark.parametrize(
    "old, new, key, message",
    [
        ("cpus_per_trial: 1", "cpus_per_trial: .nan", "resources.cpus_per_trial", "finite"),
        ("cpus_per_trial: 1", "gpus_per_trial: .inf", "resources.gpus_per_trial", "finite"),
        ("seed: 0", "seed: 4294967296", "seed", "from 0 to 4,294,967,295"),
        ("warmup_ratio: 0.1", "device: tpu", "train.device", "'tpu'"),
        ("warmup_ratio: 0.1", "max_grad_norm: .nan", "train.max_grad_norm", "finite"),
        ("warmup_ratio: 0.1", "log_every: -5", "train.log_every", "from 0 to"),
        ("warmup_ratio: 0.1", "temperature: .inf", "train.temperature", "finite"),
        ("resources: {cpus_per_trial: 1}", "resources: {cpus_per_trial: 1}\nsearch: false", "search", "mapping"),
        ("train: {warmup_ratio: 0.1}", "train: []", "train", "mapping"),
        ("seed: 0", "seed: 0\ninvalid_rows: maybe", "invalid_rows", "raise, skip"),
    ],
)  # fmt: skip
def test_sweep_fields_refused_while_loading(sweep_dir, old, new, key, message):
    assert old in SWEEP
    with pytest.raises(SpaceError) as caught:
        spaces.load_sweep(write(sweep_dir / "tiny.yaml", SWEEP.replace(old, new)))
    assert caught.value.key == key and message in str(caught.value) and "tiny.yaml" in str(caught.value)


def test_duplicate_keys_are_an_error_naming_the_line(sweep_dir):
    text = SWEEP.replace("small: {trials_per_method: 2, epochs: 1}", "small: {epochs: 2, epochs: 50}")
    with pytest.raises(SpaceError, match=r"tiny\.yaml: not valid YAML: line 9, column \d+: duplicate key 'epochs'"):
        spaces.load_sweep(write(sweep_dir / "tiny.yaml", text))
    nested = SWEEP + "seed: 1\n"
    with pytest.raises(SpaceError, match=r"line 10, column 1: duplicate key 'seed'"):
        spaces.load_sweep(write(sweep_dir / "tiny.yaml", nested))


def test_aliases_are_refused_and_messages_stay_bounded(tmp_path):
    # ten levels of nine aliases each: 9**10 leaves if expanded (the "billion laughs")
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 11)]
    path = write(tmp_path / "bomb.yaml", "\n".join(lines) + "\nname: *a10\n")
    with pytest.raises(SpaceError) as caught:
        spaces.load_sweep(path)
    assert "line 2" in str(caught.value) and "aliases are not allowed" in str(caught.value)
    # a huge value in a wrong place is echoed cut short, on one line
    huge = write(tmp_path / "huge.yaml", SWEEP.replace("name: tiny", "name: [" + ", ".join(["x" * 50] * 5000) + "]"))
    with pytest.raises(SpaceError) as caught:
        spaces.load_sweep(huge)
    assert caught.value.key == "name" and len(str(caught.value)) < 500 and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "field, value",
    [("lr", float("inf")), ("weight_decay", float("nan")), ("dropout", float("nan")), ("max_grad_norm", float("nan")),
     ("warmup_ratio", float("nan")), ("temperature", float("inf"))],
)  # fmt: skip
def test_train_config_refuses_non_finite_numbers(field, value):
    with pytest.raises(ValueError, match=f"TrainConfig.{field} must be a finite number"):
        train.TrainConfig(method="lora", tasks=["sst"], **{field: value})


@pytest.mark.parametrize(
    "values, message",
    [({"seed": 2**32}, "seed: out of range"), ({"seed": -1}, "seed: out of range"), ({"device": "tpu"}, "device 'tpu'"),
     ({"log_every": -5}, "log_every: out of range"), ({"epochs": 2.5}, "epochs must be an integer"),
     ({"method_options": {"alpha": float("nan")}}, "LoraConfig.alpha must be a finite number")],
)  # fmt: skip
def test_train_config_refuses_out_of_range_settings(values, message):
    with pytest.raises(ValueError, match=message):
        train.TrainConfig(method="lora", tasks=["sst"], **values)


@pytest.mark.parametrize(
    "method, options",
    [("lora", {"alpha": float("nan")}), ("adapter", {"init_std": float("nan")}),
     ("hyperformer", {"init_std": float("inf")}), ("lora", {"dropout": float("nan")})],
)  # fmt: skip
def test_method_configs_refuse_non_finite_options(method, options):
    with pytest.raises(ValueError, match="must be a finite number"):
        methods.make_method_config(method, options)


TOO_DEEP = "nested too deep (more than 64 levels)"


def deep_block_mapping(levels: int) -> str:
    return "".join("  " * i + f"k{i}:\n" for i in range(levels)) + "  " * levels + "x\n"


@pytest.mark.parametrize(
    "text, message",
    [("", "the file is empty; expected a YAML mapping"),
     ("# a comment, no document\n", "the file is empty; expected a YAML mapping"),
     ("name: " + "[" * 3000 + "]" * 3000 + "\n", f"not valid YAML: line 1, column 70: {TOO_DEEP}"),
     ("name: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n", f"not valid YAML: line 1, column 256: {TOO_DEEP}"),
     (deep_block_mapping(100), f"not valid YAML: line 64, column 127: {TOO_DEEP}")],
    ids=["empty", "only a comment", "3,000 lists deep", "3,000 mappings deep", "100 mappings deep"],
)  # fmt: skip
def test_an_empty_or_too_deeply_nested_file_is_named_with_its_line(tmp_path, text, message):
    """Issue 34: an empty file was "expected a mapping at the top level, got NoneType"; 3,000 levels of nesting
    were "RecursionError: maximum recursion depth exceeded", with no line."""
    path = write(tmp_path / "tiny.yaml", text)
    for load in (spaces.load_sweep, spaces.load_method_space):
        with pytest.raises(SpaceError) as caught:
            load(path)
        assert str(caught.value).startswith(f"{path}: {message}"), str(caught.value)


def test_a_directory_given_as_the_file_is_named_a_directory(tmp_path):
    folder = tmp_path / "tiny.yaml"
    folder.mkdir()
    with pytest.raises(SpaceError, match=r"tiny\.yaml: is a directory; expected a YAML file$"):
        spaces.load_sweep(folder)
    with pytest.raises(SpaceError, match="file not found"):
        spaces.load_sweep(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    "old, new, key",
    [
        ("cpus_per_trial: 1", "cpus_per_trial: 1.0e308", "resources.cpus_per_trial"),
        ("cpus_per_trial: 1", "cpus_per_trial: 1, max_concurrent_trials: 1000000000000000000000000000000",
         "resources.max_concurrent_trials"),
        ("seed: 0", "seed: 0\nmax_failures: 1000000000000000000000000000000", "max_failures"),
        ("seed: 0", "seed: 0\ncheckpoints_per_method: 100000000000", "checkpoints_per_method"),
        ("seed: 0", "seed: 0\nsearch: {n_startup_trials: 100000000000}", "search.n_startup_trials"),
        ("seed: 0", "seed: 0\nscheduler: {grace_period: 100000000000}", "scheduler.grace_period"),
        ("seed: 0", "seed: 0\nscheduler: {reduction_factor: 100000000000}", "scheduler.reduction_factor"),
        ("seed: 0", "seed: 0\nscheduler: {min_steps: 1000000000000000000000000000000}", "scheduler.min_steps"),
        ("seed: 0", "seed: 0\nconfirm: {top_k: 100000000000}", "confirm.top_k"),
        ("seed: 0", "seed: 0\nconfirm: {max_seconds: 100000000000}", "confirm.max_seconds"),
        ("epochs: 1}", "epochs: 1, max_train_examples: 1000000000000000000000000000000}",
         "budgets.small.max_train_examples"),
        ("warmup_ratio: 0.1", "max_grad_norm: 1.0e308", "train.max_grad_norm"),
        ("warmup_ratio: 0.1", "log_every: 1000000000000000000000000000000", "train.log_every"),
    ],
)  # fmt: skip
def test_counts_have_an_upper_bound_named_in_the_message(sweep_dir, old, new, key):
    """Issue 34 item 3: a count of 10**30 (or 1e308 CPUs per trial) is refused while loading, with its bound."""
    assert old in SWEEP
    with pytest.raises(SpaceError) as caught:
        spaces.load_sweep(write(sweep_dir / "tiny.yaml", SWEEP.replace(old, new)))
    assert caught.value.key == key and "out of range" in str(caught.value), str(caught.value)


def test_a_search_space_the_backbone_cannot_hold_is_refused_before_ray(sweep_dir):
    """Issue 34 item 2: top_k's k up to 12 on the 6-layer default model is refused naming the space file and key,
    before Ray starts (``peftune train --k 7`` was refused; the sweep's space reached the trials)."""
    from peftune.base.errors import UserError
    from peftune.cli import sweep_command

    write(sweep_dir / "methods" / "top_k.yaml", """\
        method: top_k
        lr: 1e-3
        dropout: 0.1
        weight_decay: 0.0
        options:
          k: {low: 1, high: 12}
        """)  # fmt: skip
    definition = spaces.load_sweep(write(sweep_dir / "tiny.yaml", SWEEP.replace("[lora]", "[top_k]")))
    with pytest.raises(UserError, match=r"top_k\.yaml: options\.k: 12 does not fit the model .*6 layers"):
        sweep_command.check_spaces_against_model(definition)
    write(sweep_dir / "methods" / "top_k.yaml", (sweep_dir / "methods" / "top_k.yaml").read_text().replace("12", "6"))
    sweep_command.check_spaces_against_model(spaces.load_sweep(sweep_dir / "tiny.yaml"))  # 6 layers: fits


# ----------------------------------------------------------------------------- issue 47: the last rough edges


def test_an_integer_for_a_float_option_is_a_float_on_every_route():
    """``peftune train --method vera --option d_initial=1`` was torch's "Only Tensors of floating point ... can
    require gradients" (the sweep's YAML route made 1 a float, ``--option`` did not): the config coerces."""
    from conftest import tiny_backbone
    from peftune.methods.base import TaskContext

    config = methods.make_method_config("vera", {"d_initial": 1, "rank": 4})
    assert type(config.d_initial) is float and config.d_initial == 1.0
    methods.get_method("vera").apply(tiny_backbone(), config, TaskContext(["sst"]))  # builds: float vectors
    assert type(methods.make_method_config("lora", {"alpha": 16}).alpha) is float
    with pytest.raises(ValueError, match="LoraConfig.alpha must be a number, got True"):
        methods.make_method_config("lora", {"alpha": True})  # a bool is not coerced into a number


def test_a_zero_vera_scale_is_refused_naming_the_key(tmp_path):
    """VeRA's d_initial = 0 keeps Lambda_d at 0: the update is 0 and its gradient too; only the heads trained."""
    with pytest.raises(ValueError, match=r"VeraConfig\.d_initial = 0\.0 is out of range; expected a value in \(0"):
        methods.make_method_config("vera", {"d_initial": 0.0})
    text = "method: vera\nlr: 1.0e-3\ndropout: 0.1\nweight_decay: 0.0\noptions:\n  rank: 8\n"
    with pytest.raises(SpaceError, match="d_initial") as caught:
        spaces.load_method_space(write(tmp_path / "vera.yaml", text + "  d_initial: {choices: [0.1, 0]}\n"))
    assert caught.value.key == "options.d_initial" and "out of range" in str(caught.value)


SIZES = [("lora", "rank"), ("adapter", "bottleneck"), ("top_k", "k"), ("prefix", "prefix_length"),
         ("prompt", "prompt_length"), ("hyperformer", "task_embedding_dim"), ("hyperformer", "bottleneck"),
         ("vera", "rank"), ("lora_adapter", "bottleneck"), ("prefix", "reparam_hidden")]  # fmt: skip


@pytest.mark.parametrize("method, key", SIZES)
def test_a_size_beyond_any_model_is_refused_while_loading_naming_the_key(tmp_path, method, key):
    """10**30 among the choices of a size was accepted by the space (only ``peftune sweep`` checked the model)."""
    with pytest.raises(ValueError, match=f"{key} = 1{'0' * 30} is too large for any BERT"):
        methods.make_method_config(method, {key: 10**30})
    text = f"method: {method}\nlr: 1.0e-3\ndropout: 0.1\nweight_decay: 0.0\noptions:\n"
    size = methods.get_method(method).size_field
    fixed = f"  {size}: 2\n" if size != key else ""
    path = write(tmp_path / f"{method}.yaml", text + fixed + f"  {key}: {{choices: [2, {10**30}]}}\n")
    with pytest.raises(SpaceError, match="too large for any BERT") as caught:
        spaces.load_method_space(path)
    assert caught.value.key == f"options.{key}", str(caught.value)


@pytest.mark.parametrize(
    "old, new, shown",
    [("seed: 0", "seed: 010", "010"), ("seed: 0", "seed: -07", "-07"), ("seed: 0", "seed: 1:30", "1:30"),
     ("warmup_ratio: 0.1", "warmup_ratio: 1:30.5", "1:30.5")],
)  # fmt: skip
def test_yaml_1_1_numbers_the_user_did_not_write_are_refused_with_the_line(sweep_dir, old, new, shown):
    """YAML 1.1 read ``010`` as octal 8 and ``1:30`` as base 60 (90), silently."""
    assert old in SWEEP
    path = write(sweep_dir / "tiny.yaml", SWEEP.replace(old, new))
    with pytest.raises(SpaceError) as caught:
        spaces.load_sweep(path)
    line = 1 + SWEEP.splitlines().index(next(li for li in SWEEP.splitlines() if old in li))
    message = str(caught.value)
    assert message.startswith(f"{path}: not valid YAML: line {line}, column ") and repr(shown) in message, message


def test_plain_yaml_numbers_still_read_as_numbers(sweep_dir):
    text = SWEEP.replace("seed: 0", "seed: 0x10").replace("trials_per_method: 2", "trials_per_method: 1_0")
    definition = spaces.load_sweep(write(sweep_dir / "tiny.yaml", text.replace("0.1}", "0.0}")))
    assert definition.seed == 16 and definition.budget.trials_per_method == 10


def test_a_nul_byte_in_a_data_path_is_a_data_error():
    from peftune.inputs import data
    from peftune.inputs.tasks import get_task

    for read in (lambda: data.read_task_file("data/a\0b.csv", get_task("sst")), lambda: data.file_sha256("a\0b")):
        with pytest.raises(data.DataError, match="a NUL byte"):
            read()


@pytest.mark.parametrize("key", ["max_train_examples", "max_dev_examples", "selection_examples",
                                 "decision_examples", "max_length"])  # fmt: skip
def test_a_bool_is_not_a_count(key):
    """``max_train_examples=True`` was taken as 1."""
    from peftune.core.trial_spec import DataSettings

    extra = {"selection_examples": 8} if key == "decision_examples" else {}
    with pytest.raises(ValueError, match=f"DataSettings.{key}: expected an integer, got True"):
        DataSettings("data", **{**extra, key: True})


def test_load_tasks_refuses_a_bool_for_a_count(tiny_data_dir):
    from peftune.inputs import data
    from peftune.inputs.backbone import DEFAULT_MODEL, load_tokenizer, resolve_model_dir

    tokenizer = load_tokenizer(resolve_model_dir(DEFAULT_MODEL))
    with pytest.raises(ValueError, match="DataSettings.max_train_examples: expected an integer, got True"):
        data.load_tasks(data.DataSettings(str(tiny_data_dir), max_train_examples=True), ["sst"], tokenizer)
