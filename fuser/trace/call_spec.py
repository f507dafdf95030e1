"""signature: a forward's call as a flat list of tensors, and back.

Modeling code takes more than positional tensors: ``forward(self, hidden_states, ...,
**kwargs)`` with ``position_embeddings=(cos, sin)``, ``attention_mask=None``, a dict of
rotary tables. The traced graph takes one placeholder per tensor; everything else in the call
(``None``, flags, ints, the structure of tuples and dicts) is baked into the trace and pinned
by the guard. An object that holds tensors, such as a KV cache, is *state*: it gets a
placeholder too and is passed through to the leaves that take it (the guard asks only its
type). :class:`CallSpec` is that mapping, built from the example call:

    spec = CallSpec.of(layer.forward, (hidden,), {"position_embeddings": (cos, sin)})
    spec.names                      # ['hidden_states', 'position_embeddings_0', 'position_embeddings_1']
    tensors, why = spec.flatten((h2,), {"position_embeddings": (c2, s2)})   # why: None, or a reason
    args, kwargs = spec.rebuild(tensors)                                   # the call again
"""

from __future__ import annotations

import copy
import enum
import inspect
import itertools
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.utils import _pytree as pytree

from fuser.trace.state_objects import fields_of, set_fields

# Non-tensor values that the guard compares by value; anything else must be the same object.
_BY_VALUE = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


@dataclass(frozen=True)
class _Argument:
    """One parameter of the forward as the example passed it."""

    name: str
    kind: Any  # inspect.Parameter kind
    spec: Any  # the pytree structure of its value
    constants: tuple  # (leaf index, value, what the message calls it) for each non-tensor leaf
    tensor_leaves: tuple  # leaf indices holding tensors or state, in placeholder order
    states: tuple = ()  # (leaf index, type) of each state leaf
    passed: str = "keyword"  # how the example passed it: "positional", "keyword", or "default" (not at all)


class CallSpec:
    """How one example call of ``forward`` maps to the traced graph's tensor placeholders."""

    def __init__(self, signature: inspect.Signature, arguments: list[_Argument], names: list[str], states=()):
        self.signature = signature
        self.arguments = arguments
        self.names = names  # one per tensor or state object, in placeholder order
        self.states = frozenset(states)  # the names of the state objects

    def __deepcopy__(self, memo) -> "CallSpec":
        return self  # never changed after it is made; a copy of a fused module shares it

    @classmethod
    def of(cls, forward: Callable, args: tuple = (), kwargs: dict | None = None) -> "CallSpec":
        signature = inspect.signature(forward)
        bound = signature.bind(*args, **(kwargs or {}))
        given = set(bound.arguments)
        bound.apply_defaults()
        positional = _positional_names(signature, len(args))
        arguments, names, taken, state_names = [], [], set(), []
        for name, value in bound.arguments.items():
            kind = signature.parameters[name].kind
            leaves, spec = pytree.tree_flatten_with_path(_mutable(value))
            tensors, constants, states = [], [], []
            for i, (path, leaf) in enumerate(leaves):
                if isinstance(leaf, torch.Tensor) or is_state(leaf):
                    tensors.append(i)
                    names.append(_unique(_placeholder_name(name, kind, path), taken))
                    if not isinstance(leaf, torch.Tensor):
                        states.append((i, type(leaf)))
                        state_names.append(names[-1])
                else:
                    constants.append((i, leaf, _label(name, kind, path)))
            passed = "positional" if name in positional else "keyword" if name in given else "default"
            arguments.append(_Argument(name, kind, spec, tuple(constants), tuple(tensors), tuple(states), passed))
        return cls(signature, arguments, names, state_names)

    def tensor_names_by_parameter(self) -> dict[str, list[str]]:
        """forward parameter name -> the names of the graph inputs its tensors became."""
        names, result = iter(self.names), {}
        for argument in self.arguments:
            result[argument.name] = [next(names) for _ in argument.tensor_leaves]
        return result

    def flatten(self, args: tuple, kwargs: dict) -> tuple[list | None, str | None]:
        """(the call's tensors in placeholder order, None) when the call has the example's
        structure and non-tensor values, else (None, why not)."""
        try:
            bound = self._binding(len(args), tuple(kwargs))
        except TypeError as e:
            return None, str(e)
        if len(bound) != len(self.arguments):
            return None, "a different set of arguments than traced"
        tensors = []
        for argument in self.arguments:
            value = _take(bound.get(argument.name), args, kwargs)
            leaves = _plain_leaves(value, argument.spec)
            if leaves is not None:
                spec = argument.spec  # what pytree would say, without asking it
            else:
                leaves, spec = pytree.tree_flatten(_mutable(value))
            if spec != argument.spec:
                return None, f"{argument.name} has another structure than traced ({_describe(value)})"
            for i, constant, label in argument.constants:
                if not _same(leaves[i], constant):
                    return None, f"{label} is {leaves[i]!r}, traced with {constant!r}"
            states = dict(argument.states)
            for i in argument.tensor_leaves:
                if i in states:
                    if type(leaves[i]) is not states[i]:
                        return None, f"{argument.name} is {_describe(leaves[i])} where the trace had a {states[i].__name__}"
                elif not isinstance(leaves[i], torch.Tensor):
                    return None, f"{argument.name} is not a tensor where the trace had one"
                tensors.append(leaves[i])
        return tensors, None

    def _binding(self, positional: int, keywords: tuple) -> dict:
        """Where each parameter's value comes from in a call of ``positional`` arguments and
        these ``keywords`` (which is all binding depends on): the call is bound once per such
        shape, with markers in place of the values (:func:`_take` reads them)."""
        cache = self.__dict__.setdefault("_bindings", {})
        found = cache.get((positional, keywords))
        if found is None:
            markers = tuple(_Position(i) for i in range(positional))
            found = dict(_bind(self.signature, markers, {k: _Keyword(k) for k in keywords}).arguments)
            cache[(positional, keywords)] = found
        return found

    def rebuild(self, tensors) -> tuple[tuple, dict]:
        """The call (args, kwargs) with the given values in place of the example's tensors, each
        argument passed as the example passed it (by position, by keyword, or left to its
        default): a forward wrapped by a decorator that adds keyword arguments of its own
        (transformers' output-capturing wrappers set ``use_cache``) gets the call it expects."""
        tensors = iter(tensors)
        args, kwargs = [], {}
        for argument in self.arguments:
            leaves = [None] * argument.spec.num_leaves
            for i, constant, _ in argument.constants:
                leaves[i] = constant
            for i in argument.tensor_leaves:
                leaves[i] = next(tensors)
            value = pytree.tree_unflatten(leaves, argument.spec)
            if argument.kind == inspect.Parameter.VAR_POSITIONAL:
                args.extend(value)
            elif argument.kind == inspect.Parameter.VAR_KEYWORD:
                kwargs.update(value)
            elif argument.passed == "positional":
                args.append(value)
            elif argument.passed == "keyword" or argument.tensor_leaves:  # a default holding a tensor is passed on
                kwargs[argument.name] = value
        return tuple(args), kwargs


@dataclass(frozen=True)
class StateRead:
    """An attribute of a state object that the traced code read (``forward_batch.forward_mode``),
    or what a getter of it returned (``past_key_values.get_mask_sizes(1, 0)``), that the trace
    took as it was: a value is baked in (the branch on it was taken once), a tensor's shape is
    static in the graph. The guard compares it at every call; a call where it differs runs the
    module's own forward."""

    state: str  # the state placeholder's name
    path: tuple[str, ...]  # attribute names from the state object
    value: Any  # the value read (compared: by_value), or for a tensor (dtype, device, shape)
    tensor: bool = False
    call: tuple | None = None  # (args, kwargs): the path ends at a getter, called with them
    alias: bool = False  # the path holds the call's tensor input named ``value`` itself (that object)

    def label(self) -> str:
        name = ".".join((self.state, *self.path))
        if self.call is None:
            return name
        args, kwargs = self.call
        return f"{name}({', '.join([*map(repr, args), *(f'{k}={v!r}' for k, v in kwargs.items())])})"

    def shown(self) -> str:
        """The value as the report shows it: its repr, or a tensor's shape and dtype."""
        if self.alias:
            return f"the input {self.value} itself"
        return f"a tensor {list(self.value[2])} {self.value[0]}" if self.tensor else repr(self.value)

    def differs(self, state: Any, inputs: dict[str, Any] | None = None) -> str | None:
        """None when ``state`` (the call's object) holds the same value at the path, else why
        not. ``inputs``: the call's tensors by graph input name (an alias is checked against them)."""
        now = state
        for name in self.path:
            now = getattr(now, name, _MISSING)
            if now is _MISSING:
                return f"{self.label()} is missing"
        if self.alias:
            return None if now is (inputs or {}).get(self.value) else f"{self.label()} is not the input {self.value} itself, as traced"
        if self.call is not None:
            try:
                now = now(*self.call[0], **self.call[1])
            except Exception as e:  # noqa: BLE001 - the guard declines the call; eager will raise it
                return f"{self.label()} raised {type(e).__name__}: {e}"
        if self.tensor:
            dtype, device, shape = self.value
            if not isinstance(now, torch.Tensor):
                return f"{self.label()} is {_describe(now)}, traced as a tensor"
            if (now.dtype, now.device, tuple(now.shape)) != self.value:
                return f"{self.label()} is {now.dtype} {list(now.shape)} on {now.device}, traced as {dtype} {list(shape)} on {device}"
            return None
        if same_value(now, self.value):
            return None
        shown = f"a tensor {list(now.shape)} {now.dtype}" if isinstance(now, torch.Tensor) else repr(now)
        return f"{self.label()} is {shown}, traced with {self.value!r}"


_MISSING = object()


def same_value(now: Any, then: Any) -> bool:
    """Values the guard takes as the same: equal by value (numbers, strings, enums, None, their
    tuples and lists), anything else the same object."""
    if now is then:
        return True
    if type(now) is not type(then):
        return False
    if isinstance(then, _BY_VALUE + (enum.Enum,)):
        return now == then
    if isinstance(then, (tuple, list)):
        return len(now) == len(then) and all(same_value(a, b) for a, b in zip(now, then))
    return False


def read_as_value(value: Any) -> bool:
    """Is a state attribute's value one the trace bakes in (compared by value at every call)?"""
    if isinstance(value, _BY_VALUE + (enum.Enum,)):
        return True
    return isinstance(value, (tuple, list)) and len(value) <= 64 and all(read_as_value(v) for v in value)


_STATE_MARK = "__fuser_call_state__"


def declare_state(cls: type) -> None:
    """Take every instance of ``cls`` a call hands on as state, whatever it holds (a serving
    engine's per-call batch object: new at every call, read attribute by attribute). A built-in
    class (``types.SimpleNamespace``) is not marked: its instances are state where they hold
    tensors, as any object's."""
    try:
        setattr(cls, _STATE_MARK, True)
    except TypeError:
        pass


def is_state(value: Any) -> bool:
    """An object the call hands on that holds tensors (a KV cache: its layers' key and value
    buffers), or one of a class declared state (:func:`declare_state`), rather than a constant
    of the call."""
    if isinstance(value, (torch.Tensor, torch.nn.Module, type) + _BY_VALUE) or callable(value):
        return False
    if getattr(type(value), _STATE_MARK, False):
        return True
    return next(_tensors_within(value, "", _STATE_DEPTH, width=64), None) is not None


def with_state_copied(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call with each state object copied (:func:`copy_state`): a run of it leaves the
    caller's state alone."""
    return pytree.tree_map(lambda v: copy_state(v) if is_state(v) else v, (tuple(args), dict(kwargs)))


def copy_state(value: Any) -> Any:
    """A copy of a state object for a run that may write into it: a deep copy. Where none can
    be made (the object holds a process group or a stream, as sglang's ``forward_batch`` does
    mid-layer, in its residual stream's transport), a copy of the object in which each tensor
    it holds, where :func:`state_tensors` looks, is cloned, and every other object is shared
    with the caller's: a run that writes into those writes into the caller's."""
    try:
        return copy.deepcopy(value)
    except (TypeError, RuntimeError, copy.Error):  # an object that cannot be pickled or copied
        return _tensors_cloned(value, _STATE_DEPTH)


def _tensors_cloned(value: Any, depth: int) -> Any:
    """``value`` with the tensors it holds cloned, ``depth`` levels into its lists, tuples, dicts
    and attributes (the levels :func:`_tensors_within` walks); other objects shared."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if depth == 0 or isinstance(value, _BY_VALUE) or callable(value):
        return value
    if isinstance(value, list):
        return [_tensors_cloned(v, depth - 1) for v in value]
    if isinstance(value, tuple):
        items = [_tensors_cloned(v, depth - 1) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {k: _tensors_cloned(v, depth - 1) for k, v in value.items()}
    attributes = fields_of(value)  # its __dict__, __slots__ (sglang's residual stream) or struct fields
    if not attributes:
        return value
    try:
        twin = copy.copy(value)
        set_fields(twin, {k: _tensors_cloned(v, depth - 1) for k, v in attributes.items()})
    except (TypeError, RuntimeError, AttributeError, copy.Error):
        return value
    return twin


def state_tensors(args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
    """The tensors that the call's state objects hold, by path (``past_key_values.layers[0].keys``)."""
    found: dict[str, torch.Tensor] = {}
    bound = {**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs}
    for name, value in bound.items():
        for path, leaf in pytree.tree_flatten_with_path(value)[0]:
            if is_state(leaf):
                found.update(_tensors_within(leaf, name + "".join(str(k) for k in path), _STATE_DEPTH))
    return found


#: How deep into a state object its tensors are looked for (a cache's layers' keys: 3).
_STATE_DEPTH = 3


def _tensors_within(value: Any, path: str, depth: int, width: int | None = None):
    """(path, tensor) for each tensor ``value`` holds, ``depth`` levels into its lists, tuples,
    dicts and attributes (at most ``width`` items of each, when given)."""
    if isinstance(value, torch.Tensor):
        yield path, value
        return
    if depth == 0 or isinstance(value, _BY_VALUE):
        return
    if isinstance(value, (list, tuple)):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    elif isinstance(value, dict):
        items = ((f"{path}[{k!r}]", v) for k, v in list(value.items()))
    else:
        items = ((f"{path}.{k}", v) for k, v in list(getattr(value, "__dict__", {}).items()))
    for item_path, item in itertools.islice(items, width):
        yield from _tensors_within(item, item_path, depth - 1, width)


def _positional_names(signature: inspect.Signature, count: int) -> set[str]:
    """The parameters the first ``count`` positional arguments of a call bind to."""
    names = set()
    for parameter in signature.parameters.values():
        if len(names) == count:
            break
        if parameter.kind == inspect.Parameter.VAR_POSITIONAL:
            names.add(parameter.name)
            break
        if parameter.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            names.add(parameter.name)
    return names


#: Values pytree takes as a leaf whatever is registered with it.
_LEAVES = (torch.Tensor, int, float, bool, str, bytes, type(None), torch.dtype, torch.device)


@dataclass(frozen=True)
class _Position:
    index: int


@dataclass(frozen=True)
class _Keyword:
    name: str


def _plain_leaves(value, spec: pytree.TreeSpec) -> list | None:
    """``value``'s leaves when ``spec`` is a leaf, or a tuple or dict of leaves, and ``value`` is
    such a thing of plain values (tensors, numbers, None, ...) laid out as ``spec`` says; else
    None (pytree is asked). The guard's common case, without pytree's cost."""
    if spec.is_leaf():
        return [value] if isinstance(value, _LEAVES) else None
    if spec.type is tuple and type(value) is tuple and len(value) == spec.num_children:
        children = value
    elif spec.type is dict and type(value) is dict and list(value) == spec.context:
        children = tuple(value.values())
    else:
        return None
    if all(isinstance(c, _LEAVES) for c in children) and all(s.is_leaf() for s in _children(spec)):
        return list(children)
    return None


def _mutable(value):
    """``value`` with fx's ``immutable_dict`` and ``immutable_list`` as the dict and list they
    stand for: a call made from an fx graph (a fused forward that calls the module) passes its
    dicts and lists so, and pytree tells them apart from the plain ones of an eager call."""
    if type(value) in (immutable_dict, dict):
        return {k: _mutable(v) for k, v in value.items()}
    if type(value) in (immutable_list, list):
        return [_mutable(v) for v in value]
    if type(value) is tuple:
        return tuple(_mutable(v) for v in value)
    return value


def _children(spec: pytree.TreeSpec) -> list:
    """``spec``'s child specs (``children()`` in newer torch, ``children_specs`` before)."""
    return spec.children() if callable(getattr(spec, "children", None)) else spec.children_specs


def _take(where, args: tuple, kwargs: dict):
    """A bound value with the call's arguments in place of the markers :meth:`CallSpec._binding`
    bound (a default stays as it is; ``*args`` and ``**kwargs`` are a tuple and a dict of them)."""
    if type(where) is _Position:
        return args[where.index]
    if type(where) is _Keyword:
        return kwargs[where.name]
    if type(where) is tuple and where and all(type(w) is _Position for w in where):
        return tuple(args[w.index] for w in where)
    if type(where) is dict and where and all(type(w) is _Keyword for w in where.values()):
        return {k: kwargs[w.name] for k, w in where.items()}
    return where


def _bind(signature: inspect.Signature, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


def _same(value, constant) -> bool:
    if value is constant:
        return True
    if type(value) is not type(constant) or not isinstance(constant, _BY_VALUE):
        return False
    return value == constant


def _label(name: str, kind, path) -> str:
    """``scale`` for ``**kwargs['scale']``; ``position_embeddings[1]``; ``mask``."""
    if kind == inspect.Parameter.VAR_KEYWORD and path and hasattr(path[0], "key"):
        name, path = str(path[0].key), path[1:]
    return name + "".join(str(k) for k in path)  # pytree keys print as [1], ['key'], .attr


def _placeholder_name(name: str, kind, path) -> str:
    """``hidden_states``; ``position_embeddings_0``; ``input_ids`` for ``**kwargs['input_ids']``."""
    keys = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
    if kind == inspect.Parameter.VAR_KEYWORD and keys:
        name, keys = keys[0], keys[1:]
    text = "_".join([name] + keys)
    text = re.sub(r"\W", "_", text)
    return text if text.isidentifier() else f"arg_{text}"


def _unique(name: str, taken: set) -> str:
    candidate, n = name, 1
    while candidate in taken:
        candidate, n = f"{name}_{n}", n + 1
    taken.add(candidate)
    return candidate


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return "a tensor"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    if isinstance(value, dict):
        return f"a dict with keys {sorted(map(str, value))}"
    return type(value).__name__


def example_call(made) -> tuple[Any, tuple, dict]:
    """A factory's result, ``(module, args)`` or ``(module, args, kwargs)``, as the three."""
    if not isinstance(made, (tuple, list)) or len(made) not in (2, 3):
        raise TypeError(f"a factory returns (module, args) or (module, args, kwargs), not {_describe(made)}")
    module, args, kwargs = (*made, {}) if len(made) == 2 else made
    if isinstance(args, torch.Tensor):
        args = (args,)
    if not isinstance(args, (tuple, list)) or not isinstance(kwargs, dict):
        raise TypeError(f"a factory's example inputs are a tuple of args and a dict of kwargs, not {_describe(args)}, {_describe(kwargs)}")
    return module, tuple(args), dict(kwargs)
