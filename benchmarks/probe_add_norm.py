"""Probe kernel shapes for a residual add + RMSNorm over wide rows: fuser's row program, one
program holding the whole row, against hand-written variants that walk the row in chunks
(two passes: sum of squares, then normalise) or hold several rows a program, and against
torch.compile's kernel for the same chain.

    PYTHONPATH=. python benchmarks/probe_add_norm.py [--tokens 1,128,512,2048] [--variants ordered] [--out FILE]

A measurement for choosing the kernel shape, not a benchmark of fuser: each variant is timed
as ``fuser tune`` times kernels (100 launches in one CUDA graph, replayed). bf16, 4096 wide
(Llama-3-8B / Qwen3-8B). Writes JSON: µs per (variant, T).
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

HIDDEN, EPS = 4096, 1e-6


@triton.jit
def _whole_rows(x_ptr, r_ptr, w_ptr, h_ptr, y_ptr, n_rows, N: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, N)[None, :]
    mask = rows < n_rows
    x = tl.load(x_ptr + rows * N + cols, mask=mask, other=0.0)
    r = tl.load(r_ptr + rows * N + cols, mask=mask, other=0.0)
    h = (x.to(tl.float32) + r.to(tl.float32)).to(tl.bfloat16, fp_downcast_rounding="rtne")
    tl.store(h_ptr + rows * N + cols, h, mask=mask)
    f = h.to(tl.float32)
    inv = tl.rsqrt(tl.sum(f * f, axis=1)[:, None] / N + 1e-6)
    y = (f * inv).to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
    w = tl.load(w_ptr + cols).to(tl.float32)
    tl.store(y_ptr + rows * N + cols, (w * y).to(tl.bfloat16, fp_downcast_rounding="rtne"), mask=mask)


@triton.jit
def _ordered(x_ptr, r_ptr, w_ptr, h_ptr, y_ptr, N: tl.constexpr, STORE_EARLY: tl.constexpr, LOAD_LATE: tl.constexpr):
    """One program a row, the whole row in a block, as fuser's row program holds it: the
    operands loaded first or where first used, each result stored where computed or last."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, N)
    x = tl.load(x_ptr + row * N + cols)
    r = tl.load(r_ptr + row * N + cols)
    if not LOAD_LATE:
        w = tl.load(w_ptr + cols)
    h = (x.to(tl.float32) + r.to(tl.float32)).to(tl.bfloat16, fp_downcast_rounding="rtne")
    if STORE_EARLY:
        tl.store(h_ptr + row * N + cols, h)
    f = h.to(tl.float32)
    inv = tl.expand_dims(tl.sum(f * f, axis=0), 0) / N + 1e-6
    y = (f * tl.rsqrt(inv)).to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
    if LOAD_LATE:
        w = tl.load(w_ptr + cols)
    out = (w.to(tl.float32) * y).to(tl.bfloat16, fp_downcast_rounding="rtne")
    if not STORE_EARLY:
        tl.store(h_ptr + row * N + cols, h)
    tl.store(y_ptr + row * N + cols, out)


@triton.jit
def _chunked(x_ptr, r_ptr, w_ptr, h_ptr, y_ptr, N: tl.constexpr, CHUNK: tl.constexpr, RELOAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((CHUNK,), tl.float32)
    for start in tl.range(0, N, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + row * N + cols, eviction_policy="evict_last")
        r = tl.load(r_ptr + row * N + cols, eviction_policy="evict_last")
        h = (x.to(tl.float32) + r.to(tl.float32)).to(tl.bfloat16, fp_downcast_rounding="rtne")
        tl.store(h_ptr + row * N + cols, h)
        f = h.to(tl.float32)
        acc += f * f
    inv = tl.rsqrt(tl.sum(acc, axis=0) / N + 1e-6)
    for start in tl.range(0, N, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        if RELOAD:
            h = tl.load(h_ptr + row * N + cols, eviction_policy="evict_first")
        else:
            x = tl.load(x_ptr + row * N + cols, eviction_policy="evict_first")
            r = tl.load(r_ptr + row * N + cols, eviction_policy="evict_first")
            h = (x.to(tl.float32) + r.to(tl.float32)).to(tl.bfloat16, fp_downcast_rounding="rtne")
        f = h.to(tl.float32)
        y = (f * inv).to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
        w = tl.load(w_ptr + cols, eviction_policy="evict_last").to(tl.float32)
        tl.store(y_ptr + row * N + cols, (w * y).to(tl.bfloat16, fp_downcast_rounding="rtne"))


def whole_rows(rows: int, warps: int):
    def launch(x, r, w):
        h, y = torch.empty_like(x), torch.empty_like(x)
        T = x.shape[0]
        _whole_rows[(triton.cdiv(T, rows),)](x, r, w, h, y, T, N=HIDDEN, ROWS=rows, num_warps=warps)
        return y, h

    return launch


def ordered(store_early: bool, load_late: bool, warps: int):
    def launch(x, r, w):
        h, y = torch.empty_like(x), torch.empty_like(x)
        _ordered[(x.shape[0],)](x, r, w, h, y, N=HIDDEN, STORE_EARLY=store_early, LOAD_LATE=load_late, num_warps=warps)
        return y, h

    return launch


def chunked(chunk: int, warps: int, reload: bool):
    def launch(x, r, w):
        h, y = torch.empty_like(x), torch.empty_like(x)
        _chunked[(x.shape[0],)](x, r, w, h, y, N=HIDDEN, CHUNK=chunk, RELOAD=reload, num_warps=warps)
        return y, h

    return launch


def variants():
    found = {}
    for store_early in (False, True):
        for load_late in (False, True):
            for warps in (4, 8):
                name = f"ordered store={'early' if store_early else 'last'} load={'late' if load_late else 'first'} warps={warps}"
                found[name] = ordered(store_early, load_late, warps)
    for rows in (1, 2, 4):
        for warps in (4, 8, 16):
            found[f"whole rows={rows} warps={warps}"] = whole_rows(rows, warps)
    for reload in (False, True):
        for chunk in (512, 1024, 2048):
            for warps in (2, 4, 8):
                found[f"chunked {'reload' if reload else 'recompute'} chunk={chunk} warps={warps}"] = chunked(chunk, warps, reload)
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,128,512,2048")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--variants", default="", help="only the hand-written variants whose name holds this")
    args = parser.parse_args()
    import fuser
    from bench_kernels import AddNorm
    from fuser.tools.tune import time_launches_us

    results = {}
    for T in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(T, HIDDEN, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(T, HIDDEN, device="cuda", dtype=torch.bfloat16)
        reference = AddNorm().to("cuda", torch.bfloat16).eval()
        w = reference.norm.weight.detach()
        with torch.no_grad():
            want_y, want_h = reference(x, r)
        fused = AddNorm().to("cuda", torch.bfloat16).eval()
        fused.load_state_dict(reference.state_dict())
        fuser.apply(fused, (x, r))
        compiled = torch.compile(reference, dynamic=False)
        timed = {"fuser": (fused, (x, r)), "compile": (compiled, (x, r))}
        timed.update({name: (launch, (x, r, w)) for name, launch in variants().items() if args.variants in name})
        for name, (launch, inputs) in timed.items():
            with torch.no_grad():
                y, h = launch(*inputs)
            error = max((y.float() - want_y.float()).abs().max().item(), (h.float() - want_h.float()).abs().max().item())
            us = time_launches_us(launch, inputs, launches=100, replays=50, warmups=3)
            results[f"{name} / {T}"] = dict(us=round(us, 3), max_error=error)
            print(f"T={T} {name}: {us:.3f} µs (max error {error:.3g})", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
