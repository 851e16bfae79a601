"""The frozen weights cast once per trial (``backbone.cast_frozen``) change no number a trial computes.

Under bf16 autocast a frozen weight was cast at every call; a trial now casts it once. Each method trains a few
steps in bf16 with the casts and without them (``train.cast_for`` made a no-op): the losses, the trained parameters
and the dev scores are equal to the bit. The casts are really used (a wrong cast changes the output), a weight a
method trains (full, top-k) is never cast, and a bias it trains (BitFit) is never taken from a cast.
"""

from __future__ import annotations

import pytest
import torch

from peftune.core import train
from peftune.inputs.backbone import Linear, LowPrecision, cast_frozen

STEPS = 4
CASES = {
    "lora": {"rank": 4},
    "lora-ffn": {"rank": 2, "targets": ["query", "value", "intermediate.dense", "output.dense"]},
    "dora": {"rank": 4},
    "ia3": {},
    "bitfit": {},
    "adapter": {"bottleneck": 8},
    "frozen": {},
    "top_k": {"k": 1},
    "vera": {},
    "prefix": {},
    "full": {},
}


def bf16_config(case: str) -> train.TrainConfig:
    return train.TrainConfig(
        method=case.split("-")[0], method_options=CASES[case], tasks=["sst", "para", "sts"], lr=3e-3, dropout=0.1,
        epochs=1, batch_size=16, seed=3, precision="bf16", device="cpu", log_every=0,
    )  # fmt: skip


def steps(config, prepared) -> dict:
    trial = train.Trial(config, prepared, None)
    torch.manual_seed(train.epoch_seed(config, 0))
    plan = train.epoch_plan(config, trial.tasks, prepared.pad_token_id, 0)
    losses = [trial.step(batch) for batch in plan[:STEPS]]
    dev = train.evaluate_splits(trial.model, trial.tasks, config, trial.device, trial.precision, False)
    return {"losses": losses, "params": trial.model.trainable_state_dict(), "dev": dev, "model": trial.model}


@pytest.mark.parametrize("case", CASES)
def test_a_trial_computes_the_same_numbers_with_its_frozen_weights_cast_once(tiny_prepared, case, monkeypatch):
    config = bf16_config(case)
    cast = steps(config, tiny_prepared)
    monkeypatch.setattr(train, "cast_for", lambda model, precision, like=None: None)
    plain = steps(config, tiny_prepared)
    assert [loss.item() for loss in cast["losses"]] == [loss.item() for loss in plain["losses"]]
    assert torch.equal(torch.stack(cast["losses"]), torch.stack(plain["losses"]))
    assert cast["params"].keys() == plain["params"].keys()
    for name, value in cast["params"].items():
        assert torch.equal(value, plain["params"][name]), name
    assert cast["dev"] == plain["dev"]
    for name, module in cast["model"].named_modules():
        if isinstance(module, Linear):
            trains_weight = module.weight.requires_grad
            assert (module.lowp is None) == trains_weight, name  # cast exactly where the weight is frozen
            if module.lowp is not None and module.bias is not None and module.bias.requires_grad:
                assert module.lowp.bias is None, name  # a trained bias is the live one


def test_the_cast_copy_is_what_a_frozen_linear_multiplies_by_under_autocast():
    torch.manual_seed(0)
    linear = Linear(8, 4).requires_grad_(False)
    x = torch.randn(2, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        before = linear(x)
    assert cast_frozen(linear, torch.bfloat16) == 32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(linear(x), before)
        linear.lowp = LowPrecision(torch.bfloat16, torch.zeros(4, 8, dtype=torch.bfloat16), linear.lowp.bias)
        assert torch.equal(linear(x), linear.bias.to(torch.bfloat16).expand(2, 4))  # the copy, not the weight
    assert torch.equal(linear(x), torch.nn.functional.linear(x, linear.weight, linear.bias))  # fp32: the weight
