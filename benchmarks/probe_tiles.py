"""Probe the tile width of every fused kernel of zoo layers that chooses it at launch: each
kernel launched on the layer's own recorded inputs at each width it may choose, and as its
launcher chooses, at each token count.

    PYTHONPATH=. python benchmarks/probe_tiles.py --layers gpt_oss_proj [--tokens 1,8,128,512] [--out FILE]

A measurement for choosing the tile (``fuser.lower.tiling.launch_widths``, ``launch_width``), not a
benchmark of fuser: kernels are timed as ``fuser tune`` times them (a CUDA graph of
back-to-back launches), each width at the warps its launcher gives it. Writes JSON: per kernel,
its ops, its widths, and µs per (width, T), "auto" for the launcher's own choice.
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from examples.zoo import layers as zoo  # noqa: E402


def probe(name: str, tokens: tuple[int, ...]) -> list[dict]:
    from fuser.pipeline.fuse_module import plan
    from fuser.validate.against_eager import record_values, store_targets
    from fuser.tools.tune import _rows, time_launches_us

    module, args, kwargs = zoo.FACTORIES[name](T=max(tokens), device="cuda")
    fused = plan(module, args, example_kwargs=kwargs)
    values = record_values(module, fused.traced, fused.cops)
    found = []
    for kernel in fused.kernels:
        spec = kernel.spec
        if spec is None or not spec.tile_at_launch:
            continue
        program = spec.program
        inputs = values.inputs_of(kernel.region) + store_targets(kernel.region, values)
        times = {}
        for T in tokens:
            rows = _rows(inputs, spec.inputs, T)
            times[f"auto/{T}"] = round(time_launches_us(kernel.launch, rows), 3)
            for width in program.widths:
                launch = lambda *a, width=width: kernel.launch(*a, block_tile=width)  # noqa: E731
                times[f"{width}/{T}"] = round(time_launches_us(launch, rows), 3)
        ops = sorted({fused.cops[n].op for n in kernel.region.nodes})
        found.append(dict(layer=name, kernel=kernel.path.stem, ops=ops, default=program.block_last,
                          widths=list(program.widths), last=program.last, us=times))  # fmt: skip
        for T in tokens:
            best = min((v, k) for k, v in times.items() if k.endswith(f"/{T}") and not k.startswith("auto"))
            print(f"{name} {kernel.path.stem} T={T}: default {program.block_last}: {times[f'{program.block_last}/{T}']}, "
                  f"auto {times[f'auto/{T}']}, best {best[1].split('/')[0]}: {best[0]}", flush=True)  # fmt: skip
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
