"""Golden outputs for every pattern in patterns/, and for the chains fuser lowers without one.

Every pattern file first gets the generic golden cases of :mod:`fuser.testing` (its reference
fused with it, at every declared dtype and at odd widths). The tests below then fuse the chain
as model code spells it, with inputs chosen for the pattern (values beyond a clamp limit, an
eps that matters, NaN and inf).

Each test builds a small module whose forward spells the chain the way model code does (weights
as parameters of the module), fuses it with ``fuser.apply`` traced at one token count, and
compares the fused module at T in {1, 3, 16} with the pattern's plain-PyTorch ``reference``
(which the eager module reproduces bit for bit). It then checks that the report shows the chain
fused by that pattern, with the expected template and captured parameters.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import (
    assert_claimed,
    assert_close,
    chains,
    eager_call,
    fused_call,
    gen,
    pattern,
    randn,
)

import fuser
import fuser.testing
import fuser.validate.tolerance
from fuser.pattern import patterns_dir
from fuser.testing import golden_tests

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

#: dtype -> (rtol, atol) for one fused chain against its eager ops (fuser.validate.tolerance.KERNEL).
KERNEL_TOLERANCE = {
    torch.float32: (1e-4, 1e-5),
    torch.float16: (2e-3, 1e-3),
    torch.bfloat16: (2**-6, 1e-2),
    torch.float8_e4m3fn: (2**-3, 2**-9),
}

TRACE_T = fuser.testing.TRACE_T  # the token count fuser traces at
TOKENS = fuser.testing.TOKENS  # token counts the fused module is called at

DTYPES = [pytest.param(BF16, id="bfloat16"), pytest.param(FP16, id="float16"), pytest.param(FP32, id="float32")]


#: where golden() runs: the CPU (Triton's interpreter) in CI; tests whose outputs come from
#: golden() also get a "cuda" variant, marked gpu, for compiled kernels (``pytest -m gpu``).
DEVICE = ["cpu"]


def pytest_generate_tests(metafunc):
    uses_golden = "golden(" in inspect.getsource(metafunc.function)
    devices = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if uses_golden else [])
    metafunc.parametrize("device", devices)


@pytest.fixture(autouse=True)
def _golden_device(device):
    if device == "cuda":
        assert torch.cuda.is_available(), "the cuda golden tests need a CUDA device (pytest -m gpu)"
    DEVICE[0] = device
    yield
    DEVICE[0] = "cpu"


def test_tolerance_table_is_fusers():
    assert KERNEL_TOLERANCE == fuser.validate.tolerance.KERNEL


#: every pattern file, and the test here that holds its golden outputs
GOLDEN_TESTS = {
    "rmsnorm": "test_rmsnorm",
    "rmsnorm_weightless": "test_rmsnorm_weightless",
    "add_rmsnorm": "test_add_rmsnorm",
    "swiglu_clamp": "test_swiglu_clamp",
    "mhc_post": "test_mhc_post",
    "mhc_sinkhorn": "test_mhc_sinkhorn",
    "mhc_sinkhorn_rms": "test_mhc_sinkhorn_rms",
    "expert_sort": "test_expert_sort.py::test_kernel_matches_a_stable_sort_and_histc",  # integer ids: its own file
    "expert_sort_rows": "test_expert_sort.py::test_rows_kernel_matches_the_sort_and_the_gather",
}


PATTERN_FILES = sorted(p for p in patterns_dir().glob("*.py") if not p.name.startswith("_"))

# Each pattern file's own golden cases: test_<pattern>_golden[<dtypes>-<width>].
for _file in PATTERN_FILES:
    globals()[f"test_{_file.stem}_golden"] = golden_tests(_file)


def _golden_test(name: str):
    """The test ``name`` names: one of this file's, or ``file.py::test`` in another test file."""
    if "::" not in name:
        return globals().get(name)
    file, test = name.split("::")
    return getattr(importlib.import_module(file.removesuffix(".py")), test, None)


def test_every_pattern_has_golden_outputs():
    files = {p.stem for p in PATTERN_FILES}
    assert files == set(GOLDEN_TESTS), "patterns/ and the golden tests here disagree"
    assert all(callable(_golden_test(test)) for test in GOLDEN_TESTS.values())
    assert all(callable(globals().get(f"test_{name}_golden")) for name in files)


# --- modules as model code writes them ---------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, n, dtype, eps=1e-6, seed=0):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(randn(gen(seed), n, scale=0.1).add(1.0).to(dtype))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight).to(x.dtype)


class WeightlessRMSNorm(nn.Module):
    def __init__(self, eps=1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class AddRMSNorm(nn.Module):
    def __init__(self, n, dtype, eps=1e-6, seed=0):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(randn(gen(seed), n, scale=0.1).add(1.0).to(dtype))

    def forward(self, x, residual):
        h = x + residual
        hf = h.float()
        hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (hf * self.weight).to(h.dtype), h


class SwiGLUClamp(nn.Module):
    def __init__(self, limit=10.0, low=None):
        super().__init__()
        self.high = limit
        self.low = -limit if low is None else low

    def forward(self, gate_up):
        inter = gate_up.shape[-1] // 2
        g = torch.clamp(gate_up[..., :inter], max=self.high)
        u = torch.clamp(gate_up[..., inter:], self.low, self.high)
        return (F.silu(g.float()) * u.float()).to(gate_up.dtype)


class MHCPost(nn.Module):
    def forward(self, out, R, post, comb):
        mixed = (comb.unsqueeze(-1) * R.unsqueeze(2)).sum(1)
        return (post.unsqueeze(-1) * out.unsqueeze(1) + mixed).to(out.dtype)


class MHCSinkhorn(nn.Module):
    def __init__(self, n=4, eps=1e-6, post_scale=2.0, iters=20, seed=0):
        super().__init__()
        self.n, self.eps, self.post_scale, self.iters = n, eps, post_scale, iters
        g = gen(seed)
        self.scale = nn.Parameter(randn(g, 3, scale=0.1).add(1.0))  # fp32
        self.base = nn.Parameter(randn(g, (2 + n) * n, scale=0.5))  # fp32

    def forward(self, mixes):
        return self.split_and_sinkhorn(mixes)

    def split_and_sinkhorn(self, mixes):
        n, eps, scale, base = self.n, self.eps, self.scale, self.base
        pre = torch.sigmoid(mixes[:, :n] * scale[0] + base[:n]) + eps
        post = self.post_scale * torch.sigmoid(mixes[:, n : 2 * n] * scale[1] + base[n : 2 * n])
        comb = (mixes[:, 2 * n :] * scale[2] + base[2 * n :]).view(-1, n, n)
        comb = comb.softmax(-1) + eps
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + eps)
            comb = comb / (comb.sum(-2, keepdim=True) + eps)
        return pre, post, comb


class MHCSinkhornRMS(MHCSinkhorn):
    """The mix GEMM's output scaled by the per-token 1/RMS, then the same block."""

    def forward(self, mix, rms):
        return self.split_and_sinkhorn(mix * rms)


# --- the golden check --------------------------------------------------------------------------
def assert_identical(actual, expected, what="eager"):
    if isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected)
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_identical(a, e, f"{what}[{i}]")
        return
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    assert torch.equal(actual, expected), f"{what}: the module does not compute the pattern's reference"


def golden(name, module, make_inputs, reference, *, template, params=None, tokens=TOKENS):
    """Fuse ``module`` at TRACE_T; at every T in ``tokens`` the fused output must match
    ``reference(inputs)`` within KERNEL_TOLERANCE; then the report must show ``name`` fusing
    the whole chain (one of the names, where ``name`` is a tuple). Returns the report."""
    device = torch.device(DEVICE[0])
    module.to(device)
    cases = {T: tuple(a.to(device) for a in make_inputs(T)) for T in sorted(set(tokens) | {TRACE_T})}
    expected = {T: reference(*args) for T, args in cases.items()}
    for T, args in cases.items():
        assert_identical(eager_call(module, *args), expected[T], f"eager at T={T}")
    report = fuser.apply(module, cases[TRACE_T])
    try:
        for T in tokens:
            assert_close(fused_call(module, *cases[T]), expected[T], KERNEL_TOLERANCE, f"fused at T={T}")
    finally:
        fuser.restore(module)
    if isinstance(name, tuple):
        name = next((n for n in name if chains(report, n)), name[0])
    assert_claimed(report, name, template=template, params=params)
    return report


# --- rmsnorm -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [7, 64, 123, 256])
def test_rmsnorm(N, dtype):
    ref = pattern("rmsnorm").reference
    module = RMSNorm(N, dtype, seed=N)
    golden(
        "rmsnorm", module,
        lambda T: (randn(gen(T), T, N, dtype=dtype, scale=2.0),),
        lambda x: ref(x, module.weight.detach(), eps=1e-6),
        template="row_reduce", params={"eps": 1e-6},
    )  # fmt: skip


@pytest.mark.parametrize("weight_dtype", [FP32, FP16])
def test_rmsnorm_bf16_with_other_weight_dtypes(weight_dtype):
    """The pattern takes bf16, fp16 and fp32 weights: the product promotes, math unchanged."""
    ref = pattern("rmsnorm").reference
    module = RMSNorm(64, weight_dtype, seed=1)
    golden(
        "rmsnorm", module,
        lambda T: (randn(gen(T), T, 64, dtype=BF16, scale=2.0),),
        lambda x: ref(x, module.weight.detach(), eps=1e-6),
        template="row_reduce", params={"eps": 1e-6},
    )  # fmt: skip


def test_rmsnorm_captures_eps():
    """eps=1e-5 in the model is captured as the parameter and used by the kernel: with rows of
    mean square ~1e-6 the result depends on eps far beyond the tolerance."""
    ref = pattern("rmsnorm").reference
    module = RMSNorm(64, BF16, eps=1e-5, seed=2)
    make = lambda T: (randn(gen(T), T, 64, dtype=BF16, scale=1e-3),)  # noqa: E731
    golden(
        "rmsnorm", module, make,
        lambda x: ref(x, module.weight.detach(), eps=1e-5),
        template="row_reduce", params={"eps": 1e-5},
    )  # fmt: skip
    x = make(16)[0].to(module.weight.device)  # golden() moved the module to the test device
    with_default = ref(x, module.weight.detach(), eps=1e-6).float()
    with_model = ref(x, module.weight.detach(), eps=1e-5).float()
    assert (with_default - with_model).abs().max() > 0.1, "inputs too large for eps to matter"


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_nan_and_inf_follow_eager(dtype):
    """A non-finite value spoils its own row exactly as in eager (inf -> rsqrt(inf) = 0 -> the
    inf becomes NaN, the rest 0; NaN -> the whole row NaN); other rows are untouched."""
    N = 64
    module = RMSNorm(N, dtype, seed=3)
    clean = randn(gen(7), 6, N, dtype=dtype, scale=2.0)
    x = clean.clone()
    x[1, 3] = float("inf")
    x[2, 5] = float("nan")
    x[3, 0] = float("-inf")
    x[4, :] = 0.0  # 0 * rsqrt(eps): zeros
    x[5, 9] = torch.finfo(dtype).max / 2  # its square overflows fp32 in bf16/fp32
    expected = eager_call(module, x)
    expected_clean = eager_call(module, clean)
    report = fuser.apply(module, (randn(gen(1), TRACE_T, N, dtype=dtype),))
    try:
        got = fused_call(module, x)
        got_clean = fused_call(module, clean)
    finally:
        fuser.restore(module)
    assert torch.equal(got.isnan(), expected.isnan()), f"NaN pattern differs:\n{got}\n{expected}"
    assert torch.equal(got.isinf(), expected.isinf()), "inf pattern differs"
    assert torch.equal(got[got.isinf()], expected[expected.isinf()]), "sign of inf differs"
    assert expected[1].isnan().sum() == 1 and expected[2].isnan().all()  # what eager does
    assert_close(got, expected, KERNEL_TOLERANCE)
    assert torch.equal(got[0], got_clean[0]), "a clean row changed because of another row"
    assert_close(got_clean, expected_clean, KERNEL_TOLERANCE)
    assert_claimed(report, "rmsnorm", template="row_reduce")


# --- rmsnorm_weightless ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [7, 64, 123, 256])
def test_rmsnorm_weightless(N, dtype):
    ref = pattern("rmsnorm_weightless").reference
    golden(
        "rmsnorm_weightless", WeightlessRMSNorm(),
        lambda T: (randn(gen(T), T, N, dtype=dtype, scale=2.0),),
        lambda x: ref(x, eps=1e-6),
        template="row_reduce", params={"eps": 1e-6},
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=str)
def test_rmsnorm_weightless_per_head(dtype):
    """x [T, heads, N]: the pattern's '...' dims; each head normalised on its own."""
    ref = pattern("rmsnorm_weightless").reference
    golden(
        "rmsnorm_weightless", WeightlessRMSNorm(eps=1e-5),
        lambda T: (randn(gen(T), T, 3, 40, dtype=dtype, scale=2.0),),
        lambda x: ref(x, eps=1e-5),
        template="row_reduce", params={"eps": 1e-5},
    )  # fmt: skip


# --- add_rmsnorm -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [7, 64, 123, 256])
def test_add_rmsnorm(N, dtype):
    ref = pattern("add_rmsnorm").reference
    module = AddRMSNorm(N, dtype, seed=N)
    golden(
        "add_rmsnorm", module,
        lambda T: (randn(gen(T), T, N, dtype=dtype, scale=2.0), randn(gen(100 + T), T, N, dtype=dtype)),
        lambda x, r: ref(x, r, module.weight.detach(), eps=1e-6),
        template="row_reduce", params={"eps": 1e-6},
    )  # fmt: skip


def test_add_rmsnorm_captures_eps():
    ref = pattern("add_rmsnorm").reference
    module = AddRMSNorm(48, FP16, eps=1e-5, seed=4)
    golden(
        "add_rmsnorm", module,
        lambda T: (randn(gen(T), T, 48, dtype=FP16, scale=1e-3), randn(gen(9 + T), T, 48, dtype=FP16, scale=1e-3)),
        lambda x, r: ref(x, r, module.weight.detach(), eps=1e-5),
        template="row_reduce", params={"eps": 1e-5},
    )  # fmt: skip


# --- swiglu_clamp ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES[:2] + [pytest.param(FP32, id="float32")])
@pytest.mark.parametrize("I2", [14, 64, 246])
def test_swiglu_clamp(I2, dtype):
    ref = pattern("swiglu_clamp").reference
    golden(
        "swiglu_clamp", SwiGLUClamp(limit=10.0),
        lambda T: (randn(gen(T), T, I2, dtype=dtype, scale=6.0),),  # some values beyond the limit
        lambda gate_up: ref(gate_up, low=-10.0, high=10.0),
        template="pointwise", params={"low": -10.0, "high": 10.0},
    )  # fmt: skip


@pytest.mark.parametrize("low, high", [(-7.0, 7.0), (-5.0, 7.0)])
def test_swiglu_clamp_captures_limits(low, high):
    ref = pattern("swiglu_clamp").reference
    golden(
        "swiglu_clamp", SwiGLUClamp(limit=high, low=low),
        lambda T: (randn(gen(T), T, 64, dtype=BF16, scale=6.0),),
        lambda gate_up: ref(gate_up, low=low, high=high),
        template="pointwise", params={"low": low, "high": high},
    )  # fmt: skip


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_swiglu_clamp_nan_and_inf_follow_eager():
    I = 32  # noqa: E741
    module = SwiGLUClamp()
    clean = randn(gen(5), 4, 2 * I, dtype=BF16, scale=6.0)
    x = clean.clone()
    x[1, 2] = float("nan")  # gate: silu(NaN)
    x[1, I + 5] = float("nan")  # up: clamp keeps NaN
    x[2, 0] = float("-inf")  # gate: silu(-inf) = -inf * 0 = NaN in eager
    x[2, I + 1] = float("inf")  # up: clamped to the limit
    x[3, 4] = float("inf")  # gate: clamped to the limit
    expected = eager_call(module, x)
    report = fuser.apply(module, (randn(gen(1), TRACE_T, 2 * I, dtype=BF16),))
    try:
        got = fused_call(module, x)
        got_clean = fused_call(module, clean)
    finally:
        fuser.restore(module)
    assert_claimed(report, "swiglu_clamp")
    assert torch.equal(got.isnan(), expected.isnan()), f"NaN pattern differs:\n{got}\n{expected}"
    assert torch.equal(got.isinf(), expected.isinf()), "inf pattern differs"
    assert_close(got, expected, KERNEL_TOLERANCE)
    assert torch.equal(got[0], got_clean[0]), "a clean row changed because of another row"


# --- mhc_post ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [7, 64, 123, 256])
def test_mhc_post(H, dtype):
    ref = pattern("mhc_post").reference
    n = 4

    def make(T):
        g = gen(T)
        out = randn(g, T, H, dtype=dtype)
        R = randn(g, T, n, H, dtype=dtype)
        post = torch.rand(T, n, generator=g) * 2  # fp32
        comb = torch.rand(T, n, n, generator=g).softmax(-2)  # fp32, columns sum to one
        return out, R, post, comb

    golden("mhc_post", MHCPost(), make, ref, template="row_reduce", params={})


# --- mhc_sinkhorn ------------------------------------------------------------------------------
def _sinkhorn_golden(module):
    ref = pattern("mhc_sinkhorn").reference
    n = module.n
    return golden(
        "mhc_sinkhorn", module,
        lambda T: (randn(gen(T), T, (2 + n) * n),),
        lambda mixes: ref(
            mixes, module.scale.detach(), module.base.detach(),
            eps=module.eps, post_scale=module.post_scale, iters=module.iters,
        ),
        template="sinkhorn",
        params={"eps": module.eps, "post_scale": module.post_scale, "iters": module.iters},
    )  # fmt: skip


def test_mhc_sinkhorn():
    _sinkhorn_golden(MHCSinkhorn())


def test_mhc_sinkhorn_captures_eps_and_post_scale():
    _sinkhorn_golden(MHCSinkhorn(eps=1e-5, post_scale=3.0, seed=1))


def test_mhc_sinkhorn_finds_iteration_count():
    _sinkhorn_golden(MHCSinkhorn(iters=7, seed=2))


@pytest.mark.parametrize("iters", [20, 7])
def test_mhc_sinkhorn_rms(iters):
    ref = pattern("mhc_sinkhorn_rms").reference
    module = MHCSinkhornRMS(iters=iters, seed=4)
    golden(
        "mhc_sinkhorn_rms", module,
        lambda T: (randn(gen(T), T, 24, scale=4.0), torch.rand(T, 1, generator=gen(60 + T)) + 0.1),
        lambda mix, rms: ref(
            mix, rms, module.scale.detach(), module.base.detach(),
            eps=module.eps, post_scale=module.post_scale, iters=module.iters,
        ),
        template="sinkhorn",
        params={"eps": module.eps, "post_scale": module.post_scale, "iters": module.iters},
    )  # fmt: skip


def test_mhc_sinkhorn_fused_comb_is_doubly_stochastic():
    """The fused comb ends on a column normalisation: columns sum to one, rows nearly so."""
    module = MHCSinkhorn(seed=3)
    fuser.apply(module, (randn(gen(0), TRACE_T, 24),))
    try:
        _, _, comb = fused_call(module, randn(gen(1), 16, 24))
    finally:
        fuser.restore(module)
    torch.testing.assert_close(comb.sum(-2), torch.ones(16, 4), rtol=0, atol=1e-5)
    torch.testing.assert_close(comb.sum(-1), torch.ones(16, 4), rtol=0, atol=1e-3)


# --- chains no pattern claims: the generic lowering --------------------------------------------
# Golden outputs for what fuser lowers from the graph itself: slices of computed values, top-k
# with the gather that follows it, products summed over a short axis, kernels merged with the
# kernel that feeds them or that reads the same activation, and results written in place.


def norm_rope_tail(x, freqs, rope):
    """Weight-free per-head RMSNorm rounded to x's dtype, then interleaved RoPE on the last
    ``rope`` columns (DSV4.md C4): slices of a computed value, reassembled with cat."""
    xf = x.float()
    x = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    nope = x.shape[-1] - rope
    tail = torch.view_as_complex(x[..., nope:].float().unflatten(-1, (-1, 2)))
    return torch.cat([x[..., :nope], torch.view_as_real(tail * freqs).flatten(-2).to(x.dtype)], dim=-1)


class NormRope(nn.Module):
    def __init__(self, rope):
        super().__init__()
        self.rope = rope

    def forward(self, x, freqs):
        return norm_rope_tail(x, freqs, self.rope)


def rope_freqs(T, rope, seed):
    angles = randn(gen(seed), T, 1, rope // 2, scale=3.0)
    return torch.polar(torch.ones_like(angles), angles)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim,rope", [(3, 48, 16), (4, 64, 64), (64, 512, 64)])
def test_norm_then_rope_on_a_slice_is_one_kernel(heads, head_dim, rope, dtype):
    """The norm (a pattern) and the RoPE on its last columns (generic), merged: the slices of the
    normed value are taken in registers."""
    golden(
        "rmsnorm_weightless+generic", NormRope(rope),
        lambda T: (randn(gen(T), T, heads, head_dim, dtype=dtype, scale=2.0), rope_freqs(T, rope, T + 1)),
        lambda x, f: norm_rope_tail(x, f, rope),
        template="row_reduce", params={"rmsnorm_weightless.eps": 1e-6},
    )  # fmt: skip


def unaligned_slices(x):
    """Columns 5:13 and 3:40 of a computed value: slices no register reshape can pick."""
    y = torch.sigmoid(x.float()) * 2
    return (y[..., 5:13].sum(-1, keepdim=True) + y[..., 3:40].amax(-1, keepdim=True)).to(x.dtype)


class UnalignedSlices(nn.Module):
    def forward(self, x):
        return unaligned_slices(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_unaligned_slices_of_a_computed_value(dtype):
    golden(
        "generic", UnalignedSlices(),
        lambda T: (randn(gen(T), T, 41, dtype=dtype),),
        unaligned_slices, template="row_reduce",
    )  # fmt: skip


def biased_topk(logits, bias, k, largest):
    """DSV4.md G2: sqrt-softplus scores, top-k of the biased scores, gather of the un-biased
    ones, renormalised."""
    scores = torch.sqrt(F.softplus(logits))
    ids = torch.topk(scores + bias, k, dim=-1, largest=largest, sorted=True).indices
    weights = scores.gather(1, ids)
    return ids, weights / (weights.sum(-1, keepdim=True) + 1e-20)


class BiasedTopK(nn.Module):
    def __init__(self, experts, k, largest=True, sorted=True):
        super().__init__()
        self.k, self.largest, self.sorted = k, largest, sorted
        self.bias = nn.Parameter(randn(gen(experts), experts, scale=0.1))

    def forward(self, logits):
        scores = torch.sqrt(F.softplus(logits))
        ids = torch.topk(scores + self.bias, self.k, dim=-1, largest=self.largest, sorted=self.sorted).indices
        weights = scores.gather(1, ids)
        return ids, weights / (weights.sum(-1, keepdim=True) + 1e-20)


@pytest.mark.parametrize("experts,k,largest", [(256, 6, True), (40, 3, True), (37, 8, False)])
def test_gate_topk_gather_renormalise_is_one_kernel(experts, k, largest):
    module = BiasedTopK(experts, k, largest)
    golden(
        "generic", module,
        lambda T: (randn(gen(T), T, experts, scale=2.0),),
        lambda x: biased_topk(x, module.bias.detach(), k, largest),
        template="row_reduce",
    )  # fmt: skip


def test_unsorted_topk_is_checked_as_a_set():
    """topk(sorted=False) leaves the order of the picks to the implementation: fuser validates
    the kernel (and this test compares it) per row in the order of the ids."""
    module = BiasedTopK(256, 6, sorted=False)
    x = randn(gen(3), 3, 256, scale=2.0)
    expected_ids, expected_w = eager_call(module, x)
    report = fuser.apply(module, (x,))
    try:
        assert_claimed(report, "generic", template="row_reduce")
        for T in TOKENS:
            x = randn(gen(T), T, 256, scale=2.0)
            ids, w = fused_call(module, x)
            want_ids, want_w = biased_topk(x, module.bias.detach(), 6, True)
            order, want_order = ids.argsort(-1), want_ids.argsort(-1)
            assert torch.equal(ids.take_along_dim(order, -1), want_ids.take_along_dim(want_order, -1))
            assert_close(w.take_along_dim(order, -1), want_w.take_along_dim(want_order, -1), KERNEL_TOLERANCE)
    finally:
        fuser.restore(module)


def stream_mix_norm(comb, R):
    """The mHC post's mix of the streams, then an RMS over the whole mixed row: one program per
    row, where the [n, n, H] product is summed over its first axis without being built."""
    mixed = (comb.unsqueeze(-1) * R.float().unsqueeze(2)).sum(1)  # [T, n, H]
    flat = mixed.flatten(1)
    return (flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + 1e-6)).to(R.dtype)


class StreamMixNorm(nn.Module):
    def forward(self, comb, R):
        return stream_mix_norm(comb, R)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [256, 1024])  # a [4, 4, H] product of 4096 elements, and of 16384
def test_a_large_product_summed_over_streams(H, dtype):
    """The mix (generic) and the norm after it (a pattern), merged into one row program; the
    cast after the norm joins it as the op after it, or as a lone op's kernel merged in where a
    lone-op table (this GPU's) fuses a lone cast."""
    golden(
        ("generic+rmsnorm_weightless", "generic+rmsnorm_weightless+generic"), StreamMixNorm(),
        lambda T: (randn(gen(T), T, 4, 4).softmax(-1), randn(gen(T + 1), T, 4, H, dtype=dtype)),
        stream_mix_norm, template="row_reduce", params={"rmsnorm_weightless.eps": 1e-6},
    )  # fmt: skip


class TwoNormsOfOneProjection(nn.Module):
    """q_norm and kv_norm of one fused projection (DSV4.md C1/C2): two norms that read slices of
    the same activation run as one kernel."""

    def __init__(self, q, kv, dtype):
        super().__init__()
        self.q = q
        self.proj = nn.Linear(32, q + kv, bias=False, dtype=dtype)
        self.q_norm, self.kv_norm = RMSNorm(q, dtype, seed=1), RMSNorm(kv, dtype, seed=2)

    def forward(self, x):
        qkv = self.proj(x)
        return self.q_norm(qkv[:, : self.q]), self.kv_norm(qkv[:, self.q :])


@pytest.mark.parametrize("dtype", DTYPES)
def test_two_norms_reading_one_activation_are_one_kernel(dtype):
    module = TwoNormsOfOneProjection(48, 24, dtype)
    with torch.no_grad():
        module.proj.weight.copy_(randn(gen(0), 72, 32, scale=0.2))

    def reference(x):
        qkv = F.linear(x, module.proj.weight.detach())
        ref = pattern("rmsnorm").reference
        return ref(qkv[:, :48], module.q_norm.weight.detach()), ref(qkv[:, 48:], module.kv_norm.weight.detach())

    golden(
        "rmsnorm+rmsnorm", module, lambda T: (randn(gen(T), T, 32, dtype=dtype),), reference,
        template="row_reduce", params={"rmsnorm.eps": 1e-6},
    )  # fmt: skip


class InverseRopeInPlace(nn.Module):
    """DSV4.md C9: the attention output's RoPE columns rotated back in place."""

    def __init__(self, dim, rope, dtype):
        super().__init__()
        self.rope = rope
        self.proj = nn.Linear(dim, dim, bias=False, dtype=dtype)

    def forward(self, x, freqs):
        o = self.proj(x)
        tail = torch.view_as_complex(o[..., -self.rope :].float().unflatten(-1, (-1, 2)))
        o[..., -self.rope :] = torch.view_as_real(tail * freqs.conj()).flatten(-2).to(o.dtype)
        return o


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim,rope", [(40, 8), (512, 64)])
def test_a_result_copied_into_a_slice_is_written_there(dim, rope, dtype):
    """``o[..., -r:] = f(o[..., -r:])``: the kernel writes into o itself; no copy is left."""
    module = InverseRopeInPlace(dim, rope, dtype)
    with torch.no_grad():
        module.proj.weight.copy_(randn(gen(dim), dim, dim, scale=dim**-0.5))

    def reference(x, freqs):
        o = F.linear(x, module.proj.weight.detach())
        tail = torch.view_as_complex(o[..., -rope:].float().unflatten(-1, (-1, 2)))
        return torch.cat([o[..., :-rope], torch.view_as_real(tail * freqs.conj()).flatten(-2).to(o.dtype)], -1)

    report = golden(
        "generic", module,
        lambda T: (randn(gen(T), T, dim, dtype=dtype), rope_freqs(T, rope, T)[:, 0]),
        reference, template="pointwise",
    )  # fmt: skip
    (chain,) = report.chains
    assert "setitem" in chain.nodes, report.text()


class AddThenNorm(nn.Module):
    """A decoder layer's residual add and the RMSNorm after it; both results are read after it."""

    def __init__(self, dim, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x, residual):
        h = x + residual
        hf = h.float()
        return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype) * self.weight, h


def the_plan(module, inputs):
    import fuser.pipeline.fuse_module

    plan = fuser.pipeline.fuse_module.plan(module, inputs, validate=False)
    (kernel,) = plan.kernels
    return plan, kernel


def test_a_result_the_kernel_allocates_is_stored_where_it_is_computed():
    """The residual sum is stored before the norm's reduction, so it holds no registers through it."""
    _, kernel = the_plan(AddThenNorm(48, torch.bfloat16), (randn(gen(0), 3, 48, dtype=torch.bfloat16),) * 2)
    body = kernel.spec.program.body
    stores = [i for i, line in enumerate(body) if line.startswith("tl.store(")]
    (reduction,) = [i for i, line in enumerate(body) if "tl.sum(" in line]
    assert len(stores) == 2 and stores[0] < reduction < stores[1], "\n".join(body)


@pytest.mark.parametrize("output", [0, 1])
def test_a_result_written_into_a_callers_buffer_is_stored_last(output):
    """Written into a caller's buffer (which the kernel may also read), either result of the add
    + norm is stored after the rest of the body, the residual sum too."""
    from fuser.lower.lowerer import lower_region

    plan, kernel = the_plan(AddThenNorm(48, torch.bfloat16), (randn(gen(0), 3, 48, dtype=torch.bfloat16),) * 2)
    region = kernel.region
    program = lower_region(plan.traced, plan.cops, region.nodes, region.inputs, region.outputs, {region.outputs[output]})
    body = program.body
    assert body[-1].startswith(f"tl.store({program.outputs[output].name}_ptr"), "\n".join(body)


def kv_norm_rope_fp8(kv, weight, freqs, rope, block):
    """DSV4.md C5: kv_norm in fp32 (not rounded), RoPE on the last ``rope`` dims rounded to bf16,
    the rest quantised to FP8 e4m3 with one UE8M0 scale per ``block`` values."""
    from examples.dsv4.layer import apply_rope, quantize_fp8, rms_scale

    kf = kv.float()
    kn = kf * rms_scale(kf, 1e-6) * weight
    nope = kv.shape[-1] - rope
    k_nope, k_scale = quantize_fp8(kn[..., :nope], block)
    return apply_rope(kn[..., nope:], freqs).to(torch.bfloat16), k_nope, k_scale


class KVNormRopeFP8(nn.Module):
    def __init__(self, dim, rope, block, seed=0):
        super().__init__()
        self.rope, self.block = rope, block
        self.weight = nn.Parameter(randn(gen(seed), dim, scale=0.1).add(1.0).to(BF16))

    def forward(self, kv, freqs):
        return kv_norm_rope_fp8(kv, self.weight, freqs, self.rope, self.block)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim,rope,block", [(48, 8, 8), (512, 64, 64)])  # 5 and 7 scales per key
def test_kv_norm_rope_and_fp8_cache_quantisation_are_one_kernel(dim, rope, block, dtype):
    module = KVNormRopeFP8(dim, rope, block)
    # On fp32 input (.float() a no-op) the norm is spelled as the rmsnorm pattern: it merges in.
    golden(
        "rmsnorm+generic+generic" if dtype == FP32 else "generic", module,
        lambda T: (randn(gen(T), T, dim, dtype=dtype, scale=3.0), rope_freqs(T, rope, T)[:, 0]),
        lambda kv, f: kv_norm_rope_fp8(kv, module.weight.detach(), f, rope, block),
        template="row_reduce",
    )  # fmt: skip


def neox_rope(q, cos, sin):
    """GPT-NeoX / Llama RoPE: q * cos + rotate_half(q) * sin, where rotate_half concatenates
    the negated second half with the first: a concatenation that further math reads."""
    half = q.shape[-1] // 2
    rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
    return q * cos + rotated * sin


class NeoxRope(nn.Module):
    def forward(self, q, cos, sin):
        return neox_rope(q, cos, sin)


def rotate_mix(x):
    """Three uneven parts concatenated, then scaled: no halves to interleave."""
    y = x.float() * 2
    return (torch.cat([y[..., 5:8], y[..., :5], y[..., 8:]], dim=-1) * torch.sigmoid(y)).to(x.dtype)


class RotateMix(nn.Module):
    def forward(self, x):
        return rotate_mix(x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim", [(3, 16), (8, 128)])
def test_rotate_half_rope_is_one_kernel(heads, head_dim, dtype):
    def make(T):
        angles = randn(gen(T + 7), T, 1, head_dim // 2, scale=3.0)
        cos, sin = (torch.cat([f(angles)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
        return randn(gen(T), T, heads, head_dim, dtype=dtype), cos, sin

    golden("generic", NeoxRope(), make, neox_rope, template="pointwise")


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_concatenation_of_uneven_parts_read_by_more_math(dtype):
    golden("generic", RotateMix(), lambda T: (randn(gen(T), T, 2, 21, dtype=dtype),), rotate_mix, template="pointwise")


def softmax_in_fp32(logits):
    return logits.softmax(-1, dtype=torch.float32).mul(2.0)


class SoftmaxInFp32(nn.Module):
    def forward(self, logits):
        return softmax_in_fp32(logits)


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_softmax_with_an_fp32_dtype(dtype):
    golden("generic", SoftmaxInFp32(), lambda T: (randn(gen(T), T, 37, dtype=dtype, scale=3.0),), softmax_in_fp32, template="row_reduce")


class RoutedInput(nn.Module):
    """Llama-4's routed-expert input as transformers writes it: every expert's copy of the
    tokens, block by block (row e·T + t), each row times that token's score for that expert."""

    def forward(self, hidden, scores):
        routed = hidden.repeat(scores.shape[1], 1)
        return routed * scores.transpose(0, 1).reshape(-1, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("E,H", [(2, 64), (3, 100), (16, 96)])
def test_rows_repeated_per_expert_times_their_scores_are_one_kernel(E, H, dtype):
    """The repeat and the product over [E·T, H] rows run as one kernel over [E, T, H]."""

    def reference(hidden, scores):  # each expert's block: the tokens times that expert's scores
        return torch.cat([hidden * scores[:, e : e + 1] for e in range(E)])

    golden(
        "generic", RoutedInput(),
        lambda T: (randn(gen(T), T, H, dtype=dtype), randn(gen(T + 1), T, E, dtype=dtype).sigmoid()),
        reference, template="pointwise",
    )  # fmt: skip


def test_a_chain_that_writes_nothing_is_not_lowered():
    """A region whose values nothing reads (a state updated after its last read) has no kernel
    to make: lowering refuses it, and its ops stay eager."""
    from fuser.lower.code import LoweringError
    from fuser.lower.lowerer import lower_region

    plan, kernel = the_plan(AddThenNorm(48, torch.bfloat16), (randn(gen(0), 3, 48, dtype=torch.bfloat16),) * 2)
    region = kernel.region
    with pytest.raises(LoweringError, match="writes nothing"):
        lower_region(plan.traced, plan.cops, region.nodes, region.inputs, [])


def test_a_block_larger_than_triton_takes_is_not_lowered():
    """Blocks a program must hold whole (normalised over two axes, so not tiled): [16, 64, 512]
    (2^19 elements) lowers; [64, 64, 512] (2^21: as Kimi-Linear's chunked recurrence makes) is
    refused at lowering, not left to fail in Triton."""
    from fuser.lower.lowerer import TRITON_MAX_NUMEL

    class Outer(nn.Module):
        def forward(self, a, b):
            p = torch.exp(a.unsqueeze(-1) * b.unsqueeze(-2))
            return p / p.sum(dim=(1, 3), keepdim=True)

    fits = fuser.explain(Outer(), (torch.randn(2, 16, 64), torch.randn(2, 16, 512)))
    assert fits.chains and not fits.unfused, fits.text()
    report = fuser.explain(Outer(), (torch.randn(2, 64, 64), torch.randn(2, 64, 512)))
    assert not report.chains and not report.rejected, report.text()
    assert all(f"Triton takes at most {TRITON_MAX_NUMEL}" in u.reason for u in report.unfused), report.text()
