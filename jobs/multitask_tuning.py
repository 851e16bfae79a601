"""SST + Quora paraphrase + STS tuned together, across every PEFT method (search_spaces/multitask_tuning.yaml).

Run it as ``jobs/sst_tuning.py`` is run (its docstring gives the cluster and local commands), with this file's name:

    python jobs/multitask_tuning.py --data-dir ../shared/data --smoke-test    # the code path on a tiny budget
    python jobs/multitask_tuning.py --data-dir ../shared/data --budget cpu    # sized for 2 CPU cores

The score is the mean of the three tasks' dev metrics. It is ``jobs/tuning.py`` on its own definition
(``--definition`` and ``--tasks`` replace it); all logic lives in the library (``peftune.sweep.orchestrator``).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # jobs/tuning.py beside this file, however it is run
from tuning import run  # noqa: E402

if __name__ == "__main__":
    sys.exit(run("multitask_tuning", __doc__))
