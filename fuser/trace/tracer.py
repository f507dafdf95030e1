"""shadow_tracer: :class:`ShadowTracer`, the fx tracer behind :func:`fuser.trace.tracing.trace`. It
records each op and runs it eagerly on the shadow values (:mod:`fuser.trace.proxy`), keeps
leaves and calls given state opaque (:mod:`fuser.trace.leaves`), and while it traces patches
process-wide hooks (:mod:`fuser.trace.patches`): ``isinstance`` in traced code sees through
proxies, and a CUDA stream switch or a traced value assigned to a module attribute is refused.
An attribute written on a state object (``forward_batch.residual_stream = x``) is a ``setattr``
node of the graph (:meth:`ShadowTracer.write_state`); an object of a class declared
``fuser.trace_through`` read off the state is traced as a Python object, and made again at run
time where eager's could be seen (:mod:`fuser.trace.state_objects`).
"""

from __future__ import annotations

import builtins
import copy
import dataclasses
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate
from torch.utils import _pytree as pytree

from fuser.trace.leaves import (  # noqa: F401 - DEFAULT_LEAF_TYPES: read from here too
    DEFAULT_LEAF_TYPES,
    LEAF,
    AutomaticLeaf,
    custom_op,
    is_default_leaf,
    kernel_launches_as_leaves,
    patched_leaf_functions,
)
from fuser.ir.opaque import is_opaque
from fuser.trace.proxy import ShadowProxy
from fuser.trace.call_spec import CallSpec, StateRead, read_as_value
from fuser.trace.constant_indices import slice_constant_list_indices
from fuser.trace.patches import refuse_module_rebinding, refuse_stream_switches, shadow_isinstance, sizes_one_by_one
from fuser.trace.refusal import calling_line, error_location, refuse
from fuser.trace.state_objects import LiveObjects, Materialize, fields_of, fingerprint, frozen_copy, is_traced_through, proxies_within, set_fields
from fuser.trace.token_dims import grow


def run_node(kind: str, target, args, kwargs, root: torch.nn.Module):
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
        counters: Iterable[tuple] = (),
        leaf_modules: Iterable[torch.nn.Module] = (),
        compiled_leaves: Sequence[Callable] = (),
    ):
        super().__init__(param_shapes_constant=True)
        self.compiled_leaves = list(compiled_leaves)  # C extensions' functions: one call each, wherever held
        self.counters = set(counters)  # getters (state, path) the forward changes: leaves, never values
        self.leaf_functions = list(leaf_functions)  # patched where they are held: fuser.trace.leaves
        self.noted: list[AutomaticLeaf] = []  # calls into compiled code, kept as one call each
        self.leaf_names = set(leaf_names)  # qualified names in the traced module
        # submodules kept opaque whatever their name (fuser.trace.leaves.resolve_leaves): held,
        # so that an id is never a freed module's
        self.leaf_modules = {id(m): m for m in leaf_modules}
        self.leaf_types = tuple(leaf_types)  # a user's: every instance, subclasses too
        self.shadows: dict[str, tuple[Any, Any]] = {}
        self._placeholder_values: dict[str, tuple[Any, Any]] = {}
        self._eager_depth = 0
        self._attr_names: dict[int, str] = {}
        self._states: frozenset = frozenset()  # placeholders that are state (fuser.trace.call_spec)
        # state placeholders and the objects read off them -> (state name, attribute path)
        self.state_paths: dict[fx.Node, tuple[str, tuple[str, ...]]] = {}
        self.state_reads: dict[tuple, StateRead] = {}
        self._states_changed: set[str] = set()  # state given to a call that may change it
        # what a call given state returned (a dynamic cache's keys), and what is computed from it:
        # its sizes may differ from call to call whatever the batch, so none is read as a literal
        self.state_fed: set[fx.Node] = set()
        # (state name, attribute path) -> what the traced code wrote there: a later read sees it
        self.state_writes: dict[tuple[str, tuple[str, ...]], Any] = {}
        # (state name, attribute path) -> the leaf call (and its line) that rebound it
        self._rebound_by_leaves: dict[tuple[str, tuple[str, ...]], str] = {}
        self.live = LiveObjects()  # objects read off state and traced through (fuser.trace.state_objects)
        # (state name, attribute path) -> the call's tensor input a traced-through object holds there
        self.aliases: dict[tuple[str, tuple[str, ...]], str] = {}
        self._inputs: dict[str, fx.Proxy] = {}  # the placeholders, by input name
        self.tokens: int | None = None  # the example's token count (None: no input follows the tokens)
        self.token_ranges: list = []  # branches on the token count taken as traced (fuser.trace.proxy.TokenRange)

    # --- leaf policy -------------------------------------------------------------------------
    def is_leaf_module(self, m: torch.nn.Module, qualified_name: str) -> bool:
        return (
            qualified_name in self.leaf_names
            or id(m) in self.leaf_modules
            or is_default_leaf(m)
            or isinstance(m, self.leaf_types)
            or is_opaque(type(m))
            or is_opaque(m)
        )

    def call_module(self, m, forward, args, kwargs):
        if self._eager_depth:
            return forward(*args, **kwargs)
        if not self._installed(m):
            # A module the traced code made (transformers' ``ACT2FN[name]`` makes a fresh
            # activation at each lookup): eager makes it anew at every call, so it is no state
            # of the module and is traced through, its weights (if any) read as the values made.
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

    def _installed(self, m: torch.nn.Module) -> bool:
        """Is ``m`` the traced module or one of its submodules (rather than made by the code)?"""
        try:
            self.path_of_module(m)
        except NameError:
            return False
        return True

    def create_arg(self, a):
        if issubclass(type(a), fx.Proxy):  # before fx's own isinstance() probes
            return a.node
        if isinstance(a, torch.nn.Parameter) and not self._eager_depth and id(a) not in self._attr_names:
            a = a.detach()  # a weight of a module the traced code made: a value given as itself
        if isinstance(a, torch.nn.Module) and not self._eager_depth and not self._installed(a):
            # A module the traced code made (``ACT2FN[name]``) passed on: read as the object.
            name = self.get_fresh_qualname("_constant_")
            object.__setattr__(self.root, name, a)  # (not registered: the trace leaves the module as it was)
            node = self.create_node("get_attr", name, (), {})
            self.shadows[node.name] = (a, a)
            return node
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
        if (state, path) in self._rebound_by_leaves:
            raise refuse(
                f"`{'.'.join((state, *path))}` is read after {self._rebound_by_leaves[state, path]}, a call the graph keeps "
                "as one (a leaf), rebinds it: the fused graph cannot replay a write of state inside a leaf",
                "Make the write in the traced code, or make the code reading it part of the leaf (@fuser.opaque).",
            )
        if (state, path) in self.state_writes:
            return self.state_writes[state, path]  # written earlier in this forward: the value written
        if (state, path) in self.live.twins:
            return self.live.twins[state, path]
        if is_traced_through(value):
            return self._twin(proxy, name, value)
        if (state, path) in self.aliases and isinstance(value, torch.Tensor):
            self.state_reads[state, path, None] = StateRead(state, path, self.aliases[state, path], alias=True)
            return self._inputs[self.aliases[state, path]]
        if read_as_value(value):
            self.state_reads[state, path, None] = StateRead(state, path, value)
            return value
        read = self.create_proxy("call_function", builtins.getattr, (proxy, name), {})
        if isinstance(value, torch.Tensor):
            spec = (value.dtype, value.device, tuple(value.shape))
            self.state_reads[state, path, None] = StateRead(state, path, spec, tensor=True)
        else:
            self.state_paths[read.node] = (state, path)
        return read

    def _twin(self, proxy: "ShadowProxy", name: str, value: Any):
        """The twin of a traced-through object read off the state (:mod:`fuser.trace.state_objects`):
        its tensor fields traced reads (or the call's input it holds), its plain fields guarded."""
        state, path = self.state_paths[proxy.node]
        read = self.create_proxy("call_function", builtins.getattr, (proxy, name), {})  # the call's object
        self.state_paths[read.node] = (state, (*path, name))
        twin = copy.copy(value)
        fields = {}
        for field, v in fields_of(value).items():
            if not isinstance(v, torch.Tensor) and not read_as_value(v):
                raise refuse(
                    f"`{'.'.join((state, *path, name, field))}` holds a {type(v).__name__}: a {type(value).__name__} "
                    "read off the state is traced through with tensors and plain values in its fields only",
                    "Call the module where that field is empty (between whole steps), or keep the code reading it a leaf.",
                )
            fields[field] = self.read_state(read, field, v)
        set_fields(twin, fields)
        self.live.twins[state, (*path, name)] = twin
        self.live.add(twin, read.node)
        return twin

    def _materialize(self, obj: Any) -> fx.Node:
        """A node making ``obj`` (a traced-through object) at run time as the trace holds it now:
        into the call's object it was read from, or the node that made it before, or anew."""
        frozen = frozen_copy(obj)
        proxies = proxies_within(frozen)
        target = self.live.nodes.get(id(obj))
        make = Materialize(frozen, proxies)
        node = self.create_node("call_function", make, (target, *[p.node for p in proxies]), {})
        node.meta[LEAF] = True  # an effect: kept where it is, never fused
        # The shadow state's object is made so too, for the leaves after that read it.
        shadow_target = self.shadows[target.name][0] if target is not None else None
        at_t = make(shadow_target, *[p.shadow[0] if "shadow" in p.__dict__ else p for p in proxies])
        self.shadows[node.name] = (at_t, at_t)
        if id(obj) not in self.live.objects:
            self.live.add(obj, None)
        if target is None:
            self.live.nodes[id(obj)] = node  # made once; later materialisations update it in place
        self.live.synced[id(obj)] = fingerprint(obj)
        return node

    def sync_live_objects(self) -> None:
        """Materialise every traced-through object that changed since it was last (before a leaf
        given the state, and at the end of the forward: where eager's object can be seen)."""
        for obj in self.live.changed():
            self._materialize(obj)

    def write_state(self, proxy: "ShadowProxy", name: str, value: Any) -> None:
        """``state.name = value`` in traced code: a ``setattr`` node of the graph, which the fused
        forward performs where eager does, after the kernels that compute ``value``. What can be
        written is what the graph can replay exactly: a value it computes (a traced tensor, or
        anything else a node holds) or a plain value (a number, a flag, None: written as a
        constant; where it was computed from a value read off the state, that read is guarded).
        Later reads of the attribute in the traced code see what was written, not a state read.
        A tensor the graph does not compute (made from Python values, or held by the module)
        or an object made in the traced code would be the same object at every call where eager
        writes a new one: refused, with the line."""
        state, path = self.state_paths[proxy.node]
        label = ".".join((state, *path, name))
        if is_traced_through(value):
            made = self._materialize(value)
            node = self.create_node("call_function", builtins.setattr, (proxy.node, name, made), {})
            node.meta[LEAF] = True
            self.shadows[node.name] = (None, None)
            setattr(proxy.shadow[0], name, self.shadows[made.name][0])
            self.state_writes[state, (*path, name)] = value
            self._states_changed.add(state)
            return
        if not isinstance(value, ShadowProxy) and not read_as_value(value):
            if isinstance(value, torch.Tensor):
                what = "a tensor the graph does not compute (made from Python values, or held by the module)"
            elif proxies_within(value):
                what = f"a {type(value).__name__} holding traced values (made in the traced code)"
            else:
                what = f"a {type(value).__name__} made in the traced code (eager writes a new one at every call)"
            raise refuse(
                f"writing {what} to `{label}`; the fused graph can replay a write of a value it computes or a plain value only",
                "Write a tensor the forward computes or a plain value, or move this code into an opaque leaf (@fuser.opaque).",
            )
        node = self.create_node("call_function", builtins.setattr, (proxy.node, name, self.create_arg(value)), {})
        node.meta[LEAF] = True  # an effect: kept where it is, never fused
        self.shadows[node.name] = (None, None)
        # The shadow state (a copy of the example's) holds the value at T, for the leaves after.
        target = proxy.shadow[0]
        setattr(target, name, value.shadow[0] if isinstance(value, ShadowProxy) else value)
        self.state_writes[state, (*path, name)] = value
        self._states_changed.add(state)

    def note(self, leaf: AutomaticLeaf) -> None:
        """Record a call kept opaque by itself (once per callee and line)."""
        if not any(a.name == leaf.name and a.where == leaf.where for a in self.noted):
            self.noted.append(leaf)

    # --- proxies carry shadows ---------------------------------------------------------------
    def proxy(self, node: fx.Node) -> fx.Proxy:
        return ShadowProxy(node, self)

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        state = self._state_taken(args, kwargs)
        # a call given the state that is no attribute read or getter: it may read or change it
        given = state is not None and target is not builtins.getattr and not (kind == "call_method" and _is_getter(target))
        if given and self.live.objects:
            self.sync_live_objects()  # it sees what eager's objects hold
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr)
        if kind == "output":
            return proxy
        if kind == "call_function" and (leaf := custom_op(target)) is not None:
            self.note(leaf)
        if kind == "placeholder":
            # A parameter the example does not pass is baked at its default (fx's concrete_args).
            default = args[0] if args else None
            shadow = self._placeholder_values.get(target, (default, default))
            if target in self._states:
                self.state_paths[proxy.node] = (target, ())
        elif state is not None and (value := self._queried(kind, target, args, kwargs, state)) is not _NOT_A_QUERY:
            self.graph.erase_node(proxy.node)
            return value
        elif state is not None:
            if given:
                self._states_changed.add(state)  # (an attribute read or a getter changes nothing)
            # A call given state (``past_key_values.update(k, v, i)``) is a leaf. The state is
            # one object of the example's batch: the call runs once, and its result at T+1 is
            # its result at T grown where its tensor arguments grow. (An attribute read off it
            # is one too, not worth a line of the report: fuser.trace.call_spec.StateRead.)
            proxy.node.meta[LEAF] = True
            if target is not builtins.getattr:
                what = f"{state}.{target}" if kind == "call_method" else getattr(target, "__name__", str(target))
                self.note(AutomaticLeaf(what, calling_line(), f"takes `{state}`, state the graph passes through"))
                self.state_fed.add(proxy.node)
            before = self._state_attributes(args, kwargs)
            at_t = self._eager(kind, target, args, kwargs, 0)
            self._note_rebinding(before, kind, target)
            shadow = (at_t, _grown_like(at_t, args, kwargs))
        else:
            shadow = tuple(self._eager(kind, target, args, kwargs, i) for i in (0, 1))
            if any(a in self.state_fed for a in proxy.node.all_input_nodes):
                self.state_fed.add(proxy.node)
        proxy.shadow = shadow
        self.shadows[proxy.node.name] = shadow
        return proxy

    def _queried(self, kind, target, args, kwargs, state: str):
        """The value of a getter of the state (``past_key_values.get_mask_sizes(1, 0)``: a
        method named ``get_...``, called with constants) when it returns plain values (numbers,
        flags, their tuples) and nothing in the forward may have changed the state before it: the
        trace takes the value as it is, as it takes an attribute's (:meth:`read_state`), and the
        guard calls the getter at every call instead of the fused forward. Else, and for a
        getter of ``counters`` (one whose value the forward itself changes, a cache's length:
        taken as it is, it would hold for one call only), ``_NOT_A_QUERY``: the call is a leaf."""
        if kind != "call_method" or not _is_getter(target) or state in self._states_changed:
            return _NOT_A_QUERY
        if not _is_state_proxy(args[0], self.state_paths) or any(isinstance(a, fx.Proxy) for a in pytree.tree_leaves((args[1:], kwargs))):
            return _NOT_A_QUERY
        _, path = self.state_paths[args[0].node]
        if (state, (*path, target)) in self.counters:
            return _NOT_A_QUERY
        value = self._eager(kind, target, args, kwargs, 0)
        if not read_as_value(value):
            return _NOT_A_QUERY
        read = StateRead(state, (*path, target), value, call=(tuple(args[1:]), dict(kwargs)))
        self.state_reads[state, read.path, repr(read.call)] = read
        return value

    def _state_attributes(self, args, kwargs) -> list[tuple[Any, str, dict[str, Any]]]:
        """(object, label, its attributes) of each state object a call is given."""
        found = []

        def note(a):
            if _is_state_proxy(a, self.state_paths) and "shadow" in a.__dict__:
                state, path = self.state_paths[a.node]
                found.append((a.shadow[0], ".".join((state, *path)), fields_of(a.shadow[0])))

        map_aggregate((args, kwargs), note)
        return found

    def _note_rebinding(self, before, kind, target) -> None:
        """A leaf given a state object rebinds one of its attributes (``cache.steps += 1``
        inside it): at run time the leaf does so itself, but a later read of that attribute in
        the traced code would take the trace's value, not the call's; :meth:`read_state`
        refuses one, with the leaf's line."""
        if target is builtins.getattr:
            return
        for obj, label, then in before:
            now = fields_of(obj)
            what = f"{label}.{target}" if kind == "call_method" else getattr(target, "__name__", str(target))
            state, path = label.split(".")[0], tuple(label.split(".")[1:])
            for name in set(then) | set(now):
                if then.get(name, _MISSING) is not now.get(name, _MISSING):
                    self._rebound_by_leaves.setdefault((state, (*path, name)), f"`{what}` ({calling_line()})")

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
            return run_node(kind, target, args, kwargs, self.root)
        finally:
            self._eager_depth -= 1

    # --- the call: one placeholder per tensor of the example call ----------------------------
    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        """Placeholders for the example call's tensors (see :mod:`fuser.trace.call_spec`); everything
        else in the call — ``None``, flags, the structure of tuples and dicts — is baked in."""
        proxies = [self.create_proxy("placeholder", name, (), {}) for name in self._call.names]
        self._inputs = dict(zip(self._call.names, proxies))
        args, kwargs = self._call.rebuild(proxies)
        root = self.root

        def traced_call():
            out = root_fn(root, *args, **kwargs) if is_module else root_fn(*args, **kwargs)
            self.sync_live_objects()  # what the forward leaves on the state, as eager leaves it
            return out

        return traced_call, []

    def trace_with_shadows(self, root, call: CallSpec, inputs_a: tuple, inputs_b: tuple, aliases=None,
                           tokens: int | None = None) -> fx.Graph:
        """Trace ``root`` (a module or a plain function) on inputs at batch sizes T and T+1.
        ``aliases``: the tensor fields of traced-through state objects that hold an input
        (:func:`fuser.trace.state_objects.input_aliases`); ``tokens``: T."""
        self.aliases = dict(aliases or {})
        self.tokens = tokens
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
            patched_leaf_functions(self.leaf_functions, self.compiled_leaves),
            kernel_launches_as_leaves(),
            refuse_stream_switches(self),
            refuse_module_rebinding(),
            shadow_isinstance(),
            sizes_one_by_one(),
        ):
            graph = self.trace(root)
        slice_constant_list_indices(graph, self.shadows)  # x[..., [-2], :] is x[..., 2:3, :]: a view
        return graph


_NOT_A_QUERY = object()
_MISSING = object()  # an attribute an object does not have


def _is_getter(method) -> bool:
    return isinstance(method, str) and method.startswith("get_")


def _is_state_proxy(a, state_paths) -> bool:
    return isinstance(a, fx.Proxy) and a.node in state_paths


def _grown_like(value: Any, args, kwargs) -> Any:
    """A leaf's result at T+1 from its result at T: each tensor grown along the dims where a
    tensor argument grows, where it has that argument's size at T, by as many rows as the
    argument grows (its first rows repeated: :func:`fuser.trace.token_dims.grow`)."""
    growing: dict[int, tuple[int, int]] = {}

    def note(a):
        if isinstance(a, ShadowProxy) and isinstance(a.shadow[0], torch.Tensor) and isinstance(a.shadow[1], torch.Tensor):
            x, y = a.shadow
            for d, (p, q) in enumerate(zip(x.shape, y.shape)):
                if p < q:
                    growing.setdefault(d, (p, q))

    map_aggregate((args, kwargs), note)

    def grow_(v):
        if not isinstance(v, torch.Tensor):
            return v
        for d, (size, more) in growing.items():
            if d < v.dim() and v.shape[d] == size and more - size <= size:
                v = grow(v, d, more - size)
        return v

    if isinstance(value, dict) and type(value) is not dict:
        # A dict of its own class (transformers' ModelOutput, read by attribute): kept so
        # (fx's map_aggregate would give a plain immutable dict).
        grown = copy.copy(value)
        for key, item in value.items():
            grown[key] = map_aggregate(item, grow_)
        return grown
    return map_aggregate(value, grow_) if isinstance(value, (tuple, list, dict, torch.Tensor)) else value
