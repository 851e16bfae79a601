"""Any sweep definition as a Ray job: a shipped one by name, or your own YAML file (docs/guide.md).

On a Ray cluster, from the repository root (token authentication on, dashboard and Jobs API on 127.0.0.1):

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python jobs/tuning.py \\
        --definition examples/questions/sweep.yaml --tracking-uri sqlite:///$PWD/mlflow.db \\
        --storage-path $PWD/ray_results --reports-dir $PWD/reports

A shipped definition on your own task (a task file; its data files beside it travel with the working directory):

    python jobs/tuning.py --definition sst_tuning --tasks examples/questions/task.yaml --name questions_tuning

(absolute paths for what must outlive the job: a Ray job runs in a temporary copy of the working directory).
``jobs/sst_tuning.py`` and ``jobs/multitask_tuning.py`` are this job with their own definition. All logic lives in
the library (``peftune.cli.sweep_command.job_main``, ``peftune.sweep.orchestrator``).
"""

import sys
from pathlib import Path

# the source tree this job came with goes first on the path (`ray job submit --working-dir .` adds only its root,
# and peftune lives under platform/): the driver runs the submitted code, and ships it to every trial
ROOT = Path(__file__).resolve().parents[1]
if (ROOT / "platform" / "peftune").is_dir():
    sys.path[:0] = [str(ROOT / "platform"), str(ROOT)]

from peftune.cli import commands  # noqa: E402


def run(definition: str, description: str) -> int:
    """The job on ``definition`` (its default; ``--definition`` replaces it; "": ``--definition`` is required)."""
    return commands.job_main(definition, description)


if __name__ == "__main__":
    sys.exit(run("", __doc__))
