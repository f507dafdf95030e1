"""decode_gemm: ``F.linear(x, weight)`` at decode sizes (a few token rows) by fuser's own kernel,
where a table measured offline on this GPU says it is faster than PyTorch's (cuBLAS).

At one to sixteen tokens a linear layer is a GEMV: it reads its weight once, and its time is
that read plus the launch. The kernel gives each program ``block_n`` output columns (as few as
four, so that a weight of 2048 rows runs 512 programs and every SM streams several) and walks
the reduction in chunks of ``block_k`` (up to the whole of it; its width a constant of the kernel:
one binary per weight shape): each chunk of the weight is read once. At one token row it is
multiplied against the row and summed on the CUDA cores, accumulated in fp32 and rounded once,
as cuBLAS does (no ``tl.dot``: no rows padded to 16). At two rows (:data:`CORE_ROWS`) so is
each row in turn, against the chunk read once, with the one row's launch: a program keeps its
few columns, so a weight of 2048 rows still runs 512 programs. At more rows
the rows and the columns are padded to 16 (the columns of a program at least 16) and each chunk
is one ``tl.dot`` on the tensor cores, summed in fp32 (fp32 operands multiplied in fp32, not
tf32), the chunk narrowed as the rows grow (``block_k`` ÷ rows). Where a residual is given the
sum is added before that rounding (the residual add's epilogue:
:mod:`fuser.pipeline.residual_in_gemm`). :func:`gated` runs a gate/up pair's GEMM and stores
``act(gate) * up`` alone, each program holding the same columns of both halves
(:mod:`fuser.pipeline.gated_in_gemm`).

Launched with programmatic dependent launch (``Config.pdl``, set by the ``decode_gemm`` pass where
the ``pdl`` pass is on and the GPU has it) at one token row, as fuser's row programs are
(:data:`fuser.codegen.emit.PDL_ROWS`): the GPU may launch it while the kernel before it still
runs; its first instruction waits (``gdc_wait``) until that kernel has finished and its writes
are visible. It then lets the next kernel launch at once, which waits the same way. With
``Config.early`` (the ``early_weights`` pass's, :mod:`fuser.pipeline.early_weights`) each program
reads its first chunk of the weight before that wait, so the weight's read overlaps the end of
the kernel before. Only that kernel can still be running (any before it had finished before it
passed its own wait), so the read is safe wherever that kernel writes no weight: the pass sets
it where a kernel of the same forward comes just before the GEMM, and none writes a parameter.

The table (``<GPU>-decode_gemm.json``, written by ``fuser tune --decode-gemm``,
:mod:`fuser.tools.tune_decode_gemm`; ``$FUSER_DECODE_GEMM_TABLE`` names one file to read instead,
on any device) has one entry per weight shape and dtype: the best of the configurations timed,
its time and PyTorch's at each decode token count (each replayed in a CUDA graph), and
``up_to``, the largest token count up to which the kernel was the faster at every count (the
configuration up to :data:`CORE_ROWS` rows the fastest there, ``config_rows`` the fastest over
the larger counts where another). A linear layer whose shape has no entry, or a call with more
rows than ``up_to``, runs ``F.linear``: the default is PyTorch's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from fuser.codegen.emit import PDL_ROWS, forbid_compile_during_capture
from fuser.codegen.fast_launch import fast
from fuser.install.rounding import exact_products, to_dtype
from fuser.ir.device_tables import current_gpu, table_entries, table_file

#: The environment variable naming one decode-GEMM table file, read instead of the GPU's own.
TABLE_ENV = "FUSER_DECODE_GEMM_TABLE"
#: A GPU's table file name in the launch-table directories.
TABLE_SUFFIX = "-decode_gemm.json"
#: The most token rows the kernel takes (a decode step's; past a few rows it loses to cuBLAS anyway).
MAX_ROWS = 16
#: The most token rows summed on the CUDA cores (a row at a time, as one row is); more take
#: ``tl.dot``, padded to 16 rows (a constexpr: the kernel reads it). On an H100 (bf16, the table's
#: configurations, µs) 2 rows so ran faster than ``tl.dot`` at every shape timed (2048x8192 11.0
#: against 12.3, 3072x2048 5.13 against 6.89, 4096x4096 9.65 against 11.8, 6144x4096 20.0 against
#: 23.9, 16384x2048 24.6 against 27.1); 3 and 4 rows slower at four of the five.
CORE_ROWS = tl.constexpr(2)


@dataclass(frozen=True)
class Config:
    """How the kernel is launched for one weight shape, and up to how many rows it is used."""

    block_n: int  # output columns a program
    block_k: int  # the reduction's chunk at one row (narrowed at more)
    warps: int
    up_to: int
    pdl: bool = False  # launched with programmatic dependent launch at one row (not in the table: the pass's)
    early: bool = False  # with PDL, the weight's first chunk read before the wait (not in the table: the pass's)
    rows: tuple[int, int, int] | None = None  # (block_n, block_k, warps) past CORE_ROWS rows (tl.dot's), where they differ

    def at(self, rows: int) -> tuple[int, int, int]:
        """(block_n, block_k, warps) of a launch on ``rows`` token rows: the one row's up to
        :data:`CORE_ROWS` (summed the same way), ``rows`` past it."""
        return self.rows if rows > CORE_ROWS and self.rows is not None else (self.block_n, self.block_k, self.warps)


#: The activations the kernel applies to a gated pair's first half (``GATE``): 0 none.
ACTIVATIONS = {"silu": 1, "gelu_tanh": 2}


@triton.jit
def _row_chunk(x_ptr, a_ptr, rows, row_ok, ks, K: tl.constexpr, stride_xm, stride_am, EVEN_K: tl.constexpr, ADD: tl.constexpr):
    """One chunk of the GEMM's input rows: ``x``, or ``x + a`` rounded to their dtype (a residual
    add before the norm)."""
    ok = row_ok[:, None] if EVEN_K else row_ok[:, None] & (ks < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=ok, other=0.0)
    if ADD:
        x = to_dtype(x.to(tl.float32) + tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :], mask=ok, other=0.0).to(tl.float32), x.dtype)
    return x


@triton.jit
def _normed(x, nw_ptr, ks, K: tl.constexpr, rstd, NORM: tl.constexpr, EVEN_K: tl.constexpr):
    """An RMSNorm of the chunk ``x`` (its rows' ``rstd`` given), each value rounded where eager
    rounds it: 1 ``weight * (x * rstd).to(dtype)`` (transformers' Llama, Qwen, Mistral); 2
    ``(x * rstd * weight).to(dtype)``, the weight in fp32; 3 ``(x * rstd * (1 + weight)).to(dtype)``
    (Gemma's)."""
    nw = (tl.load(nw_ptr + ks) if EVEN_K else tl.load(nw_ptr + ks, mask=ks < K, other=0.0)).to(tl.float32)[None, :]
    xf = x.to(tl.float32) * rstd[:, None]
    if NORM == 1:
        return to_dtype(nw * to_dtype(xf, x.dtype).to(tl.float32), x.dtype)
    if NORM == 2:
        return to_dtype(xf * nw, x.dtype)
    return to_dtype(xf * (1.0 + nw), x.dtype)


@triton.jit
def _weight_chunk(w_ptr, cols, col_ok, ks, K: tl.constexpr, stride_wn, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    """Weight rows ``cols``, the reduction's chunk ``ks``."""
    w_at = w_ptr + cols[:, None] * stride_wn + ks[None, :]
    if EVEN_N and EVEN_K:
        return tl.load(w_at)
    return tl.load(w_at, mask=col_ok[:, None] & (ks < K)[None, :], other=0.0)


@triton.jit
def _dot_chunk(acc, x, w, BLOCK_M: tl.constexpr, EXACT: tl.constexpr):
    """``acc`` plus one chunk of the reduction: the weight's chunk ``w`` against the rows' chunk
    ``x``; up to :data:`CORE_ROWS` rows on the CUDA cores, each row's products summed in fp32 as at
    one row, more by ``tl.dot``."""
    if BLOCK_M == 1:
        return acc + tl.expand_dims(tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1), 0)
    if BLOCK_M <= CORE_ROWS:
        # each row taken out of the chunk's rows (a sum with zeros: exact) and summed as one row is;
        # on an H100 a [rows, cols, chunk] product of the chunk narrowed by the rows ran 2-3x slower
        wf, xf, rows = w.to(tl.float32), x.to(tl.float32), tl.arange(0, BLOCK_M)[:, None]
        for m in tl.static_range(BLOCK_M):
            row = tl.sum(tl.where(rows == m, xf, 0.0), axis=0)
            acc = tl.where(rows == m, acc + tl.expand_dims(tl.sum(wf * row[None, :], axis=1), 0), acc)
        return acc
    if EXACT:  # fp32 operands (and bf16 in the interpreter): the products in fp32, not tf32
        return acc + tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    return acc + tl.dot(x, tl.trans(w))


@triton.jit
def _decode_gemm(
    x_ptr, w_ptr, r_ptr, y_ptr, a_ptr, nw_ptr, h_ptr, M, N, stride_xm, stride_wn, stride_rm, stride_ym, stride_am, stride_hm, eps,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, ACCUMULATE: tl.constexpr, GATE: tl.constexpr, PDL: tl.constexpr,
    EXACT: tl.constexpr, NORM: tl.constexpr, ADD: tl.constexpr, EARLY: tl.constexpr,
):  # fmt: skip
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    col_ok, row_ok = cols < N, rows < M
    if EARLY:  # the weight's first chunk read while the kernel before still runs (the module's docstring)
        first = _weight_chunk(w_ptr, cols, col_ok, tl.arange(0, BLOCK_K), K, stride_wn, EVEN_N, EVEN_K)
        first_up = _weight_chunk(w_ptr + N * stride_wn, cols, col_ok, tl.arange(0, BLOCK_K), K, stride_wn, EVEN_N, EVEN_K) if GATE else first
    if PDL:
        gdc_wait()  # launched early: wait until the kernel before has finished and its writes are seen
        gdc_launch_dependents()  # the next kernel may launch now; it waits the same way
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if NORM:  # the norm's prologue: each program the rows' mean square, over the whole reduction
        squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            x = _row_chunk(x_ptr, a_ptr, rows, row_ok, ks, K, stride_xm, stride_am, EVEN_K, ADD)
            squares += tl.sum(x.to(tl.float32) * x.to(tl.float32), axis=1)
            if ADD and tl.program_id(0) == 0:  # the sum, the residual the layer goes on with: by one program
                ok = row_ok[:, None] if EVEN_K else row_ok[:, None] & (ks < K)[None, :]
                tl.store(h_ptr + rows[:, None] * stride_hm + ks[None, :], x, mask=ok)
        rstd = tl.rsqrt(squares / K + eps)
    if EARLY:
        ks = tl.arange(0, BLOCK_K)
        x = _row_chunk(x_ptr, a_ptr, rows, row_ok, ks, K, stride_xm, stride_am, EVEN_K, ADD)
        if NORM:
            x = _normed(x, nw_ptr, ks, K, rstd, NORM, EVEN_K)
        acc = _dot_chunk(acc, x, first, BLOCK_M, EXACT)
        if GATE:
            up = _dot_chunk(up, x, first_up, BLOCK_M, EXACT)
    for start in range(BLOCK_K if EARLY else 0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        x = _row_chunk(x_ptr, a_ptr, rows, row_ok, ks, K, stride_xm, stride_am, EVEN_K, ADD)
        if NORM:
            x = _normed(x, nw_ptr, ks, K, rstd, NORM, EVEN_K)
        acc = _dot_chunk(acc, x, _weight_chunk(w_ptr, cols, col_ok, ks, K, stride_wn, EVEN_N, EVEN_K), BLOCK_M, EXACT)
        if GATE:  # the pair's second half: weight rows N + cols
            w_up = _weight_chunk(w_ptr + N * stride_wn, cols, col_ok, ks, K, stride_wn, EVEN_N, EVEN_K)
            up = _dot_chunk(up, x, w_up, BLOCK_M, EXACT)
    out = rows[:, None] * stride_ym + cols[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    dtype = y_ptr.dtype.element_ty
    if GATE:  # each rounded where eager rounds it: both halves, the activation, the product
        gate = to_dtype(acc, dtype).to(tl.float32)
        if GATE == 1:  # silu
            gate = gate / (1.0 + tl.exp(-gate))
        else:  # the tanh GELU
            inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            gate = 0.5 * gate * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))
        acc = to_dtype(gate, dtype).to(tl.float32) * to_dtype(up, dtype).to(tl.float32)
    if ACCUMULATE:
        acc += tl.load(r_ptr + rows[:, None] * stride_rm + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + out, to_dtype(acc, dtype), mask=ok)


forbid_compile_during_capture(_decode_gemm, Path(__file__))  # warm-ups at each shape compile it first
_launch = fast(_decode_gemm)


def takes(x: torch.Tensor, weight: torch.Tensor, config: Config | None) -> bool:
    """Does the kernel take ``F.linear(x, weight)`` under ``config`` (else PyTorch's runs)?"""
    if config is None or x.dim() == 0 or x.dtype != weight.dtype or weight.dim() != 2 or weight.stride(-1) != 1:
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    return 0 < rows <= config.up_to and x.shape[-1] == weight.shape[1] and x.device == weight.device


def chunk(block_k: int, block_m: int, k: int) -> int:
    """The reduction's chunk of a ``tl.dot`` on ``block_m`` rows: ``block_k`` at one row, narrowed as
    the rows grow (as many products a step), never wider than the reduction."""
    return max(16, min(block_k // block_m, triton.next_power_of_2(k)))


def linear(x: torch.Tensor, weight: torch.Tensor, config: Config | None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight)`` (plus ``residual``, of the output's shape, where given): by the
    kernel where :func:`takes` says so, by PyTorch otherwise."""
    if not takes(x, weight, config) or (residual is not None and tuple(residual.shape) != (*x.shape[:-1], weight.shape[0])):
        out = F.linear(x, weight)
        return out if residual is None else residual + out
    return _run(x, weight, config, weight.shape[0], residual=residual)


def gated(x: torch.Tensor, weight: torch.Tensor, config: Config, activation: str, norm: Norm | None = None):
    """``act(a) * b`` of ``a, b = F.linear(x, weight).chunk(2, -1)`` by the kernel, in one launch
    (``act`` of :data:`ACTIVATIONS`; the caller has asked :func:`takes`); of ``x`` normed first
    where ``norm`` is given (as :func:`normed`)."""
    if weight.shape[0] % 2:
        raise ValueError(f"a gated pair's weight has an even number of rows (its two halves); has {tuple(weight.shape)}")
    return _run(x, weight, config, weight.shape[0] // 2, gate=ACTIVATIONS[activation], norm=norm)


@dataclass(frozen=True)
class Norm:
    """An RMSNorm the kernel applies to its input rows first (its prologue): of ``x``, or of
    ``x + added`` (then also returned: the residual the layer goes on with)."""

    form: str  # of NORMS
    weight: torch.Tensor
    eps: float
    added: torch.Tensor | None = None


#: The RMSNorm forms of the prologue, by how each rounds (``_normed``): transformers' Llama's
#: ``weight * x.to(dtype)``, an fp32 weight's ``(x * weight).to(dtype)``, Gemma's ``1 + weight``.
NORMS = {"weight_after_cast": 1, "weight_in_fp32": 2, "one_plus_weight": 3}


def normed(x: torch.Tensor, weight: torch.Tensor, config: Config, norm: Norm):
    """``F.linear(rmsnorm(x), weight)`` by the kernel in one launch, each program computing the
    rows' mean square itself (the caller has asked :func:`takes`); with ``norm.added``, of
    ``rmsnorm(x + added)``, returning ``(out, x + added)``."""
    return _run(x, weight, config, weight.shape[0], norm=norm)


def _rows(t: torch.Tensor, k: int) -> torch.Tensor:
    """``t`` as rows of ``k``, each contiguous."""
    flat = t.reshape(-1, k)
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def _run(x, weight, config: Config, n: int, residual=None, gate: int = 0, norm: Norm | None = None) -> torch.Tensor:
    k = weight.shape[1]
    flat = _rows(x, k)
    rows = flat.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    r = residual.reshape(rows, n) if residual is not None else out
    adds = norm is not None and norm.added is not None  # a residual added before the norm: its sum returned too
    added = _rows(norm.added, k) if adds else flat
    h = torch.empty_like(flat) if adds else flat
    block_n, block_k, warps = config.at(rows)
    block_m = triton.next_power_of_2(rows)
    if rows <= CORE_ROWS:  # summed on the CUDA cores a row at a time: the launch as at one row
        block_k = chunk(block_k, 1, k)
    else:  # one tl.dot a chunk: the chunk narrowed by the rows, the rows and columns padded to 16
        block_k = chunk(block_k, block_m, k)
        block_m, block_n = max(16, block_m), max(16, block_n)
    pdl = config.pdl and rows <= PDL_ROWS
    _launch[(triton.cdiv(n, block_n),)](
        flat, weight, r, out, added, norm.weight if norm is not None else flat, h, rows, n, flat.stride(0), weight.stride(0), r.stride(0),
        out.stride(0), added.stride(0), h.stride(0), norm.eps if norm is not None else 0.0,
        K=k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_N=n % block_n == 0,
        EVEN_K=k % block_k == 0, ACCUMULATE=residual is not None, GATE=gate, PDL=pdl, EXACT=exact_products(x.dtype),
        NORM=NORMS[norm.form] if norm is not None else 0, ADD=adds, EARLY=config.early,
        num_warps=warps, launch_pdl=pdl,
    )  # fmt: skip
    out = out.view(*x.shape[:-1], n)
    return (out, h.view(x.shape)) if adds else out



# --- the table -----------------------------------------------------------------------------------
class DecodeGemmTableError(ValueError):
    """A decode-GEMM table that cannot be read; names the file and what is wrong."""


def table_path() -> Path | None:
    """The table file read: ``$FUSER_DECODE_GEMM_TABLE``, else this GPU's in the table directories."""
    return table_file(TABLE_ENV, TABLE_SUFFIX, current_gpu(), DecodeGemmTableError)


def config_for(n: int, k: int, dtype: torch.dtype) -> Config | None:
    """The kernel's configuration for a weight of ``n`` rows of ``k``, where the table says the
    kernel is the faster at one token or more; None: PyTorch's GEMM."""
    path = table_path()
    if path is None:
        return None
    return _read(str(path), path.stat().st_mtime_ns).get((n, k, str(dtype).removeprefix("torch.")))


@functools.lru_cache(maxsize=8)
def _read(path: str, mtime_ns: int) -> dict:
    where = f"decode-GEMM table {path}"
    entries = table_entries(path, where, DecodeGemmTableError)
    found = {}
    for i, entry in enumerate(entries):
        try:
            key = (int(entry["n"]), int(entry["k"]), str(entry["dtype"]))
            launches = [_launch_of(entry["config"])] + ([_launch_of(entry["config_rows"])] if "config_rows" in entry else [])
            up_to = int(entry["up_to"])
        except (KeyError, TypeError, ValueError) as e:
            raise DecodeGemmTableError(
                f'{where}: entry {i} needs "n", "k", "dtype", "up_to" and a "config" (and may have a "config_rows", at more '
                f'than one token row) of "block_n", "block_k" and "warps"; has {entry!r} ({type(e).__name__}: {e})'
            ) from None
        for block_n, block_k, warps in launches:
            if not (_power_of_2(block_n) and _power_of_2(block_k) and block_k >= 16 and warps >= 1):
                raise DecodeGemmTableError(f"{where}: entry {i}: block_n and block_k powers of 2, block_k 16 or more, warps 1 or more; "
                                           f"has {entry['config']!r}, {entry.get('config_rows')!r}")  # fmt: skip
        if up_to > 0:
            found[key] = Config(*launches[0], min(up_to, MAX_ROWS), rows=launches[1] if len(launches) > 1 else None)
    return found


def _launch_of(c: dict) -> tuple[int, int, int]:
    return int(c["block_n"]), int(c["block_k"]), int(c["warps"])


def _power_of_2(v: int) -> bool:
    return v >= 1 and v & (v - 1) == 0


@functools.lru_cache(maxsize=None)
def launcher(config: Config):
    """``F.linear`` (plus a residual) by the kernel under ``config``: what a fused graph calls."""

    def decode_linear(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, weight, config, residual)

    decode_linear.decode_gemm_config = config
    decode_linear.decode_gemm_launch = (config, launcher)
    return decode_linear


def config_of(target) -> Config | None:
    """The configuration of a fused graph's call target made by :func:`launcher`; None for any other."""
    return getattr(target, "decode_gemm_config", None)


def launch_of(target) -> tuple[Config, Callable[[Config], Callable]] | None:
    """For a fused graph's call target that runs the kernel (plain, adding the residual, gated, or
    with the norm's prologue): its configuration, and how to make the same call under another;
    None for any other target."""
    return getattr(target, "decode_gemm_launch", None)
