"""any_size: a kernel of the call's inputs alone that runs PyTorch's ops for its glue where an
input comes at another size than the kernel was built for — so the guard need not hold it.

A decoder layer's additive attention mask is made from the boolean mask the model passes every
layer (``to`` and ``where``: one kernel, run once per forward, :mod:`fuser.install.once_per_forward`).
With generate's dynamic cache that mask grows by a key each step; a kernel built for its length
would hold the length in the guard, and every decode step after the first would run the layer
eager. Where a shared kernel's glue can run as the traced PyTorch ops (every node a function or
method call), its inputs' sizes are left free (:func:`fuser.install.free_sizes.free_sizes` is
not given its nodes) and its launch (:func:`at_any_size`) runs those ops at any size the kernel
was not built for, the kernel itself at the sizes it was: still once per forward, so a decode
step of a dynamic cache launches the mask's two ops once for all the layers.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx

from fuser.install.leaf_sizes import fits, traced_sizes
from fuser.trace.tracing import Traced


def eager_region(region, graph: fx.Graph) -> Callable | None:
    """The region's traced ops as one function of its inputs returning its outputs (a tuple, as
    a kernel's launch does); None where one is not a plain function or method call."""
    nodes = [n for n in graph.nodes if n in region.covered]
    if not nodes or any(n.op not in ("call_function", "call_method") for n in nodes):
        return None
    ops = fx.Graph()
    env = {node: ops.placeholder(node.name) for node in region.inputs}
    for node in nodes:
        if any(a not in env for a in node.all_input_nodes):
            return None  # (reads a value the kernel is not given)
        env[node] = ops.node_copy(node, env.__getitem__)
    ops.output(tuple(env[node] for node in region.outputs))
    return fx.GraphModule(torch.nn.Module(), ops)


def at_any_size(launch: Callable, ops: Callable, inputs: list[fx.Node], traced: Traced) -> Callable:
    """``launch`` where every tensor argument has the sizes the trace gave its input (besides the
    batch), ``ops`` (:func:`eager_region`) otherwise."""
    expected = [traced_sizes(traced, node) for node in inputs]

    def launched(*args):
        for value, sizes in zip(args, expected):
            if sizes is not None and isinstance(value, torch.Tensor) and not fits(value.shape, sizes):
                return ops(*args)
        return launch(*args)

    launched.__name__ = getattr(launch, "__name__", "launch")
    return launched
