"""The generic fallback: glue no pattern claims becomes "generic" kernels.

Connected elementwise ops become one ``pointwise`` kernel, chains with a per-token reduction one
``row_reduce`` kernel; an op with no lowering splits a chain and is reported; views of the
inputs are read through their strides; a lone op is not worth a kernel and is reported.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn
from helpers import (
    assert_close,
    eager_call,
    fused_call,
    gen,
    randn,
)

import fuser
from fuser.validate.tolerance import KERNEL

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
TRACE_T = 3
TOKENS = (1, 3, 16)


def fuse_and_compare(module, make_inputs, tokens=TOKENS):
    """apply() at TRACE_T, then the fused module must match eager at every T in ``tokens``."""
    cases = {T: make_inputs(T) for T in sorted(set(tokens) | {TRACE_T})}
    expected = {T: eager_call(module, *args) for T, args in cases.items()}
    report = fuser.apply(module, cases[TRACE_T])
    try:
        for T in tokens:
            assert_close(fused_call(module, *cases[T]), expected[T], KERNEL, f"fused at T={T}")
    finally:
        fuser.restore(module)
    dropped = [r for r in report.rejected if r.category == "validation"]
    assert not dropped, f"a kernel fuser built disagreed with eager or failed:\n{report.text()}"
    return report


def only_generic_chain(report, template):
    assert len(report.chains) == 1, report.text()
    chain = report.chains[0]
    assert chain.pattern == "generic", report.text()
    assert chain.template == template, report.text()
    return chain


# --- pointwise ---------------------------------------------------------------------------------
class ScaleAddSigmoid(nn.Module):
    def forward(self, x, y):
        return (x.float() * 0.5 + y.float()).sigmoid().to(torch.bfloat16)


@pytest.mark.parametrize("dtype, width", [(BF16, 123), (FP16, 40), (FP32, 256), (BF16, 7)], ids=str)
def test_pointwise_chain_is_one_generic_kernel(dtype, width):
    report = fuse_and_compare(
        ScaleAddSigmoid(),
        lambda T: (randn(gen(T), T, width, dtype=dtype, scale=3.0), randn(gen(40 + T), T, width, dtype=dtype)),
    )
    chain = only_generic_chain(report, "pointwise")
    assert chain.inputs == ["x", "y"] and len(chain.outputs) == 1, report.text()
    assert {"mul", "add", "sigmoid"} <= set(chain.nodes), chain.nodes
    assert not report.unfused and not report.rejected, report.text()
    assert report.launches_after == 1
    assert chain.launches_replaced == report.launches_before
    if dtype != FP32:  # the two upcasts, mul, add, sigmoid and the downcast
        assert report.launches_before == 6


class GatedByParameter(nn.Module):
    """A parameter (no token dim) broadcast along the rows, and two outputs from one chain."""

    def __init__(self, width):
        super().__init__()
        self.scale = nn.Parameter(randn(gen(0), width))

    def forward(self, x):
        h = x.float() * self.scale
        return torch.sigmoid(h).to(x.dtype), (h * h + 1.0).to(x.dtype)


def test_parameter_with_a_leading_unit_dim_broadcasts_over_rows():
    class RowScale(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = nn.Parameter(randn(gen(0), 1, 80))

        def forward(self, x):
            return (x.float() * self.p).sigmoid().to(x.dtype)

    report = fuse_and_compare(RowScale(), lambda T: (randn(gen(T), T, 80, dtype=BF16),))
    only_generic_chain(report, "pointwise")


def test_pointwise_chain_with_a_parameter_and_two_outputs():
    report = fuse_and_compare(GatedByParameter(50), lambda T: (randn(gen(T), T, 50, dtype=BF16),))
    chain = only_generic_chain(report, "pointwise")
    assert len(chain.outputs) == 2, report.text()
    assert "scale" in chain.inputs, report.text()
    assert not report.unfused and report.launches_after == 1


# --- row reductions ----------------------------------------------------------------------------
class AbsMax(nn.Module):
    def forward(self, x):
        return x.float().abs().amax(-1, keepdim=True) * 2


class ScaledSoftmax(nn.Module):
    def forward(self, x):
        return (x.float() * 0.125).softmax(-1).to(x.dtype)


class LogSumExp(nn.Module):
    def forward(self, x):
        xf = x.float()
        m = xf.amax(-1, keepdim=True)
        return (xf - m).exp().sum(-1, keepdim=True).log() + m


class SumOfSquares(nn.Module):
    def forward(self, x):
        return (x.float() * x.float()).sum(-1) * 0.5


@pytest.mark.parametrize("module", [AbsMax, ScaledSoftmax, LogSumExp, SumOfSquares], ids=lambda m: m.__name__)
@pytest.mark.parametrize("width", [33, 256])
def test_row_reduction_is_one_generic_row_reduce_kernel(module, width):
    report = fuse_and_compare(module(), lambda T: (randn(gen(T), T, width, dtype=BF16, scale=2.0),))
    chain = only_generic_chain(report, "row_reduce")
    assert not report.unfused and report.launches_after == 1, report.text()
    assert chain.launches_replaced == report.launches_before


def test_row_reduction_without_keepdim_then_unsqueeze():
    """The reduced row is a scalar in the row program; unsqueeze gives it a dim back."""

    class Norm(nn.Module):
        def forward(self, x):
            xf = x.float()
            return xf * torch.rsqrt(xf.pow(2).mean(-1).unsqueeze(-1) + 1e-6)

    report = fuse_and_compare(Norm(), lambda T: (randn(gen(T), T, 64, dtype=BF16),))
    only_generic_chain(report, "row_reduce")


# --- ops without a lowering --------------------------------------------------------------------
class Around(nn.Module):
    """Three elementwise ops, the op under test, three elementwise ops."""

    def __init__(self, middle):
        super().__init__()
        self.middle = middle

    def forward(self, x):
        a = (x.float() * 0.5 + 1.0).exp()
        b = self.middle(a)
        return (b * 0.25 - 1.0).sigmoid().to(x.dtype)


UNLOWERED = {
    "cumprod": (lambda a: torch.cumprod(a, -1), "cumprod"),
    "sort": (lambda a: torch.sort(a, dim=-1).values, "sort"),
    "atan": (torch.atan, "atan"),
    "fmod": (lambda a: torch.fmod(a, 0.7), "fmod"),
}


@pytest.mark.parametrize("op", list(UNLOWERED))
def test_op_without_lowering_splits_the_chain_and_is_reported(op):
    middle, name = UNLOWERED[op]
    report = fuse_and_compare(Around(middle), lambda T: (randn(gen(T), T, 40, dtype=BF16),))
    # the ops before and after it are two kernels; it runs eagerly between them
    assert [c.pattern for c in report.chains] == ["generic", "generic"], report.text()
    before, after = sorted(report.chains, key=lambda c: "exp" not in c.nodes)
    assert "exp" in before.nodes and "sigmoid" in after.nodes
    assert not set(before.nodes) & set(after.nodes)
    unfused = [u for u in report.unfused if u.op == name]
    assert len(unfused) == 1, report.text()
    assert name in unfused[0].reason, report.text()
    assert unfused[0].launches == 1
    assert report.launches_after == 3, report.text()


class BoolSlice(nn.Module):
    """One op the fallback takes in but cannot lower (a slice of a bool value) in a chain."""

    def forward(self, x):
        a = (x.float() * 0.5 + 1.0).exp()
        keep = (a > 1.5)[..., 3:30]
        return torch.where(keep, a[..., 3:30] * 2.0, -1.0).sigmoid().to(x.dtype)


def test_an_op_that_does_not_lower_stays_eager_and_the_rest_is_fused_around_it():
    report = fuse_and_compare(BoolSlice(), lambda T: (randn(gen(T), T, 40, dtype=BF16),))
    assert [c.pattern for c in report.chains] == ["generic", "generic"], report.text()
    before, after = sorted(report.chains, key=lambda c: "exp" not in c.nodes)
    assert "exp" in before.nodes and "gt" in before.nodes and "sigmoid" in after.nodes, report.text()
    assert report.launches_after == 2, report.text()


# --- views of the inputs -----------------------------------------------------------------------
class Slice(nn.Module):
    def forward(self, x):
        v = x[:, 2:9]
        return (v.float() * 2 + 1).sigmoid().to(x.dtype)


class SelectAndSlice(nn.Module):
    def forward(self, x):
        v = x[:, 1, 3:11]  # [T, H, N] -> [T, 8]
        return (v.float().exp() * 2).to(x.dtype)


class StridedSlice(nn.Module):
    def forward(self, x):
        v = x[:, ::3]
        return (v.float() * v.float()).sum(-1, keepdim=True) + 1


class TwoHalves(nn.Module):
    def forward(self, x):
        a, b = x.chunk(2, dim=-1)
        return (a.float() * torch.sigmoid(b.float())).to(x.dtype)


def _copies(graph):
    copying = {"contiguous", "clone", "copy_", "copy"}
    return [n for n in graph.nodes if n.op in ("call_method", "call_function") and getattr(n.target, "__name__", n.target) in copying]


VIEWS = {
    # id: (module, non-token shape of x, the views of x the kernel reads)
    "x[:,2:9]": (Slice, (40,), lambda x: (x[:, 2:9],)),
    "x[:,1,3:11]": (SelectAndSlice, (4, 20), lambda x: (x[:, 1, 3:11],)),
    "x[:,::3]": (StridedSlice, (40,), lambda x: (x[:, ::3],)),
    "chunk": (TwoHalves, (64,), lambda x: x.chunk(2, dim=-1)),
}


@pytest.mark.parametrize("case", list(VIEWS))
def test_views_of_the_input_are_read_through_strides(case):
    module_type, shape, views = VIEWS[case]
    make = lambda T: (randn(gen(T), T, *shape, dtype=BF16, scale=2.0),)  # noqa: E731
    report = fuse_and_compare(module_type(), make)
    assert len(report.chains) == 1 and report.chains[0].pattern == "generic", report.text()
    assert not report.unfused, report.text()

    plan = fuser.plan(module_type(), make(TRACE_T))
    assert not _copies(plan.graph), f"the fused graph copies a view:\n{plan.graph}"
    (kernel,) = plan.kernels
    # the kernel reads the views themselves: no node between x and the kernel makes a copy
    assert all(n.target is operator.getitem for n in kernel.region.inputs), kernel.region.inputs
    # ... and a non-contiguous view gives exactly what its contiguous copy gives
    strided = views(make(16)[0])
    assert not any(v.is_contiguous() for v in strided)
    assert torch.equal(kernel.launch(*strided)[0], kernel.launch(*[v.contiguous() for v in strided])[0])


def test_non_contiguous_module_input():
    """The fused module called with a strided tensor (every other column of a wider one)."""
    module = ScaleAddSigmoid()
    x3, y3 = randn(gen(0), TRACE_T, 48, dtype=BF16), randn(gen(1), TRACE_T, 48, dtype=BF16)
    fuser.apply(module, (x3, y3))
    try:
        wide = randn(gen(2), 16, 96, dtype=BF16)
        x, y = wide[:, ::2], randn(gen(3), 48, 16, dtype=BF16).t()
        assert not x.is_contiguous() and not y.is_contiguous()
        got = fused_call(module, x, y)
    finally:
        fuser.restore(module)
    assert_close(got, eager_call(module, x, y), KERNEL)


# --- what is not fused -------------------------------------------------------------------------
class LoneSigmoid(nn.Module):
    def forward(self, x):
        return x.sigmoid()


class LoneCast(nn.Module):
    def forward(self, x):
        return x.unsqueeze(1).float()  # a free view and one cast


class AroundALinear(nn.Module):
    """One op on each side of a GEMM: neither has a neighbour to share a kernel with (a sigmoid:
    a ReLU would be applied by the GEMM itself, fuser.pipeline.activation_in_gemm)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16, dtype=BF16)

    def forward(self, x):
        return torch.sigmoid(self.proj(x * 2))


@pytest.mark.parametrize(
    "module, ops",
    [(LoneSigmoid, {"sigmoid"}), (LoneCast, {"cast"}), (AroundALinear, {"mul", "sigmoid"})],
    ids=["sigmoid", "cast", "around-linear"],
)
def test_a_single_op_is_not_fused_and_is_reported(module, ops):
    report = fuse_and_compare(module(), lambda T: (randn(gen(T), T, 16, dtype=BF16),))
    assert not report.chains, report.text()
    assert {u.op for u in report.unfused} == ops, report.text()
    assert all(u.reason and u.launches == 1 for u in report.unfused), report.text()
    assert report.launches_after == report.launches_before == len(ops)


# --- casts ------------------------------------------------------------------------------------
def test_a_no_op_cast_does_not_split_a_chain():
    class Chain(nn.Module):
        def forward(self, x, r):
            h = (x * 2 + r).float()  # already fp32: nothing happens here
            return h.exp() + 1

    report = fuse_and_compare(Chain(), lambda T: (randn(gen(T), T, 40), randn(gen(9 + T), T, 40)))
    only_generic_chain(report, "pointwise")


def test_a_bf16_intermediate_feeding_fp32_math_is_fused():
    """exp magnifies any difference in the bf16 rounding of h: the kernel must round as PyTorch."""

    class Chain(nn.Module):
        def forward(self, x, r):
            h = x * 2 + r  # rounded to bf16 here, as in eager
            return h.float().exp() + 1

    report = fuse_and_compare(
        Chain(), lambda T: (randn(gen(T), T, 40, dtype=BF16, scale=2.0), randn(gen(9 + T), T, 40, dtype=BF16))
    )
    only_generic_chain(report, "pointwise")
