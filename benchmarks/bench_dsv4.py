"""Benchmark the DSv4 decode layer: eager vs torch.compile vs fuser, replayed in CUDA graphs.

    PYTHONPATH=. python benchmarks/bench_dsv4.py [--config flash|tiny] [--tokens 1,8,32,128,512]

Runs the GPU-marked tests first and records their outcome with the results (``--skip-gpu-tests``
to leave them out). Writes benchmarks/results/dsv4_<config>.{json,md}; `python benchmarks/plot.py`
draws the PNG.
The fuser variant is fused by ``dsv4.fuse_layer``: the layer and, nested, the shared expert inside
its side-stream leaf (``fuser bench examples/dsv4/layer.py:flash`` would fuse the layer only).
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from examples.dsv4 import layer as dsv4  # noqa: E402
from fuser.tools import bench  # noqa: E402

GPU_TESTS = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"]


def run_gpu_tests() -> dict:
    """The GPU-marked tests (golden outputs with compiled kernels, layers, capture), run first so
    that every benchmark result says whether the code it measured passed them."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(GPU_TESTS, cwd=ROOT, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return {"command": "pytest -q -m gpu", "passed": proc.returncode == 0, "summary": lines[-1] if lines else "",
            "failures": [line for line in lines if line.startswith("FAILED") or line.startswith("ERROR")]}


if __name__ == "__main__":
    os.chdir(ROOT)
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="flash", choices=["flash", "tiny"])
    parser.add_argument("--tokens", default="1,8,32,128,512")
    parser.add_argument("--skip-gpu-tests", action="store_true", help="do not run (and record) pytest -m gpu first")
    args = parser.parse_args()
    tokens = tuple(int(t) for t in args.tokens.split(","))
    factory = getattr(dsv4, args.config)
    gpu_tests = None if args.skip_gpu_tests else run_gpu_tests()
    if gpu_tests:
        print(f"gpu tests: {gpu_tests['summary']}")
    result = bench.run(factory, f"examples/dsv4/layer.py:{args.config}", tokens, fuse=dsv4.fuse_layer)
    result.stamp["gpu_tests"] = gpu_tests or {"command": "pytest -q -m gpu", "passed": None, "summary": "not run"}
    paths = bench.write(result, ROOT / "benchmarks/results", f"dsv4_{args.config}")
    print(result.markdown())
    print("wrote " + ", ".join(str(p) for p in paths))
