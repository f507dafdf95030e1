"""table_reads: ``torch.gather`` of a table that does not follow the tokens, spread over them
by a repeat (GPT-J's ``embed_positions.repeat(T, 1, 1)``), at positions spread along its
columns (``position_ids.unsqueeze(-1).repeat(1, 1, width)``): each token's row of the table at
its position, ``gather_table``; or, where the position ids are one position for every sequence
(``[1, 1]``: a decode step's ``cache_position[None]``), the table repeated once and gathered
there: one row that every token reads. A function of :func:`fuser.canon.views.gather`'s,
taking the canonicaliser (:class:`fuser.canon.canonicalize.Canonicalizer`) explicitly."""

from __future__ import annotations

import torch
import torch.fx as fx

from fuser.ir.canonical_op import COMPUTE, KERNEL_DTYPES, COp

_SPREADS = ("repeat", "expand", "reshape")


def gather_of_spread_table(cz, node: fx.Node, x: fx.Node, dim: int, index: fx.Node) -> COp | None:
    """``gather_table(x, index)`` when ``torch.gather(x, dim, index)`` reads, per token, one row of
    a table at one position: ``x`` is [tokens, *table.shape], the same table at every token (a
    broadcast repeat of it), ``dim`` the table's rows, and ``index`` [tokens, 1, *table.shape[1:]],
    the same position along every column (a broadcast of one position per token); or ``x`` and
    ``index`` follow no tokens and have one in their place (one position for all). None
    otherwise."""
    spread = cz.cops.get(x)
    if spread is None or spread.op != "repeat" or not spread.attr("broadcast") or not isinstance(spread.args[0], fx.Node):
        return None
    table = spread.args[0]
    src, values, idx = cz.value(table), cz.value(x), cz.value(index)
    if (
        not src.dim() or cz.batch_dims(table) or tuple(values.shape[1:]) != tuple(src.shape)
        or cz.batch_dims(x) not in ((0,), ()) or cz.batch_dims(index) != cz.batch_dims(x)
        or (not cz.batch_dims(x) and values.shape[0] != 1)
        or src.dtype not in KERNEL_DTYPES or src.is_complex() or dim % values.dim() != 1
        or idx.dtype not in (torch.int64, torch.int32)
        or tuple(idx.shape[1:]) != (1, *src.shape[1:])
    ):  # fmt: skip
        return None
    if per_row_position(cz, index) is None:
        return None
    return cz.make(node, "gather_table", COMPUTE, (x, index))


def per_row_position(cz, index: fx.Node) -> fx.Node | None:
    """The value ``index`` broadcasts, when it is one position per token (every other dim 1) or
    one for all (every dim 1), spread by broadcast repeats, expands and unit-axis reshapes;
    None otherwise."""
    node = index
    while True:
        value = cz.value(node)
        rows = cz.batch_dims(node)
        if rows in ((0,), ()) and all(s == 1 for s in value.shape[len(rows):]):
            return node
        cop = cz.cops.get(node)
        if cop is None or cop.op not in _SPREADS or not isinstance(cop.args[0], fx.Node):
            return None
        if cop.op == "repeat" and not cop.attr("broadcast"):
            return None
        node = cop.args[0]
