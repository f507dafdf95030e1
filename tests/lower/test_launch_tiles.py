"""Tile widths chosen at launch by the row count (fuser.lower.tiling.launch_widths, launch_width).

A tiled row program whose body reads the same at any tile width chooses its width, and its
warps, each time it is launched: narrow tiles for a few rows (enough programs to run at once),
wide ones for many. Golden outputs at every width it may choose, per dtype, at odd widths; the
launcher's choice against the rule it inlines; validation at every width.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
from helpers import assert_close, gen, randn

import fuser.pipeline.fuse_module
import fuser.validate.against_eager
from fuser.codegen.emit import kernel_source
from fuser.lower.lowerer import _launch_widths
from fuser.lower.row_program import RowProgram
from fuser.lower.tiling import LAUNCH_PROGRAMS, MIN_PROGRAM, launch_width, launch_widths, tile_floor
from fuser.validate.tolerance import KERNEL

DTYPES = [pytest.param(torch.bfloat16, id="bfloat16"), pytest.param(torch.float16, id="float16"),
          pytest.param(torch.float32, id="float32")]  # fmt: skip


class SiluMul(nn.Module):
    """SiLU(gate) * up: a pointwise chain, its columns tiled."""

    def forward(self, gate, up):
        return F.silu(gate) * up


class WeightedRowSum(nn.Module):
    """The sum of each token's k rows, weighted (the last MoE kernel): a reduction inside a
    column tile, at 2048 elements a warp."""

    def forward(self, rows, weights):
        return (rows * weights).sum(1)


class HeadNorm(nn.Module):
    """An RMS norm of each head of ``[T, heads, dim]``: the heads are tiled."""

    def forward(self, x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


class InterleavedSiluMul(nn.Module):
    """SiLU of the even columns times the odd ones (GPT-OSS's interleaved gate and up): the
    source is read a tile twice as wide, and split in registers."""

    def forward(self, gate_up):
        return F.silu(gate_up[..., ::2]) * gate_up[..., 1::2]


CASES = {
    # name: (module, inputs at T tokens)
    "pointwise, 1000 columns": (SiluMul(), lambda T, dt: (randn(gen(T), T, 1000, dtype=dt, scale=3.0),
                                                         randn(gen(50 + T), T, 1000, dtype=dt))),
    "k rows summed, 300 columns": (WeightedRowSum(), lambda T, dt: (randn(gen(T), T, 3, 300, dtype=dt),
                                                                   randn(gen(50 + T), T, 3, 1, dtype=dt))),
    "every other of 1200 columns": (InterleavedSiluMul(), lambda T, dt: (randn(gen(T), T, 1200, dtype=dt, scale=3.0),)),
    "6 heads of 40": (HeadNorm(), lambda T, dt: (randn(gen(T), T, 6, 40, dtype=dt, scale=2.0),)),
}  # fmt: skip


def the_kernel(module, inputs, validate=True):
    """The one kernel of ``module``'s plan at ``inputs``."""
    plan = fuser.pipeline.fuse_module.plan(module, inputs, validate=validate)
    (kernel,) = plan.kernels
    return kernel, plan


def kernel_values(module, inputs):
    """The inputs of the one kernel of ``module`` at ``inputs``, and its outputs in eager."""
    kernel, plan = the_kernel(module, inputs, validate=False)
    values = fuser.validate.against_eager.record_values(module, plan.traced, plan.cops)
    return values.inputs_of(kernel.region), values[kernel.region.outputs[0]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_every_width_a_launch_may_choose_matches_eager(case, dtype):
    module, make = CASES[case]
    kernel, _ = the_kernel(module, make(3, dtype))
    widths = kernel.spec.program.widths
    assert kernel.spec.tile_at_launch and len(widths) >= 2, (case, widths)
    for T in (2, 7):
        inputs, expected = kernel_values(module, make(T, dtype))
        for width in widths:
            (got,) = kernel.launch(*inputs, block_tile=width)
            assert_close(got, expected, KERNEL, f"{case}, T={T}, tile {width}")
        (got,) = kernel.launch(*inputs)
        assert_close(got, expected, KERNEL, f"{case}, T={T}, tile chosen at launch")


ROWS = (2, 3, 9, 33)


class GridSpy:
    """Stands in for a Triton kernel in its launcher's module and records each launch's grid."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("case", list(CASES))
def test_the_launcher_takes_the_widest_tile_that_still_gives_enough_programs(case):
    """The launcher inlines :func:`launch_width`: its grid has that many tiles per row at
    every row count; one row takes the narrowest tile, rows enough to fill the GPU the widest."""
    module, make = CASES[case]
    kernel, _ = the_kernel(module, make(3, torch.float32))
    program = kernel.spec.program
    name = kernel.path.stem + "_kernel"
    spy = GridSpy(kernel.launch.__globals__[name])
    kernel.launch.__globals__[name] = spy
    try:
        for rows in ROWS:
            kernel.launch(*kernel_values(module, make(rows, torch.float32))[0])
    finally:
        kernel.launch.__globals__[name] = spy.kernel
    chosen = [triton.cdiv(program.last, launch_width(rows, program.last, program.widths)) for rows in ROWS]
    assert [g[1] for g in spy.grids] == chosen
    assert launch_width(1, program.last, program.widths) == program.widths[0]
    many = LAUNCH_PROGRAMS  # rows enough for the widest tile to give LAUNCH_PROGRAMS programs
    assert launch_width(many, program.last, program.widths) == program.widths[-1]


@pytest.mark.parametrize(
    "width, others, leading",
    [(512, 4, False), (256, 8, False), (2048, 1, False), (1024, 2, False), (16, 128, False), (4, 512, True), (8, 64, True)],
)  # fmt: skip
def test_widths_run_from_a_one_warp_program_to_the_default_tile(width, others, leading):
    widths = launch_widths(width, others, leading)
    assert widths[-1] == width
    assert all(b == 2 * a for a, b in zip(widths, widths[1:])), widths  # consecutive powers of two
    assert widths[0] >= tile_floor(leading)
    assert widths[0] == tile_floor(leading) or widths[0] * others >= MIN_PROGRAM  # a warp's worth at least
    assert widths[0] == width or widths[0] // 2 * others < MIN_PROGRAM  # and no more


def test_launch_width_is_the_widest_with_enough_programs_else_the_narrowest():
    widths = (64, 128, 256, 512, 1024)
    for rows in range(1, 700, 7):
        chosen = launch_width(rows, 2880, widths)
        enough = [w for w in widths if rows * -(-2880 // w) >= LAUNCH_PROGRAMS]
        assert chosen == (max(enough) if enough else 64), rows


def test_a_body_that_depends_on_the_width_keeps_its_one_tile():
    program = RowProgram([], [], ["x = tl.reshape(y, (4, 512))"], tiled=True, last=2880, block_last=512, others=4)
    assert _launch_widths(program, lambda width: [f"x = tl.reshape(y, (4, {width}))"]) == ()
    assert _launch_widths(program, lambda width: list(program.body)) == (64, 128, 256, 512)


def test_validation_runs_the_kernel_at_every_width(monkeypatch):
    module, make = CASES["pointwise, 1000 columns"]
    seen = []
    validate_launch = fuser.validate.against_eager._validate_launch

    def spy(kernel, values, cops, options):
        seen.append(options.get("block_tile"))
        return validate_launch(kernel, values, cops, options)

    monkeypatch.setattr(fuser.validate.against_eager, "_validate_launch", spy)
    kernel, _ = the_kernel(module, make(3, torch.float32))
    assert seen == list(kernel.spec.program.widths)


def test_a_kernel_whose_warps_were_tuned_keeps_its_tile():
    """Warps tuned for a kernel (the tuner's, or a launch-table entry) hold for its own tile."""
    module, make = CASES["pointwise, 1000 columns"]
    spec = the_kernel(module, make(3, torch.float32))[0].spec
    _, source = kernel_source(replace(spec, warps=4))
    assert f"BLOCK_TILE={spec.program.block_last}," in source and "block_tile" not in source, source
    _, source = kernel_source(spec)
    assert "BLOCK_TILE=block_tile," in source, source
