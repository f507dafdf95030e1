"""One fused kernel at a time: fuser's kernel vs torch.compile's (Inductor) for the same chain.

    PYTHONPATH=. python benchmarks/bench_kernels.py [--tokens 1,512]

Each chain is transformers' own code where it has a module for it (``Qwen3RMSNorm``, its
``ACT2FN`` SiLU), at Llama-3-8B / Qwen3-8B dims in bf16. For every variant, 100 calls are
captured in one CUDA graph (the same input each time) and replayed; the time per call is
reported. fuser's variant is checked to be one kernel per call. Writes
benchmarks/results/kernels.{json,md}. The target: fuser within 10% of torch.compile's kernel
(fuser / compile ≤ 1.1) for every simple chain.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import fuser  # noqa: E402
from fuser.tools import bench  # noqa: E402
from fuser.tools.tune import time_launches_us  # noqa: E402

CALLS = 100
HIDDEN, INTERMEDIATE = 4096, 14336
EXPERTS, TOP_K = 128, 8


def _norm():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    norm = Qwen3RMSNorm(HIDDEN, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    return norm


class AddNorm(nn.Module):
    """A decoder layer's residual add and the next RMSNorm: both results are read after it."""

    def __init__(self):
        super().__init__()
        self.norm = _norm()

    def forward(self, hidden, residual):
        hidden = residual + hidden
        return self.norm(hidden), hidden


class GatedAct(nn.Module):
    """Llama / Qwen3 MLP's ``act_fn(gate_proj(x)) * up_proj(x)`` between the GEMMs."""

    def __init__(self):
        super().__init__()
        from transformers.activations import ACT2FN

        self.act = ACT2FN["silu"]

    def forward(self, gate, up):
        return self.act(gate) * up


class ExpertSort(nn.Module):
    """transformers' grouped_mm experts' offset preparation (integrations/moe.py), as CUDA runs
    it: the routed expert ids sorted, counted per expert and summed up."""

    def forward(self, expert_ids):
        sorted_ids, perm = torch.sort(expert_ids)
        counts = torch.histc(sorted_ids.int(), bins=EXPERTS, min=0, max=EXPERTS - 1)
        return sorted_ids, perm, torch.cumsum(counts, dim=0, dtype=torch.int32)


def _routed_ids(T: int) -> torch.Tensor:
    """``top_k_index.reshape(-1)``: TOP_K distinct experts per token (Qwen3-30B-A3B's 8 of 128)."""
    return torch.rand(T, EXPERTS).topk(TOP_K, dim=-1).indices.reshape(-1)


CHAINS = {
    "rmsnorm (Qwen3RMSNorm, 4096)": (lambda: _norm(), lambda T: (torch.randn(T, HIDDEN),)),
    "add + rmsnorm (4096)": (AddNorm, lambda T: (torch.randn(T, HIDDEN), torch.randn(T, HIDDEN))),
    "silu(gate) * up (14336)": (GatedAct, lambda T: (torch.randn(T, INTERMEDIATE), torch.randn(T, INTERMEDIATE))),
    "expert sort (T x 8 of 128 experts)": (ExpertSort, lambda T: (_routed_ids(T),)),
}


def per_call_us(forward, inputs) -> float:
    # three warm-ups: torch.compile compiles (and may autotune) outside the capture
    return time_launches_us(forward, inputs, launches=CALLS, replays=50, warmups=3)


def run(tokens) -> list[dict]:
    rows = []
    for name, (make, make_inputs) in CHAINS.items():
        for T in tokens:
            inputs = tuple(x.to("cuda", torch.bfloat16 if x.is_floating_point() else x.dtype) for x in make_inputs(T))
            eager = make().to("cuda", torch.bfloat16).eval()
            fused = make().to("cuda", torch.bfloat16).eval()
            report = fuser.apply(fused, inputs)
            compiled = torch.compile(make().to("cuda", torch.bfloat16).eval(), dynamic=False)
            row = dict(chain=name, tokens=T, fuser_launches=report.launches_after)
            for variant, forward in (("eager", eager), ("compile", compiled), ("fuser", fused)):
                row[f"{variant}_us"] = round(per_call_us(forward, inputs), 3)
            row["fuser_over_compile"] = round(row["fuser_us"] / row["compile_us"], 3)
            print(row, flush=True)
            rows.append(row)
    return rows


def markdown(rows, stamp) -> str:
    lines = [
        "# One kernel at a time: fuser vs torch.compile",
        "",
        f"{stamp['gpu']}, torch {stamp['torch']}, triton {stamp['triton']}, commit {stamp['commit']}, {stamp['date']}.",
        f"bf16; {CALLS} calls captured in one CUDA graph and replayed; µs per call. Target: fuser / compile ≤ 1.1.",
        "",
        "| chain | T | eager µs | torch.compile µs | fuser µs | fuser launches | fuser / compile | met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        met = "yes" if r["fuser_over_compile"] <= 1.1 and r["fuser_launches"] == 1 else "no"
        lines.append(
            f"| {r['chain']} | {r['tokens']} | {r['eager_us']} | {r['compile_us']} | {r['fuser_us']} | "
            f"{r['fuser_launches']} | {r['fuser_over_compile']:.2f} | {met} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    os.chdir(ROOT)
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="1,512")
    args = parser.parse_args()
    rows = run(tuple(int(t) for t in args.tokens.split(",")))
    stamp = bench.stamp()
    out = ROOT / "benchmarks/results"
    (out / "kernels.json").write_text(json.dumps({"stamp": stamp, "rows": rows}, indent=1) + "\n")
    (out / "kernels.md").write_text(markdown(rows, stamp))
    print(markdown(rows, stamp))
