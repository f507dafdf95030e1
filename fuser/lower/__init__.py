"""lower: a region as a row program — plain data the templates render.

Takes a region and the canonical graph; returns a :class:`~fuser.lower.row_program.RowProgram`
(its operands, the body's lines, how rows and the tiled axis split over programs, its warps),
or raises :class:`~fuser.lower.code.LoweringError` naming the op that does not lower.
"""
