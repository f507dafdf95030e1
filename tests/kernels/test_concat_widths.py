"""Golden outputs of concatenations along the last axis at any width and any number of parts.

RoPE as transformers writes it (``q * cos + rotate_half(q) * sin``) at the head dims of
current models, partial rotary (``partial_rotary_factor``: GPT-NeoX, Phi, StableLM), and a
concatenation of three loaded values of odd widths. Halves of a power-of-two width are
interleaved in registers; other concatenations read each part again at the concatenation's
columns (fuser/lower/concat.py), a one-hot sum only where a part cannot be. Each case is fused with
``fuser.apply`` (tests/kernels/test_ops_golden.py's :func:`fuse_and_compare`): the output must
match plain PyTorch within fuser.validate.tolerance.KERNEL for its dtype at every token count,
the whole chain must be one kernel, and no ``cat``, ``neg`` or slice may be left eager.
A part that cannot be read at other columns (a softmax's output) keeps the concatenation eager,
with its reason.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from helpers import assert_close, eager_call, fused_call, gen, randn
from test_ops_golden import DTYPES, TOKENS, TRACE_T, fuse_and_compare

import fuser
from fuser.lower.tiling import pow2
from fuser.validate.tolerance import KERNEL

HEADS = 16  # [16, 128] blocks: a one-hot sum over their columns is too large, the parts are re-read
ROPE_NODES = ["cat", "neg", "mul", "add"]


def rotate_half(x):
    """transformers' ``rotate_half``: the negated second half, then the first."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q, cos, sin):
    return (q * cos) + (rotate_half(q) * sin)


class Rope(nn.Module):
    def forward(self, q, cos, sin):
        return apply_rotary(q, cos, sin)


class PartialRope(nn.Module):
    """GPT-NeoX / Phi / StableLM: the first ``rotary`` columns rotated, the rest passed through;
    ``scaled``: the result read by more math (as attention's scale), so the outer concatenation
    is one block too, not only stored part by part."""

    def __init__(self, rotary: int, scaled: bool):
        super().__init__()
        self.rotary, self.scaled = rotary, scaled

    def forward(self, q, cos, sin):
        q_rot, q_pass = q[..., : self.rotary], q[..., self.rotary :]
        out = torch.cat((apply_rotary(q_rot, cos, sin), q_pass), dim=-1)
        return out * 0.125 if self.scaled else out


def rope_inputs(dtype, head_dim: int, rotary: int | None = None):
    """(q [T, HEADS, head_dim], cos, sin [T, 1, rotary]) as transformers' rotary embedding
    makes them: the angles twice over (``torch.cat((freqs, freqs), -1)``)."""
    rotary = rotary or head_dim

    def make(T):
        angles = randn(gen(T + 7), T, 1, (rotary + 1) // 2, scale=3.0)
        cos, sin = (torch.cat([f(angles)] * 2, -1)[..., :rotary].to(dtype) for f in (torch.cos, torch.sin))
        return randn(gen(T), T, HEADS, head_dim, dtype=dtype, scale=2.0), cos, sin

    return make


def halves(first: int, second: int) -> bool:
    """Are two parts halves of a power-of-two width (interleaved in registers, not re-read)?"""
    return first == second == pow2(first)


def one_kernel(report, remapped: bool):
    """The chain is one fused kernel; ``remapped``: one that reads its parts at remapped columns."""
    assert len(report.chains) == 1, report.text()
    assert not report.unfused, report.text()
    if remapped:
        source = open(report.chains[0].path).read()
        assert "(columns remapped)" in source, source


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80, 96, 112, 128, 256])
def test_rotate_half_rope_at_any_head_dim(head_dim, dtype):
    report = fuse_and_compare(Rope(), rope_inputs(dtype, head_dim), ROPE_NODES)
    one_kernel(report, remapped=not halves(head_dim // 2, head_dim - head_dim // 2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaled", [False, True], ids=["stored", "scaled"])
@pytest.mark.parametrize("factor", [0.25, 0.4, 0.5])
@pytest.mark.parametrize("head_dim", [80, 128])
def test_partial_rotary(head_dim, factor, scaled, dtype):
    rotary = int(head_dim * factor)  # as transformers takes it (128 * 0.4: 51, halves of 25 and 26)
    report = fuse_and_compare(PartialRope(rotary, scaled), rope_inputs(dtype, head_dim, rotary), ROPE_NODES)
    one_kernel(report, remapped=scaled and not halves(rotary, head_dim - rotary))


class ThreeParts(nn.Module):
    def forward(self, a, b, c, x):
        return torch.cat((a, -b, c * 2), dim=-1) * x + 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [1, 32])
def test_three_parts_of_odd_widths(heads, dtype):
    widths = (24, 40, 7)

    def make(T):
        parts = [randn(gen(10 * T + i), T, heads, w, dtype=dtype, scale=2.0) for i, w in enumerate(widths)]
        return (*parts, randn(gen(T), T, heads, sum(widths), dtype=dtype, scale=2.0))

    report = fuse_and_compare(ThreeParts(), make, ["cat", "neg", "mul", "add"])
    one_kernel(report, remapped=True)  # its parts are loads: read again, never summed one-hot


class SoftmaxThenCat(nn.Module):
    """A part that is a softmax over its own columns: never computed again at other columns."""

    def forward(self, x, y, z):
        return torch.cat((torch.softmax(x * 2, dim=-1), y + 1), dim=-1) * z


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="float32")])
def test_a_part_that_cannot_be_reread_stays_eager_with_its_reason(dtype):
    def make(T):
        return (
            randn(gen(T), T, HEADS, 100, dtype=dtype),
            randn(gen(T + 1), T, HEADS, 28, dtype=dtype),
            randn(gen(T + 2), T, HEADS, 128, dtype=dtype),
        )

    module = SoftmaxThenCat()
    cases = {T: make(T) for T in sorted(set(TOKENS) | {TRACE_T})}
    expected = {T: eager_call(module, *args) for T, args in cases.items()}
    report = fuser.apply(module, cases[TRACE_T])
    try:
        for T in TOKENS:
            assert_close(fused_call(module, *cases[T]), expected[T], KERNEL, f"fused at T={T}")
    finally:
        fuser.restore(module)
    (cat,) = [u for u in report.unfused if u.op == "cat"]
    assert "concatenation is too large to assemble in registers" in cat.reason, report.text()
