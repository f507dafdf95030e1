"""state_objects: objects of declared classes, read off a call's state, traced as Python objects.

sglang hands a DeepSeek-V4 layer's residual from boundary to boundary through
``forward_batch.residual_stream``, a ``ResidualStream`` whose methods the layer's code calls
(``stream.write(x)``, ``stream.record(out, update)``) and whose fields hold tensors. Read off the
state like any other object, each of those calls would be a leaf given state, and its result a
traced value where eager returns None. A class declared with :func:`trace_through` is traced as
what it is, a Python object:

* read off the state, the object is a *twin* (made by the tracer's ``_twin``): a shallow copy whose
  tensor fields are traced values (read at run time off the call's object, or, where the field
  holds one of the call's tensor inputs itself, that input, the identity guarded) and whose
  other fields are None or plain values (guarded);
* the traced code runs the twin's methods in Python: what they compute is traced, what they
  decide on is decided, as for any traced code;
* wherever eager's object can be seen by something the graph does not trace (a leaf given the
  state, a write of the object onto the state, the end of the forward), the graph
  *materialises* each twin that changed (:class:`Materialize`): the object as the trace holds
  it then, each traced value in it replaced by the run's, copied into the call's own object
  (the twin of one read off the state) or made anew (one the traced code made). So the object
  a fused call leaves on the state holds what eager's holds, field by field.

Objects inside a twin (a pending contribution, a tuple) are copied where they hold a traced
value and shared where they do not (a stage, a module: the same objects eager's hold).
"""

from __future__ import annotations

import copy
import enum
import functools
import types
from typing import Any

import torch
import torch.fx as fx

_MARK = "__fuser_traced_through__"
#: How deep into an object its fields are looked through for traced values.
DEPTH = 6


def trace_through(cls: type) -> type:
    """Declare ``cls`` an object the trace goes through when read off a call's state (see the
    module's docstring). Usable as a class decorator."""
    setattr(cls, _MARK, True)
    return cls


def is_traced_through(value: Any) -> bool:
    return not isinstance(value, type) and bool(getattr(type(value), _MARK, False))


def fields_of(obj: Any) -> dict[str, Any]:
    """An object's fields: its ``__dict__``, ``__slots__`` and msgspec struct fields (the values
    themselves, held: an id alone could be a freed value's, reused)."""
    found = dict(getattr(obj, "__dict__", {}))
    for name in getattr(type(obj), "__struct_fields__", ()):
        found[name] = getattr(obj, name)
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if isinstance(name, str) and name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                found[name] = getattr(obj, name)
    return found


_FUNCTIONS = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.BuiltinMethodType)


def _opaque_value(value: Any) -> bool:
    """A value never looked into: a traced value, a tensor, a module, a class, a function (an
    object with a ``__call__`` of its own and a ``functools.partial`` are: their fields and
    arguments may hold traced values), a number, a string, an enum."""
    return (
        isinstance(value, (fx.Proxy, torch.Tensor, torch.nn.Module, type, enum.Enum, int, float, str, bytes, bool) + _FUNCTIONS)
        or value is None
    )


def _children(value: Any) -> list[tuple[Any, Any]]:
    """(key, item) of what ``value`` holds: a tuple's or list's items, a dict's values, an object's fields."""
    if isinstance(value, (tuple, list)):
        return list(enumerate(value))
    if isinstance(value, functools.partial):
        return [("func", value.func), *enumerate(value.args), *value.keywords.items()]
    if isinstance(value, dict):
        return list(value.items())
    return list(fields_of(value).items())


def holders(value: Any) -> set[int]:
    """The ids of the objects within ``value`` (itself included) that hold a traced value,
    :data:`DEPTH` levels down."""
    edges: dict[int, list[int]] = {}
    found: set[int] = set()
    seen: dict[int, Any] = {}

    def visit(v: Any, depth: int) -> None:
        if id(v) in seen or depth == 0:
            return
        seen[id(v)] = v
        edges[id(v)] = []
        for _, item in _children(v):
            if isinstance(item, fx.Proxy):
                found.add(id(v))
            elif not _opaque_value(item):
                edges[id(v)].append(id(item))
                visit(item, depth - 1)

    if isinstance(value, fx.Proxy) or _opaque_value(value):
        return set()
    visit(value, DEPTH)
    changed = True
    while changed:  # an object holds a traced value if one it holds does
        changed = False
        for at, below in edges.items():
            if at not in found and any(b in found for b in below):
                found.add(at)
                changed = True
    return found


def substituted(value: Any, held: set[int], swap, memo: dict[int, Any]) -> Any:
    """``value`` with each traced value in it replaced by ``swap(proxy)``: the objects in
    ``held`` (:func:`holders`) copied, every other object shared."""
    if isinstance(value, fx.Proxy):
        return swap(value)
    if id(value) not in held:
        return value
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, tuple):
        items = [substituted(v, held, swap, memo) for v in value]
        made = type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    elif isinstance(value, functools.partial):
        made = functools.partial(value.func, *(substituted(v, held, swap, memo) for v in value.args),
                                 **{k: substituted(v, held, swap, memo) for k, v in value.keywords.items()})
    elif isinstance(value, list):
        made = memo[id(value)] = []
        made.extend(substituted(v, held, swap, memo) for v in value)
    elif isinstance(value, dict):
        made = memo[id(value)] = copy.copy(value)
        made.update({k: substituted(v, held, swap, memo) for k, v in value.items()})
    elif hasattr(type(value), "__struct_fields__") and type(value).__struct_config__.frozen:
        # A frozen msgspec struct, made from its fields (a cycle through it sees the original).
        memo[id(value)] = value
        made = type(value)(**{k: substituted(v, held, swap, memo) for k, v in fields_of(value).items()})
    else:
        made = memo[id(value)] = copy.copy(value)
        set_fields(made, {k: substituted(v, held, swap, memo) for k, v in fields_of(value).items()})
    memo[id(value)] = made
    return made


def set_fields(target: Any, fields: dict[str, Any]) -> None:
    """Set fields as the object's own constructor would (a frozen dataclass's too)."""
    struct = hasattr(type(target), "__struct_fields__")  # a msgspec struct: its own setattr
    for name, v in fields.items():
        setattr(target, name, v) if struct else object.__setattr__(target, name, v)


def fingerprint(value: Any) -> tuple:
    """What ``value`` holds, by identity, :data:`DEPTH` levels down: equal while nothing in it changed."""
    seen: set[int] = set()
    out: list = []

    def visit(v: Any, depth: int) -> None:
        if id(v) in seen or depth == 0:
            return
        seen.add(id(v))
        items = _children(v)
        out.append((id(v), tuple((k, id(i)) for k, i in items)))
        for _, item in items:
            if not _opaque_value(item):
                visit(item, depth - 1)

    visit(value, DEPTH)
    return tuple(out)


class Materialize:
    """A graph node's target: one traced-through object as the trace held it at one point,
    made at run time with the run's values in place of the traced ones. Called with the call's
    own object to update (or None: made anew) and the run's value of each traced value."""

    __name__ = "materialize"

    def __init__(self, frozen: Any, proxies: list[fx.Proxy]):
        self.frozen = frozen  # a copy of the object where it holds traced values (they stay proxies)
        self.held = holders(frozen)
        self.index = {id(p): i for i, p in enumerate(proxies)}
        self.kind = type(frozen).__name__

    def __repr__(self) -> str:
        return f"materialize({self.kind})"

    def __call__(self, target: Any, *values: Any) -> Any:
        def swap(p):
            return values[self.index[id(p)]]

        if target is None:
            return substituted(self.frozen, self.held, swap, {})
        memo = {id(self.frozen): target}  # what in it refers to the object itself refers to the call's
        set_fields(target, {k: substituted(v, self.held, swap, memo) for k, v in fields_of(self.frozen).items()})
        return target


def proxies_within(value: Any) -> list[fx.Proxy]:
    """The traced values ``value`` holds (each once), :data:`DEPTH` levels down."""
    found: dict[int, fx.Proxy] = {}
    seen: set[int] = set()

    def visit(v: Any, depth: int) -> None:
        if isinstance(v, fx.Proxy):
            found.setdefault(id(v), v)
            return
        if id(v) in seen or depth == 0 or _opaque_value(v):
            return
        seen.add(id(v))
        for _, item in _children(v):
            visit(item, depth - 1)

    visit(value, DEPTH)
    return list(found.values())


def frozen_copy(value: Any) -> Any:
    """A copy of ``value`` as it is now: the objects in it that hold traced values copied (the
    proxies kept), so that later changes to the live object do not reach it."""
    return substituted(value, holders(value), lambda p: p, {})


class LiveObjects:
    """The traced-through objects of one trace: the twins of those read off the state (by state
    path), the objects the traced code made and wrote onto the state, the graph node that holds
    each at run time, and what each held when it was last materialised."""

    def __init__(self):
        self.twins: dict[tuple, Any] = {}  # (state, path) -> twin
        self.objects: dict[int, Any] = {}  # id -> every live object (twins and made), held
        self.nodes: dict[int, fx.Node | None] = {}  # id -> the node holding it at run time (None: not made yet)
        self.synced: dict[int, tuple] = {}  # id -> its fingerprint when last materialised (or read)

    def add(self, obj: Any, node: fx.Node | None) -> None:
        self.objects[id(obj)] = obj
        self.nodes[id(obj)] = node
        self.synced[id(obj)] = fingerprint(obj) if node is not None else ()

    def changed(self) -> list[Any]:
        return [o for i, o in self.objects.items() if fingerprint(o) != self.synced[i]]


def input_aliases(names: list[str], values: list[Any], states) -> dict[tuple[str, tuple[str, ...]], str]:
    """(state, attribute path) -> the call's tensor input it holds itself, for each tensor field
    of a traced-through object read off a state input (sglang's stream holds the residual the
    layer is called with): read there, the field is that input."""
    inputs = {id(v): n for n, v in zip(names, values) if isinstance(v, torch.Tensor)}
    found: dict[tuple[str, tuple[str, ...]], str] = {}

    def visit(v: Any, state: str, path: tuple[str, ...], depth: int) -> None:
        if depth == 0 or _opaque_value(v) or isinstance(v, (tuple, list, dict)):
            return
        for name, item in fields_of(v).items():
            if is_traced_through(v) and isinstance(item, torch.Tensor) and id(item) in inputs:
                found[state, (*path, name)] = inputs[id(item)]
            elif not isinstance(item, torch.Tensor):
                visit(item, state, (*path, name), depth - 1)

    for n, v in zip(names, values):
        if n in states:
            visit(v, n, (), 3)
    return found
