"""The sglang decode capture protocol on the real-size DSv4 layer: fused by fuser, and under
torch.compile (default mode and reduce-overhead), recorded side by side.

    PYTHONPATH=. python benchmarks/capture_dsv4.py   # on a GPU; writes benchmarks/results/capture_dsv4_flash.json

Batch sizes: sglang's default list up to 256, largest first, static input buffers sliced per
size (as sglang's capture does), two warm-ups per size on one side stream, one shared pool.
Warm-ups and captures run in capture mode (sglang's ``model_capture_mode()``), so the shared
expert forks onto its alternate stream and joins back inside the graphs (torch.compile sees that
stream code, as it does in sglang). fuser (``dsv4.fuse_layer``: the layer and, nested, the shared
expert) must capture every size with no kernel compiled during capture, and replays must match
eager. torch.compile is run on a few sizes only (it compiles once per size).
"""

import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from examples.dsv4 import layer as dsv4  # noqa: E402
from examples.dsv4.compare import compare_routed, run_with_expert_ids  # noqa: E402
from fuser.tools.bench import mark_leaves, stamp  # noqa: E402
from fuser.tools.capture import SGLANG_BATCH_SIZES, capture_decode  # noqa: E402

COMPILE_SIZES = [64, 8, 1]


def main():
    largest = max(SGLANG_BATCH_SIZES)
    fused, big_inputs = dsv4.flash(T=largest, device="cuda")
    eager, eager_inputs = dsv4.flash(T=largest, device="cuda")
    # Every module is built before any capture: a failed capture leaves the CUDA RNG unusable.
    to_compile = {mode: dsv4.flash(T=1, device="cuda")[0] for mode in ("default", "reduce-overhead")}
    slices = lambda bs: tuple(x[:bs] for x in big_inputs)  # noqa: E731 - sglang's static buffers
    started = time.perf_counter()
    dsv4.fuse_layer(fused, slices(8))
    record = {"stamp": stamp(), "apply_s": round(time.perf_counter() - started, 1), "variants": []}

    with dsv4.capture_mode():
        result = capture_decode(fused, slices, SGLANG_BATCH_SIZES, variant="fuser")
    replay = {}
    for bs, captured in sorted(result.graphs.items()):
        captured.graph.replay()
        torch.cuda.synchronize()
        expected, eager_ids = run_with_expert_ids(eager, tuple(x[:bs] for x in eager_inputs))
        # A token whose top-6 expert set differs (a near-tie flipped by a one-ulp difference
        # upstream) legitimately differs; every other token must match.
        fused_ids = lambda: run_with_expert_ids(fused, slices(bs))[1]  # noqa: E731 - only on a mismatch
        replay[bs] = compare_routed(captured.output, expected, eager_ids, fused_ids, f"bs={bs}").entry
    summary = result.summary()
    summary["replay"] = replay
    record["variants"].append(summary)
    save(record)
    del result

    for mode, module in list(to_compile.items()):
        del to_compile[mode]
        mark_leaves(module, keep_from_dynamo=True)
        compiled = torch.compile(module, mode=mode, dynamic=False)
        with dsv4.capture_mode():
            result = capture_decode(compiled, slices, COMPILE_SIZES, variant=f"torch.compile {mode}")
        record["variants"].append(result.summary())
        save(record)
        del result, compiled, module
        torch.cuda.empty_cache()

    print(json.dumps(record, indent=2))


def save(record):
    """Written after every variant: a variant that crashes the process keeps the ones before."""
    out = ROOT / "benchmarks/results/capture_dsv4_flash.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
