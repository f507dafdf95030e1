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
call where they are (:mod:`fuser.leaves`). Each is listed in ``Traced.automatic_leaves`` with
the file, line and reason; what the traced module's own forward cannot trace raises
:class:`TraceRefused`.
"""

from __future__ import annotations

import builtins
import dataclasses
import operator
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate
from torch.utils import _pytree as pytree

from fuser import idioms
from fuser.leaves import (
    LEAF,
    AutomaticLeaf,
    compiled_functions,
    custom_op,
    kernel_launches_as_leaves,
    leaf_after,
    opaque_functions,
    patched_leaf_functions,
)
from fuser.opaque import is_opaque
from fuser.signature import CallSpec, StateRead, copy_state, read_as_value
from fuser.where import TraceRefused, calling_line, error_location, is_library_file, refuse

# Module types kept opaque whatever the user says: the heavy ops of a decode layer.
DEFAULT_LEAF_TYPES: tuple[type, ...] = (torch.nn.Linear, torch.nn.Embedding)

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


class ShadowProxy(fx.Proxy):
    """A proxy that also carries the two real values the node takes."""

    shadow: tuple[Any, Any]

    # --- metadata reads: static answers where both shadows agree ---------------------------
    def _tensor(self) -> torch.Tensor:
        value = self.shadow[0]
        if not isinstance(value, torch.Tensor):
            raise refuse(f"tensor metadata asked of a {type(value).__name__}", "")
        return value

    def size(self, dim: int | None = None):
        a, b = self.shadow
        if dim is None:
            return tuple(self.size(i) for i in range(a.dim()))
        if a.shape[dim] == b.shape[dim]:
            return int(a.shape[dim])
        return self.tracer.create_proxy("call_method", "size", (self, dim), {})

    @property
    def shape(self):
        return self.size()

    def dim(self) -> int:
        return self._tensor().dim()

    ndimension = dim

    @property
    def ndim(self) -> int:
        return self._tensor().dim()

    @property
    def dtype(self):
        return self._tensor().dtype

    @property
    def device(self):
        return self._tensor().device

    @property
    def is_cuda(self) -> bool:
        return self._tensor().is_cuda

    def numel(self):
        a, b = self.shadow
        if a.numel() == b.numel():
            return a.numel()
        return self.tracer.create_proxy("call_method", "numel", (self,), {})

    def is_contiguous(self, *args, **kwargs) -> bool:
        a, b = self.shadow
        answer = a.is_contiguous(*args, **kwargs)
        if answer != b.is_contiguous(*args, **kwargs):
            raise refuse("is_contiguous() depends on the batch size", "Make the layout static.")
        return answer

    # --- what cannot be traced ---------------------------------------------------------------
    def __bool__(self):
        answer = _decided_for_any_tokens(self.node)
        if answer is not None:
            return answer  # `if x.shape[0] == 0: return ...`: the guard runs no call without tokens
        raise refuse(
            "Python control flow on a traced value (it depends on the batch size or on tensor data)",
            "Branch on static sizes only, or move this code into an opaque leaf (@fuser.opaque).",
        )

    def __len__(self):
        value = self.shadow[0]
        if isinstance(value, (tuple, list)):
            return len(value)
        size = self.size(0)
        if isinstance(size, int):
            return size
        raise refuse("len() of a tensor whose first dim is the batch", "Use x.shape[0] in tensor ops.")

    def __iter__(self):
        value = self.shadow[0]
        if isinstance(value, (tuple, list)):
            return iter([self[i] for i in range(len(value))])
        raise refuse("iteration over a traced tensor", "Index it explicitly or make it an opaque leaf.")

    def _host_sync(self, *args, **kwargs):
        raise refuse(
            "a host read of a traced tensor (.item()/.tolist()/data_ptr(); a sync the graph cannot replay)",
            "Keep it on the device, or move this code into an opaque leaf (@fuser.opaque).",
        )

    item = tolist = numpy = data_ptr = __int__ = __float__ = __index__ = _host_sync

    def __setitem__(self, index, value):
        self.tracer.create_proxy("call_function", operator.setitem, (self, index, value), {})

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)  # private probes (e.g. Parameter's _is_param)
        value = self.shadow[0] if "shadow" in self.__dict__ else None
        attr = getattr(value, name, None)
        if self.node in self.tracer.state_paths and hasattr(value, name) and not callable(attr):
            return self.tracer.read_state(self, name, attr)
        if callable(attr) or attr is None:
            return super().__getattr__(name)  # a method: an fx Attribute, called later
        return self.tracer.create_proxy("call_function", builtins.getattr, (self, name), {})


_COMPARISONS = (operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge)


def _decided_for_any_tokens(node: fx.Node) -> bool | None:
    """The answer of ``size op c`` (a token count ``x.shape[0]`` or ``x.numel()`` against an int
    constant) when it is the same for every count from one token up; else None."""
    if node.op != "call_function" or node.target not in _COMPARISONS or len(node.args) != 2:
        return None
    a, b = node.args
    flipped = not isinstance(a, fx.Node)
    size, constant = (b, a) if flipped else (a, b)
    counts = isinstance(size, fx.Node) and size.op == "call_method" and size.target in ("size", "numel")
    if not counts or isinstance(constant, bool) or not isinstance(constant, int):
        return None
    answers = {node.target(constant, n) if flipped else node.target(n, constant) for n in (1, 1 << 40)}
    return answers.pop() if len(answers) == 1 and constant <= 1 else None


def _run_node(kind: str, target, args, kwargs, root: torch.nn.Module):
    if kind == "call_function":
        return target(*args, **kwargs)
    if kind == "call_method":
        return getattr(args[0], target)(*args[1:], **kwargs)
    if kind == "call_module":
        return root.get_submodule(target)(*args, **kwargs)
    if kind == "get_attr":
        obj = root
        for part in target.split("."):
            obj = getattr(obj, part)
        return obj
    raise AssertionError(kind)


def _holds_proxies(value) -> bool:
    """Does a dataclass hold a traced value in a field (or inside a tuple, list or dict there)?"""
    fields = [getattr(value, f.name, None) for f in dataclasses.fields(value)]
    return any(isinstance(leaf, fx.Proxy) for leaf in pytree.tree_leaves(fields))


class ShadowTracer(fx.Tracer):
    """fx tracer with shadow values, an opaque-leaf policy and refusals with locations."""

    def __init__(
        self,
        leaf_names: Iterable[str] = (),
        leaf_types: Sequence[type] = (),
        leaf_functions: Sequence[Callable] = (),
    ):
        super().__init__(param_shapes_constant=True)
        self.leaf_functions = list(leaf_functions)  # patched where they are held: fuser.leaves
        self.noted: list[AutomaticLeaf] = []  # calls into compiled code, kept as one call each
        self.leaf_names = set(leaf_names)
        self.leaf_types = tuple(DEFAULT_LEAF_TYPES) + tuple(leaf_types)
        self.shadows: dict[str, tuple[Any, Any]] = {}
        self._placeholder_values: dict[str, tuple[Any, Any]] = {}
        self._eager_depth = 0
        self._attr_names: dict[int, str] = {}
        self._states: frozenset = frozenset()  # placeholders that are state (fuser.signature)
        # state placeholders and the objects read off them -> (state name, attribute path)
        self.state_paths: dict[fx.Node, tuple[str, tuple[str, ...]]] = {}
        self.state_reads: dict[tuple[str, tuple[str, ...]], StateRead] = {}

    # --- leaf policy -------------------------------------------------------------------------
    def is_leaf_module(self, m: torch.nn.Module, qualified_name: str) -> bool:
        return qualified_name in self.leaf_names or isinstance(m, self.leaf_types) or is_opaque(type(m)) or is_opaque(m)

    def call_module(self, m, forward, args, kwargs):
        if self._eager_depth:
            return forward(*args, **kwargs)
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as e:
            # The innermost submodule the error came out of: trace() may keep it opaque.
            path = self.path_of_module(m)
            if not hasattr(e, "_fuser_submodule") and not self.is_leaf_module(m, path):
                e._fuser_submodule = path
                e._fuser_where = error_location(e)
            raise

    def create_arg(self, a):
        if issubclass(type(a), fx.Proxy):  # before fx's own isinstance() probes
            return a.node
        if isinstance(a, torch.nn.Module) and not self._eager_depth:
            # A submodule passed to a function (transformers' attention interface takes the
            # attention module): an attribute read, with the module as its shadow value.
            return self.create_proxy("get_attr", self.path_of_module(a), (), {}).node
        dataclass = dataclasses.is_dataclass(a) and not isinstance(a, type) and not self._eager_depth
        if dataclass and _holds_proxies(a):
            # A dataclass holding traced values (a model's output, transformers' ModelOutput,
            # which fx would take for a plain dict): built in the graph from its fields.
            fields = {f.name: self.create_arg(getattr(a, f.name)) for f in dataclasses.fields(a) if f.init}
            node = self.create_node("call_function", type(a), (), fields)
        elif dataclass:
            # A dataclass given as itself (transformers' config): fx would build it again in
            # the graph, running its __init__ at every call; it is read as the object instead.
            name = self.get_fresh_qualname("_constant_")
            setattr(self.root, name, a)
            node = self.create_node("get_attr", name, (), {})
        else:
            node = super().create_arg(a)
        if isinstance(node, fx.Node) and node.name not in self.shadows:
            # A value given as itself (a tensor the code made, a parameter passed as it is, a
            # named tuple): fx reads it as an attribute or builds it in the graph; it is the
            # same value at T and T+1.
            self.shadows[node.name] = (a, a)
        return node

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        if self._eager_depth or not isinstance(attr_val, torch.Tensor):
            return attr_val
        name = self._attr_names.get(id(attr_val))
        if name is None:
            return attr_val
        if name not in parameter_proxy_cache:
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
        return parameter_proxy_cache[name]

    def read_state(self, proxy: "ShadowProxy", name: str, value: Any):
        """``state.name`` in traced code. A value (a mode, a flag, a count, None) is taken as it
        is, so a branch on it traces; a tensor is read at run time from the call's object, its
        shape as traced; another object is read at run time too, and what is read off it is a
        state read in turn. Each value and tensor read is compared by the guard at every call."""
        state, path = self.state_paths[proxy.node]
        path = (*path, name)
        if read_as_value(value):
            self.state_reads[state, path] = StateRead(state, path, value)
            return value
        read = self.create_proxy("call_function", builtins.getattr, (proxy, name), {})
        if isinstance(value, torch.Tensor):
            spec = (value.dtype, value.device, tuple(value.shape))
            self.state_reads[state, path] = StateRead(state, path, spec, tensor=True)
        else:
            self.state_paths[read.node] = (state, path)
        return read

    def note(self, leaf: AutomaticLeaf) -> None:
        """Record a call kept opaque by itself (once per callee and line)."""
        if not any(a.name == leaf.name and a.where == leaf.where for a in self.noted):
            self.noted.append(leaf)

    # --- proxies carry shadows ---------------------------------------------------------------
    def proxy(self, node: fx.Node) -> fx.Proxy:
        return ShadowProxy(node, self)

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr)
        if kind == "output":
            return proxy
        if kind == "call_function" and (leaf := custom_op(target)) is not None:
            self.note(leaf)
        state = self._state_taken(args, kwargs)
        if kind == "placeholder":
            # A parameter the example does not pass is baked at its default (fx's concrete_args).
            default = args[0] if args else None
            shadow = self._placeholder_values.get(target, (default, default))
            if target in self._states:
                self.state_paths[proxy.node] = (target, ())
        elif state is not None:
            # A call given state (``past_key_values.update(k, v, i)``) is a leaf. The state is
            # one object of the example's batch: the call runs once, and its result at T+1 is
            # its result at T grown where its tensor arguments grow. (An attribute read off it
            # is one too, not worth a line of the report: fuser.signature.StateRead.)
            proxy.node.meta[LEAF] = True
            if target is not builtins.getattr:
                what = f"{state}.{target}" if kind == "call_method" else getattr(target, "__name__", str(target))
                self.note(AutomaticLeaf(what, calling_line(), f"takes `{state}`, state the graph passes through"))
            at_t = self._eager(kind, target, args, kwargs, 0)
            shadow = (at_t, _grown_like(at_t, args, kwargs))
        else:
            shadow = tuple(self._eager(kind, target, args, kwargs, i) for i in (0, 1))
        proxy.shadow = shadow
        self.shadows[proxy.node.name] = shadow
        return proxy

    def _state_taken(self, args, kwargs) -> str | None:
        """The name of the state placeholder among a call's arguments, if any."""
        found = []
        map_aggregate((args, kwargs), lambda a: found.append(self.state_paths[a.node][0]) if _is_state_proxy(a, self.state_paths) else None)
        return found[0] if found else None

    def _eager(self, kind, target, args, kwargs, which: int):
        def pick(a):
            return a.shadow[which] if isinstance(a, ShadowProxy) else a

        args = map_aggregate(args, pick)
        kwargs = map_aggregate(kwargs, pick)
        self._eager_depth += 1
        try:
            return _run_node(kind, target, args, kwargs, self.root)
        finally:
            self._eager_depth -= 1

    # --- the call: one placeholder per tensor of the example call ----------------------------
    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        """Placeholders for the example call's tensors (see :mod:`fuser.signature`); everything
        else in the call — ``None``, flags, the structure of tuples and dicts — is baked in."""
        proxies = [self.create_proxy("placeholder", name, (), {}) for name in self._call.names]
        args, kwargs = self._call.rebuild(proxies)
        root = self.root

        def traced_call():
            return root_fn(root, *args, **kwargs) if is_module else root_fn(*args, **kwargs)

        return traced_call, []

    def trace_with_shadows(self, root, call: CallSpec, inputs_a: tuple, inputs_b: tuple) -> fx.Graph:
        """Trace ``root`` (a module or a plain function) on inputs at batch sizes T and T+1."""
        self._attr_names = {}
        if isinstance(root, torch.nn.Module):
            for name, t in list(root.named_parameters(remove_duplicate=False)) + list(
                root.named_buffers(remove_duplicate=False)
            ):
                self._attr_names.setdefault(id(t), name)
        self._call = call
        self._states = call.states
        self._placeholder_values = {n: (a, b) for n, a, b in zip(call.names, inputs_a, inputs_b)}
        with (
            patched_leaf_functions(self.leaf_functions, compiled_functions()),
            kernel_launches_as_leaves(),
            _refuse_stream_switches(self),
            _refuse_module_rebinding(),
            _shadow_isinstance(),
        ):
            return self.trace(root)


class _refuse_stream_switches:
    """While tracing, a CUDA stream switch in traced code raises instead of running.

    The fused forward is one sequence of calls on the caller's stream: a fork onto another
    stream, or a wait between streams, would be run once here and lost from the graph. Leaves
    keep them: a leaf runs its own code at run time, and while tracing it runs eagerly (for the
    shadow values) with the tracer's eager depth set, which lets these calls through. Only
    calls from user code on the tracing thread are refused.
    """

    # (owner, attribute, what the message calls it)
    TARGETS = (
        (torch.cuda.StreamContext, "__enter__", "torch.cuda.stream(...)"),
        (torch.cuda, "set_stream", "torch.cuda.set_stream"),
        (torch.cuda.Stream, "wait_stream", "Stream.wait_stream"),
        (torch.cuda.Stream, "wait_event", "Stream.wait_event"),
        (torch.cuda.Stream, "record_event", "Stream.record_event"),
        (torch.cuda.Event, "record", "Event.record"),
        (torch.cuda.Event, "wait", "Event.wait"),
    )

    def __init__(self, tracer: ShadowTracer):
        self.tracer = tracer

    def __enter__(self):
        self._patched = []
        tracer, thread = self.tracer, threading.get_ident()
        for owner, name, what in self.TARGETS:
            original = vars(owner).get(name)
            if original is None:
                continue

            def guarded(*args, __original=original, __what=what, **kwargs):
                caller = sys._getframe(1).f_code.co_filename
                if threading.get_ident() == thread and not tracer._eager_depth and not is_library_file(caller):
                    raise refuse(
                        f"a CUDA stream switch ({__what}) in traced code; the fused graph runs on one stream",
                        "Put the side-stream region (the fork, the work on the other stream and the join) "
                        "in an opaque leaf (@fuser.opaque).",
                    )
                return __original(*args, **kwargs)

            setattr(owner, name, guarded)
            self._patched.append((owner, name, original))
        return self

    def __exit__(self, *exc):
        for owner, name, original in self._patched:
            setattr(owner, name, original)
        return False


class _shadow_isinstance:
    """While tracing, ``isinstance(proxy, T)`` in the traced code answers for the traced value.

    Only calls from outside torch, triton and fuser see through proxies; library code keeps
    the real answer (torch's C++ argument parser must never take a proxy for a tensor).
    """

    def __enter__(self):
        self.original = original = builtins.isinstance

        def shadow_isinstance(obj, classes):
            if type(obj) is ShadowProxy and "shadow" in obj.__dict__:
                caller = sys._getframe(1).f_code.co_filename
                if not is_library_file(caller):
                    return original(obj.shadow[0], classes)
            return original(obj, classes)

        builtins.isinstance = shadow_isinstance
        return self

    def __exit__(self, *exc):
        builtins.isinstance = self.original
        return False


class _refuse_module_rebinding:
    """While tracing, ``self.attr = <traced value>`` raises: the graph cannot rebind state."""

    def __enter__(self):
        self.original = original = torch.nn.Module.__setattr__

        def guarded(module, name, value):
            if isinstance(value, fx.Proxy):
                raise refuse(
                    f"assigning a traced value to module attribute {name!r} (the fused graph cannot rebind module state)",
                    f"Write it in place (self.{name}.copy_(...)), or make this module an opaque leaf (@fuser.opaque).",
                )
            original(module, name, value)

        torch.nn.Module.__setattr__ = guarded
        return self

    def __exit__(self, *exc):
        torch.nn.Module.__setattr__ = self.original
        return False


def forward_of(root) -> Callable:
    return root.forward if isinstance(root, torch.nn.Module) else root


def _is_state_proxy(a, state_paths) -> bool:
    return isinstance(a, fx.Proxy) and a.node in state_paths


def _grown_like(value: Any, args, kwargs) -> Any:
    """A leaf's result at T+1 from its result at T: each tensor grown (its first row repeated)
    along the dims where a tensor argument grows, where it has that argument's size at T."""
    growing: dict[int, int] = {}

    def note(a):
        if isinstance(a, ShadowProxy) and isinstance(a.shadow[0], torch.Tensor):
            x, y = a.shadow
            for d, (p, q) in enumerate(zip(x.shape, y.shape)):
                if p != q:
                    growing.setdefault(d, p)

    map_aggregate((args, kwargs), note)

    def grow(v):
        if not isinstance(v, torch.Tensor):
            return v
        for d, size in growing.items():
            if d < v.dim() and v.shape[d] == size:
                v = _grow_batch(v, d)
        return v

    return map_aggregate(value, grow) if isinstance(value, (tuple, list, dict, torch.Tensor)) else value


def _grow_batch(value: Any, dim: int) -> Any:
    """The example input at batch size T+1: its first row repeated once more."""
    index = torch.zeros(1, dtype=torch.long, device=value.device)
    return torch.cat([value, value.index_select(dim, index)], dim=dim)


def default_batch_inputs(names: Sequence[str], inputs: Sequence[Any]) -> dict[str, int]:
    """Every tensor input with at least one dim has the batch (tokens) as dim 0."""
    return {n: 0 for n, v in zip(names, inputs) if isinstance(v, torch.Tensor) and v.dim() >= 1}


def trace(
    module: torch.nn.Module | Callable,
    example_inputs: Sequence[Any],
    *,
    example_kwargs: dict[str, Any] | None = None,
    leaves: Iterable[str | type | Callable] = (),
    batch_inputs: dict[str, int] | None = None,
) -> Traced:
    """Trace ``module.forward`` (or a plain function) with the token dimension symbolic.

    The example call is ``module(*example_inputs, **example_kwargs)``; every tensor in it
    (nested in tuples, lists and dicts too) becomes a graph input, and every other value is
    baked in (:mod:`fuser.signature`). ``leaves`` adds opaque leaves: submodule qualified names,
    module classes or functions. A submodule whose forward cannot be traced becomes a leaf by
    itself, and so is each call into compiled code (listed in ``Traced.automatic_leaves``;
    :mod:`fuser.leaves`); only code of the traced forward itself is refused. ``batch_inputs``
    maps forward parameter names (or graph input names) to their batch dim (default: dim 0 of
    every tensor input). Buffers the forward mutates are restored.
    """
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
    # State (a KV cache) is never touched: the graph's example keeps a copy, the shadows another.
    pristine = [copy_state(v) if n in call.states else v for n, v in zip(call.names, tensors)]
    tensors = [copy_state(v) if n in call.states else v for n, v in zip(call.names, pristine)]
    grown = tuple(_grow_batch(v, batch[n]) if n in batch else v for n, v in zip(call.names, tensors))
    leaves = list(leaves)
    functions = [x for x in leaves if callable(x) and not isinstance(x, type)] + opaque_functions()
    automatic: list[AutomaticLeaf] = []
    attributes = set(vars(module)) if isinstance(module, torch.nn.Module) else set()
    while True:
        tracer = ShadowTracer(
            leaf_names=[x for x in leaves if isinstance(x, str)] + [a.name for a in automatic if a.function is None],
            leaf_types=[x for x in leaves if isinstance(x, type)],
            leaf_functions=functions + [a.function for a in automatic if a.function is not None],
        )
        # Tracing patches process-wide hooks (isinstance, Module.__setattr__, Triton's launcher):
        # one trace at a time, so concurrent apply() calls never see each other's patches.
        try:
            with _TRACE_LOCK, preserved_state(module, tensors), torch.no_grad():
                graph = tracer.trace_with_shadows(module, call, tensors, grown)
            break
        except Exception as e:  # noqa: BLE001 - untraceable code becomes a leaf: fuser.leaves
            leaf = leaf_after(e, automatic)
            if leaf is None:
                raise
            automatic.append(leaf)
        finally:
            constants = _constants_taken_off(module, attributes)
    state = [*module.parameters(), *module.buffers()] if isinstance(module, torch.nn.Module) else []
    idioms.rewrite(graph, tracer.shadows, state)
    _drop_unused_size_reads(graph)
    return Traced(
        root=module,
        graph=graph,
        input_names=list(call.names),
        batch_inputs=batch,
        example_inputs=tuple(pristine),
        shadows=tracer.shadows,
        call=call,
        automatic_leaves=automatic + tracer.noted,
        constants=constants,
        state_reads=list(tracer.state_reads.values()),
    )


def _constants_taken_off(module, attributes: set[str]) -> dict[str, Any]:
    """The values fx stowed on ``module`` during the trace (``_tensor_constant<i>``: values
    the traced code was given as themselves), removed from it: the trace leaves the module as
    it was, and the fused forward is installed with them."""
    if not isinstance(module, torch.nn.Module):
        return {}
    return {name: module.__dict__.pop(name) for name in set(vars(module)) - attributes}


def batch_dims_of(call: CallSpec, tensors: list, batch_inputs: dict[str, int] | None) -> dict[str, int]:
    """Graph input name -> its batch dim. A forward parameter's name stands for all its tensors."""
    if batch_inputs is None:
        return default_batch_inputs(call.names, tensors)
    by_parameter = call.tensor_names_by_parameter()
    batch = {}
    for name, dim in batch_inputs.items():
        if name in call.names:
            batch[name] = dim
        elif name in by_parameter:
            batch.update({n: dim for n in by_parameter[name]})
        else:
            raise ValueError(f"batch_inputs names {name!r}, which is no tensor input of forward {tuple(call.names)}")
    return batch


def _qualname(module) -> str:
    return (
        type(module).__name__ if isinstance(module, torch.nn.Module) else getattr(module, "__qualname__", str(module))
    )


def _drop_unused_size_reads(graph: fx.Graph) -> None:
    """``x.shape`` asks every dim's size; the reads nobody used would count as uses of x."""
    for node in reversed(list(graph.nodes)):
        if node.op == "call_method" and node.target in ("size", "numel", "dim") and not node.users:
            graph.erase_node(node)


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
