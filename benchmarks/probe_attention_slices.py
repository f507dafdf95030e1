"""Probe: into how many slices should the decode attention kernel cut the keys, and where does it
beat PyTorch's attention?

``fuser.install.decode_attention`` cuts the keys into slices until about ``PROGRAMS`` programs
run, and a second kernel combines the slices. Too few slices leave the memory idle at long
caches; too many pay for the combining. This probe chains 16 attention calls (one a layer, each
query the output of the one before, each its own cache, as a decode step does), captures the
chain in a CUDA graph with PDL and times a replay, with the slices forced to 1 to 256 (at one
sequence) and as the kernel chooses them for targets of 132 to 1056 programs (``auto@N``: its
``PROGRAMS`` set to N, which 128-wide heads halve), beside
PyTorch's ``F.scaled_dot_product_attention`` (``sdpa``), for Llama-3.2-1B's heads (32 query, 8
key, 64 wide) and Qwen3-8B's (32, 8, 128) at several cache lengths and sequence counts. With
``--masked`` each call gets transformers' static-cache mask instead (its last 96 slots hidden).

    PYTHONPATH=. python benchmarks/probe_attention_slices.py [--batches 1,8] [--masked] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from fuser.install import decode_attention
from fuser.tools.capture import replay_time_us

SHAPES = {"llama_1b": (32, 8, 64), "qwen3_8b": (32, 8, 128)}
KEYS = (256, 1024, 4096, 16384)
FORCED = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: Targets of programs for the kernel's own choice (its ``PROGRAMS``), compared as "auto@N".
PROGRAMS = (132, 264, 528, 1056)
LAYERS = 16
ROOM = 96  # a masked cache's slots past the tokens (as bench_decode's)


def chain_us(attend, batch: int, heads: int, heads_kv: int, dim: int, keys: int, layers: int = LAYERS, masked: bool = False) -> float:
    g = torch.Generator(device="cuda").manual_seed(0)
    mask = None
    if masked:  # transformers' static cache: the last ROOM slots not written yet, filled with finfo.min
        mask = torch.zeros(batch, 1, 1, keys, device="cuda", dtype=torch.bfloat16)
        mask[..., keys - ROOM :] = torch.finfo(torch.bfloat16).min
    caches = [(torch.randn(batch, heads_kv, keys, dim, device="cuda", dtype=torch.bfloat16, generator=g),
               torch.randn(batch, heads_kv, keys, dim, device="cuda", dtype=torch.bfloat16, generator=g)) for _ in range(layers)]  # fmt: skip
    q = torch.randn(batch, heads, 1, dim, device="cuda", dtype=torch.bfloat16, generator=g)

    def step():
        x = q
        for k, v in caches:
            x = attend(x, k, v, mask)
        return x

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return replay_time_us(graph, 100) / layers


def kernel(q, k, v, mask=None):
    return decode_attention.attention(q, k, v, mask, enable_gqa=True, pdl=True)


def sdpa(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1")
    p.add_argument("--masked", action="store_true", help="give each call transformers' static-cache mask")
    p.add_argument("--out")
    args = p.parse_args(argv)
    chosen = decode_attention.slices
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for model, (heads, heads_kv, dim) in SHAPES.items():
            for keys in KEYS:
                shape = (batch, heads, heads_kv, dim, keys)
                row = {"model": model, "batch": batch, "keys": keys, "auto_slices": chosen(batch, heads_kv, keys),
                       "sdpa": round(chain_us(sdpa, *shape, masked=args.masked), 2),
                       "kernel": round(chain_us(kernel, *shape, masked=args.masked), 2)}  # fmt: skip
                for forced in FORCED if batch == 1 else ():
                    if forced > -(-keys // decode_attention.BLOCK_S):
                        continue
                    decode_attention.slices = lambda batch, h, k, s=forced: s
                    try:
                        row[f"slices={forced}"] = round(chain_us(kernel, *shape, masked=args.masked), 2)
                    finally:
                        decode_attention.slices = chosen
                kept = decode_attention.PROGRAMS
                for programs in PROGRAMS:
                    decode_attention.PROGRAMS = programs
                    try:
                        row[f"auto@{programs}"] = round(chain_us(kernel, *shape, masked=args.masked), 2)
                    finally:
                        decode_attention.PROGRAMS = kept
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "programs": decode_attention.PROGRAMS, "masked": args.masked, "rows": rows,
                       "us_per_call": True}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
