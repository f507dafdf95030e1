"""program: a row program as plain data, what the templates render (templates/_row_program.py.jinja).

:mod:`fuser.lower.lowerer` makes it from a region: each operand (a tensor the kernel reads or writes,
by its block shape and dtype), the body's lines, and how the rows and the tiled axis are split
across programs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from fuser.trace.tracing import Traced

TL_DTYPES = {
    torch.float32: "tl.float32", torch.bfloat16: "tl.bfloat16", torch.float16: "tl.float16",
    torch.float8_e4m3fn: "tl.float8e4nv", torch.bool: "tl.int1",
    torch.int8: "tl.int8",  # quantised activations: made only by a cast of a value clamped to its range
}  # fmt: skip


@dataclass
class Operand:
    """A tensor the kernel reads or writes: its pointer and the strides of its block dims."""

    name: str
    node: str
    shape: tuple[int, ...]  # block shape (no token dim)
    dtype: torch.dtype
    has_rows: bool
    broadcast_rows: bool = False  # a [1, ...] tensor the launcher expands over the token rows
    into: bool = False  # an output the caller passes in (a view it is written into), not allocated
    # Its rows per program: 1, or k (the index a program gathers k rows with), or 0 when its rows
    # are not the programs' (a gathered table).
    row_group: int = 1
    # The dim its tokens (or its broadcast 1) are along: the launcher moves it first (a view) for
    # the kernel, and allocates an output in its own layout.
    row_dim: int = 0

    @property
    def complex(self) -> bool:
        """complex64: the kernel sees it as float pairs (an extra trailing dim of 2)."""
        return self.dtype.is_complex

    @property
    def stride_args(self) -> list[str]:
        dims = len(self.shape) + (1 if self.complex else 0)
        return ([f"{self.name}_stride_row"] if self.has_rows else []) + [
            f"{self.name}_stride_{i}" for i in range(dims)
        ] + ([f"{self.name}_rows"] if self.read_at_positions else [])

    @property
    def read_at_positions(self) -> bool:
        """Rows read where values say (a gathered table): the kernel gets their count too."""
        return self.has_rows and self.row_group == 0


@dataclass
class RowProgram:
    inputs: list[Operand]
    outputs: list[Operand]
    body: list[str] = field(default_factory=list)
    tiled: bool = False  # one axis (the last, else the first) is split across programs
    leading: bool = False  # the tiled axis is the first (heads), not the last (columns)
    last: int = 1  # size of the tiled axis
    block_last: int = 1  # its elements per program
    num_warps: int = 4
    numel: int = 1  # padded elements of the largest block
    helpers: tuple[str, ...] = ()  # jit functions the body calls (templates/_row_program.py.jinja)
    tile_scales: tuple[int, ...] = ()  # wider tiles the body reads (``tile2``: every other column's source)
    others: int = 1  # elements of the other axes each element of the tiled axis comes with
    per_warp: int = 256  # elements a warp takes (fuser.codegen.launch_config.elements_per_warp)
    # Tile widths a launch may choose by its row count (fuser.lower.tiling.launch_widths); none: block_last
    widths: tuple[int, ...] = ()


def row_source(inputs: list[Operand]) -> str:
    """The input whose first dim gives the program count (the token count, or k times it), or
    in a chain with no token rows the first input (the device of the outputs)."""
    op = _row_input(inputs)
    return (op or inputs[0]).name


def row_count(inputs: list[Operand]) -> str:
    """The launcher's expression for the number of programs: 1 in a chain with no token rows."""
    op = _row_input(inputs)
    if op is None:
        return "1"
    return f"{op.name}.shape[0]" + (f" // {op.row_group}" if op.row_group > 1 else "")


def _row_input(inputs: list[Operand]) -> Operand | None:
    rowed = [op for op in inputs if op.has_rows and not op.broadcast_rows and op.row_group]
    return min(rowed, key=lambda op: op.row_group) if rowed else None  # one row per program if any, else k


def operand(traced: Traced, node: fx.Node, name: str) -> Operand:
    """The kernel argument for ``node``'s value: block shape without the token dim, dtype."""
    value = traced.value(node)
    batch = traced.batch_dims(node)
    rows = batch[0] if batch else 0
    shape = tuple(value.shape[:rows]) + tuple(value.shape[rows + 1 :]) if batch else tuple(value.shape)
    return Operand(name, node.name, shape, value.dtype, bool(batch), row_dim=rows)
