"""The benchmark compares like with like: every contender trains on the same examples, tokens and steps."""

import dataclasses

import pytest
import torch

from peftune.base.errors import UserError
from peftune.benchmarks import throughput as bench

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, tiny_prepared):
    """A tiny random BERT in HF format (safetensors + tokenizer), with the weights of ``tiny_prepared``."""
    import transformers

    from peftune.inputs.backbone import DEFAULT_MODEL, load_tokenizer, resolve_model_dir

    directory = tmp_path_factory.mktemp("tiny-bert")
    config = tiny_prepared.backbone.config
    hf_config = transformers.BertConfig(**{k: v for k, v in config.to_dict().items()})
    model = transformers.BertModel(hf_config)
    model.load_state_dict(tiny_prepared.backbone.state_dict, strict=False)
    model.save_pretrained(str(directory))
    load_tokenizer(resolve_model_dir(DEFAULT_MODEL)).save_pretrained(str(directory))
    return directory


@pytest.mark.slow
def test_contenders_see_the_same_examples_and_steps(tiny_prepared, tiny_model_dir, tmp_path):
    lines = []
    rounds = bench.run(
        tiny_prepared,
        tiny_model_dir,
        batch_size=16,
        repeats=1,
        output_dir=str(tmp_path),
        device=CPU,
        echo=lines.append,
    )
    best = bench.best_of(rounds)
    split = tiny_prepared.tasks["sst"].train
    assert len(best) == 8 and len(lines) == 8
    expected_steps = -(-len(split) // 16)
    for name, result in best.items():
        assert sorted(result.examples) == list(range(len(split))), name  # each example exactly once
        assert result.steps == expected_steps, name
        assert result.tokens == split.num_tokens(), name
        assert result.seconds > 0


def test_each_ratio_comes_with_its_range_over_the_rounds():
    def result(seconds):
        return bench.Result(seconds=seconds, tokens=1000, steps=10, examples=[])

    names = [
        "Trainer, full FT, defaults (fp32)",
        "Trainer, full FT, bf16=True",
        "Trainer + peft, LoRA r=8",
        "Trainer + peft, LoRA r=8, bf16=True",
        "core, full FT, auto (bf16)",
        "core, LoRA r=8, auto (bf16)",
    ]
    rounds = {name: [result(1.0), result(1.0)] for name in names}
    rounds["core, full FT, auto (bf16)"] = [result(0.5), result(0.8)]  # 2.0x the Trainer, then 1.25x
    lines = bench.ratio_lines(rounds)
    full = next(line for line in lines if line.startswith("core full FT / Trainer bf16=True"))
    assert "2.00x" in full and "rounds 1.25-2.00x" in full  # the best rounds' ratio, and the rounds' range
    lora = next(line for line in lines if line.startswith("core LoRA epoch / core full FT epoch"))
    assert "2.00x" in lora and "rounds 1.25-2.00x" in lora
    one = bench.ratio_lines({name: results[:1] for name, results in rounds.items()})
    assert not any("rounds" in line for line in one)  # one round has no range


def test_flops_and_peak_are_plausible():
    from peftune.inputs.backbone import BertConfig

    minilm = BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
    full = bench.flops_per_token(minilm, 25.0, lora=False)
    assert 60e6 < full < 70e6  # ~64 MFLOP of training per token (6 N, N = 10.6 M)
    assert bench.flops_per_token(minilm, 25.0, lora=True) < full
    assert bench.matmul_peak(torch.float32, CPU, size=256, repeats=2) > 0


def test_time_shares_cover_the_epoch_and_find_the_matmuls(tiny_prepared):
    shares = bench.time_shares(tiny_prepared, "full", "fp32", batch_size=16, device=CPU)
    assert sum(shares.values()) == pytest.approx(1.0)
    assert shares["matmul"] > 0 and shares["optimizer"] > 0
    assert bench.category("aten::addmm") == "matmul" and bench.category("aten::_fused_adamw_") == "optimizer"


def test_compiling_pays_only_from_the_trial_length_its_saved_step_time_covers():
    faster = bench.CompileResult(compile_s=60.0, eager_step_s=0.30, compiled_step_s=0.20, steps=64)
    assert faster.speedup == pytest.approx(1.5) and faster.break_even_steps == pytest.approx(600)
    slower = bench.CompileResult(compile_s=60.0, eager_step_s=0.30, compiled_step_s=0.33, steps=64)
    assert slower.break_even_steps == float("inf")  # measured on AVX2 CPUs: never, for full FT and LoRA
    # 1 ms saved against 5 ms of spread between epochs: not a saving anyone can count on (was 60,000 steps)
    noisy = bench.CompileResult(compile_s=60.0, eager_step_s=0.301, compiled_step_s=0.300, steps=64, noise_step_s=0.005)
    assert noisy.break_even_steps == float("inf")
    assert dataclasses.replace(noisy, noise_step_s=0.0005).break_even_steps == pytest.approx(60_000)


def test_the_compile_comparison_traces_the_core_s_step_on_every_batch_length(tiny_prepared):
    # dynamo's "eager" backend: the tracing of the real path, without inductor's minutes of C++ compiling
    result = bench.compile_comparison(tiny_prepared, "lora", "fp32", 16, repeats=1, device=CPU, backend="eager")
    assert result.steps == -(-len(tiny_prepared.tasks["sst"].train) // 16)
    assert result.compile_s >= 0 and result.eager_step_s > 0 and result.compiled_step_s > 0
    assert result.noise_step_s >= 0


def test_the_bench_compares_on_the_cpu_or_a_gpu_only():
    # a device this machine lacks or torch does not know: test_bad_input_kinds' kind 7
    bench.check_bench_device(CPU)
    with pytest.raises(UserError, match="--device mps: the bench runs on cpu or cuda"):
        bench.check_bench_device(torch.device("mps"))


def test_the_pack_bench_times_the_same_members_on_the_same_tokens(tiny_prepared):
    """``--pack``: K members packed against the same K one after another, on the same batches, rounds alternating."""
    lines = []
    results = bench.run_pack_bench(tiny_prepared, ["lora", "bitfit"], [2], batch_size=32, repeats=1, device=CPU,
                                   echo=lines.append)  # fmt: skip
    assert list(results) == [("lora", 2), ("bitfit", 2)] and len(lines) == 4
    assert [line.split(": ")[1] for line in lines[:2]] == ["lora K=2 packed", "lora K=2 solo"]  # alternating
    for (_, k), rounds in results.items():
        packed, solo = rounds["packed"][0], rounds["solo"][0]
        assert packed.tokens == solo.tokens and packed.steps * k == solo.steps and packed.seconds > 0


def test_the_pack_profile_compares_a_packed_step_with_its_solo_steps_by_category(tiny_prepared, capsys):
    bench.print_pack_profile(tiny_prepared, "bitfit", 2, 16, CPU, repeats=1)
    lines = capsys.readouterr().out.splitlines()
    assert "packed against the K solo steps" in lines[1]
    assert [line.split()[0] for line in lines[3:]] == [
        "matmul",
        "attention",
        "optimizer",
        "casts",
        "norms,",
        "other",
        "total",
    ]
