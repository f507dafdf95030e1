"""A forward that writes attributes of its state object (sglang's boundaries hand the residual
stream on through ``forward_batch.residual_stream = ...``): each write is a node of the traced
graph, performed by the fused forward where eager performs it, after the kernels that compute
its value; a later read in the traced code sees what was written; a plain value written from a
value read off the state is guarded as that read. A write the graph cannot replay exactly (a
tensor it does not compute, an object made in the traced code) refuses the trace with its line;
so does a read, in the traced code, of an attribute a leaf rebound (the leaf writes it itself at
run time; the trace's value of it would be baked in)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

import fuser
from fuser.install.splice import STATE_ATTR
from fuser.trace.tracing import trace

H = 16


@dataclasses.dataclass
class Batch:
    gain: torch.Tensor  # [H]
    position: torch.Tensor  # [1]: a counter the forward moves on, as a tensor
    residual: object = None  # written by the forward, read by the next one
    normed: object = None
    steps: int = 0  # a counter the forward moves on, as a plain value
    done: bool = False


def make_batch(seed: int) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    return Batch(torch.rand(H, generator=generator) + 0.5, torch.zeros(1))


def copied(batch: Batch) -> Batch:
    return dataclasses.replace(batch, gain=batch.gain.clone(), position=batch.position.clone())


class Handoff(nn.Module):
    """Writes the residual it computes and a normed value, moves two counters on, reads the
    residual back after writing it, and hands the batch to a leaf after the writes."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(H))

    def forward(self, x, batch):
        batch.residual = x * batch.gain + 1
        batch.steps = batch.steps + 1
        batch.position = batch.position + 1
        h = batch.residual  # the value just written, not a read of the call's state
        batch.normed = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * h * self.weight
        batch.done = True
        return consume(batch.normed, batch).sigmoid()


@fuser.opaque
def consume(y, batch):
    """A leaf that reads what the traced code wrote (at run time, off the call's batch)."""
    return y + batch.residual * batch.position


def eager(layer, x, batch):
    return Handoff.forward(layer, x, batch)


def state_of(batch: Batch) -> dict:
    return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}


def assert_same_state(got: Batch, expected: Batch):
    a, b = state_of(got), state_of(expected)
    assert a.keys() == b.keys()
    for name in a:
        if isinstance(b[name], torch.Tensor):
            torch.testing.assert_close(a[name], b[name], msg=name)
        else:
            assert a[name] == b[name], (name, a[name], b[name])


@pytest.fixture
def fused():
    layer = Handoff()
    batch = make_batch(0)
    before = copied(batch)
    report = fuser.apply(layer, (torch.randn(5, H), batch))
    assert_same_state(batch, before)  # apply's runs wrote into copies of the state
    yield layer, report
    fuser.restore(layer)


def test_writes_are_nodes_of_the_graph_in_program_order():
    traced = trace(Handoff(), (torch.randn(5, H), make_batch(0)))
    writes = [n.args[1] for n in traced.graph.nodes if n.op == "call_function" and n.target is setattr]
    assert writes == ["residual", "steps", "position", "normed", "done"]
    consume = next(n for n in traced.graph.nodes if "consume" in str(n.target))
    assert all(n < consume for n in traced.graph.nodes if n.target is setattr)
    # the residual and the steps were read before any write; nothing was read after one
    assert [r.label() for r in traced.state_reads] == ["batch.gain", "batch.steps", "batch.position"]


def test_the_fused_forward_writes_the_state_as_eager_does(fused):
    layer, report = fused
    assert report.launches_after < report.launches_before, report.text()
    for T in (1, 3, 8, 5):
        x, batch = torch.randn(T, H), make_batch(T)
        expected_batch = copied(batch)
        assert layer.__dict__[STATE_ATTR].guard.why_not((x, batch), {}) is None
        with torch.no_grad():
            got = layer(x, batch)
            expected = eager(layer, x, expected_batch)
        torch.testing.assert_close(got, expected)
        assert_same_state(batch, expected_batch)
        assert batch.steps == 1 and batch.done is True and batch.position.item() == 1


@pytest.mark.filterwarnings("ignore:fuser. Handoff runs its own forward")
def test_a_plain_value_written_from_a_read_is_guarded_as_that_read(fused):
    """The second call on the same batch finds ``steps`` moved on: the guard sends it to the
    module's own forward, which moves it on again; the tensor counter follows either way."""
    layer, _ = fused
    x, batch = torch.randn(3, H), make_batch(3)
    expected_batch = copied(batch)
    with torch.no_grad():
        for _ in range(3):
            got = layer(x, batch)
            expected = eager(layer, x, expected_batch)
            torch.testing.assert_close(got, expected)
            assert_same_state(batch, expected_batch)
    assert layer.__dict__[STATE_ATTR].guard.why_not((x, batch), {}) == "batch.steps is 3, traced with 0"
    assert batch.position.item() == 3


class WritesAConstantTensor(nn.Module):
    def forward(self, x, batch):
        batch.residual = torch.zeros(H)
        return x.sigmoid() * 2


class WritesAnObject(nn.Module):
    def forward(self, x, batch):
        batch.residual = [x * 2, x * 3]
        return x.sigmoid() * 2


class WritesInALeaf(nn.Module):
    """A leaf rebinds an attribute of the state and the traced code reads it after."""

    def forward(self, x, batch):
        store(x, batch)
        return x.sigmoid() * batch.steps


@fuser.opaque
def store(x, batch):
    batch.steps = batch.steps + 1


@pytest.mark.parametrize(
    "module, what",
    [
        (WritesAConstantTensor, "writing a tensor the graph does not compute (made from Python values, or held by the module) to `batch.residual`"),
        (WritesAnObject, "writing a list holding traced values (made in the traced code) to `batch.residual`"),
        (WritesInALeaf, "`batch.steps` is read after `store` ("),
    ],
)
def test_a_write_the_graph_cannot_replay_is_refused_with_its_line(module, what):
    batch = make_batch(0)
    with pytest.raises(fuser.FuserError) as e:
        fuser.apply(module(), (torch.randn(4, H), batch))
    message = str(e.value)
    assert what in message, message
    assert "test_state_writes.py:" in message, message
    assert batch.residual is None and batch.steps == 0  # the caller's state is left alone
