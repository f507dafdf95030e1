"""A linear layer with a bias and its activation: PyTorch's two launches against cuBLASLt's one
(the activation in the GEMM's epilogue, ``torch._addmm_activation``, as
``fuser.pipeline.activation_in_gemm`` calls it), at the MLP up projections of the zoo's layers.

    python benchmarks/probe_gemm_activation.py [--out benchmarks/results/gemm_activation_h100.json]

Each variant: 20 calls captured in one CUDA graph, replayed 200 times; µs per call. Also the
largest error against the fp64 reference (eager: ``gelu_new`` written out, as transformers runs
it) and the kernels one call launches.
"""

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fuser.tools.bench import launched_kernels  # noqa: E402
from fuser.tools.tune import time_launches_us  # noqa: E402

SHAPES = {"gptj": (4096, 16384), "phi2": (2560, 10240), "starcoder2": (4608, 18432), "gpt_neox": (6144, 24576)}


def gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for name, (k, n) in SHAPES.items():
        for dtype in (torch.bfloat16, torch.float16):
            w = torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5
            b = torch.randn(n, device="cuda", dtype=dtype) * 0.1
            for T in (1, 2, 8, 32, 128):
                x = torch.randn(T, k, device="cuda", dtype=dtype)
                ref = gelu_new(F.linear(x.double(), w.double(), b.double()))
                variants = {
                    "linear": lambda: F.linear(x, w, b),
                    "linear + gelu_tanh": lambda: F.gelu(F.linear(x, w, b), approximate="tanh"),
                    "linear + relu": lambda: F.relu(F.linear(x, w, b)),
                    "epilogue gelu_tanh": lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True),
                    "epilogue relu": lambda: torch._addmm_activation(b, x, w.t(), use_gelu=False),
                }
                row = dict(layer=name, dtype=str(dtype).removeprefix("torch."), T=T)
                row.update({v: round(time_launches_us(fn, (), launches=20, replays=200, warmups=3), 2) for v, fn in variants.items()})
                row["error eager gelu_new"] = (gelu_new(F.linear(x, w, b)).double() - ref).abs().max().item()
                row["error epilogue"] = (variants["epilogue gelu_tanh"]().double() - ref).abs().max().item()
                row["kernels epilogue"] = [name[:60] for name in launched_kernels(variants["epilogue gelu_tanh"])]
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
