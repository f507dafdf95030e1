"""registry: each op's row-program lowering, by the name its op-table entry gives.

An op that is not a pointwise expression names a lowering in the op table (fuser/ir/ops.py,
``Op.lowering``); the function that writes it is registered under that name where it is
defined, beside the others of its family (:mod:`fuser.lower.layout`, :mod:`fuser.lower.reductions`,
:mod:`fuser.lower.normalizations`, :mod:`fuser.lower.row_gathers`), as Inductor's
``@register_lowering`` does::

    @lowering("layer_norm")
    def layer_norm(lw, node, cop):
        ...  # lines of Triton appended to lw.lines; the value's local named with lw.emit

A lowering takes the lowerer (:class:`fuser.lower.lowerer.Lowerer`: the region, its block
shapes, locals and lines) explicitly. The lowerer imports every family module, so that the
table is full before the first region is lowered.
"""

from __future__ import annotations

from typing import Callable

#: lowering name (an op-table entry's ``lowering``) -> the function that writes it
LOWERINGS: dict[str, Callable] = {}


class UnknownLowering(LookupError):
    """An op-table entry names a lowering that no family module registers (or names none where
    it needs one): a mistake in fuser, not in the model, so it is never taken for an op that
    merely does not lower here (:class:`fuser.lower.code.LoweringError`)."""


def lowering(name: str):
    """Register the decorated function as the lowering called ``name``."""

    def register(fn: Callable) -> Callable:
        if name in LOWERINGS:
            raise ValueError(f"two lowerings called {name!r}: {LOWERINGS[name].__module__} and {fn.__module__}")
        LOWERINGS[name] = fn
        return fn

    return register


def lowering_for(entry) -> Callable:
    """The lowering of op-table entry ``entry`` (an :class:`fuser.ir.ops.Op`)."""
    fn = LOWERINGS.get(entry.lowering) if entry.lowering else None
    if fn is None:
        named = f"names the lowering {entry.lowering!r}, which no module registers" if entry.lowering else "names no lowering"
        raise UnknownLowering(
            f"op {entry.name!r} {named}: give its entry in fuser/ir/ops.py a lowering, and define that one with "
            f"@lowering(...) in its family's module under fuser/lower/"
        )
    return fn
