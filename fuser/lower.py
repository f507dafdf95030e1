"""lower: turn a region of canonical ops into the body of a Triton *row program*.

A row program runs one program per token row (and per tile of the last axis when no op
mixes values along it, else per tile of the first axis when none mixes values along that:
:mod:`fuser.tiling`).
Each value lives in registers as a block: its shape without the token dim, each dim padded to
a power of two. Inputs are loaded through their runtime strides
(so views, slices and non-contiguous tensors need no copy); values without a token dim
(weights) are loaded whole and broadcast. Every op computes in fp32 and rounds to the dtype
the eager op returns, so bf16 rounding happens exactly where PyTorch rounds. Operands are all
loaded first (one memory round trip); each output the kernel allocates is stored where it is
computed, one written into a caller's buffer last.

How each op lowers comes from the op table (fuser/ops.py): a pointwise op's Triton expression,
or the ``lower_<name>`` method of :class:`_Lowerer` that its entry names.

The result is plain data (:class:`fuser.program.RowProgram`) that the Jinja templates render.
"""

from __future__ import annotations

import builtins
import itertools
import keyword
import math
import re
from dataclasses import dataclass

import torch
import torch.fx as fx

from fuser import ops
from fuser.body import tidy
from fuser.canon import COMPUTE, UNIT_VIEW, COp
from fuser.launch_config import elements_per_warp, warps_for
from fuser.program import TL_DTYPES, Operand, RowProgram, operand
from fuser.tiling import find_tiling, inserted_axes, launch_widths, pow2, tile_floor
from fuser.trace import Traced


class LoweringError(Exception):
    """The region cannot be written as one row program; the message says which node and why,
    ``node`` is that node (when one op is the reason)."""

    def __init__(self, message: str, node: fx.Node | None = None):
        super().__init__(message)
        self.node = node


# The Triton expression of every pointwise op (fuser.ops), by name, read at lowering time.
_EXPRESSIONS = {name: op.triton for name, op in ops.TABLE.items() if op.kind == ops.POINTWISE and op.triton}

# Integer values a row program carries: top-k indices and the indices a gather reads.
INDEX_DTYPES = {torch.int64: "tl.int64", torch.int32: "tl.int32"}
# Most picks a top-k makes (one reduction each).
TOPK_LIMIT = 64
# A top-k key: the value's 32 ordered bits above 31 bits of index (so keys stay within int64),
# and a key below every key for lanes already picked or outside the row.
_INDEX_BITS = 31
_INDEX_SPAN = 1 << _INDEX_BITS
_NO_KEY = -(1 << 62) - 1


def rounded(expr: str, dtype: torch.dtype, source: torch.dtype = torch.float32) -> str:
    """``expr`` (of dtype ``source``) converted to ``dtype`` the way PyTorch rounds it.

    fp32 -> bf16 goes through ``to_bf16`` and fp32 -> fp8 e4m3 through ``to_e4m3``
    (templates/_kernel_base.py.jinja): round to nearest even, as the GPU's own bf16 conversion
    does; under Triton's CPU interpreter (whose casts truncate, or round fp8 wrongly) in integer
    arithmetic, and fp8 always so.
    """
    if dtype == source:
        return expr
    if dtype == torch.bfloat16 and source == torch.float32:
        return f"to_bf16({expr})"
    if dtype == torch.float8_e4m3fn:
        return f"to_e4m3({rounded(expr, torch.float32, source)})"
    return f"({expr}).to({TL_DTYPES.get(dtype, 'tl.float32')})"


# A product summed over a short axis (at most _CONTRACT_AXIS long) whose block is larger than
# _CONTRACT_ABOVE elements is never built: the sum runs over the axis, one slice at a time.
_CONTRACT_ABOVE = 4096
_CONTRACT_AXIS = 16
# Largest block (elements) an unaligned slice may spread into a one-hot sum.
_ONE_HOT_LIMIT = 1 << 16


@dataclass
class Segments:
    """A value concatenated along its last axis: (column offset, expression, width, dtype) parts."""

    parts: list[tuple[int, str, int, torch.dtype]]


def _shape_code(dims: list[str], as_list: bool = False) -> str:
    """A block shape written as ``str`` writes a tuple (or a list) of ints, from its dims' code."""
    if as_list:
        return f"[{', '.join(dims)}]"
    return f"({', '.join(dims)}{',' if len(dims) == 1 else ''})"


def _expand(base: str, axis: int, rank: int) -> str:
    if rank == 1:
        return base
    return f"{base}[{', '.join(':' if i == axis else 'None' for i in range(rank))}]"


def _selected(condition: str, value: str, axis: int) -> str:
    """The value where ``condition`` holds, summed over ``axis``: how a block in registers is
    indexed (Triton cannot index one) when the condition holds once along that axis."""
    return f"tl.sum(tl.where({condition}, {value}, 0.0), axis={axis})"


def _pair_index(rank: int) -> str:
    return _expand("tl.arange(0, 2)", rank - 1, rank)


class _Lowerer:
    def __init__(self, traced: Traced, cops: dict[fx.Node, COp], nodes, inputs, outputs, in_place=()):
        self.traced, self.cops = traced, cops
        self.nodes, self.inputs, self.outputs = list(nodes), list(inputs), list(outputs)
        self.in_place = set(in_place)  # outputs written into a caller's buffer: stored last
        self.names: dict[fx.Node, str] = {}
        self.dtypes: dict[fx.Node, torch.dtype] = {}
        self.lines: list[str] = []
        self.helpers: set[str] = set()
        self.taken: set[str] = set()  # locals (and their companions) in use
        self.masks: dict[str, str] = {}  # mask expression -> the local it is built in, once
        # Tables read only through a row gather are never loaded whole, nor at this program's row.
        self.gathered = {n for n in self.inputs if self._only_gathered(n)}
        self.regathered = self._regathered()
        self.row_rank = max(
            (self.traced.value(n).dim() for n in self.inputs + self.nodes if self.traced.batch_dims(n)), default=0
        )
        self._check_rows()
        tiling = find_tiling(self)
        self.tiled = tiling is not None
        self.last, self._leading = (tiling.size, tiling.leading) if tiling else (1, False)
        self.tile_axis = tiling.axis if tiling else {}  # each value's tiled block axis
        self.tile_scale = tiling.scale if tiling else {}  # how many tiles wide it is read
        self.block_last = 1

    # --- structure ---------------------------------------------------------------------------
    def _only_gathered(self, node: fx.Node) -> bool:
        uses = [self.cops[u] for u in node.users if u in self.nodes]
        return bool(uses) and all(c.op == "gather_rows" and c.args[0] is node and c.args[1] is not node for c in uses)

    def _regathered(self) -> set[fx.Node]:
        """Values of another row count that a ``group_rows`` reads at gathered rows: its gather,
        the gather's index and the gathered table with what computes it, never lowered at this
        program's row (``lower_group_rows`` computes them at the rows it gathers)."""
        found = set()
        for node in self.nodes:
            if self.cops[node].op != "group_rows":
                continue
            gather = self.cops[node].args[0]
            if gather not in self.nodes or [u for u in gather.users if u in self.nodes] != [node]:
                raise LoweringError(f"`{node.name}`: its rows' gather must be in the kernel and read by it alone", node)
            table, index = self.cops[gather].args
            found |= {gather, index} | self._table_values(table)
        for node in found & set(self.nodes + self.inputs):
            outside = [u for u in node.users if u in self.nodes and u not in found and self.cops[u].op != "group_rows"]
            if outside or node in self.outputs:
                raise LoweringError(f"`{node.name}` is read at gathered rows and at this program's row", node)
        return found

    def _table_values(self, table: fx.Node) -> set[fx.Node]:
        """``table`` and the kernel's nodes that compute it (pointwise, casts, unit axes, row
        gathers with the tables they read)."""
        found, todo = set(), [table]
        while todo:
            node = todo.pop()
            if node in found:
                continue
            found.add(node)
            if node not in self.nodes:
                continue
            cop = self.cops[node]
            if cop.op == "gather_rows":  # its table is read at the rows its index names there
                found.add(cop.args[0])
                todo.append(cop.args[1])
            elif ops.kind(cop.op) == ops.POINTWISE or (cop.op == "reshape" and cop.kind == UNIT_VIEW):
                todo += [a for a in cop.args if isinstance(a, fx.Node)]
            else:
                raise LoweringError(f"`{node.name}` ({cop.op}) cannot be computed at gathered rows", node)
        return found

    def _check_rows(self):
        rows = set()
        for node in self.inputs + self.nodes:
            if node in self.regathered:
                continue
            value = self.traced.value(node)
            if node in self.nodes and self.cops[node].op == "topk":
                continue  # a (values, indices) pair, read only through its parts
            if not isinstance(value, torch.Tensor):
                raise LoweringError(f"`{node.name}` is not a tensor")
            batch = self.traced.batch_dims(node)
            if batch and batch != (0,):
                raise LoweringError(f"`{node.name}` has its token dim at {batch}, not first")
            if batch and node not in self.gathered:  # a gathered table's rows are any rows
                rows.add((value.shape[0], self.traced.shadows[node.name][1].shape[0]))
            if value.dtype in INDEX_DTYPES:
                continue  # positions and index arithmetic, computed in integers
            if value.dtype not in TL_DTYPES and not value.dtype.is_complex and node not in self.gathered:
                raise LoweringError(f"`{node.name}` is {value.dtype}; row programs take {list(TL_DTYPES)}")
        if len(rows) > 1:
            raise LoweringError(f"values with different token counts {sorted(rows)} in one chain")
        if not rows:
            raise LoweringError("no value in the chain follows the tokens (parameters only)")
        for node in self.outputs:
            if not self.traced.batch_dims(node):
                raise LoweringError(f"output `{node.name}` does not follow the tokens")

    def block_shape(self, node: fx.Node) -> tuple[int, ...]:
        value = self.traced.value(node)
        if self.traced.batch_dims(node):
            return tuple(value.shape[1:])
        if self._over_rows(node, value):
            return tuple(value.shape[1:])  # [1, N] broadcast over the token rows
        return tuple(value.shape)

    def _over_rows(self, node: fx.Node, value) -> bool:
        """Is ``node``'s value (no token rows) broadcast over the rows: a leading 1 where the
        row values it is combined with have their rows, at their rank (or the region's)?"""
        if not value.dim() or value.shape[0] != 1:
            return False
        if value.dim() == self.row_rank:
            return True
        return any(
            u in self.nodes and self.traced.batch_dims(u) and self.traced.value(u).dim() == value.dim() for u in node.users
        )

    def block_axes(self, cop: COp) -> list[int]:
        src = cop.args[0]
        offset = 1 if self.traced.batch_dims(src) else 0
        return [d - offset for d in cop.attr("dim")]

    def block_axis(self, node: fx.Node, dim: int) -> int:
        """Block axis of ``node``'s (full-rank) dim ``dim``."""
        return dim - (1 if self.traced.batch_dims(node) else 0)

    # --- index and mask expressions ----------------------------------------------------------
    def is_tiled(self, node: fx.Node, axis: int) -> bool:
        return self.tiled and self.tile_axis.get(node) == axis

    def axis_index(self, node: fx.Node, axis: int, rank: int) -> str:
        """Index along ``axis`` of ``node``'s rank-``rank`` block, broadcastable against others."""
        size = self.block_shape(node)[axis]
        base = self.tile_name(node) if self.is_tiled(node, axis) else f"tl.arange(0, {pow2(size)})"
        if rank == 1:
            return base
        expand = ", ".join(":" if i == axis else "None" for i in range(rank))
        return f"{base}[{expand}]"

    def tile_name(self, node: fx.Node) -> str:
        """The index of ``node``'s tiled axis: ``tile``, or ``tile2`` for a tile twice as wide."""
        scale = self.tile_scale.get(node, 1)
        return "tile" if scale == 1 else f"tile{scale}"

    def padded(self, node: fx.Node) -> tuple[int, ...]:
        shape = self.block_shape(node)
        wide = self.block_last * self.tile_scale.get(node, 1)
        return tuple(wide if self.is_tiled(node, i) else pow2(s) for i, s in enumerate(shape))

    def shape_code(self, node: fx.Node, as_list: bool = False) -> str:
        """``node``'s padded block shape as code, as ``str`` writes the tuple (or the list), but a
        tiled axis as its tile's width (``BLOCK_TILE``, ``2 * BLOCK_TILE``): so that the body
        reads the same at any width, and the launch may choose one."""
        return _shape_code(self.dim_codes(node), as_list)

    def dim_codes(self, node: fx.Node) -> list[str]:
        """Each axis of ``node``'s padded block as code (:meth:`shape_code`)."""
        return [self.tile_code(node) if self.is_tiled(node, i) else str(s) for i, s in enumerate(self.padded(node))]

    def tile_code(self, node: fx.Node, halved: bool = False) -> str:
        """The width of ``node``'s tiled axis as code (half of it with ``halved``)."""
        scale = self.tile_scale.get(node, 1) // (2 if halved else 1)
        return "BLOCK_TILE" if scale == 1 else f"{scale} * BLOCK_TILE"

    def mask(self, node: fx.Node) -> str | None:
        """The local holding which lanes of ``node``'s padded block are real (None: all are),
        built once, at the top of the body."""
        shape = self.block_shape(node)
        terms = [
            f"({self.axis_index(node, axis, len(shape))} < {size})"
            for axis, size in enumerate(shape)
            if self.is_tiled(node, axis) or pow2(size) != size
        ]
        if not terms:
            return None
        expr = " & ".join(terms)
        if expr not in self.masks:
            self.masks[expr] = f"mask{len(self.masks)}"
        return self.masks[expr]

    # --- code --------------------------------------------------------------------------------
    def fresh(self, node: fx.Node) -> str:
        """A local for ``node``'s value, named after the node."""
        self.names[node] = self.local(node.name)
        return self.names[node]

    def local(self, base: str) -> str:
        """A new local called ``base`` (``add_1``), or another name (:func:`_named`) when that
        one, or a companion of it (``add_1_re``, ``add_1_idx``, ...), is taken or is the frame's."""
        name = _named(base, self.taken)
        self.taken.update(name + suffix for suffix in _COMPANIONS)
        return name

    def f32(self, arg) -> str:
        """An operand as fp32 (or a literal)."""
        if not isinstance(arg, fx.Node):
            if isinstance(arg, bool):
                return "1" if arg else "0"
            if isinstance(arg, float) and not math.isfinite(arg):
                return {True: "float('inf')", False: "float('-inf')"}[arg > 0] if not math.isnan(arg) else "float('nan')"
            return repr(float(arg)) if isinstance(arg, float) else repr(arg)
        name = self.names[arg]
        dtype = self.dtypes[arg]
        if dtype in (torch.float32, torch.bool):
            return name
        return f"{name}.to(tl.float32)"

    def emit(self, node: fx.Node, expr: str, layout_only: bool = False):
        """``name = expr``, rounded to the node's dtype unless it only moves values around; a
        layout op that leaves the block as it is names its source's local, no copy."""
        dtype = self.traced.value(node).dtype
        if layout_only and expr in self.taken:
            self.names[node], self.dtypes[node] = expr, dtype
            return
        name = self.fresh(node)
        if dtype not in (torch.float32, torch.bool) and not layout_only:
            expr = rounded(expr, dtype)
        self.lines.append(f"{name} = {expr}  # {node.name}")
        self.dtypes[node] = dtype

    def load(self, operand: Operand, node: fx.Node):
        if node in self.gathered or node in self.regathered:
            return
        row = f"row * {operand.name}_stride_row" if operand.has_rows else None
        self._emit_load(node, self.fresh(node), operand, row)

    def _emit_load(self, node: fx.Node, name: str, operand: Operand, row: str | None, first_stride: int = 0):
        """``name = tl.load(...)`` of ``node``'s block from ``operand``: ``row`` offsets the
        pointer to this token's row; block dim i uses stride ``first_stride + i``."""
        shape = operand.shape
        rank = len(shape) + (1 if operand.complex else 0)
        terms = [f"{operand.name}_ptr"] + ([row] if row else [])
        for axis in range(len(shape)):
            terms.append(f"{self.axis_index(node, axis, rank)} * {operand.name}_stride_{first_stride + axis}")
        if operand.complex:
            terms.append(f"{_pair_index(rank)} * {operand.name}_stride_{first_stride + len(shape)}")
        mask = self.mask(node)
        if mask and operand.complex:
            mask = f"({mask})[..., None]" if len(shape) else None
        extra = f", mask={mask}, other=0.0" if mask else ""
        self.lines.append(f"{name} = tl.load({' + '.join(terms)}{extra})  # {node.name}")
        self.names[node] = name
        self._finish_pair_load(node, name, operand)

    def _finish_pair_load(self, node, name, operand):
        self.dtypes[node] = operand.dtype
        if operand.complex:
            self.lines.append(f"{name}_re, {name}_im = tl.split({name})")
            self.names[node] = (f"{name}_re", f"{name}_im")

    def store(self, operand: Operand, node: fx.Node):
        value = self.names[node]
        if isinstance(value, Segments):
            return self._store_segments(operand, node, value)
        shape = operand.shape
        rank = len(shape) + (1 if operand.complex else 0)
        terms = [f"{operand.name}_ptr", f"row * {operand.name}_stride_row"]
        for axis in range(len(shape)):
            terms.append(f"{self.axis_index(node, axis, rank)} * {operand.name}_stride_{axis}")
        mask = self.mask(node)
        if operand.complex:
            terms.append(f"{_pair_index(rank)} * {operand.name}_stride_{len(shape)}")
            value = f"tl.join({value[0]}, {value[1]})"
            mask = f"({mask})[..., None]" if mask and len(shape) else None
        extra = f", mask={mask}" if mask else ""
        source = torch.float32 if operand.complex else self.dtypes[node]
        target = torch.float32 if operand.complex else operand.dtype
        self.lines.append(f"tl.store({' + '.join(terms)}, {rounded(value, target, source)}{extra})")

    def _store_segments(self, operand: Operand, node: fx.Node, segments: "Segments"):
        """A concatenation along the last axis: each part stored at its column offset."""
        rank = len(operand.shape)
        for offset, part, width, dtype in segments.parts:
            terms = [f"{operand.name}_ptr", f"row * {operand.name}_stride_row"]
            for axis in range(rank - 1):
                terms.append(f"{self.axis_index(node, axis, rank)} * {operand.name}_stride_{axis}")
            cols = _expand(f"tl.arange(0, {pow2(width)})", rank - 1, rank)
            terms.append(f"({cols} + {offset}) * {operand.name}_stride_{rank - 1}")
            masks = [
                f"({self.axis_index(node, a, rank)} < {s})"
                for a, s in enumerate(operand.shape[:-1])
                if pow2(s) != s or self.is_tiled(node, a)
            ]  # fmt: skip
            if pow2(width) != width:
                masks.append(f"({cols} < {width})")
            extra = f", mask={' & '.join(masks)}" if masks else ""
            self.lines.append(f"tl.store({' + '.join(terms)}, {rounded(part, operand.dtype, dtype)}{extra})")

    def masked(self, node: fx.Node, fill: str) -> str:
        mask = self.mask(node)
        value = self.f32(node)
        return f"tl.where({mask}, {value}, {fill})" if mask else value

    def lower_node(self, node: fx.Node):
        cop = self.cops[node]
        op, args = cop.op, cop.args
        entry = ops.TABLE.get(op)
        if entry is None:
            raise LoweringError(f"`{node.name}`: no row-program lowering for {op}")
        if op == "topk":
            return self.topk(node, cop)
        keeps_parts = op == "cast" or (op == "reshape" and self._moves_unit_axes(args[0], node))
        for arg in args:  # a concatenation read by anything but a cast, a store or a unit-axis move: one block
            if not keeps_parts and isinstance(arg, fx.Node) and isinstance(self.names.get(arg), Segments):
                self.names[arg] = self.joined(arg)
        special = entry.lowering == "pairs_and_parts" or any(
            isinstance(x, fx.Node) and isinstance(self.names.get(x), (tuple, Segments)) for x in args
        )
        if special:
            return self.lower_pairs_and_parts(node, cop)
        if node in self.contracted:
            return  # built inside the sum that reads it
        if args and args[0] in self.contracted:
            return self.reduce(node, cop)
        if self.traced.value(node).dtype in INDEX_DTYPES and entry.integer:
            operands = [self.names[a] if isinstance(a, fx.Node) else repr(a) for a in args]
            return self.emit(node, ops.render(entry.integer, *operands), layout_only=True)
        if op in _EXPRESSIONS:
            self.helpers.update(entry.helpers)
            operands = [None if a is None else self.f32(a) for a in args]
            return self.emit(node, ops.render(_EXPRESSIONS[op], *operands))
        return getattr(self, f"lower_{entry.lowering}")(node, cop)

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
        which = _expand(f"tl.arange(0, {pow2(len(cop.args))})", axis, rank)
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
        if math.prod(shape) * out[axis] > _ONE_HOT_LIMIT:
            raise LoweringError(f"`{node.name}`: repeating a {shape} block is too large to do in registers")
        rank = len(shape)
        source = _expand(f"tl.arange(0, {shape[axis]})", axis, rank + 1)
        wanted = _expand(f"tl.arange(0, {out[axis]})", axis + 1, rank + 1)
        spread = f"tl.expand_dims({self.f32(src)}, {axis + 1})"
        expr = _selected(f"{source} == {wanted} // {repeats}", spread, axis)
        if self.traced.value(node).dtype == torch.bool:
            expr = f"({expr}) != 0"
        return self.emit(node, expr)

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
            if math.prod(self.padded(product)) > _CONTRACT_ABOVE and self.block_shape(product)[axes[0]] <= _CONTRACT_AXIS:
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
        which = _expand(f"tl.arange(0, {pow2(shape[own])})", own, len(shape))
        return _selected(f"{which} == {j}", self.f32(x), own)

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
            pairs = f"tl.reshape({expr}, {_shape_code(self.dim_codes(src)[:-1] + [half, '2'])})"
            self.lines.append(f"{name}_even, {name}_odd = tl.split({pairs})  # {node.name}")
            self.names[node] = f"{name}_odd" if start else f"{name}_even"
            self.dtypes[node] = self.dtypes[src]
            return
        if start == 0 and width == last:  # the same block; the columns past ``stop`` are masked from here on
            self.names[node], self.dtypes[node] = expr, self.dtypes[src]
            return
        if start % width == 0 and last % width == 0:
            rows = f"tl.reshape({self.f32(src)}, {shape[:-1] + (last // width, width)})"
            which = _expand(f"tl.arange(0, {last // width})", rank - 1, rank + 1)
            picked = _selected(f"{which} == {start // width}", rows, rank - 1)
        elif math.prod(shape) * width <= _ONE_HOT_LIMIT:
            cols = _expand(f"tl.arange(0, {last})", rank, rank + 1)
            wanted = _expand(f"tl.arange(0, {width})", rank - 1, rank + 1)
            spread = f"tl.expand_dims({self.f32(src)}, {rank - 1})"
            picked = _selected(f"{cols} == {wanted} + {start}", spread, rank)
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
        elif math.prod(shape) * max(pow2(w) for _, _, w, _ in parts) <= _ONE_HOT_LIMIT:
            cols = _expand(f"tl.arange(0, {last})", rank, rank + 1)
            terms = []
            for (offset, _, w, _), value in zip(parts, values):
                own = _expand(f"tl.arange(0, {pow2(w)})", rank - 1, rank + 1)
                spread = f"tl.expand_dims({value}, {rank})"
                terms.append(_selected(f"({own} < {w}) & ({own} + {offset} == {cols})", spread, rank - 1))
            expr = " + ".join(terms)
        else:
            raise LoweringError(f"`{node.name}`: a {last}-wide concatenation is too large to assemble in registers", node)
        name = f"joined{len(self.lines)}"
        self.lines.append(f"{name} = {expr}  # {node.name}")
        return name

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
        picks = _expand(f"tl.arange(0, {pow2(k)})", axis, rank)
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

    def gather_last(self, node: fx.Node, name: str, cop: COp):
        """``src.gather(-1, index)``: a one-hot sum over the last axis per index."""
        src, index = cop.args
        shape = self.padded(src)
        rank = len(shape)
        if math.prod(self.padded(index)) * shape[-1] > _ONE_HOT_LIMIT:
            raise LoweringError(f"`{node.name}`: gathering from a {shape[-1]}-wide block is too large")
        cols = _expand(f"tl.arange(0, {shape[-1]})", rank, rank + 1)
        wanted = f"tl.expand_dims({self.names[index]}, {rank})"
        spread = f"tl.expand_dims({self.f32(src)}, {rank - 1})"
        self.lines.append(f"{name} = {_selected(f'{cols} == {wanted}', spread, rank)}  # {node.name}")
        self.names[node] = name
        self.dtypes[node] = self.dtypes[src]

    def lower_scatter_last(self, node: fx.Node, cop: COp):
        """``x.scatter(-1, index, value)``: a column is set where any of its row's indices names
        it (a one-hot test per index; padded indices name no column)."""
        src, index, value = cop.args
        shape, picks = self.padded(src), self.padded(index)
        rank = len(shape)
        if math.prod(picks) * shape[-1] > _ONE_HOT_LIMIT:
            raise LoweringError(f"`{node.name}`: scattering into a {shape[-1]}-wide block is too large")
        cols = _expand(f"tl.arange(0, {shape[-1]})", rank, rank + 1)
        hits = f"({cols} == tl.expand_dims({self.names[index]}, {rank}))"
        width = self.block_shape(index)[-1]
        if picks[-1] != width:
            hits += f" & {_expand(f'(tl.arange(0, {picks[-1]}) < {width})', rank - 1, rank + 1)}"
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

    def gather_rows(self, node: fx.Node, name: str, table: fx.Node, index: fx.Node):
        """``table[index]``: the row of ``table`` this program's index names. The table is read
        from memory (an input); the index may be computed here (``perm // top_k``)."""
        operands = {n: op for n, op in zip(self.inputs, self._operands)}
        if table not in operands:
            raise LoweringError(f"`{node.name}`: a row gather must read its table directly")
        t = operands[table]
        shape, first, count, stride_row = _table_rows(t)
        self.lines.append(f"{name}_idx = {_wrapped(self.names[index], count)}  # {index.name}")
        gathered = Operand(t.name, table.name, shape, t.dtype, True)
        self._emit_load(node, name, gathered, f"{name}_idx * {stride_row}", first_stride=first)

    def lower_group_rows(self, node: fx.Node, cop: COp):
        """``table[index].view(T, k, ...)``: this token's k rows of the gather, each computed
        from the table's inputs loaded at the row its index names (``index[row * k + j]``)."""
        gather = cop.args[0]
        table, index = self.cops[gather].args
        operands = dict(zip(self.inputs, self._operands))
        if index not in operands or self.block_shape(index):
            raise LoweringError(f"`{node.name}`: the gather's index must be an input of one position per row", node)
        k = cop.attr("group")
        name = self.fresh(node)
        i = operands[index]
        picks = f"tl.arange(0, {pow2(k)})"
        self.lines.append(
            f"{name}_rows = tl.load({i.name}_ptr + (row * {k} + {picks}) * {i.name}_stride_row, mask={picks} < {k}, other=0)"
            f"  # {index.name}, {k} per token"
        )
        at_rows = _AtRows(self, f"{name}_rows", k, operands)
        if self.cops[index].op == "inverse_permutation":  # rows inv[i]: a gather through perm there reads perm[inv[i]] = i
            at_rows.inverts = (self.cops[index].args[0], f"(row * {k} + {picks})")
        self.lines.append(f"{name} = {at_rows.value(table)}  # {node.name}")
        self.names[node] = name
        self.dtypes[node] = at_rows.dtypes[table]

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

    # --- entry point -------------------------------------------------------------------------
    def lower(self, block_last: int | None = None) -> RowProgram:
        """The region's row program; a tiled one with ``block_last`` elements of the tiled axis
        a program (default: :meth:`tile_width`)."""
        names = _operand_names(self.inputs + self.outputs)
        ins = [self._operand(n, name) for n, name in zip(self.inputs, names)]
        outs = [self._operand(n, name) for n, name in zip(self.outputs, names[len(self.inputs) :])]
        for op in ins + outs:  # no local may be called as a kernel argument is
            self.taken.update([f"{op.name}_ptr", *op.stride_args])
        self.contracted = self._contractions()
        values = [
            n for n in self.nodes + self.inputs
            if isinstance(self.traced.value(n), torch.Tensor)
            and n not in self.contracted and n not in self.gathered and n not in self.regathered
        ]  # fmt: skip: a gathered table is read a row at a time, a contracted product never built
        others = 1
        if self.tiled:
            others = max(
                math.prod(pow2(s) for i, s in enumerate(self.block_shape(n)) if not self.is_tiled(n, i))
                * self.tile_scale.get(n, 1)
                for n in values
            )  # fmt: skip: a tile twice as wide counts twice
            self.block_last = block_last or self.tile_width(others)
        numel = max(math.prod(self.padded(n) or (1,)) for n in values)
        self._operands = ins
        for operand, node in zip(ins, self.inputs):
            self.load(operand, node)
        unstored = list(zip(outs, self.outputs))
        for node in self.nodes:
            if node in self.regathered:
                continue
            try:
                self.lower_node(node)
            except LoweringError as e:
                e.node = e.node or node
                raise
            unstored = self._store_fresh(node, unstored)
        for operand, node in unstored:
            self.store(operand, node)
        masks = [f"{name} = {expr}" for expr, name in self.masks.items()]
        self.lines = tidy(masks + self.lines)
        names = {self.cops[n].op for n in self.nodes}
        leading = self.tiled and self._leading
        per_warp = elements_per_warp(bool(names & ops.REDUCING), self.tiled, leading, names)
        helpers = tuple(sorted(self.helpers))
        scales = tuple(sorted({s for s in self.tile_scale.values() if s > 1})) if self.tiled else ()
        return RowProgram(
            ins, outs, self.lines, self.tiled, leading, self.last, self.block_last, warps_for(numel, per_warp),
            numel, helpers, scales, others, per_warp,
        )  # fmt: skip

    def _store_fresh(self, node: fx.Node, unstored: list) -> list:
        """Store ``node`` where it is computed when it is an output the kernel allocates (so its
        registers are free for the rest of the body); one written into a caller's buffer is
        stored last, after every read of that buffer."""
        if node in self.in_place or node not in self.names:
            return unstored
        for operand, output in unstored:
            if output is node:
                self.store(operand, node)
        return [(operand, output) for operand, output in unstored if output is not node]

    def tile_width(self, others: int) -> int:
        """Elements of the tiled axis a program takes, when each of them comes with ``others``
        elements of the other axes: about 2048 a program, at least 16 columns (heads by the one)."""
        return min(pow2(self.last), max(tile_floor(self._leading), pow2(max(1, 2048 // others))))

    def _operand(self, node: fx.Node, name: str) -> Operand:
        op = operand(self.traced, node, name)
        if not op.has_rows and self.block_shape(node) != op.shape:  # [1, N]: expanded over rows
            op = Operand(name, node.name, self.block_shape(node), op.dtype, True, broadcast_rows=True)
        if node in self.gathered or node in self.regathered:
            groups = [self.cops[g].attr("group") for g in self.nodes if self.cops[g].op == "group_rows"
                      and self.cops[self.cops[g].args[0]].args[1] is node]  # fmt: skip
            op.row_group = groups[0] if groups else 0
        return op


def _operand_names(nodes: list[fx.Node]) -> list[str]:
    """The kernel's name for each node it reads or writes: the node's own (``residual``, so the
    arguments read ``residual_ptr``, ``residual_stride_row``), unless another operand or the
    frame has it."""
    names: list[str] = []
    for node in nodes:
        names.append(_named(node.name, set(names)))
    return names


def _named(base: str, taken: set[str]) -> str:
    """``base``, or ``v_<base>``, or ``v_<base>_<n>``: the first that is free (:func:`_free`)."""
    candidates = itertools.chain([base, f"v_{base}"], (f"v_{base}_{n}" for n in itertools.count(1)))
    return next(c for c in candidates if _free(c, taken))


# What a local's name may be followed by, for the values that come with it (a complex value's
# parts, a top-k's values and indices, a gather's row index, an argmax's ranks).
_COMPANIONS = ("", "_re", "_im", "_even", "_odd", "_key", "_val", "_idx", "_rank", "_best", "_pairs")
# Names a kernel module already uses: the frame's (row, tile, helpers, modules, the launcher's
# locals), the masks and the loops' locals.
_FRAME_NAME = re.compile(r"(row|tile\d*|tl|triton|torch|os|math|to_bf16|to_e4m3|expm1_f32|tanh_f32"
                         r"|BLOCK_TILE|n_rows|block_tile|num_warps|launch|mask\d+|_.*)$")  # fmt: skip


def _free(name: str, taken: set[str]) -> bool:
    """May a local be called ``name``: not a Python keyword or builtin, not a name of the
    kernel's frame, and neither it nor a companion of it taken?"""
    if keyword.iskeyword(name) or name in dir(builtins) or _FRAME_NAME.match(name):
        return False
    return not any(name + suffix in taken for suffix in _COMPANIONS)


def _table_rows(table: Operand) -> tuple[tuple[int, ...], int, str, str]:
    """How a row gather reads ``table``: (a row's block shape, the stride number of its first
    axis, the row count, the row stride). A table with rows of another count (MoE's hidden
    states) has its own row stride and count; a table of fixed rows (a parameter: a rotary
    table, the experts' biases) is indexed along its first axis."""
    if table.has_rows:
        return table.shape, 0, f"{table.name}_rows", f"{table.name}_stride_row"
    return table.shape[1:], 1, str(table.shape[0]), f"{table.name}_stride_0"


def _wrapped(index: str, rows) -> str:
    """A position as PyTorch indexes: a negative one counts from the end. (Positions out of
    range raise in eager; here they are clamped into the table so no load leaves it.)"""
    return f"tl.minimum(tl.maximum(tl.where({index} < 0, {index} + {rows}, {index}), 0), {rows} - 1)"


class _AtRows:
    """Values of a gathered table computed at ``rows`` (a block of k row numbers): each input
    loaded at those rows, each op applied as at the table's own rows. A value's block is the
    rows' axis followed by its own block."""

    def __init__(self, lowerer: _Lowerer, rows: str, k: int, operands: dict):
        self.lowerer, self.rows, self.k, self.operands = lowerer, rows, k, operands
        # (perm, positions) when the rows are inverse_permutation(perm) at those positions
        self.inverts: tuple[fx.Node, str] | None = None
        self.names: dict[fx.Node, str] = {}
        self.dtypes: dict[fx.Node, torch.dtype] = {}

    def value(self, node: fx.Node) -> str:
        """The expression of ``node`` at the rows (rounded to its dtype), as a name."""
        if node not in self.names:
            self.names[node] = self._input(node) if node in self.operands else self._op(node)
        return self.names[node]

    def f32(self, arg) -> str:
        if not isinstance(arg, fx.Node):
            return self.lowerer.f32(arg)
        name = self.value(arg)
        return name if self.dtypes[arg] in (torch.float32, torch.bool) else f"{name}.to(tl.float32)"

    def _line(self, node: fx.Node, expr: str, dtype: torch.dtype) -> str:
        name = self.lowerer.local(f"{node.name}_at_{self.rows}")
        self.lowerer.lines.append(f"{name} = {expr}  # {node.name} at the gathered rows")
        self.dtypes[node] = dtype
        return name

    def _input(self, node: fx.Node, rows: str | None = None, source: fx.Node | None = None) -> str:
        """``node``: input ``source`` (by default itself) loaded at ``rows`` (by default the
        gathered rows)."""
        operand = self.operands[source or node]
        if operand.broadcast_rows or not (operand.has_rows or (rows and operand.shape)):
            raise LoweringError(f"`{node.name}`: a gathered table's input must have its rows", node)
        shape, first, count, stride_row = _table_rows(operand)
        rank = len(shape) + 1
        picks = _expand(f"tl.arange(0, {pow2(self.k)})", 0, rank)
        at = _wrapped(rows or self.rows, count)
        terms = [f"{operand.name}_ptr", f"{_expand(f'({at})', 0, rank)} * {stride_row}"]
        masks = [f"({picks} < {self.k})"]
        for axis, size in enumerate(shape):
            tiled = self.lowerer.is_tiled(node, axis)
            index = _expand(self.lowerer.tile_name(node) if tiled else f"tl.arange(0, {pow2(size)})", axis + 1, rank)
            terms.append(f"{index} * {operand.name}_stride_{axis + first}")
            if tiled or pow2(size) != size:
                masks.append(f"({index} < {size})")
        expr = f"tl.load({' + '.join(terms)}, mask={' & '.join(masks)}, other=0.0)"
        return self._line(node, expr, operand.dtype)

    def _op(self, node: fx.Node) -> str:
        cop = self.lowerer.cops[node]
        dtype = self.lowerer.traced.value(node).dtype
        rank = len(self.lowerer.block_shape(node)) + 1
        if cop.op == "reshape":  # a unit-axis view: only inserted unit axes are followed here
            src = cop.args[0]
            inserted = inserted_axes(self.lowerer.block_shape(src), self.lowerer.block_shape(node))
            if inserted is None:
                raise LoweringError(f"`{node.name}`: only unit axes may be added at gathered rows", node)
            expr = self.value(src)
            for axis in inserted:
                expr = f"tl.expand_dims({expr}, {axis + 1})"
            return self._line(node, expr, self.dtypes[src])
        if cop.op == "cast":
            return self._line(node, rounded(self.f32(cop.args[0]), dtype), dtype)
        if cop.op == "gather_rows":  # table[index] at the rows: the table at the rows the index holds there
            table, index = cop.args
            if table not in self.operands:
                raise LoweringError(f"`{node.name}`: a row gather must read its table directly", node)
            if self.lowerer.block_shape(index):
                raise LoweringError(f"`{node.name}`: a row gather's index must be one position per row", node)
            if self.inverts and self.inverts[0] is index:  # table[perm] at rows inv[i] is table[i]
                return self._input(node, rows=self.inverts[1], source=table)
            return self._input(node, rows=self.value(index), source=table)
        entry = ops.TABLE[cop.op]
        if dtype in INDEX_DTYPES and entry.integer:
            operands = [self.value(a) if isinstance(a, fx.Node) else repr(a) for a in cop.args]
            return self._line(node, ops.render(entry.integer, *operands), dtype)
        if cop.op not in _EXPRESSIONS:
            raise LoweringError(f"`{node.name}`: {cop.op} is not computed at gathered rows", node)
        operands = []
        for arg in cop.args:
            expr = self.f32(arg) if arg is not None else None
            if isinstance(arg, fx.Node):  # numpy broadcasting aligns the trailing dims: pad after the rows' axis
                for _ in range(rank - 1 - len(self.lowerer.block_shape(arg))):
                    expr = f"tl.expand_dims({expr}, 1)"
            operands.append(expr)
        self.lowerer.helpers.update(entry.helpers)
        expr = ops.render(_EXPRESSIONS[cop.op], *operands)
        return self._line(node, expr if dtype in (torch.float32, torch.bool) else rounded(expr, dtype), dtype)


def lower_region(traced: Traced, cops, nodes, inputs, outputs, in_place=()) -> RowProgram:
    """Lower the region's nodes (in graph order) reading ``inputs`` and writing ``outputs``
    (those in ``in_place`` into a caller's buffer)."""
    for node in nodes:
        if cops[node].kind not in (COMPUTE, UNIT_VIEW):
            raise LoweringError(f"`{node.name}` ({cops[node].op}) is not an elementwise or reduction op")
    program = _Lowerer(traced, cops, nodes, inputs, outputs, in_place).lower()
    if program.tiled:

        def body_at(width: int) -> list[str]:
            return _Lowerer(traced, cops, nodes, inputs, outputs, in_place).lower(block_last=width).body

        program.widths = _launch_widths(program, body_at)
    return program


def _launch_widths(program: RowProgram, body_at) -> tuple[int, ...]:
    """The tile widths a launch of ``program`` may choose among (:func:`launch_widths`), or none
    when its body depends on the width: lowered at another width, it must read the same."""
    widths = launch_widths(program.block_last, program.others, program.leading)
    if len(widths) < 2:
        return ()
    return widths if body_at(widths[0]) == program.body else ()
