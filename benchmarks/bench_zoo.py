"""Benchmark transformers' decoder layers (examples/zoo) at real dims: eager vs torch.compile vs
fuser, each replayed in a CUDA graph, the same leaves in every variant.

    PYTHONPATH=. python benchmarks/bench_zoo.py [--layers qwen3_proj,gpt_oss] [--tokens 1,8,128,512]

Writes benchmarks/results/zoo/<layer>.{json,md} per layer (``fuser.tools.bench``) and, over every
layer measured so far, benchmarks/results/zoo.{json,md}: glue launches, glue µs and whole-layer
µs per variant, and fuser's glue time over torch.compile's. ``python benchmarks/plot.py
benchmarks/results/zoo/<layer>.json`` draws one layer.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from examples.zoo import layers as zoo  # noqa: E402
from fuser.tools import bench  # noqa: E402

OUT = ROOT / "benchmarks/results"
# The target: fuser's glue time over torch.compile's, per layer kind.
HEAVY_GLUE = ("deepseek_v4", "deepseek_v3", "gpt_oss", "qwen3_moe")


def target_ratio(layer: str) -> float:
    return 0.5 if layer.removesuffix("_proj") in HEAVY_GLUE else 1.0


def summary(results: dict[str, dict]) -> tuple[dict, str]:
    """One row per (layer, T): the three variants side by side, and the verdict on the targets."""
    rows = []
    for layer, data in results.items():
        by = {(r["variant"], r["tokens"]): r for r in data["rows"]}
        for T in sorted({r["tokens"] for r in data["rows"]}):
            e, c, f = (by.get((v, T)) for v in ("eager", "compile", "fuser"))
            if not (e and c and f):
                continue
            ratio = f["glue_us"] / c["glue_us"] if c["glue_us"] else float("nan")
            rows.append(dict(
                layer=layer, tokens=T,
                glue_launches=[e["glue_launches"], c["glue_launches"], f["glue_launches"]],
                glue_us=[round(e["glue_us"], 1), round(c["glue_us"], 1), round(f["glue_us"], 1)],
                layer_us=[round(e["layer_us"], 1), round(c["layer_us"], 1), round(f["layer_us"], 1)],
                fuser_over_compile=round(ratio, 2), target=target_ratio(layer),
                launches_met=f["glue_launches"] <= c["glue_launches"], time_met=ratio <= target_ratio(layer),
                commit=data["stamp"]["commit"],
            ))  # fmt: skip
    lines = [
        "# transformers' decoder layers: eager / torch.compile / fuser",
        "",
        "Real dims, H200, each variant captured in a CUDA graph and replayed; µs per layer per decode step.",
        "Target: glue launches ≤ torch.compile's, glue µs ≤ 1.0× torch.compile's (≤ 0.5× for the",
        "DeepSeek-V4, DeepSeek-V3, GPT-OSS and Qwen3-MoE layers).",
        "",
        "| layer | T | glue launches e / c / f | glue µs e / c / f | layer µs e / c / f | fuser / compile glue | met | commit |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        met = ("launches " if r["launches_met"] else "") + ("time" if r["time_met"] else "")
        lines.append(
            f"| {r['layer']} | {r['tokens']} | {' / '.join(map(str, r['glue_launches']))} | "
            f"{' / '.join(map(str, r['glue_us']))} | {' / '.join(map(str, r['layer_us']))} | "
            f"{r['fuser_over_compile']:.2f} (≤ {r['target']}) | {met.strip() or 'no'} | {r['commit']} |"
        )
    return {"rows": rows}, "\n".join(lines) + "\n"


def bench_one(name: str, tokens: tuple[int, ...]) -> None:
    result = bench.run(zoo.FACTORIES[name], f"examples/zoo/layers.py:{name}", tokens)
    bench.write(result, OUT / "zoo", name)
    print(result.markdown())


if __name__ == "__main__":
    os.chdir(ROOT)
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", default=",".join(zoo.FACTORIES), help="zoo factories, comma-separated")
    parser.add_argument("--tokens", default="1,8,128,512")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # one layer, in this process
    args = parser.parse_args()
    tokens = tuple(int(t) for t in args.tokens.split(","))
    (OUT / "zoo").mkdir(parents=True, exist_ok=True)
    if args.one:
        bench_one(args.one, tokens)
        sys.exit(0)
    # One process per layer: a fresh torch.compile cache (layers share transformers'
    # GradientCheckpointingLayer.__call__, so their compiles would count against one recompile
    # limit and the later layers would silently run eager) and the GPU memory of one layer only.
    for name in args.layers.split(","):
        proc = subprocess.run([sys.executable, __file__, "--one", name, "--tokens", args.tokens], cwd=ROOT)
        if proc.returncode:
            print(f"{name}: FAILED (exit {proc.returncode})")
    results = {p.stem: json.loads(p.read_text()) for p in sorted((OUT / "zoo").glob("*.json"))}
    data, text = summary(results)
    (OUT / "zoo.json").write_text(json.dumps(data, indent=1) + "\n")
    (OUT / "zoo.md").write_text(text)
    print(text)
