"""Where the first ``generate`` after ``fuser.apply`` spends its time on a machine that has
compiled nothing yet: each variant runs in a process of its own with empty Triton, Inductor and
fuser kernel caches, and reports the wall time of apply and of the first ``generate`` (4 new
tokens), how many Triton compiles ran and their summed and overlapped seconds; ``--profile``
adds a profile of that first ``generate`` (the functions with the most cumulative time; the
profiler slows Python code several times over, so its wall times are not the variant's).

    PYTHONPATH=. python benchmarks/probe_cold_start.py [--models llama_1b,qwen3_8b] [--batch 1]
        [--variants fuser,compile] [--profile] [--out DIR]

Writes ``cold_start.{json,md}`` under ``--out`` (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class CompileClock:
    """Triton's ``compile`` timed: count, summed seconds, and seconds when at least one ran."""

    def __init__(self):
        import triton.compiler

        self.lock, self.count, self.summed, self.busy, self.running, self.since = threading.Lock(), 0, 0.0, 0.0, 0, 0.0
        original = triton.compiler.compile

        def timed(*args, **kwargs):
            start = self._enter()
            try:
                return original(*args, **kwargs)
            finally:
                self._leave(start)

        triton.compiler.compile = timed  # JIT functions look it up when they first bind

    def _enter(self) -> float:
        now = time.perf_counter()
        with self.lock:
            if self.running == 0:
                self.since = now
            self.running += 1
        return now

    def _leave(self, start: float) -> None:
        now = time.perf_counter()
        with self.lock:
            self.count += 1
            self.summed += now - start
            self.running -= 1
            if self.running == 0:
                self.busy += now - self.since


def one_variant(model_name: str, batch: int, variant: str, out: Path, profiled: bool) -> dict:
    clock = CompileClock()
    import torch

    import fuser
    from benchmarks.bench_generate import causal_lm, generate

    model = causal_lm(model_name)
    ids = torch.randint(1, model.config.vocab_size, (batch, 32), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    torch.cuda.synchronize()
    started = time.perf_counter()
    if variant.startswith("fuser"):
        fuser.apply(model, cuda_graphs=variant == "fuser graphs")
    applied = time.perf_counter()
    profile = cProfile.Profile() if profiled else None
    if profile:
        profile.enable()
    generate(model, ids, 4, static=variant != "fuser")
    torch.cuda.synchronize()
    done = time.perf_counter()
    if profile:
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(60)
        (out / f"profile_{model_name}_b{batch}_{variant.replace(' ', '_')}.txt").write_text(text.getvalue())
    return dict(model=model_name, batch=batch, variant=variant, apply_s=round(applied - started, 2),
                first_generate_s=round(done - applied, 2), ready_s=round(done - started, 2), compiles=clock.count,
                compile_summed_s=round(clock.summed, 2), compile_busy_s=round(clock.busy, 2))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="llama_1b,qwen3_8b,deepseek_v4_flash")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--variants", default="fuser,fuser graphs,compile")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results"))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a variant, run in this process
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.one:
        print(json.dumps(one_variant(args.models, args.batch, args.one, out, args.profile)), flush=True)
        return
    rows = []
    for model in args.models.split(","):
        for variant in args.variants.split(","):
            rows.append(fresh_process(model, args.batch, variant, out, args.profile))
            print(json.dumps(rows[-1]), flush=True)
    (out / "cold_start.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / "cold_start.md").write_text(table(rows) + "\n")


def fresh_process(model: str, batch: int, variant: str, out: Path, profiled: bool) -> dict:
    """One variant in a process of its own, with empty caches."""
    with tempfile.TemporaryDirectory() as fresh:
        env = dict(os.environ, TRITON_CACHE_DIR=f"{fresh}/triton", TORCHINDUCTOR_CACHE_DIR=f"{fresh}/inductor",
                   FUSER_KERNEL_DIR=f"{fresh}/kernels")  # fmt: skip
        command = [sys.executable, __file__, "--models", model, "--batch", str(batch), "--out", str(out), "--one", variant]
        done = subprocess.run(command + (["--profile"] if profiled else []), env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else dict(model=model, batch=batch, variant=variant, failed=done.stderr[-2000:])


def table(rows: list[dict]) -> str:
    lines = ["| model | batch | variant | ready s | apply s | first generate s | Triton compiles | compile s (summed / overlapped) |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['model']} | {r['batch']} | {r['variant']} | failed: {r['failed'][-200:]!r} | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['batch']} | {r['variant']} | {r['ready_s']} | {r['apply_s']} | {r['first_generate_s']} | "
                     f"{r['compiles']} | {r['compile_summed_s']} / {r['compile_busy_s']} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
