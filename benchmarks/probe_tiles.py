"""Probe the column tile of every tiled fused kernel of zoo layers: each kernel launched on the
layer's own recorded inputs with each tile width and warp count, at each token count.

    PYTHONPATH=. python benchmarks/probe_tiles.py --layers gpt_oss_proj [--tokens 1,8,128,512] [--out FILE]

A measurement for choosing the tile (``lower._Lowerer.block_last``), not a benchmark of fuser:
kernels are timed as ``fuser tune`` times them (a CUDA graph of back-to-back launches). Writes
JSON: per kernel, its ops, the tile it was given, and µs per (tile, warps, T).
"""

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from examples.zoo import layers as zoo  # noqa: E402

TILES = (64, 128, 256, 512, 1024)
WARPS = (1, 2, 4)


def probe(name: str, tokens: tuple[int, ...]) -> list[dict]:
    from fuser import lower
    from fuser.api import kernel_spec, plan, record_values, store_targets
    from fuser.emit import emit
    from fuser.tune import _rows, time_launches_us

    module, args, kwargs = zoo.FACTORIES[name](T=max(tokens), device="cuda")
    fused = plan(module, args, example_kwargs=kwargs)
    values = record_values(module, fused.traced, fused.cops)
    found = []
    for kernel in fused.kernels:
        spec = kernel.spec
        if spec is None or spec.program is None or not spec.program.tiled:
            continue
        program = spec.program
        inputs = values.inputs_of(kernel.region) + store_targets(kernel.region, values)
        times = {}
        own = lower._Lowerer.tile_width
        for tile in (t for t in TILES if t <= lower.pow2(program.last)):
            lower._Lowerer.tile_width = lambda self, others, tile=tile: tile
            try:
                tiled = kernel_spec(kernel.region, fused.traced, fused.cops)
            finally:
                lower._Lowerer.tile_width = own
            for warps in WARPS:
                _, launch = emit(replace(tiled, warps=warps))
                for T in tokens:
                    times[f"{tile}/{warps}/{T}"] = round(time_launches_us(launch, _rows(inputs, spec.inputs, T)), 3)
        ops = sorted({fused.cops[n].op for n in kernel.region.nodes})
        found.append(dict(layer=name, kernel=kernel.path.stem, ops=ops, tile=program.block_last,
                          warps=spec.num_warps, last=program.last, us=times))  # fmt: skip
        best = {T: min((v, k) for k, v in times.items() if k.endswith(f"/{T}")) for T in tokens}
        given = {T: times.get(f"{program.block_last}/{spec.num_warps}/{T}") for T in tokens}
        print(f"{name} {kernel.path.stem} ({program.block_last}/{spec.num_warps}): given {given}; best {best}", flush=True)
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", required=True)
    parser.add_argument("--tokens", default="1,8,128,512")
    parser.add_argument("--out", type=Path)
    a = parser.parse_args()
    tokens = tuple(int(t) for t in a.tokens.split(","))
    results = [r for name in a.layers.split(",") for r in probe(name, tokens)]
    if a.out:
        a.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
