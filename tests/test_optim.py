"""ClippedAdamW: clip_grad_norm_ and a fused AdamW step in one kernel pass over the gradients."""

from __future__ import annotations

import pytest
import torch

from peftune.core.optim import ClippedAdamW


def params_and_grads(scale: float, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(64, 32), (32,), (5, 64), (1,)]
    return [(torch.randn(s, generator=generator), scale * torch.randn(s, generator=generator)) for s in shapes]


def trained(optimizer_for, scale: float, steps: int = 5) -> list[torch.Tensor]:
    """Parameters after ``steps`` steps on fixed gradients of size ``scale`` (two groups, one without decay)."""
    tensors = params_and_grads(scale)
    params = [torch.nn.Parameter(p.clone()) for p, _ in tensors]
    groups = [{"params": params[:2], "weight_decay": 0.01, "lr": 1e-3}, {"params": params[2:], "weight_decay": 0.0}]
    optimizer = optimizer_for(groups)
    for step in range(steps):
        for param, (_, grad) in zip(params, tensors, strict=True):
            param.grad = grad * (step + 1)
        optimizer.step()
    return [p.detach() for p in params]


def reference(max_norm: float):
    """What it replaces: clip_grad_norm_, then torch's fused AdamW."""
    optimizer = None

    def build(groups):
        nonlocal optimizer
        optimizer = torch.optim.AdamW(groups, lr=3e-3, fused=True)
        plain_step = optimizer.step

        def step():
            torch.nn.utils.clip_grad_norm_([p for g in groups for p in g["params"]], max_norm)
            plain_step()

        optimizer.step = step
        return optimizer

    return build


def test_unclipped_gradients_step_exactly_as_the_fused_adamw():
    ours = trained(lambda groups: ClippedAdamW(groups, lr=3e-3, max_grad_norm=1e6), scale=0.01)
    theirs = trained(reference(1e6), scale=0.01)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)  # a divisor of 1: the same gradients, the same kernel


@pytest.mark.parametrize("max_norm", [1.0, 0.05])
def test_clipped_gradients_step_as_clip_grad_norm_then_adamw(max_norm):
    ours = trained(lambda groups: ClippedAdamW(groups, lr=3e-3, max_grad_norm=max_norm), scale=1.0)
    theirs = trained(reference(max_norm), scale=1.0)
    unclipped = trained(lambda groups: torch.optim.AdamW(groups, lr=3e-3, fused=True), scale=1.0)
    for a, b, c in zip(ours, theirs, unclipped, strict=True):
        # a division by the inverse factor against a multiplication by it: the last bits at most
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert not torch.allclose(a, c, rtol=1e-6, atol=1e-7)  # and the clip did act


def test_its_state_is_adamw_s_so_checkpoints_load_either_way():
    tensors = params_and_grads(1.0)
    params = [torch.nn.Parameter(p.clone()) for p, _ in tensors]
    ours = ClippedAdamW(params, lr=1e-3, max_grad_norm=1.0)
    for param, (_, grad) in zip(params, tensors, strict=True):
        param.grad = grad
    ours.step()
    theirs = torch.optim.AdamW(params, lr=1e-3, fused=True)
    theirs.load_state_dict(ours.state_dict())
    for param in params:
        assert set(theirs.state[param]) == {"step", "exp_avg", "exp_avg_sq"} and theirs.state[param]["step"] == 1
