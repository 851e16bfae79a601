"""Encoders beyond BERT through a whole sweep (issue 53): the guide's example task swept on tiny random RoBERTa,
DistilBERT and ELECTRA checkpoints (`--model DIR`), each with its own tokenizer: search, confirmation and report
end with exit 0, and the record names the model. RoBERTa runs in the slow tier; the other two in the long one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_backbone_families import make_checkpoint

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "questions" / "sweep.yaml"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["roberta", pytest.param("distilbert", marks=pytest.mark.long),
                                    pytest.param("electra", marks=pytest.mark.long)])  # fmt: skip
def test_a_smoke_sweep_runs_on_each_encoder_family(family, tmp_path):
    import mlflow

    make_checkpoint(family, tmp_path / family)
    # the example's sweep with the methods whose shipped spaces fit a 32-wide encoder (LoRA's ranks reach 64)
    sweep = EXAMPLE.read_text().replace("tasks: [task.yaml]", f"tasks: [{EXAMPLE.parent / 'task.yaml'}]")
    sweep = sweep.replace("methods: [frozen, bitfit, lora, adapter, ia3]", "methods: [frozen, bitfit, ia3]")
    definition = tmp_path / "sweep.yaml"
    definition.write_text(sweep)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    command = [sys.executable, "-m", "peftune.cli.commands", "sweep", str(definition), "--smoke-test", "--model",
               str(tmp_path / family), "--name", f"questions_{family}", "--tracking-uri", uri, "--storage-path",
               str(tmp_path / "ray_results"), "--reports-dir", str(tmp_path / "reports")]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "reports" / f"questions_{family}" / "report.md").is_file()
    client = mlflow.MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name(f"questions_{family}").experiment_id])
    parent = [r for r in runs if r.data.tags.get("peftune.role") == "sweep"][0]
    assert parent.data.params["model"] == str(tmp_path / family)
    assert sum(r.data.tags.get("peftune.role") == "trial" and r.info.status == "FINISHED" for r in runs) >= 3
