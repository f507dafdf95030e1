"""A LayerNorm per slice of one tensor, each slice with its own weights, joined back along the
split dim (fuser/trace/per_slice_norms.py): rewritten in the trace as one LayerNorm with the
weights stacked. transformers' StableLM layer (its per-head q/k norms) fuses with one norm for
the q heads and one for the k heads and matches eager over several token counts; a weight
changed after apply is seen; a join that is anything else is left as it was; the rewrite is
switched off by its pass name."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fuser
from examples.zoo import layers as zoo
from fuser.install.splice import STATE_ATTR
from fuser.trace.tracing import trace
from fuser.validate.tolerance import KERNEL, LAYER, mismatch
from transformers.models.stablelm.modeling_stablelm import StableLmRotaryEmbedding

TOKENS = (1, 5, 17)
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])


def layer_norms(graph) -> int:
    return sum(n.op == "call_function" and n.target is F.layer_norm for n in graph.nodes)


def fused_layer_norms(report) -> list[str]:
    return [n for c in report.chains for n in c.nodes if n == "layer_norm" or n.startswith("layer_norm_")]


def fused_call(module, args, kwargs=None):
    """``module(*args, **kwargs)``, checking first that its fused forward takes the call."""
    kwargs = kwargs or {}
    why_not = module.__dict__[STATE_ATTR].guard.why_not(args, kwargs)
    assert why_not is None, f"the fused forward would not run: {why_not}"
    with torch.no_grad():
        return module(*args, **kwargs)


def eager_call(module, args, kwargs=None):
    with torch.no_grad():
        return module(*args, **kwargs or {})


def assert_matches(actual, expected, what: str, level=KERNEL):
    problem = mismatch(actual, expected, what, level)
    assert problem is None, problem


# --- transformers' StableLM decoder layer ------------------------------------------------------
def stablelm(T: int, dtype, S: int = 4):
    """The tiny layer (4 q heads, 2 k heads of 24; the same weights at every T) and its inputs:
    T sequences of S tokens each, so that the q/k norms count (a sequence of one token attends
    to its one key whatever its query)."""
    layer, _, _ = zoo.build("stablelm", T=T, dtype=dtype)
    config = zoo.config("stablelm", "cpu")
    hidden = torch.randn(T, S, config.hidden_size, generator=torch.Generator().manual_seed(T)).to(dtype)
    position_ids = (torch.arange(S) + 7).expand(T, S)
    cos, sin = StableLmRotaryEmbedding(config)(hidden, position_ids)
    kwargs = dict(attention_mask=None, position_ids=position_ids, position_embeddings=(cos.to(dtype), sin.to(dtype)))
    return layer, (hidden,), kwargs


@DTYPES
def test_stablelm_per_head_norms_are_one_layer_norm_each_and_match_eager(dtype):
    layer, args, kwargs = stablelm(3, dtype)
    assert layer_norms(trace(layer, args, example_kwargs=kwargs).graph) == 3  # input_layernorm, q, k
    eager = copy.deepcopy(layer)
    report = fuser.apply(layer, args, example_kwargs=kwargs)
    try:
        assert len(fused_layer_norms(report)) == 3, report.text()  # 1 + 4 + 2 without the rewrite
        for T in TOKENS:
            _, a, k = stablelm(T, dtype)
            assert_matches(fused_call(layer, a, k), eager_call(eager, a, k), f"T={T}", LAYER)
    finally:
        fuser.restore(layer)


def test_stablelm_sees_one_heads_weight_changed_after_apply():
    layer, args, kwargs = stablelm(3, torch.bfloat16)
    eager = copy.deepcopy(layer)
    fuser.apply(layer, args, example_kwargs=kwargs)
    try:
        before = fused_call(layer, args, kwargs)
        with torch.no_grad():
            for m in (layer, eager):
                m.self_attn.q_layernorm.norms[1].weight.mul_(-1.5)
        after = fused_call(layer, args, kwargs)
        assert not torch.equal(after, before)
        assert_matches(after, eager_call(eager, args, kwargs), "after the update", LAYER)
    finally:
        fuser.restore(layer)


def test_stablelm_with_the_rewrite_switched_off_keeps_a_norm_per_head():
    layer, args, kwargs = stablelm(3, torch.bfloat16)
    result = fuser.check(layer, args, example_kwargs=kwargs, disable_passes=("per_slice_norms",))
    assert result.ok, result.problems
    assert result.report.disabled_passes == ["per_slice_norms"]
    assert len(fused_layer_norms(result.report)) == 1 + 4 + 2, result.report.text()


# --- per-slice norms written other ways --------------------------------------------------------
class PerSlice(nn.Module):
    """``norm_i(x_i)`` for each slice of a projection of ``x`` ([T, heads, dim]) along the
    heads, joined back (``how``: the split and join); glue before the projection, as in a
    model, where the norms read a GEMM's result."""

    def __init__(self, how: str, heads: int, dim: int, dtype, bias: bool = True, eps=(1e-5,), parts: int | None = None):
        super().__init__()
        self.how, self.parts = how, parts or heads
        eps = eps * self.parts if len(eps) == 1 else eps
        self.norms = nn.ModuleList(nn.LayerNorm(dim, eps=e, bias=bias) for e in eps)
        self.proj = nn.Linear(dim, dim, bias=False)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in self.norms.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 + 1.0)
            self.proj.weight.copy_(torch.randn(dim, dim, generator=g) * dim**-0.5)
        self.to(dtype)

    def forward(self, x):
        x = self.proj(x * 0.5)
        if self.how == "unbind":
            return torch.stack([n(p) for n, p in zip(self.norms, x.unbind(1))], dim=1) * 2.0
        if self.how == "chunk":
            parts = x.chunk(self.parts, dim=-2)
        elif self.how == "not_all_normed":
            parts = torch.split(x, 1, dim=1)
            return torch.cat([n(p) for n, p in zip(self.norms, parts[:-1])] + [parts[-1]], dim=1) * 2.0
        else:
            parts = torch.split(x, x.shape[1] // self.parts, dim=1)
        return torch.cat([n(p) for n, p in zip(self.norms, parts)], dim=1) * 2.0


def inputs(T: int, heads: int, dim: int, dtype) -> tuple:
    return ((torch.randn(T, heads, dim, generator=torch.Generator().manual_seed(T)) * 3 + 1).to(dtype),)


def fused_matches_eager(module, heads: int, dim: int, dtype):
    """Fused at T=3, against eager at each T of TOKENS (KERNEL tolerance); the report."""
    eager = copy.deepcopy(module)
    report = fuser.apply(module, inputs(3, heads, dim, dtype))
    try:
        for T in TOKENS:
            x = inputs(T, heads, dim, dtype)
            assert_matches(fused_call(module, x), eager_call(eager, x), f"T={T}")
    finally:
        fuser.restore(module)
    return report


@DTYPES
@pytest.mark.parametrize(
    "how, bias, parts",
    [("split", True, None), ("split", False, None), ("unbind", True, None), ("chunk", True, None)],
    ids=["split", "split_no_bias", "unbind_stack", "chunk"],
)
def test_per_slice_norms_become_one_norm(how, bias, parts, dtype):
    module = PerSlice(how, 4, 37, dtype, bias=bias, parts=parts)
    assert layer_norms(trace(module, inputs(3, 4, 37, dtype)).graph) == 1
    report = fused_matches_eager(module, 4, 37, dtype)
    assert [u.node for u in report.unfused] in ([], ["mul"]), report.text()  # the scale before the projection, alone


@DTYPES
@pytest.mark.parametrize("off", [(), ("widen",)], ids=["read_in_kernel", "precomputed"])
def test_one_heads_weights_changed_after_apply_are_seen(off, dtype):
    """The stacked weights and biases are read by the kernel (``widen`` takes them in) or, with
    nothing taking them in, computed at apply time and again when a weight changes; either way
    the fused module follows a change of one head's weight and bias, and only that head's
    output changes. Heads of 640: too wide for one program, as StableLM-2-12B's 32 heads of 160."""
    heads, dim = 4, 640
    module = PerSlice("split", heads, dim, dtype)
    eager = copy.deepcopy(module)
    x = inputs(3, heads, dim, dtype)
    report = fuser.apply(module, x, disable_passes=off)
    try:
        if off:
            assert len(report.precomputed) == 2 and all(n.startswith("stack") for n in report.precomputed), report.text()
        before = fused_call(module, x)
        with torch.no_grad():
            for m in (module, eager):
                m.norms[2].weight.mul_(-1.5)
                m.norms[2].bias.add_(0.25)
        after = fused_call(module, x)
        assert_matches(after, eager_call(eager, x), "after the update")
        assert torch.equal(after[:, [0, 1, 3]], before[:, [0, 1, 3]])  # the other heads as they were
        assert not torch.equal(after[:, 2], before[:, 2])
    finally:
        fuser.restore(module)


@pytest.mark.parametrize(
    "module",
    [
        PerSlice("not_all_normed", 4, 37, torch.float32, parts=3),
        PerSlice("split", 4, 37, torch.float32, eps=(1e-5, 1e-5, 1e-6, 1e-5)),
    ],
    ids=["last_part_not_normed", "one_eps_differs"],
)
def test_anything_else_is_left_as_it_was(module):
    before = layer_norms(trace(module, inputs(3, 4, 37, torch.float32), rewrites=()).graph)
    assert layer_norms(trace(module, inputs(3, 4, 37, torch.float32)).graph) == before > 1
    fused_matches_eager(module, 4, 37, torch.float32)
