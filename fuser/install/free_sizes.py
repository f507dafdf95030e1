"""free_sizes: sizes of the fused forward's inputs that the guard need not hold.

The guard holds every size of every input but the batch: the kernels are built for them. An
input that reaches no kernel through glue — passed through eager ops to leaves only, as an
attention mask goes to ``scaled_dot_product_attention`` — is computed on by code that takes any
size, so a size of it may differ from call to call: transformers' 4-D mask grows by a key each
step of a dynamic cache. Such a dim is *free* (:func:`free_sizes`), unless the graph holds a
number that may have been read off it: where its size, or one more or less, is a literal of
any node (a slice ``mask[..., :6]`` of a length read at trace time), the dim stays held. So it
does where that size is one of a value a kernel reads that a call given state returned: a
dynamic cache's keys grow with the mask, and a kernel built for their length raises when they
grow (:mod:`fuser.install.leaf_sizes`) after the cache was written; the guard, holding the
mask's length, declines that call before anything runs.
Size-1 dims (broadcast heads) stay held too. A kernel computed from a free input through a
leaf checks its sizes at run time (:mod:`fuser.install.leaf_sizes`).

A dim held only because a literal lies next to its size (``near_literals``: a padding mask
of 17 keys in a graph with a head dim of 16) may well be free: the guard says so when it
declines a call for it, and a model fused at its first decode call is fused again from a later
one (:mod:`fuser.model.lazy_model`), at a length no literal lies next to.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate

from fuser.ir.canonical_op import HEAVY
from fuser.trace.tracing import Traced


def free_sizes(traced: Traced, cops: dict, kernel_nodes: set[fx.Node], fed: set[fx.Node] = frozenset()) -> tuple[dict, dict]:
    """``(free, near_literals)`` for the graph inputs that reach no kernel through glue.

    ``free``: input name -> its dims that may take any size at each call. ``near_literals``:
    input name -> {dim: the literals next to its size} for the dims held only because a literal
    of the graph lies next to their size (not a size of a kernel's value computed from state).
    ``kernel_nodes``: the traced nodes the kernels compute or copy; a leaf (a ``HEAVY`` node) is
    taken to give a result whose sizes do not follow its inputs' (an attention's output does not
    follow its mask's keys): :func:`reached_from` tells which kernels to check at run time all
    the same. ``fed``: the nodes computed from a call given state
    (:func:`fuser.install.leaf_sizes.fed_by_state`)."""
    literals, state = _int_literals(traced.graph), _state_sizes(traced, kernel_nodes, fed)
    free, near = {}, {}
    for node in traced.graph.nodes:
        if node.op != "placeholder" or _reaches(node, kernel_nodes, cops):
            continue
        value = traced.shadows.get(node.name, (None,))[0]
        if not isinstance(value, torch.Tensor):
            continue
        batch = traced.batch_inputs.get(node.name)
        sizes = {d: {size - 1, size, size + 1} for d, size in enumerate(value.shape) if d != batch and size > 1}
        dims = tuple(d for d, around in sizes.items() if not around & (literals | state))
        held = {d: frozenset(around & literals) for d, around in sizes.items() if around & literals and not around & state}
        if dims:
            free[node.name] = dims
        if held:
            near[node.name] = held
    return free, near


def _state_sizes(traced: Traced, kernel_nodes: set[fx.Node], fed: set[fx.Node]) -> set[int]:
    """The sizes of the values computed from a call given state that a kernel computes or reads."""
    sizes: set[int] = set()
    for node in fed:
        if node in kernel_nodes or any(u in kernel_nodes for u in node.users):
            value = traced.shadows.get(node.name, (None,))[0]
            if isinstance(value, torch.Tensor):
                sizes.update(s for s in value.shape if s > 1)
    return sizes


def _reaches(node: fx.Node, kernel_nodes: set[fx.Node], cops: dict) -> bool:
    """Does ``node`` reach a kernel through glue, not through a leaf?"""
    seen, stack = set(), [node]
    while stack:
        for user in stack.pop().users:
            if user in seen:
                continue
            seen.add(user)
            if user in kernel_nodes:
                return True
            if getattr(cops.get(user), "kind", None) != HEAVY:
                stack.append(user)
    return False


def reached_from(graph: fx.Graph, names) -> set[fx.Node]:
    """Every node computed from the inputs named, through anything."""
    reached = {n for n in graph.nodes if n.op == "placeholder" and n.name in names}
    for node in graph.nodes:
        if any(a in reached for a in node.all_input_nodes):
            reached.add(node)
    return reached


def _int_literals(graph: fx.Graph) -> set[int]:
    found: set[int] = set()

    def collect(x):
        if isinstance(x, slice):
            collect((x.start, x.stop, x.step))
        elif isinstance(x, bool):
            pass
        elif isinstance(x, int):
            found.add(abs(x))
        return x

    for node in graph.nodes:
        map_aggregate((node.args, node.kwargs), collect)
    return found
