"""trace: capture a module's forward into a torch.fx graph, outside torch.compile.

Why this approach. ``torch.fx.symbolic_trace`` keeps torch-level ops (``x.mean(-1)``,
``torch.rsqrt``) and lets leaves stay opaque calls to the original code, which is what the
matcher and the splice need; ``make_fx`` and ``torch.export`` lower to aten (and export runs
Dynamo), specialise shapes silently and cannot keep arbitrary Python as a leaf. Plain symbolic
tracing, however, knows nothing about shapes: ``isinstance(x, torch.Tensor)`` is silently False
for a proxy and every ``if x.dim() == 2`` fails.

So the tracer here *shadows* every traced value with two real values, obtained by running each
op eagerly on the example inputs at two batch sizes (T and T+1). From the pair it knows each
value's type, dtype, device and which dimensions follow the batch:

* a static dimension (equal in both shadows) reads as a plain ``int``: branches on it trace
  correctly and the splice's guard pins it;
* a batch dimension reads as a proxy (``x.size(0)``), so one trace serves every batch size,
  and a Python branch on it is refused;
* ``isinstance`` sees the shadow's type; ``.item()``, ``.tolist()``, iteration over the batch
  and CUDA stream switches are refused with the file and line that did it.

Nothing is ever dropped silently. A function or submodule whose code cannot be traced (a
refusal above, or any error its code raises on proxies) becomes an opaque leaf and the trace
starts again around it; custom ops, Triton launches and C extensions' functions are kept as one
call where they are (:mod:`fuser.trace.leaves`). Each is listed in ``Traced.automatic_leaves`` with
the file, line and reason; what the traced module's own forward cannot trace raises
:class:`TraceRefused`.
"""

from __future__ import annotations

import operator
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.fx as fx

from fuser.trace import in_place_idioms as idioms
from fuser.trace.attention_calls import AttentionRewrite, rewrite_attention_calls
from fuser.trace.leaves import AutomaticLeaf, compiled_functions, leaf_after, opaque_functions
from fuser.trace.per_slice_norms import per_slice_norms
from fuser.trace.repeated_rows import repeated_rows
from fuser.trace.tracer import ShadowTracer
from fuser.trace.token_dims import batch_dims_of, grown as grown_inputs, held_inputs_hint, infer_batch_inputs, rows_per_token
from fuser.trace.call_spec import CallSpec, StateRead, copy_state
from fuser.trace.state_objects import input_aliases
from fuser.trace.refusal import UNKNOWN_LOCATION, TraceRefused, error_location, first_line

_TRACE_LOCK = threading.RLock()


@dataclass
class Traced:
    """The traced graph of a module, with what the shadows told about every node."""

    root: torch.nn.Module
    graph: fx.Graph
    input_names: list[str]
    batch_inputs: dict[str, int]  # placeholder name -> its batch dim
    example_inputs: tuple
    # node name -> (value at T, value at T+1); tensors keep their real data.
    shadows: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    call: CallSpec | None = None  # how a call of the forward maps to the graph's inputs
    automatic_leaves: list[AutomaticLeaf] = field(default_factory=list)
    # values the traced code was given as themselves (a tensor made from Python values, a
    # dataclass config), read by the graph as attributes (fx's ``_tensor_constant<i>``): held
    # here, not on the module, until the fused forward is installed with them
    constants: dict[str, Any] = field(default_factory=dict)
    # what the traced code read off its state objects (``forward_batch.forward_mode``): the
    # guard compares each at every call
    state_reads: list[StateRead] = field(default_factory=list)
    # sdpa calls whose arguments the trace rewrote (fuser.trace.attention_calls)
    attention_calls: list[AttentionRewrite] = field(default_factory=list)
    # placeholder name -> rows of its batch dim per token, where more than one (an ALiBi bias's
    # heads: fuser.trace.token_dims)
    batch_rows: dict[str, int] = field(default_factory=dict)
    # branches on the token count taken as traced (``if x.shape[0] >= 1024``): the guard runs
    # the fused forward only for the counts where each answer holds (fuser.trace.proxy.TokenRange)
    token_ranges: list = field(default_factory=list)

    def value(self, node: fx.Node) -> Any:
        return self.shadows[node.name][0]

    def graph_module(self, root: torch.nn.Module | None = None) -> fx.GraphModule:
        """The graph as a module that runs it on the parameters of ``root`` (by default the
        traced module) and the constants."""
        root = self.root if root is None else root
        for name, value in self.constants.items():
            object.__setattr__(root, name, value)
        try:
            return fx.GraphModule(root, self.graph)
        finally:
            for name in self.constants:
                root.__dict__.pop(name, None)

    def fresh_inputs(self, inputs: Sequence[Any] | None = None) -> tuple:
        """The graph's inputs (the example's, by default) to run it on: state objects (a KV
        cache) copied anew, so that a run never changes the caller's."""
        states = self.call.states if self.call is not None else ()
        values = self.example_inputs if inputs is None else inputs
        return tuple(copy_state(v) if n in states else v for n, v in zip(self.input_names, values))

    def batch_dims(self, node: fx.Node) -> tuple[int, ...]:
        """Dimensions of ``node``'s tensor value that follow the batch size."""
        a, b = self.shadows[node.name]
        if not isinstance(a, torch.Tensor):
            return ()
        return tuple(i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y)


def forward_of(root) -> Callable:
    return root.forward if isinstance(root, torch.nn.Module) else root


def default_batch_inputs(names: Sequence[str], inputs: Sequence[Any]) -> dict[str, int]:
    """The inputs that follow the tokens, and along which dim, read off the example
    (:func:`fuser.trace.token_dims.infer_batch_inputs`)."""
    return infer_batch_inputs(names, inputs)


def trace(
    module: torch.nn.Module | Callable,
    example_inputs: Sequence[Any],
    *,
    example_kwargs: dict[str, Any] | None = None,
    leaves: Iterable[str | type | Callable | torch.nn.Module] = (),
    batch_inputs: dict[str, int] | None = None,
    rewrites: Sequence[Callable] | None = None,
    torch_only: bool = False,
) -> Traced:
    """Trace ``module.forward`` (or a plain function) with the token dimension symbolic.

    The example call is ``module(*example_inputs, **example_kwargs)``; every tensor in it
    (nested in tuples, lists and dicts too) becomes a graph input, and every other value is
    baked in (:mod:`fuser.trace.call_spec`). ``leaves`` adds opaque leaves: submodule qualified
    names, module classes, functions or submodule instances (kept opaque by identity, whatever
    their name: :func:`fuser.trace.leaves.resolve_leaves` reads a user's names into them). A
    submodule whose forward cannot be traced becomes a leaf by
    itself, and so is each call into compiled code (listed in ``Traced.automatic_leaves``;
    :mod:`fuser.trace.leaves`); only code of the traced forward itself is refused. ``batch_inputs``
    maps forward parameter names (or graph input names) to their batch dim (default: read off
    the example, :func:`fuser.trace.token_dims.infer_batch_inputs`). Buffers the forward
    mutates are restored. ``rewrites``: the graph rewrites the trace ends with, in order (default :data:`REWRITES`, all of them; the pipeline
    passes those its pass list has switched on, :mod:`fuser.pipeline.pass_list`). ``torch_only``:
    the traced code calls torch alone (a pattern's reference), so no leaf functions are looked
    for among the loaded modules and no node keeps its source line — the two cost more than
    tracing a small function.
    """
    rewrites = REWRITES if rewrites is None else tuple(rewrites)
    example_inputs = tuple(example_inputs)
    example_kwargs = dict(example_kwargs or {})
    if isinstance(module, torch.nn.Module) and "forward" in module.__dict__:
        raise TraceRefused(
            f"{type(module).__name__} has a forward set on the instance (a wrapper, or fuser's own); "
            "fuser traces the class's forward and would drop it. Remove it (or fuser.restore()) first."
        )
    try:
        call = CallSpec.of(forward_of(module), example_inputs, example_kwargs)
    except TypeError as e:
        raise ValueError(f"the example inputs do not fit {_qualname(module)}.forward: {e}") from None
    tensors, _ = call.flatten(example_inputs, example_kwargs)
    batch = batch_dims_of(call, tensors, batch_inputs)
    rows = rows_per_token(call.names, tensors, batch)
    aliases = input_aliases(call.names, tensors, call.states)  # before the state is copied
    # State (a KV cache) is never touched: the graph's example keeps a copy, the shadows another.
    pristine = [copy_state(v) if n in call.states else v for n, v in zip(call.names, tensors)]
    leaves = list(leaves)
    modules = [x for x in leaves if isinstance(x, torch.nn.Module)]
    functions = [x for x in leaves if callable(x) and not isinstance(x, (type, torch.nn.Module))]
    functions += [] if torch_only else opaque_functions()
    compiled = [] if torch_only else compiled_functions()
    automatic: list[AutomaticLeaf] = []
    counters: set[tuple] = set()
    attributes = set(vars(module)) if isinstance(module, torch.nn.Module) else set()
    while True:
        # Each attempt runs on fresh copies of the state: one that stopped part way (a leaf to
        # make) may have written into its copy already (a cache's update).
        tensors = [copy_state(v) if n in call.states else v for n, v in zip(call.names, pristine)]
        grown = grown_inputs(call.names, tensors, batch, rows)
        tracer = ShadowTracer(
            leaf_names=[x for x in leaves if isinstance(x, str)] + [a.name for a in automatic if a.function is None],
            leaf_types=[x for x in leaves if isinstance(x, type)],
            leaf_functions=functions + [a.function for a in automatic if a.function is not None],
            counters=counters,
            leaf_modules=modules,
            compiled_leaves=compiled,
        )
        tracer.record_stack_traces = not torch_only  # each node's source line, for the report (refusal.source_of)
        # Tracing patches process-wide hooks (isinstance, Module.__setattr__, Triton's launcher):
        # one trace at a time, so concurrent apply() calls never see each other's patches.
        try:
            with _TRACE_LOCK, preserved_state(module, tensors), torch.no_grad():
                graph = tracer.trace_with_shadows(module, call, tensors, grown, aliases,
                                                 token_count(tensors, token_input(call.names, tensors, batch, rows)))
            changed = _getters_changed(tracer.state_reads.values(), dict(zip(call.names, tensors)))
            if not changed:
                break
            # A getter the forward changed (a length the forward moves on): traced again with it
            # a leaf, on fresh copies of the state.
            counters |= changed
        except Exception as e:  # noqa: BLE001 - untraceable code becomes a leaf: fuser.trace.leaves
            leaf = leaf_after(e, automatic)
            if leaf is None:
                raise refused(e, held_inputs_hint(call.names, tensors, batch)) from e
            automatic.append(leaf)
        finally:
            constants = _constants_taken_off(module, attributes)
    state = [*module.parameters(), *module.buffers()] if isinstance(module, torch.nn.Module) else []
    attention: list[AttentionRewrite] = []
    for rewrite in rewrites:
        attention += rewrite(graph, tracer.shadows, state)
    _drop_unused_reads(graph)  # and those of the repeats the rewrites removed
    return Traced(
        root=module,
        graph=graph,
        input_names=list(call.names),
        batch_inputs=batch,
        batch_rows=rows,
        example_inputs=tuple(pristine),
        shadows=tracer.shadows,
        call=call,
        automatic_leaves=automatic + tracer.noted,
        constants=constants,
        state_reads=list(tracer.state_reads.values()),
        attention_calls=attention,
        token_ranges=list(tracer.token_ranges),
    )


def token_input(names: Sequence[str], inputs: Sequence[Any], batch: dict[str, int], rows: dict[str, int]) -> tuple[int, int, int] | None:
    """Where a call's token count is read: (the position of its first batch input, that input's
    batch dim, its rows per token); None where no input follows the tokens."""
    for i, (name, value) in enumerate(zip(names, inputs)):
        if name in batch and isinstance(value, torch.Tensor):
            return i, batch[name], rows.get(name, 1)
    return None


def token_count(inputs: Sequence[Any], where: tuple[int, int, int] | None) -> int | None:
    """The call's token count, read where :func:`token_input` says."""
    if where is None:
        return None
    i, dim, rows = where
    return inputs[i].shape[dim] // rows


def refused(error: Exception, hint: str = "") -> TraceRefused:
    """What the traced forward's own code could not trace, as a refusal naming the user's line
    (``file:line``), with ``hint`` (the inputs held at their sizes) after it. A refusal is
    given back as it is where there is no hint."""
    if isinstance(error, TraceRefused) and not hint:
        return error
    message = first_line(error)
    if not isinstance(error, TraceRefused):
        where = error_location(error)
        message = f"{where}: {type(error).__name__}: {message}" if where != UNKNOWN_LOCATION else f"{type(error).__name__}: {message}"
    found = TraceRefused(message + hint)
    found.location = error_location(error)
    # The error's own frames, so that what locates a failure by them (a pattern file's
    # reference: fuser.match.pattern_files) finds the same line.
    return found.with_traceback(error.__traceback__)


def in_place_idioms(graph: fx.Graph, shadows: dict, state: list) -> list:
    """Trace rewrite: in-place spellings of a value as one functional op
    (:mod:`fuser.trace.in_place_idioms`); changes nothing the report lists."""
    idioms.rewrite(graph, shadows, state)
    return []


def attention_calls(graph: fx.Graph, shadows: dict, state: list) -> list[AttentionRewrite]:
    """Trace rewrite: sdpa calls and eager-attention products given their arguments as they
    were made (:mod:`fuser.trace.attention_calls`); a record per call changed."""
    _drop_unused_reads(graph)  # a size read nobody uses would keep a repeat alive
    return rewrite_attention_calls(graph, shadows)


#: The graph rewrites a trace ends with, in order: each takes the graph, the shadows and the
#: module's parameters and buffers, and returns the attention calls it changed. The pipeline's
#: pass list (:mod:`fuser.pipeline.pass_list`) names them in this order (a test keeps the two so).
REWRITES: tuple[Callable, ...] = (in_place_idioms, attention_calls, per_slice_norms, repeated_rows)


def _getters_changed(reads: Iterable[StateRead], values: dict[str, Any]) -> set[tuple]:
    """The getters read as values (:class:`StateRead` with a call) that give another value
    after the traced forward ran on the state: (state, path) of each."""
    return {(r.state, r.path) for r in reads if r.call is not None and r.differs(values[r.state]) is not None}


def _constants_taken_off(module, attributes: set[str]) -> dict[str, Any]:
    """The values fx stowed on ``module`` during the trace (``_tensor_constant<i>``: values
    the traced code was given as themselves), removed from it: the trace leaves the module as
    it was, and the fused forward is installed with them."""
    if not isinstance(module, torch.nn.Module):
        return {}
    return {name: module.__dict__.pop(name) for name in set(vars(module)) - attributes}


def _qualname(module) -> str:
    return (
        type(module).__name__ if isinstance(module, torch.nn.Module) else getattr(module, "__qualname__", str(module))
    )


def _drop_unused_reads(graph: fx.Graph) -> None:
    """``x.shape`` asks every dim's size; the reads nobody used would count as uses of x. A
    view, a part or a range nobody used (``torch.arange(n)[:, None]`` made for a branch not
    taken) would cost launches of its own: they are dropped too."""
    for node in reversed(list(graph.nodes)):
        if not node.users and _is_unused_read(node):
            graph.erase_node(node)


def _is_unused_read(node: fx.Node) -> bool:
    if node.op == "call_method":
        return _is_size(node)
    if node.op == "call_function" and node.target in _SIZE_TESTS:
        # a test of sizes Python decided while tracing (``kv.shape[2] > mask.shape[-1]`` of a
        # cache's length, read at run time): nothing reads it, and its literal is no size
        return all(_is_size(a) for a in node.all_input_nodes)
    return node.op == "call_function" and (node.target is operator.getitem or node.target is torch.arange)


_SIZE_TESTS = (operator.gt, operator.ge, operator.lt, operator.le, operator.eq, operator.ne)


def _is_size(node: fx.Node) -> bool:
    return node.op == "call_method" and node.target in ("size", "numel", "dim")


class preserved_state:
    """Snapshot a module's buffers and the tensor inputs; put them back on exit (in place)."""

    def __init__(self, module: torch.nn.Module, inputs: Iterable[Any] = ()):
        buffers = list(module.buffers()) if isinstance(module, torch.nn.Module) else []
        self.tensors = buffers + [x for x in inputs if isinstance(x, torch.Tensor)]

    def __enter__(self):
        self.saved = [t.detach().clone() for t in self.tensors]
        return self

    def __exit__(self, *exc):
        with torch.no_grad():
            for t, saved in zip(self.tensors, self.saved):
                if not t.is_meta and not torch.equal(t, saved):  # (an expanded input, never written, cannot be)
                    t.copy_(saved)
        return False
