"""Golden outputs of the glue forms that transformers' zoo layers spell their own way:

- GPT-J's sin/cos rows: a table that does not follow the tokens repeated per sequence
  (``table.repeat(T, 1, 1)``, T read off the position ids), gathered along its rows at positions
  repeated per column (``position_ids.unsqueeze(-1).repeat(1, 1, width)``, int64): each token's
  row of the table, read straight from it (``gather_table``); and the same with one position
  for every sequence (``position_ids`` of shape [1, 1], as transformers makes it in a decode
  step without padding): one row, read by every token's program;
- a repeat that only spreads unit axes (and axes it adds in front): a broadcast, exact at any
  dtype.

Each case is fused at T=3 and called at T in {1, 5} against the eager module, within
fuser.validate.tolerance.KERNEL per dtype (fp32, bf16, fp16), at odd widths; the op must be
inside a fused kernel and nothing left eager (tests/kernels/test_lowerings_more.fused_matches).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from helpers import gen, randn
from test_lowerings_more import Around, fused_matches, pair
from test_ops_golden import DTYPES

from fuser.pipeline.pass_list import DISABLE_PASSES_ENV

WIDTHS = [1, 37, 130]


class SpreadTableGather(nn.Module):
    """GPT-J's ``_get_embed_positions`` and the gather of its rows by position, added to x."""

    def __init__(self, width: int, dtype):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.register_buffer("embed_positions", torch.randn(64, width, generator=g).to(dtype))

    def forward(self, position_ids, x):
        embed = self.embed_positions.repeat(position_ids.shape[0], 1, 1)
        index = position_ids.unsqueeze(-1).repeat(1, 1, embed.shape[-1])
        rows = torch.gather(embed, 1, index).to(x.dtype)
        return x * 2.0 + rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_table_repeated_over_the_tokens_gathered_by_position(width, dtype):
    make = lambda T: ((torch.arange(T)[:, None] * 7 + 3) % 64, randn(gen(T), T, 1, width, dtype=dtype))  # noqa: E731
    report = fused_matches(SpreadTableGather(width, dtype), make, ["repeat", "gather"])
    (chain,) = report.chains
    assert {"repeat", "repeat_1", "gather"} <= set(chain.nodes), report.text()
    source = open(chain.path).read()
    assert "embed_positions_stride_0" in source, source  # the table's rows read where they are


def shared_position(T: int) -> torch.Tensor:
    """One position for every sequence, as a decode step's ``cache_position[None]``: [1, 1],
    another value at each T (read at run time, not fused in)."""
    return torch.tensor([[(T * 7 + 3) % 64]])


class HiddenFirst(nn.Module):
    """``inner(position_ids, x)`` called as ``(x, position_ids)``: the hidden states first, so
    that they give the token count (the position ids follow none)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x, position_ids):
        return self.inner(position_ids, x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_table_row_at_one_position_shared_by_every_token(width, dtype):
    make = lambda T: (randn(gen(T), T, 1, width, dtype=dtype), shared_position(T))  # noqa: E731
    report = fused_matches(HiddenFirst(SpreadTableGather(width, dtype)), make, ["repeat", "gather"])
    (chain,) = report.chains
    assert {"repeat", "repeat_1", "gather"} <= set(chain.nodes), report.text()
    assert "embed_positions_stride_0" in open(chain.path).read()


class SplitSinCos(nn.Module):
    """The gathered rows split into sin and cos, each spread over the heads and applied to q
    (rotate_half for GPT-J's rotate_every_two): the table never built per token."""

    def __init__(self, dim: int, dtype, positions: int = 64):
        super().__init__()
        angles = torch.arange(positions)[:, None] * torch.linspace(0.01, 1.0, dim // 2)[None]
        self.register_buffer("embed_positions", torch.cat((angles.sin(), angles.cos()), -1).to(dtype))

    def forward(self, position_ids, q):
        embed = self.embed_positions.repeat(position_ids.shape[0], 1, 1)
        index = position_ids.unsqueeze(-1).repeat(1, 1, embed.shape[-1])
        sin, cos = torch.split(torch.gather(embed, 1, index), embed.shape[-1] // 2, dim=-1)
        sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
        cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
        half = q.shape[-1] // 2
        return q * cos + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [4, 18])
def test_rotary_rows_of_a_repeated_table_split_and_spread_over_heads(dim, dtype):
    make = lambda T: ((torch.arange(T)[:, None] * 5 + 1) % 64, randn(gen(T), T, 1, 3, dim, dtype=dtype))  # noqa: E731
    report = fused_matches(SplitSinCos(dim, dtype), make, ["repeat", "gather", "repeat_interleave", "mul"])
    assert len(report.chains) == 1, report.text()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [4, 18])
def test_rotary_rows_at_one_shared_position(dim, dtype):
    make = lambda T: (randn(gen(T), T, 1, 3, dim, dtype=dtype), shared_position(T))  # noqa: E731
    report = fused_matches(HiddenFirst(SplitSinCos(dim, dtype)), make, ["repeat", "gather", "repeat_interleave", "mul"])
    assert len(report.chains) == 1, report.text()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_rows_of_a_table_too_large_for_one_program_at_one_shared_position(dtype):
    """GPT-J-6B's table (2048 positions of 64: more elements than one program holds): its sin/cos
    chain has no token rows, and the gather reads one row of it, never the table whole."""
    make = lambda T: (randn(gen(T), T, 1, 3, 64, dtype=dtype), shared_position(T))  # noqa: E731
    fused_matches(HiddenFirst(SplitSinCos(64, dtype, positions=2048)), make, ["repeat", "gather", "repeat_interleave", "mul"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("repeats", [(1, 3, 1), (2, 1, 1, 1)], ids=["unit-axis", "new-axis-in-front"])
def test_repeat_of_unit_axes_is_a_broadcast(repeats, width, dtype):
    fused_matches(Around(lambda h: h.unsqueeze(1).repeat(*repeats).sum(0) if len(repeats) == 4 else h.unsqueeze(1).repeat(*repeats)),
                  pair(dtype, width), ["repeat"])  # fmt: skip


class InterleavedRotary(nn.Module):
    """transformers' Ernie 4.5 RoPE as shipped (``apply_rotary_pos_emb``): the first half of
    cos and sin interleaved (``repeat_interleave(2, dim=-1)``), q and k rotated by pairs
    (``stack((-x2, x1), -1).flatten(-2)``), in fp32, cast back."""

    def forward(self, q, k, cos, sin):
        from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import apply_rotary_pos_emb

        return apply_rotary_pos_emb(q, k, cos, sin)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [8, 18, 64])
@pytest.mark.parametrize("positions", ["shared", "per-token"])
def test_interleaved_rotary_of_cos_and_sin_with_no_token_rows(positions, dim, dtype):
    """A decode step's cos and sin are one row for the whole batch ([1, 1, dim]: values of no
    token rows, sliced, interleaved and multiplied into q and k); per token, [T, 1, dim]. One
    kernel for q and k either way."""

    def make(T):
        rows = 1 if positions == "shared" else T
        cos, sin = (randn(gen(50 + T + i), rows, 1, dim, dtype=torch.float32) for i in range(2))
        return randn(gen(T), T, 4, 1, dim, dtype=dtype), randn(gen(T + 9), T, 2, 1, dim, dtype=dtype), cos, sin

    report = fused_matches(InterleavedRotary(), make, ["repeat_interleave", "stack", "neg", "mul"])
    assert len(report.chains) == 1, report.text()


class PerHeadLayerNorm(nn.Module):
    """StableLM's StableLmLayerNormPerHead: one LayerNorm per head (its own weights), each of
    its head's slice, concatenated back along the heads (``cat_units``), then elementwise."""

    def __init__(self, heads: int, dim: int, dtype):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(dim, bias=False) for _ in range(heads))
        g = torch.Generator().manual_seed(5)
        for norm in self.norms:
            nn.init.normal_(norm.weight, generator=g)
        self.to(dtype)

    def forward(self, x, r):
        parts = torch.split(x, 1, dim=1)  # of a GEMM's result in a model: views, read as inputs
        return torch.cat([norm(part) for norm, part in zip(self.norms, parts)], dim=1) * 0.5 + r


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [3, 37, 130])
@pytest.mark.parametrize("heads", [2, 5])
def test_per_head_layer_norms_concatenated_along_the_heads(heads, dim, dtype, monkeypatch):
    # the concatenation's own lowering: what is left where per_slice_norms (one norm with the
    # weights stacked, tests/trace/test_per_slice_norms.py) does not match
    monkeypatch.setenv(DISABLE_PASSES_ENV, "per_slice_norms")
    report = fused_matches(PerHeadLayerNorm(heads, dim, dtype), pair(dtype, heads, dim), ["cat", "layer_norm"])
    assert len(report.chains) == 1, report.text()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [4, 7])
def test_per_head_layer_norms_with_the_heads_split_across_programs(heads, dtype, monkeypatch):
    """Rows too wide for one program (heads of 640 columns: StableLM-2-12B's 32 heads of 160
    are 5120 wide) put a few heads in each program: each picks its own heads' parts."""
    monkeypatch.setenv(DISABLE_PASSES_ENV, "per_slice_norms")  # the concatenation's lowering, as above
    report = fused_matches(PerHeadLayerNorm(heads, 640, dtype), pair(dtype, heads, 640), ["cat", "layer_norm"])
    (chain,) = report.chains
    assert "BLOCK_TILE" in open(chain.path).read()  # the heads are tiled
