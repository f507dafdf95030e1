"""idioms: in-place spellings of a value, rewritten in the traced graph as one functional op.

A value built by writing into a fresh buffer is a mutation to the graph, and mutations are
never fused across. Where the buffer is fresh, written once, and read only afterwards, the
write computes an ordinary value; the trace names it by one call, which runs the same PyTorch
ops when it stays eager (the same launches, the same result) and which a pattern can match.

* ``inv = torch.empty_like(perm); inv[perm] = torch.arange(perm.size(0))`` (transformers'
  grouped_mm experts put their rows back in token order with it) is
  :func:`inverse_permutation`.
* ``key = kv.new_empty(..., a + b); key[..., :a].copy_(k_nope); key[..., a:].copy_(k_rot)``
  (DeepSeek-V3's MLA key) is ``torch.cat([k_nope, k_rot], -1)``.
* ``out.add_(bias)`` on a tensor the step made and nothing else shares (transformers adds the
  experts' biases to each grouped GEMM's output that way) is ``out.add(bias)``: every later
  read of ``out`` reads the sum. Any pointwise in-place method of the op table qualifies where
  its out-of-place form gives the same shape and dtype, and so do ``masked_fill_`` and
  ``scatter_`` (DeepSeek-V3's group mask: ``zeros_like(scores).scatter_(1, idx, 1)``).
* ``ids = torch.zeros(n, k); ids[:, :] = table[input_ids]; w[:, :] /= w[:, :].sum(-1, True)``
  (sglang's hash router): a fresh buffer written whole (``buf[:] = v``, ``buf[...] = v``,
  ``buf[:, :] = v``, ``buf.copy_(v)``, ``v`` of the buffer's shape) is ``v`` cast to the
  buffer's dtype from that write on; reads before it read the fill.
"""

from __future__ import annotations

import operator
from typing import Any, Iterable

import torch
import torch.fx as fx

from fuser.ir import ops
from fuser.ir.canonical_op import FOLDED_LAUNCHES, writes_into
from fuser.trace.leaves import LEAF

_EMPTIES = {torch.empty_like, "new_empty", torch.empty}
#: Functions and methods that make a new buffer, filled or not.
_NEW_BUFFERS = _EMPTIES | {
    torch.zeros, torch.ones, torch.full, torch.zeros_like, torch.ones_like, torch.full_like,
    "new_zeros", "new_ones", "new_full",
}


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[perm[i]] = i``: where ``perm`` is a permutation, its inverse. Written
    as the idiom it replaces, so that it costs what it did: one arange, one index write."""
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.shape[0], device=perm.device)
    return inverse


def rewrite(graph: fx.Graph, shadows: dict[str, tuple[Any, Any]], state: Iterable[torch.Tensor] = ()) -> None:
    """Replace every idiom of this module's list in ``graph``; ``shadows`` (node name -> its
    values at the two traced sizes) gets the new nodes' values. ``state`` (the module's
    parameters and buffers) is memory an in-place write must keep writing, even through a value
    a leaf returned (a cache's tensors)."""
    kept = {_storage(t) for t in state}
    superseded: set[fx.Node] = set()  # values an in-place write replaced by a new node
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is operator.setitem:
            _inverse_permutation(graph, node, shadows)
        elif node.op == "call_method" and _out_of_place_name(node.target):
            _out_of_place(graph, node, shadows, superseded, kept)
        elif _fresh(node):
            _concatenation(graph, node, shadows)
    for node in list(graph.nodes):
        if node.op in ("call_function", "call_method") and node.target in _NEW_BUFFERS:
            _in_place_on_whole_views(graph, node, shadows)
            _whole_writes(graph, node, shadows)


def _in_place_on_whole_views(graph: fx.Graph, buffer: fx.Node, shadows) -> None:
    """``buf[:, :] /= s`` on a new buffer, traced as eager runs it (``v = buf[:, :]``,
    ``d = v.div_(s)``, ``buf[:, :] = d``): the write of ``v.div(s)``, where the out-of-place
    form keeps v's shape and dtype, so that :func:`_whole_writes` reads it as a value."""
    for view in [u for u in buffer.users if _whole_view(u, buffer)]:
        for write in list(view.users):
            name = _out_of_place_name(write.target) if write.op == "call_method" else None
            if name is None or name in _SHAPE_AND_DTYPE_KEPT or write.args[0] is not view or write.kwargs:
                continue
            (store,) = write.users if len(write.users) == 1 else (None,)
            if store is None or not _whole_write(store, buffer) or store.args[2] is not write:
                continue
            if not _keeps_shape_and_dtype(write, shadows):
                continue
            with graph.inserting_before(write):
                value = graph.call_method(name, write.args)
            value.meta = dict(write.meta)
            shadows[value.name] = tuple(v.clone() for v in shadows[write.name])  # its own memory, as out of place
            store.replace_input_with(write, value)
            graph.erase_node(write)


def _keeps_shape_and_dtype(write: fx.Node, shadows) -> bool:
    """Does the out-of-place form of in-place ``write`` give its target's shape and dtype at
    both traced sizes (no promotion, no broadcast past the target)?"""
    for which in (0, 1):
        target = shadows[write.args[0].name][which]
        operands = [shadows[a.name][which] for a in write.all_input_nodes]
        if any(not isinstance(o, torch.Tensor) or o.dtype != target.dtype for o in operands):
            return False
        if torch.broadcast_shapes(*(o.shape for o in operands)) != target.shape:
            return False
    return True


def _whole_writes(graph: fx.Graph, buffer: fx.Node, shadows) -> None:
    """A new buffer written whole, each time by a value of its shape, and otherwise only read:
    every read after a write reads that write's value (cast to the buffer's dtype), and the
    writes go. A view of the buffer (any spelling: its memory) must be used before the next
    write, as it would see that write; nothing may write through one, nor a leaf take one."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    writes = sorted((u for u in buffer.users if _whole_write(u, buffer)), key=order.get)
    if not writes or _written_later(buffer, set(writes), shadows) or any(_opaque(u) for u in buffer.users):
        return
    marks = [order[w] for w in writes]
    for view in _views(buffer, set(writes), shadows):
        used = [order[view]] + [order[u] for u in view.users]
        if any(_opaque(u) for u in view.users) or any(min(used) < m < max(used) for m in marks):
            return  # a leaf may write it, or it is read after a write it would see
    value_of = {}
    for write in writes:
        value = write.args[2] if write.target is operator.setitem else write.args[1]
        if not _replaces(value, buffer, write, shadows):
            return
        value_of[write] = value
    if any(u.op == "output" for w in writes for u in value_of[w].users) and any(u.op == "output" for u in buffer.users):
        return  # both returned: eager's are two tensors
    current = {}
    for write in writes:  # the value from each write on: cast where the buffer's dtype differs
        value = value_of[write]
        if shadows[value.name][0].dtype != shadows[buffer.name][0].dtype:
            with graph.inserting_before(write):
                cast = graph.call_method("to", (value, shadows[buffer.name][0].dtype))
            cast.meta = dict(write.meta)
            shadows[cast.name] = tuple(v.to(b.dtype) for v, b in zip(shadows[value.name], shadows[buffer.name]))
            value = cast  # eager's write: one launch, the cast's
        else:
            _fold_launch(value)  # eager's write copied it: one launch
        current[write] = value
    for write in writes:
        graph.erase_node(write)
    for user in list(buffer.users):  # each read, the buffer as the last write before it left it
        before = [w for w in writes if order[w] < order[user]]
        if not before:
            continue  # the fill
        if _whole_view(user, buffer):
            user.replace_all_uses_with(current[before[-1]])
            graph.erase_node(user)
        else:
            user.replace_input_with(buffer, current[before[-1]])
    if not buffer.users:
        if buffer.target not in _EMPTIES:
            _fold_launch(current[writes[0]])  # eager's fill
        graph.erase_node(buffer)


def _views(buffer: fx.Node, writes: set, shadows) -> set[fx.Node]:
    """The nodes whose value is ``buffer``'s memory (views of it, views of those), but ``writes``."""
    storage = _storage(shadows[buffer.name][0])
    found, pending = set(), [buffer]
    while pending:
        for user in pending.pop().users:
            value = shadows.get(user.name, (None,))[0]
            if user not in writes and user not in found and isinstance(value, torch.Tensor) and _storage(value) == storage:
                found.add(user)
                pending.append(user)
    return found


def _fold_launch(node: fx.Node) -> None:
    node.meta[FOLDED_LAUNCHES] = node.meta.get(FOLDED_LAUNCHES, 0) + 1


def _whole_index(index) -> bool:
    """``[:]``, ``[...]``, ``[:, :]``: every element."""
    parts = index if isinstance(index, tuple) else (index,)
    return all(p is Ellipsis or (isinstance(p, slice) and p == slice(None)) for p in parts)


def _whole_write(node: fx.Node, buffer: fx.Node) -> bool:
    if node.op == "call_function" and node.target is operator.setitem:
        return node.args[0] is buffer and _whole_index(node.args[1]) and isinstance(node.args[2], fx.Node)
    return (
        node.op == "call_method" and node.target == "copy_" and len(node.args) == 2 and not node.kwargs
        and node.args[0] is buffer and isinstance(node.args[1], fx.Node) and not node.users
    )  # fmt: skip


def _whole_view(node: fx.Node, buffer: fx.Node) -> bool:
    return (
        node.op == "call_function" and node.target is operator.getitem and len(node.args) == 2
        and node.args[0] is buffer and _whole_index(node.args[1])
    )  # fmt: skip


def _replaces(value: fx.Node, buffer: fx.Node, write: fx.Node, shadows) -> bool:
    """Can reads of ``buffer`` after ``write`` read ``value`` instead: of its shape at both
    traced sizes, a tensor of its own memory (not a graph input's, the state's or another
    value's) and never written afterwards?"""
    if value.op not in ("call_function", "call_method") or _opaque(value):
        return False  # an input, the state or a leaf's result (a cache's memory): the buffer would alias it
    for which in (0, 1):
        v, b = shadows[value.name][which], shadows[buffer.name][which]
        if not isinstance(v, torch.Tensor) or not isinstance(b, torch.Tensor) or v.shape != b.shape:
            return False
        if v.device != b.device or v.is_complex() != b.is_complex():
            return False
    storage = _storage(shadows[value.name][0])
    for node in _nodes_before(value):
        other = shadows.get(node.name, (None,))[0]
        if isinstance(other, torch.Tensor) and other.numel() and _storage(other) == storage:
            return False  # a view of another value
    return not _written_later(value, {write}, shadows)


def _opaque(node: fx.Node) -> bool:
    """A module call or a call the trace kept opaque: code the graph does not see into."""
    return node.op == "call_module" or bool(node.meta.get(LEAF))


def _nodes_before(node: fx.Node):
    current = node.prev
    while current.op != "root":
        yield current
        current = current.prev


def _concatenation(graph: fx.Graph, buffer: fx.Node, shadows) -> None:
    """A fresh buffer's last axis filled slice by slice with ``copy_`` of tensors of the
    slices' shapes and the buffer's dtype, and only read afterwards: their concatenation."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    users = list(buffer.users)
    writes = []  # (start, stop, slice view, its copy_, the part copied)
    for user in users:
        columns = _columns(user, shadows)
        copy = next(iter(user.users)) if len(user.users) == 1 else None
        if columns is None or copy is None or copy.op != "call_method" or copy.target != "copy_" or copy.kwargs:
            break
        if len(copy.args) != 2 or copy.args[0] is not user or not isinstance(copy.args[1], fx.Node) or copy.users:
            break
        writes.append((*columns, user, copy, copy.args[1]))
    readers = users[len(writes):]
    if not writes:
        return
    last = max(order[c] for _, _, _, c, _ in writes)
    if any(order[r] < last for r in readers) or _written_later(buffer, {c for _, _, _, c, _ in writes}, shadows):
        return
    writes.sort(key=lambda w: w[0])
    width = shadows[buffer.name][0].shape[-1]
    ends = [0] + [stop for _, stop, *_ in writes]
    if [start for start, *_ in writes] != ends[:-1] or ends[-1] != width:
        return  # the slices do not tile the last axis
    for _, _, view, _, part in writes:
        for which in (0, 1):
            a, b = shadows[view.name][which], shadows[part.name][which]
            if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
                return  # copy_ would broadcast or cast
    with graph.inserting_before(max((c for _, _, _, c, _ in writes), key=order.get)):
        cat = graph.call_function(torch.cat, ([part for *_, part in writes],), {"dim": -1})
    shadows[cat.name] = shadows[buffer.name]  # the buffer's values after the writes
    for reader in readers:
        reader.replace_input_with(buffer, cat)
    for _, _, view, copy, _ in writes:
        graph.erase_node(copy)
        graph.erase_node(view)
    graph.erase_node(buffer)


def _columns(view: fx.Node, shadows) -> tuple[int, int] | None:
    """(start, stop) when ``view`` is ``buffer[..., start:stop]`` (step 1, literal bounds)."""
    if view.op != "call_function" or view.target is not operator.getitem or len(view.args) != 2:
        return None
    index = view.args[1]
    if not (isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis and isinstance(index[1], slice)):
        return None
    width = shadows[view.args[0].name][0].shape[-1]
    start, stop, step = index[1].indices(width) if _literal(index[1]) else (None, None, None)
    return (start, stop) if step == 1 and start < stop else None


def _literal(part: slice) -> bool:
    return all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in (part.start, part.stop, part.step))


#: In-place methods whose out-of-place form has the input's shape and dtype whatever it reads.
_SHAPE_AND_DTYPE_KEPT = {"masked_fill", "scatter"}


def _out_of_place_name(method: str) -> str | None:
    """``add`` for ``add_``: the out-of-place form of a pointwise in-place method (or of
    ``masked_fill_``, ``scatter_``), or None."""
    name = method[:-1] if method.endswith("_") and not method.startswith("_") else None
    if name is None or not hasattr(torch.Tensor, name):
        return None
    return name if ops.kind(ops.SPELLINGS.get(name, name)) == ops.POINTWISE or name in _SHAPE_AND_DTYPE_KEPT else None


def _out_of_place(graph: fx.Graph, write: fx.Node, shadows, superseded: set, kept: set) -> None:
    target = write.args[0] if write.args else None
    if not isinstance(target, fx.Node) or target.op not in ("call_function", "call_method", "call_module"):
        return  # an input, a parameter or a buffer: the write is seen outside the step
    before, after = shadows[target.name], shadows[write.name]
    if not all(isinstance(v, torch.Tensor) for v in (*before, *after)) or before[0].shape == before[1].shape:
        return  # not a tensor that follows the tokens (a value computed once may be precomputed)
    if _out_of_place_name(write.target) not in _SHAPE_AND_DTYPE_KEPT and not _keeps_shape_and_dtype(write, shadows):
        return  # the out-of-place form would promote or broadcast
    order = {n: i for i, n in enumerate(graph.nodes)}
    for which in (0, 1):
        value = before[which]
        storage = _storage(value)
        if storage in kept:
            return  # the module's own state: the write must stay
        for node in graph.nodes:  # anything else holding this memory would see the write
            if node in (target, write) or node in superseded or order[node] > order[write]:
                continue
            other = shadows.get(node.name, (None, None))[which]
            if isinstance(other, torch.Tensor) and other.numel() and _storage(other) == storage:
                return
    with graph.inserting_before(write):
        result = graph.call_method(_out_of_place_name(write.target), write.args, write.kwargs)
    result.meta = dict(write.meta)
    shadows[result.name] = after
    later = [u for u in target.users if u is not result and order[u] > order[write]]
    for user in later:
        user.replace_input_with(target, result)
    write.replace_all_uses_with(result)
    graph.erase_node(write)
    superseded.add(target)


def _inverse_permutation(graph: fx.Graph, write: fx.Node, shadows) -> None:
    buffer, index, positions = write.args[:3]
    if not (isinstance(buffer, fx.Node) and isinstance(index, fx.Node) and isinstance(positions, fx.Node)):
        return
    if not _fresh(buffer) or next(iter(buffer.users)) is not write or list(positions.users) != [write]:
        return  # read or written before this write, or the positions are read elsewhere too
    if _written_later(buffer, {write}, shadows):
        return
    if positions.target is not torch.arange:
        return
    for which in (0, 1):
        buf, idx, pos = (shadows[n.name][which] for n in (buffer, index, positions))
        if not all(isinstance(v, torch.Tensor) for v in (buf, idx, pos)):
            return
        one_dim = idx.dim() == 1 and buf.shape == idx.shape and pos.shape == idx.shape
        if not one_dim or idx.dtype != torch.int64 or buf.dtype != torch.int64 or pos.dtype != torch.int64:
            return
        if not torch.equal(pos, torch.arange(idx.shape[0], device=pos.device)):
            return
    with graph.inserting_before(write):
        inverse = graph.call_function(inverse_permutation, (index,))
    inverse.meta = dict(write.meta)
    shadows[inverse.name] = shadows[buffer.name]  # the buffer's values after the write
    buffer.replace_all_uses_with(inverse, delete_user_cb=lambda user: user is not write)
    graph.erase_node(write)
    graph.erase_node(positions)
    graph.erase_node(buffer)


def _fresh(node: fx.Node) -> bool:
    """A new, uninitialised buffer: ``torch.empty_like(x)``, ``x.new_empty(...)``, ``torch.empty(...)``."""
    return node.op in ("call_function", "call_method") and node.target in _EMPTIES


def _written_later(buffer: fx.Node, writes: set, shadows) -> bool:
    """Is ``buffer``, or a view of it, written by anything but ``writes``?"""
    holders = {buffer} | _views(buffer, writes, shadows)
    return any(writes_into(user, node) for node in holders for user in node.users if user not in writes)


def _storage(value: torch.Tensor) -> int:
    return value.untyped_storage().data_ptr()
