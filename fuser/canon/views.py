"""views: the canonical form of views, slices, index arithmetic, row gathers, scatters and
concatenations: which are free, which a kernel does in registers, and which copy. Each function
takes the canonicaliser (:class:`fuser.canon.canonicalize.Canonicalizer`) explicitly; those of
one op name are registered under it (:mod:`fuser.canon.registry`)."""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from fuser.ir import ops
from fuser.canon.registry import canonical
from fuser.canon.joins import cat_of_units
from fuser.canon.table_reads import gather_of_spread_table
from fuser.ir.canonical_op import COMPUTE, KERNEL_DTYPES, META, UNIT_VIEW, UNSUPPORTED, VIEW, bound_args, op_name, tensor_args

_MAY_COPY = {"reshape", "flatten", "reshape_as"}  # views when the layout allows, else copies
# Views that keep the elements in their row-major order (a transpose or permute does not).
_REORDER_FREE = {"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as"}


def aliases(cz, node) -> bool:
    """Does the node's value share storage with its first argument's?"""
    src = node.args[0] if node.args else None
    if not isinstance(src, fx.Node) or not isinstance(cz.value(src), torch.Tensor):
        return False
    return cz.value(node).untyped_storage().data_ptr() == cz.value(src).untyped_storage().data_ptr()


def cast_or_copy(cz, node):
    src = node.args[0]
    out, inp = cz.value(node), cz.value(src)
    if isinstance(inp, torch.Tensor) and out.dtype == inp.dtype and out.device == inp.device:
        if out.data_ptr() == inp.data_ptr() and out.shape == inp.shape:
            return cz.make(node, "identity", COMPUTE, (src,))
        return cz.make(node, "copy", COMPUTE, (src,))
    if isinstance(inp, torch.Tensor) and out.device != inp.device:
        return cz.make(node, "to_device", UNSUPPORTED, (src,))
    return cz.make(node, "cast", COMPUTE, (src,), {"dtype": out.dtype})


def view(cz, node):
    src = node.args[0]
    if (
        node.target is operator.getitem
        and isinstance(src, fx.Node)
        and op_name(src) in ("chunk", "split", "unbind")
        and isinstance(cz.value(src.args[0]), torch.Tensor)
    ):
        return _view_of(cz, node, src.args[0], covers=(src,))  # x.chunk(2)[i] is a slice of x
    if not isinstance(src, fx.Node) or not isinstance(cz.value(src), torch.Tensor):
        return cz.make(node, op_name(node), META)
    if node.target is operator.getitem and isinstance(cz.value(src), torch.Tensor):
        index = node.args[1]
        index = index if isinstance(index, tuple) else (index,)
        if len(index) == 1 and _row_gather(cz, src, index[0]):
            return cz.make(node, "gather_rows", COMPUTE, (src, index[0]))
        if any(isinstance(i, (fx.Node, torch.Tensor)) or _constant_list(i) for i in index):
            # (a constant list too: aten.index, a copy, its list copied to the device first; one
            # that picks a range is a slice already, fuser.trace.constant_indices)
            return cz.make(node, "index", UNSUPPORTED, (src,) + tuple(i for i in index if isinstance(i, fx.Node)))
    return _view_of(cz, node, src)


def _constant_list(entry) -> bool:
    """Is ``entry`` of an index a list or tuple of numbers or flags (an advanced index)?"""
    return isinstance(entry, (list, tuple)) and all(isinstance(v, (int, bool, list, tuple)) for v in entry)


def index_arithmetic(cz, node, name: str, value) -> bool:
    """Integer pointwise math a kernel computes exactly (``perm // top_k``): an op with an
    integer expression, on tensors of the result's integer dtype and integer literals (or sizes
    no call can change: :func:`fixed_size`)."""
    if value.dtype not in (torch.int64, torch.int32) or not ops.integer_expression(name) or node.kwargs:
        return False
    args = [literal_size(cz, a) for a in node.args]
    for arg in args:
        if isinstance(arg, fx.Node):
            operand = cz.value(arg)
            if not (isinstance(operand, torch.Tensor) and operand.dtype == value.dtype):
                return False
        elif not isinstance(arg, int) or isinstance(arg, bool):
            return False
    return name != "floordiv" or (len(args) == 2 and ops.integer_divisor(args[1]))


def literal_size(cz, arg):
    """``arg``, or the int it always is where it is a size no call can change."""
    size = fixed_size(cz, arg) if isinstance(arg, fx.Node) else None
    return arg if size is None else size


def fixed_size(cz, node: fx.Node) -> int | None:
    """The value of ``node`` where it is ``t.size(d)`` of a size no call can change: d the
    selected axis of a ``topk`` result (its k, a literal of the graph: transformers' MoE
    experts read their top-k as ``top_k_index.size(-1)``). None otherwise."""
    if node.op != "call_method" or node.target != "size" or len(node.args) != 2 or node.kwargs:
        return None
    t, d = node.args
    pick = cz.cops.get(t) if isinstance(t, fx.Node) else None
    if pick is None or pick.op not in ("topk_indices", "topk_values") or not isinstance(d, int):
        return None
    producer, value = cz.cops.get(pick.args[0]), cz.value(t)
    if producer is None or producer.op != "topk" or d % value.dim() != value.dim() - 1:
        return None
    return producer.attr("k")


#: Tables a row gather reads: the kernels' dtypes and integer ones (sglang's hash router's
#: token-to-expert table), whose rows are copied, never computed on.
_GATHERED_DTYPES = (*KERNEL_DTYPES, torch.int32, torch.int64)


def _row_gather(cz, table, index) -> bool:
    """``table[index]``: one row of a table per index, the table token-independent (an
    embedding lookup) or not (MoE's ``hidden[perm // top_k]``, rows of another count)."""
    dtype = cz.value(table).dtype
    if not isinstance(index, fx.Node) or cz.batch_dims(table) not in ((), (0,)) or dtype not in _GATHERED_DTYPES:
        return False
    idx = cz.value(index)
    return (
        isinstance(idx, torch.Tensor)
        and idx.dim() == 1
        and not idx.is_floating_point()
        and cz.batch_dims(index) == (0,)
    )


def _view_of(cz, node, src, covers=()):
    if op_name(node) in _MAY_COPY and _copies(cz, node, src) and not _reshaped_in_registers(cz, node, src):
        return cz.make(node, "reshape_copy", UNSUPPORTED, (src,))
    out, inp = cz.value(node), cz.value(src)
    if out.data_ptr() == inp.data_ptr() and out.shape == inp.shape and out.stride() == inp.stride():
        return cz.make(node, "identity", COMPUTE, (src,))
    shape = cz.static_shape(node)
    same_dims = [s for s in shape if s != 1] == [s for s in cz.static_shape(src) if s != 1]
    if same_dims and out.numel() == inp.numel() and _same_order(out, inp):
        return cz.make(node, "reshape", UNIT_VIEW, (src,), {"shape": shape})
    if op_name(node) in ("expand", "expand_as"):
        return cz.make(node, "expand", UNIT_VIEW, (src,), {"shape": shape})
    if _moves_only_the_tokens(cz, node, src):
        return cz.make(node, "reshape", UNIT_VIEW, (src,), {"shape": shape})
    reshapes = op_name(node) in _REORDER_FREE  # a transpose of the same sizes is no reshape
    if reshapes and out.numel() == inp.numel() and _register_reshape(cz.static_shape(src), shape):
        return cz.make(node, "reshape", UNIT_VIEW, (src,), {"shape": shape})
    group = _row_group(cz, src, node)
    if group:  # gathered rows regrouped per token: out[t, j] = src[t * group + j]
        return cz.make(node, "group_rows", UNIT_VIEW, (src,), {"group": group})
    columns = _last_axis_slice(cz, src, out, inp)
    if columns is not None and _computed(cz, src):
        # A slice of a value a kernel computes: taken in registers when both share a kernel.
        start, stop, step = columns
        attrs = {"start": start, "stop": stop, **({"step": step} if step != 1 else {})}
        return cz.make(node, "slice", UNIT_VIEW, (src,), attrs)
    return cz.make(
        node, "view", VIEW, (src,),
        {"shape": shape, "stride": tuple(out.stride()), "offset": out.storage_offset() - inp.storage_offset()},
        covers,
    )  # fmt: skip


def _reshaped_in_registers(cz, node, src) -> bool:
    """A reshape that copies in eager (of an expanded or permuted view) but that a kernel
    computing its source does in registers (DeepSeek-V3's group mask spread over experts)."""
    if not _computed(cz, src) or cz.batch_dims(src) != (0,) or cz.batch_dims(node) != (0,):
        return False
    return _register_reshape(cz.static_shape(src)[1:], cz.static_shape(node)[1:])


def _row_group(cz, src, node) -> int | None:
    """``k`` when ``node`` views the rows of a row gather ``src`` as [tokens, k, ...] (MoE's
    ``out[inv_perm].view(T, k, H)``): a kernel over the tokens gathers k rows each."""
    if cz.cops.get(src) is None or cz.cops[src].op != "gather_rows":
        return None
    if cz.batch_dims(src) != (0,) or cz.batch_dims(node) != (0,):
        return None
    shapes = [(o.shape, i.shape) for o, i in zip(cz.traced.shadows[node.name], cz.traced.shadows[src.name])]
    group = shapes[0][0][1] if len(shapes[0][0]) > 1 else None
    for out, inp in shapes:
        if len(out) < 2 or out[1] != group or out[0] * group != inp[0] or tuple(out[2:]) != tuple(inp[1:]):
            return None
    return group


def _copies(cz, node, src) -> bool:
    """Did the reshape copy at either traced size (no view fits its input's layout, as after
    a permute)? Then it is a kernel of its own, not a free view."""
    return any(
        out.numel() and out.untyped_storage().data_ptr() != inp.untyped_storage().data_ptr()
        for out, inp in zip(cz.traced.shadows[node.name], cz.traced.shadows[src.name])
        if isinstance(out, torch.Tensor) and isinstance(inp, torch.Tensor)
    )


def _last_axis_slice(cz, src, out, inp) -> tuple[int, int, int] | None:
    """(start, stop, step) when ``out`` is ``inp[..., start:stop:step]`` along a non-token
    last axis: a range of columns (step 1), or every other column (``x[..., ::2]``,
    ``x[..., 1::2]``: GPT-OSS's interleaved gate and up)."""
    rank = inp.dim()
    if not rank or out.dim() != rank or out.shape[:-1] != inp.shape[:-1] or out.stride()[:-1] != inp.stride()[:-1]:
        return None
    if (rank - 1) in cz.batch_dims(src) or inp.shape[-1] <= 1:
        return None
    column = inp.stride(-1)
    offset = out.storage_offset() - inp.storage_offset()
    if column <= 0 or offset < 0 or offset % column:
        return None
    start = offset // column
    if out.stride(-1) == 2 * column:  # every other column, to the end
        every_other = start in (0, 1) and inp.shape[-1] % 2 == 0 and out.shape[-1] == inp.shape[-1] // 2
        return (start, inp.shape[-1], 2) if every_other else None
    stop = start + out.shape[-1]
    whole = (start, stop) == (0, inp.shape[-1])
    return (start, stop, 1) if out.stride(-1) == column and stop <= inp.shape[-1] and not whole else None


def _computed(cz, node) -> bool:
    """Is ``node`` a value glue computes (not an input or a heavy op's result, or a view of one)?"""
    cop = cz.cops.get(node)
    if cop is None or cop.kind not in (COMPUTE, UNIT_VIEW):
        return False
    if cop.op == "identity" or cop.kind == UNIT_VIEW:
        return isinstance(cop.args[0], fx.Node) and _computed(cz, cop.args[0])
    return True


@canonical("gather")
def gather(cz, node):
    """``x.gather(-1, index)`` with index shaped like x but for the last axis."""
    params = bound_args(node, ("input", "dim", "index"))
    x, dim, index = params.get("input"), params.get("dim"), params.get("index")
    if isinstance(x, fx.Node) and isinstance(index, fx.Node) and isinstance(dim, int) and not params.get("sparse_grad"):
        src, idx = cz.value(x), cz.value(index)
        rank = src.dim()
        if (
            rank and dim % rank == rank - 1 and idx.dim() == rank and src.shape[:-1] == idx.shape[:-1]
            and rank - 1 not in cz.batch_dims(x)
        ):  # fmt: skip
            return cz.make(node, "gather_last", COMPUTE, (x, index))
        spread = gather_of_spread_table(cz, node, x, dim, index)
        if spread is not None:
            return spread
        rows = _per_row_index(cz, index, src)
        if dim % max(rank, 1) == 0 and rows is not None and _row_gather(cz, x, rows):
            return cz.make(node, "gather_rows", COMPUTE, (x, rows))  # the index repeats one position per row
    return cz.make(node, "gather", UNSUPPORTED, tensor_args(node))


def _per_row_index(cz, index, table):
    """``positions`` when ``index`` is ``positions[:, None].expand(-1, *table.shape[1:])`` (or
    ``unsqueeze(-1).expand_as(...)``): ``torch.gather(table, 0, index)`` is then a row gather
    ``table[positions]``. None otherwise."""
    idx = cz.value(index)
    if not isinstance(idx, torch.Tensor) or idx.dim() != table.dim() or tuple(idx.shape[1:]) != tuple(table.shape[1:]):
        return None
    node = index
    while isinstance(node, fx.Node) and cz.cops.get(node) is not None and cz.cops[node].op in ("expand", "reshape", "identity"):
        node = cz.cops[node].args[0]
        value = cz.value(node)
        if isinstance(value, torch.Tensor) and value.dim() == 1:
            return node if value.shape[0] == idx.shape[0] else None
    return None


@canonical("index_select")
def index_select(cz, node):
    """``torch.index_select(table, 0, positions)``: a row gather ``table[positions]``."""
    params = bound_args(node, ("input", "dim", "index"))
    x, dim, index = params.get("input"), params.get("dim"), params.get("index")
    if isinstance(x, fx.Node) and isinstance(dim, int) and cz.value(x).dim() and dim % cz.value(x).dim() == 0:
        if _row_gather(cz, x, index):
            return cz.make(node, "gather_rows", COMPUTE, (x, index))
    return cz.make(node, "index_select", UNSUPPORTED, tensor_args(node))


@canonical("scatter")
def scatter(cz, node):
    """``x.scatter(-1, index, value)`` with index shaped like x but for the last axis: each
    listed column set to a scalar value (a group or expert mask), or to the source's value at
    the index's place (``full(-inf).scatter(-1, top_indices, top_values)``: the top-k scores
    kept in place, the rest -inf)."""
    params = bound_args(node, ("input", "dim", "index", "value"))
    x, dim, index = params.get("input"), params.get("dim"), params.get("index")
    value = params.get("value", params.get("src"))
    if isinstance(x, fx.Node) and isinstance(index, fx.Node) and isinstance(dim, int) and isinstance(value, (int, float)):
        src, idx = cz.value(x), cz.value(index)
        rank = src.dim()
        if (
            rank and dim % rank == rank - 1 and idx.dim() == rank and src.shape[:-1] == idx.shape[:-1]
            and rank - 1 not in cz.batch_dims(x) and src.is_floating_point() and idx.dtype == torch.int64
            and not params.get("reduce")
        ):  # fmt: skip
            return cz.make(node, "scatter_last", COMPUTE, (x, index, float(value)))
    if isinstance(x, fx.Node) and isinstance(index, fx.Node) and isinstance(dim, int) and isinstance(value, fx.Node):
        src, idx, picked = cz.value(x), cz.value(index), cz.value(value)
        rank = src.dim()
        if (
            rank and dim % rank == rank - 1 and idx.dim() == rank and src.shape[:-1] == idx.shape[:-1]
            and picked.shape == idx.shape and picked.dtype == src.dtype and rank - 1 not in cz.batch_dims(x)
            and src.dtype in KERNEL_DTYPES and idx.dtype == torch.int64 and not params.get("reduce")
        ):  # fmt: skip
            return cz.make(node, "scatter_src_last", COMPUTE, (x, index, value))
    return cz.make(node, "scatter", UNSUPPORTED, tensor_args(node))


@canonical("cat")
def cat(cz, node):
    parts = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    rank = cz.value(node).dim()
    units = cat_of_units(cz, node, parts, dim)
    if units is not None:
        return units
    if not all(isinstance(p, fx.Node) for p in parts) or dim % rank != rank - 1:
        return cz.make(node, "cat", UNSUPPORTED, tuple(p for p in parts if isinstance(p, fx.Node)))
    return cz.make(node, "cat", COMPUTE, tuple(parts), {"dim": rank - 1})


def _same_order(out: torch.Tensor, inp: torch.Tensor) -> bool:
    """Does the view keep its input's elements in order (it only inserts or drops size-1
    dims)? A transpose of a square matrix has the same sizes but not the same order."""
    return [(s, t) for s, t in zip(out.shape, out.stride()) if s != 1] == [
        (s, t) for s, t in zip(inp.shape, inp.stride()) if s != 1
    ]


def _moves_only_the_tokens(cz, node, src) -> bool:
    """Does the view move the token dim alone (``scores.transpose(0, 1)`` of ``[T, E]``)? Each
    token's elements keep their order, so a row program's block is the same before and after."""
    tokens, source_tokens = cz.batch_dims(node), cz.batch_dims(src)
    if len(tokens) != 1 or len(source_tokens) != 1:
        return False
    out, inp = cz.value(node), cz.value(src)
    if out.dim() != inp.dim() or out.data_ptr() != inp.data_ptr():
        return False

    def others(value, token):
        return [(s, t) for d, (s, t) in enumerate(zip(value.shape, value.stride())) if d != token and s != 1]

    same_rows = (out.shape[tokens[0]], out.stride(tokens[0])) == (inp.shape[source_tokens[0]], inp.stride(source_tokens[0]))
    return same_rows and others(out, tokens[0]) == others(inp, source_tokens[0])


def _register_reshape(src: tuple, dst: tuple) -> bool:
    """A reshape a kernel can do in registers: equal leading dims, then powers of two only; or
    the last axis split into (a, b) or merged back from it, b a power of two (padding a block's
    dims to powers of two then keeps every element where the reshape puts it: [448] padded to
    [512] is [7, 64] padded to [8, 64])."""
    p = 0
    while p < min(len(src), len(dst)) and src[p] == dst[p]:
        p += 1
    tail_src, tail_dst = src[p:], dst[p:]
    if not (tail_src or tail_dst) or math.prod(tail_src) != math.prod(tail_dst):
        return False
    if all(s > 0 and s & (s - 1) == 0 for s in tail_src + tail_dst):
        return True
    split, merged = sorted((tail_src, tail_dst), key=len, reverse=True)
    inner = split[-1] if len(split) == 2 else 0
    return len(split) == 2 and len(merged) == 1 and inner > 0 and inner & (inner - 1) == 0

