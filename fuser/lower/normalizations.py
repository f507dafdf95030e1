"""normalizations: lowerings that combine values along an axis of the block and keep its
shape: softmax and log_softmax, layer norm, RMS norm, running sums. Each takes the lowerer
(:class:`fuser.lower.lowerer.Lowerer`) explicitly."""

from __future__ import annotations

import torch
import torch.fx as fx

from fuser.canon.canonicalize import COp
from fuser.lower.code import rounded
from fuser.lower.reductions import reduced_axes
from fuser.lower.registry import lowering


@lowering("softmax")
def softmax(lw, node: fx.Node, cop: COp):
    """softmax and log_softmax; with ``dtype=``, of the input cast to that dtype first."""
    src = cop.args[0]
    (axis,) = reduced_axes(lw, node, cop)
    x, dtype = lw.f32(src), cop.attr("dtype")
    if dtype not in (None, torch.float32, lw.dtypes[src]):
        lw.lines.append(f"_x = ({rounded(x, dtype)}).to(tl.float32)  # {node.name}: in {dtype}")
        x = "_x"
    mask = lw.mask(src)
    highest = f"tl.where({mask}, {x}, float('-inf'))" if mask else x
    lw.lines.append(f"_max = tl.expand_dims(tl.max({highest}, axis={axis}), {axis})")
    lw.lines.append(f"_exp = tl.exp({x} - _max)")
    if mask:
        lw.lines.append(f"_exp = tl.where({mask}, _exp, 0.0)")
    total = f"tl.expand_dims(tl.sum(_exp, axis={axis}), {axis})"
    if cop.op == "log_softmax":
        return lw.emit(node, f"{x} - _max - tl.log({total})")
    return lw.emit(node, f"_exp / {total}")


@lowering("layer_norm")
def layer_norm(lw, node: fx.Node, cop: COp):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last axis (biased variance,
    from the centred values, as PyTorch)."""
    src, weight, bias = cop.args
    (axis,) = reduced_axes(lw, node, cop)
    count = float(lw.block_shape(src)[axis])
    mask = lw.mask(src)
    lw.lines.append(f"_mean = tl.expand_dims(tl.sum({lw.masked(src, '0.0')}, axis={axis}), {axis}) / {count!r}  # {node.name}")
    centred = f"{lw.f32(src)} - _mean"
    lw.lines.append(f"_centred = {f'tl.where({mask}, {centred}, 0.0)' if mask else centred}")
    lw.lines.append(f"_var = tl.expand_dims(tl.sum(_centred * _centred, axis={axis}), {axis}) / {count!r}")
    expr = f"_centred * tl.rsqrt(_var + {float(cop.attr('eps'))!r})"
    if weight is not None:
        expr = f"{expr} * {lw.f32(weight)}"
    if bias is not None:
        expr = f"{expr} + {lw.f32(bias)}"
    return lw.emit(node, expr)


@lowering("rms_norm")
def rms_norm(lw, node: fx.Node, cop: COp):
    """``x * rsqrt(mean(x²) + eps) * weight`` over the last axis, in fp32 (``F.rms_norm``)."""
    src, weight = cop.args
    (axis,) = reduced_axes(lw, node, cop)
    count = float(lw.block_shape(src)[axis])
    square = f"{lw.f32(src)} * {lw.f32(src)}"
    mask = lw.mask(src)
    square = f"tl.where({mask}, {square}, 0.0)" if mask else square
    lw.lines.append(f"_ms = tl.expand_dims(tl.sum({square}, axis={axis}), {axis}) / {count!r}  # {node.name}")
    expr = f"{lw.f32(src)} * tl.rsqrt(_ms + {float(cop.attr('eps'))!r})"
    if weight is not None:
        expr = f"{expr} * {lw.f32(weight)}"
    return lw.emit(node, expr)


@lowering("cumsum")
def cumsum(lw, node: fx.Node, cop: COp):
    """``torch.cumsum`` along a non-token axis of the block, whole in one program: a scan in
    fp32 (as PyTorch accumulates a bf16 or fp16 running sum), rounded once. Padded lanes come
    after the real ones (zeros, masked), so they never reach a real lane's sum."""
    src = cop.args[0]
    (axis,) = reduced_axes(lw, node, cop)
    return lw.emit(node, f"tl.cumsum({lw.masked(src, '0.0')}, axis={axis})")
