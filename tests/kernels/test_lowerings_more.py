"""Golden outputs of the glue ops lowered beside the op table's first ones: ``repeat``, row
gathers by computed positions (``table[pos]``, ``index_select``, ``torch.gather``), ``F.pad``
with a constant, ``cumsum`` along a short axis, p-norms, ``index_add`` and ``scatter`` of values
along the last axis, and concatenations of many computed parts.

Each case is a small module that uses the op as model code does, between elementwise ops. It is
fused with ``fuser.apply`` at T=3 and called at T in {1, 5}; its output must match the eager
module (plain PyTorch) within fuser.validate.tolerance.KERNEL for the output's dtype, the
report must show the op inside a fused chain and nothing left unfused, and no candidate may be
rejected by validation. Inputs are bfloat16, float16 and float32 at odd widths. Where an op
cannot lower (``index_add`` along the tokens), it stays eager with its reason.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_close, eager_call, fused_call, gen, randn
from test_ops_golden import DTYPES

import fuser
from fuser.validate.tolerance import KERNEL

TRACE_T = 3
TOKENS = (1, 5)
ALL_WIDTHS = [1, 3, 37, 96, 130]
WIDTHS = [1, 37, 130]  # where the op is the same at every width but its padding


def fused_matches(module, make_inputs, fused_ops, tolerance=KERNEL):
    """Fuse at TRACE_T; the fused module must match eager at every T in TOKENS, every fx node
    named after one of ``fused_ops`` must be in a fused chain, and nothing may stay unfused."""
    cases = {T: make_inputs(T) for T in sorted(set(TOKENS) | {TRACE_T})}
    expected = {T: eager_call(module, *args) for T, args in cases.items()}
    report = fuser.apply(module, cases[TRACE_T])
    try:
        for T in TOKENS:
            assert_close(fused_call(module, *cases[T]), expected[T], tolerance, f"fused at T={T}")
    finally:
        fuser.restore(module)
    assert not [r for r in report.rejected if r.category == "validation"], report.text()
    assert not report.unfused, report.text()
    fused = {n for chain in report.chains for n in chain.nodes}
    for op in fused_ops:
        assert any(n == op or n.startswith(op + "_") for n in fused), f"{op} is not fused:\n{report.text()}"
    return report


class Around(nn.Module):
    """``after(fn(before))``: the op between elementwise ops, as glue has it."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, r):
        return self.fn(x + r) * 0.5 - 1.0


def pair(dtype, *shape, scale=2.0):
    return lambda T: (randn(gen(T), T, *shape, dtype=dtype, scale=scale), randn(gen(100 + T), T, *shape, dtype=dtype, scale=scale))


# --- repeat -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", ALL_WIDTHS)
@pytest.mark.parametrize("times", [3])
def test_repeat_along_the_last_axis(times, width, dtype):
    fused_matches(Around(lambda h: h.repeat(1, times)), pair(dtype, width), ["repeat"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("repeats", [(1, 2, 1), (1, 3, 2)], ids=["rows", "rows-and-columns"])
@pytest.mark.parametrize("width", [37])
def test_repeat_along_rows_that_are_not_the_tokens(width, repeats, dtype):
    fused_matches(Around(lambda h: h.repeat(*repeats)), pair(dtype, 3, width), ["repeat"])


# --- row gathers by computed positions ----------------------------------------------------------
class Positions(nn.Module):
    """A learned-positions table (GPT-2, OPT: ``wpe[past + arange]``) or a rotary table
    gathered at positions computed in the chain, added to the hidden states."""

    def __init__(self, spelling: str, width: int, dtype):
        super().__init__()
        self.spelling = spelling
        self.register_buffer("table", torch.randn(64, width, generator=torch.Generator().manual_seed(7)).to(dtype))

    def forward(self, positions, x):
        at = positions + 2  # an offset (OPT's learned positions start at 2)
        if self.spelling == "getitem":
            rows = self.table[at]
        elif self.spelling == "index_select":
            rows = torch.index_select(self.table, 0, at)
        else:
            rows = torch.gather(self.table, 0, at[:, None].expand(-1, self.table.shape[1]))
        return x * 2.0 + rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("spelling", ["getitem", "index_select", "gather"])
def test_table_gathered_at_computed_positions(spelling, width, dtype):
    module = Positions(spelling, width, dtype)
    make = lambda T: (torch.arange(T) * 3 + 1, randn(gen(T), T, width, dtype=dtype))  # noqa: E731
    fused_matches(module, make, [{"getitem": "getitem", "index_select": "index_select", "gather": "gather"}[spelling]])


class RotaryByPosition(nn.Module):
    """cos and sin rows of a rotary table gathered by position ids, applied to [T, heads, dim]."""

    def __init__(self, dim: int, dtype):
        super().__init__()
        angles = torch.arange(64)[:, None] * torch.linspace(0.01, 1.0, dim // 2)[None]
        angles = torch.cat((angles, angles), -1)
        self.register_buffer("cos_cached", angles.cos().to(dtype))
        self.register_buffer("sin_cached", angles.sin().to(dtype))

    def forward(self, position_ids, q):
        cos = self.cos_cached[position_ids].unsqueeze(1)
        sin = torch.index_select(self.sin_cached, 0, position_ids).unsqueeze(1)
        half = q.shape[-1] // 2
        rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
        return q * cos + rotated * sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [32, 96])
def test_rotary_table_gathered_by_position_ids(dim, dtype):
    make = lambda T: (torch.arange(T) + 4, randn(gen(T), T, 4, dim, dtype=dtype))  # noqa: E731
    fused_matches(RotaryByPosition(dim, dtype), make, ["getitem", "index_select", "cat", "mul"])


# --- pad ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("sides", [(2, 3, 0.0), (4, 0, 1.3)], ids=["both", "left"])
def test_pad_with_a_constant(sides, width, dtype):
    left, right, value = sides
    fused_matches(Around(lambda h: F.pad(h, (left, right), value=value)), pair(dtype, width), ["pad"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_pad_of_a_wide_block_reads_its_source_at_shifted_columns(dtype):
    report = fused_matches(Around(lambda h: F.pad(h, (3, 5), value=0.25)), pair(dtype, 16, 130), ["pad"])
    assert "(columns remapped)" in open(report.chains[0].path).read()


# --- cumsum -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", ALL_WIDTHS)
def test_cumsum_along_the_row(width, dtype):
    fused_matches(Around(lambda h: torch.cumsum(h, dim=-1)), pair(dtype, width), ["cumsum"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_cumsum_along_a_middle_axis_and_in_fp32(dtype):
    fused_matches(Around(lambda h: h.cumsum(1) + h.cumsum(-1, dtype=torch.float32)), pair(dtype, 5, 37), ["cumsum"])


# --- p-norms ------------------------------------------------------------------------------------
NORMS = {
    "torch.norm(2)": lambda h: h / torch.norm(h, 2, -1, keepdim=True),
    "x.norm()": lambda h: h * h.norm(dim=-1, keepdim=True),
    "norm(1)": lambda h: h - torch.norm(h, 1, dim=-1, keepdim=True),
    "vector_norm(inf)": lambda h: h / torch.linalg.vector_norm(h, float("inf"), dim=-1, keepdim=True),
    "vector_norm(-inf)": lambda h: h + torch.linalg.vector_norm(h, -math.inf, dim=-1, keepdim=True),
    "vector_norm(3)": lambda h: h / torch.linalg.vector_norm(h, 3.0, dim=-1, keepdim=True),
    "vector_norm(0.5)": lambda h: torch.linalg.vector_norm(h, 0.5, dim=-1, keepdim=True) + h,
    "vector_norm(0)": lambda h: torch.linalg.vector_norm(torch.relu(h), 0, dim=-1, keepdim=True) + h,
    "F.normalize": lambda h: F.normalize(h, dim=-1),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(NORMS))
def test_p_norm_along_the_last_axis(case, dtype):
    fused_matches(Around(NORMS[case]), pair(dtype, 37), [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 3, 96, 130])
@pytest.mark.parametrize("case", ["torch.norm(2)", "vector_norm(3)"])
def test_p_norm_at_odd_widths(case, width, dtype):
    fused_matches(Around(NORMS[case]), pair(dtype, width), [])


@pytest.mark.parametrize("dtype", DTYPES)
def test_p_norm_per_head_without_keepdim(dtype):
    fused_matches(Around(lambda h: torch.norm(h, 2.5, dim=-1).unsqueeze(-1) * h), pair(dtype, 4, 37), ["norm"])


# --- index_add ----------------------------------------------------------------------------------
class IndexAdd(nn.Module):
    """Columns of a source added into columns of x that an index buffer names (repeats sum)."""

    def __init__(self, index: list[int], alpha: float):
        super().__init__()
        self.alpha = alpha
        self.register_buffer("index", torch.tensor(index))

    def forward(self, x, s):
        return (x * 2.0).index_add(-1, self.index, s + 1.0, alpha=self.alpha) - 1.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [3, 37, 130])
@pytest.mark.parametrize("alpha", [0.5])
def test_index_add_along_the_last_axis(alpha, width, dtype):
    index = [(7 * j) % width for j in range(5)] + [0, width - 1]  # repeats included
    make = lambda T: (randn(gen(T), T, width, dtype=dtype), randn(gen(T + 50), T, len(index), dtype=dtype))  # noqa: E731
    fused_matches(IndexAdd(index, alpha), make, ["index_add"])


class IndexAddOverTokens(nn.Module):
    def forward(self, x, index, s):
        return (x * 2.0).index_add(0, index, s + 1.0) - 1.0


def test_index_add_along_the_tokens_stays_eager_with_its_reason():
    module = IndexAddOverTokens()
    make = lambda T: (randn(gen(T), T, 8), torch.arange(T).flip(0), randn(gen(T + 1), T, 8))  # noqa: E731
    expected = eager_call(module, *make(5))
    report = fuser.apply(module, make(TRACE_T))
    try:
        assert_close(fused_call(module, *make(5)), expected, KERNEL, "fused at T=5")
    finally:
        fuser.restore(module)
    (left,) = [u for u in report.unfused if u.op.startswith("index_add")]
    assert "over tokens" in left.op, report.text()


# --- scatter of values along the last axis --------------------------------------------------------
class TopScoresKept(nn.Module):
    """Llama-4's router: the top-k scores kept in place, the rest -inf, then a sigmoid."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k

    def forward(self, x, r):
        logits = x + r
        top, where = torch.topk(logits, self.k, dim=1)
        kept = torch.full_like(logits, float("-inf")).scatter_(1, where, top)
        return torch.sigmoid(kept.float()).to(x.dtype)


class ScatterAtGivenPlaces(nn.Module):
    """Each row's values put at the columns its index row names (distinct within a row)."""

    def forward(self, x, index, s):
        return (x * 2.0).scatter(-1, index, s + 1.0) - 1.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width,k", [(3, 1), (37, 2), (130, 8)])
def test_top_values_scattered_into_their_places(width, k, dtype):
    fused_matches(TopScoresKept(k), pair(dtype, width), ["topk", "scatter", "sigmoid"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [5, 37])
def test_values_scattered_at_an_index_per_row(width, dtype):
    def make(T):
        places = torch.stack([torch.randperm(width, generator=gen(T + j))[:3] for j in range(T)])
        return randn(gen(T), T, width, dtype=dtype), places, randn(gen(T + 50), T, 3, dtype=dtype)

    fused_matches(ScatterAtGivenPlaces(), make, ["scatter"])


# --- concatenations of many parts ----------------------------------------------------------------
class ManyParts(nn.Module):
    """Five parts of odd widths, each computed (a negation, a product, a slice, an exp, a cast)."""

    def forward(self, a, b, c):
        parts = (a * 2.0, -b, c[..., 1:8], torch.exp(a[..., :3] * 0.1), (b + c[..., :1]).float().to(a.dtype))
        return torch.cat(parts, dim=-1) * 0.5 + 1.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [1, 16])
@pytest.mark.parametrize("width", [37])
def test_concatenation_of_five_computed_parts(width, heads, dtype):
    def make(T):
        shape = (T, heads) if heads > 1 else (T,)
        return tuple(randn(gen(10 * T + i), *shape, w, dtype=dtype) for i, w in enumerate((width, width, 11)))

    fused_matches(ManyParts(), make, ["cat", "neg", "exp"])


class KeysForTheProduct(nn.Module):
    """GPT-J's keys at its head dim: a rotary part computed over the first 64 of 256 dims,
    joined to the rest, heads first, cast to fp32 and transposed for the scores' product —
    the last axis swapped with the one token a head. Too wide to assemble in registers, the
    concatenation is kept in parts through the cast and the transpose and stored part by part."""

    def forward(self, key, sin, cos):
        rot, rest = key[..., :64], key[..., 64:]
        every_two = torch.stack((-rot[..., 1::2], rot[..., ::2]), dim=-1).flatten(-2)  # GPT-J's rotate_every_two
        rot = rot * cos + every_two * sin  # a part computed, not read again
        joined = torch.cat([rot, rest], dim=-1).permute(0, 2, 1, 3)  # [T, heads, 1, 256]
        return joined.to(torch.float32).transpose(-1, -2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [1, 5])
def test_a_concatenation_moved_past_a_unit_axis_is_stored_in_parts(heads, dtype):
    def make(T):
        g = gen(T)
        return randn(g, T, 1, heads, 256, dtype=dtype), randn(g, T, 1, 1, 64, dtype=dtype), randn(g, T, 1, 1, 64, dtype=dtype)

    report = fused_matches(KeysForTheProduct(), make, ["cat", "transpose", "stack"])
    assert len(report.chains) == 1, report.text()


# --- per-head RMSNorm rounds where eager rounds ---------------------------------------------------
class PerHeadRMSNorm(nn.Module):
    """transformers' Qwen3RMSNorm as q_norm over [T, 16, head_dim]: normalised in fp32, cast
    back, then multiplied by the bf16 weight in bf16."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(dim, generator=torch.Generator().manual_seed(3)) * 4 + 0.5)

    def forward(self, q):
        h = q.view(q.shape[0], 16, -1).to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(q.dtype)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_per_head_rms_norm_is_bitwise_eager_in_bf16(head_dim):
    """The kernel rounds to bf16 after normalising and again after the weight, as eager does:
    on the CPU (where the sum and rsqrt are computed alike) the results are the same bits."""
    module = PerHeadRMSNorm(head_dim).to(torch.bfloat16)
    make = lambda T: (randn(gen(T), T, 16 * head_dim, dtype=torch.bfloat16, scale=3.0),)  # noqa: E731
    expected = {T: eager_call(module, *make(T)) for T in (1, 5, 64)}
    report = fuser.apply(module, make(TRACE_T))
    try:
        for T, want in expected.items():
            assert torch.equal(fused_call(module, *make(T)), want), f"T={T}"
    finally:
        fuser.restore(module)
    assert len(report.chains) == 1 and not report.unfused, report.text()


# --- glue laid out [experts, tokens, ...] ---------------------------------------------------------
EXPERTS = 4


class ExpertsFirst(nn.Module):
    """A MoE's routed-expert glue as batched experts lay it out: a bmm's [experts, tokens, 2I]
    output split into gate and up, a per-expert bias [experts, 1, I], the routing weight of each
    (token, expert) and the sum over the experts. The glue's token dim is its second."""

    def __init__(self, hidden: int, inter: int, dtype):
        super().__init__()
        g = torch.Generator().manual_seed(11)
        self.w = nn.Parameter((torch.randn(EXPERTS, hidden, 2 * inter, generator=g) * 0.3).to(dtype))
        self.b = nn.Parameter(torch.randn(EXPERTS, 1, inter, generator=g).to(dtype))

    def forward(self, x, routing):
        gate_up = torch.bmm(x.unsqueeze(0).expand(EXPERTS, -1, -1), self.w)
        gate, up = gate_up.chunk(2, dim=-1)
        routed = (F.silu(gate) * up + self.b) * routing.t()[..., None]
        return routed, routed.sum(0) * 2.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [3, 37])
def test_glue_with_its_tokens_second(inter, dtype):
    module = ExpertsFirst(8, inter, dtype)
    make = lambda T: (randn(gen(T), T, 8, dtype=dtype), randn(gen(T + 1), T, EXPERTS, dtype=dtype))  # noqa: E731
    report = fused_matches(module, make, ["silu", "mul", "add", "sum"])
    assert len(report.chains) == 1, report.text()
    source = open(report.chains[0].path).read()
    assert ".movedim(1, 0)" in source, source
    for T in TOKENS:  # the outputs keep eager's layout ([experts, tokens, I], contiguous)
        fused = fuser.apply(module, make(TRACE_T))
        try:
            assert fused_call(module, *make(T))[0].is_contiguous()
        finally:
            fuser.restore(module)
