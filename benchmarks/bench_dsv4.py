"""Benchmark the DSv4 decode layer: eager vs torch.compile vs fuser, replayed in CUDA graphs.

    PYTHONPATH=. python benchmarks/bench_dsv4.py [--config flash|tiny] [--tokens 1,8,32,128,512]

Writes benchmarks/results/dsv4_<config>.{json,md}; `python benchmarks/plot.py` draws the PNG.
"""

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fuser.cli import main  # noqa: E402

if __name__ == "__main__":
    os.chdir(ROOT)
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="flash", choices=["flash", "tiny"])
    parser.add_argument("--tokens", default="1,8,32,128,512")
    args = parser.parse_args()
    sys.exit(
        main([
            "bench", f"examples/dsv4/layer.py:{args.config}", "--tokens", args.tokens,
            "--out", str(ROOT / "benchmarks/results"), "--name", f"dsv4_{args.config}",
        ])
    )
