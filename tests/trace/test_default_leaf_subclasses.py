"""Subclasses of the modules the trace keeps whole (fuser.trace.leaves.is_default_leaf): one
whose class defines its own forward is traced into (its glue fused or reported, the GEMM or
lookup it reaches the heavy op); one that keeps the base's forward stays one call; code inside
that cannot be traced (a quantised linear's) becomes a leaf with its reason."""

import torch
import torch.nn as nn
import torch.nn.functional as F

import fuser
from fuser.trace.leaves import is_default_leaf
from fuser.trace.tracing import trace

H, E = 32, 8


def rms(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class Router(nn.Linear):
    """Llama-4's router, as transformers writes it: the GEMM, then glue in the same forward."""

    def __init__(self, hidden, experts, top_k=2):
        super().__init__(hidden, experts, bias=False)
        self.top_k = top_k

    def forward(self, x):
        logits = super().forward(x)
        top, index = torch.topk(logits, self.top_k, dim=1)
        scores = torch.full_like(logits, float("-inf")).scatter_(1, index, top)
        return torch.sigmoid(scores.float()).to(scores.dtype), logits


class Gated(nn.Linear):
    """A linear whose forward goes on with pointwise glue only."""

    def forward(self, x):
        y = super().forward(x)
        return torch.sigmoid(y) * y + 1.0


class HostScaledLinear(nn.Linear):
    """A quantised linear of the simplest kind: it reads its scale on the host (untraceable)."""

    def forward(self, x):
        scale = self.weight.abs().max().item()  # HOST-READ
        return F.linear(x, self.weight / scale) * scale


@torch.library.custom_op("fuser_test::int8_gemm", mutates_args=())
def int8_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x @ weight.t()


@int8_gemm.register_fake
def _(x, weight):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


class KernelLinear(nn.Linear):
    """A linear that calls its own kernel (a custom op), as bitsandbytes-like layers do."""

    def forward(self, x):
        return int8_gemm(x, self.weight)


class ScaledEmbedding(nn.Embedding):
    """Gemma's word embedding: the lookup, then a scale."""

    def forward(self, ids):
        return super().forward(ids) * 4.0


class Layer(nn.Module):
    def __init__(self, proj: nn.Module):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(H) + 0.5)
        self.proj = proj

    def forward(self, x):
        return self.proj(rms(x, self.weight))


def _line(marker: str) -> int:
    lines = open(__file__).read().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.rstrip().endswith(f"# {marker}"))


def _fused_call(layer, *inputs):
    """The fused layer's output on ``inputs``, checking the fused forward ran."""
    before = fuser.stats(layer)[""]["fused"]
    with torch.no_grad():
        out = layer(*inputs)
    assert fuser.stats(layer)[""]["fused"] == before + 1, fuser.stats(layer)
    return out


def _calls(traced, op, target):
    return [n for n in traced.graph.nodes if n.op == op and n.target == target]


def test_which_modules_are_kept_whole():
    assert is_default_leaf(nn.Linear(4, 4)) and is_default_leaf(nn.Embedding(4, 4))
    # a subclass that keeps the base's forward (MultiheadAttention's out_proj is one)
    assert is_default_leaf(nn.modules.linear.NonDynamicallyQuantizableLinear(4, 4))
    assert not is_default_leaf(Router(4, 4)) and not is_default_leaf(ScaledEmbedding(4, 4))
    assert not is_default_leaf(nn.LayerNorm(4))


def test_a_plain_linear_stays_one_call():
    torch.manual_seed(0)
    traced = trace(Layer(nn.Linear(H, E)), (torch.randn(3, H),))
    assert len(_calls(traced, "call_module", "proj")) == 1
    assert not _calls(traced, "call_function", F.linear)


def test_the_glue_after_a_subclass_gemm_is_traced_and_fused():
    torch.manual_seed(0)
    layer = Layer(Gated(H, E))
    x = torch.randn(5, H)
    traced = trace(layer, (torch.randn(3, H),))
    assert not _calls(traced, "call_module", "proj") and len(_calls(traced, "call_function", F.linear)) == 1
    assert not traced.automatic_leaves
    with torch.no_grad():
        expected = layer(x)
    result = fuser.check(layer, (torch.randn(3, H),))
    assert result.ok, result.problems
    fused = {n for c in result.report.chains for n in c.nodes}
    assert "sigmoid" in fused, result.report.text()  # the subclass's own glue, in a kernel
    report = fuser.apply(layer, (torch.randn(3, H),))
    assert report.launches_after < report.launches_before
    torch.testing.assert_close(_fused_call(layer, x), expected, atol=1e-5, rtol=1e-5)


def test_a_router_subclass_is_traced_its_top_k_and_scatter_fused_or_reported():
    torch.manual_seed(0)
    layer = Layer(Router(H, E))
    x = torch.randn(6, H)
    with torch.no_grad():
        expected = layer(x)
    report = fuser.explain(layer, (torch.randn(3, H),))
    fused = [n for c in report.chains for n in c.nodes]
    eager = [u.node for u in report.unfused]
    for op in ("topk", "scatter", "sigmoid"):
        assert any(n.startswith(op) for n in fused + eager), (op, report.text())
    assert not report.automatic_leaves
    fuser.apply(layer, (torch.randn(3, H),))
    for got, want in zip(_fused_call(layer, x), expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_an_untraceable_subclass_forward_is_a_leaf_with_its_reason():
    torch.manual_seed(0)
    layer = Layer(HostScaledLinear(H, E))
    traced = trace(layer, (torch.randn(3, H),))
    (leaf,) = traced.automatic_leaves
    assert leaf.name == "proj" and "host read" in leaf.reason, leaf
    assert leaf.where.endswith(f"test_default_leaf_subclasses.py:{_line('HOST-READ')}"), leaf
    assert len(_calls(traced, "call_module", "proj")) == 1
    x = torch.randn(4, H)
    with torch.no_grad():
        expected = layer(x)
    result = fuser.check(layer, (torch.randn(3, H),))
    assert result.ok, result.problems
    fuser.apply(layer, (torch.randn(3, H),))
    torch.testing.assert_close(_fused_call(layer, x), expected, atol=1e-5, rtol=1e-5)


def test_a_subclass_calling_its_own_kernel_keeps_the_kernel_as_one_call():
    torch.manual_seed(0)
    layer = Layer(KernelLinear(H, E))
    traced = trace(layer, (torch.randn(3, H),))
    (leaf,) = traced.automatic_leaves
    assert leaf.name == "torch.ops.fuser_test.int8_gemm.default", leaf
    assert "custom op" in leaf.reason
    x = torch.randn(4, H)
    with torch.no_grad():
        expected = layer(x)
    result = fuser.check(layer, (torch.randn(3, H),))
    assert result.ok, result.problems
    fuser.apply(layer, (torch.randn(3, H),))
    torch.testing.assert_close(_fused_call(layer, x), expected, atol=1e-5, rtol=1e-5)


class Embedder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = ScaledEmbedding(50, H)
        self.weight = nn.Parameter(torch.rand(H) + 0.5)

    def forward(self, ids):
        return rms(self.embed(ids), self.weight)


def test_an_embedding_subclass_is_traced_its_lookup_the_heavy_op():
    torch.manual_seed(0)
    layer = Embedder()
    ids = torch.randint(0, 50, (3,))
    traced = trace(layer, (ids,))
    assert len(_calls(traced, "call_function", F.embedding)) == 1 and not _calls(traced, "call_module", "embed")
    report = fuser.explain(layer, (ids,))
    fused = {n for c in report.chains for n in c.nodes}
    assert "mul" in fused, report.text()  # the scale joins the norm's kernel
    assert not any(u.op == "embedding" for u in report.unfused), report.text()
    more = torch.randint(0, 50, (7,))
    with torch.no_grad():
        expected = layer(more)
    fuser.apply(layer, (ids,))
    torch.testing.assert_close(_fused_call(layer, more), expected, atol=1e-5, rtol=1e-5)
