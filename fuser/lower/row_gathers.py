"""row_gathers: rows a row program reads at positions its values give (a gathered table), and
rows grouped k to a program (each token's expert rows): a value of the table is computed at
the gathered rows, as at its own. The lowerer (:class:`fuser.lower.lowerer.Lowerer`) asks
which of its values are read only so (:func:`gathered_only`, :func:`regathered_values`); each
function takes it explicitly."""

from __future__ import annotations

import torch
import torch.fx as fx

from fuser.ir import ops
from fuser.canon.canonicalize import UNIT_VIEW, COp
from fuser.lower.code import EXPRESSIONS, INDEX_DTYPES, LoweringError, expanded, rounded
from fuser.lower.row_program import Operand
from fuser.lower.memory import emit_load
from fuser.lower.registry import lowering
from fuser.lower.tiling import inserted_axes, pow2


def gathered_only(lw, node: fx.Node) -> bool:
    """Is input ``node`` a table read only a row at a time (by row gathers, or spread over the
    tokens only for ``gather_table`` to read)?"""
    uses = [u for u in node.users if u in lw.nodes]
    return bool(uses) and all(
        (lw.cops[u].op == "gather_rows" and lw.cops[u].args[0] is node and lw.cops[u].args[1] is not node)
        or u in lw.spread_tables
        for u in uses
    )


def spread_tables(lw) -> set[fx.Node]:
    """Tables that do not follow the tokens spread over them (a broadcast repeat of an input)
    that only ``gather_table`` reads: never built, the gather reads the input's rows."""
    found = set()
    for node in lw.nodes:
        cop = lw.cops[node]
        if cop.op != "repeat" or not cop.attr("broadcast") or cop.args[0] not in lw.inputs or node in lw.outputs:
            continue
        uses = [lw.cops[u] for u in node.users if u in lw.nodes]
        if uses and len(uses) == len(node.users) and all(c.op == "gather_table" and c.args[0] is node for c in uses):
            found.add(node)
    return found


@lowering("gather_table")
def gather_table(lw, node: fx.Node, cop: COp):
    """``torch.gather(table spread over the tokens, 1, position spread along the columns)``: the
    row of the table at this token's position, loaded into the node's block (unit axes in
    front of the table's row)."""
    spread, index = cop.args
    table = lw.cops[spread].args[0]
    operands = dict(zip(lw.inputs, lw.input_operands))
    if spread not in lw.spread_tables or table not in operands:
        raise LoweringError(f"`{node.name}`: a table gather must read its table directly", node)
    position = _position(lw, index)
    t, name = operands[table], lw.fresh(node)
    shape, rank = lw.block_shape(node), len(lw.block_shape(node))
    row = t.shape[1:]
    lead = rank - len(row)
    if lead < 0 or any(s != 1 for s in shape[:lead]) or len(lw.block_shape(position)) > rank:
        raise LoweringError(f"`{node.name}`: one row of the table per token is gathered into a {shape} block", node)
    lw.lines.append(f"{name}_idx = {_wrapped(lw.names[position], str(t.shape[0]))}  # {position.name}")
    terms = [f"{t.name}_ptr", f"{name}_idx * {t.name}_stride_0"]
    terms += [f"{lw.axis_index(node, lead + a, rank)} * {t.name}_stride_{a + 1}" for a in range(len(row))]
    mask = lw.mask(node)
    extra = f", mask={mask}, other=0.0" if mask else ""
    lw.lines.append(f"{name} = tl.load({' + '.join(terms)}{extra})  # {node.name}")
    lw.names[node], lw.dtypes[node] = name, t.dtype


def _position(lw, index: fx.Node) -> fx.Node:
    """The value of one position per token that ``index`` spreads (broadcast repeats, expands
    and unit-axis reshapes looked through), as lowered or loaded here."""
    node = index
    while not (node in lw.names and all(s == 1 for s in lw.block_shape(node))):
        cop = lw.cops.get(node)
        if node not in lw.nodes or cop.op not in ("repeat", "expand", "reshape") or not isinstance(cop.args[0], fx.Node):
            raise LoweringError(f"`{index.name}`: a table gather's index must be one position per token", index)
        if cop.op == "repeat" and not cop.attr("broadcast"):
            raise LoweringError(f"`{index.name}`: a table gather's index must be one position per token", index)
        node = cop.args[0]
    return node


def regathered_values(lw) -> set[fx.Node]:
    """Values of another row count that a ``group_rows`` reads at gathered rows: its gather,
    the gather's index and the gathered table with what computes it, never lowered at this
    program's row (:func:`group_rows` computes them at the rows it gathers)."""
    found = set()
    for node in lw.nodes:
        if lw.cops[node].op != "group_rows":
            continue
        gather = lw.cops[node].args[0]
        if gather not in lw.nodes or [u for u in gather.users if u in lw.nodes] != [node]:
            raise LoweringError(f"`{node.name}`: its rows' gather must be in the kernel and read by it alone", node)
        table, index = lw.cops[gather].args
        found |= {gather, index} | _table_values(lw, table)
    for node in found & set(lw.nodes + lw.inputs):
        outside = [u for u in node.users if u in lw.nodes and u not in found and lw.cops[u].op != "group_rows"]
        if outside or node in lw.outputs:
            raise LoweringError(f"`{node.name}` is read at gathered rows and at this program's row", node)
    return found


def _table_values(lw, table: fx.Node) -> set[fx.Node]:
    """``table`` and the kernel's nodes that compute it (pointwise, casts, unit axes, row
    gathers with the tables they read)."""
    found, todo = set(), [table]
    while todo:
        node = todo.pop()
        if node in found:
            continue
        found.add(node)
        if node not in lw.nodes:
            continue
        cop = lw.cops[node]
        if cop.op == "gather_rows":  # its table is read at the rows its index names there
            found.add(cop.args[0])
            todo.append(cop.args[1])
        elif ops.kind(cop.op) == ops.POINTWISE or (cop.op == "reshape" and cop.kind == UNIT_VIEW):
            todo += [a for a in cop.args if isinstance(a, fx.Node)]
        else:
            raise LoweringError(f"`{node.name}` ({cop.op}) cannot be computed at gathered rows", node)
    return found


def gather_rows(lw, node: fx.Node, name: str, table: fx.Node, index: fx.Node):
    """``table[index]``: the row of ``table`` this program's index names. The table is read
    from memory (an input); the index may be computed here (``perm // top_k``)."""
    operands = {n: op for n, op in zip(lw.inputs, lw.input_operands)}
    if table not in operands:
        raise LoweringError(f"`{node.name}`: a row gather must read its table directly")
    t = operands[table]
    shape, first, count, stride_row = _table_rows(t)
    lw.lines.append(f"{name}_idx = {_wrapped(lw.names[index], count)}  # {index.name}")
    gathered = Operand(t.name, table.name, shape, t.dtype, True)
    emit_load(lw, node, name, gathered, f"{name}_idx * {stride_row}", first_stride=first)


@lowering("group_rows")
def group_rows(lw, node: fx.Node, cop: COp):
    """``table[index].view(T, k, ...)``: this token's k rows of the gather, each computed
    from the table's inputs loaded at the row its index names (``index[row * k + j]``)."""
    gather = cop.args[0]
    table, index = lw.cops[gather].args
    operands = dict(zip(lw.inputs, lw.input_operands))
    if index not in operands or lw.block_shape(index):
        raise LoweringError(f"`{node.name}`: the gather's index must be an input of one position per row", node)
    k = cop.attr("group")
    name = lw.fresh(node)
    i = operands[index]
    picks = f"tl.arange(0, {pow2(k)})"
    lw.lines.append(
        f"{name}_rows = tl.load({i.name}_ptr + (row * {k} + {picks}) * {i.name}_stride_row, mask={picks} < {k}, other=0)"
        f"  # {index.name}, {k} per token"
    )
    at_rows = _AtRows(lw, f"{name}_rows", k, operands)
    if lw.cops[index].op == "inverse_permutation":  # rows inv[i]: a gather through perm there reads perm[inv[i]] = i
        at_rows.inverts = (lw.cops[index].args[0], f"(row * {k} + {picks})")
    lw.lines.append(f"{name} = {at_rows.value(table)}  # {node.name}")
    lw.names[node] = name
    lw.dtypes[node] = at_rows.dtypes[table]


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

    def __init__(self, lowerer, rows: str, k: int, operands: dict):
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
        picks = expanded(f"tl.arange(0, {pow2(self.k)})", 0, rank)
        at = _wrapped(rows or self.rows, count)
        terms = [f"{operand.name}_ptr", f"{expanded(f'({at})', 0, rank)} * {stride_row}"]
        masks = [f"({picks} < {self.k})"]
        for axis, size in enumerate(shape):
            tiled = self.lowerer.is_tiled(node, axis)
            index = expanded(self.lowerer.tile_name(node) if tiled else f"tl.arange(0, {pow2(size)})", axis + 1, rank)
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
        if cop.op not in EXPRESSIONS:
            raise LoweringError(f"`{node.name}`: {cop.op} is not computed at gathered rows", node)
        operands = []
        for arg in cop.args:
            expr = self.f32(arg) if arg is not None else None
            if isinstance(arg, fx.Node):  # numpy broadcasting aligns the trailing dims: pad after the rows' axis
                for _ in range(rank - 1 - len(self.lowerer.block_shape(arg))):
                    expr = f"tl.expand_dims({expr}, 1)"
            operands.append(expr)
        self.lowerer.helpers.update(entry.helpers)
        expr = ops.render(EXPRESSIONS[cop.op], *operands)
        return self._line(node, expr if dtype in (torch.float32, torch.bool) else rounded(expr, dtype), dtype)
