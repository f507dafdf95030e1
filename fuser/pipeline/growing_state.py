"""growing_state: glue at the length of a cache that grows each call stays eager.

transformers' ``DynamicCache`` grows by ``torch.cat`` at every decode step: its ``update``
returns keys and values one position longer each call. Glue computed on them at that length —
an eager attention's mask add and softmax over the keys, say — would be a kernel built for one
length: the guard would have to hold the length (and decline every later step), or the kernel
would meet another length (:mod:`fuser.install.leaf_sizes` raises then, after the cache was
written). So the nodes computed from such a cache whose value has the cache's length among
its sizes (or one more or less: a sink's logit concatenated to the scores, say), and the glue
computed from them (a max over the keys, also where it is read through the ``values`` of a
``max``'s result) up to the next leaf, are kept eager (reported with this reason) and the rest of
the layer is fused around them; the inputs that reach no kernel then (the attention mask) take any length
(:mod:`fuser.install.free_sizes`), and the fused layer serves every step.

A cache is taken to grow when it is transformers' ``DynamicCache`` (or a subclass of it); its
length is dim -2 of what its ``update`` returns, or what its ``get_seq_length`` and
``get_mask_sizes`` return: in the model's forward above the layers, which makes the causal mask
at the cache's length from the padding mask, that glue stays eager too, and the padding mask
(which grows by a key a step) takes any length.
"""

from __future__ import annotations

import sys

import torch
import torch.fx as fx

from fuser.install.leaf_sizes import fed_by_state
from fuser.trace.tracing import Traced

REASON = "computed from a dynamic cache at its length, which grows each call: left eager so that the fused forward serves every step"


def grows(state) -> bool:
    cache_utils = sys.modules.get("transformers.cache_utils")
    dynamic = getattr(cache_utils, "DynamicCache", None)
    return dynamic is not None and isinstance(state, dynamic)


def at_growing_length(traced: Traced, fusible, leaf) -> dict[fx.Node, str]:
    """The fusible nodes (``fusible(node)``) computed from a growing cache at its length, or from
    such a value through tensors (a ``max``'s result and its ``values`` too) up to a leaf
    (``leaf(node)``: an attention's product, whose sizes do not follow the keys') -> why. A
    size read off such a value is a number, not a value computed at the length."""
    call = traced.call
    states = call.states if call is not None else frozenset()
    growing = {n for n in traced.graph.nodes if n.op == "placeholder" and n.name in states and grows(traced.value(n))}
    if not growing:
        return {}
    lengths = set()
    for node in traced.graph.nodes:
        if node.op == "call_method" and node.target == "update" and node.args and node.args[0] in growing:
            value = traced.value(node)
            keys = value[0] if isinstance(value, (tuple, list)) and value else None
            if isinstance(keys, torch.Tensor) and keys.dim() >= 2 and keys.shape[-2] > 1:
                lengths |= {keys.shape[-2] - 1, keys.shape[-2], keys.shape[-2] + 1}
        elif node.op == "call_method" and node.target in _LENGTH_GETTERS and node.args and node.args[0] in growing:
            lengths |= {v + d for v in _ints(traced.value(node)) if v > 1 for d in (-1, 0, 1)}
    if not lengths:
        return {}
    fed, reached, held = fed_by_state(traced), set(), {}
    for node in traced.graph.nodes:  # in program order: what is computed from a held value is held too
        value = traced.shadows.get(node.name, (None,))[0]
        at_length = node in fed and isinstance(value, torch.Tensor) and bool(lengths & set(value.shape))
        if leaf(node) or not _tensors(value) or not (at_length or any(a in reached for a in node.all_input_nodes)):
            continue
        reached.add(node)
        if fusible(node):
            held[node] = REASON
    return held


#: The cache's methods that return its length (or the mask's, one more): the model's forward
#: above the layers makes its causal mask at that length.
_LENGTH_GETTERS = ("get_seq_length", "get_mask_sizes")


def _ints(value) -> list[int]:
    """The ints of ``value`` (an int, or a tuple of them)."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int) and not isinstance(v, bool)] if isinstance(value, (tuple, list)) else []


def _tensors(value) -> bool:
    """Is ``value`` a tensor, or a tuple holding one (a ``max``'s values and indices)?"""
    return isinstance(value, torch.Tensor) or isinstance(value, tuple) and any(isinstance(v, torch.Tensor) for v in value)
