"""Where the host time of a fused decode step goes, without CUDA graphs: ``cProfile`` over a
``generate`` of Llama-3.2-1B's shape (bench_generate's model) at batch 1, eager and fused, the
top functions by their own time.

    PYTHONPATH=. python benchmarks/probe_generate_overhead.py [--model llama_1b] [--top 30]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fuser  # noqa: E402
from benchmarks.bench_generate import causal_lm, generate, timed  # noqa: E402


def profile(model, ids, top: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    generate(model, ids, 64, False)
    torch.cuda.synchronize()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama_1b")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    model = causal_lm(args.model)
    ids = torch.randint(1, model.config.vocab_size, (1, 32), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    generate(model, ids, 4, False)
    print("eager s per 64 tokens:", timed(lambda: generate(model, ids, 64, False))[0])
    print(profile(model, ids, args.top))
    fuser.apply(model)
    generate(model, ids, 4, False)
    print("fused s per 64 tokens:", timed(lambda: generate(model, ids, 64, False))[0])
    print(profile(model, ids, args.top))


if __name__ == "__main__":
    main()
