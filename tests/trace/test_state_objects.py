"""Objects read off a call's state traced as Python objects (fuser.trace.state_objects).

The blocks below hand their residual on as sglang's DeepSeek-V4 boundaries do, through a stream
object on the per-call batch whose methods change it (``stream.write``, ``stream.record``) and
check by identity that what they are given is theirs. Declared with ``fuser.trace_through``, the
stream's methods run in the trace; what a fused call leaves on the batch is checked against what
eager leaves, field by field and by identity, over several calls and token counts.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fuser
from fuser.trace.state_objects import Materialize
from fuser.trace.tracing import trace

HIDDEN = 16


class Pending:
    """A producer's output the next reader must add (sglang's ``Contribution``)."""

    def __init__(self, value):
        self.value = value


@fuser.trace_through
class Stream:
    """The residual of one forward and what the last producer left pending."""

    __slots__ = ("residual", "pending")

    def __init__(self, residual=None):
        self.residual = residual
        self.pending = None

    def take(self, hidden):
        if self.pending is None:
            if self.residual is not None and hidden is not self.residual:
                raise RuntimeError("output does not belong to this stream")
            return hidden, self.residual
        return self.pending.value, self.residual

    def write(self, residual):
        self.residual, self.pending = residual, None
        return residual

    def record(self, output):
        if self.pending is not None:
            raise RuntimeError("cannot replace an unconsumed contribution")
        self.pending = Pending(output)
        return output


class Batch:
    """The per-call state: the stream, and a tensor of its own (so it is state)."""

    def __init__(self, tokens: int):
        self.stream = Stream()
        self.positions = torch.arange(tokens)


@fuser.opaque
class Peek(nn.Module):
    """A leaf given the batch that reads what the stream holds at run time."""

    def forward(self, x, batch):
        return x + 2 * batch.stream.pending.value


def rms_norm(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


class Block(nn.Module):
    """Reads the stream, writes the sum, records its output, lets a leaf see it pending, then
    completes it: the stream is changed in place, never replaced."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(HIDDEN) + 0.5)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.peek = Peek()

    def forward(self, hidden, batch):
        stream = batch.stream
        x, residual = stream.take(hidden)
        h = stream.write(x if residual is None else x + residual)
        y = stream.record(torch.tanh(self.proj(rms_norm(h, self.weight))))
        seen = self.peek(h, batch)
        return stream.write(stream.pending.value + stream.residual + 0.5 * seen)


class Replacing(Block):
    """Writes a new stream onto the batch, then changes that one after the write."""

    def forward(self, hidden, batch):
        x, residual = batch.stream.take(hidden)
        h = x if residual is None else x + residual
        batch.stream = Stream(h)
        out = self.proj(rms_norm(h, self.weight)).sigmoid()
        return batch.stream.write(out * h)


def run(blocks, hidden, batch):
    for block in blocks:
        hidden = block(hidden, batch)
    return hidden


def two_blocks(cls=Block):
    torch.manual_seed(0)
    return [cls(), cls()]


def fuse(blocks, tokens: int = 5):
    """Each block fused on the call the model makes of it: the first with a fresh stream, the
    second with the stream the first left (its residual the block's input itself)."""
    batch = Batch(tokens)
    hidden = torch.randn(tokens, HIDDEN)
    with torch.no_grad():
        for block in blocks:
            fuser.apply(block, (hidden, batch))
            hidden = block(hidden, batch)


def leave(stream):
    return (stream.residual, stream.pending)


@pytest.mark.parametrize("cls", [Block, Replacing])
def test_fused_blocks_leave_the_stream_as_eager_does_at_every_token_count(cls):
    eager_blocks = two_blocks(cls)
    blocks = copy.deepcopy(eager_blocks)
    fuse(blocks)
    for tokens in (5, 1, 8):
        hidden = torch.randn(tokens, HIDDEN)
        with torch.no_grad():
            eager_batch, fused_batch = Batch(tokens), Batch(tokens)
            eager_stream, fused_stream = eager_batch.stream, fused_batch.stream
            expected = run(eager_blocks, hidden, eager_batch)
            out = run(blocks, hidden, fused_batch)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        # what the stream holds, as eager: the residual is the returned tensor itself, nothing pending
        assert fused_batch.stream.residual is out and eager_batch.stream.residual is expected
        assert fused_batch.stream.pending is None and eager_batch.stream.pending is None
        # the stream object: changed in place (Block), or a new one (Replacing), as eager's
        assert (fused_batch.stream is fused_stream) == (eager_batch.stream is eager_stream) == (cls is Block)
    for block in blocks:
        assert fuser.stats(block)[""] == {"fused": 1 + 3, "declined": {}}  # fuse()'s call, then these


def test_a_leaf_given_the_state_sees_the_stream_as_eager_has_it_then():
    """Peek reads the pending contribution off the batch at run time: the graph makes the
    stream as it is at that point before the leaf runs (and once more at the end)."""
    block = two_blocks()[0]
    graph = trace(block, (torch.randn(5, HIDDEN), Batch(5))).graph
    order = [n.target for n in graph.nodes if n.op in ("call_function", "call_module")]
    made = [i for i, t in enumerate(order) if isinstance(t, Materialize)]
    leaf = order.index("peek")
    assert len(made) == 2 and made[0] < leaf < made[1]
    assert [order[i].kind for i in made] == ["Stream", "Stream"]


def test_the_second_blocks_residual_is_its_input_itself_and_the_guard_checks_it():
    eager_blocks = two_blocks()
    blocks = copy.deepcopy(eager_blocks)
    fuse(blocks)
    hidden = torch.randn(3, HIDDEN)
    with torch.no_grad():
        batch = Batch(3)
        h = blocks[0](hidden, batch)
        batch.stream.residual = h.clone()  # equal values, another tensor: eager's take() would raise
        with pytest.raises(RuntimeError, match="does not belong to this stream"):
            blocks[1](h, batch)
    (declined,) = fuser.stats(blocks[1])[""]["declined"]
    assert declined == "batch.stream.residual is not the input hidden itself, as traced"


def test_a_stream_at_another_stage_runs_eager_with_the_reason():
    """The first block was traced with a fresh stream (no residual): called with a written one,
    its guard declines and its own code runs."""
    eager_blocks = two_blocks()
    blocks = copy.deepcopy(eager_blocks)
    fuse(blocks)
    hidden = torch.randn(4, HIDDEN)
    with torch.no_grad():
        batch, eager_batch = Batch(4), Batch(4)
        batch.stream.write(hidden)
        eager_batch.stream.write(hidden)
        out = blocks[0](hidden, batch)
        expected = eager_blocks[0](hidden, eager_batch)
    torch.testing.assert_close(out, expected)
    (declined,) = fuser.stats(blocks[0])[""]["declined"]
    assert declined.startswith("batch.stream.residual is a tensor")


def test_a_stream_holding_an_object_in_a_field_is_refused_naming_it():
    block = two_blocks()[0]
    batch = Batch(2)
    batch.stream.record(torch.randn(2, HIDDEN))
    with pytest.raises(fuser.FuserError, match=r"`batch\.stream\.pending` holds a Pending: a Stream read off the state"):
        fuser.apply(block, (torch.randn(2, HIDDEN), batch))
    assert "forward" not in block.__dict__  # left as it was
