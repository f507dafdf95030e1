"""rewrite: the fused graph — each kernel's region replaced by one call to its launcher, at the
position the planning chose — and a graph as the Python function or method that runs it, with
every attribute looked up on the module it is called with (:mod:`fuser.install.splice` installs it)."""

from __future__ import annotations

import operator
import types
from typing import Callable

import torch
import torch.fx as fx

from fuser.canon.canonicalize import COMPUTE, META, UNIT_VIEW, VIEW, COp

#: The key of a kernel call's ``node.meta`` that holds its region.
REGION_META = "fuser_region"


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
    # A kernel placed among the inputs runs where the body starts, after the attribute reads.
    body = next((n for n in graph.nodes if n.op != "placeholder"), None)
    for i, region in enumerate(regions):
        position = body if region.position.op == "placeholder" else region.position
        at_position.setdefault(position, []).append((i, region))
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
                call.meta[REGION_META] = region  # which outputs are fresh buffers (fuser.pipeline.residual_in_gemm)
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


def compile_function(graph: fx.Graph, what: str) -> Callable:
    """The graph as a plain function whose first argument is the module (``self``): every
    attribute is looked up on the module it is called with, so a copy runs on its own."""
    code = graph.python_code(root_module="self")
    namespace = dict(code.globals)
    exec(compile(code.src, f"<fuser {what}>", "exec"), namespace)
    return namespace["forward"]


def compile_forward(graph: fx.Graph, module: torch.nn.Module) -> Callable:
    """The graph as a method of ``module`` (attributes looked up on ``self`` at call time)."""
    return types.MethodType(compile_function(graph, f"fused forward of {type(module).__name__}"), module)
