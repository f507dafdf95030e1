"""decode_attention: ``F.scaled_dot_product_attention`` of one query token per sequence (a decode
step) by fuser's own kernel, PyTorch's for any other call.

At decode the attention reads the cache (every key and value row of every key head) for one
query row per head: a read of a few hundred KB to a few MB, far below what a fused attention
kernel built for long queries (cuDNN's, flash's) is laid out for; on an H100 cuDNN's takes 6 µs
a layer for a 256-row cache of Llama-3.2-1B. The kernel gives each program one key head of one
sequence (the query heads of its group, padded to 16 rows, as one ``tl.dot`` against each block
of keys) over one slice of the keys, with the online softmax in fp32; the probabilities are
rounded to the values' dtype before their product with the values, as flash and cuDNN round
them. A call with more key rows than one slice runs the slices as programs of their own and a
second kernel combines them (each slice's running max, sum and weighted values); given counts
kept between calls (``counts``: one a key head of a sequence, zeroed), the program that
finishes a key head's slices last combines them instead, and the call is one launch.

A block of keys that the mask hides from every query head (``-inf`` in an additive mask,
``False`` in a boolean one) is not read: a static cache passes its whole length to the call
with the rows past the tokens written masked, and only the written ones are read. So is a block
an additive mask fills with a large negative value (cuDNN's -65504, ``finfo.min``) once each head
of the program has seen a key of its slice that the mask does not hide: such a key's weight,
``exp`` of a score 65504 below the largest, is 0 in fp32, as it is in PyTorch's kernels. (A slice
of hidden keys alone is read: a head that sees no key at all attends over them all, as in
PyTorch's.) A program reads the mask a block ahead: the next block's in flight while this one's
keys are read, so that only a slice's first block waits for its mask before its keys.

Taken: one query row (``q`` of ``[batch, heads, 1, dim]``), keys and values of ``[batch, key
heads, keys, dim]`` with the query heads a multiple of the key heads (``enable_gqa``, or as many
heads), the last dim contiguous, one dtype (fp32, fp16, bf16) on a CUDA GPU (or Triton's
interpreter), a mask of none, or additive of the query's dtype or boolean, broadcastable to
``[batch, heads, 1, keys]``; no dropout, not ``is_causal`` (which at one query row would be the
first key alone). Anything else runs PyTorch's. Launched with programmatic dependent launch where
the ``pdl`` pass is on and the GPU has it (waiting first, like fuser's row programs). A fused
graph calls it for one sequence (:data:`MAX_BATCH`); more run PyTorch's.
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from fuser.codegen.emit import forbid_compile_during_capture
from fuser.codegen.fast_launch import fast
from fuser.install.kv_cache import move_length_on
from fuser.install.rounding import exact_products, to_dtype

#: Keys a block of the loop (rows of one ``tl.dot``); a slice of the keys is a multiple of it.
BLOCK_S = 64
#: The query heads a program holds, at least (``tl.dot``'s smallest tile).
MIN_ROWS = 16
#: The most heads of a key head's group (beyond it, PyTorch's: a program's registers).
MAX_GROUP = 64
#: The most sequences a call the kernel takes: one. At batch 8 on an H100 cuDNN's attention was
#: the faster (Llama-3.2-1B's step 1356 µs on cuDNN's, 1413 on the kernel; at batch 1 1114 and
#: 1080), and at 528 programs flash's still is but at 1024 keys (benchmarks/results/README.md).
MAX_BATCH = 1
#: Programs a call aims at where heads are 64 wide or less (four an SM of an H100 or H200): the keys
#: are sliced until there are as many. At long caches a program an SM left the memory idle:
#: Llama-3.2-1B's heads at 16384 keys took 36.7 µs a call at 132 programs, 18.3 at 528 (an H100;
#: benchmarks/results/README.md, "The attention kernel's slices"). Wider heads aim at as many
#: fewer: a program of 128-wide heads holds twice the registers, so half as many run at once, and
#: a second wave of slices cost more than it read (Qwen3-8B's heads at 4096 keys 12.2 µs at 264
#: programs, 14.7 at 528; "The mask read a block ahead").
PROGRAMS = 528
#: Slices the combining kernel reads at a time.
CHUNK = 16
#: The most partial values (fp32, of its query heads by the slices read at once) a program combining
#: its key head's slices holds: 64 registers a thread of its four warps.
FOLD_ELEMENTS = 8192
#: An additive mask's values at or below this hide a key (cuDNN's fill, ``finfo.min``, ``-inf``).
HIDDEN = -65504.0
#: Mask kinds (``MASK``): none, additive, boolean.
NO_MASK, ADDITIVE, BOOLEAN = 0, 1, 2


@triton.jit
def _product(a, b, EXACT: tl.constexpr):
    """``a @ b`` summed in fp32: half operands on the tensor cores; with ``EXACT`` each operand
    as fp32 and the products in fp32, not tf32."""
    if EXACT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)



@triton.jit
def _bias(m_ptr, b, heads, g_ok, first, end, m_b, m_h, m_s, MASK: tl.constexpr, BLOCK_S: tl.constexpr):
    """The mask of the block of keys from ``first`` (``-inf`` past ``end`` and for padded heads),
    as an fp32 bias of ``[heads, keys]``."""
    s = first + tl.arange(0, BLOCK_S)
    ok = g_ok[:, None] & (s < end)[None, :]
    if MASK == 1:
        return tl.load(m_ptr + b * m_b + heads[:, None] * m_h + s[None, :] * m_s, mask=ok, other=float("-inf")).to(tl.float32)
    if MASK == 2:
        seen = tl.load(m_ptr + b * m_b + heads[:, None] * m_h + s[None, :] * m_s, mask=ok, other=0)
        return tl.where(seen != 0, 0.0, float("-inf"))
    return tl.where(ok, 0.0, float("-inf"))


@triton.jit
def _attend(
    q_ptr, k_ptr, v_ptr, m_ptr, o_ptr, part_ptr, stat_ptr, new_k_ptr, new_v_ptr, length_ptr, done_ptr, count_ptr,
    S, per_slice, scale, heads_kv,
    q_b, q_h, k_b, k_h, k_s, v_b, v_h, v_s, m_b, m_h, m_s, o_b, o_h, nk_b, nk_h, nv_b, nv_h,
    GROUP: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    MASK: tl.constexpr, SLICED: tl.constexpr, WRITE: tl.constexpr, COMBINE: tl.constexpr, FOLD: tl.constexpr,
    EXACT: tl.constexpr, PDL: tl.constexpr, HIDDEN: tl.constexpr,
):  # fmt: skip
    """One program: the query heads of key head ``kvh`` of sequence ``b`` against the keys of
    slice ``pid(1)``; the output where the call has one slice, else the slice's running max, sum
    and unnormalised weighted values for :func:`_combine` (with ``COMBINE``, for the last program
    of the key head's slices to finish, which combines them: :func:`_combine_group`). With
    ``WRITE`` the step's new key and value rows are written at the cache's length first (by the
    program whose slice holds that slot; one past the cache is dropped) and read from the
    registers where the loop meets them; the last program to finish moves the length on by one."""
    if PDL:
        gdc_wait()  # launched early: wait until the kernel before has finished and its writes are seen
        gdc_launch_dependents()
    bh = tl.program_id(0)
    piece = tl.program_id(1)
    b = bh // heads_kv
    kvh = bh % heads_kv
    g = tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    g_ok, d_ok = g < GROUP, d < D
    start = piece * per_slice
    end = tl.minimum(start + per_slice, S)
    if WRITE:
        length = tl.load(length_ptr)
        new_k = tl.load(new_k_ptr + b * nk_b + kvh * nk_h + d, mask=d_ok, other=0.0)
        new_v = tl.load(new_v_ptr + b * nv_b + kvh * nv_h + d, mask=d_ok, other=0.0)
        if (start <= length) & (length < end):
            tl.store(k_ptr + b * k_b + kvh * k_h + length * k_s + d, new_k, mask=d_ok)
            tl.store(v_ptr + b * v_b + kvh * v_h + length * v_s + d, new_v, mask=d_ok)
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + b * q_b + heads[:, None] * q_h + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full((ROWS,), float("-inf"), tl.float32)
    l_i = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, BLOCK_D), tl.float32)
    best = tl.full((ROWS,), float("-inf"), tl.float32)  # each head's largest mask value so far
    next_bias = _bias(m_ptr, b, heads, g_ok, start, end, m_b, m_h, m_s, MASK, BLOCK_S)
    first = start
    while first < end:
        s = first + tl.arange(0, BLOCK_S)
        s_ok = s < end
        if MASK == 0:  # no mask: the keys past the slice hidden
            bias = _bias(m_ptr, b, heads, g_ok, first, end, m_b, m_h, m_s, MASK, BLOCK_S)
        else:  # the next block's mask in flight while this block is read
            bias = next_bias
            next_bias = _bias(m_ptr, b, heads, g_ok, first + BLOCK_S, end, m_b, m_h, m_s, MASK, BLOCK_S)
        first += BLOCK_S
        top = tl.max(bias, axis=1)
        skip = tl.max(top, axis=0) == float("-inf")
        if MASK == 1:  # hidden by a large negative fill, where every head has seen a key it does not hide
            seen = tl.min(tl.where(g_ok, best, float("inf")), axis=0) > HIDDEN
            skip = skip | ((tl.max(top, axis=0) <= HIDDEN) & seen)
        best = tl.maximum(best, top)
        if not skip:  # a block the mask hides from every head is not read
            k = tl.load(k_ptr + b * k_b + kvh * k_h + s[:, None] * k_s + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
            if WRITE:  # the new row as written, whichever of the program's threads wrote it
                k = tl.where((s_ok & (s == length))[:, None], new_k[None, :], k)
            scores = _product(q, tl.trans(k), EXACT)
            scores = scores * scale + bias
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: nothing to scale
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + b * v_b + kvh * v_h + s[:, None] * v_s + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
            if WRITE:
                v = tl.where((s_ok & (s == length))[:, None], new_v[None, :], v)
            acc = acc * alpha[:, None] + _product(to_dtype(p, v.dtype), v, EXACT)
            m_i = m_new
    if SLICED:
        row = (b * heads_kv * GROUP + heads) * tl.num_programs(1) + piece
        tl.store(part_ptr + row[:, None] * BLOCK_D + d[None, :], acc, mask=g_ok[:, None])
        tl.store(stat_ptr + row * 2, m_i, mask=g_ok)
        tl.store(stat_ptr + row * 2 + 1, l_i, mask=g_ok)
        if COMBINE:
            # Every thread's stores before the count (acq_rel: released by it, and seen by the
            # program that counts last, after its own acquire); that program sets the count back.
            tl.debug_barrier()
            if tl.atomic_add(count_ptr + bh, 1) == tl.num_programs(1) - 1:
                _combine_group(part_ptr, stat_ptr, o_ptr, b, heads, g_ok, d, d_ok, (b * heads_kv * GROUP + heads) * tl.num_programs(1),
                               tl.num_programs(1), o_b, o_h, FOLD)  # fmt: skip
                tl.store(count_ptr + bh, 0)
    else:
        out = acc / l_i[:, None]
        tl.store(o_ptr + b * o_b + heads[:, None] * o_h + d[None, :], to_dtype(out, o_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    if WRITE:
        move_length_on(length_ptr, done_ptr, length, 1, tl.num_programs(0) * tl.num_programs(1))


@triton.jit
def _combine_group(part_ptr, stat_ptr, o_ptr, b, heads, g_ok, d, d_ok, first, slices, o_b, o_h, FOLD: tl.constexpr):
    """The output of a key head's query heads ``heads`` (rows ``first`` of the parts and stats,
    their ``slices`` in a row): their slices' weighted values, rescaled to the largest max and
    summed, :data:`FOLD` slices at a time (read past L1: other programs wrote them)."""
    p = tl.arange(0, FOLD)
    m_run = tl.full(g_ok.shape, float("-inf"), tl.float32)
    l_run = tl.zeros(g_ok.shape, tl.float32)
    acc = tl.zeros((g_ok.shape[0], d.shape[0]), tl.float32)
    start = 0
    while start < slices:
        rows = first[:, None] + start + p[None, :]
        ok = g_ok[:, None] & (start + p < slices)[None, :]
        start += FOLD
        m = tl.load(stat_ptr + rows * 2, mask=ok, other=float("-inf"), cache_modifier=".cg")
        l = tl.load(stat_ptr + rows * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
        parts = tl.load(part_ptr + rows[:, :, None] * d.shape[0] + d[None, None, :], mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
        top = tl.maximum(m_run, tl.max(m, axis=1))
        safe = tl.where(top == float("-inf"), 0.0, top)
        alpha = tl.exp(m_run - safe)
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - safe[:, None]))
        acc = acc * alpha[:, None] + tl.sum(parts * w[:, :, None], axis=1)
        l_run = l_run * alpha + tl.sum(l * w, axis=1)
        m_run = top
    out = acc / l_run[:, None]
    tl.store(o_ptr + b * o_b + heads[:, None] * o_h + d[None, :], to_dtype(out, o_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _combine(part_ptr, stat_ptr, o_ptr, heads, o_b, o_h, slices, CHUNK: tl.constexpr,
             D: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """One program a query head: its slices' weighted values, rescaled to the largest max and
    summed, :data:`CHUNK` slices at a time (the count of slices is an argument: a cache that
    grows a key a step compiles nothing new, and a short one reads one chunk)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    bh = tl.program_id(0)
    j = tl.arange(0, CHUNK)
    d = tl.arange(0, BLOCK_D)
    first = bh * slices
    tops = tl.full((CHUNK,), float("-inf"), tl.float32)
    start = 0
    while start < slices:
        m = tl.load(stat_ptr + (first + start + j) * 2, mask=start + j < slices, other=float("-inf"))
        tops = tl.maximum(tops, m)
        start += CHUNK
    top = tl.max(tops, axis=0)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    sums = tl.zeros((CHUNK,), tl.float32)
    start = 0
    while start < slices:
        row = first + start + j
        j_ok = start + j < slices
        start += CHUNK
        m = tl.load(stat_ptr + row * 2, mask=j_ok, other=float("-inf"))
        l = tl.load(stat_ptr + row * 2 + 1, mask=j_ok, other=0.0)
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
        parts = tl.load(part_ptr + row[:, None] * BLOCK_D + d[None, :], mask=j_ok[:, None], other=0.0)
        acc += tl.sum(parts * w[:, None], axis=0)
        sums += l * w
    out = acc / tl.sum(sums, axis=0)
    tl.store(o_ptr + (bh // heads) * o_b + (bh % heads) * o_h + d, to_dtype(out, o_ptr.dtype.element_ty), mask=d < D)


for _kernel in (_attend, _combine):
    forbid_compile_during_capture(_kernel, Path(__file__))  # warm-ups at each shape compile it first
_attend_launch, _combine_launch = fast(_attend), fast(_combine)


def _mask_kind(mask, q: torch.Tensor, batch: int, heads: int, keys: int) -> int | None:
    """The kernel's kind of ``mask`` (:data:`NO_MASK`, :data:`ADDITIVE`, :data:`BOOLEAN`); None
    for one it does not take."""
    if mask is None:
        return NO_MASK
    if not isinstance(mask, torch.Tensor) or mask.device != q.device or mask.dim() > 4:
        return None
    try:
        torch.broadcast_shapes(mask.shape, (batch, heads, 1, keys))
    except RuntimeError:
        return None
    if mask.dim() == 4 and mask.shape[2] != 1 or (mask.dim() >= 1 and mask.shape[-1] != keys):
        return None  # (a mask of one key broadcast over the keys is rare: PyTorch's)
    if mask.dtype == torch.bool:
        return BOOLEAN
    return ADDITIVE if mask.dtype == q.dtype else None


def takes(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False) -> bool:
    """Does the kernel take this call (see the module's docstring)?"""
    tensors = (q, k, v)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in tensors) or dropout_p != 0.0 or is_causal:
        return False
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or not (q.dtype == k.dtype == v.dtype):
        return False
    if not (q.device == k.device == v.device) or any(t.requires_grad for t in tensors) and torch.is_grad_enabled():
        return False
    batch, heads, rows, dim = q.shape
    if rows != 1 or k.shape != v.shape or k.shape[0] != batch or k.shape[3] != dim or dim > 256 or k.shape[2] == 0:
        return False
    heads_kv = k.shape[1]
    if heads % heads_kv or (heads != heads_kv and not enable_gqa) or heads // heads_kv > MAX_GROUP:
        return False
    if any(t.stride(3) != 1 for t in tensors):
        return False
    return _mask_kind(attn_mask, q, batch, heads, k.shape[2]) is not None


def takes_write(k, v, new_k, new_v, length, done) -> bool:
    """Can the kernel write ``new_k`` and ``new_v`` into the cache ``k``, ``v`` at ``length``
    (see :func:`attention`'s ``write``)?"""
    tensors = (new_k, new_v, length, done)
    if not all(isinstance(t, torch.Tensor) and t.device == k.device for t in tensors):
        return False
    batch, heads_kv, _, dim = k.shape
    if new_k.shape != (batch, heads_kv, 1, dim) or new_v.shape != new_k.shape or new_k.dtype != k.dtype or new_v.dtype != v.dtype:
        return False
    if new_k.stride(3) != 1 or new_v.stride(3) != 1 or new_k.requires_grad or new_v.requires_grad:
        return False
    return length.numel() == 1 and not length.is_floating_point() and done.numel() == 1 and done.dtype == torch.int32


def takes_counts(counts, batch: int, heads_kv: int, device) -> bool:
    """Is ``counts`` an int32 tensor of a count for each of ``batch × heads_kv`` key heads on
    ``device`` (see :func:`attention`)?"""
    return (isinstance(counts, torch.Tensor) and counts.dtype == torch.int32 and counts.device == device
            and counts.is_contiguous() and counts.numel() >= batch * heads_kv)  # fmt: skip


def fold(rows: int, block_d: int) -> int:
    """Slices the combining program reads at a time: up to :data:`FOLD_ELEMENTS` partial values
    of its rows, 8 slices at most."""
    return max(1, min(8, FOLD_ELEMENTS // (rows * block_d)))


def slices(batch: int, heads_kv: int, keys: int, dim: int) -> int:
    """Slices of the keys: as many as give about :data:`PROGRAMS` programs (fewer in proportion
    for heads wider than 64), each a multiple of :data:`BLOCK_S` keys."""
    blocks = triton.cdiv(keys, BLOCK_S)
    programs = PROGRAMS * 64 // max(dim, 64)
    return max(1, min(blocks, programs // max(batch * heads_kv, 1)))


def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, pdl=False, write=None,
              counts=None):  # fmt: skip
    """``F.scaled_dot_product_attention(q, k, v, ...)``: by the kernel where :func:`takes` says
    so, by PyTorch's otherwise. ``write``, where given, is ``(new_k, new_v, length, done)``: the
    step's key and value rows (``[batch, key heads, 1, dim]``, the last dim contiguous) that the
    kernel writes into ``k`` and ``v`` at slot ``length`` (a one-element int tensor on the device,
    moved on by one) before it attends, ``done`` a zeroed int32 count of its programs (see
    :func:`takes_write`; the caller checks that it does). ``counts``, where given, is a zeroed
    int32 tensor of a count for each key head of each sequence, kept zeroed between calls (the
    kernel sets each back; :func:`takes_counts`): a call of several slices then combines them in
    the program that finishes a key head's last, not in a second kernel. A tensor kept beside a
    static cache serves, used by one call at a time."""
    if not takes(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        if write is not None:
            raise ValueError("decode_attention.attention: a write into the cache is given with a call the kernel does not take")
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                              scale=scale, enable_gqa=enable_gqa)  # fmt: skip
    batch, heads, _, dim = q.shape
    heads_kv, keys = k.shape[1], k.shape[2]
    group = heads // heads_kv
    kind = _mask_kind(attn_mask, q, batch, heads, keys)
    mask = attn_mask.expand(batch, heads, 1, keys) if kind != NO_MASK else q
    m_strides = (mask.stride(0), mask.stride(1), mask.stride(3)) if kind != NO_MASK else (0, 0, 0)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    pieces = slices(batch, heads_kv, keys, dim)
    per_slice = triton.cdiv(triton.cdiv(keys, pieces), BLOCK_S) * BLOCK_S
    pieces = triton.cdiv(keys, per_slice)
    block_d = max(16, triton.next_power_of_2(dim))  # (tl.dot's smallest)
    sliced = pieces > 1
    parts = torch.empty((batch * heads * pieces, block_d), dtype=torch.float32, device=q.device) if sliced else out
    stats = torch.empty((batch * heads * pieces, 2), dtype=torch.float32, device=q.device) if sliced else out
    new_k, new_v, length, done = write if write is not None else (q, q, q, q)
    if counts is not None and not takes_counts(counts, batch, heads_kv, q.device):
        raise ValueError(f"decode_attention.attention: counts of {counts.numel()} {counts.dtype} on {counts.device} "
                         f"given for {batch * heads_kv} key heads on {q.device} (a zeroed int32 tensor of one each)")  # fmt: skip
    combine = sliced and counts is not None
    rows = max(MIN_ROWS, triton.next_power_of_2(group))
    _attend_launch[(batch * heads_kv, pieces)](
        q, k, v, mask, out, parts, stats, new_k, new_v, length, done, counts if combine else q,
        keys, per_slice, 1.0 / math.sqrt(dim) if scale is None else float(scale), heads_kv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        *m_strides, out.stride(0), out.stride(1), new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1),
        GROUP=group, ROWS=rows, D=dim, BLOCK_D=block_d, BLOCK_S=BLOCK_S, MASK=kind, SLICED=sliced,
        WRITE=write is not None, COMBINE=combine, FOLD=fold(rows, block_d), EXACT=exact_products(q.dtype), PDL=pdl,
        HIDDEN=HIDDEN, num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
    if sliced and not combine:
        _combine_launch[(batch * heads,)](
            parts, stats, out, heads, out.stride(0), out.stride(1), pieces,
            CHUNK=CHUNK, D=dim, BLOCK_D=block_d, PDL=pdl, num_warps=1 if CHUNK * block_d <= 2048 else 4, launch_pdl=pdl,
        )  # fmt: skip
    return out


@functools.lru_cache(maxsize=None)
def launcher(pdl: bool):
    """``F.scaled_dot_product_attention`` by :func:`attention` for up to :data:`MAX_BATCH`
    sequences, launched with PDL where ``pdl``: what a fused graph calls."""

    def decode_attention(*args, **kwargs):
        q = args[0] if args else kwargs.get("query")
        if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[0] > MAX_BATCH:
            return F.scaled_dot_product_attention(*args, **kwargs)
        return attention(*args, **kwargs, pdl=pdl)

    decode_attention.decode_attention_pdl = pdl
    return decode_attention
