"""The command line: training writes a checkpoint; bad input exits 2 with a message naming the problem."""

import pytest

from conftest import SHARED_DATA, write_task_file
from peftune import methods
from peftune.cli import commands


def run(capsys, *argv):
    code = commands.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_train_writes_a_checkpoint_and_reports(capsys, tiny_data_dir, tmp_path):
    code, out, _ = run(
        capsys,
        "train",
        "--method",
        "lora",
        "--rank",
        "4",
        "--tasks",
        "sst,sts",
        "--data-dir",
        str(tiny_data_dir),
        "--epochs",
        "1",
        "--max-train-examples",
        "32",
        "--max-dev-examples",
        "16",
        "--output",
        str(tmp_path / "ckpt"),
        "--export-peft",
    )
    assert code == 0
    assert "epoch 1:" in out and "sst_accuracy" in out and "sts_pearson" in out
    assert (tmp_path / "ckpt" / "trainable.safetensors").exists()
    assert (tmp_path / "ckpt" / "peft" / "adapter_model.safetensors").exists()
    code, _, err = run(
        capsys,
        "train",
        "--method",
        "lora",
        "--tasks",
        "sst",
        "--data-dir",
        str(tiny_data_dir),
        "--epochs",
        "1",
        "--output",
        str(tmp_path / "ckpt"),
    )
    assert code == 2 and "already holds a checkpoint" in err


def test_train_dora_with_lora_variants_exports_to_peft(capsys, tiny_data_dir, tmp_path):
    """A DoRA run with LoRA's variants as --option values trains and exports in peft's format (use_dora true)."""
    import json

    code, out, _ = run(
        capsys, "train", "--method", "dora", "--rank", "2", "--option", "use_rslora=true",
        "--option", "loraplus_lr_ratio=16", "--option", "init=olora", "--tasks", "sst", "--data-dir",
        str(tiny_data_dir), "--epochs", "1", "--max-train-examples", "32", "--max-dev-examples", "16",
        "--output", str(tmp_path / "ckpt"), "--export-peft",
    )  # fmt: skip
    assert code == 0 and "peft dora adapter:" in out
    exported = json.loads((tmp_path / "ckpt" / "peft" / "adapter_config.json").read_text())
    assert exported["use_dora"] and exported["use_rslora"] and exported["init_lora_weights"] == "olora"


@pytest.mark.parametrize("method", ["ia3", "vera"])
def test_train_ia3_and_vera_export_to_peft(capsys, tiny_data_dir, tmp_path, method):
    """--export-peft after an (IA)^3 or VeRA run: peft loads the adapter onto the HF BertModel of the same model and
    computes what the run's checkpoint computes."""
    import json

    import transformers

    from conftest import assert_peft_loads_the_export
    from peftune.core.checkpoint import load_checkpoint
    from peftune.inputs.backbone import DEFAULT_MODEL, resolve_model_dir

    options = ["--rank", "8"] if method == "vera" else []
    code, out, _ = run(
        capsys, "train", "--method", method, *options, "--tasks", "sst", "--data-dir", str(tiny_data_dir),
        "--epochs", "1", "--max-train-examples", "32", "--max-dev-examples", "16", "--output",
        str(tmp_path / "ckpt"), "--export-peft",
    )  # fmt: skip
    assert code == 0 and f"peft {method} adapter:" in out
    exported = json.loads((tmp_path / "ckpt" / "peft" / "adapter_config.json").read_text())
    assert exported["peft_type"] == method.upper() and exported["base_model_name_or_path"] == DEFAULT_MODEL
    model = load_checkpoint(tmp_path / "ckpt").eval()
    hf = transformers.BertModel.from_pretrained(str(resolve_model_dir(DEFAULT_MODEL))).eval()
    assert_peft_loads_the_export(model, hf, tmp_path / "ckpt" / "peft", export=False)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--method", "loraa"], "unknown method 'loraa'; valid methods:"),
        (["--method", "adapter", "--rank", "4"], "--rank does not apply to method 'adapter'"),
        (["--method", "lora", "--option", "ranks=3"], "has no option 'ranks'"),
        (["--method", "lora", "--rank", "0"], "rank must be a positive integer"),
        (["--tasks", "sst,nli"], "unknown task 'nli'"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_message(capsys, tiny_data_dir, argv, message):
    code, _, err = run(capsys, "train", "--data-dir", str(tiny_data_dir), *argv)
    assert code == 2
    assert message in err


def test_malformed_row_names_file_and_line(capsys, tiny_data_dir, tmp_path):
    for path in tiny_data_dir.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    write_task_file(tmp_path / "ids-sst-train.csv", ["sentence", "sentiment"], [["fine", 1], ["broken", 7]])
    code, _, err = run(
        capsys, "train", "--tasks", "sst", "--data-dir", str(tmp_path), "--output", str(tmp_path / "out")
    )
    assert code == 2
    assert "ids-sst-train.csv, line 3" in err and "one of 0, 1, 2, 3, 4" in err
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_missing_data_dir_and_model(capsys, tiny_data_dir, tmp_path):
    code, _, err = run(capsys, "train", "--data-dir", str(tmp_path / "nowhere"))
    assert code == 2 and "nowhere" in err
    code, _, err = run(capsys, "train", "--data-dir", str(tiny_data_dir), "--model", str(tmp_path / "no-model"))
    assert code == 2 and "no-model" in err


def test_methods_lists_every_method_with_counts(capsys):
    code, out, _ = run(capsys, "methods", "--bert-base-shape")
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines()[2:]}
    assert {"frozen", "full", "lora", "adapter", "lora_adapter", "hyperformer", "prefix", "prompt"} <= set(lines)
    assert "442,368" in lines["lora"] and "0.40%" in lines["lora"]


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="real data directory not present")
@pytest.mark.parametrize("method", methods.method_names())
def test_every_method_trains_on_the_real_files(capsys, tmp_path, method):
    """A short multitask run on the real SST/Quora/STS files with the packaged model."""
    code, out, err = run(
        capsys,
        "train",
        "--method",
        method,
        "--tasks",
        "sst,para,sts",
        "--data-dir",
        str(SHARED_DATA),
        "--epochs",
        "1",
        "--max-train-examples",
        "48",
        "--max-dev-examples",
        "48",
        "--max-length",
        "64",
        "--invalid-rows",
        "skip",
        "--output",
        str(tmp_path / method),
    )
    assert code == 0, err
    assert "para_accuracy" in out and "best dev score" in out
