"""fuser.pipeline.upcast_in_gemm: a matmul of two half tensors, each cast to fp32 for it (GPT-J's
attention scores), runs as the half GEMM with an fp32 output — no cast of the key cache. On the
CPU the rewritten call casts as eager does (no ``out_dtype`` kernel there), so these tests check
the rewrite and its results; the GPU test checks the one kernel."""

import copy

import pytest
import torch
import torch.nn as nn

import fuser
from fuser.pipeline.upcast_in_gemm import matmul_upcast
from fuser.tools.bench import launched_kernels
from fuser.validate.tolerance import LAYER, mismatch
from tests.model.test_decode import PROMPT, STEPS, greedy, prefilled, step
from tests.model.test_model import causal_lm

B, H, T, S, D = 3, 4, 5, 11, 16


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


class Scores(nn.Module):
    """Attention scores as GPT-J computes them: both operands cast to fp32, the keys transposed."""

    def __init__(self, query_kernel=False):
        super().__init__()
        self.query_kernel = query_kernel

    def forward(self, q, k):
        if self.query_kernel:
            q = q * 2.0  # glue before the cast: the cast ends a kernel
        scores = torch.matmul(q.to(torch.float32), k.to(torch.float32).transpose(-1, -2))
        return torch.softmax(scores, dim=-1)


def inputs(dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, 1, D, generator=g).to(dtype), torch.randn(T, H, S, D, generator=g).to(dtype)


@pytest.mark.parametrize("query_kernel", [False, True], ids=["cast", "kernel_output"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_casts_of_a_half_matmul_go(query_kernel, dtype):
    module = Scores(query_kernel)
    q, k = inputs(dtype)
    expected = module(q, k)
    report = fuser.apply(module, (q, k))
    assert len(report.upcasts_in_gemm) == 1, report.text()
    assert ("cast back" in report.upcasts_in_gemm[0]) == query_kernel
    assert "run as the half GEMM with an fp32 output" in report.text()
    for seed in (1, 2):
        q, k = inputs(dtype, seed)
        got = module(q, k)
        assert got.dtype == torch.float32
        assert mismatch(got, Scores.forward(module, q, k), "scores", LAYER) is None
    assert mismatch(module(*inputs(dtype)), expected, "scores", LAYER) is None


class KeyReadTwice(nn.Module):
    def forward(self, q, k):
        k32 = k.to(torch.float32)
        return torch.matmul(q.to(torch.float32), k32.transpose(-1, -2)).sum(-1) + k32.sum((-1, -2)).unsqueeze(-1)


class MixedHalves(nn.Module):
    def forward(self, q, k):
        return torch.softmax(torch.matmul(q.to(torch.float32), k.to(torch.float32).transpose(-1, -2)), -1)


class OneCast(nn.Module):
    def forward(self, q, k):
        return torch.softmax(torch.matmul(q.to(torch.float32), k.transpose(-1, -2)), -1)


@pytest.mark.parametrize("make,args,why", [
    (KeyReadTwice, inputs(), "would copy more than the casts it saves"),
    (OneCast, (inputs()[0], inputs(torch.float32)[1]), "one operand is not a half tensor cast to fp32 for the matmul alone"),
    (MixedHalves, (inputs()[0], inputs(torch.float16)[1]), "not one half dtype"),
], ids=["cast_read_elsewhere", "fp32_keys", "bf16_and_fp16"])  # fmt: skip
def test_where_the_result_could_differ_the_casts_stay_with_the_reason(make, args, why):
    module = make()
    expected = module(*args)
    report = fuser.apply(module, args)
    assert report.upcasts_in_gemm == [] and len(report.upcasts_apart) == 1, report.text()
    assert why in next(iter(report.upcasts_apart.values()))
    assert mismatch(module(*args), expected, "output", LAYER) is None


def test_fp32_operands_are_left_as_they_are():
    module = Scores()
    q, k = inputs(torch.float32)
    report = fuser.apply(module, (q, k))
    assert report.upcasts_in_gemm == [] and report.upcasts_apart == {}


@pytest.mark.parametrize("a_shape,b_shape", [((T, H, 1, D), (T, H, D, S)), ((1, H, T, D), (B, 1, D, S)), ((T, D), (D, S))])
def test_matmul_upcast_is_the_fp32_matmul_of_the_half_operands(a_shape, b_shape):
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(a_shape, generator=g).bfloat16(), torch.randn(b_shape, generator=g).bfloat16()
    assert torch.equal(matmul_upcast(a, b), torch.matmul(a.float(), b.float()))


def test_gpt_j_s_bf16_decode_casts_no_key_cache():
    """transformers' GPT-J as shipped, in bf16: its scores' matmul takes the key cache as it is
    (the query, cast at the end of the rotary kernel, cast back), and greedy decode gives
    eager's logits at every step."""
    model = causal_lm("gptj", layers=2).to(torch.bfloat16)
    cache, tokens = prefilled(model)
    eager_model = copy.deepcopy(model)
    report = fuser.apply(model, (), example_kwargs=step(tokens, PROMPT, copy.deepcopy(cache)))
    (group,) = report.groups
    assert len(group.report.upcasts_in_gemm) == 1 and "cast back" in group.report.upcasts_in_gemm[0], group.report.text()
    fused, eager = greedy(model, copy.deepcopy(cache), tokens), greedy(eager_model, copy.deepcopy(cache), tokens)
    assert len(fused) == STEPS
    for i, (got, expected) in enumerate(zip(fused, eager)):
        assert mismatch(got, expected, f"logits at step {i}", LAYER) is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_on_the_gpu_the_scores_are_one_gemm_with_no_cast(dtype):
    """A 352-key cache of 16 heads of 256 at 32 sequences (GPT-J at batch 32): one GEMM (cuBLAS
    may clear its workspace with a memset first), no cast kernel, and the fp32 matmul's result
    to fp32 accuracy (the products are exact)."""
    q = torch.randn(32, 16, 1, 256, device="cuda").to(dtype)
    k = torch.randn(32, 16, 352, 256, device="cuda").to(dtype)
    kernels = [n for n in launched_kernels(lambda: matmul_upcast(q, k.transpose(-1, -2))) if not n.startswith("Memset")]
    assert len(kernels) == 1 and not any(w in n.lower() for n in kernels for w in ("copy", "cast", "elementwise")), kernels
    got = matmul_upcast(q, k.transpose(-1, -2))
    expected = torch.matmul(q.double(), k.double().transpose(-1, -2))
    torch.testing.assert_close(got.double(), expected, atol=1e-3, rtol=1e-5)
    module = Scores().cuda()
    report = fuser.apply(module, (q, k))
    assert len(report.upcasts_in_gemm) == 1, report.text()
    assert mismatch(module(q, k), Scores.forward(module, q, k), "scores", LAYER) is None
