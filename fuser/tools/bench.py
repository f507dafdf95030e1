"""bench: a layer in three variants — eager, torch.compile, fuser — each captured in a CUDA
graph the way sglang captures decode and replayed, side by side in one run.

For each variant and token count T it reports the whole-layer replay time, the glue kernels
per layer and their GPU time, and torch.compile's compile time; for fuser's largest kernels,
the bandwidth they reach against a copy measured in the same run.

Telling glue from heavy kernels: one eager (non-graph) forward runs with a marker kernel
(``torch.cuda._sleep``) launched before and after every opaque leaf and every call of a heavy
function (``F.linear``, ``torch.einsum``, ``torch.matmul``, ...: fuser's HEAVY ops); kernels
between markers belong to a heavy op (its GEMM, and a workspace memset or a layout copy it
launches itself), GEMM kernels are also known by name, the rest is glue. A leaf that wraps other
modules (a side-stream region) gets no markers: the glue inside it is glue, which a nested
``fuser.apply`` fuses (``run(..., fuse=...)``). Graph replay runs the same kernels in the same
order, so the replay's kernels take their class by position. Leaves are kept out of
torch.compile (as sglang keeps its custom ops), so all three variants run the same leaves and
differ in the glue only.
"""

from __future__ import annotations

import functools
import json
import math
import platform
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from fuser.tools.capture import capture_decode, exposed_us, profiled_replays, replay_time_us
from fuser.ir.opaque import is_opaque
from fuser.trace.call_spec import example_call

HEAVY_NAMES = ("gemm", "gemv", "cutlass", "nvjet", "xmma", "cublas", "splitk", "sm90_", "matmul", "cijk",
               "cudnn_generated", "flash_fwd", "fmha", "sdpa_")  # fmt: skip: GEMMs, then attention
MARKER = "spin"


@dataclass
class Row:
    variant: str
    tokens: int
    layer_us: float
    glue_launches: int
    glue_us: float
    heavy_launches: int
    compile_s: float | None = None
    note: str = ""
    glue_kernels: dict[str, float] | None = None  # fuser's glue kernels: name -> µs per layer


@dataclass
class Bandwidth:
    kernel: str
    tokens: int
    bytes: int
    us: float
    gbps: float
    fraction_of_copy: float


@dataclass
class BenchResult:
    """One benchmark run: each variant's rows (time, launches) at each token count, the copy
    bandwidth and fused kernels' bandwidth, and fuser's reports, with the machine stamp."""

    target: str
    stamp: dict
    copy_gbps: float
    rows: list[Row] = field(default_factory=list)
    bandwidth: list[Bandwidth] = field(default_factory=list)
    fuser_report: dict = field(default_factory=dict)
    nested_reports: dict = field(default_factory=dict)  # submodule name -> report, applies inside leaves

    def json(self) -> str:
        return json.dumps(asdict(self), indent=2, default=str)

    def markdown(self) -> str:
        s = self.stamp
        lines = [
            f"# fuser bench: {self.target}",
            "",
            f"{s['gpu']}, torch {s['torch']}, triton {s['triton']}, commit {s['commit']}, {s['date']}",
            "",
        ]
        if s.get("gpu_tests"):
            t = s["gpu_tests"]
            verdict = {True: "passed", False: "FAILED", None: "not run"}[t["passed"]]
            detail = f" — {t['summary']}" if t["summary"] != verdict else ""
            lines += [f"GPU tests (`{t['command']}`) on this code: {verdict}{detail}", ""]
        lines += [
            "Each variant captured in a CUDA graph (sglang's protocol: two warm-ups on a side stream,",
            "shared pool) and replayed; times are per layer per decode step.",
            "",
            "| T | variant | layer µs | glue launches | glue µs | heavy launches | compile s |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in self.rows:
            compile_s = f"{r.compile_s:.1f}" if r.compile_s is not None else "-"
            lines.append(
                f"| {r.tokens} | {r.variant} | {r.layer_us:.1f} | {r.glue_launches} | {r.glue_us:.1f} | "
                f"{r.heavy_launches} | {compile_s} |" + (f" {r.note}" if r.note else "")
            )
        lines += ["", f"Copy bandwidth (same run): {self.copy_gbps:.0f} GB/s (bytes read + written).", ""]
        if self.bandwidth:
            lines += ["| fused kernel | T | MB moved | µs | GB/s | of copy |", "|---|---|---|---|---|---|"]
            for b in self.bandwidth:
                lines.append(
                    f"| {b.kernel} | {b.tokens} | {b.bytes / 1e6:.2f} | {b.us:.1f} | {b.gbps:.0f} | {b.fraction_of_copy:.0%} |"
                )
        per_kernel = [r for r in self.rows if r.glue_kernels is not None]
        if per_kernel:
            names = list(dict.fromkeys(n for r in per_kernel for n in r.glue_kernels))
            lines += ["", "fuser's glue kernels, µs per layer:", ""]
            lines += ["| kernel | " + " | ".join(f"T={r.tokens}" for r in per_kernel) + " |"]
            lines += ["|---|" + "---|" * len(per_kernel)]
            for name in names:
                cells = [f"{r.glue_kernels[name]:.1f}" if name in r.glue_kernels else "-" for r in per_kernel]
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
        return "\n".join(lines) + "\n"


def stamp() -> dict:
    import os

    import triton

    commit = os.environ.get("FUSER_COMMIT", "")  # set it where the checkout's .git is stale or absent
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
            ).stdout.strip()
        except OSError:
            pass
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": commit or "unknown",
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }


def copy_bandwidth_gbps(gib: float = 2.0) -> float:
    """Device-to-device copy, bytes read + written per second (mean of 10 after 3 warm-ups)."""
    n = int(gib * 2**30 // 2)
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000 / 10
    del a, b
    return 2 * n * 2 / seconds / 1e9


def _kernels(prof) -> list[tuple[str, float]]:
    """(name, µs) of each kernel in start order, the µs each adds to the stream's time
    (:func:`fuser.tools.capture.exposed_us`)."""
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return exposed_us([(e.name, float(e.time_range.start), float(e.time_range.end)) for e in events])


def launched_kernels(call: Callable) -> list[str]:
    """The names of the kernels one ``call()`` launches, in order."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return [name for name, _ in _kernels(prof)]


_MARKING = [False]  # set while kernel_classes profiles: leaves then launch marker kernels
_DEPTH = [0]  # heavy calls in progress: only the outermost one is marked


def _marked(call: Callable) -> Callable:
    """``call`` with a marker kernel before and after it while ``_MARKING`` is set (the
    outermost heavy call only: a GEMM inside a leaf belongs to the leaf)."""

    def marked(*args, **kwargs):
        outermost = _MARKING[0] and _DEPTH[0] == 0
        if outermost:
            torch.cuda._sleep(1)
        _DEPTH[0] += 1
        try:
            return call(*args, **kwargs)
        finally:
            _DEPTH[0] -= 1
            if outermost:
                torch.cuda._sleep(1)

    return marked


def _heavy_functions() -> list[tuple[object, str]]:
    """(namespace, name) of each heavy function fuser keeps as it is (``canon.HEAVY_FUNCTIONS``)."""
    import torch.nn.functional as F

    from fuser.canon.canonicalize import HEAVY_FUNCTIONS

    found = []
    for namespace in (torch, F):
        for name, value in vars(namespace).items():
            if not name.startswith("__") and any(value is f for f in HEAVY_FUNCTIONS):
                found.append((namespace, name))
    return found


def mark_leaves(module: torch.nn.Module, *, keep_from_dynamo: bool = False) -> None:
    """Wrap every opaque leaf's forward so that, while ``_MARKING`` is set, a marker kernel runs
    before and after it. With ``keep_from_dynamo`` the wrapper is also kept out of
    torch.compile, so compiled and eager variants run the very same leaves eagerly.

    A leaf that wraps other modules (a side-stream region: its work is its children's) is left
    as it is: their GEMMs are heavy by name, their glue stays glue, and torch.compile sees it."""
    for m in module.modules():
        if not is_opaque(type(m)) or next(m.children(), None) is not None:
            continue
        forward = _marked(m.forward)
        m.forward = torch._dynamo.disable(forward) if keep_from_dynamo else forward


def kernel_classes(forward: Callable, inputs: tuple, heavy_calls: bool = True) -> list[tuple[str, str]]:
    """(kernel name, 'glue' | 'heavy') for one eager forward, in launch order (the module's
    leaves must be wrapped by :func:`mark_leaves`). With ``heavy_calls`` the heavy functions are
    marked too (not under torch.compile: patching them would make Dynamo compile again, and
    compiled code calls its GEMMs, known by name, without them)."""
    with torch.no_grad():
        forward(*inputs)  # warm
        torch.cuda.synchronize()
        heavy = _heavy_functions() if heavy_calls else []
        originals = [getattr(namespace, name) for namespace, name in heavy]
        _MARKING[0] = True
        try:
            for (namespace, name), original in zip(heavy, originals):
                setattr(namespace, name, _marked(original))
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                forward(*inputs)
                torch.cuda.synchronize()
        finally:
            _MARKING[0] = False
            for (namespace, name), original in zip(heavy, originals):
                setattr(namespace, name, original)
    classes, inside_leaf = [], False
    for name, _ in _kernels(prof):
        if MARKER in name.lower():
            inside_leaf = not inside_leaf
            continue
        heavy = inside_leaf or any(k in name.lower() for k in HEAVY_NAMES)
        classes.append((name, "heavy" if heavy else "glue"))
    if inside_leaf:
        raise RuntimeError("unbalanced heavy-op markers: a heavy kernel ran on another stream?")
    return classes


def profile_replay(graph, classes: list[tuple[str, str]], replays: int = 5):
    """(glue kernels [(name, µs)], heavy launches, note, µs per kernel name over all replays),
    per replay, classes taken by position."""
    kernels = _kernels(profiled_replays(graph, replays))
    per = len(kernels) // replays
    one = kernels[:per]
    note = ""
    if per != len(classes):  # same count: same launches in the same order (GEMM names may differ)
        note = f"replay has {per} kernels, eager {len(classes)}: classes by name"
        by_name = dict(classes)
        labels = [by_name.get(n, "glue") for n, _ in one]
    else:
        labels = [c for _, c in classes]
    glue = [(n, d) for (n, d), c in zip(one, labels) if c == "glue"]
    totals: dict[str, list[float]] = {}
    for name, d in kernels:
        totals.setdefault(name, []).append(d)
    return glue, per - len(glue), note, totals


def run(
    factory: Callable,
    target: str,
    tokens=(1, 8, 32, 128, 512),
    variants=("eager", "compile", "fuser"),
    fuse: Callable | None = None,
) -> BenchResult:
    """``fuse(module, inputs)`` fuses the fuser variant in place and returns its plans by
    submodule name, ``""`` the module itself (for nested applies inside leaves); by default
    ``fuser.apply`` on the module."""
    import fuser

    result = BenchResult(target=target, stamp=stamp(), copy_gbps=copy_bandwidth_gbps())
    eager_module, _, _ = example_call(factory(T=tokens[0], device="cuda"))
    mark_leaves(eager_module)
    fused_module, fused_args, fused_kwargs = example_call(factory(T=tokens[0], device="cuda"))
    # One trace serves every T below.
    if fuse:
        plans = fuse(fused_module, fused_args)
    else:
        plans = {"": fuser.pipeline.fuse_module.apply_plan(fused_module, fused_args, example_kwargs=fused_kwargs)}
    mark_leaves(fused_module)
    result.fuser_report = plans[""].report.to_json()
    result.nested_reports = {name: p.report.to_json() for name, p in plans.items() if name}
    compiled = None
    if "compile" in variants:
        compile_module, _, _ = example_call(factory(T=tokens[0], device="cuda"))
        mark_leaves(compile_module, keep_from_dynamo=True)
        compiled = torch.compile(compile_module, dynamic=False)
    modules = {"eager": eager_module, "compile": compiled, "fuser": fused_module}
    for T in tokens:
        _, inputs, kwargs = example_call(factory(T=T, device="cuda"))
        torch.cuda.empty_cache()
        for variant in variants:
            forward = functools.partial(modules[variant], **kwargs)
            compile_s = None
            if variant == "compile":
                torch.cuda.synchronize()
                started = time.perf_counter()
                with torch.no_grad():
                    forward(*inputs)
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - started
            capture = capture_decode(forward, lambda bs: inputs, [T], variant=variant)
            if T not in capture.graphs:
                result.rows.append(Row(variant, T, math.nan, 0, math.nan, 0, compile_s, f"capture failed: {capture.failed.get(T)}"))
                continue
            graph = capture.graphs[T].graph
            layer_us = replay_time_us(graph)
            classes = kernel_classes(forward, inputs, heavy_calls=variant != "compile")
            glue, heavy_n, note, totals = profile_replay(graph, classes)
            named = None
            if variant == "fuser":  # which kernels the remaining glue time goes to
                named = {}
                for name, us in glue:
                    named[name] = round(named.get(name, 0.0) + us, 2)
            glue_us = sum(us for _, us in glue)
            result.rows.append(Row(variant, T, layer_us, len(glue), glue_us, heavy_n, compile_s, note, named))
            if variant == "fuser" and T == max(tokens):
                result.bandwidth = _bandwidth(list(plans.values()), totals, T, result.copy_gbps)
            del capture, graph
    return result


def _bandwidth(plans: list, totals: dict, T: int, copy_gbps: float, top: int = 3) -> list[Bandwidth]:
    """Bytes each fused kernel reads and writes at T tokens, over its measured time."""
    rows = []
    for plan in plans:
        for kernel in plan.kernels:
            name = f"{kernel.path.stem}_kernel"
            if name not in totals:
                continue
            region = kernel.region
            moved = 0
            for node in list(region.inputs) + list(region.outputs):
                value = plan.traced.value(node)
                per_row = value[0].numel() if plan.traced.batch_dims(node) else None
                moved += (per_row * T if per_row is not None else value.numel()) * value.element_size()
            us = sum(totals[name]) / len(totals[name])
            gbps = moved / (us * 1e-6) / 1e9
            rows.append(Bandwidth(kernel.path.stem, T, moved, us, gbps, gbps / copy_gbps))
    rows.sort(key=lambda b: -b.us)
    seen, unique = set(), []
    for b in rows:
        if b.kernel not in seen:
            seen.add(b.kernel)
            unique.append(b)
    return unique[:top]


def write(result: BenchResult, out_dir: Path, name: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.json", out_dir / f"{name}.md"]
    paths[0].write_text(result.json())
    paths[1].write_text(result.markdown())
    return paths
