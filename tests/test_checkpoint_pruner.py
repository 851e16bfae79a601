"""The sweep's checkpoints are pruned by peftune, not by Tune's ``num_to_keep``.

``CheckpointConfig(num_to_keep=1)`` made Tune save the whole experiment's state after every trial checkpoint
(a saved state must not name a deleted checkpoint), and a save writes every trial: the driver's cost per trial
grew with the sweep (issue 31, 224 -> 767 ms a trial between the first and the last 200 of 1,000).
``resume.CheckpointPruner`` keeps what a retry, a resume and the record still read; Tune saves on its own period.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pyarrow.fs
import pytest

from conftest import start_local_ray
from peftune.sweep.resume import CheckpointPruner, checkpoint_exists, delete_checkpoint


def _checkpoint(path):
    path.mkdir(parents=True)
    (path / "trainable.safetensors").write_bytes(b"x")
    return SimpleNamespace(path=str(path), filesystem=pyarrow.fs.LocalFileSystem())


def _report(pruner, trial, checkpoint, score):
    trial.last_result = {"score": score}  # Tune processes the result before the checkpoint it carries
    pruner.on_checkpoint(iteration=0, trials=[trial], trial=trial, checkpoint=checkpoint)


def _on_disk(directory):
    return sorted(path.name for path in directory.iterdir())


def test_a_trial_keeps_its_best_its_latest_and_what_the_last_two_saves_name(tmp_path):
    pruner = CheckpointPruner("score")
    trial = SimpleNamespace(trial_id="t1", last_result={})
    root = tmp_path / "t1"
    checkpoints = [_checkpoint(root / f"checkpoint_{i}") for i in range(6)]

    _report(pruner, trial, checkpoints[0], 0.30)
    _report(pruner, trial, checkpoints[1], 0.50)  # the best (and the earliest of the two 0.50s)
    # checkpoint_0 went: neither best nor latest, and no save names it (2 to 5 are not reported yet)
    assert _on_disk(root) == ["checkpoint_1", "checkpoint_2", "checkpoint_3", "checkpoint_4", "checkpoint_5"]
    pruner.on_state_save()  # a save names checkpoint_1
    _report(pruner, trial, checkpoints[2], 0.40)
    pruner.on_state_save()  # a save names checkpoint_2
    _report(pruner, trial, checkpoints[3], 0.50)  # a tie: the earlier stays the best
    _report(pruner, trial, checkpoints[4], 0.20)
    # checkpoint_1: best and saved; checkpoint_2: the last save's; checkpoint_3 went (neither); checkpoint_4: latest
    reported = [name for name in _on_disk(root) if name < "checkpoint_5"]
    assert reported == ["checkpoint_1", "checkpoint_2", "checkpoint_4"]

    pruner.on_trial_complete(iteration=0, trials=[trial], trial=trial)
    pruner.on_state_save()
    pruner.on_state_save()  # both states a resume may read name checkpoint_4, the trial ended before them
    reported = [name for name in _on_disk(root) if name < "checkpoint_5"]
    assert reported == ["checkpoint_1", "checkpoint_4"]
    assert "t1" not in pruner.trials  # forgotten: a save costs nothing for an ended trial


def test_without_a_score_only_the_latest_and_the_saved_ones_stay(tmp_path):
    pruner = CheckpointPruner(score=None)
    trial = SimpleNamespace(trial_id="t", last_result={})
    checkpoints = [_checkpoint(tmp_path / f"c{i}") for i in range(3)]
    for checkpoint in checkpoints:
        _report(pruner, trial, checkpoint, 0.9)
    assert _on_disk(tmp_path) == ["c2"]


def test_a_checkpoint_already_deleted_is_no_error(tmp_path):
    checkpoint = _checkpoint(tmp_path / "c")
    delete_checkpoint(checkpoint)
    assert not checkpoint_exists(checkpoint)
    delete_checkpoint(checkpoint)  # Tune's own num_to_keep (a sweep begun before the pruner) deleted it first


@pytest.mark.slow
def test_real_tune_saves_on_its_period_and_the_best_checkpoint_is_the_one_kept(tmp_path):
    """Real Tune: the pruner's rule holds on Tune's own checkpoints, and Tune no longer saves its state once a
    checkpoint (with ``num_to_keep=1`` it saved at least once per checkpoint: 2 trials x 6 epochs here)."""
    import ray
    from ray import tune

    from peftune.sweep.resume import RunCallbacks, installed

    scores = {0: [0.1, 0.4, 0.3, 0.4, 0.2, 0.35], 1: [0.5, 0.2, 0.6, 0.1, 0.6, 0.0]}

    def trainable(config):
        import tempfile

        for epoch, score in enumerate(scores[config["arm"]], start=1):
            with tempfile.TemporaryDirectory() as directory:
                (Path(directory) / "epoch.txt").write_text(str(epoch))
                tune.report({"score": score, "epoch": epoch}, checkpoint=tune.Checkpoint.from_directory(directory))

    pruner = CheckpointPruner("score")
    start_local_ray()
    try:
        with installed([pruner]):
            grid = tune.Tuner(
                trainable,
                param_space={"arm": tune.grid_search([0, 1])},
                run_config=tune.RunConfig(
                    storage_path=str(tmp_path / "ray"),
                    callbacks=[RunCallbacks()],
                    checkpoint_config=tune.CheckpointConfig(
                        checkpoint_score_attribute="score", checkpoint_score_order="max"
                    ),
                    verbose=0,
                ),
            ).fit()
    finally:
        ray.shutdown()
    assert not grid.errors
    assert pruner.saves < 12, pruner.saves  # not a save per checkpoint: 14 with num_to_keep=1 (measured)
    for result in grid:
        arm = result.config["arm"]
        kept = [(metrics["epoch"], checkpoint) for checkpoint, metrics in result.best_checkpoints
                if checkpoint_exists(checkpoint)]  # fmt: skip
        epochs = sorted(epoch for epoch, _ in kept)
        best = max(range(6), key=lambda i: (scores[arm][i], -i)) + 1  # the best score, the earliest on a tie
        assert best in epochs and 6 in epochs  # the best and the latest are on disk
        assert len(epochs) <= 4, epochs  # and at most the two the last saves named beside them
        for epoch, checkpoint in kept:  # each checkpoint Tune names is its own epoch's
            assert (Path(checkpoint.path) / "epoch.txt").read_text() == str(epoch)
