"""The cheap-mask dropout and attention: the distribution, the gradient and the seeding of torch's own."""

import math

import pytest
import torch
import torch.nn.functional as F

from peftune.inputs.dropout import Dropout, attention, dropout, keep_mask, member_dropout


@pytest.mark.parametrize("p", [0.05, 0.1, 0.5, 0.9])
def test_an_element_drops_with_probability_p(p):
    torch.manual_seed(0)
    n = 1_000_000
    keep, scale = keep_mask(torch.Size([n]), p)
    kept = keep.double().mean().item()
    assert abs(kept - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n) + 2**-16
    # the four 16-bit lanes of a 64-bit draw keep at the same rate (no lane is biased)
    lanes = keep[: n - n % 4].view(-1, 4).double().mean(0)
    assert (lanes - (1 - p)).abs().max().item() < 5 * math.sqrt(p * (1 - p) / (n / 4)) + 2**-16
    assert scale == pytest.approx(1 / (1 - p), rel=1e-4)


def test_the_expectation_is_exact_and_values_are_zero_or_scaled():
    torch.manual_seed(1)
    x = torch.full((2_000_000,), 3.0)
    out = dropout(x, 0.1)
    _, scale = keep_mask(torch.Size([1]), 0.1)
    values = torch.unique(out)
    assert values[0].item() == 0.0 and values[1:].tolist() == [pytest.approx(3.0 * scale)]
    assert out.mean().item() == pytest.approx(3.0, abs=5 * 3.0 * scale * math.sqrt(0.1 * 0.9 / x.numel()))


def test_the_gradient_flows_through_the_kept_elements_only():
    torch.manual_seed(2)
    x = torch.randn(64, 128, requires_grad=True)
    out = dropout(x, 0.3)
    out.sum().backward()
    kept = out != 0
    _, scale = keep_mask(torch.Size([1]), 0.3)
    assert torch.equal(x.grad, kept.float() * scale)
    assert 0.6 < kept.float().mean().item() < 0.8


def test_seeded_like_torch():
    x = torch.randn(1000)
    torch.manual_seed(3)
    a = dropout(x, 0.2)
    torch.manual_seed(3)
    b = dropout(x, 0.2)
    torch.manual_seed(4)
    c = dropout(x, 0.2)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_evaluation_and_the_edges_are_torchs():
    x = torch.randn(100)
    assert torch.equal(dropout(x, 0.5, training=False), x)
    assert torch.equal(dropout(x, 0.0), x)
    assert torch.equal(dropout(x, 1.0), torch.zeros_like(x))
    module = Dropout(0.5).eval()
    assert torch.equal(module(x), x) and isinstance(module, torch.nn.Dropout)


def test_bf16_input_keeps_its_dtype():
    x = torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=True)
    out = dropout(x, 0.1)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16


def _qkv(B=2, H=3, T=5, S=7, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=g) for n in (T, S, S))
    bias = torch.zeros(B, 1, 1, S)
    bias[1, ..., 4:] = torch.finfo(torch.float32).min  # the second example's last 3 keys are padding
    return q, k, v, bias


def test_attention_without_drops_is_scaled_dot_product_attention():
    q, k, v, bias = _qkv()
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    # p below 2**-17 rounds to no drop at all: the explicit path runs, with an all-True mask
    assert torch.allclose(attention(q, k, v, bias, 1e-9, training=True), expected, atol=1e-6)
    assert torch.allclose(attention(q, k, v, bias, 0.1, training=False), expected, atol=1e-6)


def test_attention_drops_probabilities_not_outputs():
    # with v the identity (S x S per head), the output rows ARE the dropped, rescaled probabilities
    q, k, _, bias = _qkv(B=64, H=4, T=16, S=16, D=16)
    v = torch.eye(16).expand(64, 4, 16, 16)
    torch.manual_seed(5)
    out = attention(q, k, v, bias, 0.5, training=True)
    probs = torch.softmax(q @ k.transpose(-2, -1) / 4.0 + bias, dim=-1)
    kept = out != 0
    dropped_share = 1 - kept[probs > 0].float().mean().item()
    assert abs(dropped_share - 0.5) < 0.02
    assert torch.allclose(out[kept], 2 * probs[kept], rtol=1e-5)
    assert torch.all(out[1, ..., 4:] == 0)  # padding keys get no weight, dropped or not


def test_a_generator_draws_what_the_global_rng_draws_from_the_same_seed():
    x = torch.randn(4, 7, 8)
    torch.manual_seed(5)
    expected = dropout(x, 0.2)
    assert torch.equal(dropout(x, 0.2, generator=torch.Generator().manual_seed(5)), expected)


@pytest.mark.parametrize(
    "ps, seeds",
    [
        ([0.1, 0.0, 0.3], (1, 2, 3)),  # own streams, one member drawing nothing
        ([0.1, 0.2, 0.1, 0.0], (1, 1, 2, 1)),  # shared streams (drawn once) at different p
        ([0.1, 0.1, 0.1], (4, 4, 4)),  # one stream, one p: one mask broadcast
    ],
)
def test_member_dropout_gives_each_member_its_solo_mask_and_scale(ps, seeds):
    """A pack's rows (K * B, ...): member k's rows dropped as its solo run drops them, from its own generator, which
    ends in the state its solo draw leaves (a member at p == 0 draws nothing)."""
    rows = 4
    x = torch.randn(len(ps) * rows, 5, 6)
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    packed = member_dropout(x, ps, generators)
    for k, (p, seed) in enumerate(zip(ps, seeds, strict=True)):
        solo_generator = torch.Generator().manual_seed(seed)
        solo = dropout(x[k * rows : (k + 1) * rows], p, generator=solo_generator)
        assert torch.equal(packed[k * rows : (k + 1) * rows], solo)
        assert torch.equal(generators[k].get_state(), solo_generator.get_state())
