"""capture: replay a module the way sglang captures decode (SGLANG.md §1).

Largest batch size first; for each size two eager warm-ups on one dedicated non-default
capture stream (with a device sync before each), then ``torch.cuda.graph`` on that stream
into one shared memory pool, global capture error mode; every graph and its outputs are
held for the life of the harness (dropping one breaks the shared pool). Triton compiles that
happen while a graph is being captured are counted: fuser must cause none.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

#: sglang's default decode batch sizes up to 256 (arg_groups/cuda_graph_hook.py).
SGLANG_BATCH_SIZES = [1, 2, 4, 8, 12] + list(range(16, 257, 8))


@dataclass
class Captured:
    batch_size: int
    graph: Any
    output: Any
    inputs: tuple


@dataclass
class CaptureResult:
    variant: str
    captured: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)
    compiles_during_capture: int = 0
    seconds: float = 0.0
    graphs: dict[int, Captured] = field(default_factory=dict)

    def summary(self) -> dict:
        return {
            "variant": self.variant,
            "captured": self.captured,
            "failed": self.failed,
            "compiles_during_capture": self.compiles_during_capture,
            "seconds": round(self.seconds, 2),
        }


@contextlib.contextmanager
def count_triton_compiles(counter: list[int]):
    """Count ``triton.compile`` calls made inside the block (Triton JIT compiles)."""
    try:
        import triton.compiler.compiler as compiler_module
        import triton.runtime.jit as jit_module
    except ImportError:
        yield
        return
    original = compiler_module.compile

    def counting(*args, **kwargs):
        counter[0] += 1
        return original(*args, **kwargs)

    patched = [(compiler_module, "compile"), (jit_module, "compile")]
    saved = [(m, n, getattr(m, n, None)) for m, n in patched]
    for module, name in patched:
        if getattr(module, name, None) is original:
            setattr(module, name, counting)
    try:
        yield
    finally:
        for module, name, value in saved:
            if value is not None:
                setattr(module, name, value)


def capture_decode(
    forward: Callable,
    make_inputs: Callable[[int], tuple],
    batch_sizes: list[int],
    *,
    variant: str = "",
    warmups: int = 2,
) -> CaptureResult:
    """Capture ``forward(*make_inputs(bs))`` for each batch size, sglang style."""
    result = CaptureResult(variant)
    stream = torch.cuda.Stream()
    pool = torch.cuda.graph_pool_handle()
    started = time.perf_counter()
    for bs in sorted(batch_sizes, reverse=True):
        inputs = make_inputs(bs)  # made before any capture: a failed capture breaks the RNG
        try:
            with torch.no_grad():
                for _ in range(warmups):
                    torch.cuda.synchronize()
                    with torch.cuda.stream(stream):
                        forward(*inputs)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                compiles = [0]
                with count_triton_compiles(compiles), torch.cuda.graph(graph, pool=pool, stream=stream):
                    output = forward(*inputs)
                result.compiles_during_capture += compiles[0]
            result.graphs[bs] = Captured(bs, graph, output, inputs)
            result.captured.append(bs)
        except Exception as e:  # noqa: BLE001 - record what happens to each variant
            result.failed[bs] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            traceback.clear_frames(e.__traceback__)
            torch.cuda.synchronize()
    result.seconds = time.perf_counter() - started
    return result


def replay_time_us(graph, iters: int = 50) -> float:
    """Mean time of one replay, in microseconds (CUDA events, after a warm replay)."""
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters


def profiled_replays(graph, replays: int):
    """torch.profiler's record of ``replays`` back-to-back replays of ``graph``, after a warm one."""
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    return prof


def replay_kernels(graph, replays: int = 10) -> list[tuple[str, float, float]]:
    """Every kernel (and copy, memset) of ``replays`` back-to-back replays, traced with
    torch.profiler after a warm replay: (name, start µs, end µs), in order of start."""
    prof = profiled_replays(graph, replays)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [(e.name, float(e.time_range.start), float(e.time_range.end)) for e in events]
    return sorted(kernels, key=lambda k: k[1])


def exposed_us(kernels) -> list[tuple[str, float]]:
    """(name, µs) of each of ``kernels`` ((name, start, end) triples), in order of start: the µs
    it adds to the time the GPU is busy — from its start, or from the latest end of the kernels
    before it where it started earlier, to its end. A kernel launched with programmatic
    dependent launch starts while the one before ends, and waits for it: that wait is the
    kernel before's time, not its own. The µs sum to :func:`busy_us` of the same kernels."""
    exposed, reach = [], float("-inf")
    for name, start, end in sorted(kernels, key=lambda k: k[1]):
        exposed.append((name, max(0.0, end - max(start, reach))))
        reach = max(reach, end)
    return exposed


def busy_us(intervals) -> float:
    """How long at least one of ``intervals`` ((start, end) pairs, or (name, start, end) triples)
    runs: the length of their union (kernels on several streams overlap; each instant counts once)."""
    spans = sorted((span[-2], span[-1]) for span in intervals)
    total, reach = 0.0, float("-inf")
    for start, end in spans:
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total
