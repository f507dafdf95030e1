"""splice: put the fused graph back into the eager module, in place, behind a guard.

The fused forward is Python generated from the rewritten fx graph with ``self`` as the root,
bound to the original module: parameters, buffers and leaves are looked up on the live
module at every call, so nothing is copied and ``state_dict`` is unchanged. The exception is
glue computed from parameters alone (a weight's cast), which apply computes once: re-apply after
loading new weights. ``module.forward`` becomes a guarded wrapper that runs the fused graph only
when the call looks like the traced one (dtypes, devices, non-token sizes, at least one token,
the user's own predicate) and the original forward otherwise. :func:`restore` undoes it.
"""

from __future__ import annotations

import functools
import inspect
import operator
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx

from fuser.canon import COMPUTE, META, UNIT_VIEW, VIEW, COp
from fuser.trace import Traced

STATE_ATTR = "_fuser_state"


def rewrite_graph(
    graph: fx.Graph,
    cops: dict[fx.Node, COp],
    regions: list,
    launchers: dict[int, Callable],
    constants: dict[fx.Node, str] | None = None,
) -> tuple[fx.Graph, set[fx.Node]]:
    """A new graph where each region is one call to its launcher, placed at its position, and
    each node in ``constants`` reads the module attribute it names; and the old graph's nodes
    that are still in it."""
    constants = constants or {}
    at_position: dict[fx.Node, list] = {}
    covered = set()
    for i, region in enumerate(regions):
        at_position.setdefault(region.position, []).append((i, region))
        covered |= region.covered
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    origin: dict[fx.Node, fx.Node] = {}
    dead: set[fx.Node] = set()
    waiting: list[fx.Node] = []  # pure nodes (a view, a no-op cast) of outputs of later kernels

    def copy(node):
        env[node] = new.node_copy(node, lambda n: env[n])
        origin[env[node]] = node

    def flush():
        """Copy the waiting nodes whose inputs exist now, in program order."""
        ready = [n for n in waiting if all(a in env for a in n.all_input_nodes)]
        while ready:
            for node in ready:
                waiting.remove(node)
                copy(node)
            ready = [n for n in waiting if all(a in env for a in n.all_input_nodes)]

    # Attribute reads (parameters, buffers) come first: a kernel may run before the point
    # where the traced code first touched an attribute it reads.
    attributes = [n for n in graph.nodes if n.op == "get_attr"]
    for node in graph.nodes:
        if attributes and node.op != "placeholder":
            for attr in attributes:
                copy(attr)
            attributes = []
        pending = list(at_position.get(node, ()))
        while pending:  # kernels placed at the same point run producers first
            ready = [(i, r) for i, r in pending if all(a in env for a in r.inputs + [s.args[0] for s in r.stores.values()])]
            if not ready:
                raise AssertionError(f"kernels at `{node.name}` wait on each other's outputs")
            for i, region in ready:
                # An output stored in place is written into its target's view, made here.
                targets = [new.call_function(operator.getitem, (env[s.args[0]], s.args[1])) for s in region.stores.values()]
                call = new.call_function(launchers[i], tuple(env[a] for a in region.inputs) + tuple(targets))
                call.name = f"fused_{region.pattern}_{i}"
                for k, out in enumerate(region.outputs):
                    env[out] = new.call_function(operator.getitem, (call, k))
                pending.remove((i, region))
                flush()
        if node in covered or node in env:  # fused, or an attribute read already made
            continue
        if node in constants:
            env[node] = new.get_attr(constants[node])
            continue
        if any(a not in env for a in node.all_input_nodes):
            if node.op == "output" or _pure(cops.get(node)):
                waiting.append(node)  # reads a kernel's output made later: copied once it is
            else:
                dead.add(node)  # only reads values no longer computed: must be unused (checked below)
            continue
        copy(node)
    flush()
    for node in waiting:
        if node not in env:
            dead.add(node)
    for node in dead:
        live = [u.name for u in node.users if u not in dead and u not in covered]
        if live or node.op == "output":
            raise AssertionError(f"`{node.name}` reads a fused intermediate but is used by {live or 'the output'}")
    _drop_unused_views(new, origin, cops)
    new.lint()
    return new, {origin[n] for n in new.nodes if n in origin}


def _pure(cop: COp | None) -> bool:
    """A node without effects, which may run later than where it was traced."""
    return cop is not None and (cop.kind in (VIEW, UNIT_VIEW, META) or cop.op == "identity")


def _drop_unused_views(graph: fx.Graph, origin: dict, cops: dict):
    """Remove pure nodes (views, glue math, size arithmetic) nobody reads any more."""
    for node in reversed(list(graph.nodes)):
        old = origin.get(node)
        cop = cops.get(old) if old is not None else None
        pure = cop is not None and cop.kind in (VIEW, UNIT_VIEW, META, COMPUTE)
        if pure and not node.users and node.op != "output" and not (cop.kind == META and cop.op == "setitem"):
            graph.erase_node(node)


def compile_forward(graph: fx.Graph, module: torch.nn.Module) -> Callable:
    """The graph as a method of ``module`` (attributes looked up on ``self`` at call time)."""
    code = graph.python_code(root_module="self")
    namespace = dict(code.globals)
    exec(compile(code.src, f"<fuser fused forward of {type(module).__name__}>", "exec"), namespace)
    return types.MethodType(namespace["forward"], module)


@dataclass
class Guard:
    """When the fused forward may run: what the trace assumed about the call."""

    signature: inspect.Signature
    traced: list[tuple[str, Any]]  # (name, spec) for each traced argument
    defaults: dict[str, Any]  # parameters baked in at their default values
    predicate: Callable[..., bool] | None = None

    @classmethod
    def from_trace(cls, module: torch.nn.Module, traced: Traced, predicate=None) -> "Guard":
        signature = inspect.signature(module.forward)
        specs = []
        for name, value in zip(traced.input_names, traced.example_inputs):
            if isinstance(value, torch.Tensor):
                batch = traced.batch_inputs.get(name)
                sizes = tuple(None if i == batch else s for i, s in enumerate(value.shape))
                specs.append((name, ("tensor", value.dtype, value.device, sizes)))
            else:
                specs.append((name, ("value", value)))
        names = set(traced.input_names)
        defaults = {n: p.default for n, p in signature.parameters.items() if n not in names}
        return cls(signature, specs, defaults, predicate)

    def why_not(self, args, kwargs) -> str | None:
        """None when the fused forward applies to this call, else the reason it does not."""
        return self.check(args, kwargs)[1]

    def check(self, args, kwargs) -> tuple[list | None, str | None]:
        """(the traced arguments in order, None) when the fused forward applies, else (None, why)."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            return None, str(e)
        bound.apply_defaults()
        reason = self._mismatch(bound.arguments)
        if reason is None and self.predicate is not None and not self.predicate(*args, **kwargs):
            reason = "the user guard declined"
        if reason is not None:
            return None, reason
        return [bound.arguments[name] for name, _ in self.traced], None

    def _mismatch(self, arguments) -> str | None:
        for name, default in self.defaults.items():
            if arguments.get(name, default) is not default:
                return f"{name} differs from its traced default"
        for name, spec in self.traced:
            value = arguments.get(name)
            if spec[0] == "value":
                if value != spec[1]:
                    return f"{name} is {value!r}, traced with {spec[1]!r}"
                continue
            _, dtype, device, sizes = spec
            if not isinstance(value, torch.Tensor):
                return f"{name} is not a tensor"
            if value.dtype != dtype or value.device != device or value.dim() != len(sizes):
                return f"{name} is {value.dtype} {tuple(value.shape)} on {value.device}"
            for i, (have, want) in enumerate(zip(value.shape, sizes)):
                if want is None:
                    if have == 0:
                        return f"{name} has no tokens"
                elif have != want:
                    return f"{name} dim {i} is {have}, traced with {want}"
        return None


@dataclass
class FuserState:
    original_forward: Callable | None  # the instance attribute we replaced, if any
    fused_forward: Callable
    guard: Guard
    report: Any
    constants: tuple[str, ...] = ()  # attributes holding values computed from parameters


def install(module: torch.nn.Module, fused_forward: Callable, guard: Guard, report, constants=None) -> None:
    """Route ``module.forward`` through the guard to ``fused_forward``.

    ``constants`` (name -> tensor) become plain attributes of the module — not parameters or
    buffers, so ``state_dict`` is unchanged; they hold values computed from parameters at
    apply time (re-apply after loading new weights).
    """
    constants = constants or {}
    original = module.__dict__.get("forward")
    eager = module.forward

    @functools.wraps(eager)
    def forward(*args, **kwargs):
        traced_args, _ = guard.check(args, kwargs)
        if traced_args is not None:
            return fused_forward(*traced_args)
        return eager(*args, **kwargs)

    state = FuserState(original, fused_forward, guard, report, tuple(constants))
    for name, value in constants.items():
        object.__setattr__(module, name, value)
    object.__setattr__(module, STATE_ATTR, state)
    module.forward = forward


def restore(module: torch.nn.Module) -> None:
    """Undo :func:`fuser.apply`: the module's forward is its own again."""
    state = module.__dict__.get(STATE_ATTR)
    if state is None:
        raise ValueError(f"{type(module).__name__} is not fused by fuser")
    if state.original_forward is None:
        del module.forward
    else:
        module.forward = state.original_forward
    for name in state.constants:
        del module.__dict__[name]
    del module.__dict__[STATE_ATTR]


def is_fused(module: torch.nn.Module) -> bool:
    return STATE_ATTR in module.__dict__
