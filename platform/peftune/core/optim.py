"""AdamW whose fused step clips the gradients: the clip folded into the optimizer's kernel.

``clip_grad_norm_`` and then a fused AdamW step pass over every gradient three times: the norm, the scaling by the
clip's factor, and the step. Here the step's kernel divides each gradient by the clip's divisor as it reads it
(its ``grad_scale``, the divisor AMP's GradScaler hands the fused kernel to unscale), so the scaling pass is gone;
for full fine-tuning that is a read and a write of 22M gradients a step on MiniLM. What it computes is
``clip_grad_norm_``'s clip: the same global 2-norm, the same ``min(1, max_norm / (norm + 1e-6))``, applied as a
division by its inverse (so the last bit of a clipped gradient may differ from the multiplication).

The state is AdamW's (``step``, ``exp_avg``, ``exp_avg_sq``, initialised as its fused step initialises them), so a
checkpoint of either loads into the other.
"""

from __future__ import annotations

import torch
from torch.optim.adamw import adamw


class ClippedAdamW(torch.optim.AdamW):
    """Fused AdamW (decoupled weight decay, no AMSGrad) that clips the gradients' global 2-norm to
    ``max_grad_norm`` inside its step."""

    def __init__(self, params, lr: float, max_grad_norm: float):
        super().__init__(params, lr=lr, fused=True)
        self.max_grad_norm = max_grad_norm

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ClippedAdamW.step takes no closure")
        groups = [(group, [p for p in group["params"] if p.grad is not None]) for group in self.param_groups]
        grads = [p.grad for _, params in groups for p in params]
        if not grads:
            return None
        # the global 2-norm as clip_grad_norm_ computes it: each gradient's norm, then the norm of those
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        divisor = torch.clamp((norm + 1e-6) / self.max_grad_norm, min=1.0).float()  # 1 / clip_grad_norm_'s factor
        for group, params in groups:
            if not params:
                continue
            states = [self.state_of(p) for p in params]
            beta1, beta2 = group["betas"]
            adamw(
                params,
                [p.grad for p in params],
                [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states],
                [],
                [s["step"] for s in states],
                fused=True,
                grad_scale=divisor,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
            )
        return None

    def state_of(self, parameter: torch.Tensor) -> dict:
        """The parameter's AdamW state, created as the fused AdamW creates it at its first step."""
        state = self.state[parameter]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=parameter.device)
            state["exp_avg"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
        return state
