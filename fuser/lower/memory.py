"""memory: how a row program reads its operands and writes its outputs. A block is loaded
through the operand's runtime strides (a complex value's trailing pair split into re and im),
and stored rounded to the output's dtype; a concatenation is stored part by part, and an output
the kernel allocates as soon as it is computed. Each function takes the lowerer
(:class:`fuser.lower.lowerer.Lowerer`) explicitly."""

from __future__ import annotations

import torch
import torch.fx as fx

from fuser.lower.code import LoweringError, Segments, expanded, pair_index, rounded
from fuser.lower.row_program import Operand
from fuser.lower.tiling import pow2


def load(lw, operand: Operand, node: fx.Node):
    if node in lw.gathered or node in lw.regathered:
        return
    row = f"row * {operand.name}_stride_row" if operand.has_rows else None
    emit_load(lw, node, lw.fresh(node), operand, row)


def emit_load(lw, node: fx.Node, name: str, operand: Operand, row: str | None, first_stride: int = 0):
    """``name = tl.load(...)`` of ``node``'s block from ``operand``: ``row`` offsets the
    pointer to this token's row; block dim i uses stride ``first_stride + i``."""
    shape = operand.shape
    rank = len(shape) + (1 if operand.complex else 0)
    terms = [f"{operand.name}_ptr"] + ([row] if row else [])
    for axis in range(len(shape)):
        terms.append(f"{lw.axis_index(node, axis, rank)} * {operand.name}_stride_{first_stride + axis}")
    if operand.complex:
        terms.append(f"{pair_index(rank)} * {operand.name}_stride_{first_stride + len(shape)}")
    mask = lw.mask(node)
    if mask and operand.complex:
        mask = f"({mask})[..., None]" if len(shape) else None
    extra = f", mask={mask}, other=0.0" if mask else ""
    lw.lines.append(f"{name} = tl.load({' + '.join(terms)}{extra})  # {node.name}")
    lw.names[node] = name
    _finish_pair_load(lw, node, name, operand)


def load_columns(lw, node: fx.Node, name: str, operand: Operand, cols: str, width: int, may_be_negative: bool):
    """``name = tl.load(...)`` of ``node``'s block at columns ``cols`` (an index along its last
    axis, any block width, ``width`` columns real) instead of its own: the other axes as
    :func:`emit_load` reads them, the columns outside ``[0, width)`` masked (a concatenation's
    part read at the concatenation's columns, :mod:`fuser.lower.concat`)."""
    rank = len(operand.shape)
    terms = [f"{operand.name}_ptr"] + ([f"row * {operand.name}_stride_row"] if operand.has_rows else [])
    masks = []
    for axis, size in enumerate(operand.shape[:-1]):
        index = lw.axis_index(node, axis, rank)
        terms.append(f"{index} * {operand.name}_stride_{axis}")
        if lw.is_tiled(node, axis) or pow2(size) != size:
            masks.append(f"({index} < {size})")
    terms.append(f"{cols} * {operand.name}_stride_{rank - 1}")
    masks += ([f"({cols} >= 0)"] if may_be_negative else []) + [f"({cols} < {width})"]
    lw.lines.append(f"{name} = tl.load({' + '.join(terms)}, mask={' & '.join(masks)}, other=0.0)  # {node.name}")


def _finish_pair_load(lw, node, name, operand):
    lw.dtypes[node] = operand.dtype
    if operand.complex:
        lw.lines.append(f"{name}_re, {name}_im = tl.split({name})")
        lw.names[node] = (f"{name}_re", f"{name}_im")


def store(lw, operand: Operand, node: fx.Node):
    value = lw.names[node]
    if isinstance(value, Segments):
        return _store_segments(lw, operand, node, value)
    shape = operand.shape
    rank = len(shape) + (1 if operand.complex else 0)
    terms = [f"{operand.name}_ptr"] + ([f"row * {operand.name}_stride_row"] if operand.has_rows else [])
    for axis in range(len(shape)):
        terms.append(f"{lw.axis_index(node, axis, rank)} * {operand.name}_stride_{axis}")
    mask = lw.mask(node)
    if operand.complex:
        terms.append(f"{pair_index(rank)} * {operand.name}_stride_{len(shape)}")
        value = f"tl.join({value[0]}, {value[1]})"
        mask = f"({mask})[..., None]" if mask and len(shape) else None
    extra = f", mask={mask}" if mask else ""
    source = torch.float32 if operand.complex else lw.dtypes[node]
    target = torch.float32 if operand.complex else operand.dtype
    lw.lines.append(f"tl.store({' + '.join(terms)}, {rounded(value, target, source)}{extra})")


def _store_segments(lw, operand: Operand, node: fx.Node, segments: "Segments"):
    """A concatenation along one axis (the last, or where unit axes moved it): each part stored
    at its offset along that axis."""
    rank = len(operand.shape)
    along = rank + segments.axis
    if lw.is_tiled(node, along):
        raise LoweringError(f"`{node.name}`: a concatenation along its tiled axis")
    others = [a for a in range(rank) if a != along]
    for offset, part, width, dtype in segments.parts:
        terms = [f"{operand.name}_ptr"] + ([f"row * {operand.name}_stride_row"] if operand.has_rows else [])
        for axis in others:
            terms.append(f"{lw.axis_index(node, axis, rank)} * {operand.name}_stride_{axis}")
        cols = expanded(f"tl.arange(0, {pow2(width)})", along, rank)
        terms.append(f"({cols} + {offset}) * {operand.name}_stride_{along}")
        masks = [
            f"({lw.axis_index(node, a, rank)} < {operand.shape[a]})"
            for a in others
            if pow2(operand.shape[a]) != operand.shape[a] or lw.is_tiled(node, a)
        ]  # fmt: skip
        if pow2(width) != width:
            masks.append(f"({cols} < {width})")
        extra = f", mask={' & '.join(masks)}" if masks else ""
        lw.lines.append(f"tl.store({' + '.join(terms)}, {rounded(part, operand.dtype, dtype)}{extra})")


def store_fresh(lw, node: fx.Node, unstored: list) -> list:
    """Store ``node`` where it is computed when it is an output the kernel allocates (so its
    registers are free for the rest of the body); one written into a caller's buffer is
    stored last, after every read of that buffer."""
    if node in lw.in_place or node not in lw.names:
        return unstored
    for target, output in unstored:
        if output is node:
            store(lw, target, node)
    return [(target, output) for target, output in unstored if output is not node]
