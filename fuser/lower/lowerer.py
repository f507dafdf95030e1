"""lower: turn a region of canonical ops into the body of a Triton *row program*.

A row program runs one program per token row (and per tile of the last axis when no op
mixes values along it, else per tile of the first axis when none mixes values along that:
:mod:`fuser.lower.tiling`).
Each value lives in registers as a block: its shape without the token dim, each dim padded to
a power of two. Inputs are loaded through their runtime strides
(so views, slices and non-contiguous tensors need no copy); values without a token dim
(weights) are loaded whole and broadcast. Every op computes in fp32 and rounds to the dtype
the eager op returns, so bf16 rounding happens exactly where PyTorch rounds. Operands are all
loaded first (one memory round trip); each output the kernel allocates is stored where it is
computed, one written into a caller's buffer last.

How each op lowers comes from the op table (fuser/ir/ops.py): a pointwise op's Triton expression,
or the lowering its entry names, a function registered under that name beside the others of its
family (:mod:`fuser.lower.registry`: layout, reductions, normalizations, row gathers).

The result is plain data (:class:`fuser.lower.row_program.RowProgram`) that the Jinja templates render.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from fuser.ir import ops
from fuser.lower.tidy import tidy
from fuser.canon.canonicalize import COMPUTE, UNIT_VIEW, COp
from fuser.lower.warps import elements_per_warp, warps_for
from fuser.lower.code import (
    COMPANIONS, EXPRESSIONS, INDEX_DTYPES, LoweringError, Segments, free_name, operand_names, rounded, shape_literal,
    without_node_echo,
)  # fmt: skip
from fuser.lower import normalizations  # noqa: F401 (each family module registers its lowerings when imported)
from fuser.lower.layout import joined, moved_concatenation_axis, pairs_and_parts
from fuser.lower.memory import load, store, store_fresh
from fuser.lower.reductions import contractions
from fuser.lower.registry import lowering_for
from fuser.lower.row_gathers import gathered_only, regathered_values, spread_tables
from fuser.lower.row_program import TL_DTYPES, Operand, RowProgram, operand
from fuser.lower.tiling import find_tiling, launch_widths, pow2, tile_floor
from fuser.trace.tracing import Traced

#: The most elements a value of a chain with no token rows may have: one program holds it.
ROWLESS_ELEMENTS = 1 << 16
#: The most elements Triton takes in one block.
TRITON_MAX_NUMEL = 1 << 20


class Lowerer:
    """Lowers one region: its nodes in graph order, each to lines of Triton over blocks in
    registers (``lines``), each value's local in ``names`` and dtype in ``dtypes``. This class
    holds the state and the general part (block shapes and indices, masks, locals, the dispatch
    by op); loads and stores are :mod:`fuser.lower.memory`, and the ops' own lowerings functions
    that take it, registered by name in their family's module (:mod:`fuser.lower.registry`)."""

    def __init__(self, traced: Traced, cops: dict[fx.Node, COp], nodes, inputs, outputs, in_place=(), names=None):
        self.traced, self.cops = traced, cops
        self.nodes, self.inputs, self.outputs = list(nodes), list(inputs), list(outputs)
        self.in_place = set(in_place)  # outputs written into a caller's buffer: stored last
        # what a matched pattern's reference calls a node (fuser.regions.builder.Region.names):
        # its local is called so instead of after the node
        self.reference_names: dict[fx.Node, str] = dict(names or {})
        self.names: dict[fx.Node, str] = {}
        self.reserved: dict[fx.Node, str] = {}  # an operand's node -> its argument's name, for its local
        self.dtypes: dict[fx.Node, torch.dtype] = {}
        self.lines: list[str] = []
        self.helpers: set[str] = set()
        self.taken: set[str] = set()  # locals (and their companions) in use
        self.masks: dict[str, str] = {}  # mask expression -> the local it is built in, once
        self._over_rows_dims: dict[fx.Node, int | None] = {}  # row_dim of values of no token rows
        # Tables read only through a row gather are never loaded whole, nor at this program's row.
        self.spread_tables = spread_tables(self)
        self.gathered = {n for n in self.inputs if gathered_only(self, n)}
        self.regathered = regathered_values(self)
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
            if len(batch) > 1:
                raise LoweringError(f"`{node.name}` has its tokens along several dims {batch}")
            if batch and batch != (0,) and (node in self.gathered or node in self.regathered):
                raise LoweringError(f"`{node.name}` is a gathered table with its token dim at {batch}, not first")
            if batch and node not in self.gathered:  # a gathered table's rows are any rows
                rows.add((value.shape[batch[0]], self.traced.shadows[node.name][1].shape[batch[0]]))
            if value.dtype in INDEX_DTYPES:
                continue  # positions and index arithmetic, computed in integers
            if value.dtype not in TL_DTYPES and not value.dtype.is_complex and node not in self.gathered:
                raise LoweringError(f"`{node.name}` is {value.dtype}; row programs take {list(TL_DTYPES)}")
        if len(rows) > 1:
            raise LoweringError(f"values with different token counts {sorted(rows)} in one chain")
        self.rowless = not rows
        if self.rowless:
            self._check_rowless()
            return
        for node in self.outputs:
            if not self.traced.batch_dims(node):
                raise LoweringError(f"output `{node.name}` does not follow the tokens")

    def _check_rowless(self):
        """A chain where no value follows the tokens (a model's positions and causal mask, from
        its cache's length) is one program over values of the sizes they were traced with; it
        needs a tensor input, for the device, and blocks one program holds (a table read a row at
        a time by a gather is never held whole: GPT-J's sin/cos row at a decode step's position)."""
        if not any(isinstance(self.traced.value(n), torch.Tensor) for n in self.inputs):
            raise LoweringError("no value in the chain follows the tokens, and it reads no tensor")
        for node in self.inputs + self.nodes:
            if node in self.gathered or node in self.spread_tables:
                continue
            value = self.traced.value(node)
            if isinstance(value, torch.Tensor) and value.numel() > ROWLESS_ELEMENTS:
                raise LoweringError(
                    f"no value in the chain follows the tokens, and `{node.name}` has {value.numel()} elements: "
                    f"one program takes at most {ROWLESS_ELEMENTS}"
                )

    def block_shape(self, node: fx.Node) -> tuple[int, ...]:
        """``node``'s value without its token dim (the rows), wherever that dim is: a value laid
        out [experts, tokens, ...] is the block [experts, ...] of each token's program."""
        value = self.traced.value(node)
        rows = self.row_dim(node)
        if rows is None:
            return tuple(value.shape)
        return tuple(value.shape[:rows]) + tuple(value.shape[rows + 1 :])

    def row_dim(self, node: fx.Node) -> int | None:
        """The dim of ``node``'s value that the programs' rows run along: its token dim, or for
        a value broadcast over the rows (:meth:`_over_rows`) its size-1 dim there; None for
        a value read whole."""
        batch = self.traced.batch_dims(node)
        if batch:
            return batch[0]
        if node not in self._over_rows_dims:
            self._over_rows_dims[node] = self._over_rows(node, self.traced.value(node))
        return self._over_rows_dims[node]

    def _over_rows(self, node: fx.Node, value) -> int | None:
        """The dim along which ``node``'s value (no token rows) is broadcast over the rows: a 1
        where the row values of its rank it is combined with have their tokens, or where a value
        of no rows computed from it in place (elementwise, or repeated along other dims) is
        broadcast so (cos sliced, then interleaved, then multiplied into q: one row dim for the
        three); a leading 1 at the region's rank; None when it is read whole."""
        if not isinstance(value, torch.Tensor) or not value.dim():
            return None
        for u in node.users:
            user_value = self.traced.value(u) if u in self.nodes else None
            if not isinstance(user_value, torch.Tensor) or user_value.dim() != value.dim():
                continue
            batch = self.traced.batch_dims(u)
            if batch and value.shape[batch[0]] == 1:
                return batch[0]
            if not batch and self._keeps_dims(u):
                rows = self.row_dim(u)
                if rows is not None and value.shape[rows] == 1:
                    return rows
        return 0 if value.shape[0] == 1 and value.dim() == self.row_rank else None

    def _keeps_dims(self, node: fx.Node) -> bool:
        """Is each dim of ``node``'s value its operands' dim in the same place (an elementwise
        op, or a repeat_interleave along one dim)?"""
        op = self.cops[node].op
        return ops.kind(op) == ops.POINTWISE or op == "repeat_interleave"

    def block_axes(self, cop: COp) -> list[int]:
        return [self.block_axis(cop.args[0], d) for d in cop.attr("dim")]

    def block_axis(self, node: fx.Node, dim: int) -> int:
        """Block axis of ``node``'s (full-rank) dim ``dim``: past its row dim (its token dim, or
        the unit dim it is broadcast over the rows along: :meth:`row_dim`), one less."""
        rows = self.row_dim(node)
        return dim - (1 if rows is not None and dim > rows else 0)

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
        return shape_literal(self.dim_codes(node), as_list)

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

    def fresh(self, node: fx.Node) -> str:
        """A local for ``node``'s value: called as its kernel argument is, if it is one; else
        as the pattern's reference calls it, else after the node."""
        reserved = self.reserved.pop(node, None)
        if reserved is not None:
            self.names[node] = reserved
        else:
            self.names[node] = self.local(self.reference_names.get(node, node.name), node in self.reference_names)
        return self.names[node]

    def local(self, base: str, numbered: bool = False) -> str:
        """A new local called ``base`` (``add_1``), or another name (:func:`fuser.lower.code.free_name`) when that
        one, or a companion of it (``add_1_re``, ``add_1_idx``, ...), is taken or is the frame's;
        ``numbered``: a reference's name, ``xf_1`` after ``xf``."""
        name = free_name(base, self.taken, numbered)
        self.taken.update(name + suffix for suffix in COMPANIONS)
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

    def masked(self, node: fx.Node, fill: str) -> str:
        mask = self.mask(node)
        value = self.f32(node)
        return f"tl.where({mask}, {value}, {fill})" if mask else value

    def lower_node(self, node: fx.Node):
        """Lower one op: complex pairs, concatenations and row gathers by their own rules
        (:func:`~fuser.lower.layout.pairs_and_parts`), index arithmetic in integers, a pointwise
        op by its expression, any other by the lowering its op-table entry names."""
        cop = self.cops[node]
        op, args = cop.op, cop.args
        entry = ops.TABLE.get(op)
        if entry is None:
            raise LoweringError(f"`{node.name}`: no row-program lowering for {op}")
        if op == "topk":  # a pair of values and indices, from a block never joined
            return lowering_for(entry)(self, node, cop)
        keeps_parts = op == "cast" or (op == "reshape" and moved_concatenation_axis(self, args[0], node) is not None)
        for arg in args:  # a concatenation read by anything but a cast, a store or a unit-axis move: one block
            if not keeps_parts and isinstance(arg, fx.Node) and isinstance(self.names.get(arg), Segments):
                self.names[arg] = joined(self, arg)
        special = entry.lowering == "pairs_and_parts" or any(
            isinstance(x, fx.Node) and isinstance(self.names.get(x), (tuple, Segments)) for x in args
        )
        if special:
            return pairs_and_parts(self, node, cop)
        if node in self.contracted:
            return  # built inside the sum that reads it (its ``reduce``)
        if entry.integer and self._on_integers(node, args):
            operands = [self.names[a] if isinstance(a, fx.Node) else repr(a) for a in args]
            dtype = self.traced.value(node).dtype
            return self.emit(node, ops.render(entry.integer, *operands), layout_only=dtype in INDEX_DTYPES)
        if op in EXPRESSIONS:
            self.helpers.update(entry.helpers)
            operands = [None if a is None else self.f32(a) for a in args]
            return self.emit(node, ops.render(EXPRESSIONS[op], *operands))
        return lowering_for(entry)(self, node, cop)

    def _on_integers(self, node: fx.Node, args) -> bool:
        """Index arithmetic, computed in integers: an integer result, or a comparison of integer
        tensors (positions past 2^24 compare exactly, as they would not in fp32)."""
        if self.traced.value(node).dtype in INDEX_DTYPES:
            return True
        tensors = [a for a in args if isinstance(a, fx.Node)]
        literals = [a for a in args if not isinstance(a, fx.Node)]
        return (
            self.traced.value(node).dtype == torch.bool and bool(tensors)
            and all(self.dtypes.get(a) in INDEX_DTYPES for a in tensors)
            and all(isinstance(a, int) and not isinstance(a, bool) for a in literals)
        )  # fmt: skip

    def lower(self, block_last: int | None = None) -> RowProgram:
        """The region's row program; a tiled one with ``block_last`` elements of the tiled axis
        a program (default: :meth:`tile_width`)."""
        names = operand_names(self.inputs + self.outputs, self.reference_names)
        ins = [self._operand(n, name) for n, name in zip(self.inputs, names)]
        outs = [self._operand(n, name) for n, name in zip(self.outputs, names[len(self.inputs) :])]
        for op, node in zip(outs, self.outputs):
            op.into = node in self.in_place
        if not self.rowless and not any(op.has_rows and not op.broadcast_rows and op.row_group for op in ins):
            # (An expand over the tokens of a value that does not follow them, the chain's last
            # op, is the reason: the chain is fused without it, and it stays a view.)
            spread = [n for n in self.outputs if self.cops[n].op == "expand" and self.traced.batch_dims(n)]
            raise LoweringError("no input of the chain follows the tokens: nothing gives its row count", *spread[:1])
        for op in ins + outs:  # no local may be called as a kernel argument is, but the argument's own
            self.taken.update([f"{op.name}_ptr", *op.stride_args, *(op.name + suffix for suffix in COMPANIONS)])
        self.reserved = dict(zip(self.inputs + self.outputs, names))
        self.contracted = contractions(self)
        values = [
            n for n in self.nodes + self.inputs
            if isinstance(self.traced.value(n), torch.Tensor)
            and n not in self.contracted and n not in self.gathered and n not in self.regathered
            and n not in self.spread_tables
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
        self.input_operands = ins
        for source, node in zip(ins, self.inputs):
            load(self, source, node)
        unstored = list(zip(outs, self.outputs))
        for node in self.nodes:
            if node in self.regathered or node in self.spread_tables:
                continue
            try:
                self.lower_node(node)
            except LoweringError as e:
                e.node = e.node or node
                raise
            unstored = store_fresh(self, node, unstored)
        for target, node in unstored:
            store(self, target, node)
        masks = [f"{name} = {expr}" for expr, name in self.masks.items()]
        self.lines = tidy(masks + without_node_echo(self.lines, self._renamed()))
        names = {self.cops[n].op for n in self.nodes}
        leading = self.tiled and self._leading
        per_warp = elements_per_warp(bool(names & ops.REDUCING), self.tiled, leading, names)
        helpers = tuple(sorted(self.helpers))
        scales = tuple(sorted({s for s in self.tile_scale.values() if s > 1})) if self.tiled else ()
        return RowProgram(
            ins, outs, self.lines, self.tiled, leading, self.last, self.block_last, warps_for(numel, per_warp),
            numel, helpers, scales, others, per_warp,
        )  # fmt: skip

    def _renamed(self) -> dict[str, str]:
        """node name -> its local, for each node whose local a pattern's reference named."""
        return {n.name: self.names[n] for n in self.reference_names if isinstance(self.names.get(n), str)}

    def tile_width(self, others: int) -> int:
        """Elements of the tiled axis a program takes, when each of them comes with ``others``
        elements of the other axes: about 2048 a program, at least 16 columns (heads by the one)."""
        return min(pow2(self.last), max(tile_floor(self._leading), pow2(max(1, 2048 // others))))

    def _operand(self, node: fx.Node, name: str) -> Operand:
        op = operand(self.traced, node, name)
        if not op.has_rows and self.block_shape(node) != op.shape:  # [1, N]: expanded over rows
            op = Operand(name, node.name, self.block_shape(node), op.dtype, True, broadcast_rows=True)
            op.row_dim = self.row_dim(node)
        if node in self.gathered or node in self.regathered:
            groups = [self.cops[g].attr("group") for g in self.nodes if self.cops[g].op == "group_rows"
                      and self.cops[self.cops[g].args[0]].args[1] is node]  # fmt: skip
            op.row_group = groups[0] if groups else 0
        return op


def lower_region(traced: Traced, cops, nodes, inputs, outputs, in_place=(), names=None) -> RowProgram:
    """Lower the region's nodes (in graph order) reading ``inputs`` and writing ``outputs``
    (those in ``in_place`` into a caller's buffer); ``names``: what a matched pattern's
    reference calls some of them (:attr:`fuser.regions.builder.Region.names`), for their locals."""
    if not outputs:
        raise LoweringError("the chain writes nothing a later op reads")
    for node in nodes:
        if cops[node].kind not in (COMPUTE, UNIT_VIEW):
            raise LoweringError(f"`{node.name}` ({cops[node].op}) is not an elementwise or reduction op")
    program = Lowerer(traced, cops, nodes, inputs, outputs, in_place, names).lower()
    if program.numel > TRITON_MAX_NUMEL:
        raise LoweringError(f"a {program.numel}-element block: Triton takes at most {TRITON_MAX_NUMEL} in one")
    if program.tiled:

        def body_at(width: int) -> list[str]:
            return Lowerer(traced, cops, nodes, inputs, outputs, in_place, names).lower(block_last=width).body

        program.widths = _launch_widths(program, body_at)
    return program


def _launch_widths(program: RowProgram, body_at) -> tuple[int, ...]:
    """The tile widths a launch of ``program`` may choose among (:func:`launch_widths`), or none
    when its body depends on the width: lowered at another width, it must read the same."""
    widths = launch_widths(program.block_last, program.others, program.leading)
    if len(widths) < 2:
        return ()
    return widths if body_at(widths[0]) == program.body else ()
