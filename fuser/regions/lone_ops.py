"""lone_ops: whether one glue op alone between heavy ops (a LayerNorm between a residual and a
GEMM, a GELU between two GEMMs) gets a kernel of its own, or is left to PyTorch.

A kernel saves no launch on one op: it pays only where fuser's kernel is faster than PyTorch's
for that op. At decode sizes it often is — PyTorch's LayerNorm takes about 16 µs at one token
on an H200 where a row kernel takes 3–4 — and sometimes not (PyTorch's elementwise kernels are
close to the launch floor). The choice comes from a table measured offline on each GPU, never
from timing at apply or serve time:

``<GPU>-lone_ops.json`` (``fuser tune --lone-ops``, :mod:`fuser.tools.tune_lone_ops`), read
from the launch-table directories (``$FUSER_LAUNCH_CONFIGS``, then ``fuser/codegen/launch_configs/``,
:func:`fuser.ir.device_tables.table_dirs`); ``$FUSER_LONE_OP_TABLE`` names one table file
to read instead, on any device (the CPU included). Each entry is one op kind at one width and
dtype, with PyTorch's time and the fuser kernel's at decode token counts (1..16, each timed in a
CUDA graph); the op is fused where the kernel's mean over those token counts is the smaller.

An op is looked up by its kind (:func:`op_kind`: ``layer_norm``/``layer_norm_nobias``,
``gelu``, ``gelu_tanh``, ``relu``, ``silu``, ``softmax``, ``cast_to_float32``, a reduction's
name, ...), the dtype it reads, and the width of one token's row of its input (:func:`row_width`:
a ``[T, D]`` input's D, but a ``[B, heads, cached, D]`` key cache's heads × cached × D, which
one row program handles at each token as the table's kernels handle D): the entry of the
nearest measured width (on a log scale) within a factor of two; none beyond that.

With no entry (on the CPU, on a GPU with no table, an op or width it does not hold), the
default: a lone normalization or reduction (LayerNorm, softmax, a sum or mean) of floating-point
rows up to :data:`DEFAULT_WIDTH_LIMIT` wide is fused —
PyTorch's kernels for those are several times slower than a row kernel at decode sizes on every
GPU measured — and a lone elementwise op (GELU, a cast, ReLU) is left to PyTorch, whose
elementwise kernels are about as fast as any launch.

A pattern's kernel (RMSNorm written out in its ops) is made whatever its size: its ops are
several launches in eager. The table's ``rms_norm`` and ``relu2`` entries record how the kernel
compares with PyTorch's (``F.rms_norm``, ``relu(x).square()``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.fx as fx

from fuser.canon.canonicalize import REDUCING, COp
from fuser.ir.device_tables import current_gpu, table_entries, table_file

#: The environment variable naming one lone-op table file, read instead of the GPU's own.
TABLE_ENV = "FUSER_LONE_OP_TABLE"
#: A GPU's table file name in the launch-table directories.
TABLE_SUFFIX = "-lone_ops.json"
#: The widest row the default fuses (a logits row of a whole vocabulary is not a decode-size row).
DEFAULT_WIDTH_LIMIT = 16384
#: How far (a factor) a width may lie from the nearest measured one and still use its entry.
WIDTH_REACH = 2.0


@dataclass(frozen=True)
class Decision:
    """Whether the lone op gets a kernel of its own, and why (the text ``fuser explain`` shows)."""

    fuse: bool
    why: str


class LoneOpTableError(ValueError):
    """A lone-op table that cannot be read; names the file and what is wrong."""


def gave_a_kernel(note: str) -> bool:
    """Does a region's note (:attr:`fuser.regions.builder.Region.note`) say that a lone op was
    given a kernel of its own because it runs faster there? (A model's final LayerNorm is one
    op: its kernel saves no launch, only time.)"""
    return note.startswith("alone: fused")


def op_kind(cop: COp, value_of) -> str:
    """The table's name for the op of ``cop`` (``value_of(node)`` gives a node's traced value)."""
    if cop.op == "layer_norm":
        return "layer_norm" if cop.args[2] is not None else "layer_norm_nobias"
    if cop.op == "cast":
        return f"cast_to_{_dtype_name(value_of(cop.node).dtype)}"
    return cop.op


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def row_width(value: torch.Tensor, token_dims: tuple[int, ...]) -> int:
    """The elements of one token's row of ``value``: its size over its token dims' sizes (all
    of it where it has none)."""
    tokens = math.prod(value.shape[d] for d in token_dims)
    return value.numel() // tokens if tokens else 0


def decide(node: fx.Node, cop: COp, value_of, token_dims_of) -> Decision:
    """Whether ``node`` (op ``cop``), alone between ops that cannot share its kernel, gets one
    (``value_of(node)``: a node's traced value; ``token_dims_of(node)``: its dims that follow the
    token count)."""
    source = next((a for a in cop.args if isinstance(a, fx.Node)), None)
    value = value_of(source) if source is not None else None
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or not value.is_floating_point():
        return Decision(False, "alone: left to PyTorch: not a row of floating-point values")
    kind, dtype, width = op_kind(cop, value_of), _dtype_name(value.dtype), row_width(value, token_dims_of(source))
    table, path = current_table()
    entry = nearest(table.get((kind, dtype), []), width)
    what = f"{kind}, width {width}, {dtype}"
    if entry is None:
        return _default(cop.op, width, f"{what}: no entry in " + (path.name if path else "a lone-op table (none for this device)"))
    fused, torch_us = entry["fuser_mean_us"], entry["torch_mean_us"]
    said = f"the table says {fused:.1f} µs vs PyTorch's {torch_us:.1f} µs ({what}; measured at width {entry['width']}, {path.name})"
    if fused < torch_us:
        return Decision(True, f"alone: fused, {said}")
    return Decision(False, f"alone: left to PyTorch, {said}")


def _default(op: str, width: int, what: str) -> Decision:
    about = f" ({what})"
    if op in REDUCING and width <= DEFAULT_WIDTH_LIMIT:
        return Decision(True, f"alone: fused by default{about}: PyTorch's normalizations and reductions are slow at decode sizes")
    return Decision(False, f"alone: left to PyTorch by default{about}: its elementwise kernels are as fast as a kernel of one op")


def nearest(entries: list[dict], width: int) -> dict | None:
    """The entry of the width nearest ``width`` (log scale), if within :data:`WIDTH_REACH`."""
    if not entries or width <= 0:
        return None
    best = min(entries, key=lambda e: (abs(math.log(e["width"] / width)), -e["width"]))
    return best if abs(math.log(best["width"] / width)) <= math.log(WIDTH_REACH) else None


# --- the table -----------------------------------------------------------------------------------
_forced: contextvars.ContextVar[bool | None] = contextvars.ContextVar("fuser_lone_ops_forced", default=None)


@contextlib.contextmanager
def forced(fuse: bool):
    """Every lone op fused (or left) whatever the table says: how ``fuser tune --lone-ops``
    builds the kernel it times."""
    token = _forced.set(fuse)
    try:
        yield
    finally:
        _forced.reset(token)


def forced_decision() -> Decision | None:
    fuse = _forced.get()
    if fuse is None:
        return None
    return Decision(fuse, "alone: " + ("fused" if fuse else "left to PyTorch") + ", as forced (measuring lone ops)")


def table_path() -> Path | None:
    """The table file read: ``$FUSER_LONE_OP_TABLE``, else this GPU's in the table directories."""
    return table_file(TABLE_ENV, TABLE_SUFFIX, current_gpu(), LoneOpTableError)


def current_table() -> tuple[dict, Path | None]:
    """(op kind, dtype) -> its entries, and the file they come from (None: no table)."""
    path = table_path()
    if path is None:
        return {}, None
    return _read(str(path), path.stat().st_mtime_ns), path


@functools.lru_cache(maxsize=8)
def _read(path: str, mtime_ns: int) -> dict:
    where = f"lone-op table {path}"
    entries = table_entries(path, where, LoneOpTableError)
    found: dict = {}
    for i, entry in enumerate(entries):
        checked = _checked(entry)
        if checked is None:
            raise LoneOpTableError(
                f'{where}: entry {i} needs "op" and "dtype" strings, a positive "width" and "torch_us" and '
                f'"fuser_us" dicts of token count -> µs, has {entry!r}'
            )
        found.setdefault((checked["op"], checked["dtype"]), []).append(checked)
    return found


def _checked(entry) -> dict | None:
    """A table entry with the means over its token counts, or None if it is malformed."""
    if not isinstance(entry, dict) or not isinstance(entry.get("op"), str) or not isinstance(entry.get("dtype"), str):
        return None
    width = entry.get("width")
    if type(width) is not int or width <= 0:
        return None
    means = {}
    for side in ("torch_us", "fuser_us"):
        times = entry.get(side)
        if not isinstance(times, dict) or not times or not all(isinstance(t, (int, float)) and t > 0 for t in times.values()):
            return None
        means[side.replace("_us", "_mean_us")] = sum(times.values()) / len(times)
    return {**entry, **means}
