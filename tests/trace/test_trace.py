"""fuser.trace: the shadow-value tracer — what it captures, what it refuses, and where."""

import operator
import os

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import triton
import triton.language as tl
from helpers import describe_exit, run_isolated

import fuser
from fuser.trace.tracing import trace

THIS_FILE = os.path.basename(__file__)


def line_of(marker: str) -> int:
    """The line of this file carrying ``marker`` (a trailing comment), so messages can be checked
    against the exact line without hard-coding numbers."""
    with open(__file__) as f:
        hits = [i for i, line in enumerate(f, 1) if line.rstrip().endswith(f"# {marker}")]
    assert len(hits) == 1, f"marker {marker!r} found {len(hits)} times"
    return hits[0]


def assert_refused_at(excinfo, marker: str):
    message = str(excinfo.value)
    location = f"{THIS_FILE}:{line_of(marker)}"
    assert location in message, f"expected {location} in {message!r}"
    return message


def graph_module(module, traced):
    return fx.GraphModule(module, traced.graph)


def call_nodes(traced, op):
    return [n for n in traced.graph.nodes if n.op == op]


# ---------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------


class BranchOnTokens(nn.Module):
    def forward(self, x):
        if x.shape[0] % 2 == 1:  # REFUSE-TOKEN-BRANCH
            return x
        return x * 2


class EarlyExitWithoutTokens(nn.Module):
    def forward(self, x):
        if x.shape[0] == 0 or 0 == x.numel():
            return x
        if not x.size(0) > 0:
            return x
        return x * 2


class BranchOnData(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # REFUSE-DATA-BRANCH
            return x
        return -x


class Item(nn.Module):
    def forward(self, x):
        return x * x.amax().item()  # REFUSE-ITEM


class ToList(nn.Module):
    def forward(self, x):
        return torch.tensor(x.tolist())  # REFUSE-TOLIST


def test_python_branch_on_token_count_is_refused_with_file_and_line():
    with pytest.raises(fuser.TraceRefused) as excinfo:
        trace(BranchOnTokens(), (torch.randn(3, 8),))
    message = assert_refused_at(excinfo, "REFUSE-TOKEN-BRANCH")
    assert "control flow" in message


def test_an_exit_for_zero_tokens_is_specialised_on_tokens():
    """The guard runs no call without tokens, so `if x.shape[0] == 0` is decided: False."""
    traced = trace(EarlyExitWithoutTokens(), (torch.randn(3, 8),))
    ops = [n.target for n in traced.graph.nodes if n.op in ("call_function", "call_method")]
    assert operator.mul in ops  # the x * 2 path was traced
    gm = torch.fx.GraphModule(EarlyExitWithoutTokens(), traced.graph)
    x = torch.randn(5, 8)
    torch.testing.assert_close(gm(x), x * 2)


def test_data_dependent_branch_is_refused():
    with pytest.raises(fuser.TraceRefused) as excinfo:
        trace(BranchOnData(), (torch.randn(3, 8),))
    assert_refused_at(excinfo, "REFUSE-DATA-BRANCH")


@pytest.mark.parametrize("module, marker", [(Item(), "REFUSE-ITEM"), (ToList(), "REFUSE-TOLIST")], ids=["item", "tolist"])
def test_host_reads_are_refused_with_file_and_line(module, marker):
    with pytest.raises(fuser.TraceRefused) as excinfo:
        trace(module, (torch.randn(3, 8),))
    message = assert_refused_at(excinfo, marker)
    assert "host read" in message


class IntOfTheTokenCount(nn.Module):
    def forward(self, x):
        return x.view(int(x.shape[0]), 2, 4).sum(-1)  # REFUSE-INT-SIZE


def test_int_of_the_token_count_is_refused_as_what_it_is():
    with pytest.raises(fuser.TraceRefused) as excinfo:
        trace(IntOfTheTokenCount(), (torch.randn(3, 8),))
    message = assert_refused_at(excinfo, "REFUSE-INT-SIZE")
    assert "int() of a size that follows the batch" in message and "host read" not in message


def test_refusal_does_not_touch_the_inputs():
    x = torch.randn(3, 8)
    before = x.clone()
    with pytest.raises(fuser.TraceRefused):
        trace(BranchOnData(), (x,))
    assert torch.equal(x, before)



class ScaledByPositions(nn.Module):
    def forward(self, x, positions):
        return torch.sigmoid(x * positions) + 1


def test_an_expanded_input_is_taken_and_left_as_it_was():
    """Modeling code passes broadcast views (``position_ids.expand(batch, -1)``): one storage
    element per column, so it can be neither written in place nor written back to."""
    x = torch.randn(3, 8)
    positions = torch.arange(8.0).expand(3, 8)
    module = ScaledByPositions()
    report = fuser.apply(module, (x, positions))
    assert report.launches_after == 1
    torch.testing.assert_close(module(x, positions), torch.sigmoid(x * positions) + 1)
    with pytest.raises(fuser.TraceRefused, match="control flow"):  # the refusal, not the restore's error
        trace(BranchOnData(), (positions,))

# ---------------------------------------------------------------------------------------------
# Branches that trace correctly
# ---------------------------------------------------------------------------------------------


class IsTensor(nn.Module):
    def forward(self, x):
        if isinstance(x, torch.Tensor):
            return x * 2
        return x - 1  # pragma: no cover - the branch the trace must not take


def test_isinstance_tensor_is_true_and_the_graph_takes_that_branch():
    m = IsTensor()
    traced = trace(m, (torch.randn(3, 8),))
    targets = [n.target for n in call_nodes(traced, "call_function")]
    assert targets == [operator.mul]
    x = torch.randn(6, 8)
    assert torch.equal(graph_module(m, traced)(x), x * 2)


def test_torch_compile_after_the_first_trace_of_a_process_sees_the_real_isinstance():
    """The first trace of a process may be where ``torch._dynamo`` is imported (fx imports it to
    record stack traces); Dynamo's table of builtins must not hold the trace's ``isinstance``."""
    run = run_isolated(
        """
        import sys, torch
        from fuser.trace.tracing import trace

        class Double(torch.nn.Module):
            def forward(self, x):
                return x * 2

        assert "torch._dynamo" not in sys.modules
        trace(Double(), (torch.randn(3, 8),))

        @torch.compile(backend="eager", fullgraph=True)
        def f(x):
            return x + 1 if isinstance(x, torch.Tensor) else x

        print(f(torch.zeros(2)).tolist())
        """
    )
    assert run.returncode == 0, describe_exit(run)
    assert run.stdout.strip() == "[1.0, 1.0]"


class StaticBranches(nn.Module):
    def forward(self, x):
        if x.dim() == 2:
            x = x * 3
        else:
            x = x - 100  # pragma: no cover
        if x.shape[-1] == 8:
            return x + 1
        return x - 1  # pragma: no cover


def test_branches_on_static_sizes_trace_correctly():
    m = StaticBranches()
    traced = trace(m, (torch.randn(3, 8),))
    gm = graph_module(m, traced)
    for T in (1, 3, 9):
        x = torch.randn(T, 8)
        assert torch.equal(gm(x), x * 3 + 1)


class ReshapeByTokens(nn.Module):
    def forward(self, x):
        T = x.shape[0]
        return x.reshape(T, 2, 4).sum(-1).reshape(T * 2)


def test_token_count_in_reshape_stays_symbolic():
    m = ReshapeByTokens()
    traced = trace(m, (torch.randn(3, 8),))
    assert traced.batch_inputs == {"x": 0}
    reshapes = [n for n in traced.graph.nodes if n.target == "reshape"]
    # The first reshape takes a size() node, not the literal 3.
    assert any(isinstance(a, fx.Node) for a in reshapes[0].args[1:])
    assert 3 not in reshapes[0].args
    gm = graph_module(m, traced)
    for T in (1, 2, 7, 16):
        x = torch.randn(T, 8)
        out = gm(x)
        assert out.shape == (2 * T,)
        assert torch.equal(out, m(x))


class SizesOneByOne(nn.Module):
    """Factories given the token count as one of their sizes one by one, not in a tuple."""

    def forward(self, x):
        scale = torch.ones(x.shape[0], 1) * 2.0
        shift = torch.zeros(x.size(0), x.size(1), dtype=x.dtype)
        buf = torch.empty(x.shape[0], 8)
        buf[:] = x * scale + shift
        return buf


def test_a_factory_given_a_traced_size_one_by_one_is_traced_with_the_size_symbolic():
    m = SizesOneByOne()
    traced = trace(m, (torch.randn(3, 8),))
    factories = [n for n in traced.graph.nodes if n.target in (torch.ones, torch.zeros, torch.empty)]
    assert factories and all(isinstance(n.args[0], tuple) and isinstance(n.args[0][0], fx.Node) for n in factories)
    assert torch.zeros is torch._C._VariableFunctions.zeros  # the tracing's patch is gone
    gm = graph_module(m, traced)
    for T in (1, 2, 7):
        x = torch.randn(T, 8)
        assert torch.equal(gm(x), m(x))


# ---------------------------------------------------------------------------------------------
# In-place writes
# ---------------------------------------------------------------------------------------------


class AugmentedOnAnInput(nn.Module):
    def forward(self, x, r):
        x += r  # the caller's tensor changes, as in eager
        return x * 2


class AugmentedThroughAView(nn.Module):
    def forward(self, x, r):
        h = x * 2
        left = h[:, :4]
        left *= r[:, :4]  # writes h
        return h + 1


class AugmentedKeepsItsDtype(nn.Module):
    def forward(self, x, r):
        h = x * 2
        h += r.float()  # h stays bf16: in place, no promotion
        return h * 3


class AugmentedOnAFreshValueAndASize(nn.Module):
    def forward(self, x, r):
        h = x * 2
        h += r
        n = x.shape[0]
        n += 1  # an int: n = n + 1
        return h.relu().view(n - 1, -1)


@pytest.mark.parametrize(
    "module", [AugmentedOnAnInput(), AugmentedThroughAView(), AugmentedKeepsItsDtype()], ids=lambda m: type(m).__name__
)
def test_augmented_assignment_on_a_traced_tensor_writes_in_place_as_eager(module):
    x, r = torch.randn(5, 8).bfloat16(), torch.randn(5, 8).bfloat16()
    result = fuser.check(module, (x.clone(), r))
    assert result.ok, result.problems
    fused_x, eager_x = x.clone(), x.clone()
    expected = module(eager_x, r)
    fuser.apply(module, (x.clone(), r))
    try:
        got = module(fused_x, r)
    finally:
        fuser.restore(module)
    assert got.dtype == expected.dtype and torch.allclose(got.float(), expected.float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(fused_x, eager_x)  # the input as eager left it


def test_augmented_assignment_on_a_fresh_value_fuses_as_its_out_of_place_form():
    module = AugmentedOnAFreshValueAndASize()
    x, r = torch.randn(5, 8), torch.randn(5, 8)
    result = fuser.check(module, (x, r))
    assert result.ok, result.problems
    assert result.report.launches_after == 1 and not result.report.unfused, result.report.text()


class Writes(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.zeros(4, 8))

    def forward(self, x):
        x[..., 2:] = x[..., 2:] * 3 + 1
        self.buf.copy_(self.buf * 0.5 + x.sum(0))
        return x * 2 + self.buf.sum(0)


def test_setitem_and_copy_into_a_buffer_are_recorded_and_replayed():
    m = Writes()
    traced = trace(m, (torch.randn(3, 8),))
    nodes = list(traced.graph.nodes)
    setitems = [n for n in nodes if n.op == "call_function" and n.target is operator.setitem]
    copies = [n for n in nodes if n.op == "call_method" and n.target == "copy_"]
    assert len(setitems) == 1 and len(copies) == 1
    assert copies[0].args[0].op == "get_attr" and copies[0].args[0].target == "buf"
    # Program order: the write to x comes before the read that feeds the buffer update.
    assert nodes.index(setitems[0]) < nodes.index(copies[0])

    eager, fx_m = Writes(), Writes()
    for m_ in (eager, fx_m):
        m_.buf.copy_(torch.arange(32.0).view(4, 8))
    gm = graph_module(fx_m, traced)
    for T in (2, 5):
        x = torch.randn(T, 8)
        x_eager, x_fx = x.clone(), x.clone()
        out_eager = eager(x_eager)
        out_fx = gm(x_fx)
        assert torch.equal(out_fx, out_eager)
        assert torch.equal(x_fx, x_eager), "the setitem on the input is replayed"
        assert not torch.equal(x_fx, x)
        assert torch.equal(fx_m.buf, eager.buf), "the copy_ into the buffer is replayed"


# ---------------------------------------------------------------------------------------------
# Triton launches and opaque leaves
# ---------------------------------------------------------------------------------------------


@triton.jit
def _add_one_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)


def add_one(x):
    y = torch.empty_like(x)
    n = x.numel()
    _add_one_kernel[(triton.cdiv(n, 64),)](x, y, n, BLOCK=64)  # LAUNCH
    return y


@fuser.opaque
def add_one_opaque(x):
    return add_one(x)


class DirectLaunch(nn.Module):
    def forward(self, x):
        return add_one(x * 2) * 3


class OpaqueLaunch(nn.Module):
    def forward(self, x):
        return add_one_opaque(x * 2) * 3


def test_a_triton_launch_in_traced_code_is_one_reported_call():
    m = DirectLaunch()
    traced = trace(m, (torch.randn(3, 8),))
    launches = [n for n in traced.graph.nodes if n.op == "call_function" and n.target.__name__ == "launch__add_one_kernel"]
    assert len(launches) == 1
    (leaf,) = traced.automatic_leaves
    assert leaf.name == "Triton kernel _add_one_kernel"
    assert leaf.where == f"{__file__}:{line_of('LAUNCH')}"
    gm = graph_module(m, traced)
    for T in (1, 5):  # the grid follows the token count
        x = torch.randn(T, 8)
        torch.testing.assert_close(gm(x), (x * 2 + 1) * 3)


def test_tracing_a_launch_leaves_triton_as_it_was():
    from triton.runtime.jit import JITFunction

    run_before = JITFunction.run
    trace(DirectLaunch(), (torch.randn(3, 8),))
    assert JITFunction.run is run_before
    x = torch.randn(4, 8)
    torch.testing.assert_close(add_one(x), x + 1)  # still launches outside tracing


def test_a_torch_only_trace_looks_for_no_leaf_functions_and_keeps_no_source_lines():
    """A pattern's reference is traced ``torch_only``: an @fuser.opaque function is not looked
    for among the loaded modules (it is traced into), and no node keeps its line; the default
    trace keeps the function one call and each node's line."""
    default = trace(OpaqueLaunch(), (torch.randn(3, 8),))
    assert [n.target for n in default.graph.nodes if n.op == "call_function"].count(add_one_opaque) == 1
    assert any(n.stack_trace for n in default.graph.nodes)
    plain = trace(OpaqueLaunch(), (torch.randn(3, 8),), torch_only=True)
    targets = [n.target for n in plain.graph.nodes if n.op == "call_function"]
    assert add_one_opaque not in targets and any(getattr(t, "__name__", "") == "launch__add_one_kernel" for t in targets)
    assert not any(n.stack_trace for n in plain.graph.nodes)


def test_opaque_function_with_a_launch_is_one_call_node_and_runs():
    m = OpaqueLaunch()
    traced = trace(m, (torch.randn(3, 8),))
    calls = [n for n in traced.graph.nodes if n.op == "call_function" and n.target is add_one_opaque]
    assert len(calls) == 1
    # Nothing of its inside leaked into the graph.
    assert [n.target for n in traced.graph.nodes if n.op == "call_method"] == []
    gm = graph_module(m, traced)
    for T in (1, 5):
        x = torch.randn(T, 8)
        torch.testing.assert_close(gm(x), (x * 2 + 1) * 3)


@fuser.opaque
class OpaqueBlock(nn.Module):
    def forward(self, x):
        return torch.tanh(x) * 2


class Inner(nn.Module):
    def forward(self, x):
        return torch.sigmoid(x) + 1


class Sub(nn.Module):
    def __init__(self):
        super().__init__()
        self.name = Inner()
        self.other = Inner()


class WithLeaves(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.block = OpaqueBlock()
        self.sub = Sub()

    def forward(self, x):
        x = self.block(self.lin(x))
        return self.sub.other(self.sub.name(x))


def test_linear_and_opaque_classes_are_call_module_leaves():
    m = WithLeaves()
    traced = trace(m, (torch.randn(3, 8),))
    modules = [n.target for n in traced.graph.nodes if n.op == "call_module"]
    assert modules == ["lin", "block"]
    # Not a leaf: sub.name and sub.other are traced through.
    assert sum(1 for n in traced.graph.nodes if n.target is torch.sigmoid) == 2
    x = torch.randn(4, 8)
    torch.testing.assert_close(graph_module(m, traced)(x), m(x), rtol=0, atol=0)


def test_leaves_by_qualified_name():
    m = WithLeaves()
    traced = trace(m, (torch.randn(3, 8),), leaves=["sub.name"])
    modules = [n.target for n in traced.graph.nodes if n.op == "call_module"]
    assert modules == ["lin", "block", "sub.name"]
    assert sum(1 for n in traced.graph.nodes if n.target is torch.sigmoid) == 1  # sub.other only
    x = torch.randn(4, 8)
    torch.testing.assert_close(graph_module(m, traced)(x), m(x), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# CUDA stream switches: refused in traced code, kept inside leaves
# ---------------------------------------------------------------------------------------------
# No CUDA stream or event can be made on the CPU. torch.cuda.stream(None) and set_stream(None) are
# no-ops there, so without the refusal they would trace silently; the Stream and Event methods are
# called on a stand-in, so without the refusal they would fail with an AttributeError instead.


class NotAStream:
    """Stands in for a torch.cuda.Stream or Event."""


def stream_context():
    with torch.cuda.stream(None):  # REFUSE-STREAM-CONTEXT
        pass


def set_stream():
    torch.cuda.set_stream(None)  # REFUSE-SET-STREAM


def wait_stream():
    torch.cuda.Stream.wait_stream(NotAStream(), NotAStream())  # REFUSE-WAIT-STREAM


def wait_event():
    torch.cuda.Stream.wait_event(NotAStream(), NotAStream())  # REFUSE-WAIT-EVENT


def record_event():
    torch.cuda.Stream.record_event(NotAStream())  # REFUSE-RECORD-EVENT


def event_record():
    torch.cuda.Event.record(NotAStream())  # REFUSE-EVENT-RECORD


def event_wait():
    torch.cuda.Event.wait(NotAStream())  # REFUSE-EVENT-WAIT


STREAM_SWITCHES = {
    "stream-context": (stream_context, "REFUSE-STREAM-CONTEXT", "torch.cuda.stream"),
    "set_stream": (set_stream, "REFUSE-SET-STREAM", "set_stream"),
    "wait_stream": (wait_stream, "REFUSE-WAIT-STREAM", "wait_stream"),
    "wait_event": (wait_event, "REFUSE-WAIT-EVENT", "wait_event"),
    "record_event": (record_event, "REFUSE-RECORD-EVENT", "record_event"),
    "Event.record": (event_record, "REFUSE-EVENT-RECORD", "Event.record"),
    "Event.wait": (event_wait, "REFUSE-EVENT-WAIT", "Event.wait"),
}
PATCHED = [
    (torch.cuda.StreamContext, "__enter__"), (torch.cuda, "set_stream"), (torch.cuda.Stream, "wait_stream"),
    (torch.cuda.Stream, "wait_event"), (torch.cuda.Stream, "record_event"), (torch.cuda.Event, "record"),
    (torch.cuda.Event, "wait"),
]  # fmt: skip


class SwitchesStreams(nn.Module):
    def __init__(self, switch):
        super().__init__()
        self.switch = switch

    def forward(self, x):
        y = x * 2
        self.switch()
        return y + 1


@pytest.mark.parametrize("name", sorted(STREAM_SWITCHES))
def test_stream_switch_in_traced_code_is_refused_suggesting_a_leaf(name):
    switch, marker, what = STREAM_SWITCHES[name]
    before = [vars(owner)[attr] for owner, attr in PATCHED]
    with pytest.raises(fuser.TraceRefused) as excinfo:
        trace(SwitchesStreams(switch), (torch.randn(3, 8),))
    message = assert_refused_at(excinfo, marker)
    assert what in message and "stream" in message
    assert "@fuser.opaque" in message
    assert [vars(owner)[attr] for owner, attr in PATCHED] == before, "left patched after tracing"


@fuser.opaque
class SideStreamLeaf(nn.Module):
    """Forks onto another stream and joins back, as sglang's shared expert does in capture mode."""

    def forward(self, x):
        alt, cur = NotAStream(), NotAStream()
        torch.cuda.Stream.wait_stream(alt, cur)
        with torch.cuda.stream(None):
            torch.cuda.set_stream(None)
            y = torch.tanh(x)
            torch.cuda.Stream.record_event(alt)
            torch.cuda.Event.record(alt)
        torch.cuda.Stream.wait_event(cur, alt)
        torch.cuda.Event.wait(alt)
        return y


class WithSideStreamLeaf(nn.Module):
    def __init__(self):
        super().__init__()
        self.side = SideStreamLeaf()

    def forward(self, x):
        return self.side(x * 2) + 1


def test_stream_switches_inside_a_leaf_run_while_tracing_and_at_run_time(monkeypatch):
    # Spies stand in for the CUDA calls (no CUDA here); the tracer's guards wrap them.
    calls = []
    for owner, attr in PATCHED:
        monkeypatch.setattr(owner, attr, lambda *args, __attr=attr, **kwargs: calls.append(__attr))
    m = WithSideStreamLeaf()
    traced = trace(m, (torch.randn(3, 8),))
    assert [n.target for n in traced.graph.nodes if n.op == "call_module"] == ["side"]
    assert sorted(calls) == sorted([attr for _, attr in PATCHED] * 2), "the leaf runs once per shadow"
    calls.clear()
    x = torch.randn(4, 8)
    torch.testing.assert_close(graph_module(m, traced)(x), torch.tanh(x * 2) + 1)
    assert sorted(calls) == sorted(attr for _, attr in PATCHED)


# ---------------------------------------------------------------------------------------------
# State after tracing
# ---------------------------------------------------------------------------------------------


class MutatesInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("state", torch.ones(8))

    def forward(self, x):
        self.count.add_(1)
        self.state.mul_(2)
        return x * self.state


def test_buffers_mutated_in_place_are_restored_after_tracing():
    m = MutatesInPlace()
    buffers = dict(m.named_buffers())
    before = {k: v.clone() for k, v in buffers.items()}
    x = torch.randn(3, 8)
    x_before = x.clone()
    trace(m, (x,))
    for name, buf in m.named_buffers():
        assert buf is buffers[name], f"{name} was replaced"
        assert torch.equal(buf, before[name]), f"{name} changed"
    assert torch.equal(x, x_before)


class RebindsBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count += 1
        return x * self.count


def test_buffer_rebound_in_forward_is_refused_and_left_intact():
    m = RebindsBuffer()
    count = m.count
    with pytest.raises(fuser.TraceRefused, match="assigning a traced value to module attribute 'count'") as error:
        trace(m, (torch.randn(3, 8),))
    assert "test_trace.py" in str(error.value)
    assert m.count is count
    assert type(m.count) is torch.Tensor and torch.equal(m.count, torch.zeros(()))
