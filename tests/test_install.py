"""A package that is whole: ``pip install .`` (not editable) into a fresh virtual environment, then, from an
empty directory and with nothing of the source tree on the path, the shipped search spaces and the report's
reference data are found as package data, ``peftune methods`` runs, and so does a smoke sweep of the shipped
``smoke`` definition on a tiny data directory.

The package is built and installed from a copy of the repository's files, so that the build leaves nothing in
the source tree. Its dependencies are not installed again: the new environment reads them from this one's
site-packages (a path in a .pth file, whose own .pth files, this project's editable install among them, are not
run). Installing them is what `.ci/run` has just done with the README's command, from the package index; a second
install of torch and Ray took six of the slow tier's minutes and tested nothing of this package.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from conftest import copy_repository

CHECK_DATA = """
import importlib.resources, sys
from peftune.sweep import spaces
assert spaces.SEARCH_SPACES_DIR.is_relative_to(sys.prefix), spaces.SEARCH_SPACES_DIR
assert {"smoke.yaml", "sst_tuning.yaml", "methods/lora.yaml"} <= {
    str(p.relative_to(spaces.SEARCH_SPACES_DIR)) for p in spaces.shipped_files()}
assert spaces.load_sweep(spaces.resolve_sweep_path("sst_tuning")).methods
assert (importlib.resources.files("analysis") / "reference" / "adaptbert_table3.csv").is_file()
print("package data: ok")
"""


def run(command: list, cwd: Path, env: dict, timeout: float) -> str:
    done = subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{command}: exit {done.returncode}\n{output[-4000:]}"
    return output


@pytest.mark.long
@pytest.mark.slow
def test_a_non_editable_install_finds_its_data_and_runs_the_smoke_sweep(tmp_path, tiny_data_dir):
    source, venv, empty = tmp_path / "source", tmp_path / "venv", tmp_path / "empty"
    for directory in (source, empty):
        directory.mkdir()
    copy_repository(source)
    # nothing of the caller's source tree or Ray session leaks in: the installed package must stand alone
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0")
    started = time.monotonic()
    run([sys.executable, "-m", "venv", venv], tmp_path, env, 300)
    site_packages = next((venv / "lib").glob("python3*/site-packages"))
    (site_packages / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([venv / "bin" / "python", "-m", "pip", "install", "--quiet", "--no-deps", source], tmp_path, env, 600)
    installed = time.monotonic()
    assert not list(site_packages.glob("torch*")) and list(site_packages.glob("peftune*"))  # the package only
    bin_dir = venv / "bin"
    assert "package data: ok" in run([bin_dir / "python", "-c", CHECK_DATA], empty, env, 300)
    assert "lora" in run([bin_dir / "peftune", "methods"], empty, env, 300)
    assert '"budgets"' in run([bin_dir / "peftune", "schema"], empty, env, 300)
    sweep = [bin_dir / "peftune", "sweep", "smoke", "--data-dir", tiny_data_dir, "--tracking-uri",
             f"sqlite:///{empty / 'mlflow.db'}", "--storage-path", empty / "ray_results",
             "--reports-dir", empty / "reports"]  # fmt: skip
    output = run(sweep, empty, env, 1800)
    assert "sweep smoke: completed" in output and (empty / "mlflow.db").is_file(), output[-4000:]
    print(f"install {installed - started:.0f} s; then methods, schema, sweep {time.monotonic() - installed:.0f} s")
