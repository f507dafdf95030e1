"""Check the warps heuristic on kernels it was never tuned for: every fused kernel of every zoo
layer (transformers' decoder layers at real dims) timed at each warp count on this GPU.

    PYTHONPATH=. python benchmarks/tune_zoo.py [--layers qwen3,gpt_oss] [--tokens 1,8,128,512]

Each layer is fused and tuned in a process of its own (``fuser tune``'s code, with the table
written to a scratch directory: fuser's shipped table is left as it is, so the zoo keeps running
on the heuristic as a new user's model would). Writes benchmarks/results/launch_heuristic.{json,md}:
per kernel and token count, the heuristic's warps and time against the best warp count's.
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
from fuser import bench  # noqa: E402

OUT = ROOT / "benchmarks/results"
WITHIN = 1.10  # the target: the heuristic's time at most 10% over the best warps'


def tune_one(name: str, tokens: tuple[int, ...], out: Path) -> None:
    from fuser.tune import tune

    module, args, kwargs = zoo.FACTORIES[name](T=max(tokens), device="cuda")
    entries = tune(module, args, kwargs, tokens)
    out.write_text(json.dumps(entries, indent=1) + "\n")


def rows_of(layer: str, entries: list[dict]) -> list[dict]:
    """One row per kernel and token count: the heuristic against the best warps at that count."""
    rows = []
    for e in entries:
        for T in e["us"][str(e["heuristic"])]:
            times = {int(w): ts[T] for w, ts in e["us"].items()}
            best = min(times, key=times.get)
            rows.append(dict(
                layer=layer, kernel=e["kernel"], pattern=e["pattern"], template=e["template"], size=e["size"],
                tokens=int(T), heuristic=e["heuristic"], heuristic_us=times[e["heuristic"]],
                best=best, best_us=times[best], over_best=round(times[e["heuristic"]] / times[best], 3),
            ))  # fmt: skip
    return rows


def markdown(rows: list[dict], stamp: dict) -> str:
    misses = [r for r in rows if r["over_best"] > WITHIN]
    lines = [
        "# The warps heuristic on the zoo's kernels",
        "",
        f"{stamp.get('gpu', '')}, commit {stamp.get('commit', '')}. Every fused kernel of every zoo layer at real",
        "dims, timed at 1, 2, 4, 8 and 16 warps (10 launches back to back in a CUDA graph, replayed),",
        "against the warps `fuser.lower`'s heuristic picks for it (a table entry aside).",
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
            f"{r['heuristic_us']:.2f} | {r['best']} | {r['best_us']:.2f} | {r['over_best']:.2f}{flag} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    os.chdir(ROOT)
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", default=",".join(zoo.FACTORIES), help="zoo factories, comma-separated")
    parser.add_argument("--tokens", default="1,8,128,512")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--into", help=argparse.SUPPRESS)
    args = parser.parse_args()
    tokens = tuple(int(t) for t in args.tokens.split(","))
    if args.one:
        tune_one(args.one, tokens, Path(args.into))
        sys.exit(0)
    path = OUT / "launch_heuristic.json"
    layers = json.loads(path.read_text())["layers"] if path.exists() else {}
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
