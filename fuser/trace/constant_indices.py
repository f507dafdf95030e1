"""constant_indices: an index by a constant list that picks a range, held in the graph as the
slice it is.

``x[..., [-2], :]`` (Falcon's multi-query key) is advanced indexing: ``aten.index``, a copy, and
on a GPU a host-to-device copy of the list first (which a CUDA graph cannot capture). Where
the list is an ascending run with a constant step along a dim of a fixed size, it picks what a
slice picks: ``x[..., [-2], :]`` is ``x[..., 2:3, :]`` for a dim of 4, ``x[:, [0, 2, 4]]`` is
``x[:, 0:5:2]``. The slice is a view: no kernel, no copy.

A view shares its source's memory where the index made a copy, so the graph keeps the index
where that could show: where a write the graph makes (an index write, an in-place method, an
``out=``) lands in either's memory, where a leaf changed one of them (the copy no longer equals
its source's slice at the end of the trace), where a custom op that writes its arguments is
given either, or where the value (or a view of it) is an output of the graph. What stays an
index is counted by the report as an op of its own (:func:`fuser.canon.views.view`).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from fuser.ir.canonical_op import writes_into


def as_slice(index: Any, shape: tuple[int, ...]) -> Any:
    """``index`` with its one constant list of ints replaced by the slice that picks the same
    elements of a tensor of ``shape``; None when it holds no such list or the list is no
    ascending run with a constant step (or another entry is itself an advanced index)."""
    entries = index if isinstance(index, tuple) else (index,)
    lists = [i for i, e in enumerate(entries) if isinstance(e, list)]
    if len(lists) != 1 or not all(_basic(e) for i, e in enumerate(entries) if i != lists[0]):
        return None
    p = lists[0]
    values = entries[p]
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return None
    dim = _dim_of(entries, p, len(shape))
    if dim is None or not 0 <= dim < len(shape):
        return None
    size = shape[dim]
    if not all(-size <= v < size for v in values):
        return None
    values = [v % size for v in values]
    step = values[1] - values[0] if len(values) > 1 else 1
    if step < 1 or values != list(range(values[0], values[0] + step * len(values), step)):
        return None
    picked = slice(values[0], values[-1] + 1, step if step != 1 else None)
    return (*entries[:p], picked, *entries[p + 1 :])


def _basic(entry) -> bool:
    """An entry of an index that is no advanced index (what torch applies as a view)."""
    if isinstance(entry, bool):
        return False
    return entry is None or entry is Ellipsis or isinstance(entry, (int, slice))


def _dim_of(entries: tuple, p: int, rank: int) -> int | None:
    """The dim of the source that entry ``p`` indexes."""
    def consumed(es):
        return sum(1 for e in es if e is not None and e is not Ellipsis)

    ellipses = [i for i, e in enumerate(entries) if e is Ellipsis]
    if len(ellipses) > 1:
        return None
    if ellipses and ellipses[0] < p:
        return rank - consumed(entries[p:])
    return consumed(entries[:p])


def slice_constant_list_indices(graph: fx.Graph, shadows: dict[str, tuple[Any, Any]]) -> list[fx.Node]:
    """Rewrite each ``getitem`` by a constant list that :func:`as_slice` reads as a slice, where
    the view cannot show (see the module's docstring); its shadows become the views. The nodes
    rewritten, in graph order."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    rewritten = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not operator.getitem or len(node.args) != 2:
            continue
        source, index = node.args
        if not isinstance(source, fx.Node) or source.name not in shadows or node.name not in shadows:
            continue
        copies, sources = shadows[node.name], shadows[source.name]
        if not all(isinstance(t, torch.Tensor) for t in (*copies, *sources)):
            continue
        picked = as_slice(index, tuple(sources[0].shape))
        if picked is None or as_slice(index, tuple(sources[1].shape)) != picked:
            continue  # (or the list picks other places at the other size: a dim that follows the tokens)
        views = tuple(s[picked] for s in sources)
        if not all(v.shape == c.shape and torch.equal(v, c) for v, c in zip(views, copies)):
            continue  # (a leaf changed one of them: the copy no longer equals the slice)
        if _may_show(graph, node, source, shadows, order):
            continue
        node.args = (source, picked)
        shadows[node.name] = views
        rewritten.append(node)
    return rewritten


def _may_show(graph: fx.Graph, node: fx.Node, source: fx.Node, shadows, order) -> bool:
    """Could a view in place of the copy ``node`` change what the graph computes or returns?"""
    memory = {_storage(shadows[source.name][0]), _storage(shadows[node.name][0])}

    def shares(n) -> bool:
        value = shadows.get(n.name, (None,))[0] if isinstance(n, fx.Node) else None
        return isinstance(value, torch.Tensor) and _storage(value) in memory

    copy = _storage(shadows[node.name][0])
    for other in graph.nodes:
        if other.op == "output":
            outputs: list[fx.Node] = []
            fx.node.map_arg(other.args, outputs.append)
            returned = [shadows[o.name][0] for o in outputs if o.name in shadows]
            if any(isinstance(v, torch.Tensor) and _storage(v) == copy for v in returned):
                return True  # (the caller would be given a view of the source)
            continue
        if order[other] <= order[node]:
            continue
        written = [a for a in other.all_input_nodes if writes_into(other, a)]
        if any(shares(a) for a in written):
            return True
        if _custom_op_writing(other) and any(shares(a) for a in other.all_input_nodes):
            return True
    return False


def _custom_op_writing(node: fx.Node) -> bool:
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket):
        overloads = [getattr(target, o) for o in target.overloads()]
    elif isinstance(target, torch._ops.OpOverload):
        overloads = [target]
    else:
        return False
    return any(a.alias_info is not None and a.alias_info.is_write for o in overloads for a in o._schema.arguments)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()
