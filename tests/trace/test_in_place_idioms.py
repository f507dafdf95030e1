"""In-place spellings of a value rewritten as one functional op (fuser/trace/in_place_idioms.py): the
inverse permutation ``inv[perm] = arange(n)`` is rewritten only where the buffer is fresh,
written once, by exactly that, and read only afterwards; everywhere else the graph keeps the
write. The rewritten op computes what the idiom did, fused or eager."""

import types

import pytest
import torch
import torch.nn as nn

import fuser
from helpers import fused_output
from fuser.validate.against_eager import _unstable_sort_ties
from fuser.canon.canonicalize import canonicalize
from fuser.trace.in_place_idioms import inverse_permutation
from fuser.trace.tracing import trace


def _ops(module, *inputs) -> list[str]:
    traced = trace(module, inputs)
    return [n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target)) for n in traced.graph.nodes]


class Inverse(nn.Module):
    def forward(self, scores):
        perm = torch.argsort(scores)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.size(0), device=scores.device)
        return scores[inv] * 2.0


def test_the_idiom_becomes_one_op_with_the_same_values():
    scores = torch.randn(9)
    ops = _ops(Inverse(), scores)
    assert "inverse_permutation" in ops and "setitem" not in ops and "arange" not in ops and "empty_like" not in ops
    perm = torch.argsort(scores)
    expected = torch.empty_like(perm)
    expected[perm] = torch.arange(9)
    assert torch.equal(inverse_permutation(perm), expected)


class ReadBeforeWrite(nn.Module):
    def forward(self, scores):
        perm = torch.argsort(scores)
        inv = torch.empty_like(perm)
        first = inv.clamp(0, 0)  # reads the buffer before the write
        inv[perm] = torch.arange(perm.size(0))
        return scores[inv] + first


class NotPositions(nn.Module):
    def forward(self, scores):
        perm = torch.argsort(scores)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.size(0)).flip(0)
        return scores[inv]


class WrittenAgain(nn.Module):
    def forward(self, scores):
        perm = torch.argsort(scores)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.size(0))
        inv[0] = 0
        return scores[inv]


class WrittenThroughAView(nn.Module):
    def forward(self, scores):
        perm = torch.argsort(scores)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.size(0))
        inv.view(-1)[:1].zero_()
        return scores[inv]


class NotFresh(nn.Module):
    def forward(self, scores):
        perm = torch.argsort(scores)
        inv = perm.clone()
        inv[perm] = torch.arange(perm.size(0))
        return scores[inv]


@pytest.mark.parametrize("module", [ReadBeforeWrite(), NotPositions(), WrittenAgain(), WrittenThroughAView(), NotFresh()],
                         ids=lambda m: type(m).__name__)  # fmt: skip
def test_other_writes_keep_the_graph_as_it_is(module):
    scores = torch.randn(9)
    ops = _ops(module, scores)
    assert "inverse_permutation" not in ops and "setitem" in ops
    result = fuser.check(module, (scores,))
    assert result.ok, result.problems


def test_an_inverse_no_template_computes_stays_eager_and_costs_its_two_launches():
    module = Inverse()
    scores = torch.randn(9)
    expected = module(scores)
    report = fuser.explain(module, (scores,))
    (left,) = [u for u in report.unfused if u.op == "inverse_permutation"]
    assert left.launches == 2, report.text()
    result = fuser.check(module, (scores,))
    assert result.ok, result.problems
    assert torch.equal(fused_output(module, (scores,)), expected)


class SortedInverse(nn.Module):
    def forward(self, ids):
        _, perm = torch.sort(ids)
        return inverse_permutation(perm)


def test_validation_reads_the_inverse_of_an_unstable_sort_up_to_its_ties():
    """Equal ids may go either way round in an unstable sort, and so may their places in its
    inverse; any other difference in the inverse (or one that is no permutation) is caught."""
    ids = torch.tensor([1, 4, 0, 1, 1, 0])
    traced = trace(SortedInverse(), (ids,))
    cops = canonicalize(traced)
    (node,) = [n for n in traced.graph.nodes if n in cops and cops[n].op == "inverse_permutation"]
    region = types.SimpleNamespace(outputs=[node])
    values = {n: traced.value(n) for n in traced.graph.nodes if n.name in traced.shadows}
    stable = torch.tensor([2, 5, 0, 3, 4, 1])  # positions of the ids sorted stably

    def inverse(perm):
        return torch.argsort(perm)

    def same(got):
        (a,), (b,) = _unstable_sort_ties(region, cops, values, [got], [inverse(stable)])
        return torch.equal(a, b)

    assert same(inverse(torch.tensor([5, 2, 4, 0, 3, 1])))  # ties swapped
    assert not same(inverse(torch.tensor([2, 0, 5, 3, 4, 1])))  # 0 and 5 swapped across two runs
    assert not same(torch.tensor([2, 2, 0, 3, 4, 1]))  # not a permutation


# --- in-place writes on fresh values ---------------------------------------------------------------
class WithBias(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(8, dtype=dtype), requires_grad=False)


class BiasAddedInPlace(WithBias):
    """transformers' grouped GEMM + bias: ``out = gemm(x); out.add_(bias); return out``."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        out = self.proj(x)
        out.add_(self.bias)
        return out * 2.0


class InputWrittenInPlace(WithBias):
    def forward(self, x):
        x.add_(self.bias.to(x.dtype))  # the caller sees the write
        return x * 2.0


class ViewTakenBeforeTheWrite(WithBias):
    def forward(self, x):
        out = x * 3.0
        flat = out.view(-1)
        out.add_(self.bias.to(x.dtype))
        return flat * 2.0  # reads the written values through the view


class WriteThatPromotes(WithBias):
    def forward(self, x):
        out = x * 3.0
        out.add_(self.bias)  # bf16 in place; out of place it would be fp32
        return out * 2.0


def test_an_in_place_write_on_a_fresh_value_reads_as_its_out_of_place_form():
    x = torch.randn(5, 8)
    module = BiasAddedInPlace()
    ops = _ops(module, x)
    assert "add" in ops and "add_" not in ops
    expected = module(x)
    result = fuser.check(module, (x,))
    assert result.ok, result.problems
    assert result.report.launches_after == 1, result.report.text()  # the add and the scale, one kernel
    torch.testing.assert_close(fused_output(module, (x,)), expected)


@pytest.mark.parametrize("module", [InputWrittenInPlace(), ViewTakenBeforeTheWrite(), WriteThatPromotes()],
                         ids=lambda m: type(m).__name__)  # fmt: skip
def test_other_in_place_writes_stay_writes(module):
    x = torch.randn(5, 8).bfloat16()
    assert "add_" in _ops(module, x.clone())
    result = fuser.check(module, (x.clone(),))
    assert result.ok, result.problems


# --- a buffer filled slice by slice ------------------------------------------------------------------
class KeyFilledBySlices(nn.Module):
    """DeepSeek-V3's MLA key: a new buffer, its last axis filled by two copy_ writes."""

    def __init__(self, extra=0, part_dtype=None, read_before=False):
        super().__init__()
        self.extra, self.part_dtype, self.read_before = extra, part_dtype, read_before

    def forward(self, x):
        nope, rot = x[..., :16] * 2.0, (x[..., -8:] + 1.0).sin()
        if self.part_dtype is not None:
            rot = rot.to(self.part_dtype)
        key = x.new_empty(*x.shape[:-1], 24 + self.extra)
        early = key.sum() if self.read_before else None
        key[..., :16].copy_(nope)
        key[..., 16:24].copy_(rot)
        return key * 3.0 if early is None else (key * 3.0, early)


def test_a_buffer_filled_slice_by_slice_is_a_concatenation():
    module = KeyFilledBySlices()
    x = torch.randn(5, 24)
    ops = _ops(module, x)
    assert "cat" in ops and "copy_" not in ops and "new_empty" not in ops
    result = fuser.check(module, (x,))
    assert result.ok, result.problems
    assert result.report.launches_after == 1, result.report.text()


@pytest.mark.parametrize(
    "module",
    [KeyFilledBySlices(part_dtype=torch.float64), KeyFilledBySlices(extra=4), KeyFilledBySlices(read_before=True)],
    ids=["a copy that casts", "slices that leave a gap", "read before the writes"],
)  # fmt: skip
def test_other_slice_writes_stay_writes(module):
    x = torch.randn(5, 24)
    ops = _ops(module, x)
    assert "copy_" in ops and "cat" not in ops


class Cache(nn.Module):
    """Hands back rows of its own state, as a KV cache's update returns its tensors."""

    def __init__(self):
        super().__init__()
        self.register_buffer("rows", torch.zeros(16, 8))

    def forward(self, x):
        return self.rows[: x.shape[0]]


class WritesWhatTheCacheReturned(nn.Module):
    def __init__(self):
        super().__init__()
        self.cache = Cache()

    def forward(self, x):
        held = self.cache(x)
        held.add_(x)  # writes the cache's buffer
        return held * 2.0


def test_an_in_place_write_into_a_leafs_state_stays_a_write():
    module = WritesWhatTheCacheReturned()
    traced = trace(module, (torch.randn(5, 8),), leaves=["cache"])
    targets = [n.target for n in traced.graph.nodes]
    assert "add_" in targets and "add" not in targets


# --- a buffer written whole ----------------------------------------------------------------------
class WrittenWhole(nn.Module):
    """A zero-filled buffer read, then written whole twice (the second time through a whole view
    of itself, as ``buf[:, :] /= ...`` is traced), then read: sglang's hash router's buffers."""

    def __init__(self, value_dtype=None):
        super().__init__()
        self.value_dtype = value_dtype

    def forward(self, x):
        buf = torch.zeros((x.shape[0], 8), dtype=torch.float32)
        before = buf + 1.0  # reads the fill
        value = x * 2.0 if self.value_dtype is None else (x * 2.0).to(self.value_dtype)
        buf[:, :] = value  # cast to the buffer's fp32 where the value is not
        buf[...] = buf[:, :] / ((buf[:, :] ** 2).sum(-1, keepdim=True) + 3.0)
        return buf.exp() + before


def test_a_buffer_written_whole_reads_each_writes_value_from_it_on():
    for module in (WrittenWhole(), WrittenWhole(torch.bfloat16)):
        x = torch.randn(5, 8)
        ops = _ops(module, x)
        assert "setitem" not in ops and ops.count("zeros") == 1, ops  # the fill stays for the read before
        expected = module(x)
        result = fuser.check(module, (x,))
        assert result.ok, result.problems
        assert result.report.launches_after == 1, result.report.text()
        torch.testing.assert_close(fused_output(module, (x,)), expected)


class ScaledInPlaceThroughAWholeView(nn.Module):
    """``buf[:, :] /= ...``, traced as eager runs it: a whole view, its ``div_``, the write back."""

    def __init__(self, divisor_dtype=None):
        super().__init__()
        self.divisor_dtype = divisor_dtype

    def forward(self, x):
        buf = torch.zeros((x.shape[0], 8), dtype=x.dtype)
        buf[:, :] = x * 2.0
        divisor = buf[:, :].sum(-1, keepdim=True) ** 2 + 1.0
        buf[:, :] /= divisor if self.divisor_dtype is None else divisor.to(self.divisor_dtype)
        return buf


def test_a_buffer_scaled_in_place_through_a_whole_view_is_one_kernel():
    x = torch.randn(5, 8)
    module = ScaledInPlaceThroughAWholeView()
    assert "div_" not in _ops(module, x) and "setitem" not in _ops(module, x)
    result = fuser.check(module, (x,))
    assert result.ok, result.problems
    assert result.report.launches_after == 1, result.report.text()


def test_an_in_place_op_through_a_whole_view_that_would_promote_stays_a_write():
    x = torch.randn(5, 8).bfloat16()
    module = ScaledInPlaceThroughAWholeView(torch.float32)  # bf16 /= fp32: bf16 in place, fp32 out of place
    assert "div_" in _ops(module, x)
    result = fuser.check(module, (x,))
    assert result.ok, result.problems


class WrittenInPart(nn.Module):
    def forward(self, x):
        buf = torch.zeros((x.shape[0], 8))
        buf[:, :-1] = x[:, :-1] * 2.0
        return buf + 1.0


class WrittenWithAnInput(nn.Module):
    def forward(self, x):
        buf = torch.zeros_like(x)
        buf[:] = x  # the buffer would alias the input
        return buf


class WrittenByBroadcast(nn.Module):
    def forward(self, x):
        buf = torch.zeros((x.shape[0], 8))
        buf[:, :] = x[:, :1] * 2.0  # a column spread over the row
        return buf + 1.0


class ViewReadAfterTheNextWrite(nn.Module):
    """A view of the buffer taken between two writes and read after the second: it sees it."""

    def __init__(self, view):
        super().__init__()
        self.view = view

    def forward(self, x):
        buf = torch.zeros((x.shape[0], 8))
        buf[:] = x * 2.0
        seen = self.view(buf)
        buf[:] = x * 3.0
        return seen + 1.0


class BothReturned(nn.Module):
    def forward(self, x):
        buf = torch.empty((x.shape[0], 8))
        value = x * 2.0
        buf[:] = value
        return buf, value  # eager's are two tensors: writing one leaves the other


class ValueWrittenLater(nn.Module):
    def forward(self, x):
        buf = torch.empty((x.shape[0], 8))
        value = x * 2.0
        buf[:] = value
        value[0] = 1.0  # the buffer keeps the copy
        return buf * value


@fuser.opaque
def _zero_first_column(buf):
    buf[:, 0] = 0.0


class ALeafWritesIt(nn.Module):
    def forward(self, x):
        buf = torch.empty((x.shape[0], 8))
        value = x * 2.0
        buf[:] = value
        _zero_first_column(buf)  # a leaf, which may write what it is given
        return buf + value


@pytest.mark.parametrize(
    "module", [WrittenInPart(), WrittenWithAnInput(), WrittenByBroadcast(), ViewReadAfterTheNextWrite(lambda b: b[:, :]),
               ViewReadAfterTheNextWrite(lambda b: b[:, :4]), ViewReadAfterTheNextWrite(lambda b: b.detach()),
               BothReturned(), ValueWrittenLater(), ALeafWritesIt()],
    ids=["WrittenInPart", "WrittenWithAnInput", "WrittenByBroadcast", "WholeViewReadAfterTheNextWrite",
         "PartReadAfterTheNextWrite", "DetachedReadAfterTheNextWrite", "BothReturned", "ValueWrittenLater", "ALeafWritesIt"],
)  # fmt: skip
def test_other_whole_buffer_writes_stay_writes(module):
    x = torch.randn(5, 8)
    assert "setitem" in _ops(module, x)
    expected = module(x.clone())
    result = fuser.check(module, (x.clone(),))
    assert result.ok, result.problems
    got = fused_output(module, (x.clone(),))
    for a, b in zip(got if isinstance(got, tuple) else (got,), expected if isinstance(expected, tuple) else (expected,)):
        torch.testing.assert_close(a, b)
