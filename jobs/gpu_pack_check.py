"""One GPU, one run: packed trials against the same trials one by one, then the core against the HF Trainer.

What a GPU machine must answer for packed trials (docs/design.md, "Packed trials"): how much faster K members train
packed than one after another, and how many fit (the peak memory per member). On a machine with one GPU:

    CUDA_VISIBLE_DEVICES=0 python jobs/gpu_pack_check.py --data-dir /abs/path/to/data

or on a Ray cluster, as a job given one GPU:

    ray job submit --address http://127.0.0.1:8265 --entrypoint-num-gpus 1 --working-dir . -- \\
        python jobs/gpu_pack_check.py --data-dir /abs/path/to/data

It runs ``peftune bench --device cuda --pack 2,4,8,16`` (packed against solo tokens/s for LoRA, adapter and
BitFit, and each one's peak MiB per member) and then ``peftune bench --device cuda`` (the core against the Trainer,
fp32 and bf16, LoRA against peft; the GPU's matmul peaks), with the same examples and rounds. The packed part
comes first because it is what this script is for; the second runs even where the first fails, and the exit
status is the worse of the two. All logic lives in the library (``peftune.benchmarks.throughput``). What it
printed on a GPU, and how long it ran there: docs/benchmarks.md, "One GPU (H200)".
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if (ROOT / "platform" / "peftune").is_dir():  # the source tree this job came with (see jobs/sst_tuning.py)
    sys.path[:0] = [str(ROOT / "platform"), str(ROOT)]

from peftune.cli import commands  # noqa: E402
from peftune.inputs.backbone import DEFAULT_MODEL  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="as peftune bench's --model (default: packaged)")
    parser.add_argument("--device", default="cuda", help="as peftune bench's --device (cuda:1, or cpu for a try)")
    parser.add_argument("--examples", default="4000", help="SST train examples per measured epoch")
    parser.add_argument("--repeats", default="2", help="alternating rounds; the best of each is kept")
    parser.add_argument("--pack", default="2,4,8,16", help="the pack sizes K")
    args = parser.parse_args()
    common = ["bench", "--device", args.device, "--data-dir", args.data_dir, "--model", args.model,
              "--examples", args.examples, "--repeats", args.repeats]  # fmt: skip
    packed = commands.main([*common, "--pack", args.pack])
    return max(packed or 0, commands.main(common) or 0)


if __name__ == "__main__":
    sys.exit(main())
