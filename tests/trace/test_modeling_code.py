"""Modeling code as people write it: keyword arguments and nested inputs, submodules the trace
cannot enter (kept opaque automatically, and reported), opaque functions reached through
helpers or taking a module, eval-mode dropout, early exits for zero tokens."""

import sys
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fuser
from fuser.trace.tracing import trace


def rms(x, weight, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


class KeywordLayer(nn.Module):
    """A transformers-style signature: positional hidden states, everything else by keyword."""

    def __init__(self, n=32):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(n) + 0.5)
        self.proj = nn.Linear(n, n, bias=False)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, **kwargs):
        cos, sin = position_embeddings
        h = rms(hidden_states, self.weight)
        h = self.proj(h * cos + h.flip(-1) * sin)
        if attention_mask is not None:
            h = h + attention_mask
        return hidden_states + h * kwargs.get("scale", 1.0)


def keyword_inputs(T=3, n=32, dtype=torch.float32):
    x = torch.randn(T, n, dtype=dtype)
    cos, sin = torch.randn(T, n, dtype=dtype), torch.randn(T, n, dtype=dtype)
    return (x,), dict(position_embeddings=(cos, sin), attention_mask=None, scale=0.5)


def test_keyword_arguments_and_nested_tensors_trace_and_fuse():
    layer = KeywordLayer()
    args, kwargs = keyword_inputs()
    result = fuser.check(layer, args, example_kwargs=kwargs)
    assert result.ok, result.problems
    assert result.report.launches_after < result.report.launches_before
    fuser.apply(layer, args, example_kwargs=kwargs)
    args, kwargs = keyword_inputs(T=7)  # another token count: the same trace serves it
    state = layer.__dict__["_fuser_state"]
    assert state.guard.why_not(args, kwargs) is None
    fused = layer(*args, **kwargs)
    fuser.restore(layer)
    torch.testing.assert_close(fused, layer(*args, **kwargs))


def test_a_call_unlike_the_traced_one_runs_eager():
    layer = KeywordLayer()
    args, kwargs = keyword_inputs()
    fuser.apply(layer, args, example_kwargs=kwargs)
    guard = layer.__dict__["_fuser_state"].guard
    x, (cos, sin) = args[0], kwargs["position_embeddings"]
    assert "scale is 2.0" in guard.why_not(args, {**kwargs, "scale": 2.0})
    assert "structure" in guard.why_not(args, {**kwargs, "position_embeddings": (cos, sin, sin)})
    mask = torch.zeros(3, 32)
    assert guard.why_not(args, {**kwargs, "attention_mask": mask}) is not None
    expected = KeywordLayer.forward(layer, x, attention_mask=mask, position_embeddings=(cos, sin), scale=0.5)
    torch.testing.assert_close(layer(x, attention_mask=mask, position_embeddings=(cos, sin), scale=0.5), expected)


def test_a_nested_keyword_tensor_that_requires_grad_runs_eager():
    """cos in `position_embeddings=(cos, sin)` requires grad: the kernels have no backward, so
    the call runs eager and cos gets its gradient."""
    layer = KeywordLayer().requires_grad_(False)
    args, kwargs = keyword_inputs()
    fuser.apply(layer, args, example_kwargs=kwargs)
    cos, sin = kwargs["position_embeddings"]
    cos = cos.clone().requires_grad_(True)
    layer(*args, **{**kwargs, "position_embeddings": (cos, sin)}).sum().backward()
    fuser.restore(layer)
    expected = cos.detach().clone().requires_grad_(True)
    layer(*args, **{**kwargs, "position_embeddings": (expected, sin)}).sum().backward()
    assert cos.grad is not None
    torch.testing.assert_close(cos.grad, expected.grad)


class LoopExperts(nn.Module):
    """A Python loop over the experts that were hit: data-dependent, not traceable."""

    def __init__(self, n=16, experts=4):
        super().__init__()
        self.w = nn.Parameter(torch.randn(experts, n, n) / n**0.5)

    def forward(self, x, index):
        out = torch.zeros_like(x)
        for e in index.unique():  # UNTRACEABLE-LOOP
            rows = (index == e).nonzero()[:, 0]
            out[rows] = x[rows] @ self.w[e]
        return out


class MoEBlock(nn.Module):
    def __init__(self, n=16, experts=4):
        super().__init__()
        self.gate = nn.Linear(n, experts, bias=False)
        self.experts = LoopExperts(n, experts)
        self.weight = nn.Parameter(torch.rand(n) + 0.5)

    def forward(self, x):
        h = rms(x, self.weight)
        index = self.gate(h).argmax(-1)
        return x + torch.sigmoid(self.experts(h, index).float()).to(x.dtype)


def test_an_untraceable_submodule_becomes_a_reported_leaf():
    block = MoEBlock()
    x = torch.randn(5, 16)
    traced = trace(block, (x,))
    (leaf,) = traced.automatic_leaves
    assert leaf.name == "experts"
    assert leaf.where.endswith(f"{__file__}:{_line('UNTRACEABLE-LOOP')}")
    assert "iteration" in leaf.reason
    result = fuser.check(block, (x,))
    assert result.ok, result.problems
    text = result.report.text()
    assert "leaf (automatic): experts" in text and "test_modeling_code.py" in text


def test_the_top_modules_own_untraceable_code_is_still_refused():
    experts = LoopExperts()
    with pytest.raises(fuser.TraceRefused, match=f"{_line('UNTRACEABLE-LOOP')}"):
        trace(experts, (torch.randn(5, 16), torch.randint(0, 4, (5,))))


def _line(marker: str) -> int:
    return next(i for i, line in enumerate(open(__file__), 1) if f"# {marker}" in line)


# An opaque function in one module, reached through a helper in another (as transformers'
# layers reach kernels through integrations.* helpers).
kernels = types.ModuleType("fuser_test_kernels")
exec(
    "import fuser, torch\n"
    "calls = []\n"
    "@fuser.opaque\n"
    "def custom_kernel(x):\n"
    "    calls.append(x.shape)\n"
    "    return torch.tanh(x) * 2\n",
    kernels.__dict__,
)
helpers = types.ModuleType("fuser_test_helpers")
helpers.kernels = kernels
exec("def activation(x):\n    return kernels.custom_kernel(x) + 1\n", helpers.__dict__)
sys.modules[kernels.__name__], sys.modules[helpers.__name__] = kernels, helpers


class ThroughHelper(nn.Module):
    def forward(self, x):
        return helpers.activation(x * 3) * 5


def test_an_opaque_function_holds_when_reached_through_a_helper():
    traced = trace(ThroughHelper(), (torch.randn(3, 8),))
    calls = [n for n in traced.graph.nodes if n.op == "call_function" and n.target is kernels.custom_kernel]
    assert len(calls) == 1
    assert not any(n.op == "call_function" and n.target is torch.tanh for n in traced.graph.nodes)


def attention_interface(module, q, k):
    """transformers' attention interface takes the attention module itself."""
    return torch.softmax(q @ k.transpose(-1, -2) * module.scaling, -1) @ k, None


class Attention(nn.Module):
    def __init__(self, n=16):
        super().__init__()
        self.q = nn.Linear(n, n, bias=False)
        self.scaling = n**-0.5

    def forward(self, x):
        out, _ = attention_interface(self, self.q(x).unsqueeze(1), x.unsqueeze(1))
        return out.squeeze(1)


class WithAttention(nn.Module):
    def __init__(self, n=16):
        super().__init__()
        self.attn = Attention(n)
        self.weight = nn.Parameter(torch.rand(n) + 0.5)

    def forward(self, x):
        return x + self.attn(rms(x, self.weight))


def test_an_opaque_function_taking_the_module_is_one_call():
    layer = WithAttention()
    x = torch.randn(4, 16)
    result = fuser.check(layer, (x,), leaves=[attention_interface])
    assert result.ok, result.problems
    traced = trace(layer, (x,), leaves=[attention_interface])
    (call,) = [n for n in traced.graph.nodes if n.target is attention_interface]
    assert call.args[0].op == "get_attr" and call.args[0].target == "attn"


class WithDropout(nn.Module):
    def __init__(self, n=16):
        super().__init__()
        self.drop = nn.Dropout(0.1)
        self.p = 0.2

    def forward(self, x):
        h = self.drop(torch.sigmoid(x.float()))
        return F.dropout(h * 2, self.p, self.training).to(x.dtype) + x


def test_dropout_in_eval_mode_is_the_identity():
    m = WithDropout().eval()
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    result = fuser.check(m, (x,))
    assert result.ok, result.problems
    assert result.report.launches_after == 1  # sigmoid, mul, cast, add: one kernel, no dropouts left
    assert not [u for u in result.report.unfused if "dropout" in u.op]


class EarlyExit(nn.Module):
    def __init__(self, n=16):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(n) + 0.5)

    def forward(self, x):
        if x.shape[0] == 0:
            return x
        return rms(x, self.weight)


def test_an_early_exit_for_zero_tokens_is_specialised_under_the_guard():
    m = EarlyExit()
    result = fuser.check(m, (torch.randn(3, 16),))
    assert result.ok and result.report.chains, result.problems
    fuser.apply(m, (torch.randn(3, 16),))
    empty = torch.randn(0, 16)
    assert m(empty).shape == (0, 16)  # the guard sends zero tokens to the eager forward
    fuser.restore(m)


def test_topk_picks_may_differ_only_between_equal_scores():
    """Validation accepts a kernel's top-k that picks the other of two near-equal scores (its
    fp32 rounding differs from eager's), never one that picks a lower score."""
    from torch.fx import Graph

    from fuser.validate.against_eager import _near_tie
    from fuser.canon.canonicalize import COMPUTE, UNIT_VIEW, COp

    graph = Graph()
    x = graph.placeholder("scores")
    topk = graph.call_function(torch.topk, (x, 1))
    indices = graph.call_function(getattr, (topk, "indices"))
    cops = {
        topk: COp("topk", COMPUTE, (x,), (("k", 1),), (topk,)),
        indices: COp("topk_indices", UNIT_VIEW, (topk,), (), (indices,)),
    }
    scores = torch.tensor([[0.1, 0.2, 0.35, 0.0, 0.0, 0.35 - 1e-9]])
    values = {x: scores}
    eager = torch.tensor([[2]])
    assert _near_tie(indices, torch.tensor([[5]]), eager, values, cops, torch.float32)
    assert not _near_tie(indices, torch.tensor([[1]]), eager, values, cops, torch.float32)


class TransposedMix(nn.Module):
    """transformers' DeepSeek-V4 mHC: a square matrix per token, normalised, read transposed."""

    def forward(self, logits, streams):
        comb = torch.softmax(logits, dim=-1) + 1e-6
        comb = comb / (comb.sum(dim=-2, keepdim=True) + 1e-6)
        return torch.matmul(comb.to(streams.dtype).transpose(-1, -2), streams)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_transposed_view_of_a_fused_square_matrix_keeps_its_order(dtype):
    logits, streams = torch.randn(3, 4, 4), torch.randn(3, 4, 8, dtype=dtype)
    result = fuser.check(TransposedMix(), (logits, streams))
    assert result.ok, result.problems
    assert result.report.chains and not result.report.unfused, result.report.text()


class TransposedDecay(nn.Module):
    """transformers' Qwen3-Next gated delta rule: ``(k * decay.exp()[..., None]).transpose(-1,
    -2) @ v``, a computed [64, 128] block read transposed: sizes a reshape in registers could
    also give, in another order."""

    def forward(self, k, g, v):
        return (k * g.exp()[..., None]).transpose(-1, -2) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_transposed_view_of_a_fused_block_is_no_reshape(dtype):
    k, g, v = torch.randn(3, 64, 128, dtype=dtype), -torch.rand(3, 64, dtype=dtype), torch.randn(3, 64, 16, dtype=dtype)
    result = fuser.check(TransposedDecay(), (k, g, v))
    assert result.ok, result.problems
    report = result.report
    assert not report.rejected and [c.pattern for c in report.chains] == ["generic"], report.text()
    assert {"exp", "mul"} <= {n.rstrip("_0123456789") for n in report.chains[0].nodes}, report.text()


class InterleavedRope(nn.Module):
    """transformers' DeepSeek-V4 RoPE on the trailing 64 channels of 512-wide heads, then the
    heads moved behind the (single) position: ``cat([nope, rotated], -1).transpose(1, 2)``."""

    def forward(self, q, cos, sin):
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

        return apply_rotary_pos_emb(q, cos, sin).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [3, 8])
def test_a_wide_concatenation_moved_by_unit_axes_is_stored_part_by_part(dtype, heads):
    """The 448 + 64 columns are never assembled into one block in registers (too wide): each
    part is stored at its offset, and the transpose only moves the size-1 axis."""
    q = torch.randn(3, heads, 1, 512, dtype=dtype)
    cos, sin = torch.randn(3, 1, 32), torch.randn(3, 1, 32)
    result = fuser.check(InterleavedRope(), (q, cos, sin))
    assert result.ok, result.problems
    assert result.report.launches_after == 1 and not result.report.unfused, result.report.text()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, width", [(3, 40), (8, 72)])
def test_a_rotary_table_shared_by_every_sequence_broadcasts_over_the_rows(dtype, heads, width):
    """A decode step of a whole model: every sequence at one position, so the rotary tables
    are ``[1, 1, d]`` (no token rows) and, unsqueezed, meet the ``[T, heads, 1, d]`` rows at
    their rank: the leading 1 is the broadcast over the rows, in one kernel."""
    q = torch.randn(5, heads, 1, width, dtype=dtype)
    cos, sin = torch.randn(1, 1, 4), torch.randn(1, 1, 4)
    result = fuser.check(InterleavedRope(), (q, cos, sin), batch_inputs={"q": 0})
    assert result.ok, result.problems
    assert result.report.launches_after == 1 and not result.report.unfused, result.report.text()


def sets_a_keyword(forward):
    """A decorator like transformers' output-capturing wrappers: it sets a keyword argument of
    the forward (``use_cache``) itself and passes the rest on as it got them."""

    def wrapper(self, *args, **kwargs):
        kwargs["scale"] = kwargs.get("scale") or 2.0
        return forward(self, *args, **kwargs)

    wrapper.__wrapped__ = forward  # inspect.signature reads the forward's own parameters
    return wrapper


class Wrapped(nn.Module):
    def __init__(self, n=32):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(n) + 0.5)

    @sets_a_keyword
    def forward(self, hidden_states, attention_mask=None, scale=None):
        return rms(hidden_states, self.weight) * scale


@pytest.mark.parametrize("call", ["keywords", "positional"])
def test_each_argument_is_passed_as_the_example_passed_it(call):
    """The traced and the guarded call pass each argument as the example did (by position, by
    keyword, or not at all): a wrapper that sets a keyword itself gets no second value for it."""
    module, x = Wrapped(), torch.randn(5, 32)
    args, kwargs = ((), dict(hidden_states=x)) if call == "keywords" else ((x,), {})
    expected = module(*args, **kwargs)
    report = fuser.apply(module, args, example_kwargs=kwargs)
    try:
        assert report.launches_after < report.launches_before, report.text()
        torch.testing.assert_close(module(*args, **kwargs), expected)
    finally:
        fuser.restore(module)


def test_transformers_model_forward_traces_with_its_output_wrappers():
    """transformers' Qwen3Model.forward (wrapped to capture outputs, which sets ``use_cache``
    itself), called by keyword as its CausalLM calls it, with its layers as leaves: it traces,
    and its final norm and its causal mask are fused."""
    import copy

    from fuser.pipeline.fuse_module import plan
    from tests.model.test_decode import PROMPT, prefilled, step
    from tests.model.test_model import causal_lm

    model = causal_lm("qwen3", layers=2)
    cache, tokens = prefilled(model)
    kwargs = step(tokens, PROMPT, copy.deepcopy(cache))
    kwargs.pop("cache_position")
    p = plan(model.model, (), example_kwargs=kwargs, leaves=["layers.0", "layers.1"])
    assert "rmsnorm" in [c.pattern for c in p.report.chains], p.report.text()
    assert [c for c in p.report.chains if "le" in c.nodes], p.report.text()  # the mask, from the cache's length
