"""tiling: which axis of a row program is split across programs.

A row program runs one program per token row. When no op of the region mixes values along the
outputs' last axis, that axis is also split into tiles, one program each (a grid of rows x
tiles); else, when none mixes values along their first axis (the heads of a ``[T, heads, dim]``
value), that one is. The tiled axis is followed backwards from the outputs, through broadcasts,
reshapes that keep it, reductions over other axes and rows gathered per token, to the axis of
every value it is; a value read every other column (``x[..., ::2]``, GPT-OSS's interleaved gate
and up) is read a tile twice as wide. :func:`find_tiling` gives that map, or None when some op the
tiled axis reaches needs the whole axis in one program; one it does not reach (Llama-4's
router top-k, whose scores each tile of the hidden dim reads broadcast) is computed whole in
every tile.

How wide a tile is can wait until the launch, when the row count is known
(:func:`launch_widths`, :func:`launch_width`): a few rows want narrower tiles than the default
of about 2048 elements a program, so that enough programs run at once (on an H200, GPT-OSS's
last MoE kernel at T=1 in its layer: 2.4 µs at 64 columns against 3.4 at 512). Many rows keep
the default: wider tiles, faster on that kernel alone at T=512, were slower in the layer (7.4
against 6.6 µs at 1024 columns; Qwen3-MoE's 7.6 against 6.6).

The region is seen through its lowerer (:class:`fuser.lower.lowerer.Lowerer`): its ops, nodes,
outputs and the block shape of each value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from fuser.ir import ops
from fuser.canon.canonicalize import UNIT_VIEW, COp


@dataclass
class Tiling:
    size: int  # the tiled axis's length in the outputs
    leading: bool  # the first axis (heads) is tiled, not the last (columns)
    axis: dict[fx.Node, int | None]  # each value's tiled block axis (None: broadcast along it)
    scale: dict[fx.Node, int]  # how many tiles wide each value's tiled axis is read (1, or 2)


def find_tiling(lw) -> Tiling | None:
    """The tiling of the lowerer ``lw``'s region: its last axis, else its first; or None."""
    outs = [lw.block_shape(n) for n in lw.outputs]
    if not all(outs):
        return None
    for leading in (False, True):
        found = _tile(lw, outs, leading)
        if found is not None:
            return found
    return None


#: Programs a launch wants at least, when its tile can be narrowed to get them: about four per
#: SM of an H100 or H200 (132 SMs).
LAUNCH_PROGRAMS = 512
#: Fewest elements a program takes (one warp, eight a thread).
MIN_PROGRAM = 256


def pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def tile_floor(leading: bool) -> int:
    """The narrowest tile: one head, or 16 columns."""
    return 1 if leading else 16


def launch_widths(width: int, others: int, leading: bool) -> tuple[int, ...]:
    """The tile widths (powers of two, narrowest first) a launch may take for a tiled axis whose
    default tile is ``width``, each element of it coming with ``others`` elements of the other
    axes: from ``MIN_PROGRAM`` elements a program (and :func:`tile_floor`) up to ``width``."""
    narrowest = min(width, max(tile_floor(leading), pow2(MIN_PROGRAM // others)))
    return tuple(1 << b for b in range(narrowest.bit_length() - 1, width.bit_length()))


def launch_width(rows: int, size: int, widths: tuple[int, ...]) -> int:
    """The widest of ``widths`` that still gives ``LAUNCH_PROGRAMS`` programs over ``rows``
    rows of ``size`` elements, else the narrowest. (The kernel launchers inline this.)"""
    for width in reversed(widths):
        if rows * -(-size // width) >= LAUNCH_PROGRAMS:
            return width
    return widths[0]


def inserted_axes(src: tuple, dst: tuple) -> list[int] | None:
    """The axes (in order) where ``dst`` is ``src`` with size-1 dims inserted, else None."""
    axes, i = [], 0
    for axis, size in enumerate(dst):
        if i < len(src) and src[i] == size:
            i += 1
        elif size == 1:
            axes.append(axis)
        else:
            return None
    return axes if i == len(src) else None


def _tile(lw, outs: list[tuple[int, ...]], leading: bool) -> Tiling | None:
    """The tiling of the outputs' first axis (``leading``) or last, or None when it cannot be."""
    sizes = {s[0] if leading else s[-1] for s in outs}
    size = sizes.pop() if len(sizes) == 1 else 1
    if size <= 1 or (leading and any(len(s) < 2 for s in outs)):
        return None
    axis: dict[fx.Node, int | None] = {n: 0 if leading else len(shape) - 1 for n, shape in zip(lw.outputs, outs)}
    scale: dict[fx.Node, int] = {}
    for node in reversed(lw.nodes):
        mine = axis.setdefault(node, None)
        cop = lw.cops[node]
        if mine is not None and not leading and _needs_its_last_axis_whole(lw, node, cop):
            return None  # (one the tiled axis does not reach, broadcast along it, each tile computes whole)
        wide = scale.setdefault(node, 1)
        source_wide = wide * (2 if _halving(lw, node) else 1)
        for arg in cop.args:
            if not isinstance(arg, fx.Node):
                continue
            theirs = _arg_axis(lw, node, cop, arg, mine, size * wide)
            if theirs == "conflict" or axis.setdefault(arg, theirs) != theirs:
                return None
            if theirs is not None and scale.setdefault(arg, source_wide) != source_wide:
                return None  # read at two widths
    return Tiling(size, leading, axis, scale)


def _needs_its_last_axis_whole(lw, node: fx.Node, cop: COp) -> bool:
    """Does ``node`` read its block's last axis whole (a top-k, a scatter, a reshape that
    regroups it, complex values)?"""
    regrouped = cop.op == "reshape" and inserted_axes(lw.block_shape(cop.args[0]), lw.block_shape(node)) is None
    whole = cop.op in ops.WHOLE_BLOCK and not gathered_per_column(lw, node) and not _halving(lw, node)
    return whole or regrouped or _is_complex(lw.traced.value(node))


def _halving(lw, node: fx.Node) -> bool:
    """Every other column of the last axis (``x[..., ::2]``, ``x[..., 1::2]``): a tile of the
    result reads a tile twice as wide of its source (GPT-OSS's interleaved gate and up)."""
    cop = lw.cops[node]
    if cop.op != "slice" or cop.attr("step", 1) != 2:
        return False
    src, out = lw.block_shape(cop.args[0]), lw.block_shape(node)
    return bool(src) and len(src) == len(out) and src[-1] == 2 * out[-1] and cop.attr("start") in (0, 1)


def gathered_per_column(lw, node: fx.Node) -> bool:
    """Rows gathered per token (``group_rows``), the row gathers computed at them, and rows
    gathered one per token (a bias by expert id): a column of the result reads the same column
    of each row, so the columns may be tiled."""
    cop = lw.cops[node]
    if cop.op == "gather_rows":
        return node in lw.regathered or not lw.block_shape(cop.args[1])
    return cop.op == "group_rows"


def _arg_axis(lw, node, cop: COp, arg: fx.Node, mine, size):
    """Which axis of ``arg`` feeds the tiled axis ``mine`` of ``node`` (or "conflict")."""
    if mine is None:
        return None
    shape, src = lw.block_shape(node), lw.block_shape(arg)
    if gathered_per_column(lw, node):
        if arg is not cop.args[0]:
            return None  # the index: one position per row
        k = mine - 1 if cop.op == "group_rows" else mine + len(src) - len(shape)  # past [k], or a table's rows
        return k if 0 <= k < len(src) and src[k] == size else "conflict"
    if _halving(lw, node):
        return len(src) - 1 if mine == len(shape) - 1 and src[-1] == 2 * size else "conflict"
    kind = ops.kind(cop.op)
    if kind in (ops.REDUCTION, ops.NORMALIZATION) and arg is cop.args[0]:
        reduced = lw.block_axes(cop)
        if kind == ops.NORMALIZATION or cop.attr("keepdim"):
            k = mine
        else:
            kept = [i for i in range(len(src)) if i not in reduced]
            k = kept[mine]
        return "conflict" if k in reduced else k
    if cop.kind == UNIT_VIEW and cop.op == "reshape":
        before = sum(1 for s in shape[:mine] if s != 1)
        positions = [i for i, s in enumerate(src) if s != 1]
        return positions[before] if before < len(positions) and src[positions[before]] == size else "conflict"
    if cop.op in ("stack", "repeat_interleave"):
        # The axis they make (or repeat along) is never tiled; a stack's others shift past it.
        axis = lw.block_axis(node, cop.attr("dim"))
        if mine == axis:
            return "conflict"
        k = mine - 1 if cop.op == "stack" and mine > axis else mine
        return None if src[k] == 1 else k if src[k] == size else "conflict"
    if cop.op in ops.WHOLE_BLOCK or _is_complex(lw.traced.value(node)):
        # They work on the last axis (or pair it up); the leading axes line up from the left.
        if mine >= len(shape) - 1 or mine >= len(src) - 1:
            return "conflict"
        return None if src[mine] == 1 else mine if src[mine] == size else "conflict"
    k = mine - (len(shape) - len(src))  # elementwise, expand: numpy right-aligned broadcast
    if k < 0 or src[k] == 1:
        return None
    return k if src[k] == size else "conflict"


def _is_complex(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype.is_complex
