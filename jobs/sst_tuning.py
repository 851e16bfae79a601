"""SST-5 sentiment tuning across every PEFT method (search_spaces/sst_tuning.yaml).

On a Ray cluster, from the repository root (token authentication on, dashboard and Jobs API on 127.0.0.1):

    export RAY_AUTH_MODE=token    # `ray job submit` sends the cluster's token (~/.ray/auth_token) only then
    ray start --head --dashboard-host 127.0.0.1 --num-cpus 2
    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python jobs/sst_tuning.py \\
        --data-dir /abs/path/to/data --tracking-uri sqlite:///$PWD/mlflow.db \\
        --storage-path $PWD/ray_results --reports-dir $PWD/reports --smoke-test

(absolute paths: a Ray job runs in a temporary copy of the working directory). Directly, with a local Ray:

    python jobs/sst_tuning.py --data-dir ../shared/data --smoke-test    # the code path on a tiny budget
    python jobs/sst_tuning.py --data-dir ../shared/data --budget cpu    # sized for 2 CPU cores
    python jobs/sst_tuning.py --data-dir /data --budget gpu --model bert-base-uncased

Running it again resumes the sweep; it ends by printing the MLflow parent run id, the MLflow UI
address and where the report goes. It is ``jobs/tuning.py`` on its own definition (``--definition`` and
``--tasks`` replace it); all logic lives in the library (``peftune.sweep.orchestrator``).
Its run times on measured machines: docs/benchmarks.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # jobs/tuning.py beside this file, however it is run
from tuning import run  # noqa: E402

if __name__ == "__main__":
    sys.exit(run("sst_tuning", __doc__))
