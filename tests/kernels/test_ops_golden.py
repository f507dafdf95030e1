"""Golden outputs of the ops of the op table (fuser/ir/ops.py) lowered in row programs.

Each case is a small module that uses one op as model code does, after a residual add (one op
alone is not worth a kernel). It is fused with ``fuser.apply`` at T=3 and called at T in {1, 3};
its output must match the eager module (plain PyTorch) within fuser.validate.tolerance.KERNEL for the
output's dtype, and the report must show the op inside a fused chain and nothing left unfused.
Inputs are bfloat16, float16 and float32 at odd widths. A last group checks the fp32 accuracy of
the transcendental ops over a wide range, near 0 and at large |x|, against torch's own.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_close, eager_call, fused_call, gen, randn

import fuser
from fuser.validate.tolerance import KERNEL

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
DTYPES = [pytest.param(BF16, id="bfloat16"), pytest.param(FP16, id="float16"), pytest.param(FP32, id="float32")]
WIDTHS = [6, 42, 123]
TRACE_T = 3
TOKENS = (1, 3)


def fuse_and_compare(module, make_inputs, fused_ops, may_stay=()):
    """Fuse at TRACE_T; the fused module must match eager at every T in TOKENS, and every fx
    node named after one of ``fused_ops`` must be in a fused chain, none left unfused."""
    cases = {T: make_inputs(T) for T in sorted(set(TOKENS) | {TRACE_T})}
    expected = {T: eager_call(module, *args) for T, args in cases.items()}
    report = fuser.apply(module, cases[TRACE_T])
    try:
        for T in TOKENS:
            assert_close(fused_call(module, *cases[T]), expected[T], KERNEL, f"fused at T={T}")
    finally:
        fuser.restore(module)
    assert not [r for r in report.rejected if r.category == "validation"], report.text()
    assert not [u for u in report.unfused if u.op not in may_stay], report.text()
    fused = {n for chain in report.chains for n in chain.nodes}
    for op in fused_ops:
        assert any(n == op or n.startswith(op + "_") for n in fused), f"{op} is not fused:\n{report.text()}"
    return report


def residual(dtype, width, scale=2.0, shape=()):
    """(x, r) of shape [T, *shape, width]."""
    return lambda T: (
        randn(gen(T), T, *shape, width, dtype=dtype, scale=scale),
        randn(gen(100 + T), T, *shape, width, dtype=dtype, scale=scale),
    )


class Residual(nn.Module):
    """``fn(x + r)``: the op after a residual add, as in a decoder block."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, r):
        return self.fn(x + r)


# --- pointwise ----------------------------------------------------------------------------------
def new_gelu(x):  # transformers' NewGELUActivation (ACT2FN["gelu_new"])
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0))))


def fast_gelu(x):  # transformers' FastGELUActivation (ACT2FN["gelu_fast"])
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


POINTWISE = {
    # id: (fn, the fx nodes that must be fused, input scale)
    "F.gelu": (F.gelu, ["gelu"], 3.0),
    "F.gelu(tanh)": (lambda h: F.gelu(h, approximate="tanh"), ["gelu"], 3.0),
    "nn.GELU": (nn.GELU(), ["gelu"], 3.0),
    "nn.GELU(tanh)": (nn.GELU(approximate="tanh"), ["gelu"], 3.0),
    "gelu_new": (new_gelu, ["tanh", "pow"], 3.0),
    "gelu_fast": (fast_gelu, ["tanh"], 3.0),
    "erf": (torch.erf, ["erf"], 2.0),
    "tanh": (torch.tanh, ["tanh"], 3.0),
    "log1p": (lambda h: torch.log1p(h.abs() - 0.5), ["log1p"], 1.0),
    "expm1": (torch.expm1, ["expm1"], 2.0),
    "pow(3)": (lambda h: h.pow(3), ["pow"], 2.0),
    "pow(-3)": (lambda h: (h.abs() + 0.5) ** -3, ["pow"], 1.0),
    "pow(2.5)": (lambda h: torch.pow(h.abs(), 2.5), ["pow"], 2.0),
    "pow(7)": (lambda h: h.pow(7), ["pow"], 1.0),
    "2**h": (lambda h: 2.0**h, ["pow"], 2.0),
    "h**h": (lambda h: h ** torch.floor(h), ["pow"], 2.0),
    "where(tensor)": (lambda h: torch.where(h > 0, h, h * 0.25), ["where"], 2.0),
    "where(scalar)": (lambda h: torch.where(h > 0.5, h, 0.0), ["where"], 2.0),
    "where(scalars)": (lambda h: torch.where(h > 0.5, 1.0, -1.0), ["where"], 2.0),
    "masked_fill": (lambda h: h.masked_fill(h < -1.0, -3.5), ["masked_fill"], 2.0),
    "bool": (lambda h: torch.relu(h).bool(), ["bool"], 2.0),
    "to(bool)": (lambda h: torch.relu(h).to(torch.bool), ["to"], 2.0),
    "bool->float": (lambda h: (h > 0).to(h.dtype) * h, ["to"], 2.0),
    "~": (lambda h: ~(h > 0.5), ["invert"], 2.0),
    "~ &": (lambda h: ~(h > 0.5) & (h > -0.5), ["invert", "and_"], 2.0),
    "leaky_relu": (lambda h: F.leaky_relu(h, 0.2), ["leaky_relu"], 3.0),
    "nn.LeakyReLU": (nn.LeakyReLU(), ["leaky_relu"], 3.0),
    "elu": (F.elu, ["elu"], 3.0),
    "elu(alpha)+1": (lambda h: F.elu(h, 0.5) + 1.0, ["elu"], 3.0),  # linear attention's feature map
    "celu": (lambda h: F.celu(h, 2.0), ["celu"], 3.0),
    "selu": (nn.SELU(), ["selu"], 3.0),
    "hardtanh": (lambda h: F.hardtanh(h, -0.5, 2.0), ["hardtanh"], 3.0),
    "relu6": (nn.ReLU6(), ["hardtanh"], 5.0),  # nn.ReLU6 calls F.hardtanh(x, 0, 6)
    "hardsigmoid": (F.hardsigmoid, ["hardsigmoid"], 5.0),
    "hardswish": (nn.Hardswish(), ["hardswish"], 5.0),
    "mish": (F.mish, ["mish"], 5.0),
    "logsigmoid": (F.logsigmoid, ["log_sigmoid"], 5.0),
    "round": (lambda h: torch.round(h * 8.0), ["round"], 3.0),
    "round(ties)": (lambda h: torch.floor(h * 4.0).mul(0.5).round(), ["round"], 3.0),  # k/2: half to even
    "trunc": (lambda h: torch.trunc(h * 3.0), ["trunc"], 3.0),
    "sign": (lambda h: torch.sign(torch.relu(h) - 0.5) * h, ["sign"], 2.0),
    "neg(0.0) is -0.0": (lambda h: torch.exp(1.0 / -torch.relu(h)), ["neg"], 2.0),  # exp(-inf), not exp(inf)
    "softsign": (F.softsign, ["softsign"], 4.0),
    "tanhshrink": (nn.Tanhshrink(), ["tanhshrink"], 3.0),
    "sinh": (torch.sinh, ["sinh"], 3.0),
    "cosh": (lambda h: torch.cosh(h) - 1.0, ["cosh"], 3.0),
    "hardshrink": (nn.Hardshrink(), ["hardshrink"], 2.0),
    "softshrink": (lambda h: F.softshrink(h, 0.25), ["softshrink"], 2.0),
    "threshold": (lambda h: F.threshold(h, 0.1, -2.0), ["_threshold"], 2.0),
    "copysign": (lambda h: torch.copysign(h, 0.5 - h), ["copysign"], 2.0),
    "copysign(-0.0)": (lambda h: torch.copysign(h + 1.0, -torch.relu(h)), ["copysign"], 2.0),
    "heaviside": (lambda h: torch.heaviside(torch.round(h), h * 0.5), ["heaviside"], 2.0),
    "xlogy": (lambda h: torch.xlogy(torch.round(h), h.abs() + 0.1), ["xlogy"], 2.0),
    "lerp": (lambda h: torch.lerp(h, h * h, 0.3), ["lerp"], 2.0),
    "lerp(tensor weight)": (lambda h: torch.lerp(h, -h - 1.0, torch.sigmoid(h)), ["lerp"], 2.0),
    "addcmul": (lambda h: torch.addcmul(h, h, h + 1.0, value=0.5), ["addcmul"], 2.0),
    "addcdiv": (lambda h: h.addcdiv(h, h.abs() + 1.0, value=-0.5), ["addcdiv"], 2.0),
}
COMPARISONS = {
    "eq": lambda h: torch.relu(h) == 0,
    "ne": lambda h: torch.relu(h) != 0,
    "lt": lambda h: h < 0.25,
    "le": lambda h: h <= 0.25,
    "gt": lambda h: h > -0.25,
    "ge": lambda h: h >= -0.25,
}


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(POINTWISE))
def test_pointwise(case, dtype, width):
    fn, names, scale = POINTWISE[case]
    fuse_and_compare(Residual(fn), residual(dtype, width, scale), names)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(COMPARISONS))
def test_comparison_stores_a_bool(op, dtype, width):
    fuse_and_compare(Residual(COMPARISONS[op]), residual(dtype, width), [op])


@pytest.mark.parametrize("dtype", DTYPES)
def test_transformers_gelu_activations(dtype):
    activations = pytest.importorskip("transformers.activations")
    for name in ("gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh"):
        act = activations.ACT2FN[name]
        fuse_and_compare(Residual(act), residual(dtype, 42, 3.0), [])


# --- reductions and normalizations --------------------------------------------------------------
class Norm(nn.Module):
    def __init__(self, width, dtype, affine=True, bias=True):
        super().__init__()
        self.norm = nn.LayerNorm(width, elementwise_affine=affine, bias=bias, dtype=dtype)
        if affine:
            with torch.no_grad():
                self.norm.weight.copy_(randn(gen(width), width, dtype=dtype, scale=0.5) + 1)
                if bias:
                    self.norm.bias.copy_(randn(gen(width + 1), width, dtype=dtype, scale=0.5))

    def forward(self, x, r):
        return self.norm(x + r)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine, bias", [(True, True), (True, False), (False, False)], ids=["w+b", "w", "plain"])
def test_layer_norm(affine, bias, dtype, width):
    fuse_and_compare(Norm(width, dtype, affine, bias), residual(dtype, width, 3.0), ["layer_norm"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_functional_layer_norm_over_heads(dtype):
    module = Residual(lambda h: F.layer_norm(h, (h.shape[-1],), eps=1e-6))
    fuse_and_compare(module, residual(dtype, 42, 3.0, shape=(3,)), ["layer_norm"])


class TorchRMSNorm(nn.Module):
    """``nn.RMSNorm`` (PyTorch's own module: ``F.rms_norm``) after a residual add."""

    def __init__(self, width, dtype, affine=True, eps=1e-6):
        super().__init__()
        self.norm = nn.RMSNorm(width, eps=eps, elementwise_affine=affine, dtype=dtype)
        if affine:
            with torch.no_grad():
                self.norm.weight.copy_(randn(gen(width), width, dtype=dtype, scale=0.5) + 1)

    def forward(self, x, r):
        return self.norm(x + r)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine, eps", [(True, 1e-6), (True, None), (False, 1e-5)], ids=["w", "w-default-eps", "plain"])
def test_torch_rms_norm(affine, eps, dtype, width):
    fuse_and_compare(TorchRMSNorm(width, dtype, affine, eps), residual(dtype, width, 3.0), ["rms_norm"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_functional_rms_norm_over_heads(dtype):
    module = Residual(lambda h: F.rms_norm(h, (h.shape[-1],)) * 2.0)
    fuse_and_compare(module, residual(dtype, 42, 3.0, shape=(3,)), ["rms_norm"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [130, 4096])
def test_torch_rms_norm_on_the_gpu(width, dtype):
    module = TorchRMSNorm(width, dtype).cuda()
    x, r = (t.cuda() for t in residual(dtype, width, 3.0)(64))
    expected = module(x, r)
    result = fuser.check(module, (x, r))
    assert result.ok, result.problems
    assert result.report.launches_after == 1, result.report.text()
    fuser.apply(module, (x, r))
    try:
        assert_close(module(x, r), expected, KERNEL, "fused on the GPU")
    finally:
        fuser.restore(module)


def test_rms_norm_of_a_weight_in_another_dtype_stays_pytorchs():
    """PyTorch computes ``F.rms_norm`` of a bf16 input and an fp32 weight on another path (the
    normalised input rounded before the weight): not fused, and eager's result comes back."""
    module = TorchRMSNorm(42, torch.float32)
    x, r = residual(torch.bfloat16, 42, 3.0)(5)
    report = fuser.explain(module, (x, r))
    assert "rms_norm" in [u.op for u in report.unfused], report.text()  # (and the add, alone)
    result = fuser.check(module, (x, r))
    assert result.ok, result.problems


REDUCING = {
    "softmax(dtype=fp32)": (lambda h: F.softmax(h, dim=-1, dtype=torch.float32), ["softmax"]),
    "softmax(dtype=input)": (lambda h: torch.softmax(h.float() * 0.5, -1, dtype=h.dtype), ["softmax"]),
    "log_softmax": (lambda h: h.log_softmax(-1), ["log_softmax"]),
    "log_softmax(dtype=fp32)": (lambda h: F.log_softmax(h, -1, dtype=torch.float32), ["log_softmax"]),
    "max(dim)": (lambda h: (torch.max(h, dim=-1).values, torch.max(h, -1)[1]), ["getattr", "getitem"]),
    "max(dim, keepdim)": (lambda h: (h.max(-1, keepdim=True).values * 2, h.max(-1, keepdim=True)[1]), ["getattr", "getitem"]),
    "min(dim).indices": (lambda h: h.min(dim=-1).indices, ["getattr"]),
    "amax": (lambda h: torch.amax(h, -1, keepdim=True), ["amax"]),
    "argmax": (lambda h: h.argmax(-1), ["argmax"]),
    "argmax(keepdim)": (lambda h: torch.argmax(h, dim=-1, keepdim=True), ["argmax"]),
    "logsumexp": (lambda h: torch.logsumexp(h, -1, keepdim=True) - h, ["logsumexp"]),
    "logsumexp(masked)": (lambda h: h.masked_fill(h < 0, float("-inf")).logsumexp(dim=-1) * 2.0, ["logsumexp"]),
    # a LayerNorm written by hand, and the other spellings of var and std
    "var(unbiased=False) norm": (
        lambda h: (h - h.mean(-1, keepdim=True)) * torch.rsqrt(h.var(-1, keepdim=True, unbiased=False) + 1e-5), ["var"]),
    "var": (lambda h: h.var(-1) * 2.0, ["var"]),
    "torch.var(correction=0)": (lambda h: torch.var(h, dim=-1, correction=0, keepdim=True) + h, ["var"]),
    "std": (lambda h: (h - h.mean(-1, keepdim=True)) / (h.std(-1, keepdim=True) + 1e-5), ["std"]),
    # per-token int8 quantisation, dequantised (W8A8's activations; BitNet's absmax)
    "int8 absmax": (lambda h: (lambda s: (h * s).round().clamp(-128, 127) / s)(
        127.0 / h.abs().amax(-1, keepdim=True).clamp(min=1e-5)), ["round", "amax"]),
}


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(REDUCING))
def test_reducing(case, dtype, width):
    fn, names = REDUCING[case]
    fuse_and_compare(Residual(fn), residual(dtype, width, 3.0), names)


class QuantiseInt8(nn.Module):
    """Per-token absmax int8 quantisation (W8A8's activations, before an int8 GEMM)."""

    def __init__(self, low=-128, high=127):
        super().__init__()
        self.low, self.high = low, high

    def forward(self, x, r):
        h = x + r
        scale = h.abs().amax(-1, keepdim=True).clamp(min=1e-5) / 127.0
        return (h / scale).round().clamp(self.low, self.high).to(torch.int8), scale


class DequantiseInt8(nn.Module):
    def forward(self, q, scale, r):
        return q.to(r.dtype) * scale + r


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_quantisation_is_one_kernel_and_exact(dtype, width):
    """The int8 values are eager's exactly (a cast of a value clamped into int8's range), the
    scales within the dtype's tolerance; dequantising them is one kernel too."""
    module = QuantiseInt8()
    cases = {T: residual(dtype, width, 3.0)(T) for T in (1, 3, 16)}
    eager = {T: eager_call(module, *args) for T, args in cases.items()}
    report = fuser.apply(module, cases[3])
    try:
        assert report.launches_after == 1 and not report.unfused, report.text()
        for T, (x, r) in cases.items():
            expected = eager[T]
            q, scale = fused_call(module, x, r)
            assert q.dtype == torch.int8 and torch.equal(q, expected[0]), f"T={T}"
            assert_close(scale, expected[1], KERNEL, f"scale at T={T}")
    finally:
        fuser.restore(module)
    x, r = cases[16]
    q, scale = QuantiseInt8()(x, r)
    fuse_and_compare(DequantiseInt8(), lambda T: (q[:T], scale[:T], r[:T]), ["to", "mul", "add"])


def test_a_cast_to_int8_of_a_value_not_clamped_into_its_range_stays_pytorchs():
    """Out of int8's range PyTorch's own cast differs between devices: a kernel does not take it."""
    x, r = residual(torch.float32, 42, 3.0)(5)
    report = fuser.explain(QuantiseInt8(-200, 200), (x, r))
    assert [u.op for u in report.unfused] == ["cast"], report.text()
    result = fuser.check(QuantiseInt8(-200, 200), (x, r))
    assert result.ok, result.problems


class MaskedSoftmax(nn.Module):
    """Attention-style: masked positions to -inf, then softmax in fp32."""

    def forward(self, scores, keep):
        return (scores * 0.125).masked_fill(~keep, float("-inf")).softmax(-1, dtype=torch.float32)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_fill_with_a_mask_input_then_softmax(dtype, width):
    def make(T):
        keep = torch.rand(T, width, generator=gen(T)) > 0.3
        keep[:, 0] = True  # every row keeps one position
        return randn(gen(T), T, width, dtype=dtype, scale=4.0), keep

    fuse_and_compare(MaskedSoftmax(), make, ["masked_fill", "softmax"])


# --- layout and constants -----------------------------------------------------------------------
def spread(mask):
    """Each column of ``mask`` repeated 4 times: a reshape of an expanded view, which copies."""
    return mask.unsqueeze(-1).expand(-1, mask.shape[-1], 4).reshape(mask.shape[0], -1) + 0.5


def interleaved(h):
    """[..., 2 * width]: h and 3 * h - 1, column by column (an even width whatever h's is)."""
    return torch.stack([h, h * 3 - 1], dim=-1).flatten(-2)


LAYOUT = {
    # id: (fn, fx nodes, extra non-token dims of the input)
    "stack(-1)": (lambda h: torch.stack([h, h * 2, -h], dim=-1), ["stack"], ()),
    "stack(-2)": (lambda h: torch.stack((h * 0.5, h), -2), ["stack"], ()),
    "stack(heads)": (lambda h: torch.stack([h, h.exp()], dim=1), ["stack"], (2,)),
    "repeat_interleave(-1)": (lambda h: h.repeat_interleave(3, dim=-1) * 2, ["repeat_interleave"], ()),
    "repeat_interleave(heads)": (lambda h: torch.repeat_interleave(h, 2, dim=1) + 1, ["repeat_interleave"], (3,)),
    # GPT-OSS's interleaved gate and up (gate_up[..., ::2], gate_up[..., 1::2]) of an even width
    "every other column": (lambda h: (lambda g: g[..., ::2].clamp(max=1.0) * (g[..., 1::2] + 1))(interleaved(h)),
                           ["getitem", "clamp"], ()),  # fmt: skip
    "every other column (heads)": (lambda h: (lambda g: g[..., 1::2] - g[..., ::2])(interleaved(h)), ["getitem"], (3,)),
    # DeepSeek-V3's group mask: zeros_like(scores).scatter_(1, top-k, 1), spread over each group
    "scatter_ of the top-k": (lambda h: torch.zeros_like(h).scatter_(1, torch.topk(h, 3, dim=-1, sorted=False)[1], 1) * h,
                              ["scatter", "topk"], ()),  # fmt: skip
    "scatter_ spread by a copying reshape": (lambda h: spread(torch.zeros_like(h).scatter_(-1, h.argmax(-1, keepdim=True), 1.0)),
                                             ["scatter", "reshape"], ()),  # fmt: skip
    # PhiMoE's sparsemixer: the top expert masked out with -inf before the second's softmax
    "scatter of -inf": (lambda h: h.scatter(-1, h.argmax(-1, keepdim=True), float("-inf")).softmax(-1),
                        ["scatter", "softmax"], ()),  # fmt: skip
    "zeros_like read": (lambda h: torch.where(h > 0, h, torch.zeros_like(h)), ["zeros_like"], ()),
    "ones_like read": (lambda h: h * torch.ones_like(h) - 1, ["ones_like"], ()),
    "full_like read": (lambda h: torch.maximum(h, torch.full_like(h, -0.5)), ["full_like"], ()),
    "full read": (lambda h: h + torch.full((h.shape[0], h.shape[-1]), 0.75, dtype=h.dtype), ["full"], ()),
    "zeros_like written": (lambda h: (h * 2, torch.zeros_like(h)), ["zeros_like"], ()),
    "new_ones written": (lambda h: (h * 2, h.new_ones(h.shape)), ["new_ones"], ()),
    "new_full written": (lambda h: (h * 2, h.new_full(h.shape, 3.25)), ["new_full"], ()),
}


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(LAYOUT))
def test_layout_and_constants(case, dtype, width):
    fn, names, shape = LAYOUT[case]
    fuse_and_compare(Residual(fn), residual(dtype, width, shape=shape), names)


class InterleavedGateUp(nn.Module):
    """GPT-OSS's experts' activation (transformers' ``GptOssExperts._apply_gate``): gate and up
    interleaved column by column in a GEMM's output, the expert's bias gathered per row."""

    def __init__(self, experts: int, width: int, dtype):
        super().__init__()
        self.bias = nn.Parameter(randn(gen(width), experts, 2 * width, dtype=dtype, scale=0.5))

    def forward(self, gate_up, expert_ids):
        gate_up = gate_up + self.bias[expert_ids]
        gate, up = gate_up[..., ::2].clamp(max=7.0), gate_up[..., 1::2].clamp(-7.0, 7.0)
        return (up + 1) * (gate * torch.sigmoid(gate * 1.702))


@pytest.mark.parametrize("width", [37, 1100], ids=["one-tile", "two-tiles"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_other_column_of_an_input_is_read_a_tile_twice_as_wide(dtype, width):
    """The result's columns are split across programs; each reads the source's columns twice
    as wide (``tile2``), and the bias rows gathered by id the same way."""
    module = InterleavedGateUp(5, width, dtype)
    report = fuse_and_compare(
        module, lambda T: (randn(gen(T), T, 2 * width, dtype=dtype, scale=4.0), torch.arange(T) % 5), ["getitem", "sigmoid"]
    )
    (chain,) = report.chains
    source = open(chain.path).read()
    assert "tile2 = " in source and "BLOCK_TILE: tl.constexpr" in source, source


class WrittenIntoNewEmpty(nn.Module):
    def forward(self, x, r):
        out = x.new_empty(x.shape)
        out[:, :] = (x + r) * 2 + 1
        return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_new_empty_is_an_allocation_not_a_kernel(dtype):
    """An ``empty`` only written into launches nothing: it is neither fused nor reported."""
    report = fuse_and_compare(WrittenIntoNewEmpty(), residual(dtype, 42), ["add", "mul"], may_stay=("setitem",))
    assert report.launches_before == 4, report.text()  # add, mul, add and the write


# --- fp32 accuracy of the transcendental ops ----------------------------------------------------
def wide_range() -> torch.Tensor:
    """Magnitudes from 1e-30 to 1e4 (both signs), 0, and values around the switch points."""
    magnitudes = torch.logspace(-30, 4, 4001)
    edges = torch.tensor([0.0, 0.25, 0.2499, 0.2501, 1.0, 9.0, 10.0, 20.0, 44.0, 88.0, 89.0])
    values = torch.cat([magnitudes, -magnitudes, edges, -edges])
    return values.reshape(1, -1)


ACCURACY = {
    # id: (fn, domain of the inputs, rtol, atol against torch in fp32); gelu's 1 + erf(x) (or
    # 1 + tanh) cancels for x << 0 in torch's formula too: there only an absolute bound holds.
    "tanh": (torch.tanh, lambda v: v, 2e-6, 1e-37),
    "expm1": (torch.expm1, lambda v: v.clamp(max=80.0), 2e-6, 1e-37),
    "log1p": (torch.log1p, lambda v: v.clamp(min=-0.999), 2e-6, 1e-37),
    "erf": (torch.erf, lambda v: v, 2e-6, 1e-37),
    "gelu": (F.gelu, lambda v: v, 2e-6, 1e-6),
    "gelu(tanh)": (lambda v: F.gelu(v, approximate="tanh"), lambda v: v, 2e-6, 1e-6),
}


@pytest.mark.parametrize("case", list(ACCURACY))
def test_fp32_accuracy_over_a_wide_range(case):
    """Relative error near 0 too (no absolute slack): 1 - e^x or log(1 + x) written plainly
    loses every digit there."""
    fn, domain, rtol, atol = ACCURACY[case]
    values = domain(wide_range())
    module = Residual(fn)
    x, r = values.repeat(3, 1), torch.zeros_like(values).repeat(3, 1)
    expected = eager_call(module, x, r)
    fuser.apply(module, (x, r))
    try:
        got = fused_call(module, x, r)
    finally:
        fuser.restore(module)
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, equal_nan=True)


class TopK(nn.Module):
    """``torch.topk`` of a residual sum, its values scaled and its indices returned."""

    def __init__(self, k: int, largest: bool):
        super().__init__()
        self.k, self.largest = k, largest

    def forward(self, x, r):
        values, indices = torch.topk(x + r, self.k, dim=-1, largest=self.largest)
        return values * 2, indices


def with_specials(dtype, width):
    """Residual inputs whose sums hold NaN, +-inf, both zeros and repeated values."""

    def make(T):
        x, r = residual(dtype, width)(T)
        x[:, 0], r[:, 0] = float("nan"), 0.0
        x[:, width // 2], r[:, width // 2] = float("inf"), 1.0
        x[:, 1], r[:, 1] = float("-inf"), -1.0
        x[:, 2], r[:, 2] = -0.0, -0.0  # -0.0
        x[:, 3], r[:, 3] = 0.0, 0.0
        x[:, width - 1], r[:, width - 1] = x[:, 4], r[:, 4]  # a tie with column 4
        if T > 1:
            x[1, 5], r[1, 5] = float("nan"), 0.0  # two NaNs in one row
        return x, r

    return make


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("largest", [True, False], ids=["largest", "smallest"])
def test_topk_orders_nan_infinities_zeros_and_ties_as_torch(largest, dtype, width):
    """Values exactly torch.topk's (NaN ranked above +inf, smallest-first too); the indices
    point at those values, once each, and are torch's wherever the value is not repeated (torch
    orders equal values either way)."""
    k = min(width, 6)
    module = TopK(k, largest)
    make = with_specials(dtype, width)
    cases = {T: make(T) for T in (1, 3)}
    expected = {T: eager_call(module, *args) for T, args in cases.items()}
    report = fuser.apply(module, cases[3])
    try:
        got = {T: fused_call(module, *args) for T, args in cases.items()}
    finally:
        fuser.restore(module)
    assert any(n.startswith("topk") for chain in report.chains for n in chain.nodes), report.text()
    for T, (x, r) in cases.items():
        (values, indices), (want_values, want_indices) = got[T], expected[T]
        torch.testing.assert_close(values, want_values, rtol=0, atol=0, equal_nan=True)
        picked = (x + r).gather(-1, indices) * 2
        torch.testing.assert_close(picked, want_values, rtol=0, atol=0, equal_nan=True)
        assert all(len(set(row.tolist())) == k for row in indices), indices
        sums = x + r
        unique = (sums.unsqueeze(-1) == sums.gather(-1, want_indices).unsqueeze(-2)).sum(-2) == 1
        assert torch.equal(indices[unique], want_indices[unique]), (indices, want_indices)
