"""Shared fixtures: tiny BERT configs, the packaged model, tiny data directories."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach for the hub
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # `-n N`: the cores shared among the N workers, not N times each
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

from peftune.inputs.backbone import BertConfig, BertModel  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("PEFTUNE_DATA_DIR", REPO.parent / "shared" / "data"))

TINY = BertConfig(
    vocab_size=120,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
)


def tiny_backbone(seed: int = 0, config: BertConfig = TINY) -> BertModel:
    torch.manual_seed(seed)
    return BertModel(config)


def random_batch(seed: int = 1, batch: int = 3, length: int = 8):
    """(input_ids, attention_mask, token_type_ids) of random tokens, the first row padded."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, TINY.vocab_size, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0  # some padding
    return ids, mask, torch.zeros_like(ids)


def sequence_output(model, task: str, batch):
    """The backbone's (B, T, H) output with ``task``'s method parameters."""
    model.context.task = task
    return model.backbone(*batch)[0]


def sweep_command(definition: Path, data_dir: Path, uri: str, work: Path, *extra: str) -> list[str]:
    """``peftune sweep`` in a subprocess, its Ray state and reports under ``work`` (a trial may fail: allowed)."""
    import sys

    return [sys.executable, "-m", "peftune.cli.commands", "sweep", str(definition), "--data-dir", str(data_dir),
            "--tracking-uri", uri, "--storage-path", str(work / "ray_results"), "--reports-dir", str(work / "reports"),
            "--allow-failures", *extra]  # fmt: skip


def start_local_ray(num_cpus: int = 2, **kwargs) -> object:
    """A Ray of this test process only (``address="local"``: never a cluster already running here), its trials
    given Tune's wait for a reused worker's previous trial as the sweep's ``init_ray`` gives it: with Tune's own
    2 s, a loaded machine fails the next trial on a reused worker ("reset_config() ... return True")."""
    import ray

    from peftune.sweep.orchestrator import THREAD_TIMEOUT_S, THREAD_TIMEOUT_VAR

    wait = {"env_vars": {THREAD_TIMEOUT_VAR: str(THREAD_TIMEOUT_S)}}
    return ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, runtime_env=wait, **kwargs)


def copy_repository(target: Path) -> None:
    """The files a fresh clone has (the tracked ones when this is a git checkout), symlinks kept as links."""
    import shutil
    import subprocess

    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    names = listed.stdout.splitlines() if listed.returncode == 0 and listed.stdout else None
    if names is None:
        ignore = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.db", "*.egg-info", "build")
        shutil.copytree(REPO, target, ignore=ignore, symlinks=True, dirs_exist_ok=True)
        return
    for name in names + ["README.md"]:
        source = REPO / name
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():  # platform/peftune/search_spaces: the shipped spaces, linked into the package
            (target / name).unlink(missing_ok=True)
            (target / name).symlink_to(os.readlink(source))
        elif source.is_file():
            shutil.copy2(source, target / name)


def write_task_file(path: Path, header: list[str], rows: list[list]) -> Path:
    """A file in the shared data format: TSV, an unnamed index column, then id and the columns."""
    lines = ["\t".join(["", "id", *header])]
    for i, row in enumerate(rows):
        lines.append("\t".join([str(i), f"id{i:04d}", *map(str, row)]))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


POSITIVE = ["a great , wonderful film", "truly moving and funny", "brilliant acting , loved it", "a joy to watch"]
NEGATIVE = ["a dull , boring mess", "awful and tedious", "the worst plot ever", "painfully bad acting"]


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's own tokenizer (offline)."""
    from peftune.inputs.backbone import DEFAULT_MODEL, load_tokenizer, resolve_model_dir

    return load_tokenizer(resolve_model_dir(DEFAULT_MODEL))


@pytest.fixture
def clean_data():
    """No tokenized split, read file or task declared by another test before or after this one."""
    from peftune.inputs import data, tasks

    data.clear_cache()
    yield
    data.clear_cache()
    tasks.forget_declared()


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory) -> Path:
    """Learnable toy versions of the sst, para, sts and cfimdb files (same names and columns as the real ones)."""
    import random

    rng = random.Random(0)
    directory = tmp_path_factory.mktemp("data")
    for split, n in (("train", 96), ("dev", 32)):
        sst, cfimdb, para, sts = [], [], [], []
        for i in range(n):
            positive = i % 2 == 0
            text = rng.choice(POSITIVE if positive else NEGATIVE)
            sst.append([text, 4 if positive else 0])
            cfimdb.append([text, int(positive)])
            a = rng.choice(POSITIVE + NEGATIVE)
            same = i % 3 == 0
            b = a if same else rng.choice([s for s in POSITIVE + NEGATIVE if s != a])
            para.append([a, b, float(same)])
            sts.append([a, b, 5.0 if same else 1.0])
        write_task_file(directory / f"ids-sst-{split}.csv", ["sentence", "sentiment"], sst)
        write_task_file(directory / f"ids-cfimdb-{split}.csv", ["sentence", "sentiment"], cfimdb)
        write_task_file(directory / f"quora-{split}.csv", ["sentence1", "sentence2", "is_duplicate"], para)
        write_task_file(directory / f"sts-{split}.csv", ["sentence1", "sentence2", "similarity"], sts)
    return directory


@pytest.fixture(scope="session")
def tiny_prepared(tiny_data_dir):
    """PreparedData on the toy files with the real tokenizer and a tiny random BERT (fast to train)."""
    from peftune.core.train import PreparedData, PretrainedBackbone
    from peftune.inputs.backbone import DEFAULT_MODEL, load_tokenizer, resolve_model_dir
    from peftune.inputs.data import DataSettings, load_tasks
    from peftune.inputs.tasks import parse_tasks

    tokenizer = load_tokenizer(resolve_model_dir(DEFAULT_MODEL))
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
    )
    torch.manual_seed(0)
    backbone = BertModel(config)
    # a selection split as a sweep carves it (as many train rows as dev has): search trials select on it
    settings = DataSettings(str(tiny_data_dir), max_length=32, selection_examples=None)
    tasks = load_tasks(settings, parse_tasks("sst,para,sts"), tokenizer)
    return PreparedData(
        backbone=PretrainedBackbone("tiny-random-bert", config, backbone.state_dict()),
        tasks=tasks,
        pad_token_id=tokenizer.pad_token_id,
        max_length=32,
        file_hashes={},
    )


# `.ci/run` runs the slow tier in two workers, a whole file to a worker at a time, in collection order: the longest
# files go first, so that neither worker is left alone with a long one at the end (with the files in name order,
# one core sat idle for the last 3.3 minutes). By the slow tier's measured time per file (the long tests included),
# longest first; the same order serves `-m "slow and not long"` and `-m long`.
LONGEST_FIRST = (
    "test_decision_rates",
    "test_faults",
    "test_fresh_machine",
    "test_decisions",
    "test_multitask_job",
    "test_confirm",
    "test_disk_full_sweeps",
    "test_mlflow_ui",
    "test_code_travels",
    "test_lease",
    "test_search",
    "test_cluster",
    "test_postgres",
    "test_packing",
    "test_install",
    "test_worker_memory",
    "test_reproducible",
)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: a long test is deselected as the slow one it is
def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("long"):
            item.add_marker(pytest.mark.slow)  # a long test is a slow one: the fast tier never runs it
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the rest keep their order


@pytest.fixture(autouse=True)
def no_lease_left_renewing():
    """Every test releases the sweep leases it took: a lease thread left renewing stops the process (os._exit,
    as a superseded driver must) once pytest deletes the test's directory, and with it a worker and its tests."""
    import threading

    yield
    left = [thread for thread in threading.enumerate() if thread.name == "peftune-lease" and thread.is_alive()]
    assert not left, f"{len(left)} sweep lease(s) still held after the test"


def assert_peft_loads_the_export(model, hf, directory, export: bool = True) -> object:
    """Export ``model``'s adapter in peft's format to ``directory`` (or, ``export=False``, take the export already
    there), load it onto the HF BERT ``hf`` with peft, and check that the file holds exactly what peft itself saves
    for the loaded model (its keys, every value loaded) and that both give the same hidden states on a padded batch;
    returns the loaded peft model and the batch."""
    import peft
    import torch
    from safetensors.torch import load_file

    from peftune.core.checkpoint import export_peft

    if export:
        export_peft(model, directory)
    loaded = peft.PeftModel.from_pretrained(hf, directory).eval()
    written = load_file(directory / "adapter_model.safetensors")
    saved_by_peft = peft.get_peft_model_state_dict(loaded, save_embedding_layers=False)  # what save_pretrained writes
    assert written.keys() == saved_by_peft.keys(), sorted(written.keys() ^ saved_by_peft.keys())
    torch.testing.assert_close(written, saved_by_peft, rtol=0, atol=0)
    ids = torch.randint(1, TINY.vocab_size, (2, 7))
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    with torch.no_grad():
        ours = model.backbone(ids, mask, torch.zeros_like(ids))[0]
        theirs = loaded(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], rtol=1e-5, atol=1e-5)
    return loaded, ids, mask
