"""decode_attentions: the attention calls of a fused graph (``F.scaled_dot_product_attention``)
run on fuser's decode attention kernel at one query row (:mod:`fuser.install.decode_attention`),
PyTorch's at any other call.

Taken where the module runs on a CUDA GPU: each call is checked at run time (one query row, the
dtypes, the mask's kind and shape, no dropout, not causal) and runs PyTorch's where the kernel
does not take it, so a prefill through the same fused graph is PyTorch's attention. On the CPU
nothing changes (the kernel runs there only in Triton's interpreter).

:func:`cache_writes_in_attention` then gives such a call the write into the static cache before
it, where the cache's update is read by that call alone (:mod:`fuser.install.cache_in_attention`),
and :func:`slices_combined_in_attention` has that kernel combine its slices of keys too.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from fuser.install import cache_in_attention, decode_attention, kv_cache
from fuser.trace.attention_calls import SDPA
from fuser.trace.leaves import TOOK_OVER


def decode_attentions(graph: fx.Graph, on_gpu: bool, pdl: bool = False) -> list[str]:
    """Rewrite each attention call of ``graph`` (in place) where ``on_gpu``, its kernel launched
    with programmatic dependent launch where ``pdl``; returns the calls rewritten, named."""
    if not on_gpu:
        return []
    done = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target in SDPA:
            node.target = decode_attention.launcher(pdl)
            done.append(node.name + (" (launched with PDL)" if pdl else ""))
    return done


def on_gpu(example_inputs) -> bool:
    """Does the module run on a CUDA GPU (its example call's tensors there)?"""
    return any(getattr(v, "device", None) is not None and v.device.type == "cuda" for v in example_inputs)


def cache_writes_in_attention(graph: fx.Graph) -> list[tuple[str, str]]:
    """Make each attention call on the kernel whose keys and values are a static cache's update
    read by it alone (``k, v = cache.update(new_k, new_v, i)`` on fuser's one-kernel write, then
    ``attention(q, k, v, ...)``) one call of :func:`~fuser.install.cache_in_attention.attend_writing`
    in the attention's place, in place; returns each merged pair, the attention by its node's name,
    the update as the report names it (``past_key_values.update``).
    Not merged where anything between the two reads the cache object."""
    launchers = {decode_attention.launcher(pdl): pdl for pdl in (False, True)}
    updaters = {kv_cache.updater(False), kv_cache.updater(True)}
    order = {node: i for i, node in enumerate(graph.nodes)}
    merged = []
    for attend in list(graph.nodes):
        if attend.op != "call_function" or attend.target not in launchers or len(attend.args) != 3:
            continue
        update = _update_read_by(attend, updaters)
        if update is None:
            continue
        cache = update.args[0]
        if any(order[update] < order[user] < order[attend] for user in cache.users):
            continue
        name, written = attend.name, f"{cache.target if cache.op == 'placeholder' else cache.name}.update"
        with graph.inserting_before(attend):
            both = graph.call_function(cache_in_attention.writer(launchers[attend.target]),
                                       (*update.args, attend.args[0]), dict(attend.kwargs))  # fmt: skip
        both.meta = {**attend.meta, TOOK_OVER: update.name}  # (a layer's index read at run time: fuser.model)
        attend.replace_all_uses_with(both)
        keys, values = attend.args[1], attend.args[2]
        for node in (attend, keys, values, update):
            graph.erase_node(node)
        merged.append((name, written))
    return merged


def _update_read_by(attend: fx.Node, updaters) -> fx.Node | None:
    """The update (``cache.update(new_k, new_v, layer_idx)`` on fuser's write) whose keys and
    values ``attend`` takes and nothing else reads; None where there is none."""
    keys, values = attend.args[1], attend.args[2]
    picks = [(n, i) for n, i in ((keys, 0), (values, 1))
             if isinstance(n, fx.Node) and n.op == "call_function" and n.target is operator.getitem and n.args[1] == i]  # fmt: skip
    if len(picks) != 2 or keys.args[0] is not values.args[0] or any(set(n.users) != {attend} for n, _ in picks):
        return None
    update = keys.args[0]
    if update.op != "call_function" or update.target not in updaters or len(update.args) != 4 or update.kwargs:
        return None
    return update if set(update.users) == {keys, values} and isinstance(update.args[0], fx.Node) else None


def slices_combined_in_attention(graph: fx.Graph) -> list[str]:
    """Make each call that writes the cache and attends (:func:`cache_writes_in_attention`)
    combine its slices of keys in its kernel, not in a second one (in place); returns the calls,
    named."""
    done = []
    for node in graph.nodes:
        if node.op == "call_function" and not getattr(node.target, "combines", True):
            node.target = cache_in_attention.writer(node.target.decode_attention_pdl, combine=True)
            done.append(node.name)
    return done
