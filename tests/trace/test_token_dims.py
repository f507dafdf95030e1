"""Inputs whose first dim is not the token count: an ALiBi bias ``[batch·heads, 1, kv]`` where
the token count is the batch (Bloom, MPT, Falcon), rotary tables of one position for every
sequence (``[1, 1, head_dim]``, transformers' decode step). Which dim follows the tokens is read
off the example (its size the token count, or a multiple of it) or declared (``batch_inputs``,
the CLI's ``--batch-input``); an input that follows no token count the example shows is held at
its size, and a trace that fails on one names it. Never an error of fuser's own."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fuser
from fuser.pipeline.fuse_module import FuserError
from fuser.trace.token_dims import infer_batch_inputs, rows_per_token
from fuser.trace.tracing import trace
from fuser.validate.tolerance import LAYER, mismatch

HEADS, DIM, KV = 4, 8, 7


class AlibiScores(nn.Module):
    """Attention scores of one query per sequence plus an ALiBi bias given as ``[batch·heads,
    1, kv]``, viewed per sequence as Bloom's attention does; then softmax and a projection."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(DIM, HEADS * DIM, bias=False)
        self.out = nn.Linear(HEADS * KV, DIM, bias=False)

    def forward(self, hidden, keys, alibi):
        batch = hidden.shape[0]
        q = self.q(hidden).view(batch, HEADS, 1, DIM)
        scores = torch.matmul(q, keys.transpose(-1, -2)) * DIM**-0.5  # [batch, heads, 1, kv]
        scores = scores + alibi.view(batch, HEADS, 1, KV)
        probs = torch.softmax(scores.float(), dim=-1).to(hidden.dtype)
        return hidden + self.out(probs.reshape(batch, HEADS * KV))


def alibi_inputs(batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, DIM, generator=g)
    keys = torch.randn(batch, HEADS, KV, DIM, generator=g)
    slopes = torch.rand(HEADS, generator=g)
    alibi = (slopes[:, None] * torch.arange(KV)[None, :]).repeat(batch, 1).view(batch * HEADS, 1, KV)
    return hidden, keys, alibi


def eager(module, inputs):
    fuser.restore(module) if fuser.is_fused(module) else None
    with torch.no_grad():
        return module(*inputs)


def test_the_example_says_which_inputs_follow_the_tokens():
    hidden, keys, alibi = alibi_inputs(3)
    cos = torch.randn(1, 1, DIM)
    names = ["hidden", "keys", "alibi", "cos", "ids"]
    inputs = [hidden, keys, alibi, cos, torch.arange(5)]
    assert infer_batch_inputs(names, inputs) == {"hidden": 0, "keys": 0, "alibi": 0}
    batch = infer_batch_inputs(names, inputs)
    assert rows_per_token(names, inputs, batch) == {"alibi": HEADS}
    # At one token a multiple cannot be told from a size of its own: only size-1 dims follow.
    one = [hidden[:1], keys[:1], alibi[:HEADS], cos, torch.arange(5)]
    assert infer_batch_inputs(names, one) == {"hidden": 0, "keys": 0, "cos": 0}


def test_an_alibi_bias_of_batch_times_heads_rows_fuses_and_serves_other_batches():
    torch.manual_seed(0)
    module = AlibiScores().eval()
    inputs = alibi_inputs(3)
    traced = trace(module, inputs)
    assert traced.batch_inputs == {"hidden": 0, "keys": 0, "alibi": 0}
    assert traced.batch_rows == {"alibi": HEADS}
    assert traced.automatic_leaves == []
    expected = {b: eager(module, alibi_inputs(b, b)) for b in (3, 5)}
    with torch.no_grad():
        report = fuser.apply(module, inputs)
        assert report.launches_after < report.launches_before
        got = {b: module(*alibi_inputs(b, b)) for b in (3, 5)}
    assert fuser.stats(module)[""]["fused"] == 2
    for b in (3, 5):
        assert mismatch(got[b], expected[b], f"output at batch {b}", LAYER) is None


def test_at_one_token_a_held_input_is_named_and_a_declared_one_fuses():
    torch.manual_seed(0)
    module = AlibiScores().eval()
    inputs = alibi_inputs(1)
    with pytest.raises(FuserError, match=r"test_token_dims.py:\d+.*inputs held at their sizes.*alibi \[4, 1, 7\].*batch_inputs") as refused:
        fuser.apply(module, inputs)
    assert "internal" not in str(refused.value)
    assert not fuser.is_fused(module)
    expected = {b: eager(module, alibi_inputs(b, b)) for b in (1, 4)}
    with torch.no_grad():
        fuser.apply(module, inputs, batch_inputs={"hidden": 0, "keys": 0, "alibi": 0})
        got = {b: module(*alibi_inputs(b, b)) for b in (1, 4)}
    assert fuser.stats(module)[""]["fused"] == 2
    for b in (1, 4):
        assert mismatch(got[b], expected[b], f"output at batch {b}", LAYER) is None


class Rotary(nn.Module):
    """RoPE with tables of one position for every sequence (``[1, 1, d]``: transformers' decode
    step with ``position_ids`` of ``[1, 1]``) inside a submodule: it traces, no leaf."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM, bias=False)
        self.rope = Rope()

    def forward(self, hidden, position_embeddings):
        return hidden + self.proj(self.rope(hidden[:, None, :], *position_embeddings)[:, 0])


class Rope(nn.Module):
    def forward(self, x, cos, sin):
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


def test_tables_of_one_position_are_held_not_grown():
    torch.manual_seed(0)
    module = Rotary().eval()
    tables = (torch.randn(1, 1, DIM), torch.randn(1, 1, DIM))
    hidden = torch.randn(3, DIM)
    traced = trace(module, (hidden,), example_kwargs=dict(position_embeddings=tables))
    assert traced.batch_inputs == {"hidden": 0}
    assert traced.automatic_leaves == []
    expected = eager(module, (torch.randn(6, DIM, generator=torch.Generator().manual_seed(1)), tables))
    with torch.no_grad():
        fuser.apply(module, (hidden,), example_kwargs=dict(position_embeddings=tables))
        got = module(torch.randn(6, DIM, generator=torch.Generator().manual_seed(1)), position_embeddings=tables)
        why = module._fuser_state.guard.why_not((hidden,), dict(position_embeddings=(tables[0].expand(2, 1, DIM), tables[1])))
    assert fuser.stats(module)[""]["fused"] == 1
    assert mismatch(got, expected, "output", LAYER) is None
    assert why == "position_embeddings_0 dim 0 is 2, traced with 1"


def test_batch_inputs_that_name_no_dim_of_the_input_are_refused():
    module = AlibiScores().eval()
    with pytest.raises(FuserError, match=r"batch_inputs gives 'alibi' dim 3, but it is a tensor of 3 dims"):
        fuser.apply(module, alibi_inputs(2), batch_inputs={"hidden": 0, "alibi": 3})
    assert not fuser.is_fused(module)


class Cache:
    """A state object whose update appends a key, as a dynamic cache's does."""

    def __init__(self, keys):
        self.keys = keys

    def update(self, k):
        self.keys = torch.cat([self.keys, k[:, None]], dim=1)
        return self.keys


class Untraceable(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # a branch on data: kept as a leaf, and the trace starts again
            return x * 2
        return x


class AfterUpdate(nn.Module):
    """Updates the cache, then calls a submodule the trace must make a leaf, then checks the
    keys' length against the mask's, as XGLM's attention does."""

    def __init__(self):
        super().__init__()
        self.k = nn.Linear(DIM, DIM, bias=False)
        self.inner = Untraceable()

    def forward(self, hidden, mask, cache):
        keys = cache.update(self.k(hidden))
        h = self.inner(hidden)
        if keys.shape[1] != mask.shape[-1]:
            raise ValueError(f"mask of {mask.shape[-1]} keys for {keys.shape[1]}")
        scores = (keys * h[:, None]).sum(-1) + mask
        return hidden + torch.softmax(scores, -1)[:, :1] * h


def test_each_attempt_of_the_trace_starts_from_the_state_as_given():
    torch.manual_seed(0)
    module = AfterUpdate().eval()
    hidden, mask = torch.randn(3, DIM), torch.zeros(3, 5)
    cache = Cache(torch.randn(3, 4, DIM))
    traced = trace(module, (hidden, mask, cache))
    assert [a.name for a in traced.automatic_leaves if a.name == "inner"] == ["inner"]
    assert cache.keys.shape == (3, 4, DIM)  # the caller's state untouched
