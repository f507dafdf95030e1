"""layout: lowerings of ops that move values in a row program's registers: casts, broadcasts
and reshapes, constants, stacks and repeats, pads, slices and concatenations, complex pairs,
gathers, scatters and index adds along the last axis. Each takes the lowerer (:class:`fuser.lower.lowerer.Lowerer`)
explicitly."""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from fuser.canon.canonicalize import COp
from fuser.lower.concat import remapped, shifted
from fuser.lower.code import INDEX_DTYPES, ONE_HOT_LIMIT, LoweringError, Segments, expanded, rounded, selected, shape_literal
from fuser.lower.registry import lowering
from fuser.lower.row_gathers import gather_rows
from fuser.lower.tiling import inserted_axes, pow2


@lowering("cast")
def cast(lw, node: fx.Node, cop: COp):
    src = cop.args[0]
    target = lw.traced.value(node).dtype
    if lw.dtypes[src] in INDEX_DTYPES and target in INDEX_DTYPES:  # int32 <-> int64: exact, wrapping as PyTorch
        return lw.emit(node, f"{lw.names[src]}.to({INDEX_DTYPES[target]})", layout_only=True)
    value = lw.f32(src)
    if target == torch.bool and lw.dtypes[src] != torch.bool:
        value = f"({value} != 0)"  # NaN included, as PyTorch
    elif lw.dtypes[src] == torch.bool and target != torch.bool:
        value = f"{value}.to(tl.float32)"
    return lw.emit(node, value)


@lowering("rdiv")
def rdiv(lw, node: fx.Node, cop: COp):
    """``c / x`` as PyTorch computes it: ``x.reciprocal() * c``, the reciprocal rounded to the
    result's dtype before the product (in bf16 the two roundings decide a later ``round``)."""
    dtype = lw.traced.value(node).dtype
    reciprocal = rounded(f"1.0 / {lw.f32(cop.args[0])}", dtype)
    if dtype != torch.float32:
        reciprocal = f"({reciprocal}).to(tl.float32)"
    return lw.emit(node, f"{reciprocal} * {lw.f32(cop.attr('numerator'))}")


@lowering("layout")
def layout(lw, node: fx.Node, cop: COp):
    return lw.emit(node, moved(lw, node, cop, lw.names[cop.args[0]]), layout_only=True)


@lowering("full")
def full(lw, node: fx.Node, cop: COp):
    """A constant: a block of one literal, only where an op reads it or it is stored."""
    shape = lw.shape_code(node, as_list=True)
    if lw.traced.value(node).dtype == torch.bool:
        return lw.emit(node, f"tl.full({shape}, {int(bool(cop.attr('value')))}, tl.int1)")
    return lw.emit(node, f"tl.full({shape}, {lw.f32(float(cop.attr('value')))}, tl.float32)")


@lowering("stack")
def stack(lw, node: fx.Node, cop: COp):
    """``torch.stack(parts, dim)``: each part put along a new axis, one select per part."""
    axis = lw.block_axis(node, cop.attr("dim"))
    rank = len(lw.padded(node))
    which = expanded(f"tl.arange(0, {pow2(len(cop.args))})", axis, rank)
    parts = [f"tl.expand_dims({lw.f32(p)}, {axis})" for p in cop.args]
    expr = parts[-1]
    for i in reversed(range(len(parts) - 1)):
        expr = f"tl.where({which} == {i}, {parts[i]}, {expr})"
    return lw.emit(node, expr)


@lowering("cat_units")
def cat_units(lw, node: fx.Node, cop: COp):
    """``torch.cat(parts, dim)`` along a middle axis, each part one wide there: element i along
    it is part i (broadcast along that axis), one select per part; where that axis is tiled
    (heads split across programs), i counts from the program's first head."""
    axis = lw.block_axis(node, cop.attr("dim"))
    which = lw.axis_index(node, axis, len(lw.padded(node)))  # the tile's own heads, where tiled
    expr = lw.f32(cop.args[-1])
    for i in reversed(range(len(cop.args) - 1)):
        expr = f"tl.where({which} == {i}, {lw.f32(cop.args[i])}, {expr})"
    return lw.emit(node, f"tl.broadcast_to({expr}, {lw.shape_code(node)})")


@lowering("repeat_interleave")
def repeat_interleave(lw, node: fx.Node, cop: COp):
    """``src.repeat_interleave(r, dim)``: element j along the axis is the source's j // r,
    picked by a one-hot sum over the source's axis (Triton cannot index a block)."""
    src = cop.args[0]
    axis, repeats = lw.block_axis(node, cop.attr("dim")), cop.attr("repeats")
    shape, out = lw.padded(src), lw.padded(node)
    if math.prod(shape) * out[axis] > ONE_HOT_LIMIT:
        raise LoweringError(f"`{node.name}`: repeating a {shape} block is too large to do in registers")
    rank = len(shape)
    source = expanded(f"tl.arange(0, {shape[axis]})", axis, rank + 1)
    wanted = expanded(f"tl.arange(0, {out[axis]})", axis + 1, rank + 1)
    spread = f"tl.expand_dims({lw.f32(src)}, {axis + 1})"
    expr = selected(f"{source} == {wanted} // {repeats}", spread, axis)
    if lw.traced.value(node).dtype == torch.bool:
        expr = f"({expr}) != 0"
    return lw.emit(node, expr)


@lowering("repeat")
def repeat(lw, node: fx.Node, cop: COp):
    """``src.repeat(r0, r1, ...)`` (not along the last axis alone: that is a concatenation):
    along each repeated axis of n, element j is the source's j % n, picked by a one-hot sum
    over the source's axis, one axis at a time, the last first (the columns, usually the
    widest, spread while the other axes are still small)."""
    src = cop.args[0]
    if cop.attr("broadcast"):
        return lw.emit(node, broadcast_block(lw, node, src), layout_only=True)
    repeats = list(cop.attr("repeats"))
    if lw.row_dim(node) is not None:
        del repeats[lw.row_dim(node)]  # the tokens' (1)
    expr, shape = lw.f32(src), list(lw.padded(src))
    sizes, out = lw.block_shape(src), lw.padded(node)
    rank = len(shape)
    for axis, times in reversed(list(enumerate(repeats))):
        if times == 1:
            continue
        if math.prod(shape) * out[axis] > ONE_HOT_LIMIT:
            raise LoweringError(f"`{node.name}`: repeating a {tuple(shape)} block is too large to do in registers")
        source = expanded(f"tl.arange(0, {shape[axis]})", axis, rank + 1)
        wanted = expanded(f"tl.arange(0, {out[axis]})", axis + 1, rank + 1)
        spread = f"tl.expand_dims({expr}, {axis + 1})"
        picked = selected(f"{source} == {wanted} % {sizes[axis]}", spread, axis)
        expr = lw.local(f"{node.name}_{axis}")
        lw.lines.append(f"{expr} = {picked}  # {node.name}: axis {axis} repeated {times} times")
        shape[axis] = out[axis]
    if lw.traced.value(node).dtype == torch.bool:
        expr = f"({expr}) != 0"
    return lw.emit(node, expr, layout_only=lw.traced.value(node).dtype == lw.dtypes[src])


def broadcast_block(lw, node: fx.Node, src: fx.Node) -> str:
    """``src`` broadcast to ``node``'s block: a repeat of unit axes (and of axes it adds in
    front), which copies no value but moves none either (exact at any dtype)."""
    expr, have, want = lw.names[src], len(lw.block_shape(src)), len(lw.block_shape(node))
    for _ in range(want - have):
        expr = f"tl.expand_dims({expr}, 0)"
    return f"tl.broadcast_to({expr}, {lw.shape_code(node) if want else '(1,)'})" if want else expr


@lowering("pad")
def pad(lw, node: fx.Node, cop: COp):
    """``F.pad(src, (left, right), value=v)``: column c is the source's c - left inside it,
    else v; the source's columns placed with a one-hot sum when that is small enough, else
    read again at the shifted columns (:func:`fuser.lower.concat.shifted`)."""
    src = cop.args[0]
    left, value = cop.attr("left"), cop.attr("value")
    shape, out = lw.padded(src), lw.padded(node)
    rank, width = len(shape), lw.block_shape(src)[-1]
    cols = expanded(f"tl.arange(0, {out[-1]})", rank - 1, rank)
    if math.prod(shape) * out[-1] <= ONE_HOT_LIMIT:
        own = expanded(f"tl.arange(0, {shape[-1]})", rank, rank + 1)
        wanted = expanded(f"tl.arange(0, {out[-1]})", rank - 1, rank + 1)
        spread = f"tl.expand_dims({lw.f32(src)}, {rank - 1})"
        placed = selected(f"{own} == {wanted} - {left}", spread, rank)
    else:
        placed = shifted(lw, src, -left, out[-1])
        if placed is None:
            raise LoweringError(
                f"`{node.name}`: padding a {tuple(shape)} block is too large for registers, and its source cannot be "
                "read again at shifted columns"
            )
    inside = f"({cols} >= {left}) & ({cols} < {left + width})" if left else f"({cols} < {width})"
    return lw.emit(node, f"tl.where({inside}, {placed}, {lw.f32(value)})")


def moved(lw, node: fx.Node, cop: COp, src: str) -> str:
    """``src`` moved into ``node``'s block shape (broadcast, unsqueeze or register reshape)."""
    if cop.op == "expand":  # the dims it adds come first; the token dim is in no block
        for _ in range(len(lw.block_shape(node)) - len(lw.block_shape(cop.args[0]))):
            src = f"tl.expand_dims({src}, 0)"
        return f"tl.broadcast_to({src}, {lw.shape_code(node)})"
    if lw.padded(node) == lw.padded(cop.args[0]):
        return src
    inserted = inserted_axes(lw.block_shape(cop.args[0]), lw.block_shape(node))
    if inserted is not None:  # unsqueeze: a broadcast, no data movement (tl.reshape may shuffle)
        for axis in inserted:
            src = f"tl.expand_dims({src}, {axis})"
        return src
    return f"tl.reshape({src}, {lw.shape_code(node) if lw.padded(node) else (1,)})"


@lowering("pairs_and_parts")
def pairs_and_parts(lw, node: fx.Node, cop: COp):
    """Complex values as (re, im) float pairs; concatenations as column segments; row gathers."""
    op, args = cop.op, cop.args
    name = lw.fresh(node)
    value = lw.traced.value(node)
    lw.dtypes[node] = value.dtype
    src = lw.names.get(args[0]) if args and isinstance(args[0], fx.Node) else None

    def pair(re: str, im: str):
        lw.lines.append(f"{name}_re, {name}_im = {re}, {im}  # {node.name}")
        lw.names[node] = (f"{name}_re", f"{name}_im")

    if op == "gather_rows":
        return gather_rows(lw, node, name, args[0], args[1])
    if op == "slice":
        return slice_columns(lw, node, name, cop)
    if op in ("topk_values", "topk_indices"):
        values, indices = lw.names[args[0]]
        lw.names[node] = values if op == "topk_values" else indices  # the top-k's own local
        return
    if op == "gather_last":
        return gather_last(lw, node, name, cop)
    if op == "view_as_complex":
        lw.lines.append(f"{name}_re, {name}_im = tl.split({src})  # {node.name}")
        lw.names[node] = (f"{name}_re", f"{name}_im")
        return
    if op == "view_as_real":
        lw.lines.append(f"{name} = tl.join({src[0]}, {src[1]})  # {node.name}")
        lw.names[node] = name
        return
    if op == "conj":
        return pair(src[0], f"-{src[1]}")
    if op in ("reshape", "expand") and isinstance(src, tuple):
        return pair(moved(lw, node, cop, src[0]), moved(lw, node, cop, src[1]))
    if op == "cat":
        parts, offset = [], 0
        for part in args:
            expr = lw.names[part]
            if not isinstance(expr, str):
                raise LoweringError(f"`{node.name}`: cannot concatenate {type(expr).__name__} values")
            width = lw.block_shape(part)[-1]
            parts.append((offset, expr, width, lw.dtypes[part]))
            offset += width
        lw.names[node] = Segments(parts)
        return
    if op == "reshape" and isinstance(src, Segments) and (axis := moved_concatenation_axis(lw, args[0], node)) is not None:
        # (``cat([nope, rope], -1).transpose(1, 2)`` with one token per head row): each part
        # moves the same way, so the concatenation is still stored part by part.
        dims = lw.dim_codes(node)  # a tiled axis as its tile's width, whichever the launch picks

        def part_shape(width: int) -> str:
            return shape_literal([str(pow2(width)) if i == len(dims) + axis else d for i, d in enumerate(dims)])

        lw.names[node] = Segments([(o, f"tl.reshape({e}, {part_shape(w)})", w, d) for o, e, w, d in src.parts], axis)
        return
    if op == "cast" and isinstance(src, Segments):
        lw.names[node] = Segments(
            [(o, rounded(rounded(e, torch.float32, d), value.dtype), w, value.dtype) for o, e, w, d in src.parts], src.axis
        )
        return
    if value.dtype.is_complex and op in ("mul", "add", "sub", "neg"):
        a, b = (_complex(lw, x) for x in (list(args) + [None])[:2])
        if op == "neg":
            return pair(f"-{a[0]}", f"-{a[1]}")
        if op in ("add", "sub"):
            sign = "+" if op == "add" else "-"
            return pair(f"{a[0]} {sign} {b[0]}", f"{a[1]} {sign} {b[1]}")
        if b[1] is None:  # complex times real
            return pair(f"{a[0]} * {b[0]}", f"{a[1]} * {b[0]}")
        if a[1] is None:
            return pair(f"{a[0]} * {b[0]}", f"{a[0]} * {b[1]}")
        return pair(f"{a[0]} * {b[0]} - {a[1]} * {b[1]}", f"{a[0]} * {b[1]} + {a[1]} * {b[0]}")
    raise LoweringError(f"`{node.name}`: no lowering for {op} on {value.dtype} / concatenated values")


def moved_concatenation_axis(lw, src: fx.Node, node: fx.Node) -> int | None:
    """Where the concatenation axis of ``src`` (kept in parts: :class:`Segments`) lies in
    ``node`` (counted from the end) when ``node`` is ``src`` with only size-1 axes moved, added or
    dropped — the last axis too (``cat([rot, pass], -1).transpose(-1, -2)`` of one token a head:
    the keys of a product); None otherwise. Row-major order is the same either way, so each
    part moves as a register reshape."""
    segments = lw.names.get(src)
    before, after = lw.block_shape(src), lw.block_shape(node)
    if not isinstance(segments, Segments) or not before or not after:
        return None
    big_before = [i for i, s in enumerate(before) if s != 1]
    big_after = [i for i, s in enumerate(after) if s != 1]
    if [before[i] for i in big_before] != [after[i] for i in big_after]:
        return None
    axis = len(before) + segments.axis
    if axis not in big_before:
        return None
    return big_after[big_before.index(axis)] - len(after)


def slice_columns(lw, node: fx.Node, name: str, cop: COp):
    """``src[..., start:stop]`` of a block in registers (Triton cannot index a block): when
    the slice is aligned to its padded width, a reshape that makes it one row of a 2-D
    block and a masked sum that picks the row; otherwise a one-hot sum over the columns."""
    src = cop.args[0]
    expr = lw.names[src]
    if not isinstance(expr, str) or lw.dtypes[src] == torch.bool:
        raise LoweringError(f"`{node.name}`: cannot slice {lw.dtypes[src]} / paired / concatenated values")
    start, stop = cop.attr("start"), cop.attr("stop")
    shape = lw.padded(src)
    rank, last, width = len(shape), shape[-1], pow2(stop - start)
    if cop.attr("step", 1) == 2:  # every other column: the block's pairs split in two
        half = lw.tile_code(src, halved=True) if lw.is_tiled(src, rank - 1) else str(last // 2)
        pairs = f"tl.reshape({expr}, {shape_literal(lw.dim_codes(src)[:-1] + [half, '2'])})"
        lw.lines.append(f"{name}_even, {name}_odd = tl.split({pairs})  # {node.name}")
        lw.names[node] = f"{name}_odd" if start else f"{name}_even"
        lw.dtypes[node] = lw.dtypes[src]
        return
    if start == 0 and width == last:  # the same block; the columns past ``stop`` are masked from here on
        lw.names[node], lw.dtypes[node] = expr, lw.dtypes[src]
        return
    if start % width == 0 and last % width == 0:
        rows = f"tl.reshape({lw.f32(src)}, {shape[:-1] + (last // width, width)})"
        which = expanded(f"tl.arange(0, {last // width})", rank - 1, rank + 1)
        picked = selected(f"{which} == {start // width}", rows, rank - 1)
    elif math.prod(shape) * width <= ONE_HOT_LIMIT:
        cols = expanded(f"tl.arange(0, {last})", rank, rank + 1)
        wanted = expanded(f"tl.arange(0, {width})", rank - 1, rank + 1)
        spread = f"tl.expand_dims({lw.f32(src)}, {rank - 1})"
        picked = selected(f"{cols} == {wanted} + {start}", spread, rank)
    else:
        raise LoweringError(f"`{node.name}`: columns {start}:{stop} of a {last}-wide block are not aligned")
    lw.lines.append(f"{name} = {picked}  # {node.name}")
    lw.names[node] = name
    lw.dtypes[node] = lw.dtypes[src]  # picked exactly: a value of the source's dtype


def joined(lw, node: fx.Node) -> str:
    """A concatenation along the last axis (kept as column segments until now) as one block:
    two halves of a power-of-two width are interleaved and regrouped (``rotate_half``);
    other parts are read again at the concatenation's columns where each can be
    (:mod:`fuser.lower.concat`), else placed with a one-hot sum over the columns when that is
    small enough.

    A one-hot sum is the last resort: it spreads every part over a block ``pow2(width)`` times
    larger and reduces it across lanes, which Triton does through shared memory once a block
    spans warps. GPT-NeoX-20B's partial RoPE (``rotate_half`` of 24 columns, halves of 12, 16
    heads a program at 8 warps) compiled to 1424 SASS instructions a warp, 348 of them shared
    loads and stores, against 256 and none with the parts re-read (sm_90, ptxas); on an H200
    the one-hot kernel took 306 µs at T=512 for 28 MB."""
    if lw.names[node].axis != -1:
        raise LoweringError(f"`{node.name}`: a concatenation whose axis moved from last is read only by a cast, a move of unit axes or a store", node)
    parts = lw.names[node].parts
    shape = lw.padded(node)
    rank, last = len(shape), shape[-1]
    values = [rounded(expr, torch.float32, dtype) for _, expr, _, dtype in parts]
    width = parts[0][2]
    if len(parts) == 2 and parts[1][2] == width == pow2(width) and parts[1][0] == width and last == 2 * width:
        halves = f"tl.join({values[0]}, {values[1]})"  # [..., width, 2]
        order = tuple(range(rank - 1)) + (rank, rank - 1)
        expr = f"tl.reshape(tl.permute({halves}, {order}), {shape})"
    elif (expr := remapped(lw, node)) is not None:  # each part read again at the concatenation's columns
        if expr.isidentifier():
            return expr
    elif math.prod(shape) * max(pow2(w) for _, _, w, _ in parts) <= ONE_HOT_LIMIT:
        cols = expanded(f"tl.arange(0, {last})", rank, rank + 1)
        terms = []
        for (offset, _, w, _), value in zip(parts, values):
            own = expanded(f"tl.arange(0, {pow2(w)})", rank - 1, rank + 1)
            spread = f"tl.expand_dims({value}, {rank})"
            terms.append(selected(f"({own} < {w}) & ({own} + {offset} == {cols})", spread, rank - 1))
        expr = " + ".join(terms)
    else:
        raise LoweringError(f"`{node.name}`: a {last}-wide concatenation is too large to assemble in registers", node)
    name = f"joined{len(lw.lines)}"
    lw.lines.append(f"{name} = {expr}  # {node.name}")
    return name


def gather_last(lw, node: fx.Node, name: str, cop: COp):
    """``src.gather(-1, index)``: a one-hot sum over the last axis per index."""
    src, index = cop.args
    shape = lw.padded(src)
    rank = len(shape)
    if math.prod(lw.padded(index)) * shape[-1] > ONE_HOT_LIMIT:
        raise LoweringError(f"`{node.name}`: gathering from a {shape[-1]}-wide block is too large")
    cols = expanded(f"tl.arange(0, {shape[-1]})", rank, rank + 1)
    wanted = f"tl.expand_dims({lw.names[index]}, {rank})"
    spread = f"tl.expand_dims({lw.f32(src)}, {rank - 1})"
    lw.lines.append(f"{name} = {selected(f'{cols} == {wanted}', spread, rank)}  # {node.name}")
    lw.names[node] = name
    lw.dtypes[node] = lw.dtypes[src]


def _scatter_hits(lw, node: fx.Node, x: fx.Node, index: fx.Node) -> tuple[str, str, int]:
    """``(hits, places, rank)`` for a scatter into ``x``'s last axis at ``index``: ``hits`` is
    true where index place j (``places``, along axis ``rank - 1``) names column c (axis
    ``rank``); padded places name no column."""
    shape, picks = lw.padded(x), lw.padded(index)
    rank = len(shape)
    if math.prod(picks) * shape[-1] > ONE_HOT_LIMIT:
        raise LoweringError(f"`{node.name}`: scattering into a {shape[-1]}-wide block is too large")
    cols = expanded(f"tl.arange(0, {shape[-1]})", rank, rank + 1)
    places = expanded(f"tl.arange(0, {picks[-1]})", rank - 1, rank + 1)
    hits = f"({cols} == tl.expand_dims({lw.names[index]}, {rank}))"
    width = lw.block_shape(index)[-1]
    if picks[-1] != width:
        hits += f" & ({places} < {width})"
    return hits, places, rank


@lowering("scatter_last")
def scatter_last(lw, node: fx.Node, cop: COp):
    """``x.scatter(-1, index, value)``: a column is set where any of its row's indices names
    it (a one-hot test per index; padded indices name no column)."""
    src, index, value = cop.args
    hits, _, rank = _scatter_hits(lw, node, src, index)
    listed = f"tl.max(({hits}).to(tl.int32), axis={rank - 1}) > 0"
    return lw.emit(node, f"tl.where({listed}, {lw.f32(float(value))}, {lw.f32(src)})")


@lowering("scatter_src_last")
def scatter_src_last(lw, node: fx.Node, cop: COp):
    """``x.scatter(-1, index, src)``: column c is ``src[j]`` for the last j whose index names c
    (eager's order on the CPU; on the GPU eager leaves which of repeated indices wins unsaid),
    else x's own (a one-hot test per index; padded indices name no column)."""
    x, index, src = cop.args
    hits, places, rank = _scatter_hits(lw, node, x, index)
    last = lw.local(f"{node.name}_from")
    lw.lines.append(f"{last} = tl.max(tl.where({hits}, {places}, -1), axis={rank - 1})  # {node.name}: the index naming each column last")
    picked = selected(f"{hits} & ({places} == tl.expand_dims({last}, {rank - 1}))", f"tl.expand_dims({lw.f32(src)}, {rank})", rank - 1)
    return lw.emit(node, f"tl.where({last} >= 0, {picked}, {lw.f32(x)})")


@lowering("index_add_last")
def index_add_last(lw, node: fx.Node, cop: COp):
    """``x.index_add(-1, index, source, alpha=a)``: column c of x plus a times the sum of the
    source's columns j with index[j] == c (a one-hot sum over j, in fp32, rounded once;
    padded and out-of-range indices name no column)."""
    x, index, source, alpha = cop.args
    if lw.block_shape(index) != lw.block_shape(index)[-1:] or lw.dtypes.get(index) not in INDEX_DTYPES:
        raise LoweringError(f"`{node.name}`: the index of an index_add must be one integer list of positions")
    shape = lw.padded(x)
    rank, picks = len(shape), lw.padded(index)[-1]
    if math.prod(shape) * picks > ONE_HOT_LIMIT:
        raise LoweringError(f"`{node.name}`: adding into a {shape} block at {picks} positions is too large for registers")
    cols = expanded(f"tl.arange(0, {shape[-1]})", rank - 1, rank + 1)
    wanted = expanded(lw.names[index], rank, rank + 1)
    real = lw.block_shape(index)[-1]
    hits = f"({cols} == {wanted})"
    if picks != real:
        hits += f" & {expanded(f'(tl.arange(0, {picks}) < {real})', rank, rank + 1)}"
    spread = f"tl.expand_dims({lw.f32(source)}, {rank - 1})"
    added = selected(hits, spread, rank)
    scale = "" if alpha == 1 else f" * {alpha!r}"
    return lw.emit(node, f"{lw.f32(x)} + {added}{scale}")


def _complex(lw, arg) -> tuple[str, str | None]:
    """(re, im) of a complex operand; (value, None) for a real one."""
    if arg is None:
        return (None, None)
    name = lw.names.get(arg) if isinstance(arg, fx.Node) else None
    if isinstance(name, tuple):
        return name
    return (lw.f32(arg), None)
