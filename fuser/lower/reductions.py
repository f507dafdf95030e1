"""reductions: lowerings that combine values along an axis of the block: sums, means and
extrema (products only summed are never built), p-norms, argmax / argmin, and top-k. Each takes the
lowerer (:class:`fuser.lower.lowerer.Lowerer`) explicitly; softmax and layer norm, which keep
their input's shape, are :mod:`fuser.lower.normalizations`."""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from fuser.canon.canonicalize import COp
from fuser.lower.code import CONTRACT_ABOVE, CONTRACT_AXIS, LoweringError, expanded, rounded, selected
from fuser.lower.registry import lowering
from fuser.lower.tiling import pow2

# Most picks a top-k makes (one reduction each).
TOPK_LIMIT = 64
# A top-k key: the value's 32 ordered bits above 31 bits of index (so keys stay within int64),
# and a key below every key for lanes already picked or outside the row.
_INDEX_BITS = 31
_INDEX_SPAN = 1 << _INDEX_BITS
_NO_KEY = -(1 << 62) - 1


def contractions(lw) -> set[fx.Node]:
    """Products only summed (or averaged) over one short axis, too large to build whole:
    ``(comb[..., None] * R[:, None]).sum(0)``, the mHC post's mix of the streams."""
    found = set()
    for node in lw.nodes:
        cop = lw.cops[node]
        product = cop.args[0] if cop.op in ("sum", "mean") else None
        if not isinstance(product, fx.Node) or product not in lw.nodes or product in lw.outputs:
            continue
        pc = lw.cops[product]
        users = [u for u in product.users if u in lw.nodes]
        axes = lw.block_axes(cop)
        if pc.op != "mul" or users != [node] or len(axes) != 1 or lw.is_tiled(product, axes[0]):
            continue
        if math.prod(lw.padded(product)) > CONTRACT_ABOVE and lw.block_shape(product)[axes[0]] <= CONTRACT_AXIS:
            found.add(product)
    return found


def contract(lw, node: fx.Node, cop: COp):
    """``(a * b).sum(axis)`` as a sum of ``a[j] * b[j]`` over the axis, never building a * b."""
    product = cop.args[0]
    axis = lw.block_axes(cop)[0]
    rank = len(lw.padded(product))
    dtype = lw.traced.value(product).dtype
    terms = []
    for j in range(lw.block_shape(product)[axis]):
        factors = [_pick(lw, x, axis, j, rank) for x in lw.cops[product].args]
        terms.append(rounded(f"{factors[0]} * {factors[1]}", dtype))
    expr = " + ".join(f"({t})" for t in terms)
    if cop.op == "mean":
        expr = f"({expr}) / {float(len(terms))!r}"
    if cop.attr("keepdim"):
        expr = f"tl.expand_dims({expr}, {axis})"
    return lw.emit(node, expr)


def _pick(lw, x, axis: int, j: int, rank: int) -> str:
    """Operand ``x`` of a rank-``rank`` broadcast product at index ``j`` of ``axis``, that
    axis dropped."""
    if not isinstance(x, fx.Node):
        return lw.f32(x)
    shape = lw.block_shape(x)
    own = axis - (rank - len(shape))  # numpy broadcasting aligns the trailing dims
    if own < 0:
        return lw.f32(x)
    if shape[own] == 1:
        return f"tl.sum({lw.f32(x)}, axis={own})"  # drops the size-1 axis
    which = expanded(f"tl.arange(0, {pow2(shape[own])})", own, len(shape))
    return selected(f"{which} == {j}", lw.f32(x), own)


@lowering("topk")
def topk(lw, node: fx.Node, cop: COp):
    """``torch.topk`` along the last axis, unrolled into k picks of the best remaining value
    (the lowest index among equals; NaN above every number, as torch sorts it). Each pick is
    one max over 64-bit keys: the value's bits in an order-preserving integer, then the
    index, so that the pick, its value and its index come out of a single reduction."""
    src = cop.args[0]
    k, largest = cop.attr("k"), cop.attr("largest")
    if k > TOPK_LIMIT:
        raise LoweringError(f"`{node.name}`: top-{k} is more than {TOPK_LIMIT} picks")
    shape = lw.padded(src)
    rank, axis = len(shape), len(shape) - 1
    name = lw.fresh(node)
    cols = lw.axis_index(src, axis, rank)
    picks = expanded(f"tl.arange(0, {pow2(k)})", axis, rank)
    x, mask = lw.f32(src), lw.mask(src)
    flip = "" if largest else "~"  # smallest first: the order reversed (NaN still last)
    out = shape[:-1] + (pow2(k),)
    lw.lines += [
        f"_s = tl.where({x} != {x}, 0x7FC00000, tl.where({x} == 0, 0, {x}.to(tl.int32, bitcast=True)))  # {node.name}: one NaN, one zero",
        "_s = tl.where(_s < 0, _s ^ 0x7FFFFFFF, _s)  # ordered as the floats are",
        f"{name}_key = {flip}_s.to(tl.int64) * {_INDEX_SPAN} + ({_INDEX_SPAN - 1} - {cols})",
    ]
    if mask:
        lw.lines.append(f"{name}_key = tl.where({mask}, {name}_key, {_NO_KEY})")
    lw.lines += [f"{name}_val = tl.zeros({out}, tl.float32)", f"{name}_idx = tl.zeros({out}, tl.int64)"]
    lw.lines += [
        f"for _pick in tl.static_range({k}):",
        f"    _best = tl.expand_dims(tl.max({name}_key, axis={axis}), {axis})",
        f"    _s = ({flip}(_best >> {_INDEX_BITS})).to(tl.int32)",
        f"    {name}_val = tl.where({picks} == _pick, tl.where(_s < 0, _s ^ 0x7FFFFFFF, _s).to(tl.float32, bitcast=True), {name}_val)",
        f"    {name}_idx = tl.where({picks} == _pick, {_INDEX_SPAN - 1} - (_best & {_INDEX_SPAN - 1}), {name}_idx)",
        f"    {name}_key = tl.where({name}_key == _best, {_NO_KEY}, {name}_key)",
    ]
    lw.names[node] = (f"{name}_val", f"{name}_idx")
    lw.dtypes[node] = lw.traced.value(src).dtype


def reduced_axes(lw, node: fx.Node, cop: COp) -> list[int]:
    """The block axes ``cop`` combines values along (never the tokens)."""
    dims = cop.attr("dim")
    if set(dims) & set(lw.traced.batch_dims(cop.args[0])):
        raise LoweringError(f"`{node.name}` reduces across tokens (dims {dims})")
    return lw.block_axes(cop)


@lowering("reduce")
def reduce(lw, node: fx.Node, cop: COp):
    src = cop.args[0]
    axes = reduced_axes(lw, node, cop)
    if src in lw.contracted:
        return contract(lw, node, cop)
    shape = lw.block_shape(src)
    fill = {"sum": "0.0", "mean": "0.0", "amax": "float('-inf')", "amin": "float('inf')"}[cop.op]
    fn = {"sum": "tl.sum", "mean": "tl.sum", "amax": "tl.max", "amin": "tl.min"}[cop.op]
    expr = lw.masked(src, fill)
    for axis in sorted(axes, reverse=True):
        expr = f"{fn}({expr}, axis={axis})"
        if cop.attr("keepdim"):
            expr = f"tl.expand_dims({expr}, {axis})"
    if cop.op == "mean":
        count = math.prod(shape[a] for a in axes)
        expr = f"{expr} / {float(count)!r}"
    return lw.emit(node, expr)


@lowering("logsumexp")
def logsumexp(lw, node: fx.Node, cop: COp):
    """``torch.logsumexp(x, dim)`` as PyTorch computes it: the max (±inf taken as 0), then
    ``log(sum(exp(x - max))) + max``, each step rounded to the input's dtype as eager's own ops
    round it (all -inf gives -inf, an inf gives inf)."""
    src = cop.args[0]
    axes = sorted(reduced_axes(lw, node, cop), reverse=True)
    dtype = lw.traced.value(node).dtype

    def step(expr: str) -> str:
        return expr if dtype == torch.float32 else f"{rounded(expr, dtype)}.to(tl.float32)"

    values = lw.masked(src, "float('-inf')")
    peak = values
    for axis in axes:
        peak = f"tl.expand_dims(tl.max({peak}, axis={axis}), {axis})"
    shift = lw.local(f"{node.name}_peak")
    lw.lines.append(f"{shift} = {peak}  # {node.name}")
    lw.lines.append(f"{shift} = tl.where(tl.abs({shift}) == float('inf'), 0.0, {shift})")
    total = step(f"tl.exp({step(f'{values} - {shift}')})")
    for axis in axes:
        total = f"tl.expand_dims(tl.sum({total}, axis={axis}), {axis})"
    expr = f"{step(f'tl.log({step(total)})')} + {shift}"
    if not cop.attr("keepdim"):
        for axis in axes:
            expr = f"tl.max({expr}, axis={axis})"  # the size-1 axis dropped
    return lw.emit(node, expr)


@lowering("moments")
def moments(lw, node: fx.Node, cop: COp):
    """``var`` (and ``std``, its square root) over block ``axes`` in fp32, from the centred
    values as PyTorch (two passes over the block in registers), over count - correction."""
    src = cop.args[0]
    axes = sorted(reduced_axes(lw, node, cop), reverse=True)
    count = math.prod(lw.block_shape(src)[a] for a in axes)
    mean = lw.masked(src, "0.0")
    for axis in axes:
        mean = f"tl.expand_dims(tl.sum({mean}, axis={axis}), {axis})"
    lw.lines.append(f"_mean = {mean} / {float(count)!r}  # {node.name}")
    mask = lw.mask(src)
    centred = f"{lw.f32(src)} - _mean"
    lw.lines.append(f"_centred = {f'tl.where({mask}, {centred}, 0.0)' if mask else centred}")
    total = "_centred * _centred"
    for axis in axes:
        total = f"tl.sum({total}, axis={axis})"
        if cop.attr("keepdim"):
            total = f"tl.expand_dims({total}, {axis})"
    expr = f"{total} / {float(count - cop.attr('correction'))!r}"
    return lw.emit(node, f"tl.sqrt({expr})" if cop.op == "std" else expr)


@lowering("vector_norm")
def vector_norm(lw, node: fx.Node, cop: COp):
    """``torch.linalg.vector_norm(x, p, dim)`` in fp32, rounded once (:func:`norm_of`)."""
    src = cop.args[0]
    return lw.emit(node, norm_of(lw, src, reduced_axes(lw, node, cop), cop.attr("ord"), cop.attr("keepdim")))


def norm_of(lw, src: fx.Node, axes: list[int], p: float, keepdim: bool) -> str:
    """The p-norm of ``src`` over block ``axes`` in fp32: the largest |x| for inf (the
    smallest for -inf), the count of non-zeros for 0, ``sum |x|`` for 1, ``sqrt(sum x^2)``
    for 2, else ``(sum |x|^p)^(1/p)`` (an |x| of 0 gives a term of 0 for p > 0, of inf for
    p < 0, as PyTorch)."""
    x, mask = lw.f32(src), lw.mask(src)
    magnitude = f"tl.abs({x})"
    if p in (math.inf, -math.inf):
        fn, term, fill = ("tl.max", magnitude, "0.0") if p > 0 else ("tl.min", magnitude, "float('inf')")
    elif p == 0:
        fn, term, fill = "tl.sum", f"({x} != 0).to(tl.float32)", "0.0"
    elif p == 1:
        fn, term, fill = "tl.sum", magnitude, "0.0"
    elif p == 2:
        fn, term, fill = "tl.sum", f"{x} * {x}", "0.0"
    else:
        fn, term, fill = "tl.sum", f"tl.exp2({p!r} * tl.log2({magnitude}))", "0.0"
    expr = f"tl.where({mask}, {term}, {fill})" if mask else term
    for axis in sorted(axes, reverse=True):
        expr = f"{fn}({expr}, axis={axis})"
        if keepdim:
            expr = f"tl.expand_dims({expr}, {axis})"
    if p == 2:
        return f"tl.sqrt_rn({expr})"
    if p not in (0, 1, math.inf, -math.inf):
        return f"tl.exp2(tl.log2({expr}) * {1 / p!r})"
    return expr


@lowering("normalize")
def normalize(lw, node: fx.Node, cop: COp):
    """``F.normalize(x, p, dim, eps)``: ``x / max(norm, eps)``, the norm (:func:`norm_of`)
    rounded to x's dtype first, as eager computes it in x's dtype."""
    src = cop.args[0]
    axes = reduced_axes(lw, node, cop)
    norm = rounded(norm_of(lw, src, axes, cop.attr("ord"), keepdim=True), lw.dtypes[src])
    if lw.dtypes[src] != torch.float32:
        norm = f"({norm}).to(tl.float32)"
    name = lw.local(f"{node.name}_norm")
    lw.lines.append(f"{name} = {norm}  # {node.name}")
    eps = rounded(f"tl.maximum({name}, {cop.attr('eps')!r})", lw.dtypes[src])
    if lw.dtypes[src] != torch.float32:
        eps = f"({eps}).to(tl.float32)"
    return lw.emit(node, f"{lw.f32(src)} / {eps}")


@lowering("argmax")
def argmax(lw, node: fx.Node, cop: COp):
    """argmax / argmin: the lowest index of the best value, NaN ranking first (as PyTorch)."""
    src = cop.args[0]
    (axis,) = reduced_axes(lw, node, cop)
    largest = cop.op == "argmax"
    shape = lw.padded(src)
    worst, best = ("float('-inf')", "tl.max") if largest else ("float('inf')", "tl.min")
    nan_rank = "float('inf')" if largest else "float('-inf')"
    x, mask = lw.f32(src), lw.mask(src)
    name = lw.fresh(node)
    ranked = f"tl.where({x} != {x}, {nan_rank}, {x})"
    lw.lines.append(f"{name}_rank = {f'tl.where({mask}, {ranked}, {worst})' if mask else ranked}  # {node.name}")
    lw.lines.append(f"{name}_best = tl.expand_dims({best}({name}_rank, axis={axis}), {axis})")
    cols = lw.axis_index(src, axis, len(shape))
    index = f"tl.min(tl.where({name}_rank == {name}_best, {cols}, {shape[axis]}), axis={axis})"
    if cop.attr("keepdim"):
        index = f"tl.expand_dims({index}, {axis})"
    lw.lines.append(f"{name} = ({index}).to(tl.int64)")
    lw.dtypes[node] = torch.int64
