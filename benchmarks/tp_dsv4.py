"""The fused DSv4 layer under tensor parallelism, captured with sglang's decode protocol.

    PYTHONPATH=. python benchmarks/tp_dsv4.py                  # 2 GPUs: flash, NCCL, every sglang size
    PYTHONPATH=. python benchmarks/tp_dsv4.py --config tiny    # the tiny layer (on the CPU too)

One process per rank (``--world``, default 2; NCCL with one GPU each, gloo on the CPU). Each
rank builds the full layer from the same seed (checked), shards it (``examples/dsv4/tp.py``),
computes the references at every batch size — the full layer, and the eager TP layer —, fuses
its shard (``dsv4.fuse_layer``: fuser on the layer, ``all_reduce`` an opaque leaf, and nested on
the shared expert), then captures it in capture mode with ``fuser.tools.capture.capture_decode``
(largest size first, two warm-ups each on one side stream, one shared pool) and checks every replay against both references within the layer tolerance,
forgiving only tokens whose top-k expert set flipped on a near-tie. Batch sizes come from static
input buffers sliced per size, identical on every rank.

Without CUDA there is no graph capture: the fused TP layer is run eagerly at each size instead,
and the output says so. Rank 0 writes ``--out`` (default
``benchmarks/results/tp_dsv4_<config>.json``); the exit status is 1 unless every rank captured
every size and every replay matched.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # fused kernels run in Triton's CPU interpreter

from examples.dsv4 import layer as dsv4  # noqa: E402
from examples.dsv4 import tp  # noqa: E402
from examples.dsv4.compare import compare_routed, run_with_expert_ids  # noqa: E402
from fuser.tools.bench import stamp  # noqa: E402
from fuser.tools.capture import SGLANG_BATCH_SIZES, capture_decode  # noqa: E402

FACTORIES = {"flash": dsv4.flash, "tiny": dsv4.tiny}
CPU_BATCH_SIZES = [1, 4, 16]  # the interpreter is slow: a few sizes only


def fingerprint(module, inputs) -> list[float]:
    """A cheap per-tensor checksum (every k-th element) of the parameters, buffers and inputs."""
    tensors = list(module.parameters()) + list(module.buffers()) + list(inputs)
    tensors = [torch.view_as_real(t) if t.is_complex() else t for t in tensors]  # the RoPE table
    return [t.reshape(-1)[:: max(1, t.numel() // 4096)].double().sum().item() for t in tensors]


def all_ranks(value) -> list:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def run_rank(rank: int, world: int, config: str, batch_sizes: list[int], seed: int) -> dict:
    """Everything one rank does; every collective is issued in the same order on every rank."""
    device = torch.device(f"cuda:{rank}" if torch.cuda.is_available() else "cpu")
    sizes = sorted(batch_sizes, reverse=True)
    full, big_inputs = FACTORIES[config](T=sizes[0], seed=seed, device=device)
    fingerprints = all_ranks(fingerprint(full, big_inputs))
    if any(f != fingerprints[0] for f in fingerprints):
        raise RuntimeError("the ranks built different full layers or inputs from the same seed")
    slices = lambda bs: tuple(x[:bs] for x in big_inputs)  # noqa: E731 - sglang's static buffers
    layer = tp.shard(full, rank, world)

    # References at every size, before fusing: the full layer, then the eager TP layer.
    references = {}
    for bs in sizes:
        references[bs] = {"full": run_with_expert_ids(full, slices(bs)), "eager TP": run_with_expert_ids(layer, slices(bs))}
    del full
    if device.type == "cuda":
        torch.cuda.empty_cache()

    started = time.perf_counter()
    plans = dsv4.fuse_layer(layer, slices(min(8, sizes[0])))  # the layer, and the shared expert nested
    record = {
        "rank": rank,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "apply_s": round(time.perf_counter() - started, 1),
        "glue_launches": {
            name or "layer": {"eager": p.report.launches_before, "fused": p.report.launches_after} for name, p in plans.items()
        },
    }

    if device.type == "cuda":
        with dsv4.capture_mode():  # sglang's: the shared expert forks onto its side stream
            result = capture_decode(layer, slices, sizes, variant=f"fuser TP rank {rank}/{world}")
        record.update(result.summary())
        # Replays run the captured all-reduces: only sizes every rank captured, in one order.
        common = set.intersection(*(set(c) for c in all_ranks(result.captured)))
        outputs = {}
        for bs in sorted(common):
            result.graphs[bs].graph.replay()
            torch.cuda.synchronize()
            # A copy: replaying a graph captured earlier may reuse this one's output blocks.
            outputs[bs] = result.graphs[bs].output.clone()
    else:
        record.update(variant=f"fuser TP rank {rank}/{world}, eager: no CUDA, no graph capture", captured=[], failed={})
        outputs = {}
        for bs in sorted(sizes):
            with torch.no_grad():
                outputs[bs] = layer(*slices(bs))

    replay, worst = {}, {}
    for bs, output in sorted(outputs.items()):
        _, fused_ids = run_with_expert_ids(layer, slices(bs))  # on every rank: it runs the collectives
        checks = {
            reference: compare_routed(output, expected, expected_ids, fused_ids, f"bs={bs} vs {reference}", reference)
            for reference, (expected, expected_ids) in references[bs].items()
        }
        replay[bs] = {reference: c.entry for reference, c in checks.items()}
        replay[bs]["ok"] = all(c.ok for c in checks.values())
        for reference, c in checks.items():
            errors = worst.setdefault(reference, dict.fromkeys(c.errors, 0.0))
            for key, value in c.errors.items():
                errors[key] = max(errors[key], value)
    record["replay"] = replay
    record["max_error"] = worst  # over tokens with the reference's expert set
    record["ok"] = (
        not record["failed"]
        and len(outputs) == len(sizes)
        and all(r["ok"] for r in replay.values())
        and record.get("compiles_during_capture", 0) == 0
    )
    return record


def rank_main(rank: int, world: int, config: str, batch_sizes: list[int], seed: int, out: str) -> None:
    record = run_rank(rank, world, config, batch_sizes, seed)
    records = all_ranks(record)
    if rank != 0:
        return
    cuda = torch.cuda.is_available()
    header = stamp()
    summary = {
        "stamp": {**header, "world": world, "backend": dist.get_backend()},
        "config": config,
        "batch_sizes": sorted(batch_sizes, reverse=True),
        "capture": cuda,
        "note": "" if cuda else "no CUDA: gloo, no CUDA-graph capture; the fused TP layer ran eagerly",
        "ok": all(r["ok"] for r in records),
        "ranks": records,
    }
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    verdict = "every rank captured every size and matched" if cuda else "every rank matched (eager: no capture on the CPU)"
    print(f"wrote {path}; {verdict if summary['ok'] else 'FAILED: see ok, failed and replay per rank'}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(FACTORIES), default="flash")
    parser.add_argument("--world", type=int, default=2, help="processes (one GPU each on CUDA)")
    parser.add_argument("--batch-sizes", help="comma-separated (default: sglang's decode sizes; on the CPU a few)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="JSON path (default benchmarks/results/tp_dsv4_<config>.json)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds before every rank is killed")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if args.batch_sizes:
        sizes = [int(s) for s in args.batch_sizes.split(",")]
    else:
        sizes = SGLANG_BATCH_SIZES if cuda else CPU_BATCH_SIZES
    out = args.out or str(ROOT / f"benchmarks/results/tp_dsv4_{args.config}.json")
    if not cuda:
        print(f"no CUDA: {args.world} processes on gloo; no CUDA-graph capture on the CPU, the fused TP layer runs eagerly "
              f"(Triton interpreter) at batch sizes {sizes}", flush=True)
    tp.launch(rank_main, args.world, (args.config, sizes, args.seed, out), timeout_s=args.timeout)
    return 0 if json.loads(Path(out).read_text())["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
