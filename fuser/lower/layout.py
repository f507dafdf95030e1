"""lower_layout: ops that move values in a row program's registers: casts, broadcasts and
reshapes, constants, stacks and repeats, slices and concatenations, complex pairs, gathers
and scatters along the last axis."""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from fuser.canon.canonicalize import COp
from fuser.lower.code import ONE_HOT_LIMIT, LoweringError, Segments, expanded, rounded, selected, shape_literal
from fuser.lower.tiling import inserted_axes, pow2

class LayoutLowerings:
    """Methods of the row-program lowerer (:class:`fuser.lower.lowerer.Lowerer`), which holds the state
    they read (``names``, ``dtypes``, ``lines``, the region's nodes and tiling)."""

    def lower_cast(self, node: fx.Node, cop: COp):
        src = cop.args[0]
        value, target = self.f32(src), self.traced.value(node).dtype
        if target == torch.bool and self.dtypes[src] != torch.bool:
            value = f"({value} != 0)"  # NaN included, as PyTorch
        elif self.dtypes[src] == torch.bool and target != torch.bool:
            value = f"{value}.to(tl.float32)"
        return self.emit(node, value)

    def lower_layout(self, node: fx.Node, cop: COp):
        return self.emit(node, self.layout(node, cop, self.names[cop.args[0]]), layout_only=True)

    def lower_full(self, node: fx.Node, cop: COp):
        """A constant: a block of one literal, only where an op reads it or it is stored."""
        shape = self.shape_code(node, as_list=True)
        if self.traced.value(node).dtype == torch.bool:
            return self.emit(node, f"tl.full({shape}, {int(bool(cop.attr('value')))}, tl.int1)")
        return self.emit(node, f"tl.full({shape}, {self.f32(float(cop.attr('value')))}, tl.float32)")

    def lower_stack(self, node: fx.Node, cop: COp):
        """``torch.stack(parts, dim)``: each part put along a new axis, one select per part."""
        axis = self.block_axis(node, cop.attr("dim"))
        rank = len(self.padded(node))
        which = expanded(f"tl.arange(0, {pow2(len(cop.args))})", axis, rank)
        parts = [f"tl.expand_dims({self.f32(p)}, {axis})" for p in cop.args]
        expr = parts[-1]
        for i in reversed(range(len(parts) - 1)):
            expr = f"tl.where({which} == {i}, {parts[i]}, {expr})"
        return self.emit(node, expr)

    def lower_repeat_interleave(self, node: fx.Node, cop: COp):
        """``src.repeat_interleave(r, dim)``: element j along the axis is the source's j // r,
        picked by a one-hot sum over the source's axis (Triton cannot index a block)."""
        src = cop.args[0]
        axis, repeats = self.block_axis(node, cop.attr("dim")), cop.attr("repeats")
        shape, out = self.padded(src), self.padded(node)
        if math.prod(shape) * out[axis] > ONE_HOT_LIMIT:
            raise LoweringError(f"`{node.name}`: repeating a {shape} block is too large to do in registers")
        rank = len(shape)
        source = expanded(f"tl.arange(0, {shape[axis]})", axis, rank + 1)
        wanted = expanded(f"tl.arange(0, {out[axis]})", axis + 1, rank + 1)
        spread = f"tl.expand_dims({self.f32(src)}, {axis + 1})"
        expr = selected(f"{source} == {wanted} // {repeats}", spread, axis)
        if self.traced.value(node).dtype == torch.bool:
            expr = f"({expr}) != 0"
        return self.emit(node, expr)

    def layout(self, node: fx.Node, cop: COp, src: str) -> str:
        """``src`` moved into ``node``'s block shape (broadcast, unsqueeze or register reshape)."""
        if cop.op == "expand":
            return f"tl.broadcast_to({src}, {self.shape_code(node)})"
        if self.padded(node) == self.padded(cop.args[0]):
            return src
        inserted = inserted_axes(self.block_shape(cop.args[0]), self.block_shape(node))
        if inserted is not None:  # unsqueeze: a broadcast, no data movement (tl.reshape may shuffle)
            for axis in inserted:
                src = f"tl.expand_dims({src}, {axis})"
            return src
        return f"tl.reshape({src}, {self.shape_code(node) if self.padded(node) else (1,)})"

    def lower_pairs_and_parts(self, node: fx.Node, cop: COp):
        """Complex values as (re, im) float pairs; concatenations as column segments; row gathers."""
        op, args = cop.op, cop.args
        name = self.fresh(node)
        value = self.traced.value(node)
        self.dtypes[node] = value.dtype
        src = self.names.get(args[0]) if args and isinstance(args[0], fx.Node) else None

        def pair(re: str, im: str):
            self.lines.append(f"{name}_re, {name}_im = {re}, {im}  # {node.name}")
            self.names[node] = (f"{name}_re", f"{name}_im")

        if op == "gather_rows":
            return self.gather_rows(node, name, args[0], args[1])
        if op == "slice":
            return self.slice_columns(node, name, cop)
        if op in ("topk_values", "topk_indices"):
            values, indices = self.names[args[0]]
            self.names[node] = values if op == "topk_values" else indices  # the top-k's own local
            return
        if op == "gather_last":
            return self.gather_last(node, name, cop)
        if op == "view_as_complex":
            self.lines.append(f"{name}_re, {name}_im = tl.split({src})  # {node.name}")
            self.names[node] = (f"{name}_re", f"{name}_im")
            return
        if op == "view_as_real":
            self.lines.append(f"{name} = tl.join({src[0]}, {src[1]})  # {node.name}")
            self.names[node] = name
            return
        if op == "conj":
            return pair(src[0], f"-{src[1]}")
        if op in ("reshape", "expand") and isinstance(src, tuple):
            return pair(self.layout(node, cop, src[0]), self.layout(node, cop, src[1]))
        if op == "cat":
            parts, offset = [], 0
            for part in args:
                expr = self.names[part]
                if not isinstance(expr, str):
                    raise LoweringError(f"`{node.name}`: cannot concatenate {type(expr).__name__} values")
                width = self.block_shape(part)[-1]
                parts.append((offset, expr, width, self.dtypes[part]))
                offset += width
            self.names[node] = Segments(parts)
            return
        if op == "reshape" and isinstance(src, Segments) and self._moves_unit_axes(args[0], node):
            # (``cat([nope, rope], -1).transpose(1, 2)`` with one token per head row): each part
            # moves the same way, so the concatenation is still stored part by part.
            lead = self.padded(node)[:-1]
            self.names[node] = Segments(
                [(o, f"tl.reshape({e}, {lead + (pow2(w),)})", w, d) for o, e, w, d in src.parts]
            )
            return
        if op == "cast" and isinstance(src, Segments):
            self.names[node] = Segments(
                [(o, rounded(rounded(e, torch.float32, d), value.dtype), w, value.dtype) for o, e, w, d in src.parts]
            )
            return
        if value.dtype.is_complex and op in ("mul", "add", "sub", "neg"):
            a, b = (self._complex(x) for x in (list(args) + [None])[:2])
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

    def _moves_unit_axes(self, src: fx.Node, node: fx.Node) -> bool:
        """Is ``node`` ``src`` with only size-1 axes moved, added or dropped (the last axis kept)?"""
        before, after = self.block_shape(src), self.block_shape(node)
        if not before or not after or before[-1] != after[-1]:
            return False
        return [s for s in before if s != 1] == [s for s in after if s != 1]

    def slice_columns(self, node: fx.Node, name: str, cop: COp):
        """``src[..., start:stop]`` of a block in registers (Triton cannot index a block): when
        the slice is aligned to its padded width, a reshape that makes it one row of a 2-D
        block and a masked sum that picks the row; otherwise a one-hot sum over the columns."""
        src = cop.args[0]
        expr = self.names[src]
        if not isinstance(expr, str) or self.dtypes[src] == torch.bool:
            raise LoweringError(f"`{node.name}`: cannot slice {self.dtypes[src]} / paired / concatenated values")
        start, stop = cop.attr("start"), cop.attr("stop")
        shape = self.padded(src)
        rank, last, width = len(shape), shape[-1], pow2(stop - start)
        if cop.attr("step", 1) == 2:  # every other column: the block's pairs split in two
            half = self.tile_code(src, halved=True) if self.is_tiled(src, rank - 1) else str(last // 2)
            pairs = f"tl.reshape({expr}, {shape_literal(self.dim_codes(src)[:-1] + [half, '2'])})"
            self.lines.append(f"{name}_even, {name}_odd = tl.split({pairs})  # {node.name}")
            self.names[node] = f"{name}_odd" if start else f"{name}_even"
            self.dtypes[node] = self.dtypes[src]
            return
        if start == 0 and width == last:  # the same block; the columns past ``stop`` are masked from here on
            self.names[node], self.dtypes[node] = expr, self.dtypes[src]
            return
        if start % width == 0 and last % width == 0:
            rows = f"tl.reshape({self.f32(src)}, {shape[:-1] + (last // width, width)})"
            which = expanded(f"tl.arange(0, {last // width})", rank - 1, rank + 1)
            picked = selected(f"{which} == {start // width}", rows, rank - 1)
        elif math.prod(shape) * width <= ONE_HOT_LIMIT:
            cols = expanded(f"tl.arange(0, {last})", rank, rank + 1)
            wanted = expanded(f"tl.arange(0, {width})", rank - 1, rank + 1)
            spread = f"tl.expand_dims({self.f32(src)}, {rank - 1})"
            picked = selected(f"{cols} == {wanted} + {start}", spread, rank)
        else:
            raise LoweringError(f"`{node.name}`: columns {start}:{stop} of a {last}-wide block are not aligned")
        self.lines.append(f"{name} = {picked}  # {node.name}")
        self.names[node] = name
        self.dtypes[node] = self.dtypes[src]  # picked exactly: a value of the source's dtype

    def joined(self, node: fx.Node) -> str:
        """A concatenation along the last axis (kept as column segments until now) as one block:
        two halves of a power-of-two width are interleaved and regrouped (``rotate_half``);
        other parts are placed with a one-hot sum over the columns."""
        parts = self.names[node].parts
        shape = self.padded(node)
        rank, last = len(shape), shape[-1]
        values = [rounded(expr, torch.float32, dtype) for _, expr, _, dtype in parts]
        width = parts[0][2]
        if len(parts) == 2 and parts[1][2] == width == pow2(width) and parts[1][0] == width and last == 2 * width:
            halves = f"tl.join({values[0]}, {values[1]})"  # [..., width, 2]
            order = tuple(range(rank - 1)) + (rank, rank - 1)
            expr = f"tl.reshape(tl.permute({halves}, {order}), {shape})"
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
        name = f"joined{len(self.lines)}"
        self.lines.append(f"{name} = {expr}  # {node.name}")
        return name

    def gather_last(self, node: fx.Node, name: str, cop: COp):
        """``src.gather(-1, index)``: a one-hot sum over the last axis per index."""
        src, index = cop.args
        shape = self.padded(src)
        rank = len(shape)
        if math.prod(self.padded(index)) * shape[-1] > ONE_HOT_LIMIT:
            raise LoweringError(f"`{node.name}`: gathering from a {shape[-1]}-wide block is too large")
        cols = expanded(f"tl.arange(0, {shape[-1]})", rank, rank + 1)
        wanted = f"tl.expand_dims({self.names[index]}, {rank})"
        spread = f"tl.expand_dims({self.f32(src)}, {rank - 1})"
        self.lines.append(f"{name} = {selected(f'{cols} == {wanted}', spread, rank)}  # {node.name}")
        self.names[node] = name
        self.dtypes[node] = self.dtypes[src]

    def lower_scatter_last(self, node: fx.Node, cop: COp):
        """``x.scatter(-1, index, value)``: a column is set where any of its row's indices names
        it (a one-hot test per index; padded indices name no column)."""
        src, index, value = cop.args
        shape, picks = self.padded(src), self.padded(index)
        rank = len(shape)
        if math.prod(picks) * shape[-1] > ONE_HOT_LIMIT:
            raise LoweringError(f"`{node.name}`: scattering into a {shape[-1]}-wide block is too large")
        cols = expanded(f"tl.arange(0, {shape[-1]})", rank, rank + 1)
        hits = f"({cols} == tl.expand_dims({self.names[index]}, {rank}))"
        width = self.block_shape(index)[-1]
        if picks[-1] != width:
            hits += f" & {expanded(f'(tl.arange(0, {picks[-1]}) < {width})', rank - 1, rank + 1)}"
        listed = f"tl.max(({hits}).to(tl.int32), axis={rank - 1}) > 0"
        return self.emit(node, f"tl.where({listed}, {float(value)!r}, {self.f32(src)})")

    def _complex(self, arg) -> tuple[str, str | None]:
        """(re, im) of a complex operand; (value, None) for a real one."""
        if arg is None:
            return (None, None)
        name = self.names.get(arg) if isinstance(arg, fx.Node) else None
        if isinstance(name, tuple):
            return name
        return (self.f32(arg), None)
