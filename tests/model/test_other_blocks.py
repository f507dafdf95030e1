"""Glue from other model families, end to end on the CPU: fuser traces, fuses and checks them
against eager. They exercise what the DSv4 layer does not: NeoX-style RoPE (``rotate_half``, a
concatenation further math reads), softmax routing with ``softmax(dtype=float32)``, and
DeepSeek-V3's group-limited top-k with an in-place ``scatter_`` between two top-k."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import gen, randn

import fuser
import fuser.pipeline.passes


class RMSNorm(nn.Module):
    """Llama's: the normalised value rounded to x's dtype, then times the weight."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(randn(gen(d), d, scale=0.1).add(1.0))

    def forward(self, x):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + 1e-5)).to(x.dtype) * self.weight.to(x.dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaMoEBlock(nn.Module):
    """Pre-norm attention (a toy single-position mix stands in for attention) with q-norm and
    NeoX RoPE, then a softmax top-2 router and a SwiGLU MLP."""

    def __init__(self, d=64, heads=4, experts=8, k=2):
        super().__init__()
        self.heads, self.head_dim, self.k = heads, d // heads, k
        self.norm1, self.norm2, self.q_norm = RMSNorm(d), RMSNorm(d), RMSNorm(d // heads)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.router = nn.Linear(d, experts, bias=False)
        self.up = nn.Linear(d, 64, bias=False)
        self.down = nn.Linear(32, d, bias=False)

    def forward(self, x, cos, sin):
        T = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).view(T, 3, self.heads, self.head_dim).unbind(1)
        q = self.q_norm(q)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        x = x + self.o(((q * k).sum(-1, keepdim=True).softmax(1) * v).reshape(T, -1))
        h = self.norm2(x)
        weights = self.router(h).softmax(-1, dtype=torch.float32)
        weights, ids = torch.topk(weights, self.k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        gate, up = self.up(h).chunk(2, -1)
        return x + self.down(F.silu(gate) * up) * weights.sum(-1, keepdim=True).to(x.dtype), ids


class V3GroupLimitedGate(nn.Module):
    """DeepSeek-V3's router: sigmoid scores, the best two per group rank the groups, experts of
    the top groups only, un-biased weights renormalised and scaled."""

    def __init__(self, d=32, experts=64, groups=8, top_groups=3, k=6):
        super().__init__()
        self.groups, self.per_group, self.top_groups, self.k = groups, experts // groups, top_groups, k
        self.bias = nn.Parameter(randn(gen(1), experts, scale=0.1))
        self.proj = nn.Linear(d, experts, bias=False)

    def forward(self, x):
        T = x.shape[0]
        scores = self.proj(x).float().sigmoid()
        biased = scores + self.bias
        group_scores = biased.view(T, self.groups, -1).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.top_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(T, self.groups, self.per_group).reshape(T, -1)
        ids = torch.topk(biased.masked_fill(~score_mask.bool(), float("-inf")), k=self.k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        return ids, weights / (weights.sum(-1, keepdim=True) + 1e-20) * 2.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_llama_style_moe_block_fuses_and_matches_eager(dtype):
    torch.manual_seed(0)
    module = LlamaMoEBlock().to(dtype)
    T = 5
    angles = randn(gen(2), T, 1, 8)
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    result = fuser.check(module, (randn(gen(3), T, 64, dtype=dtype), cos, sin))
    assert result.ok, result.text()
    report = result.report
    assert not report.unfused and report.launches_after * 4 <= report.launches_before, report.text()
    fused_ops = {n for c in report.chains for n in c.nodes}
    assert {"cat", "neg", "softmax_1", "topk"} <= fused_ops, report.text()  # rotate_half, router


def test_deepseek_v3_group_limited_gate_fuses_and_matches_eager():
    result = fuser.check(V3GroupLimitedGate(), (randn(gen(4), 5, 32),))
    assert result.ok, result.text()
    report = result.report
    fused_ops = {n for c in report.chains for n in c.nodes}
    assert {"topk_1", "gather", "truediv", "scatter"} <= fused_ops, report.text()  # the group mask too
    assert not report.unfused and report.launches_after == 1, report.text()  # the whole gate, one kernel


class WideAndNarrowNorms(nn.Module):
    """A q head norm over 64 heads x 512 and a one-head kv norm, both scaled by the same table
    (DeepSeek-V4's attention): siblings, but one program per token over both would hold 32768
    elements, where the q norm alone splits its heads across programs."""

    def forward(self, q, kv, cos):
        q2 = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * cos
        kv2 = kv * torch.rsqrt(kv.pow(2).mean(-1, keepdim=True) + 1e-6) * cos
        return q2, kv2


def test_a_merge_never_puts_a_tiled_kernels_wide_block_in_one_program(monkeypatch):
    args = (randn(gen(1), 2, 64, 512), randn(gen(2), 2, 1, 512), randn(gen(3), 2, 1, 512))
    result = fuser.check(WideAndNarrowNorms(), args)
    assert result.ok, result.text()
    assert result.report.launches_after == 2, result.report.text()
    monkeypatch.setattr(fuser.pipeline.passes, "UNTILED_BLOCK_LIMIT", 1 << 30)  # the limit is what keeps them apart
    assert fuser.explain(WideAndNarrowNorms(), args).launches_after == 1
