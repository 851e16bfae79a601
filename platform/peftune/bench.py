"""Training throughput, side by side in one process: the core against a plain loop.

The plain loop is written the usual way: ``transformers.BertModel`` with a
linear head on the pooled output, examples in random order, each batch
tokenized and padded to its own longest sequence. The core runs the same
number of SST examples through ``run_trial`` (length-bucketed batches,
dynamic padding), once with full fine-tuning and once with LoRA. Rounds
alternate so that machine noise hits every contender alike; each keeps its
best round. Figures are non-padding tokens per second of training (forward,
backward, optimizer step), evaluation excluded.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from peftune import train
from peftune.backbone import load_tokenizer, resolve_model_dir
from peftune.data import read_task_file
from peftune.tasks import get_task


def plain_loop_epoch(model_name: str, texts: list[str], labels: list[int], batch_size: int, seed: int) -> dict:
    import transformers

    model_dir = resolve_model_dir(model_name)
    torch.manual_seed(seed)
    tokenizer = load_tokenizer(model_dir)
    bert = transformers.BertModel.from_pretrained(str(model_dir))
    head = torch.nn.Linear(bert.config.hidden_size, 5)
    optimizer = torch.optim.AdamW(list(bert.parameters()) + list(head.parameters()), lr=2e-5)
    bert.train()
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    tokens, started = 0, time.perf_counter()
    for start in range(0, len(order), batch_size):
        index = order[start : start + batch_size]
        batch = tokenizer([texts[i] for i in index], padding=True, truncation=True, max_length=128, return_tensors="pt")
        logits = head(bert(**batch).pooler_output)
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor([labels[i] for i in index]))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        tokens += int(batch["attention_mask"].sum())
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "tokens_per_s": tokens / seconds}


def core_epoch(prepared: train.PreparedData, method: str, options: dict, batch_size: int, seed: int) -> dict:
    config = train.TrainConfig(
        method=method,
        method_options=options,
        tasks=["sst"],
        lr=2e-5 if method == "full" else 5e-4,
        epochs=1,
        batch_size=batch_size,
        seed=seed,
        log_every=0,
    )
    metrics = train.run_trial(config, prepared).history[-1]
    return {"seconds": metrics["epoch_time_s"], "tokens_per_s": metrics["tokens_per_s"]}


def main(args) -> None:
    spec = get_task("sst")
    rows = read_task_file(Path(args.data_dir) / spec.train_file, spec)
    sample = random.Random(0).sample(range(len(rows)), min(args.examples, len(rows)))
    texts = [rows[i][0][0] for i in sample]
    labels = [int(rows[i][1]) for i in sample]
    prepared = train.prepare(
        args.data_dir, ["sst"], model=args.model, max_train_examples=args.examples, max_dev_examples=64
    )
    contenders = {
        "plain transformers loop, full FT": lambda r: plain_loop_epoch(args.model, texts, labels, args.batch_size, r),
        "peftune core, full FT": lambda r: core_epoch(prepared, "full", {}, args.batch_size, r),
        "peftune core, LoRA r=8": lambda r: core_epoch(prepared, "lora", {"rank": 8}, args.batch_size, r),
    }
    best: dict[str, dict] = {}
    for round_index in range(args.repeats):
        for name, run in contenders.items():
            result = run(round_index)
            print(
                f"round {round_index + 1}: {name}: {result['tokens_per_s']:.0f} tokens/s, {result['seconds']:.1f} s",
                flush=True,
            )
            if name not in best or result["tokens_per_s"] > best[name]["tokens_per_s"]:
                best[name] = result
    plain, full, lora = (best[name] for name in contenders)
    print(
        f"\n{len(texts)} SST train examples, batch {args.batch_size}, {torch.get_num_threads()} threads, "
        f"model {args.model}; best of {args.repeats} rounds"
    )
    for name, result in best.items():
        print(f"  {name:<34} {result['tokens_per_s']:>8.0f} tokens/s  {result['seconds']:>7.1f} s/epoch")
    print(f"core full FT / plain loop (tokens/s): {full['tokens_per_s'] / plain['tokens_per_s']:.2f}x  (target >= 2x)")
    print(f"LoRA epoch / full FT epoch (time):    {lora['seconds'] / full['seconds']:.2f}x  (target <= 0.7x)")
