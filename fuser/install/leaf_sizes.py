"""leaf_sizes: a kernel fed by a call given state checks the sizes it was built for.

A call given a state object (a KV cache's ``update``) returns what the state holds: a dynamic
cache's keys grow each step while every input the guard checks keeps its size. Where such a
value, or one computed from it, reaches a kernel, the kernel was built for the size the trace
saw; its launch is then checked first (:func:`size_checked`): a tensor whose size differs from
the trace's, besides the batch, raises :class:`StateSizeChanged`, naming the kernel and the size,
rather than letting the kernel compute on part of it. (transformers' attention masks grow with a
dynamic cache too, and the guard declines those calls before anything runs.)
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx

from fuser.trace.tracing import Traced


class StateSizeChanged(RuntimeError):
    """A value of a call given state reached a kernel at a size the kernel was not built for."""


def fed_by_state(traced: Traced) -> set[fx.Node]:
    """The nodes whose value depends on a call given a state object (or is one)."""
    states = traced.call.states if traced.call is not None else frozenset()
    from_state = {n for n in traced.graph.nodes if n.op == "placeholder" and n.name in states}
    fed: set[fx.Node] = set()
    for node in traced.graph.nodes:
        inputs = node.all_input_nodes
        if node.op in ("call_function", "call_method", "call_module") and any(a in from_state or a in fed for a in inputs):
            if any(a in fed for a in inputs) or _is_call(node):
                fed.add(node)
            else:
                from_state.add(node)  # an attribute read off the state: still the state
    return fed


def _is_call(node: fx.Node) -> bool:
    """A call that may return what the state holds (not a plain attribute read off it)."""
    return not (node.op == "call_function" and node.target is getattr)


def size_checked(launch: Callable, name: str, inputs: list[fx.Node], traced: Traced, fed: set[fx.Node]) -> Callable:
    """``launch`` with a check of the sizes of its inputs that a call given state fed; itself
    when there are none."""
    expected = [traced_sizes(traced, node) if node in fed else None for node in inputs]
    if not any(expected):
        return launch

    def checked(*args):
        for value, sizes, node in zip(args, expected, inputs):
            if sizes is not None and isinstance(value, torch.Tensor) and not fits(value.shape, sizes):
                raise StateSizeChanged(
                    f"fuser: kernel {name} was built for `{node.name}` of size {_shown(sizes)} and got {tuple(value.shape)}: "
                    "a call given state (a cache that grows) returned another size than at apply time, and that "
                    "state has been written already. Fuse with a cache of fixed size (transformers' StaticCache)."
                )
        return launch(*args)

    checked.__name__ = getattr(launch, "__name__", "launch")
    return checked


def traced_sizes(traced: Traced, node: fx.Node) -> tuple | None:
    """The sizes the trace gave ``node``'s value, None at a dim that follows the batch."""
    a, b = traced.shadows.get(node.name, (None, None))
    if not isinstance(a, torch.Tensor):
        return None
    return tuple(x if x == y else None for x, y in zip(a.shape, b.shape))


def fits(shape, sizes: tuple) -> bool:
    return len(shape) == len(sizes) and all(want is None or have == want for have, want in zip(shape, sizes))


def _shown(sizes: tuple) -> tuple:
    return tuple("T" if s is None else s for s in sizes)
