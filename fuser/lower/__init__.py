"""lower: a region as a row program — plain data the templates render.

Takes a region and the canonical graph; returns a :class:`~fuser.lower.row_program.RowProgram`
(its operands, the body's lines, how rows and the tiled axis split over programs, its warps),
or raises :class:`~fuser.lower.code.LoweringError` naming the op that does not lower.

:mod:`~fuser.lower.lowerer` holds the region's state and dispatches each op: a pointwise op to
its expression in the op table, any other to the lowering its entry names, a function
registered with ``@lowering(name)`` in its family's module (:mod:`~fuser.lower.layout`,
:mod:`~fuser.lower.reductions`, :mod:`~fuser.lower.normalizations`,
:mod:`~fuser.lower.row_gathers`; :mod:`~fuser.lower.registry`).
"""
