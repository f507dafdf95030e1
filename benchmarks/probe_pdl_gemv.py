"""Probe: can a decode GEMV of fuser's own beat cuBLAS *in a chain*, by reading its weights before
it waits for the kernel before it (programmatic dependent launch)?

A decode step at batch 1 is a chain of small kernels: glue, a GEMV, glue, a GEMV... cuBLAS's
GEMVs run at about 64 % of the copy bandwidth in Llama-3.2-1B's step (benchmarks/results), and
each waits for the kernel before it to end before it starts reading. A GEMV launched with PDL
can load its first block of weights (which no kernel before it writes) while that kernel still
runs, then ``gdc_wait()`` before it reads the activation. This probe times one Llama-3.2-1B
layer's four GEMV shapes (q/k/v merged, o, gate/up merged, down) chained with a row-program glue
kernel between each, 16 layers of distinct weights, captured in a CUDA graph and replayed:

* ``cublas``           — glue, then ``F.linear`` (today's step without PDL);
* ``cublas, pdl glue`` — the glue launched with PDL (today's step);
* ``gemv``             — glue and a Triton GEMV, no PDL;
* ``gemv, pdl``        — both with PDL, the GEMV waiting first;
* ``gemv, pdl, early`` — both with PDL, the GEMV loading its first weight block before it waits.

    PYTHONPATH=. python benchmarks/probe_pdl_gemv.py [--layers 16] [--out FILE.json]

Printed (and written as JSON): each GEMV configuration's time alone, the best per shape, its
error against ``F.linear``, and each chain's µs per step with the weights' bandwidth.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fuser.tools.capture import replay_time_us

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # (an older Triton: no PDL)
    gdc_launch_dependents = gdc_wait = None

HIDDEN, QKV, MLP = 2048, 3072, 8192
#: (name, rows N of the weight, reduction K): one Llama-3.2-1B layer's GEMVs at one token
SHAPES = (("qkv", QKV, HIDDEN), ("o", HIDDEN, HIDDEN), ("gate_up", 2 * MLP, HIDDEN), ("down", HIDDEN, MLP))
#: (BLOCK_N, BLOCK_K, warps) tried per shape
CONFIGS = ((4, 2048, 4), (8, 2048, 4), (8, 1024, 4), (16, 1024, 8), (8, 2048, 8), (16, 512, 4))


@triton.jit
def _gemv(x_ptr, w_ptr, y_ptr, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          PDL: tl.constexpr, EARLY: tl.constexpr):  # fmt: skip
    """y[n] = sum_k w[n, k] x[k], BLOCK_N rows of the weight a program (N a multiple of it)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    if PDL and not EARLY:
        gdc_wait()
    w = tl.load(w_ptr + rows[:, None] * K + ks[None, :])
    if PDL:
        if EARLY:
            gdc_wait()  # the weights are no kernel's output; the activation is
        gdc_launch_dependents()
    x = tl.load(x_ptr + ks)
    acc = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    for start in range(BLOCK_K, K, BLOCK_K):
        w = tl.load(w_ptr + rows[:, None] * K + start + ks[None, :])
        x = tl.load(x_ptr + start + ks)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty))


@triton.jit
def _glue(x_ptr, y_ptr, K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """A row program standing in for the glue between GEMVs: the first K values of x, RMS-normed."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    offs = tl.arange(0, BLOCK)
    ok = offs < K
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / K + 1e-6)
    tl.store(y_ptr + offs, (x * r).to(y_ptr.dtype.element_ty), mask=ok)


def gemv(x, w, y, config, pdl=False, early=False):
    block_n, block_k, warps = config
    n, k = w.shape
    _gemv[(n // block_n,)](x, w, y, K=k, BLOCK_N=block_n, BLOCK_K=min(block_k, k), PDL=pdl, EARLY=early,
                           num_warps=warps, launch_pdl=pdl)  # fmt: skip


def glue(x, y, k, pdl=False):
    _glue[(1,)](x, y, K=k, BLOCK=triton.next_power_of_2(k), PDL=pdl, num_warps=8, launch_pdl=pdl)


def graph_us(fn, replays=20) -> float:
    """µs per call of ``fn`` captured in a CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return replay_time_us(graph, replays)


def tune(weights) -> dict:
    """Each shape's configurations timed alone (50 calls in a graph, weights rotating over the
    layers so that no call finds its weight in L2), the best kept, checked against F.linear."""
    best, rows = {}, []
    for name, n, k in SHAPES:
        ws = weights[name]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        cublas = graph_us(lambda: [F.linear(x, w) for w in ws]) / len(ws)
        for config in CONFIGS:
            if n % config[0] or (k > config[1] and k % config[1]):
                continue
            us = graph_us(lambda: [gemv(x, w, y, config) for w in ws]) / len(ws)
            gemv(x, ws[0], y, config)
            expected = F.linear(x, ws[0]).float()
            err = ((y.float() - expected).norm() / expected.norm()).item()
            rows.append(dict(shape=name, config=config, us=round(us, 2), cublas_us=round(cublas, 2), rel_err=err))
            print(f"{name:>8} {config}: {us:7.2f} µs (cuBLAS {cublas:6.2f}), rel err {err:.1e}", flush=True)
            if err < 1e-2 and (name not in best or us < best[name][1]):
                best[name] = (config, us)
    return {"configs": rows, "best": {k: dict(config=v[0], us=round(v[1], 2)) for k, v in best.items()}}


def chain(weights, layers, variant, best):
    """One step's calls: per layer glue -> qkv -> glue -> o -> glue -> gate_up -> glue -> down."""
    pdl_glue = variant != "cublas"
    ours = variant.startswith("gemv")
    pdl_gemv, early = variant in ("gemv, pdl", "gemv, pdl, early"), variant == "gemv, pdl, early"
    buffers = {name: torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for name, n, _ in SHAPES}
    acts = {name: torch.empty(1, k, device="cuda", dtype=torch.bfloat16) for name, _, k in SHAPES}
    hidden = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    source = {"o": "qkv", "gate_up": "o", "down": "gate_up", "qkv": "down"}  # the GEMV before each

    def step():
        for i in range(layers):
            for name, _, k in SHAPES:
                glue(buffers[source[name]] if (i or name != "qkv") else hidden, acts[name], k, pdl_glue)
                if ours:
                    gemv(acts[name], weights[name][i], buffers[name], best[name]["config"], pdl_gemv, early)
                else:  # F.linear's own call at one row: x @ W^T
                    torch.mm(acts[name], weights[name][i].t(), out=buffers[name])

    return step


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    weights = {name: [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(args.layers)]
               for name, n, k in SHAPES}  # fmt: skip
    result = {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__}
    result.update(tune(weights))
    layer_bytes = sum(n * k * 2 for _, n, k in SHAPES)
    result["weight_bytes"] = layer_bytes * args.layers
    result["chains"] = {}
    for variant in ("cublas", "cublas, pdl glue", "gemv", "gemv, pdl", "gemv, pdl, early"):
        if variant.startswith("gemv") and len(result["best"]) < len(SHAPES):
            continue
        us = graph_us(chain(weights, args.layers, variant, result["best"]))
        gbps = result["weight_bytes"] / (us * 1e-6) / 1e9
        result["chains"][variant] = dict(us=round(us, 1), weight_gbps=round(gbps))
        print(f"{variant:>18}: {us:8.1f} µs a step of {args.layers} layers, weights at {gbps:6.0f} GB/s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
