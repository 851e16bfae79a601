"""``peftune bench``: training throughput, side by side in one process, the core against the HF Trainer.

Every contender trains one epoch on the same pre-tokenized SST examples with the same batch size (so the same
optimizer steps): the core (``run_trial``) in full fine-tuning at fp32 and in bf16 autocast, and LoRA r=8 on q/k/v;
the HF Trainer set up as a competent user would (pre-tokenized data, a padding collator, length-grouped sampling,
its fused AdamW) at fp32, with ``bf16=True``, and LoRA through peft. Rounds alternate so that machine noise hits
every contender alike; each keeps its best round. The device is the CPU or one GPU (``--device``; the Trainer would
spread over every visible GPU, so more than one is refused). Figures are non-padding tokens per second of
training; MFU is useful-token FLOPs (6 N per token for full fine-tuning, 4 N for LoRA, N the encoder's non-embedding
parameters) against a matmul peak measured in the same run. ``--pack`` times packed trials (``peftune.core.pack``)
against solo ones, ``--profile`` and ``--compile`` where the time goes. What it measured: docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import time

import torch

from peftune.base.errors import UserError
from peftune.core import pack, train
from peftune.inputs.backbone import BertConfig, resolve_model_dir
from peftune.inputs.data import DataSettings

LORA = {"rank": 8, "alpha": 16.0, "targets": ["query", "key", "value"]}
PACK_METHODS = pack.PACKABLE  # what ``--pack`` measures by default


@dataclasses.dataclass
class Result:
    seconds: float
    tokens: int  # non-padding tokens trained on
    steps: int  # optimizer steps
    examples: list[int]  # indices of the examples seen, in the order seen
    peak_memory_mb: float | None = None  # on CUDA: max_memory_allocated over the run, building included (a pack's)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


# ----------------------------------------------------------------------------- the core


def check_bench_device(device: torch.device) -> None:
    """``device`` (one this machine has: ``common.check_device``) is where the bench compares like with like: the
    CPU or one GPU."""
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"--device {device}: the bench runs on cpu or cuda, where the Trainer runs as configured here")
    if device.type == "cuda" and torch.cuda.device_count() > 1:
        raise UserError(
            f"--device {device}: {torch.cuda.device_count()} GPUs are visible, and the Trainer would spread over all "
            "of them (DataParallel) against the core's one: make one visible, e.g. CUDA_VISIBLE_DEVICES=0"
        )


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work: a GPU's kernels run after the host has moved on."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        # the bench's bare epochs never call finish_epoch, so each trial keeps its epoch clock, a cycle through the
        # trial (and a process's first Trial is kept by torch's lazy imports): only the cycle collector frees them.
        # Uncollected, the last run's tensors counted in the next one's peak (solo MiB 361-942 on one H200 run)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> float | None:
    """The most memory the device's tensors took since ``reset_peak_memory`` (None on the CPU)."""
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def auto_precision(device: torch.device) -> str:
    """What ``precision: auto`` computes in on ``device``: bf16 where it multiplies bf16 natively, else fp32."""
    return train.resolve_precision(device, "auto")


def core_config(method: str, batch_size: int, seed: int, precision: str, device: torch.device) -> train.TrainConfig:
    return train.TrainConfig(
        method=method,
        method_options=LORA if method == "lora" else {},
        tasks=["sst"],
        lr=2e-5 if method == "full" else 5e-4,
        epochs=1,
        batch_size=batch_size,
        seed=seed,
        precision=precision,
        device=str(device),
        log_every=0,
    )


def core_epoch(prepared: train.PreparedData, method: str, precision: str, batch_size: int, seed: int,
               device: torch.device) -> Result:  # fmt: skip
    config = core_config(method, batch_size, seed, precision, device)
    # the plan run_trial trains on (same seed, same epoch): which examples and how many steps
    plan = train.epoch_plan(config, {"sst": prepared.tasks["sst"]}, prepared.pad_token_id, epoch=0)
    metrics = train.run_trial(config, prepared).history[-1]
    tokens = sum(int(b.attention_mask.sum()) for b in plan)
    return Result(metrics["epoch_time_s"], tokens, len(plan), [i for b in plan for i in b.indices.tolist()])


# ----------------------------------------------------------------------------- the HF Trainer


def trainer_epoch(prepared, model_dir, mode: str, batch_size: int, seed: int, output_dir: str,
                  device: torch.device) -> Result:  # fmt: skip
    """One epoch of the Trainer; ``mode`` is "fp32" (its defaults), "bf16", "lora" (peft, fp32) or "lora_bf16"."""
    import transformers

    split = prepared.tasks["sst"].train
    dataset = []  # a list of feature dicts is a map-style dataset to the Trainer
    for i in range(len(split)):
        ids, types = split.example(i)
        dataset.append(
            {"input_ids": ids.tolist(), "token_type_ids": types.tolist(), "labels": int(split.labels[i]), "idx": i}
        )
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    pad = transformers.DataCollatorWithPadding(tokenizer)
    seen: list[int] = []
    tokens = [0]

    def collate(features):
        # records what the Trainer feeds the model, then pads as DataCollatorWithPadding does
        features = [dict(f) for f in features]
        seen.extend(f.pop("idx") for f in features)
        tokens[0] += sum(len(f["input_ids"]) for f in features)
        return pad(features)

    torch.manual_seed(seed)
    # fp32 weights whatever the checkpoint stores: transformers 5 loads in the checkpoint's dtype by default, and
    # the Trainer's defaults (and bf16=True's autocast) are measured over fp32 weights
    model = transformers.BertForSequenceClassification.from_pretrained(
        str(model_dir), num_labels=5, dtype=torch.float32
    )
    if mode.startswith("lora"):
        import peft

        config = peft.LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], target_modules=LORA["targets"])
        model = peft.get_peft_model(model, config)
    args = transformers.TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=batch_size,
        num_train_epochs=1,
        learning_rate=5e-4 if mode.startswith("lora") else 2e-5,
        train_sampling_strategy="group_by_length",
        use_cpu=device.type == "cpu",
        bf16=mode.endswith("bf16"),
        remove_unused_columns=False,  # keeps "idx" for the collator to record
        save_strategy="no",
        report_to=[],
        logging_strategy="no",
        disable_tqdm=True,
        seed=seed,
        data_seed=seed,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset, data_collator=collate)
    started = time.perf_counter()
    output = trainer.train()
    seconds = time.perf_counter() - started
    return Result(seconds, tokens[0], output.global_step, seen)


# ----------------------------------------------------------------------------- peak and MFU


def matmul_peak(dtype: torch.dtype, device: torch.device, size: int | None = None, repeats: int = 5) -> float:
    """FLOP/s of a square matmul on ``device`` (best of ``repeats``); a GPU gets a larger one to fill it."""
    size = size or (2048 if device.type == "cpu" else 8192)
    a, b = (torch.randn(size, size, device=device).to(dtype) for _ in range(2))
    torch.mm(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best


def flops_per_token(config: BertConfig, mean_length: float, lora: bool) -> float:
    """Training FLOPs per token: 6 N (forward 2 N, backward 4 N) for full fine-tuning, 4 N for LoRA
    (no weight gradients of the frozen weights; its own r-sized matmuls are negligible), plus the
    attention scores and weighted sum (2 x 2 T H per layer forward, x 3 with backward)."""
    H, L = config.hidden_size, config.num_hidden_layers
    n = L * (4 * H * H + 2 * H * config.intermediate_size)
    attention = 3 * L * 4 * mean_length * H
    return (4 if lora else 6) * n + attention


# ----------------------------------------------------------------------------- where the time goes

# op name -> category; an op's self time counts once (a matmul inside linear is "matmul", not both)
CATEGORIES = (
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul")),
    ("attention", ("scaled_dot_product", "flash_attention", "aten::_softmax", "aten::softmax")),
    ("optimizer", ("adam", "aten::_foreach", "Optimizer.")),
    ("casts and copies", ("aten::copy_", "aten::_to_copy", "aten::to", "aten::clone", "aten::contiguous")),
    ("norms, activations, dropout", ("layer_norm", "gelu", "tanh", "dropout", "bernoulli", "random_")),
)


def category(op: str) -> str:
    lowered = op.lower()
    for name, patterns in CATEGORIES:
        if any(pattern.lower() in lowered for pattern in patterns):
            return name
    return "other elementwise and bookkeeping"


def time_shares(
    prepared: train.PreparedData, method: str, precision: str, batch_size: int, device: torch.device
) -> dict[str, float]:
    """Share of one training epoch's time per op category, from torch's profiler: each op's self time on the
    CPU, and on a GPU the self time of the kernels each op launched (the host's time there is launch work)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]
    with profile(activities=activities) as profiler:
        train.run_trial(core_config(method, batch_size, 0, precision, device), prepared)
    totals: dict[str, float] = {}
    for event in profiler.key_averages():
        # on a GPU the kernels are events too, their time already counted in the op that launched them
        if event.key.startswith("ProfilerStep") or event.device_type != DeviceType.CPU:
            continue
        spent = event.self_device_time_total if on_gpu else event.self_cpu_time_total
        totals[category(event.key)] = totals.get(category(event.key), 0.0) + spent
    whole = sum(totals.values()) or 1.0
    return {name: value / whole for name, value in sorted(totals.items(), key=lambda kv: -kv[1])}


def print_profile(prepared, batch_size: int, device: torch.device) -> None:
    auto = auto_precision(device)
    runs = [("full", "fp32"), ("full", auto), ("lora", auto), ("lora", "fp32")]
    shares = {f"{m} {precision}": time_shares(prepared, m, precision, batch_size, device) for m, precision in runs}
    names = [name for name, _ in CATEGORIES] + ["other elementwise and bookkeeping"]
    spent = "CPU" if device.type == "cpu" else "GPU kernel"
    print(f"\nshare of training {spent} time by op category (torch profiler, self time, one epoch incl. evaluation)")
    print(f"  {'category':<36}" + "".join(f"{run:>12}" for run in shares))
    for name in names:
        print(f"  {name:<36}" + "".join(f"{shares[run].get(name, 0.0):>12.0%}" for run in shares))


# ----------------------------------------------------------------------------- torch.compile


@dataclasses.dataclass
class CompileResult:
    compile_s: float  # the compiled model's first epoch less an eager epoch: what compiling its graphs cost
    eager_step_s: float  # seconds per optimizer step, steady state (best epoch)
    compiled_step_s: float
    steps: int  # per epoch
    noise_step_s: float = 0.0  # the spread (max - min) of each one's steady epochs per step, the larger

    @property
    def speedup(self) -> float:
        return self.eager_step_s / self.compiled_step_s

    @property
    def break_even_steps(self) -> float:
        """The trial length (optimizer steps) from which compiling pays for itself; inf if it never does,
        and where the step it saves is within the epochs' spread (a saving the noise may have made)."""
        saved = self.eager_step_s - self.compiled_step_s
        return self.compile_s / saved if saved > self.noise_step_s else math.inf


def compile_comparison(
    prepared, method: str, precision: str, batch_size: int, repeats: int, device: torch.device,
    backend: str = "inductor",
) -> CompileResult:  # fmt: skip
    """The core's training step eager and under ``torch.compile`` (dynamic shapes: the length buckets share
    graphs), one epoch of the same batches each, alternating; the compiled model's first epoch compiles."""
    config = core_config(method, batch_size, 0, precision, device)
    batches = train.epoch_plan(config, {"sst": prepared.tasks["sst"]}, prepared.pad_token_id, epoch=0)

    def epoch(trial) -> float:
        started = time.perf_counter()
        for batch in batches:
            trial.step(batch)
        synchronize(device)
        return time.perf_counter() - started

    eager, compiled = train.Trial(config, prepared, None), train.Trial(config, prepared, None)
    compiled.model = torch.compile(compiled.model, dynamic=True, backend=backend)
    eager_s, compiled_s, first = [epoch(eager)], [], epoch(compiled)
    for _ in range(repeats):
        compiled_s.append(epoch(compiled))
        eager_s.append(epoch(eager))
    steps = len(batches)
    steady = eager_s[1:] if repeats > 1 else eager_s  # the first eager epoch warms up too
    noise = max(max(steady) - min(steady), max(compiled_s) - min(compiled_s)) / steps
    return CompileResult(max(0.0, first - min(eager_s)), min(eager_s) / steps, min(compiled_s) / steps, steps, noise)


def print_compile(prepared, batch_size: int, repeats: int, device: torch.device) -> None:
    auto = auto_precision(device)
    print(f"\ntorch.compile (inductor, dynamic shapes) against eager, the core at {auto}, same batches, best of "
          f"{repeats} epochs after the compiling one")  # fmt: skip
    for method, label in (("full", "full FT"), ("lora", "LoRA r=8")):
        result = compile_comparison(prepared, method, auto, batch_size, repeats, device)
        pays = result.break_even_steps
        never = f"never (the compiled step is not faster beyond the epochs' spread, {result.noise_step_s * 1e3:.0f} ms)"
        when = never if math.isinf(pays) else (
            f"after {pays:.0f} steps ({pays / result.steps:.1f} epochs of these examples)")  # fmt: skip
        print(
            f"  {label:<9} compile {result.compile_s:.1f} s; step {result.eager_step_s * 1e3:.0f} ms eager, "
            f"{result.compiled_step_s * 1e3:.0f} ms compiled ({result.speedup:.2f}x); compiling pays {when}"
        )


# ----------------------------------------------------------------------------- the run


def contenders(prepared, model_dir, batch_size: int, output_dir: str, device: torch.device) -> dict:
    """Name -> one epoch of that contender on ``device``, as a function of the round (its seed)."""
    auto = auto_precision(device)
    trainer = functools.partial(
        trainer_epoch, prepared, model_dir, batch_size=batch_size, output_dir=output_dir, device=device
    )
    core = functools.partial(core_epoch, prepared, batch_size=batch_size, device=device)
    return {
        "Trainer, full FT, defaults (fp32)": lambda r: trainer("fp32", seed=r),
        "Trainer, full FT, bf16=True": lambda r: trainer("bf16", seed=r),
        "Trainer + peft, LoRA r=8": lambda r: trainer("lora", seed=r),
        "Trainer + peft, LoRA r=8, bf16=True": lambda r: trainer("lora_bf16", seed=r),
        "core, full FT, fp32": lambda r: core("full", "fp32", seed=r),
        "core, full FT, bf16": lambda r: core("full", "bf16", seed=r),
        f"core, full FT, auto ({auto})": lambda r: core("full", "auto", seed=r),
        f"core, LoRA r=8, auto ({auto})": lambda r: core("lora", "auto", seed=r),
    }


def run(
    prepared, model_dir, batch_size: int, repeats: int, output_dir: str, device: torch.device, echo=print
) -> dict[str, list[Result]]:
    """Alternating rounds; returns every contender's rounds, in order."""
    runs = contenders(prepared, model_dir, batch_size, output_dir, device)
    rounds: dict[str, list[Result]] = {name: [] for name in runs}
    for round_index in range(repeats):
        for name, contender in runs.items():
            result = contender(round_index)
            echo(f"round {round_index + 1}: {name}: {result.tokens_per_s:.0f} tokens/s, {result.seconds:.1f} s")
            rounds[name].append(result)
    return rounds


def best_of(rounds: dict[str, list[Result]]) -> dict[str, Result]:
    """Each contender's fastest round (by tokens/s)."""
    return {name: max(results, key=lambda r: r.tokens_per_s) for name, results in rounds.items()}


def by_kind(results: dict[str, Result]) -> dict[str, Result]:
    """Results keyed without the precision ``auto`` resolved to: "core, full FT" is full fine-tuning at ``auto``."""
    return {name.split(" (")[0].replace(", auto", ""): r for name, r in results.items()}


def target_ratios(results: dict[str, Result]) -> list[tuple[str, float, str]]:
    """(label, ratio, target) of the targets (issue 19's, raised by issue 32's), each against the strongest peer of
    its kind."""
    by = by_kind(results)
    core_full, core_lora = by["core, full FT"], by["core, LoRA r=8"]
    trainer, trainer_bf16 = by["Trainer, full FT, defaults"], by["Trainer, full FT, bf16=True"]
    peft_lora, peft_lora_bf16 = by["Trainer + peft, LoRA r=8"], by["Trainer + peft, LoRA r=8, bf16=True"]
    return [
        ("core full FT / Trainer defaults", core_full.tokens_per_s / trainer.tokens_per_s, ">= 2.5x"),
        ("core full FT / Trainer bf16=True", core_full.tokens_per_s / trainer_bf16.tokens_per_s, ">= 1.6x"),
        ("core LoRA / Trainer + peft defaults", core_lora.tokens_per_s / peft_lora.tokens_per_s, "(peer)"),
        ("core LoRA / Trainer + peft bf16=True", core_lora.tokens_per_s / peft_lora_bf16.tokens_per_s, ">= 1.6x"),
        ("core LoRA epoch / core full FT epoch", core_lora.seconds / core_full.seconds, "<= 0.65x"),
        ("Trainer LoRA epoch / Trainer epoch", peft_lora.seconds / trainer.seconds, "(peer)"),
    ]


def ratio_lines(rounds: dict[str, list[Result]]) -> list[str]:
    """Each ratio of the best rounds, and its range over the rounds (each round's contenders against each
    other, run minutes apart): a target inside that range is not met or missed beyond the machine's noise."""
    count = min(len(results) for results in rounds.values())
    per_round = [target_ratios({name: results[i] for name, results in rounds.items()}) for i in range(count)]
    lines = []
    for k, (label, value, target) in enumerate(target_ratios(best_of(rounds))):
        values = [ratios[k][1] for ratios in per_round]
        spread = f"rounds {min(values):.2f}-{max(values):.2f}x; " if len(values) > 1 else ""
        lines.append(f"{label:<40} {value:.2f}x  ({spread}target {target})")
    return lines


def check_args(args) -> None:
    """The numeric flags, before the model and data load: a zero would end in a KeyError (no round, no best)."""
    for flag, value in (("--examples", args.examples), ("--batch-size", args.batch_size), ("--repeats", args.repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{flag} must be a positive integer, got {value!r}")
    if getattr(args, "pack", None) is not None:
        pack_sizes(args.pack)
        pack_methods(args.pack_methods)


def pack_sizes(text: str) -> list[int]:
    """``--pack 2,4,8``: the pack sizes K to measure, each from 2 to 64 (a pack of one is a solo run)."""
    sizes = [part.strip() for part in str(text).split(",")]
    if not all(part.isdigit() and 2 <= int(part) <= 64 for part in sizes):
        raise UserError(f"--pack {text!r}: expected pack sizes K from 2 to 64, comma-separated, e.g. 2,4,8")
    return [int(part) for part in sizes]


def pack_methods(text: str) -> list[str]:
    """``--pack-methods lora,adapter``: packable methods only."""
    names = [part.strip() for part in str(text).split(",")]
    bad = [name for name in names if name not in PACK_METHODS]
    if bad or not names:
        raise UserError(
            f"--pack-methods {text!r}: expected packable methods ({', '.join(PACK_METHODS)}), comma-separated"
        )
    return names


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"GPU {torch.cuda.get_device_name(device)}"
    return f"CPU, {torch.get_num_threads()} threads"


def print_results(rounds: dict[str, list[Result]], prepared, peaks: dict[str, float], device: torch.device,
                  title: str) -> None:  # fmt: skip
    """Each contender's best round with its MFU, the ratios with their ranges, and the core's MFU."""
    best = best_of(rounds)
    split = prepared.tasks["sst"].train
    mean_length = split.num_tokens() / len(split)
    config = prepared.backbone.config
    print(
        f"\n{len(split)} SST train examples ({split.num_tokens()} tokens), {title}, {device_name(device)}; "
        f"matmul peak {peaks['fp32'] / 1e9:.0f} GFLOP/s fp32, {peaks['bf16'] / 1e9:.1f} bf16"
    )
    print(f"  {'contender':<36} {'tokens/s':>9} {'s/epoch':>8} {'steps':>6} {'MFU fp32':>9} {'MFU bf16':>9}")
    for name, result in best.items():
        flops = flops_per_token(config, mean_length, lora="LoRA" in name) * result.tokens_per_s
        print(
            f"  {name:<36} {result.tokens_per_s:>9.0f} {result.seconds:>8.1f} {result.steps:>6} "
            f"{flops / peaks['fp32']:>8.0%} {flops / peaks['bf16']:>8.0%}"
        )
    print("\n".join(ratio_lines(rounds)))
    auto = auto_precision(device)
    mfu = flops_per_token(config, mean_length, lora=False) * by_kind(best)["core, full FT"].tokens_per_s / peaks[auto]
    print(f"{f'core full FT MFU vs {auto} peak':<40} {mfu:.0%}  (target >= 60% of the bf16 peak)")
    if auto == "fp32":
        where = "CPU (no AVX512-BF16 or AMX)" if device.type == "cpu" else "GPU (compute capability below 8.0)"
        print(f"bf16 is emulated on this {where}: the bf16 figures, and the ratios against the bf16 peers, say "
              "nothing of a device that multiplies bf16")  # fmt: skip


def main(args, device: torch.device) -> None:
    import tempfile

    check_args(args)
    check_bench_device(device)
    if getattr(args, "pack", None) is not None:
        pack_main(args, device)
        return
    model_dir = resolve_model_dir(args.model)
    prepared = train.prepare(bench_data(args), ["sst"])
    peaks = {"fp32": matmul_peak(torch.float32, device), "bf16": matmul_peak(torch.bfloat16, device)}
    with tempfile.TemporaryDirectory() as output_dir:
        rounds = run(prepared, model_dir, args.batch_size, args.repeats, output_dir, device,
                     echo=lambda line: print(line, flush=True))  # fmt: skip
    title = f"batch {args.batch_size}, model {args.model}; best of {args.repeats} rounds"
    print_results(rounds, prepared, peaks, device, title)
    if args.profile:
        print_profile(prepared, args.batch_size, device)
    if args.compile:
        print_compile(prepared, args.batch_size, args.repeats, device)


# ----------------------------------------------------------------------------- packed against solo


def pack_member_configs(method: str, k: int, batch_size: int, precision: str, device: torch.device):
    """K members of ``method`` as a search would propose them: one seed and batching, learning rates spread over a
    decade, LoRA r=8 on q/k/v (the core's bench LoRA) or the method's defaults."""
    return [
        train.TrainConfig(
            method=method,
            method_options=LORA if method == "lora" else {},
            tasks=["sst"],
            lr=5e-4 * 10 ** (i / k),
            epochs=1,
            batch_size=batch_size,
            seed=0,
            precision=precision,
            device=str(device),
            log_every=0,
        )  # fmt: skip
        for i in range(k)
    ]


def packed_epoch(prepared, configs, device: torch.device) -> Result:
    """One epoch of the K members as one pack: its training steps only (building it is left out, as below)."""
    reset_peak_memory(device)
    packed = pack.Pack(configs, prepared)
    plan = packed.begin_epoch(0)
    synchronize(device)
    started = time.perf_counter()
    for batch in plan:
        packed.step(batch)
    synchronize(device)
    seconds = time.perf_counter() - started
    tokens = len(configs) * sum(int(b.attention_mask.sum()) for b in plan)
    return Result(seconds, tokens, len(plan), [], peak_memory_mb(device))


def solo_epochs(prepared, configs, device: torch.device) -> Result:
    """One epoch of each of the K members, one after another, as ``run_trial`` steps (``Trial.step``)."""
    seconds, tokens, steps, peak = 0.0, 0, 0, None
    for config in configs:
        reset_peak_memory(device)
        trial = train.Trial(config, prepared, None)
        torch.manual_seed(train.epoch_seed(config, 0))
        plan = train.epoch_plan(config, trial.tasks, prepared.pad_token_id, 0)
        synchronize(device)
        started = time.perf_counter()
        for batch in plan:
            trial.step(batch)
        synchronize(device)
        seconds += time.perf_counter() - started
        tokens += sum(int(b.attention_mask.sum()) for b in plan)
        steps += len(plan)
        peak = peak_memory_mb(device)  # one member's (each solo run frees the last's model first)
        del trial
    return Result(seconds, tokens, steps, [], peak)


def run_pack_bench(prepared, methods: list[str], sizes: list[int], batch_size: int, repeats: int,
                   device: torch.device, echo=print) -> dict[tuple[str, int], dict[str, list[Result]]]:  # fmt: skip
    """(method, K) -> {"packed": rounds, "solo": rounds}; packed and solo rounds alternate, so that the machine's
    noise hits both alike."""
    precision = auto_precision(device)
    if device.type == "cuda":  # CUDA's context, cuBLAS's handles and the first kernels' loading
        warm_up = pack_member_configs(methods[0], 2, batch_size, precision, device)
        packed_epoch(prepared, warm_up, device)
        solo_epochs(prepared, warm_up, device)
    out = {}
    for method in methods:
        for k in sizes:
            configs = pack_member_configs(method, k, batch_size, precision, device)
            rounds = out[(method, k)] = {"packed": [], "solo": []}
            for r in range(repeats):
                for kind, run_ in (("packed", packed_epoch), ("solo", solo_epochs)):
                    result = run_(prepared, configs, device)
                    rounds[kind].append(result)
                    speed = f"{result.tokens_per_s:.0f} tokens/s, {result.seconds:.2f} s"
                    echo(f"round {r + 1}: {method} K={k} {kind}: {speed}")
    return out


def print_pack_results(results, prepared, peaks: dict[str, float], device: torch.device, title: str) -> None:
    split = prepared.tasks["sst"].train
    print(
        f"\n{len(split)} SST train examples ({split.num_tokens()} tokens) per member, {title}, {device_name(device)}, "
        f"{auto_precision(device)}; matmul peak {peaks['fp32'] / 1e9:.0f} GFLOP/s fp32, {peaks['bf16'] / 1e9:.0f} bf16"
    )
    memory = device.type == "cuda"  # the peak per member: how many members fit on this GPU
    head = f"  {'method':<8} {'K':>3} {'packed tok/s':>13} {'solo tok/s':>11} {'packed/solo':>12}"
    print(head + (f" {'packed MiB/member':>18} {'solo MiB':>9}" if memory else "") + "  rounds")
    for (method, k), rounds in results.items():
        packed, solo = (max(rounds[kind], key=lambda r: r.tokens_per_s) for kind in ("packed", "solo"))
        per_round = [p.tokens_per_s / s.tokens_per_s for p, s in zip(rounds["packed"], rounds["solo"], strict=True)]
        spread = f"{min(per_round):.2f}-{max(per_round):.2f}x" if len(per_round) > 1 else ""
        row = f"  {method:<8} {k:>3} {packed.tokens_per_s:>13.0f} {solo.tokens_per_s:>11.0f} "
        row += f"{packed.tokens_per_s / solo.tokens_per_s:>11.2f}x"
        if memory:
            row += f" {packed.peak_memory_mb / k:>18.0f} {solo.peak_memory_mb:>9.0f}"
        print(f"{row}  {spread}")


def step_categories(step) -> dict[str, float]:
    """Self CPU time (us) per op category (``CATEGORIES``) of one call of ``step``, from torch's profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        step()
    totals: dict[str, float] = {}
    for event in profiler.key_averages():
        totals[category(event.key)] = totals.get(category(event.key), 0.0) + event.self_cpu_time_total
    return totals


def print_pack_profile(prepared, method: str, k: int, batch_size: int, device: torch.device, repeats: int = 3) -> None:
    """Where the time goes: one packed step of K members against their K solo steps on the same batch, per op
    category (torch profiler, self CPU time, the fastest of ``repeats`` after two warm-up steps each)."""
    configs = pack_member_configs(method, k, batch_size, auto_precision(device), device)
    packed = pack.Pack(configs, prepared)
    batch = packed.begin_epoch(0)[0]
    trials = [train.Trial(config, prepared, None) for config in configs]
    steps = {"packed": lambda: packed.step(batch), "solo x K": lambda: [trial.step(batch) for trial in trials]}
    best: dict[str, dict[str, float]] = {}
    for _ in range(2):  # warm-up: the kernels of these shapes
        for step in steps.values():
            step()
    for _ in range(repeats):
        for name, step in steps.items():
            totals = step_categories(step)
            if name not in best or sum(totals.values()) < sum(best[name].values()):
                best[name] = totals
    print(f"\none step of {method} K={k}, packed against the K solo steps (torch profiler, self CPU time, ms)")
    print(f"  {'category':<36} {'packed':>9} {'solo x K':>9} {'solo/packed':>12}")
    names = [name for name, _ in CATEGORIES] + ["other elementwise and bookkeeping"]
    rows = [(name, best["packed"].get(name, 0.0), best["solo x K"].get(name, 0.0)) for name in names]
    rows.append(("total", sum(best["packed"].values()), sum(best["solo x K"].values())))
    for name, ours, theirs in rows:
        print(f"  {name:<36} {ours / 1e3:>9.0f} {theirs / 1e3:>9.0f} {theirs / max(ours, 1.0):>11.2f}x")


def bench_data(args) -> DataSettings:
    """What both benchmarks train on: ``--examples`` SST rows, 64 dev rows, with ``--model``'s tokenizer."""
    return DataSettings(str(args.data_dir), model=args.model, max_train_examples=args.examples, max_dev_examples=64)


def pack_main(args, device: torch.device) -> None:
    sizes, methods = pack_sizes(args.pack), pack_methods(args.pack_methods)
    prepared = train.prepare(bench_data(args), ["sst"])
    peaks = {"fp32": matmul_peak(torch.float32, device), "bf16": matmul_peak(torch.bfloat16, device)}
    results = run_pack_bench(prepared, methods, sizes, args.batch_size, args.repeats, device,
                             echo=lambda line: print(line, flush=True))  # fmt: skip
    title = f"batch {args.batch_size}, model {args.model}; best of {args.repeats} rounds"
    print_pack_results(results, prepared, peaks, device, title)
    if args.profile:
        for method in methods:
            print_pack_profile(prepared, method, sizes[-1], args.batch_size, device)
