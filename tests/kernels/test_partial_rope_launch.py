"""GPT-NeoX-20B's partial RoPE as one kernel: its grid at many tokens, its body, its outputs.

transformers' own ``apply_rotary_pos_emb`` (GPT-NeoX's: a quarter of each 96-wide head
rotated, ``rotate_half`` of 24 columns in halves of 12, the rest passed through) on q and k of
GPT-NeoX-20B's 64 heads, shaped ``[T, heads, 1, head_dim]`` as its attention makes them. The
halves are not of a power-of-two width, so ``rotate_half`` is read again at remapped columns
(fuser/lower/concat.py), never assembled by a one-hot sum in registers: at 16 heads a program
that sum went through shared memory and made the kernel 306 µs at T=512 on an H200.

Checked: the launcher's grid at T=512 (recorded, not run) has a program per row and per tile
of heads; the body has no one-hot sum; the kernel at every tile width the launcher may choose
matches eager per dtype (fuser.validate.tolerance.KERNEL).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import triton
from helpers import assert_close, gen, randn
from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb

import fuser.pipeline.fuse_module
import fuser.validate.against_eager
from fuser.lower.tiling import LAUNCH_PROGRAMS, launch_width
from fuser.validate.tolerance import KERNEL

HEADS, HEAD_DIM, ROTARY = 64, 96, 24  # GPT-NeoX-20B: rotary_pct 0.25
DTYPES = [pytest.param(torch.bfloat16, id="bfloat16"), pytest.param(torch.float16, id="float16"),
          pytest.param(torch.float32, id="float32")]  # fmt: skip


class NeoXRope(nn.Module):
    """GPT-NeoX's attention's RoPE step, as transformers calls it (cos, sin unsqueezed at 1)."""

    def forward(self, q, k, cos, sin):
        return apply_rotary_pos_emb(q, k, cos, sin)


def inputs(T: int, dtype: torch.dtype):
    """q, k ``[T, 64, 1, 96]`` and cos, sin ``[T, 1, 24]`` (the angles twice over, as
    GPT-NeoX's rotary embedding makes them)."""
    angles = randn(gen(T + 7), T, 1, ROTARY // 2, scale=3.0)
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    q = randn(gen(T), T, HEADS, 1, HEAD_DIM, dtype=dtype, scale=2.0)
    k = randn(gen(T + 1), T, HEADS, 1, HEAD_DIM, dtype=dtype, scale=2.0)
    return q, k, cos, sin


def the_kernel(dtype: torch.dtype, T: int = 3, validate: bool = True):
    """The one kernel of the RoPE's plan at T tokens, the values it reads there and its
    outputs in eager."""
    module = NeoXRope()
    plan = fuser.pipeline.fuse_module.plan(module, inputs(T, dtype), validate=validate)
    assert len(plan.kernels) == 1 and not plan.report.unfused, plan.report.text()
    (kernel,) = plan.kernels
    values = fuser.validate.against_eager.record_values(module, plan.traced, plan.cops)
    return kernel, values.inputs_of(kernel.region), [values[o] for o in kernel.region.outputs]


class GridSpy:
    """Stands in for the Triton kernel in its launcher's module: records each grid, runs nothing."""

    def __init__(self):
        self.grids = []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return lambda *args, **kwargs: None


def test_the_grid_at_512_tokens_has_a_program_per_row_and_tile():
    kernel, _, _ = the_kernel(torch.bfloat16, validate=False)
    program = kernel.spec.program
    assert kernel.spec.tile_at_launch and program.tiled, program
    name = kernel.path.stem + "_kernel"
    real, spy = kernel.launch.__globals__[name], GridSpy()
    kernel.launch.__globals__[name] = spy
    try:
        for T in (1, 8, 128, 512):
            same, args, _ = the_kernel(torch.bfloat16, T, validate=False)
            assert same.path == kernel.path, (T, same.path, kernel.path)  # one kernel for every T
            kernel.launch(*args)
    finally:
        kernel.launch.__globals__[name] = real
    for T, grid in zip((1, 8, 128, 512), spy.grids):
        assert grid[0] == T, (T, grid)  # a program per token row
        tile = launch_width(T, program.last, program.widths)
        assert grid[1] == triton.cdiv(HEADS, tile), (T, grid)  # and per tile of heads
        assert grid[0] * grid[1] >= min(LAUNCH_PROGRAMS, T * HEADS // program.widths[-1]), (T, grid)
    assert spy.grids[-1][0] * spy.grids[-1][1] >= 512 * HEADS // program.widths[-1]


def test_rotate_half_is_read_at_remapped_columns_not_summed_one_hot():
    kernel, _, _ = the_kernel(torch.bfloat16, validate=False)
    source = kernel.path.read_text()
    body = source[source.index("@triton.jit\ndef " + kernel.path.stem) : source.index("\ndef launch(")]
    assert "(columns remapped)" in body, body
    assert "tl.sum(" not in body, body  # no one-hot sum over the columns


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_tile_width_matches_eager(dtype):
    kernel, _, _ = the_kernel(dtype)  # validated against eager at every width, at T=3
    widths = kernel.spec.program.widths
    assert len(widths) >= 2, widths
    for T in (1, 5):
        _, args, expected = the_kernel(dtype, T, validate=False)
        for width in widths:
            got = kernel.launch(*args, block_tile=width)
            for g, e, what in zip(got, expected, ("q", "k")):
                assert_close(g, e, KERNEL, f"{what}, T={T}, tile {width}")

