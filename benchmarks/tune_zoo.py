"""Check the warps heuristic on kernels it was never tuned for: every fused kernel of every zoo
layer (transformers' decoder layers at real dims) timed at each warp count on this GPU.

    PYTHONPATH=. python benchmarks/tune_zoo.py [--layers qwen3,gpt_oss] [--tokens 1,8,128,512]

Each layer is fused and tuned in a process of its own (``fuser tune``'s code, with the table
written to a scratch directory: fuser's shipped table is left as it is, so the zoo keeps running
on the heuristic as a new user's model would). Writes benchmarks/results/launch_heuristic.{json,md}:
per kernel and token count, its time at every warp count and its features; the md judges the
heuristic's pick against the best (``--render`` judges it again, on the CPU, after the heuristic
changed).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from examples.zoo import layers as zoo  # noqa: E402
from fuser.tools import bench  # noqa: E402
from fuser.codegen.launch_config import heuristic_warps  # noqa: E402

OUT = ROOT / "benchmarks/results"
WITHIN = 1.10  # the target: the heuristic's time at most 10% over the best warps'


def tune_one(name: str, tokens: tuple[int, ...], out: Path) -> None:
    from fuser.tools.tune import tune

    module, args, kwargs = zoo.FACTORIES[name](T=max(tokens), device="cuda")
    entries = tune(module, args, kwargs, tokens)
    out.write_text(json.dumps(entries, indent=1) + "\n")


def rows_of(layer: str, entries: list[dict]) -> list[dict]:
    """One row per kernel and token count: its time at each warp count, and what it does."""
    rows = []
    for e in entries:
        features = {**e["features"], "reducing": e["template"] == "row_reduce"}
        for T in e["us"][str(e["num_warps"])]:
            rows.append(dict(
                layer=layer, kernel=e["kernel"], pattern=e["pattern"], template=e["template"], size=e["size"],
                tokens=int(T), us={w: ts[T] for w, ts in e["us"].items()}, features=features,
            ))  # fmt: skip
    return rows


def judged(row: dict) -> dict:
    """The row with today's heuristic's pick (from the kernel's features) against the best."""
    f = row["features"]
    heuristic = str(heuristic_warps(f["numel"], f["reducing"], f["tiled"], f["leading"], set(f["ops"])))
    best = min(row["us"], key=row["us"].get)
    return {**row, "heuristic": heuristic, "best": best, "over_best": row["us"][heuristic] / row["us"][best]}


def markdown(rows: list[dict], stamp: dict) -> str:
    rows = [judged(r) for r in rows]
    misses = [r for r in rows if r["over_best"] > WITHIN]
    lines = [
        "# The warps heuristic on the zoo's kernels",
        "",
        f"{stamp.get('gpu', '')}, times measured at commit {stamp.get('commit', '')}. Every fused kernel of every zoo",
        "layer at real dims, timed at 1, 2, 4, 8 and 16 warps (10 launches back to back in a CUDA graph,",
        "replayed), against the warps `fuser.codegen.launch_config.heuristic_warps` picks from the kernel's block size",
        "and ops (today's heuristic: `python benchmarks/tune_zoo.py --render` judges it again on these",
        "times, without a GPU).",
        "",
        f"Within {WITHIN:.2f}× of the best: {len(rows) - len(misses)} of {len(rows)} (kernel, T) pairs; "
        f"worst {max((r['over_best'] for r in rows), default=float('nan')):.2f}×.",
        "",
        "| layer | kernel | pattern | size | T | heuristic warps | µs | best warps | µs | heuristic / best |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        flag = " **miss**" if r["over_best"] > WITHIN else ""
        lines.append(
            f"| {r['layer']} | {r['kernel']} | {r['pattern']} | {r['size']} | {r['tokens']} | {r['heuristic']} | "
            f"{r['us'][r['heuristic']]:.2f} | {r['best']} | {r['us'][r['best']]:.2f} | {r['over_best']:.2f}{flag} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    os.chdir(ROOT)
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", default=",".join(zoo.FACTORIES), help="zoo factories, comma-separated")
    parser.add_argument("--tokens", default="1,8,128,512")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--into", help=argparse.SUPPRESS)
    parser.add_argument("--render", action="store_true", help="judge the heuristic again on the recorded times")
    args = parser.parse_args()
    tokens = tuple(int(t) for t in args.tokens.split(","))
    if args.one:
        tune_one(args.one, tokens, Path(args.into))
        sys.exit(0)
    path = OUT / "launch_heuristic.json"
    recorded = json.loads(path.read_text()) if path.exists() else {"layers": {}}
    layers = recorded["layers"]
    if args.render:
        rows = [r for layer in sorted(layers) for r in layers[layer]]
        (OUT / "launch_heuristic.md").write_text(markdown(rows, recorded["stamp"]))
        print((OUT / "launch_heuristic.md").read_text())
        sys.exit(0)
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.layers.split(","):
            into = Path(scratch) / f"{name}.json"
            proc = subprocess.run([sys.executable, __file__, "--one", name, "--tokens", args.tokens, "--into", str(into)])
            if proc.returncode:
                print(f"{name}: FAILED (exit {proc.returncode})")
                continue
            layers[name] = rows_of(name, json.loads(into.read_text()))
            stamp = bench.stamp()  # written after every layer: a run cut short keeps what it measured
            rows = [r for layer in sorted(layers) for r in layers[layer]]
            path.write_text(json.dumps({"stamp": stamp, "layers": layers}, indent=1) + "\n")
            (OUT / "launch_heuristic.md").write_text(markdown(rows, stamp))
    print((OUT / "launch_heuristic.md").read_text())
