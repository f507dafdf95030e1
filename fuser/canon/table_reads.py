"""table_reads: ``torch.gather`` of a table that does not follow the tokens, spread over them
by a repeat (GPT-J's ``embed_positions.repeat(T, 1, 1)``), at positions spread along its
columns (``position_ids.unsqueeze(-1).repeat(1, 1, width)``): each token's row of the table at
its position, ``gather_table``. A function of :func:`fuser.canon.views.gather`'s, taking the
canonicaliser (:class:`fuser.canon.canonicalize.Canonicalizer`) explicitly."""

from __future__ import annotations

import torch
import torch.fx as fx

from fuser.ir.canonical_op import COMPUTE, KERNEL_DTYPES, COp

_SPREADS = ("repeat", "expand", "reshape")


def gather_of_spread_table(cz, node: fx.Node, x: fx.Node, dim: int, index: fx.Node) -> COp | None:
    """``gather_table(x, index)`` when ``torch.gather(x, dim, index)`` reads, per token, one row of
    a table at one position: ``x`` is [tokens, *table.shape], the same table at every token (a
    broadcast repeat of it), ``dim`` the table's rows, and ``index`` [tokens, 1, *table.shape[1:]],
    the same position along every column (a broadcast of one position per token). None otherwise."""
    spread = cz.cops.get(x)
    if spread is None or spread.op != "repeat" or not spread.attr("broadcast") or not isinstance(spread.args[0], fx.Node):
        return None
    table = spread.args[0]
    src, values, idx = cz.value(table), cz.value(x), cz.value(index)
    if (
        not src.dim() or cz.batch_dims(table) or cz.batch_dims(x) != (0,) or tuple(values.shape[1:]) != tuple(src.shape)
        or src.dtype not in KERNEL_DTYPES or src.is_complex() or dim % values.dim() != 1
        or idx.dtype not in (torch.int64, torch.int32) or cz.batch_dims(index) != (0,)
        or tuple(idx.shape[1:]) != (1, *src.shape[1:])
    ):  # fmt: skip
        return None
    if per_row_position(cz, index) is None:
        return None
    return cz.make(node, "gather_table", COMPUTE, (x, index))


def per_row_position(cz, index: fx.Node) -> fx.Node | None:
    """The value ``index`` broadcasts, when it is one position per token (every other dim 1),
    spread by broadcast repeats, expands and unit-axis reshapes; None otherwise."""
    node = index
    while True:
        value = cz.value(node)
        if cz.batch_dims(node) == (0,) and all(s == 1 for s in value.shape[1:]):
            return node
        cop = cz.cops.get(node)
        if cop is None or cop.op not in _SPREADS or not isinstance(cop.args[0], fx.Node):
            return None
        if cop.op == "repeat" and not cop.attr("broadcast"):
            return None
        node = cop.args[0]
