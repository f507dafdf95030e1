"""Matching: spellings of the same math match the same pattern; different math never does.

Every spelling variant must give exactly one chain of the expected pattern (covering the whole
chain, with the captured parameters) and a fused output that matches eager at token counts
other than the traced one. Every must-not-match case must leave the pattern out of the fused
chains and, where fuser reports a rejection, file it under the right category.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import (
    assert_claimed,
    assert_close,
    assert_not_claimed,
    describe_exit,
    eager_call,
    fused_call,
    gen,
    randn,
    run_isolated,
)

import fuser
from fuser.validate.tolerance import KERNEL

BF16 = torch.bfloat16
N = 80  # RMSNorm width
I = 24  # noqa: E741  SwiGLU intermediate size (gate_up is [T, 2 * I])
n = 4  # mHC streams: mixes is [T, (2 + n) * n]
TRACE_T = 3
CALL_T = (1, 16)


class Chain(nn.Module):
    """A module whose forward is ``fn(self, x)``, with the given tensors as its parameters."""

    def __init__(self, fn, **params):
        super().__init__()
        self.fn = fn
        for name, value in params.items():
            setattr(self, name, nn.Parameter(value))

    def forward(self, x):
        return self.fn(self, x)


class Chain2(Chain):
    """The same with two tensor inputs."""

    def forward(self, x, y):
        return self.fn(self, x, y)


def chain(fn, n_inputs=1, **params):
    return (Chain if n_inputs == 1 else Chain2)(fn, **params)


def rms_weight(seed=0):
    return randn(gen(seed), N, scale=0.1).add(1.0).to(BF16)


def check_variant(module, make_inputs, pattern_name, params):
    """Exactly one chain of ``pattern_name`` with ``params``; fused == eager at other T."""
    cases = {T: make_inputs(T) for T in CALL_T + (TRACE_T,)}
    expected = {T: eager_call(module, *args) for T, args in cases.items()}
    report = fuser.apply(module, cases[TRACE_T])
    try:
        for T in CALL_T:
            assert_close(fused_call(module, *cases[T]), expected[T], KERNEL, f"fused at T={T}")
    finally:
        fuser.restore(module)
    assert_claimed(report, pattern_name, params=params)
    return report


# --- RMSNorm spellings -------------------------------------------------------------------------
def rms(square, mean, rsqrt, up=lambda x: x.float(), down=lambda y, x: y.to(x.dtype), eps=1e-6):
    """RMSNorm assembled from one spelling of each step."""

    def fn(self, x):
        xf = up(x)
        xf = xf * rsqrt(mean(square(xf)) + eps)
        return down(xf * self.weight, x)

    return fn


POW = lambda xf: xf.pow(2)  # noqa: E731
MEAN = lambda s: s.mean(-1, keepdim=True)  # noqa: E731
RSQRT = torch.rsqrt

RMS_VARIANTS = {
    # the square
    "pow": rms(POW, MEAN, RSQRT),
    "x*x": rms(lambda xf: xf * xf, MEAN, RSQRT),
    "square()": rms(lambda xf: xf.square(), MEAN, RSQRT),
    "torch.square": rms(torch.square, MEAN, RSQRT),
    "x**2": rms(lambda xf: xf**2, MEAN, RSQRT),
    "pow(2.0)": rms(lambda xf: xf.pow(2.0), MEAN, RSQRT),
    # the mean
    "sum/N": rms(POW, lambda s: s.sum(-1, keepdim=True) / N, RSQRT),
    "sum*(1/N)": rms(POW, lambda s: s.sum(-1, keepdim=True) * (1.0 / N), RSQRT),
    "sum/v.shape[-1]": rms(POW, lambda s: s.sum(-1, keepdim=True) / s.shape[-1], RSQRT),
    "torch.mean(dim=-1)": rms(POW, lambda s: torch.mean(s, dim=-1, keepdim=True), RSQRT),
    "mean(dim=1)": rms(POW, lambda s: s.mean(dim=1, keepdim=True), RSQRT),
    # the reciprocal square root
    "rsqrt()": rms(POW, MEAN, lambda v: v.rsqrt()),
    "1/sqrt": rms(POW, MEAN, lambda v: 1 / torch.sqrt(v)),
    "sqrt().reciprocal()": rms(POW, MEAN, lambda v: v.sqrt().reciprocal()),
    "pow(-0.5)": rms(POW, MEAN, lambda v: v.pow(-0.5)),
    # the casts
    "to(float32)": rms(POW, MEAN, RSQRT, up=lambda x: x.to(torch.float32)),
    "to(dtype=float32)": rms(POW, MEAN, RSQRT, up=lambda x: x.to(dtype=torch.float32)),
    "type(float32)": rms(POW, MEAN, RSQRT, up=lambda x: x.type(torch.float32)),
    "to(bfloat16)": rms(POW, MEAN, RSQRT, down=lambda y, x: y.to(torch.bfloat16)),
    "type_as(x)": rms(POW, MEAN, RSQRT, down=lambda y, x: y.type_as(x)),
}


@pytest.mark.parametrize("variant", list(RMS_VARIANTS))
def test_rmsnorm_spelling(variant):
    module = chain(RMS_VARIANTS[variant], weight=rms_weight())
    check_variant(module, lambda T: (randn(gen(T), T, N, dtype=BF16, scale=2.0),), "rmsnorm", {"eps": 1e-6})


def _weight_first(self, x):
    xf = x.float()
    return (self.weight * (torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * xf)).to(x.dtype)


def _eps_first(self, x):
    xf = x.float()
    return (xf * torch.rsqrt(1e-6 + xf.pow(2).mean(-1, keepdim=True)) * self.weight).to(x.dtype)


def _named_steps(self, x):
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + 1e-6)
    hidden = self.weight * hidden
    return hidden.to(x.dtype)


@pytest.mark.parametrize("fn", [_weight_first, _eps_first, _named_steps], ids=lambda f: f.__name__[1:])
def test_rmsnorm_commuted_operands(fn):
    module = chain(fn, weight=rms_weight(1))
    check_variant(module, lambda T: (randn(gen(T), T, N, dtype=BF16, scale=2.0),), "rmsnorm", {"eps": 1e-6})


@pytest.mark.parametrize("eps", [1e-5, 1e-6, 3e-7])
def test_rmsnorm_eps_literal_is_captured(eps):
    module = chain(rms(POW, MEAN, RSQRT, eps=eps), weight=rms_weight(2))
    check_variant(module, lambda T: (randn(gen(T), T, N, dtype=BF16, scale=2.0),), "rmsnorm", {"eps": eps})


def test_rmsnorm_weightless_spelling():
    def fn(self, x):
        xf = x.to(torch.float32)
        return (torch.rsqrt((xf * xf).sum(-1, keepdim=True) / N + 1e-5) * xf).to(x.dtype)

    module = chain(fn)
    check_variant(module, lambda T: (randn(gen(T), T, N, dtype=BF16, scale=2.0),), "rmsnorm_weightless", {"eps": 1e-5})


def test_rmsnorm_weightless_reciprocal_spelling():
    def fn(self, x):
        xf = x.float()
        return (xf * (1.0 / torch.sqrt(xf.square().mean(-1, keepdim=True) + 1e-6))).to(x.dtype)

    module = chain(fn)
    check_variant(module, lambda T: (randn(gen(T), T, N, dtype=BF16, scale=2.0),), "rmsnorm_weightless", {"eps": 1e-6})


@pytest.mark.parametrize("add", ["x + r", "r + x", "torch.add"])
def test_add_rmsnorm_spelling(add):
    adders = {"x + r": lambda x, r: x + r, "r + x": lambda x, r: r + x, "torch.add": torch.add}

    def fn(self, x, r):
        h = adders[add](x, r)
        hf = h.float()
        return (hf * torch.rsqrt(hf.square().mean(-1, keepdim=True) + 1e-6) * self.weight).to(h.dtype), h

    module = chain(fn, n_inputs=2, weight=randn(gen(3), N, scale=0.1).add(1.0).half())
    check_variant(
        module,
        lambda T: (randn(gen(T), T, N, dtype=torch.float16), randn(gen(50 + T), T, N, dtype=torch.float16)),
        "add_rmsnorm",
        {"eps": 1e-6},
    )


def test_rmsnorm_spelling_torch_pow():
    """torch.pow(x, 2) once crashed the interpreter while tracing (SIGSEGV), so a child process
    traces it first; only then is it fused here."""
    probe = run_isolated(
        """
        import torch
        from fuser.trace.tracing import trace

        class Square(torch.nn.Module):
            def forward(self, x):
                return torch.pow(x.float(), 2).mean(-1, keepdim=True)

        trace(Square(), (torch.randn(3, 8, dtype=torch.bfloat16),))
        print("TRACED")
        """
    )
    assert probe.returncode == 0 and "TRACED" in probe.stdout, describe_exit(probe)
    module = chain(rms(lambda xf: torch.pow(xf, 2), MEAN, RSQRT), weight=rms_weight())
    check_variant(module, lambda T: (randn(gen(T), T, N, dtype=BF16, scale=2.0),), "rmsnorm", {"eps": 1e-6})


# --- SwiGLU spellings --------------------------------------------------------------------------
def swiglu(split, silu=lambda gf: F.silu(gf), clamp_gate=None, clamp_up=None, limit=10.0):
    clamp_gate = clamp_gate or (lambda g: torch.clamp(g, max=limit))
    clamp_up = clamp_up or (lambda u: torch.clamp(u, -limit, limit))

    def fn(self, gate_up):
        g, u = split(gate_up)
        g, u = clamp_gate(g), clamp_up(u)
        return (silu(g.float()) * u.float()).to(gate_up.dtype)

    return fn


def _halves(gate_up):
    inter = gate_up.shape[-1] // 2
    return gate_up[..., :inter], gate_up[..., inter:]


SWIGLU_VARIANTS = {
    "slices[...,:I]": swiglu(_halves),
    "slices[:,:I]": swiglu(lambda gu: (gu[:, :I], gu[:, I:])),
    "chunk": swiglu(lambda gu: gu.chunk(2, dim=-1)),
    "torch.chunk": swiglu(lambda gu: torch.chunk(gu, 2, -1)),
    "split": swiglu(lambda gu: gu.split(I, dim=-1)),
    "narrow": swiglu(lambda gu: (gu.narrow(-1, 0, I), gu.narrow(-1, I, I))),
    "g*sigmoid(g)": swiglu(_halves, silu=lambda gf: gf * torch.sigmoid(gf)),
    "sigmoid(g)*g": swiglu(_halves, silu=lambda gf: gf.sigmoid() * gf),
    "F.silu": swiglu(_halves, silu=torch.nn.functional.silu),
    "clamp method": swiglu(
        _halves, clamp_gate=lambda g: g.clamp(max=10.0), clamp_up=lambda u: u.clamp(min=-10.0, max=10.0)
    ),
    "clamp_max/clip": swiglu(
        _halves, clamp_gate=lambda g: torch.clamp_max(g, 10.0), clamp_up=lambda u: u.clip(-10.0, 10.0)
    ),
}


@pytest.mark.parametrize("variant", list(SWIGLU_VARIANTS))
def test_swiglu_spelling(variant):
    module = chain(SWIGLU_VARIANTS[variant])
    check_variant(
        module,
        lambda T: (randn(gen(T), T, 2 * I, dtype=BF16, scale=6.0),),
        "swiglu_clamp",
        {"low": -10.0, "high": 10.0},
    )


# --- Sinkhorn spellings ------------------------------------------------------------------------
def sinkhorn(to_matrix, softmax=lambda c: c.softmax(-1), col_sum=lambda c: c.sum(-2, keepdim=True), eps=1e-6,
             pre_eps=None, iters=20):
    pre_eps = eps if pre_eps is None else pre_eps

    def fn(self, mixes):
        scale, base = self.scale, self.base
        pre = torch.sigmoid(mixes[:, :n] * scale[0] + base[:n]) + pre_eps
        post = 2.0 * torch.sigmoid(mixes[:, n : 2 * n] * scale[1] + base[n : 2 * n])
        c = to_matrix(mixes[:, 2 * n :] * scale[2] + base[2 * n :], mixes)
        c = softmax(c) + eps
        c = c / (col_sum(c) + eps)
        for _ in range(iters - 1):
            c = c / (c.sum(-1, keepdim=True) + eps)
            c = c / (col_sum(c) + eps)
        return pre, post, c

    return fn


def sinkhorn_module(fn, seed=0):
    g = gen(seed)
    return chain(fn, scale=randn(g, 3, scale=0.1).add(1.0), base=randn(g, (2 + n) * n, scale=0.5))


VIEW = lambda c, mixes: c.view(-1, n, n)  # noqa: E731


SINKHORN_VARIANTS = {
    "view(T,n,n)": sinkhorn(lambda c, mixes: c.view(mixes.shape[0], n, n)),
    "view(size(0),n,n)": sinkhorn(lambda c, mixes: c.view(mixes.size(0), n, n)),
    "view(-1,n,n)": sinkhorn(VIEW),
    "reshape(-1,n,n)": sinkhorn(lambda c, mixes: c.reshape(-1, n, n)),
    "unflatten": sinkhorn(lambda c, mixes: c.unflatten(-1, (n, n))),
    "torch.softmax": sinkhorn(VIEW, softmax=lambda c: torch.softmax(c, dim=-1)),
    "F.softmax": sinkhorn(VIEW, softmax=lambda c: F.softmax(c, dim=2)),
    "sum(dim=1)": sinkhorn(VIEW, col_sum=lambda c: c.sum(dim=1, keepdim=True)),
}


@pytest.mark.parametrize(
    "variant",
    list(SINKHORN_VARIANTS) + ["view(c.shape[0],n,n)"],
)
def test_sinkhorn_spelling(variant):
    if variant == "view(c.shape[0],n,n)":
        fn = sinkhorn(lambda c, mixes: c.view(c.shape[0], n, n))
    else:
        fn = SINKHORN_VARIANTS[variant]
    module = sinkhorn_module(fn)
    check_variant(
        module,
        lambda T: (randn(gen(T), T, (2 + n) * n),),
        "mhc_sinkhorn",
        {"eps": 1e-6, "post_scale": 2.0, "iters": 20},
    )


# --- must not match ----------------------------------------------------------------------------
def explain(module, *inputs):
    return fuser.explain(module, inputs)


def x_bf16(T=TRACE_T, width=N):
    return randn(gen(T), T, width, dtype=BF16, scale=2.0)


def test_rmsnorm_cast_to_another_dtype_is_a_dtype_rejection():
    """x is bf16 but the result is cast to fp16: not the pattern's `.to(x.dtype)`."""
    module = chain(rms(POW, MEAN, RSQRT, down=lambda y, x: y.to(torch.float16)), weight=rms_weight())
    report = explain(module, x_bf16())
    rejected = [r for r in report.rejected if r.pattern == "rmsnorm"]
    assert rejected and "float16" in rejected[0].reason, report.text()
    assert_not_claimed(report, "rmsnorm", category="dtype")


def test_rmsnorm_rounding_before_the_weight_is_not_rmsnorm():
    """Llama-style: the normed value is rounded to x's dtype before the weight multiply. Different
    rounding, so not rmsnorm (the unweighted part is the weightless pattern)."""

    def fn(self, x):
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    # fp16: the interpreter rounds fp16 like PyTorch (it truncates bf16), so validation keeps it
    report = explain(chain(fn, weight=rms_weight().half()), x_bf16().half())
    assert_not_claimed(report, "rmsnorm")
    assert_claimed(report, "rmsnorm_weightless", whole=False)


def test_float64_input_is_a_dtype_rejection():
    """The chain's ops are supported, but x is float64, which no pattern declares."""

    def fn(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)

    report = explain(chain(fn), randn(gen(0), TRACE_T, N, dtype=torch.float64))
    rejection = assert_not_claimed(report, "rmsnorm_weightless", category="dtype")
    assert "float64" in rejection.reason


def test_float64_chain_is_left_eager_and_reported():
    module = chain(rms(POW, MEAN, RSQRT), weight=rms_weight().double())
    x = randn(gen(0), TRACE_T, N, dtype=torch.float64)
    expected = eager_call(module, x)
    report = fuser.apply(module, (x,))
    try:
        got = fused_call(module, x)
    finally:
        fuser.restore(module)
    assert not report.chains, report.text()
    assert report.unfused and report.launches_after == report.launches_before
    assert any("float64" in u.reason or "float64" in u.op for u in report.unfused), report.text()
    assert torch.equal(got, expected)


@pytest.mark.parametrize("which", ["post", "comb"])
def test_mhc_post_bf16_gates_are_a_dtype_rejection(which):
    """post and comb must be fp32: in bf16 the products round differently."""

    def fn(self, out, R, post, comb):
        mixed = (comb.unsqueeze(-1) * R.unsqueeze(2)).sum(1)
        return (post.unsqueeze(-1) * out.unsqueeze(1) + mixed).to(out.dtype)

    class Post(nn.Module):
        def forward(self, out, R, post, comb):
            return fn(self, out, R, post, comb)

    g = gen(0)
    post, comb = torch.rand(TRACE_T, n, generator=g), torch.rand(TRACE_T, n, n, generator=g)
    if which == "post":
        post = post.to(BF16)
    else:
        comb = comb.to(BF16)
    inputs = (randn(g, TRACE_T, 64, dtype=BF16), randn(g, TRACE_T, n, 64, dtype=BF16), post, comb)
    rejection = assert_not_claimed(fuser.explain(Post(), inputs), "mhc_post", category="dtype")
    assert which in rejection.reason


def test_sinkhorn_bf16_mixes_is_a_dtype_rejection():
    module = sinkhorn_module(sinkhorn(VIEW))
    report = explain(module, randn(gen(0), TRACE_T, (2 + n) * n, dtype=BF16))
    assert_not_claimed(report, "mhc_sinkhorn", category="dtype")


def _divided_by_root(xf):
    return xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)


NOT_RMSNORM = {
    # x^3 is not a square; no Param stands for the exponent
    "pow(3)": rms(lambda xf: xf.pow(3), MEAN, RSQRT),
    "abs()": rms(lambda xf: xf.abs(), MEAN, RSQRT),
    # rsqrt of a sqrt is a fourth root
    "rsqrt(sqrt(v))": rms(POW, MEAN, lambda v: torch.rsqrt(torch.sqrt(v))),
    "sqrt(v)": rms(POW, MEAN, torch.sqrt),
    # dividing by the root rounds differently from multiplying by rsqrt
    "x / sqrt(v)": lambda self, x: (_divided_by_root(x.float()) * self.weight).to(x.dtype),
    # sum / 32 over 80 values is not a mean
    "sum/32": rms(POW, lambda s: s.sum(-1, keepdim=True) / 32, RSQRT),
    "sum": rms(POW, lambda s: s.sum(-1, keepdim=True), RSQRT),
    "amax": rms(POW, lambda s: s.amax(-1, keepdim=True), RSQRT),
}


@pytest.mark.parametrize("variant", list(NOT_RMSNORM))
def test_different_math_is_not_rmsnorm(variant):
    report = explain(chain(NOT_RMSNORM[variant], weight=rms_weight()), x_bf16())
    assert_not_claimed(report, "rmsnorm")
    assert_not_claimed(report, "rmsnorm_weightless")


def test_eps_multiplied_is_not_rmsnorm():
    def fn(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) * 1e-6) * self.weight).to(x.dtype)

    assert_not_claimed(explain(chain(fn, weight=rms_weight()), x_bf16()), "rmsnorm")


def test_weight_added_is_not_rmsnorm():
    def fn(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) + self.weight).to(x.dtype)

    report = explain(chain(fn, weight=rms_weight()), x_bf16())
    assert_not_claimed(report, "rmsnorm")


def test_sinkhorn_inconsistent_eps_is_a_literal_rejection():
    """eps is one Param: 1e-5 in the pre gate and 1e-6 in the Sinkhorn is not the pattern."""
    module = sinkhorn_module(sinkhorn(VIEW, pre_eps=1e-5, eps=1e-6))
    report = explain(module, randn(gen(0), TRACE_T, (2 + n) * n))
    assert_not_claimed(report, "mhc_sinkhorn", category="literal")


@pytest.mark.parametrize("extra", ["rsqrt factor", "mean square", "fp32 x"])
def test_fan_out_is_rejected(extra):
    """An intermediate used outside the chain: the fused kernel would not produce it."""

    def fn(self, x):
        xf = x.float()
        ms = xf.pow(2).mean(-1, keepdim=True)
        r = torch.rsqrt(ms + 1e-6)
        y = (xf * r * self.weight).to(x.dtype)
        return y, {"rsqrt factor": r, "mean square": ms, "fp32 x": xf}[extra]

    report = explain(chain(fn, weight=rms_weight()), x_bf16())
    rejection = assert_not_claimed(report, "rmsnorm", category="fan-out")
    assert "fan-out" in rejection.reason


def test_reduction_over_another_dim_is_rejected():
    """[T, H, N] with the mean over H (dim -2) instead of N."""

    def fn(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-2, keepdim=True) + 1e-6) * self.weight).to(x.dtype)

    report = explain(chain(fn, weight=rms_weight()), randn(gen(0), TRACE_T, 5, N, dtype=BF16))
    assert_not_claimed(report, "rmsnorm", category="shape")


def test_reduction_over_the_token_dim_is_left_eager():
    """[T, N] with the mean over dim -2, the tokens: no row program can compute it."""

    def fn(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-2, keepdim=True) + 1e-6) * self.weight).to(x.dtype)

    module = chain(fn, weight=rms_weight())
    x = x_bf16()
    expected = eager_call(module, x)
    report = fuser.apply(module, (x,))
    try:
        got = fused_call(module, x)
    finally:
        fuser.restore(module)
    assert_not_claimed(report, "rmsnorm")
    assert not any("mean" in c.nodes for c in report.chains), "a reduction across tokens was fused"
    assert_close(got, expected, KERNEL)


def test_reduction_over_the_token_dim_is_reported_as_such():
    def fn(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-2, keepdim=True) + 1e-6) * self.weight).to(x.dtype)

    report = explain(chain(fn, weight=rms_weight()), x_bf16())
    (mean,) = [u for u in report.unfused if u.node == "mean"]
    assert "token" in f"{mean.op} {mean.reason}", report.text()
    assert "parameters" not in mean.reason, report.text()


class GroupedProjection(nn.Module):
    """DSV4.md C10/C11: a grouped einsum whose result, permuted at T > 1, is flattened for the
    next GEMM: a reshape that copies."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(randn(gen(0), 4, 8, 16, scale=0.25))
        self.out = nn.Linear(32, 16, bias=False)

    def forward(self, x):
        z = torch.einsum("tgd,grd->tgr", x.view(x.shape[0], 4, 16), self.w)
        return self.out(z.reshape(x.shape[0], -1))


def test_a_reshape_that_copies_is_counted_and_made_by_the_copy_kernel():
    module = GroupedProjection()
    x = randn(gen(1), TRACE_T, 64)
    report = fuser.explain(module, (x,))
    assert report.launches_before == 1 and report.launches_after == 1, report.text()
    (copy,) = report.chains
    assert copy.template == "strided_copy" and copy.nodes == ["reshape"], report.text()
    assert not report.unfused


def test_a_reshape_that_views_stays_free():
    module = nn.Sequential(nn.Flatten(), nn.Linear(64, 8))
    report = fuser.explain(module, (randn(gen(1), TRACE_T, 4, 16),))
    assert report.launches_before == 0 and not report.unfused, report.text()
