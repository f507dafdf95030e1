"""A forward given an object of the engine's state (sglang's ``forward_batch``: a mode, flags,
tensors, a backend object) traces through reads of it: a value read off it is taken as traced
and the branch on it traces, a tensor or an object read off it is read from the call's own
object at run time, and the guard compares every value and tensor shape read at each call, so
a call in another mode runs the module's own forward."""

from __future__ import annotations

import dataclasses
import enum

import pytest
import torch
import torch.nn as nn

import fuser
from fuser.install.splice import STATE_ATTR

H = 16


class Mode(enum.IntEnum):
    EXTEND = 1
    DECODE = 2

    def is_decode(self) -> bool:
        return self == Mode.DECODE


class Backend:
    """An object the batch points at (an attention backend): no tensors of its own."""

    def __init__(self, scale: float):
        self.scale = scale


@dataclasses.dataclass
class Batch:
    mode: Mode
    seq_lens: torch.Tensor  # [T]: the batch's own tensor
    gain: torch.Tensor  # [H]
    backend: Backend
    spec_info: object = None


@fuser.opaque
def scaled(y: torch.Tensor, backend: Backend) -> torch.Tensor:
    """Stands in for a kernel the engine calls with a backend object."""
    return y * backend.scale


class Attention(nn.Module):
    def forward(self, x, batch):
        return x + batch.seq_lens[:, None].to(x.dtype)


fuser.opaque(Attention)


class Layer(nn.Module):
    """Branches on the batch's mode and flags; reads a tensor and an object off it."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(H))
        self.attn = Attention()

    def forward(self, x, batch):
        if batch.mode.is_decode() and batch.spec_info is None:
            y = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * x * self.weight * batch.gain
        else:
            y = x * 2
        return scaled(self.attn(y, batch), batch.backend) + x


def make_batch(T: int, mode=Mode.DECODE, scale=0.5, seed=0) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    return Batch(mode, torch.arange(T), torch.rand(H, generator=generator), Backend(scale))


def eager(layer: Layer, x, batch):
    return Layer.forward(layer, x, batch)


@pytest.fixture
def fused():
    layer = Layer()
    report = fuser.apply(layer, (torch.randn(5, H), make_batch(5)))
    yield layer, report
    fuser.restore(layer)


def why_not(layer, x, batch):
    return layer.__dict__[STATE_ATTR].guard.why_not((x, batch), {})


def test_a_branch_on_the_state_traces_and_its_chain_is_fused(fused):
    layer, report = fused
    (norm,) = [c for c in report.chains if "mean" in c.nodes]
    assert {"rsqrt", "mul"} <= {n.rstrip("_0123456789") for n in norm.nodes}, report.text()
    assert report.launches_after < report.launches_before, report.text()
    assert report.state_reads == {"batch.mode": "<Mode.DECODE: 2>", "batch.spec_info": "None",
                                  "batch.gain": "a tensor [16] torch.float32"}, report.text()  # fmt: skip
    assert "read off the call's state as traced" in report.text()


def test_every_batch_size_in_the_traced_mode_runs_fused_and_matches(fused):
    layer, _ = fused
    for T in (1, 3, 8):
        x, batch = torch.randn(T, H), make_batch(T, seed=T)
        assert why_not(layer, x, batch) is None
        with torch.no_grad():
            torch.testing.assert_close(layer(x, batch), eager(layer, x, batch))


def test_another_mode_or_flag_runs_the_module_s_own_forward(fused):
    layer, _ = fused
    x = torch.randn(4, H)
    extend = make_batch(4, Mode.EXTEND)
    assert why_not(layer, x, extend) == "batch.mode is <Mode.EXTEND: 1>, traced with <Mode.DECODE: 2>"
    speculative = make_batch(4)
    speculative.spec_info = object()
    assert why_not(layer, x, speculative).startswith("batch.spec_info is <object")
    with torch.no_grad():
        for batch in (extend, speculative):
            torch.testing.assert_close(layer(x, batch), eager(layer, x, batch))
            torch.testing.assert_close(layer(x, batch), x * 2 * 0.5 + torch.arange(4.0)[:, None] * 0.5 + x)


def test_tensors_and_objects_are_read_off_the_call_s_own_state(fused):
    """New values in the same shapes: the fused forward reads them, none was baked in."""
    layer, _ = fused
    x = torch.randn(3, H)
    batch = make_batch(3, scale=3.0, seed=7)
    assert why_not(layer, x, batch) is None
    with torch.no_grad():
        torch.testing.assert_close(layer(x, batch), eager(layer, x, batch))
        assert not torch.allclose(layer(x, batch), eager(layer, x, make_batch(3, seed=7)))


def test_a_tensor_read_off_the_state_in_another_shape_runs_eager(fused):
    layer, _ = fused
    x = torch.randn(3, H)
    batch = make_batch(3)
    batch.gain = torch.rand(1)  # broadcasts in eager; the kernel was made for [16]
    assert why_not(layer, x, batch) == "batch.gain is torch.float32 [1] on cpu, traced as torch.float32 [16] on cpu"
    with torch.no_grad():
        torch.testing.assert_close(layer(x, batch), eager(layer, x, batch))


class Uncopyable:
    """Something a state object may hold that cannot be deep-copied (a process group, a stream:
    sglang's forward_batch holds one in its residual stream mid-layer)."""

    def __deepcopy__(self, memo):
        raise TypeError("cannot pickle 'ProcessGroup' object")


class Writes(nn.Module):
    """Writes into a tensor of its state through a leaf, as a KV-cache update does."""

    def forward(self, x, batch):
        self.store(x, batch)
        return (x * batch.gain).sigmoid() + 1

    @staticmethod
    @fuser.opaque
    def store(x, batch):
        batch.seq_lens.add_(1)


def test_a_state_object_that_cannot_be_deep_copied_is_copied_with_its_tensors_cloned():
    batch = make_batch(4)
    batch.backend = Uncopyable()
    seq_lens = batch.seq_lens.clone()
    layer = Writes()
    report = fuser.apply(layer, (torch.randn(4, H), batch))
    try:
        assert report.launches_after < report.launches_before, report.text()
        torch.testing.assert_close(batch.seq_lens, seq_lens)  # apply's runs wrote into copies
        assert isinstance(batch.backend, Uncopyable)
        x = torch.randn(4, H)
        with torch.no_grad():
            torch.testing.assert_close(layer(x, batch), (x * batch.gain).sigmoid() + 1)
        torch.testing.assert_close(batch.seq_lens, seq_lens + 1)  # the call's own state, written once
    finally:
        fuser.restore(layer)
