"""lower_reduce: reductions in a row program: sums (and products summed without being built),
softmax, layer norm, argmax and top-k."""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from fuser.canon.canonicalize import COp
from fuser.lower.code import CONTRACT_ABOVE, CONTRACT_AXIS, LoweringError, expanded, rounded, selected
from fuser.lower.tiling import pow2

# Most picks a top-k makes (one reduction each).
TOPK_LIMIT = 64
# A top-k key: the value's 32 ordered bits above 31 bits of index (so keys stay within int64),
# and a key below every key for lanes already picked or outside the row.
_INDEX_BITS = 31
_INDEX_SPAN = 1 << _INDEX_BITS
_NO_KEY = -(1 << 62) - 1


class ReductionLowerings:
    """Methods of the row-program lowerer (:class:`fuser.lower.lowerer.Lowerer`), which holds the state
    they read (``names``, ``dtypes``, ``lines``, the region's nodes and tiling)."""

    def _contractions(self) -> set[fx.Node]:
        """Products only summed (or averaged) over one short axis, too large to build whole:
        ``(comb[..., None] * R[:, None]).sum(0)``, the mHC post's mix of the streams."""
        found = set()
        for node in self.nodes:
            cop = self.cops[node]
            product = cop.args[0] if cop.op in ("sum", "mean") else None
            if not isinstance(product, fx.Node) or product not in self.nodes or product in self.outputs:
                continue
            pc = self.cops[product]
            users = [u for u in product.users if u in self.nodes]
            axes = self.block_axes(cop)
            if pc.op != "mul" or users != [node] or len(axes) != 1 or self.is_tiled(product, axes[0]):
                continue
            if math.prod(self.padded(product)) > CONTRACT_ABOVE and self.block_shape(product)[axes[0]] <= CONTRACT_AXIS:
                found.add(product)
        return found

    def contract(self, node: fx.Node, cop: COp):
        """``(a * b).sum(axis)`` as a sum of ``a[j] * b[j]`` over the axis, never building a * b."""
        product = cop.args[0]
        axis = self.block_axes(cop)[0]
        rank = len(self.padded(product))
        dtype = self.traced.value(product).dtype
        terms = []
        for j in range(self.block_shape(product)[axis]):
            factors = [self._pick(x, axis, j, rank) for x in self.cops[product].args]
            terms.append(rounded(f"{factors[0]} * {factors[1]}", dtype))
        expr = " + ".join(f"({t})" for t in terms)
        if cop.op == "mean":
            expr = f"({expr}) / {float(len(terms))!r}"
        if cop.attr("keepdim"):
            expr = f"tl.expand_dims({expr}, {axis})"
        return self.emit(node, expr)

    def _pick(self, x, axis: int, j: int, rank: int) -> str:
        """Operand ``x`` of a rank-``rank`` broadcast product at index ``j`` of ``axis``, that
        axis dropped."""
        if not isinstance(x, fx.Node):
            return self.f32(x)
        shape = self.block_shape(x)
        own = axis - (rank - len(shape))  # numpy broadcasting aligns the trailing dims
        if own < 0:
            return self.f32(x)
        if shape[own] == 1:
            return f"tl.sum({self.f32(x)}, axis={own})"  # drops the size-1 axis
        which = expanded(f"tl.arange(0, {pow2(shape[own])})", own, len(shape))
        return selected(f"{which} == {j}", self.f32(x), own)

    def topk(self, node: fx.Node, cop: COp):
        """``torch.topk`` along the last axis, unrolled into k picks of the best remaining value
        (the lowest index among equals; NaN above every number, as torch sorts it). Each pick is
        one max over 64-bit keys: the value's bits in an order-preserving integer, then the
        index, so that the pick, its value and its index come out of a single reduction."""
        src = cop.args[0]
        k, largest = cop.attr("k"), cop.attr("largest")
        if k > TOPK_LIMIT:
            raise LoweringError(f"`{node.name}`: top-{k} is more than {TOPK_LIMIT} picks")
        shape = self.padded(src)
        rank, axis = len(shape), len(shape) - 1
        name = self.fresh(node)
        cols = self.axis_index(src, axis, rank)
        picks = expanded(f"tl.arange(0, {pow2(k)})", axis, rank)
        x, mask = self.f32(src), self.mask(src)
        flip = "" if largest else "~"  # smallest first: the order reversed (NaN still last)
        out = shape[:-1] + (pow2(k),)
        self.lines += [
            f"_s = tl.where({x} != {x}, 0x7FC00000, tl.where({x} == 0, 0, {x}.to(tl.int32, bitcast=True)))  # {node.name}: one NaN, one zero",
            "_s = tl.where(_s < 0, _s ^ 0x7FFFFFFF, _s)  # ordered as the floats are",
            f"{name}_key = {flip}_s.to(tl.int64) * {_INDEX_SPAN} + ({_INDEX_SPAN - 1} - {cols})",
        ]
        if mask:
            self.lines.append(f"{name}_key = tl.where({mask}, {name}_key, {_NO_KEY})")
        self.lines += [f"{name}_val = tl.zeros({out}, tl.float32)", f"{name}_idx = tl.zeros({out}, tl.int64)"]
        self.lines += [
            f"for _pick in tl.static_range({k}):",
            f"    _best = tl.expand_dims(tl.max({name}_key, axis={axis}), {axis})",
            f"    _s = ({flip}(_best >> {_INDEX_BITS})).to(tl.int32)",
            f"    {name}_val = tl.where({picks} == _pick, tl.where(_s < 0, _s ^ 0x7FFFFFFF, _s).to(tl.float32, bitcast=True), {name}_val)",
            f"    {name}_idx = tl.where({picks} == _pick, {_INDEX_SPAN - 1} - (_best & {_INDEX_SPAN - 1}), {name}_idx)",
            f"    {name}_key = tl.where({name}_key == _best, {_NO_KEY}, {name}_key)",
        ]
        self.names[node] = (f"{name}_val", f"{name}_idx")
        self.dtypes[node] = self.traced.value(src).dtype

    def _reduced_axes(self, node: fx.Node, cop: COp) -> list[int]:
        """The block axes ``cop`` combines values along (never the tokens)."""
        dims = cop.attr("dim")
        if set(dims) & set(self.traced.batch_dims(cop.args[0])):
            raise LoweringError(f"`{node.name}` reduces across tokens (dims {dims})")
        return self.block_axes(cop)

    def reduce(self, node: fx.Node, cop: COp):
        src = cop.args[0]
        axes = self._reduced_axes(node, cop)
        if src in self.contracted:
            return self.contract(node, cop)
        shape = self.block_shape(src)
        fill = {"sum": "0.0", "mean": "0.0", "amax": "float('-inf')", "amin": "float('inf')"}[cop.op]
        fn = {"sum": "tl.sum", "mean": "tl.sum", "amax": "tl.max", "amin": "tl.min"}[cop.op]
        expr = self.masked(src, fill)
        for axis in sorted(axes, reverse=True):
            expr = f"{fn}({expr}, axis={axis})"
            if cop.attr("keepdim"):
                expr = f"tl.expand_dims({expr}, {axis})"
        if cop.op == "mean":
            count = math.prod(shape[a] for a in axes)
            expr = f"{expr} / {float(count)!r}"
        return self.emit(node, expr)

    lower_reduce = reduce
    lower_topk = topk  # (lower_node calls it first: its input is never a joined block)

    def lower_softmax(self, node: fx.Node, cop: COp):
        """softmax and log_softmax; with ``dtype=``, of the input cast to that dtype first."""
        src = cop.args[0]
        (axis,) = self._reduced_axes(node, cop)
        x, dtype = self.f32(src), cop.attr("dtype")
        if dtype not in (None, torch.float32, self.dtypes[src]):
            self.lines.append(f"_x = ({rounded(x, dtype)}).to(tl.float32)  # {node.name}: in {dtype}")
            x = "_x"
        mask = self.mask(src)
        highest = f"tl.where({mask}, {x}, float('-inf'))" if mask else x
        self.lines.append(f"_max = tl.expand_dims(tl.max({highest}, axis={axis}), {axis})")
        self.lines.append(f"_exp = tl.exp({x} - _max)")
        if mask:
            self.lines.append(f"_exp = tl.where({mask}, _exp, 0.0)")
        total = f"tl.expand_dims(tl.sum(_exp, axis={axis}), {axis})"
        if cop.op == "log_softmax":
            return self.emit(node, f"{x} - _max - tl.log({total})")
        return self.emit(node, f"_exp / {total}")

    def lower_layer_norm(self, node: fx.Node, cop: COp):
        """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last axis (biased variance,
        from the centred values, as PyTorch)."""
        src, weight, bias = cop.args
        (axis,) = self._reduced_axes(node, cop)
        count = float(self.block_shape(src)[axis])
        mask = self.mask(src)
        self.lines.append(f"_mean = tl.expand_dims(tl.sum({self.masked(src, '0.0')}, axis={axis}), {axis}) / {count!r}  # {node.name}")
        centred = f"{self.f32(src)} - _mean"
        self.lines.append(f"_centred = {f'tl.where({mask}, {centred}, 0.0)' if mask else centred}")
        self.lines.append(f"_var = tl.expand_dims(tl.sum(_centred * _centred, axis={axis}), {axis}) / {count!r}")
        expr = f"_centred * tl.rsqrt(_var + {float(cop.attr('eps'))!r})"
        if weight is not None:
            expr = f"{expr} * {self.f32(weight)}"
        if bias is not None:
            expr = f"{expr} + {self.f32(bias)}"
        return self.emit(node, expr)

    def lower_argmax(self, node: fx.Node, cop: COp):
        """argmax / argmin: the lowest index of the best value, NaN ranking first (as PyTorch)."""
        src = cop.args[0]
        (axis,) = self._reduced_axes(node, cop)
        largest = cop.op == "argmax"
        shape = self.padded(src)
        worst, best = ("float('-inf')", "tl.max") if largest else ("float('inf')", "tl.min")
        nan_rank = "float('inf')" if largest else "float('-inf')"
        x, mask = self.f32(src), self.mask(src)
        name = self.fresh(node)
        ranked = f"tl.where({x} != {x}, {nan_rank}, {x})"
        self.lines.append(f"{name}_rank = {f'tl.where({mask}, {ranked}, {worst})' if mask else ranked}  # {node.name}")
        self.lines.append(f"{name}_best = tl.expand_dims({best}({name}_rank, axis={axis}), {axis})")
        cols = self.axis_index(src, axis, len(shape))
        index = f"tl.min(tl.where({name}_rank == {name}_best, {cols}, {shape[axis]}), axis={axis})"
        if cop.attr("keepdim"):
            index = f"tl.expand_dims({index}, {axis})"
        self.lines.append(f"{name} = ({index}).to(tl.int64)")
        self.dtypes[node] = torch.int64
