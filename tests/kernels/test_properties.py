"""Property tests: a fused module agrees with eager for any token count (0, 1, odd, large),
on contiguous, strided and offset inputs, with NaN and Inf propagated exactly as eager does.

Each configuration is fused once (fuser's trace serves every token count); hypothesis then
varies the inputs it is called with.
"""

import functools

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fuser
from fuser.validate.tolerance import mismatch

N = 40  # not a power of two: the kernels mask the padded lanes


class Glue(nn.Module):
    """An RMSNorm (a pattern) feeding a pointwise chain no pattern claims (the fallback): the two
    are merged into one kernel."""

    def __init__(self, dtype):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(N, generator=torch.Generator().manual_seed(0)).to(dtype))

    def forward(self, x):
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight).to(x.dtype)
        return (torch.sigmoid(normed.float() * 0.5) * x.float() + 1.0).to(x.dtype)


@functools.lru_cache(maxsize=None)
def fused_glue(dtype):
    module = Glue(dtype)
    report = fuser.apply(module, (torch.randn(3, N).to(dtype),))
    assert [c.pattern for c in report.chains] == ["rmsnorm+generic"], report.text()  # merged: one kernel
    return module


def eager(module, x):
    """The module's own forward, bypassing fuser."""
    return type(module).forward(module, x)


@st.composite
def inputs(draw, dtype):
    tokens = draw(st.sampled_from([0, 1, 2, 3, 7, 16, 33, 64]))
    layout = draw(st.sampled_from(["contiguous", "strided", "offset"]))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    if layout == "contiguous":
        x = torch.randn(tokens, N, generator=gen)
    elif layout == "strided":  # every other column of a wider tensor
        x = torch.randn(tokens, 2 * N, generator=gen)[:, ::2]
    else:  # a view starting one row and one column in
        x = torch.randn(tokens + 1, N + 1, generator=gen)[1:, 1:]
    x = x.to(dtype)
    specials = draw(st.lists(st.sampled_from([float("nan"), float("inf"), float("-inf")]), max_size=3))
    for value in specials:
        if tokens:
            x[draw(st.integers(0, tokens - 1)), draw(st.integers(0, N - 1))] = value
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fused_matches_eager_on_any_input(dtype, data):
    module = fused_glue(dtype)
    x = data.draw(inputs(dtype))
    expected = eager(module, x)
    got = module(x)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert torch.equal(got.isnan(), expected.isnan()), "NaN positions differ"
    assert torch.equal(got.isinf(), expected.isinf()), "Inf positions differ"
    finite = expected.isfinite()
    assert mismatch(got[finite], expected[finite], "output") is None


def test_fused_path_runs_for_strided_inputs_and_not_for_empty_ones():
    module = fused_glue(torch.float32)
    guard = module._fuser_state.guard
    assert guard.why_not((torch.randn(5, 2 * N)[:, ::2],), {}) is None
    assert "no tokens" in guard.why_not((torch.randn(0, N),), {})


def test_concurrent_apply_on_two_models_shares_the_kernel_cache_safely():
    """Two threads fuse two models at once: both fused correctly, kernels written once, and
    the process-wide hooks tracing installs are all removed afterwards."""
    import builtins
    import threading

    isinstance_before, setattr_before = builtins.isinstance, nn.Module.__setattr__
    modules = [Glue(torch.float32), Glue(torch.float32)]
    x = torch.randn(4, N)
    reports, errors = [None, None], []

    def work(i):
        try:
            reports[i] = fuser.apply(modules[i], (x,))
        except Exception as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert builtins.isinstance is isinstance_before and nn.Module.__setattr__ is setattr_before
    assert [c.kernel for c in reports[0].chains] == [c.kernel for c in reports[1].chains]
    for module in modules:
        assert fuser.is_fused(module)
        assert mismatch(module(x), eager(module, x), "output") is None
