"""concat: a concatenation along the last axis computed by reading its parts again at remapped
columns (preferred to a one-hot sum in registers, which moves values across lanes; see
:func:`fuser.lower.layout.joined`).

Column ``c`` of ``cat([a, b, ...], -1)`` is column ``c - offset`` of the part that holds it.
Triton cannot index a block in registers, but it can load a tensor at any columns: where each
part is read from memory, or is an elementwise function of values read from memory (``-x``,
``q * cos + rotate_half(q) * sin``, a slice or another concatenation of such), the part is
computed again over the concatenation's columns, its loads taken at ``c - offset`` (masked to
the part's columns), and each column picks its part with a ``tl.where``. Values one column wide
(a norm's scale, a reduction kept with ``keepdim``) are the same at every column and are read
as they are. A part computed any other way (a reduction along the columns, a gather) cannot be
read at other columns: :func:`remapped` then gives None, and the caller refuses the
concatenation as before. Each function takes the lowerer
(:class:`fuser.lower.lowerer.Lowerer`) explicitly.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fuser.ir import ops
from fuser.lower.code import EXPRESSIONS, INDEX_DTYPES, expanded, rounded
from fuser.lower.memory import load_columns
from fuser.lower.tiling import inserted_axes


class _NotRemappable(Exception):
    """A value on the way to a part cannot be computed at other columns."""


def remapped(lw, node: fx.Node) -> str | None:
    """The local holding ``node`` (a concatenation along the last axis, or a cast or unit-axis
    move of one) as one block, each part computed again at its columns; None when a part
    cannot be (the lines written on the way are dropped then)."""
    width = lw.padded(node)[-1]
    lines = len(lw.lines)
    try:
        value, dtype = _at(lw, node, 0, width, {})
    except _NotRemappable:
        del lw.lines[lines:]
        return None
    return value if dtype in (torch.float32, torch.bool) else f"{value}.to(tl.float32)"


def shifted(lw, node: fx.Node, shift: int, width: int) -> str | None:
    """``node``'s value at columns ``c + shift`` for ``c`` in ``[0, width)`` (zero where it has
    no column), in fp32, each value on its way computed again there (a padded value's source);
    None when one cannot be (the lines written on the way are dropped then)."""
    lines = len(lw.lines)
    try:
        value, dtype = _at(lw, node, shift, width, {})
    except _NotRemappable:
        del lw.lines[lines:]
        return None
    return value if dtype in (torch.float32, torch.bool) else f"{value}.to(tl.float32)"


def _at(lw, node: fx.Node, shift: int, width: int, done: dict) -> tuple[str, torch.dtype]:
    """(local, dtype) of ``node``'s value at columns ``c + shift`` for ``c`` in ``[0, width)``
    (its other axes as they are); a value one column wide, as it is."""
    shape = lw.block_shape(node)
    rank = len(shape)
    if node in lw.names and isinstance(lw.names[node], str) and (not shape or shape[-1] == 1):
        return lw.names[node], lw.dtypes[node]  # the same at every column
    if (node, shift) in done:
        return done[(node, shift)]
    value = lw.traced.value(node)
    if (
        not isinstance(value, torch.Tensor) or value.dtype.is_complex or value.dtype in INDEX_DTYPES
        or not shape or lw.is_tiled(node, rank - 1)
    ):  # fmt: skip
        raise _NotRemappable
    cols = expanded(f"tl.arange(0, {width})", rank - 1, rank)
    if shift:
        cols = f"({cols} {'-' if shift < 0 else '+'} {abs(shift)})"
    if node in lw.inputs:
        found = _load(lw, node, cols, shift)
    elif node in lw.nodes and node not in lw.contracted:
        found = _computed(lw, node, shift, width, cols, done)
    else:
        raise _NotRemappable
    done[(node, shift)] = found
    return found


def _load(lw, node: fx.Node, cols: str, shift: int) -> tuple[str, torch.dtype]:
    if node in lw.gathered or node in lw.regathered:
        raise _NotRemappable
    operand = lw.input_operands[lw.inputs.index(node)]
    if operand.complex:
        raise _NotRemappable
    name = lw.local(f"{node.name}_cols", numbered=True)
    load_columns(lw, node, name, operand, cols, lw.block_shape(node)[-1], may_be_negative=shift < 0)
    return name, operand.dtype


def _computed(lw, node: fx.Node, shift: int, width: int, cols: str, done: dict) -> tuple[str, torch.dtype]:
    """An op of the region at other columns: pointwise ops and casts over their operands at those
    columns; a slice (step 1) and a concatenation by shifting the columns they read; a
    broadcast or a move of size-1 axes as the same move; a constant as itself."""
    cop = lw.cops[node]
    op, args = cop.op, cop.args
    dtype = lw.traced.value(node).dtype
    rank = len(lw.block_shape(node))

    def operand(arg, at: int = shift) -> str | None:
        if not isinstance(arg, fx.Node):
            return None if arg is None else lw.f32(arg)
        local, arg_dtype = _at(lw, arg, at, width, done)
        return local if arg_dtype in (torch.float32, torch.bool) else f"{local}.to(tl.float32)"

    def line(expr: str, result: torch.dtype = dtype) -> tuple[str, torch.dtype]:
        name = lw.local(f"{node.name}_cols", numbered=True)
        lw.lines.append(f"{name} = {expr}  # {node.name} (columns remapped)")
        return name, result

    if op in EXPRESSIONS:
        entry = ops.TABLE[op]
        if entry.integer and lw._on_integers(node, args):
            raise _NotRemappable
        lw.helpers.update(entry.helpers)
        operands = [operand(a) for a in args]
        expr = ops.render(EXPRESSIONS[op], *operands)
        return line(expr if dtype in (torch.float32, torch.bool) else rounded(expr, dtype))
    if op == "cast":
        src = args[0]
        value, source = operand(src), _dtype_at(lw, src)
        if dtype == torch.bool and source != torch.bool:
            value = f"({value} != 0)"
        elif source == torch.bool and dtype != torch.bool:
            value = f"{value}.to(tl.float32)"
        return line(value if dtype in (torch.float32, torch.bool) else rounded(value, dtype))
    if op == "slice" and cop.attr("step", 1) == 1:
        return _at(lw, args[0], shift + cop.attr("start"), width, done)
    if op == "cat":
        return line(_picked(lw, node, shift, width, cols, operand), torch.float32)
    if op == "full":
        value = lw.traced.value(node)
        shape = lw.dim_codes(node)[:-1] + [str(width)]
        if value.dtype == torch.bool:
            return line(f"tl.full([{', '.join(shape)}], {int(bool(cop.attr('value')))}, tl.int1)")
        return line(f"tl.full([{', '.join(shape)}], {lw.f32(float(cop.attr('value')))}, tl.float32)", torch.float32)
    if op in ("reshape", "expand") and isinstance(args[0], fx.Node):
        return _moved(lw, node, cop, _at(lw, args[0], shift, width, done), width, line)
    raise _NotRemappable


def _dtype_at(lw, node) -> torch.dtype:
    value = lw.traced.value(node) if isinstance(node, fx.Node) else None
    return value.dtype if isinstance(value, torch.Tensor) else torch.float32


def _picked(lw, node: fx.Node, shift: int, width: int, cols: str, operand) -> str:
    """A concatenation's columns ``c + shift``: each from its part, read ``offset`` columns
    to the left; zero past the last."""
    expr, offset, spans = "0.0", 0, []
    for part in lw.cops[node].args:
        size = lw.block_shape(part)[-1]
        spans.append((part, offset, size))
        offset += size
    values = [operand(part, shift - offset) for part, offset, _ in spans]
    for (_, offset, size), value in reversed(list(zip(spans, values))):
        inside = f"({cols} >= {offset}) & ({cols} < {offset + size})" if offset else f"({cols} < {size})"
        expr = f"tl.where({inside}, {value}, {expr})"
    return expr


def _moved(lw, node: fx.Node, cop, source: tuple[str, torch.dtype], width: int, line) -> tuple[str, torch.dtype]:
    """A broadcast, or a reshape that only moves size-1 axes, of a value (``source``, its local
    and dtype) at other columns."""
    local, dtype = source
    before, after = lw.block_shape(cop.args[0]), lw.block_shape(node)
    shape = f"({', '.join(lw.dim_codes(node)[:-1] + [str(width)])},)"
    if cop.op == "expand":
        return line(f"tl.broadcast_to({local}, {shape})", dtype)
    if not before or before[-1] != after[-1]:
        raise _NotRemappable
    inserted = inserted_axes(before, after)
    if inserted is not None:  # unsqueeze: a broadcast, as the lowering of the op itself
        for axis in inserted:
            local = f"tl.expand_dims({local}, {axis})"
        return line(local, dtype)
    if [s for s in before if s != 1] != [s for s in after if s != 1] or any(
        lw.is_tiled(node, a) for a in range(len(after))
    ):
        raise _NotRemappable
    return line(f"tl.reshape({local}, {shape})", dtype)
