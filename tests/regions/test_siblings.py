"""Siblings of one input: the two LayerNorms of a parallel residual (GPT-NeoX: ``attn(ln1(x))`` and
``mlp(ln2(x))`` both read ``x``), each a lone op fused by fuser.regions.lone_ops, run as one
kernel with two outputs (fuser.regions.growth.siblings, the ``merge`` pass) — on transformers'
GPTNeoXLayer as transformers ships it and on a hand-written block — and the result matches eager."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fuser
from fuser.install.splice import STATE_ATTR
from fuser.regions import lone_ops
from fuser.regions.lone_ops import TABLE_ENV
from tests.helpers import gen, randn

D, T = 48, 5
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: dtype -> (rtol, atol) of the block's output: a residual sum of two GEMMs of the norms
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2**-6, 6e-2), torch.float16: (4e-3, 6e-3)}


@pytest.fixture(autouse=True)
def no_table(monkeypatch):
    """The default decides (this machine's GPU, if any, has a table of its own)."""
    monkeypatch.delenv(TABLE_ENV, raising=False)
    monkeypatch.setattr(lone_ops, "current_gpu", lambda: None)


class ParallelResidual(nn.Module):
    """A parallel residual block as GPT-NeoX and GPT-J write it: both branches read ``x``."""

    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.ln1, self.ln2 = nn.LayerNorm(D, dtype=dtype), nn.LayerNorm(D, dtype=dtype)
        with torch.no_grad():
            for ln in (self.ln1, self.ln2):
                ln.weight.copy_(1.0 + 0.2 * torch.randn(D))
                ln.bias.copy_(0.2 * torch.randn(D))
        self.attn = nn.Linear(D, D, dtype=dtype)
        self.up, self.down = nn.Linear(D, 2 * D, dtype=dtype), nn.Linear(2 * D, D, dtype=dtype)

    def forward(self, x):
        a = self.attn(self.ln1(x))
        m = self.down(F.gelu(self.up(self.ln2(x))))
        return x + a + m


def fused_run(module, args, kwargs=None, **options):
    """(report, fused output, eager output); the fused forward must take the call."""
    kwargs = kwargs or {}
    with torch.no_grad():
        expected = module(*args, **kwargs)
    report = fuser.apply(module, args, example_kwargs=kwargs or None, **options)
    try:
        why_not = module.__dict__[STATE_ATTR].guard.why_not(args, kwargs)
        assert why_not is None, f"the fused forward would not run: {why_not}"
        with torch.no_grad():
            got = module(*args, **kwargs)
    finally:
        fuser.restore(module)
    return report, got, expected


def chains_with(report, *nodes):
    return [c for c in report.chains if any(n in c.nodes for n in nodes)]


def assert_close(got, expected, dtype):
    got, expected = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected)
    assert len(got) == len(expected)
    rtol, atol = TOLERANCE[dtype]
    for a, e in zip(got, expected):
        if isinstance(e, torch.Tensor):
            assert a.dtype == e.dtype and a.shape == e.shape
            torch.testing.assert_close(a.float(), e.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_two_norms_of_a_parallel_residual_are_one_kernel(dtype):
    module = ParallelResidual(dtype)
    report, got, expected = fused_run(module, (randn(gen(2), T, D, dtype=dtype, scale=2.0),))
    (chain,) = chains_with(report, "layer_norm", "layer_norm_1")
    assert {"layer_norm", "layer_norm_1"} <= set(chain.nodes), report.text()
    assert len(chain.outputs) == 2  # the attention branch's input and the MLP's
    assert chain.note.startswith("alone: fused by default (layer_norm, width 48")
    assert_close(got, expected, dtype)


def test_without_the_merge_pass_they_are_two_kernels():
    module = ParallelResidual(torch.float32)
    report, got, expected = fused_run(module, (randn(gen(2), T, D, scale=2.0),), disable_passes=("merge",))
    assert len(chains_with(report, "layer_norm", "layer_norm_1")) == 2
    assert_close(got, expected, torch.float32)


def gpt_neox_layer(dtype):
    """transformers' GPTNeoXLayer (tiny, parallel residual) and its call at T tokens."""
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXLayer, GPTNeoXRotaryEmbedding

    config = GPTNeoXConfig(hidden_size=D, num_attention_heads=4, intermediate_size=2 * D, num_hidden_layers=1,
                           use_parallel_residual=True, vocab_size=64, rotary_pct=0.5)  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = GPTNeoXLayer(config, 0).eval().to(dtype)
    with torch.no_grad():
        for ln in (layer.input_layernorm, layer.post_attention_layernorm):
            ln.weight.copy_(1.0 + 0.2 * torch.randn(D))
            ln.bias.copy_(0.2 * torch.randn(D))
    x = randn(gen(3), 1, T, D, dtype=dtype)
    cos, sin = GPTNeoXRotaryEmbedding(config)(x, torch.arange(T)[None])
    return layer, (x,), {"position_embeddings": (cos.to(dtype), sin.to(dtype))}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpt_neox_s_parallel_residual_norms_are_one_kernel(dtype):
    layer, args, kwargs = gpt_neox_layer(dtype)
    assert layer.use_parallel_residual
    report, got, expected = fused_run(layer, args, kwargs)
    (chain,) = chains_with(report, "layer_norm", "layer_norm_1")
    assert {"layer_norm", "layer_norm_1"} <= set(chain.nodes), report.text()
    assert "input_layernorm" in chain.where
    assert_close(got, expected, dtype)


class TwoActivations(nn.Module):
    """Two lone elementwise ops of one GEMM's result, each feeding a GEMM of its own: each alone
    is left to PyTorch by default, together they are one kernel (one launch instead of two)."""

    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(D, D, dtype=dtype)
        self.left, self.right = nn.Linear(D, 8, dtype=dtype), nn.Linear(D, 8, dtype=dtype)

    def forward(self, x):
        h = self.up(x)
        return self.left(F.gelu(h)), self.right(torch.sigmoid(h))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lone_ops_left_to_pytorch_that_read_one_activation_are_one_kernel(dtype):
    module = TwoActivations(dtype)
    report, got, expected = fused_run(module, (randn(gen(5), T, D, dtype=dtype, scale=2.0),))
    (chain,) = chains_with(report, "gelu", "sigmoid")
    assert {"gelu", "sigmoid"} <= set(chain.nodes), report.text()
    assert (report.launches_before, report.launches_after) == (2, 1)
    assert_close(got, expected, dtype)
