"""Issue 11: the multitask job on the real data files, and the invalid-row policy of a sweep."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest

from conftest import SHARED_DATA
from peftune.record.writer import fingerprint_hashes
from peftune.sweep import spaces

REPO = Path(__file__).resolve().parents[1]
QUORA_BROKEN_LINES = [3296, 11099]  # rows of the shipped quora-train.csv with an empty sentence


def test_multitask_definition_skips_and_records_invalid_rows():
    definition = spaces.load_sweep(spaces.resolve_sweep_path("multitask_tuning"), budget="smoke")
    assert definition.invalid_rows == "skip"
    assert definition.to_dict()["invalid_rows"] == "skip"
    strict = definition.with_overrides(invalid_rows="raise")
    assert strict.invalid_rows == "raise" and strict.fingerprint() != definition.fingerprint()
    with pytest.raises(spaces.SpaceError, match="invalid_rows: expected one of raise, skip"):
        definition.with_overrides(invalid_rows="ignore")
    assert spaces.load_sweep(spaces.resolve_sweep_path("sst_tuning"), budget="smoke").invalid_rows == "raise"


def test_data_fingerprint_covers_the_row_policy():
    hashes = {"quora-train.csv": "ab" * 32}
    assert fingerprint_hashes(hashes, "skip") != fingerprint_hashes(hashes, "raise") == fingerprint_hashes(hashes)


def test_invalid_rows_key_is_validated(tmp_path):
    source = spaces.resolve_sweep_path("smoke").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(source + "\ninvalid_rows: ignore\n")
    (tmp_path / "methods").symlink_to(spaces.SEARCH_SPACES_DIR / "methods")
    with pytest.raises(spaces.SpaceError, match=r"invalid_rows: expected one of raise, skip, got 'ignore'"):
        spaces.load_sweep(bad, budget="smoke")


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.skipif(not (SHARED_DATA / "quora-train.csv").is_file(), reason="the real data is not here")
def test_multitask_job_smoke_test_on_the_real_data(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    command = [
        sys.executable, "jobs/multitask_tuning.py", "--smoke-test", "--data-dir", str(SHARED_DATA),
        "--tracking-uri", uri, "--storage-path", str(tmp_path / "ray_results"),
        "--reports-dir", str(tmp_path / "reports"),
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "platform"), str(REPO), env.get("PYTHONPATH", "")])
    job = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    output = job.stdout + job.stderr
    assert job.returncode == 0, output[-6000:]
    # the driver warns once, with the count
    assert len(re.findall(r"skipped 2 invalid data row\(s\) \(invalid_rows: skip\)", output)) == 1, output[-6000:]

    run_id = re.search(r"MLflow parent run id: (\w+)", output).group(1)
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["multitask_tuning"])
    parent = runs[runs["run_id"] == run_id].iloc[0]
    assert parent["tags.peftune.status"] == "completed" and parent["status"] == "FINISHED"
    assert parent["params.invalid_rows"] == "skip" and parent["params.skipped_rows"] == "2"
    children = runs[runs["tags.mlflow.parentRunId"] == run_id]
    confirmed = children[children["tags.peftune.phase"] == "confirm"]  # smoke: each budget's best, 1 seed
    children = children[children["tags.peftune.phase"] != "confirm"]
    if "tags.peftune.carried_from" in children:  # carried trials: search trials the search did not propose
        children = children[children["tags.peftune.carried_from"].isna()]
    assert len(children) == int(parent["params.num_samples"]) == 14  # one default trial per method
    assert sorted(children["tags.peftune.method"]) == sorted(
        spaces.load_sweep(spaces.resolve_sweep_path("multitask_tuning")).methods
    )
    assert 1 <= len(confirmed) == confirmed["tags.peftune.config_key"].nunique() <= 3  # one per budget
    assert children["metrics.best_score"].notna().all()

    skipped = json.loads(
        Path(
            mlflow.artifacts.download_artifacts(
                run_id=run_id, artifact_path="skipped_rows.json", dst_path=str(tmp_path / "dl")
            )
        ).read_text()
    )
    assert [(row["file"], row["line"]) for row in skipped] == [("quora-train.csv", n) for n in QUORA_BROKEN_LINES]
    assert "empty text in column 'sentence2'" in skipped[0]["reason"]
    assert "label '' in column 'is_duplicate' is not a number" in skipped[1]["reason"]

    report = tmp_path / "reports" / "multitask_tuning"
    table = (report / "report.md").read_text()
    assert "- data: 2 invalid row(s) skipped (invalid_rows: skip)" in table, table[:2000]
    for column in ("SST", "Quora", "STS", "Average", "Params updated per task %", "Additional params stored %"):
        assert column in table, table[:2000]
    assert (report / "report.html").is_file()

    # `peftune evaluate --answer` on this record reads the data as the sweep did (its malformed rows skipped)
    evaluate = [str(Path(sys.executable).parent / "peftune"), "evaluate", "--sweep", "multitask_tuning",
                "--data-dir", str(SHARED_DATA), "--tracking-uri", uri, "--answer", "--seeds", "1",
                "--output", str(report)]  # fmt: skip
    evaluated = subprocess.run(evaluate, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert evaluated.returncode == 0, (evaluated.stdout + evaluated.stderr)[-4000:]
    assert (report / "evaluation" / "evaluation.md").is_file()


def test_invalid_rows_flag_overrides_the_definition():
    import argparse

    from peftune.cli import sweep_command

    parser = argparse.ArgumentParser()
    sweep_command.add_arguments(parser, definition_default="multitask_tuning")
    default = sweep_command.definition_from_args(parser.parse_args(["--data-dir", "d", "--smoke-test"]))
    strict = sweep_command.definition_from_args(
        parser.parse_args(["--data-dir", "d", "--smoke-test", "--invalid-rows", "raise"])
    )
    assert default.invalid_rows == "skip" and strict.invalid_rows == "raise"
    assert default.fingerprint() != strict.fingerprint()  # resuming under another policy is refused
