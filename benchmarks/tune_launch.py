"""Choose each fused kernel's warp count offline, on this GPU, for the DSv4 layer.

    PYTHONPATH=. python benchmarks/tune_launch.py [--config flash] [--tokens 8,256] [--out DIR]

Every kernel of the fused layer (and of the nested shared expert) is rendered at each warp
count, launched on the layer's own recorded inputs at each token count, timed as a CUDA graph
of back-to-back launches, and the count with the least total time is kept. The table goes to
``fuser/launch_configs/<GPU>.json`` (or ``--out``), where :mod:`fuser.launch_config` looks it up
when a kernel is emitted on that GPU. Serving never benchmarks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from examples.dsv4 import layer as dsv4  # noqa: E402
from fuser import bench  # noqa: E402
from fuser.api import record_values, store_targets  # noqa: E402
from fuser.capture import replay_time_us  # noqa: E402
from fuser.emit import emit  # noqa: E402
from fuser.launch_config import TABLE_DIR, current_gpu, entry_key  # noqa: E402

WARPS = (1, 2, 4, 8, 16)


def time_launches_us(launch, args, launches: int = 10, replays: int = 20) -> float:
    """Mean microseconds per launch: ``launches`` back to back in one CUDA graph, replayed."""
    stream = torch.cuda.Stream()
    with torch.no_grad(), torch.cuda.stream(stream):
        launch(*args)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph, stream=stream):
        for _ in range(launches):
            launch(*args)
    return replay_time_us(graph, replays) / launches


def rows(args, operands, T: int):
    """The first T token rows of each input that has them."""
    return [a[:T] if op.has_rows and not op.broadcast_rows else a for a, op in zip(args, operands)]


def tune(config: str, tokens: tuple[int, ...]) -> list[dict]:
    layer, inputs = getattr(dsv4, config)(T=max(tokens), device="cuda")
    plans = dsv4.fuse_layer(layer, inputs)
    entries, seen = [], set()
    for name, plan in plans.items():
        module = layer.get_submodule(name) if name else layer
        values = record_values(module, plan.traced)
        for kernel in plan.kernels:
            spec = kernel.spec
            if spec is None or spec.program is None:
                continue  # parameter templates (sinkhorn) launch one warp by design
            key = entry_key(spec)
            if key["kernel"] in seen:
                continue
            seen.add(key["kernel"])
            args = [values[n] for n in kernel.region.inputs]
            targets = store_targets(kernel.region, values)  # where in-place outputs go
            times = {}
            for warps in WARPS:
                _, launch = emit(replace(spec, warps=warps))
                times[warps] = {
                    T: round(time_launches_us(launch, rows(args, spec.inputs, T) + [t[:T] for t in targets]), 3)
                    for T in tokens
                }  # fmt: skip
            best = min(WARPS, key=lambda w: sum(times[w].values()))
            entries.append({**key, "num_warps": best, "heuristic": spec.program.num_warps,
                            "us": {str(w): {str(T): t for T, t in ts.items()} for w, ts in times.items()}})
            print(f"{key['pattern']:>20} {key['template']:>10} size {key['size']:>6}: "
                  f"{best} warps (heuristic {spec.program.num_warps}) {times[best]}")
    return entries


if __name__ == "__main__":
    os.chdir(ROOT)
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="flash", choices=["flash", "tiny"])
    parser.add_argument("--tokens", default="8,256")
    parser.add_argument("--out", default=str(TABLE_DIR))
    args = parser.parse_args()
    tokens = tuple(int(t) for t in args.tokens.split(","))
    gpu = current_gpu()
    assert gpu, "tune_launch needs a CUDA GPU"
    table = {**bench.stamp(), "layer": f"examples/dsv4/layer.py:{args.config}", "tokens": list(tokens),
             "entries": tune(args.config, tokens)}
    out = Path(args.out) / f"{gpu}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {out}")
