"""attention_calls: attention that reads its keys and values as they are, rewritten in a traced
graph before planning: the arguments of ``F.scaled_dot_product_attention`` calls, and eager
attention's two products. Each sdpa rewrite but one keeps the backend sdpa picks for the call as
made (PyTorch's own choice, asked on the example's call), so each computes what eager does.

- **Grouped heads.** Keys and values whose heads were repeated for grouped-query attention
  (transformers' ``repeat_kv``: ``x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)``;
  or ``x.repeat_interleave(n, dim=1)``) are passed as they were, with ``enable_gqa=True``: the
  attention reads each key head for its ``n`` query heads itself, and the two copies of the
  whole cache a call (eager's, or fuser's copy kernels) are gone. A chain counts as a repeat
  when it is data movement only and, replayed on a tensor of distinct values, gives that
  tensor's ``repeat_interleave`` over the heads (at both traced batch sizes). It is rewritten
  only where sdpa picks the same fused backend for the grouped call (cuDNN attention on an
  H200, for one); transformers passes grouped heads itself only without a mask, since the
  math backend, which repeats the heads itself, may be all that takes a masked one.
- **One key head.** Keys and values of one head passed as they are, which sdpa broadcasts
  over the query's heads (multi-query attention: Falcon's), keep the call on the math backend,
  whose softmax and products run as kernels of their own. With ``enable_gqa=True`` the call is
  the same attention, each query head against the one key head, and sdpa picks a fused
  backend: rewritten only where it does. This is the one rewrite that changes the backend, and
  so the rounding, of a call: ``fuser check`` compares it with eager, within the layer's
  tolerance.
- **Boolean masks.** sdpa turns a boolean mask into an additive one after it picks its
  backend: 0 where True and, where False, -inf (-65504 for cuDNN attention), in the query's
  dtype: three launches inside the call. The same ``where`` is put in the graph before the
  call instead, as glue that fuses with its neighbours (one kernel for every call that reads
  the mask). A row with nothing to attend to gets what eager gives it.
- **Eager attention's products.** transformers' ``eager_attention_forward`` (every model's
  with ``attn_implementation="eager"``; DeepSeek-V4 takes no other) repeats the heads too, then
  ``matmul(q, k.transpose(2, 3))`` and ``matmul(p, v)``: each becomes one product per key
  head with its ``n`` query heads as rows (``q.unflatten(1, (hk, n)).flatten(2, 3)``), the same dot
  products without the copies — where the batch is the one dim that follows the tokens.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

SDPA = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
MATMUL = (torch.matmul, operator.matmul)
_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
# Data movement a repeat of the heads may be made of; the replay decides what it computes.
_MOVES = {"expand", "reshape", "view", "contiguous", "unsqueeze", "repeat_interleave", "flatten", "clone"}
_MOVE_FUNCTIONS = {operator.getitem, torch.reshape, torch.unsqueeze, torch.repeat_interleave, torch.flatten}
_MAX_CHAIN = 8
_MATH, _CUDNN = SDPBackend.MATH.value, SDPBackend.CUDNN_ATTENTION.value
_CUDNN_FILL = -65504.0  # what sdpa fills a boolean mask's False with for cuDNN attention


@dataclass
class AttentionRewrite:
    node: str  # the attention call (sdpa) or product (matmul)
    grouped: int = 0  # its query heads per key head, read in place of a repeat (0: not rewritten)
    mask: str = ""  # the additive mask made of its boolean one (the node), if any
    copies_removed: int = 0  # eager launches of the repeats no longer run
    matmul: bool = False  # a product of eager attention, its query heads regrouped by key head
    backend: str = ""  # the fused backend a multi-query call takes from the math one, if any

    def line(self) -> str:
        done = []
        if self.grouped and self.matmul:
            done.append(f"reads the un-repeated heads, the query's {self.grouped} heads a key head as its rows: "
                        f"{self.copies_removed} copies of the repeated heads removed")  # fmt: skip
        elif self.grouped and self.backend:
            done.append(f"one key head read as grouped (enable_gqa, {self.grouped} query heads a key head): "
                        f"sdpa's {self.backend} backend in place of its math one")  # fmt: skip
        elif self.grouped:
            done.append(f"keys and values read as grouped heads (enable_gqa, {self.grouped} query heads a key head): "
                        f"{self.copies_removed} copies of the repeated heads removed")  # fmt: skip
        if self.mask:
            done.append(f"boolean mask made additive as glue ({self.mask})")
        return f"{self.node}: " + "; ".join(done)


def rewrite_attention_calls(graph: fx.Graph, shadows: dict) -> list[AttentionRewrite]:
    """Rewrite every sdpa call and eager-attention product of the traced ``graph`` in place
    (``shadows``: node name -> (value at T, value at T+1); new nodes get theirs); returns a
    record per call changed. Size reads nothing uses must be gone already: each would keep a
    repeat alive."""
    traced, done = _Values(shadows), []
    additive: dict[tuple, fx.Node] = {}
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in MATMUL:
            done += [r for r in [_grouped_matmul(graph, traced, node)] if r is not None]
            continue
        if node.op != "call_function" or node.target not in SDPA:
            continue
        args = _bound(node)
        if args is None:
            continue
        values = {name: traced.value(a) if isinstance(a, fx.Node) else a for name, a in args.items()}
        eager = _backend(values)
        if eager is None:
            continue
        record = AttentionRewrite(node.name)
        mask = args.get("attn_mask")
        if isinstance(values.get("attn_mask"), torch.Tensor) and values["attn_mask"].dtype == torch.bool:
            dtype = values["query"].dtype
            fill = _CUDNN_FILL if eager == _CUDNN else float("-inf")
            made = _made_additive(values["attn_mask"], fill, dtype)
            if _backend({**values, "attn_mask": made}) != eager:
                continue
            if (mask, fill, dtype) not in additive:
                additive[mask, fill, dtype] = _additive_mask(graph, traced, mask, fill, dtype, before=node)
            mask = additive[mask, fill, dtype]
            _set(node, "attn_mask", mask)
            values["attn_mask"], record.mask = made, mask.name
        grouped = _grouped(traced, args, values, eager)
        if grouped is not None:
            (key, value), n, removed = grouped
            _set(node, "key", key)
            _set(node, "value", value)
            _set(node, "enable_gqa", True)
            record.grouped, record.copies_removed = n, _erase_unused(graph, shadows, removed)
        elif (backend := _one_head_fused(values, eager)) is not None:
            _set(node, "enable_gqa", True)
            record.grouped, record.backend = values["query"].shape[1], backend
        if record.grouped or record.mask:
            done.append(record)
    graph.lint()
    return done


class _Values:
    """The shadows, read as the trace reads them."""

    def __init__(self, shadows: dict):
        self.shadows = shadows

    def value(self, node: fx.Node):
        return self.shadows[node.name][0]


def _bound(node: fx.Node) -> dict | None:
    """The call's arguments by name, or None where it passes more than sdpa takes."""
    if len(node.args) > len(_ARGS) or any(k not in _ARGS for k in node.kwargs):
        return None
    return {**dict(zip(_ARGS, node.args)), **node.kwargs}


def _set(node: fx.Node, name: str, value) -> None:
    """Set one argument of the call, keeping positional ones where they are."""
    position = _ARGS.index(name)
    if position < len(node.args):
        node.update_arg(position, value)
    else:
        node.update_kwarg(name, value)


def _backend(values: dict) -> int | None:
    """The backend sdpa picks for a call with these arguments (PyTorch's own choice,
    ``torch._fused_sdp_choice``), or None where it cannot tell."""
    try:
        return torch._fused_sdp_choice(
            values["query"], values["key"], values["value"], values.get("attn_mask"), values.get("dropout_p", 0.0),
            values.get("is_causal", False), scale=values.get("scale"), enable_gqa=bool(values.get("enable_gqa", False)),
        )  # fmt: skip
    except Exception:  # noqa: BLE001 — a call it cannot judge is left as it is
        return None


def _made_additive(mask: torch.Tensor, fill: float, dtype: torch.dtype) -> torch.Tensor:
    return torch.where(mask, 0.0, fill).to(dtype)


def _additive_mask(graph: fx.Graph, traced: _Values, mask: fx.Node, fill: float, dtype: torch.dtype, before: fx.Node) -> fx.Node:
    """``where(mask, 0, fill).to(dtype)``, as sdpa makes it, inserted before ``before``."""
    with graph.inserting_before(before):
        where = graph.call_function(torch.where, (mask, 0.0, fill))
        cast = graph.call_method("to", (where, dtype))
    traced.shadows[where.name] = tuple(torch.where(m, 0.0, fill) for m in traced.shadows[mask.name])
    traced.shadows[cast.name] = tuple(w.to(dtype) for w in traced.shadows[where.name])
    return cast


def _one_head_fused(values: dict, eager: int) -> str | None:
    """The fused backend sdpa picks for a multi-query call (keys and values of one head, which
    sdpa broadcasts over the query's heads: Falcon's) given ``enable_gqa=True``, where the
    broadcast is what keeps the call as made on the math backend; else None. The attention is
    the same, each query head against the one key head; the backend, and so its rounding,
    is not (``fuser check`` compares it with eager)."""
    if eager != _MATH or values.get("enable_gqa"):
        return None
    q, k, v = (values.get(a) for a in ("query", "key", "value"))
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return None
    if k.shape[1] != 1 or v.shape[1] != 1 or q.shape[1] == 1:
        return None
    chosen = _backend({**values, "enable_gqa": True})
    if chosen is None or chosen == _MATH:
        return None
    return SDPBackend(chosen).name.lower()


def _grouped(traced: _Values, args: dict, values: dict, eager: int) -> tuple | None:
    """((key source, value source), heads per group, nodes of the repeats) where both key and
    value are repeats of the heads by the same factor and sdpa picks the same fused backend for
    the grouped call as for the call made; else None."""
    if values.get("enable_gqa") or not all(isinstance(args.get(a), fx.Node) for a in ("query", "key", "value")):
        return None
    query = values["query"]
    if not isinstance(query, torch.Tensor) or query.dim() != 4:
        return None
    found = [_repeat_of(traced, args[a], query.shape[1]) for a in ("key", "value")]
    if None in found or found[0][1] != found[1][1]:
        return None
    (key, n, key_chain), (value, _, value_chain) = found
    grouped = {**values, "key": traced.value(key), "value": traced.value(value), "enable_gqa": True}
    if eager == _MATH or _backend(grouped) != eager:
        return None
    return (key, value), n, key_chain + value_chain


def _grouped_matmul(graph: fx.Graph, traced: _Values, node: fx.Node) -> AttentionRewrite | None:
    """``matmul(q, repeat(k).transpose(2, 3))`` or ``matmul(p, repeat(v))`` — eager attention's
    two products, each head of ``q`` (``[b, hk * n, l, x]``) against its key head repeated —
    as one product per key head over all its query heads: ``matmul(q.unflatten(1, (hk, n))
    .flatten(2, 3), k.transpose(2, 3)).unflatten(2, (n, l)).flatten(1, 2)``. The same dot
    products, without the copies; only where the batch is the one dim that follows the tokens.
    No size of the keys is written into the graph (``reshape(-1, hk * n, l, s)`` would hold the
    cache's length ``s``, which grows each step of a dynamic cache)."""
    if len(node.args) != 2 or node.kwargs or not all(isinstance(a, fx.Node) for a in node.args):
        return None
    a, b = node.args
    if not all(_batch_first_4d(traced, n) for n in (a, node)):
        return None
    transposed = _transposes_last_two(b)
    repeated = b.args[0] if transposed else b
    found = _repeat_of(traced, repeated, traced.value(a).shape[1])
    if found is None:
        return None
    source, n, chain = found
    heads, rows = traced.value(a).shape[1:3]
    with graph.inserting_before(node):
        split_a = graph.call_method("unflatten", (a, 1, (heads // n, n)))
        grouped_a = graph.call_method("flatten", (split_a, 2, 3))
        grouped_b = graph.call_method("transpose", (source, 2, 3)) if transposed else source
        product = graph.call_function(torch.matmul, (grouped_a, grouped_b))
        split_out = graph.call_method("unflatten", (product, 2, (n, rows)))
        out = graph.call_method("flatten", (split_out, 1, 2))
    made = {new: [] for new in (split_a, grouped_a, grouped_b, product, split_out, out) if new is not source}
    for at in (0, 1):  # the new nodes' shadows, at both traced batch sizes
        values = {a: traced.shadows[a.name][at], source: traced.shadows[source.name][at]}
        values[split_a] = values[a].unflatten(1, (heads // n, n))
        values[grouped_a] = values[split_a].flatten(2, 3)
        values[grouped_b] = values[source].transpose(2, 3) if transposed else values[source]
        values[product] = torch.matmul(values[grouped_a], values[grouped_b])
        values[split_out] = values[product].unflatten(2, (n, rows))
        values[out] = values[split_out].flatten(1, 2)
        for new in made:
            made[new].append(values[new])
    for new, pair in made.items():
        new.meta = dict(node.meta)
        traced.shadows[new.name] = tuple(pair)
    node.replace_all_uses_with(out)
    name = node.name
    graph.erase_node(node)
    removed = _erase_unused(graph, traced.shadows, ([b] if transposed else []) + chain)
    return AttentionRewrite(name, grouped=n, copies_removed=removed, matmul=True)


def _batch_first_4d(traced: _Values, node: fx.Node) -> bool:
    """A 4-d tensor whose dims after the first are the same at both traced batch sizes."""
    pair = traced.shadows.get(node.name)
    if pair is None or not all(isinstance(v, torch.Tensor) and v.dim() == 4 for v in pair):
        return False
    return pair[0].shape[1:] == pair[1].shape[1:]


def _transposes_last_two(node: fx.Node) -> bool:
    if node.op != "call_method" or node.target != "transpose" or len(node.args) != 3 or node.kwargs:
        return False
    return {d % 4 if isinstance(d, int) else d for d in node.args[1:]} == {2, 3}


def _repeat_of(traced: _Values, node: fx.Node, query_heads: int) -> tuple | None:
    """(source, n, the chain's nodes) where ``node`` is ``source`` with each head repeated ``n``
    times in place (dim 1), made by data movement alone; else None."""
    chain, source = [], node
    while len(chain) < _MAX_CHAIN and _moves_data(source):
        chain.append(source)
        source = source.args[0]
        if not isinstance(source, fx.Node):
            return None
        value = traced.shadows.get(source.name, (None,))[0]
        if isinstance(value, torch.Tensor) and value.dim() == 4 and query_heads % value.shape[1] == 0:
            n = query_heads // value.shape[1]
            if n > 1 and all(_replays_as_repeat(traced, chain, source, n, at) for at in (0, 1)):
                return source, n, chain
    return None


def _moves_data(node) -> bool:
    if not isinstance(node, fx.Node) or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    if node.op == "call_method":
        return node.target in _MOVES
    return node.op == "call_function" and node.target in _MOVE_FUNCTIONS


def _replays_as_repeat(traced: _Values, chain: list[fx.Node], source: fx.Node, n: int, at: int) -> bool:
    """Does the chain, run on a tensor of distinct values shaped as ``source`` at traced batch
    size ``at`` (0 or 1), give that tensor's heads each repeated ``n`` times in place?"""
    shape = traced.shadows[source.name][at].shape
    probe = torch.arange(shape.numel()).reshape(shape)
    values = {source: probe}

    def value_of(a):
        return values[a] if a in values else traced.shadows[a.name][at] if isinstance(a, fx.Node) else a

    try:
        for node in reversed(chain):
            args = fx.node.map_aggregate(node.args, value_of)
            kwargs = fx.node.map_aggregate(node.kwargs, value_of)
            values[node] = getattr(args[0], node.target)(*args[1:], **kwargs) if node.op == "call_method" else node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 — a chain that does not replay is no repeat
        return False
    out = values[chain[0]]
    return isinstance(out, torch.Tensor) and torch.equal(out, probe.repeat_interleave(n, dim=1))


def _erase_unused(graph: fx.Graph, shadows: dict, chain: list[fx.Node]) -> int:
    """Erase the chain's nodes nothing reads any more (the outermost first); returns the eager
    launches they cost (those that made a new tensor, not a view of their input)."""
    launches = 0
    for node in chain:
        if not node.users:
            made, read = shadows[node.name][0], shadows[node.args[0].name][0]
            launches += made.untyped_storage().data_ptr() != read.untyped_storage().data_ptr()
            graph.erase_node(node)
    return launches
