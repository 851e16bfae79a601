"""Dropout and attention with a cheap random mask on the CPU.

``F.dropout`` draws one Bernoulli sample per element from a serial generator on the CPU. Here one 64-bit draw
yields four 16-bit uniform integers, each compared with a threshold: the same distribution (a drop probability
within 2**-16 of ``p``, the scale computed from the probability actually used, so the expectation is exact), from
a quarter of the draws. Seeded by ``torch.manual_seed`` like torch's own, or drawn from a given ``generator``: a
pack draws each member's masks from its own, in its solo run's order and shapes (:func:`member_dropout`).
:func:`attention` runs the math path torch takes on the CPU with dropout, with this mask, rounding as HF BERT's
attention does under autocast. Evaluation, CUDA and ``p == 0`` keep torch's fused kernels. What it saves:
docs/benchmarks.md, "Dropout with a cheap mask".
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

_LEVELS = 1 << 16  # a drop probability is a multiple of 2**-16


def uses_cheap_mask(x: torch.Tensor, p: float, training: bool) -> bool:
    return training and 0.0 < p < 1.0 and x.device.type == "cpu"


def keep_mask(
    shape: torch.Size, p: float, device: torch.device | str = "cpu", generator: torch.Generator | None = None
) -> tuple[torch.Tensor, float]:
    """(a bool tensor of ``shape``, True where an element is kept; the scale 1 / P(kept)).

    Four independent uniform int16 values per 64-bit draw; an element drops when its value is below
    ``-2**15 + round(p * 2**16)``, i.e. with probability ``round(p * 2**16) / 2**16``. The draws come from
    ``generator``, or torch's global one when it is None."""
    return _threshold(_random_bits(shape, device, generator), p)


def _random_bits(shape, device, generator: torch.Generator | None) -> torch.Tensor:
    """Uniform int16 values of ``shape``, four per 64-bit draw (the draws depend on the shape, never on p)."""
    numel = math.prod(shape)
    draws = torch.empty((numel + 3) // 4, dtype=torch.int64, device=device)
    draws.random_(-(2**63), None, generator=generator)
    return draws.view(torch.int16)[:numel].view(shape)


def _threshold(bits: torch.Tensor, p: float) -> tuple[torch.Tensor, float]:
    dropped_levels = round(p * _LEVELS)
    return bits >= dropped_levels - _LEVELS // 2, _LEVELS / (_LEVELS - dropped_levels)


def dropout(x: torch.Tensor, p: float, training: bool = True, generator: torch.Generator | None = None) -> torch.Tensor:
    """``F.dropout(x, p, training)``, with the cheap mask on the CPU (drawn from ``generator`` if given).

    Where the cheap mask does not apply, torch's ``F.dropout`` runs: it draws nothing at ``p == 0`` or in
    evaluation, and it cannot take a generator elsewhere (CUDA), which is refused then."""
    if not uses_cheap_mask(x, p, training):
        if generator is not None and training and p > 0.0:
            raise ValueError(f"dropout with a generator draws its mask on the CPU only, got a tensor on {x.device}")
        return F.dropout(x, p, training)
    keep, scale = keep_mask(x.shape, p, x.device, generator)
    return (x * keep).mul_(scale)  # autograd keeps the bool mask (a byte per element) for the backward


def member_dropout(x: torch.Tensor, ps: list[float], generators: list[torch.Generator]) -> torch.Tensor:
    """Training dropout of a pack's rows: ``x`` (K * B, ...) holds K members' copies of a batch, B rows each;
    member k's rows are dropped with its own ``ps[k]`` by a mask drawn from ``generators[k]``, in the shape its
    solo run draws, (B, ...): each member sees exactly its solo run's mask. A member at p == 0 draws nothing
    (as ``F.dropout`` at 0) and keeps its rows; x * 1 * 1.0 is x to the bit, forward and backward.

    The members of a sweep share its seed, and the bits a draw takes depend on its shape alone (p only sets the
    threshold): members whose generators are in one state draw the same bits. Those are drawn once, and the other
    generators are moved to the state the draw left (what their own draw would have left), so a pack of K LoRA
    members draws each mask once, not K times; where their p is one too, one mask serves all rows (broadcast)."""
    if not any(uses_cheap_mask(x, p, True) for p in ps):
        return x
    members = len(ps)
    shape = (x.shape[0] // members, *x.shape[1:])  # one member's rows
    drawn = []  # (state before, state after, bits) of each draw
    masks: list[tuple[int, float] | None] = []  # per member: (which draw, p), None: p == 0, nothing drawn
    for p, generator in zip(ps, generators, strict=True):
        if not uses_cheap_mask(x, p, True):
            masks.append(None)
            continue
        state = generator.get_state()
        same = next((i for i, (before, _, _) in enumerate(drawn) if torch.equal(before, state)), None)
        if same is None:
            bits = _random_bits(shape, x.device, generator)
            drawn.append((state, generator.get_state(), bits))
            same = len(drawn) - 1
        else:
            generator.set_state(drawn[same][1])
        masks.append((same, p))
    if len(set(masks)) == 1:  # one draw, one p: one (B, ...) mask broadcast over the K members' rows
        keep, scale = _threshold(drawn[masks[0][0]][2], masks[0][1])
        return (x.view(members, *shape) * keep).mul_(scale).view(x.shape)
    keeps, scales = [], []
    for mask in masks:
        keep, scale = (torch.ones(shape, dtype=torch.bool, device=x.device), 1.0) if mask is None else (
            _threshold(drawn[mask[0]][2], mask[1]))  # fmt: skip
        keeps.append(keep)
        scales.append(scale)
    keep = torch.cat(keeps)  # (K * B, ...)
    if len(set(scales)) == 1:
        return (x * keep).mul_(scales[0])
    # one scale per row: x * keep * scale_k, the product the solo run computes (fp32 by fp32)
    scale = torch.tensor(scales, dtype=torch.float32, device=x.device).repeat_interleave(shape[0])
    return (x * keep).mul_(scale.view(-1, *[1] * (x.ndim - 1)))


@contextmanager
def drawing_from(generator: torch.Generator) -> Iterator[None]:
    """Within the block, torch's default generator of ``generator``'s device draws ``generator``'s stream: what the
    block draws there (``F.dropout``, attention's dropout, the cheap mask) is what it would draw from ``generator``;
    after it, ``generator`` is in the state the block left, and the default generator in its own again.

    A pack's member draws so where its solo run's code draws from the default generator and takes no generator
    (CUDA's ``F.dropout`` and fused attention): the member's draws are its solo run's, op for op, on any device."""
    device = generator.device
    if device.type == "cpu":
        get, put = torch.get_rng_state, torch.set_rng_state
    else:
        get = functools.partial(torch.cuda.get_rng_state, device)
        put = functools.partial(torch.cuda.set_rng_state, device=device)
    saved = get()
    put(generator.get_state())
    try:
        yield
    finally:
        generator.set_state(get())
        put(saved)


class Dropout(nn.Dropout):
    """``nn.Dropout`` with the cheap mask on the CPU (same ``p``, same state: none)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)


def attention(q, k, v, attention_bias, dropout_p: float, training: bool, drop=None) -> torch.Tensor:
    """Scaled dot-product attention with dropout on the probabilities.

    q: (B, nh, T, hd), k and v: (B, nh, S, hd), attention_bias: (B, 1, 1, S) additive -> (B, nh, T, hd).
    ``drop``: a function that drops the probabilities in place of ``dropout(probs, dropout_p)`` (a pack passes
    :func:`member_dropout` with its members' generators); only called where the cheap mask applies.
    """
    if not uses_cheap_mask(q, dropout_p, training):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_bias.to(q.dtype), dropout_p=dropout_p if training else 0.0
        )
    q = q * (1.0 / math.sqrt(q.shape[-1]))  # scaling q (T x hd) is cheaper than the scores (T x S)
    # under autocast the scores come out in bf16; softmax (and its backward) and dropout then run in fp32, and
    # the probabilities meet v in bf16 again: the roundings of HF BERT's attention under the same autocast
    scores = torch.matmul(q, k.transpose(-2, -1)).float() + attention_bias  # (B, nh, T, S)
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(dropout(probs, dropout_p) if drop is None else drop(probs), v)
