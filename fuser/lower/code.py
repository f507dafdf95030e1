"""code: what every part of the row-program lowerer (:mod:`fuser.lower.lowerer`) writes with:
its error, the Triton expression of each pointwise op, PyTorch's rounding, block shapes and
indices as code, and the names of the kernel's locals and arguments."""

from __future__ import annotations

import builtins
import itertools
import keyword
import re
from dataclasses import dataclass

import torch
import torch.fx as fx

from fuser.ir import ops
from fuser.lower.row_program import TL_DTYPES


class LoweringError(Exception):
    """The region cannot be written as one row program; the message says which node and why,
    ``node`` is that node (when one op is the reason)."""

    def __init__(self, message: str, node: fx.Node | None = None):
        super().__init__(message)
        self.node = node


# The Triton expression of every pointwise op (fuser.ir.ops), by name, read at lowering time.
EXPRESSIONS = {name: op.triton for name, op in ops.TABLE.items() if op.kind == ops.POINTWISE and op.triton}

# Integer values a row program carries: top-k indices and the indices a gather reads.
INDEX_DTYPES = {torch.int64: "tl.int64", torch.int32: "tl.int32"}


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


# A product summed over a short axis (at most CONTRACT_AXIS long) whose block is larger than
# CONTRACT_ABOVE elements is never built: the sum runs over the axis, one slice at a time.
CONTRACT_ABOVE = 4096
CONTRACT_AXIS = 16
# Largest block (elements) an unaligned slice may spread into a one-hot sum.
ONE_HOT_LIMIT = 1 << 16


@dataclass
class Segments:
    """A value concatenated along one axis of its block (``axis``, counted from the end: the last
    unless unit axes moved past it since): (offset, expression, width, dtype) parts."""

    parts: list[tuple[int, str, int, torch.dtype]]
    axis: int = -1


def shape_literal(dims: list[str], as_list: bool = False) -> str:
    """A block shape written as ``str`` writes a tuple (or a list) of ints, from its dims' code."""
    if as_list:
        return f"[{', '.join(dims)}]"
    return f"({', '.join(dims)}{',' if len(dims) == 1 else ''})"


def expanded(base: str, axis: int, rank: int) -> str:
    if rank == 1:
        return base
    return f"{base}[{', '.join(':' if i == axis else 'None' for i in range(rank))}]"


def selected(condition: str, value: str, axis: int) -> str:
    """The value where ``condition`` holds, summed over ``axis``: how a block in registers is
    indexed (Triton cannot index one) when the condition holds once along that axis."""
    return f"tl.sum(tl.where({condition}, {value}, 0.0), axis={axis})"


def pair_index(rank: int) -> str:
    return expanded("tl.arange(0, 2)", rank - 1, rank)



def operand_names(nodes: list[fx.Node], reference_names: dict[fx.Node, str] | None = None) -> list[str]:
    """The kernel's name for each node it reads or writes: the name a matched pattern's
    reference gives it (``gate_up``), else the node's own (``residual``, so the arguments read
    ``residual_ptr``, ``residual_stride_row``), unless another operand or the frame has it."""
    reference_names = reference_names or {}
    names: list[str] = []
    for node in nodes:
        base = reference_names.get(node, node.name)
        names.append(free_name(base, set(names), numbered=node in reference_names))
    return names


def free_name(base: str, taken: set[str], numbered: bool = False) -> str:
    """``base``, or ``v_<base>``, or ``v_<base>_<n>``: the first that is free (:func:`_free`).

    ``numbered`` (a name from a pattern's reference, which one variable may give several
    values: rmsnorm's ``xf`` before and after it is scaled, or two matches in one kernel):
    ``base``, ``base_1``, ``base_2``, ... instead, after ``v_`` where ``base`` itself never is
    free (a keyword, a builtin, a name of the frame)."""
    if numbered:
        stem = base if _free(base, set()) else f"v_{base}"
        candidates = itertools.chain([stem], (f"{stem}_{n}" for n in itertools.count(1)))
    else:
        candidates = itertools.chain([base, f"v_{base}"], (f"v_{base}_{n}" for n in itertools.count(1)))
    return next(c for c in candidates if _free(c, taken))


# What a local's name may be followed by, for the values that come with it (a complex value's
# parts, a top-k's values and indices, a gather's row index, an argmax's ranks).
COMPANIONS = ("", "_re", "_im", "_even", "_odd", "_key", "_val", "_idx", "_rank", "_best", "_pairs")
# Names a kernel module already uses: the frame's (row, tile, helpers, modules, the launcher's
# locals), the masks and the loops' locals.
_FRAME_NAME = re.compile(r"(row|tile\d*|tl|triton|torch|os|math|to_bf16|to_e4m3|expm1_f32|tanh_f32"
                         r"|BLOCK_TILE|n_rows|block_tile|num_warps|launch|mask\d+|_.*)$")  # fmt: skip


def _free(name: str, taken: set[str]) -> bool:
    """May a local be called ``name``: not a Python keyword or builtin, not a name of the
    kernel's frame, and neither it nor a companion of it taken?"""
    if keyword.iskeyword(name) or name in dir(builtins) or _FRAME_NAME.match(name):
        return False
    return not any(name + suffix in taken for suffix in COMPANIONS)


def without_node_echo(lines: list[str], renamed: dict[str, str]) -> list[str]:
    """``lines`` without the comment naming the graph node a line assigns, where the line's local
    is the name a pattern's reference gives that node (``renamed``: node name -> local):
    ``g = ...  # clamp`` reads ``g = ...``, as ``clamp = ...  # clamp`` would after
    :func:`fuser.lower.tidy.without_echo`."""
    kept = []
    for line in lines:
        code, _, comment = line.partition("  # ")
        local = renamed.get(comment)
        kept.append(code if local is not None and code.startswith(f"{local} = ") else line)
    return kept
