"""One GPU, one run: the core against the HF Trainer, then packed trials against the same trials one by one.

What a GPU machine must answer for packed trials (README, "Packed trials"): how much faster K members train
packed than one after another, and how many fit (the peak memory per member). On a machine with one GPU:

    CUDA_VISIBLE_DEVICES=0 python jobs/gpu_pack_check.py --data-dir /abs/path/to/data

or on a Ray cluster, as a job given one GPU:

    ray job submit --address http://127.0.0.1:8265 --entrypoint-num-gpus 1 --working-dir . -- \\
        python jobs/gpu_pack_check.py --data-dir /abs/path/to/data

It runs ``peftune bench --device cuda`` (the core against the Trainer, fp32 and bf16, LoRA against peft; the GPU's
matmul peaks) and then ``peftune bench --device cuda --pack 2,4,8,16`` (packed against solo tokens/s for LoRA,
adapter and BitFit, and each one's peak MiB per member), with the same examples and rounds. About 15 minutes on an
H200 at the defaults. All logic lives in the library (``peftune.bench``).
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if (ROOT / "platform" / "peftune").is_dir():  # the source tree this job came with (see jobs/sst_tuning.py)
    sys.path[:0] = [str(ROOT / "platform"), str(ROOT)]

from peftune import cli  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--examples", default="4000", help="SST train examples per measured epoch")
    parser.add_argument("--repeats", default="2", help="alternating rounds; the best of each is kept")
    parser.add_argument("--pack", default="2,4,8,16", help="the pack sizes K")
    args = parser.parse_args()
    common = ["bench", "--device", "cuda", "--data-dir", args.data_dir, "--examples", args.examples,
              "--repeats", args.repeats]  # fmt: skip
    return cli.main(common) or cli.main([*common, "--pack", args.pack])


if __name__ == "__main__":
    sys.exit(main())
