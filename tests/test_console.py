"""The console (issue 31 item 6): a line per finished trial with the phase's progress, and the libraries quiet."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from types import SimpleNamespace

from peftune.sweep import console


def trial(method: str, score: float | None, epoch: int = 1):
    result = {"epoch": epoch} if score is None else {"epoch": epoch, "score": score}
    return SimpleNamespace(config={"method": method}, last_result=result)


def test_a_progress_line_counts_estimates_what_is_left_and_names_the_best_per_method(caplog, monkeypatch):
    clock = iter([0.0, 60.0, 120.0, 180.0])
    monkeypatch.setattr(console.time, "monotonic", lambda: next(clock))
    progress = console.Progress("search", 6, epochs=2)
    with caplog.at_level(logging.INFO, logger="peftune.sweep.console"):
        progress.on_trial_complete(0, [], trial("lora", 0.41, epoch=2))
        progress.on_trial_complete(0, [], trial("frozen", 0.39, epoch=1))  # ASHA stopped it after epoch 1
        progress.on_trial_error(0, [], trial("prompt", None))
    first, second, third = (r.getMessage() for r in caplog.records)
    assert first == "search 1/6 1m00s elapsed, ~5m00s left: lora 0.4100; best so far: lora 0.4100"
    assert second.startswith("search 2/6 (1 stopped early) 2m00s elapsed, ~4m00s left: frozen 0.3900")
    assert second.endswith("best so far: lora 0.4100, frozen 0.3900")
    assert third.startswith("search 3/6 (1 stopped early, 1 failed) 3m00s elapsed, ~3m00s left: prompt failed")


def test_trials_finishing_fast_get_a_line_at_the_first_each_tenth_a_failure_the_end_and_each_minute(
    caplog, monkeypatch
):
    """70 trials a second apart then one 2 minutes later: 158 of the SST cpu job's 315 lines were a line per trial."""
    clock = iter([0.0, *range(1, 71), 190.0, 191.0])  # started; trials 1..70 at 1 s each; 71 at 190 s; 72
    monkeypatch.setattr(console.time, "monotonic", lambda: float(next(clock)))
    progress = console.Progress("search", 72, epochs=1)
    with caplog.at_level(logging.DEBUG, logger="peftune.sweep.console"):
        for i in range(72):
            if i == 30:
                progress.on_trial_error(0, [], trial("prompt", None))
            else:
                progress.on_trial_complete(0, [], trial("lora", 0.4))
    shown = [int(r.getMessage().split()[1].split("/")[0]) for r in caplog.records if r.levelno == logging.INFO]
    assert shown == [1, 8, 15, 22, 29, 31, 36, 44, 51, 58, 65, 71, 72]  # 31: the failure; 71: a minute passed
    assert len([r for r in caplog.records if r.levelno == logging.DEBUG]) == 72 - len(shown)  # --verbose: all


def test_a_phase_of_unknown_size_counts_without_an_estimate(caplog):
    planned = []
    progress = console.Progress("confirmation", lambda: len(planned) or None, epochs=1)
    with caplog.at_level(logging.INFO, logger="peftune.sweep.console"):
        progress.on_trial_complete(0, [], trial("lora", 0.4))
    line = caplog.records[-1].getMessage()
    assert line.startswith("confirmation 1 ") and "left" not in line


def test_mlflow_links_and_download_bars_are_off_unless_the_user_set_them(monkeypatch):
    monkeypatch.delenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", raising=False)
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "true")  # the user's own choice wins
    console.quiet_libraries()
    assert os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] == "true"
    assert os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] == "true"


def test_durations_read_as_a_person_writes_them():
    assert [console.duration(s) for s in (5, 125, 3720, float("nan"))] == ["5s", "2m05s", "1h02m", "?"]


def test_tunes_slow_step_warnings_show_once_per_kind_and_the_rest_in_one_line_at_the_end(caplog):
    from ray.tune.utils.util import warn_if_slow

    from peftune.sweep.console import SlowLoopWarnings, slow_loop_warnings

    tune_log = logging.getLogger(SlowLoopWarnings.LOGGER)  # where Tune's warn_if_slow writes
    slow = [("on_trial_result", 0.61), ("on_trial_result", 0.93), ("process_trial_result", 0.55),
            ("on_trial_result", 0.58), ("process_trial_result", 0.7)]  # fmt: skip
    with caplog.at_level(logging.WARNING), slow_loop_warnings():
        for name, seconds in slow:
            tune_log.warning(warn_if_slow.DEFAULT_MESSAGE.format(name=name, duration=seconds))
        tune_log.warning("another warning of Tune's")  # not a slow step: always shown
    lines = [entry.getMessage() for entry in caplog.records]
    assert lines[:3] == [
        warn_if_slow.DEFAULT_MESSAGE.format(name="on_trial_result", duration=0.61),
        warn_if_slow.DEFAULT_MESSAGE.format(name="process_trial_result", duration=0.55),
        "another warning of Tune's",
    ]
    assert len(lines) == 4 and "3 more time(s)" in lines[3] and "the slowest 0.9 s" in lines[3]
    assert "--verbose" in lines[3]
    caplog.clear()
    tune_log.warning(warn_if_slow.DEFAULT_MESSAGE.format(name="on_trial_result", duration=0.6))
    assert len(caplog.records) == 1  # outside a sweep (and with --verbose) every one shows


def test_a_quiet_sweep_s_tune_fit_prints_nothing_of_its_own(monkeypatch, capfd, tmp_path):
    """Ray Tune's newer reporter prints an experiment box and a TensorBoard hint at every fit, even at verbose=0:
    a quiet sweep turns that reporter off for its own fits; a user's own choice of it wins. Found in CI: left
    off, a later sweep with Tune's tables in the same process (and the drivers it started) lost the "started
    with configuration" lines the tables print."""
    import ray
    from ray import tune

    from peftune.sweep import orchestrator

    name = console.TUNE_NEW_OUTPUT
    monkeypatch.setenv(name, "1")
    console.quiet_tune(console.TUNE_QUIET)()
    assert os.environ[name] == "1"  # the user's
    monkeypatch.delenv(name)  # restored at the end, as it was
    console.quiet_tune(console.TUNE_TABLES)()
    assert name not in os.environ
    back = console.quiet_tune(console.TUNE_QUIET)
    orchestrator.init_ray()
    try:
        capfd.readouterr()
        tune.Tuner(
            lambda config: tune.report({"score": config["x"]}),
            param_space={"x": tune.grid_search([1, 2])},
            run_config=tune.RunConfig(name="quiet", storage_path=str(tmp_path), verbose=console.TUNE_QUIET),
        ).fit()
    finally:
        ray.shutdown()
    printed = capfd.readouterr().out
    assert "Configuration for experiment" not in printed and "tensorboard" not in printed.lower()
    back()
    assert name not in os.environ  # the next sweep of this process gets Tune's default reporter


# A trial's process: Ray's SIGTERM handler (raises SystemExit, as ``ray._private.worker`` does) fires while a
# garbage-collection callback runs; a second object's callback raises an ordinary error.
UNRAISED_EXIT = """
import os, signal, sys
{install}
def ray_like_handler(signum, frame):
    raise SystemExit(1)
signal.signal(signal.SIGTERM, ray_like_handler)
class Collected:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs at a bytecode boundary, here: inside the callback
            pass
class Broken:
    def __del__(self):
        raise ValueError("a real fault in a callback")
Collected()
print("after the exit", flush=True)
Broken()
"""


def run_unraised_exit(install: str) -> subprocess.CompletedProcess:
    script = UNRAISED_EXIT.format(install=install)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


def test_an_exit_that_a_collection_callback_swallowed_is_not_printed_and_other_faults_still_are():
    without = run_unraised_exit("")
    assert "Exception ignored" in without.stderr and "SystemExit" in without.stderr  # the fault as it shows today
    done = run_unraised_exit(
        "from peftune.sweep import console; console.quiet_trial_logs(); console.quiet_trial_logs()"
    )
    assert done.returncode == 0 and "after the exit" in done.stdout
    assert "SystemExit" not in done.stderr
    assert "ValueError: a real fault in a callback" in done.stderr  # to the hook that was there, once
    assert done.stderr.count("Exception ignored") == 1
