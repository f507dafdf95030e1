"""tune: choose each fused kernel's warp count offline, on this GPU, for a user's own model.

    fuser tune FILE.py:FACTORY [--tokens 8,256] [--out DIR]

Every kernel fuser makes for the factory's module is rendered at each warp count, launched on
the module's own recorded inputs at each token count, timed as a CUDA graph of back-to-back
launches, and the count with the least total time is kept. The table (``<GPU>.json``) is
merged into ``DIR`` (default: ``fuser/launch_configs/``); point ``$FUSER_LAUNCH_CONFIGS`` at
a directory of your own to have fuser read it (:mod:`fuser.codegen.launch_config`). Serving never
benchmarks. ``fuser tune --lone-ops`` writes the other table, of ops alone
(:mod:`fuser.tools.tune_lone_ops`). Each entry also records the heuristic's choice and its time against the best, so
a table doubles as a check of the heuristic.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from fuser.tools.capture import replay_time_us
from fuser.codegen.launch_config import entry_key

WARPS = (1, 2, 4, 8, 16)


def time_launches_us(launch, args, launches: int = 10, replays: int = 20, warmups: int = 1) -> float:
    """Mean microseconds per launch: ``launches`` back to back in one CUDA graph, replayed."""
    return time_rotating_launches_us(launch, [args], launches, replays, warmups)


def time_rotating_launches_us(launch, arg_sets: list, launches: int = 10, replays: int = 20,
                              warmups: int = 1) -> float:  # fmt: skip
    """Mean microseconds per launch: the argument sets launched in turn, back to back in one CUDA
    graph (at least ``launches``, whole rounds), replayed — so that each launch reads its own
    operands, not the L2-resident ones of the launch before (as a model's layers do)."""
    stream = torch.cuda.Stream()
    with torch.no_grad(), torch.cuda.stream(stream):
        for _ in range(warmups):
            for args in arg_sets:
                launch(*args)  # compiles outside the capture
    torch.cuda.synchronize()
    rounds = -(-launches // len(arg_sets))
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph, stream=stream):
        for _ in range(rounds):
            for args in arg_sets:
                launch(*args)
    return replay_time_us(graph, replays) / (rounds * len(arg_sets))


def token_rows(args, operands, T: int):
    """The first T token rows of each input that has them."""
    return [a[:T] if op.has_rows and not op.broadcast_rows else a for a, op in zip(args, operands)]


_rows = token_rows  # the name benchmarks/probe_tiles.py imports


def tune_plans(plans: dict, tokens: tuple[int, ...], root: torch.nn.Module, log: Callable = print) -> list[dict]:
    """One table entry per distinct row-program kernel of ``plans`` (submodule name -> plan,
    ``""`` the module itself), timed on values recorded at ``max(tokens)`` tokens."""
    from fuser.validate.against_eager import record_values, store_targets
    from fuser.codegen.emit import emit

    entries, seen = [], set()
    for name, plan in plans.items():
        module = root.get_submodule(name) if name else root
        values = record_values(module, plan.traced, plan.cops)
        for kernel in plan.kernels:
            spec = kernel.spec
            if spec is None or spec.program is None:
                continue  # hand-written templates (sinkhorn) choose their own launch
            key = entry_key(spec)
            if key["kernel"] in seen:
                continue
            seen.add(key["kernel"])
            args = values.inputs_of(kernel.region)
            targets = store_targets(kernel.region, values)  # where in-place outputs go
            times = {}
            for warps in WARPS:
                _, launch = emit(replace(spec, warps=warps))
                times[warps] = {
                    T: round(time_launches_us(launch, token_rows(args, spec.inputs, T) + [t[:T] for t in targets]), 3)
                    for T in tokens
                }  # fmt: skip
            best = min(WARPS, key=lambda w: sum(times[w].values()))
            heuristic = spec.program.num_warps
            program = spec.program
            features = dict(numel=program.numel, tiled=program.tiled, leading=program.leading,
                            ops=sorted({plan.cops[n].op for n in kernel.region.nodes}))  # fmt: skip
            entry = {**key, "num_warps": best, "heuristic": heuristic, "features": features,
                     "heuristic_over_best": round(sum(times[heuristic].values()) / sum(times[best].values()), 3),
                     "us": {str(w): {str(T): t for T, t in ts.items()} for w, ts in times.items()}}  # fmt: skip
            entries.append(entry)
            log(f"{key['pattern']:>24} {key['template']:>10} size {key['size']:>6}: {best:>2} warps "
                f"(heuristic {heuristic}: {entry['heuristic_over_best']:.2f}x the best) {times[best]}")  # fmt: skip
    return entries


def tune(module: torch.nn.Module, args: tuple, kwargs: dict, tokens: tuple[int, ...], log: Callable = print) -> list[dict]:
    """Fuse ``module`` on its example call (made at ``max(tokens)`` tokens) and tune its kernels."""
    from fuser.pipeline.fuse_module import plan

    fused = plan(module, args, example_kwargs=kwargs)
    return tune_plans({"": fused}, tokens, module, log)


def write_table(entries: list[dict], out_dir: Path, gpu: str, about: dict) -> Path:
    """Merge ``entries`` into ``out_dir/<gpu>.json`` (an entry of the same kernel is replaced)."""
    return merge_into_table(Path(out_dir) / f"{gpu}.json", entries, key=lambda e: e["kernel"], about=about)


def merge_into_table(path: Path, entries: list[dict], key, about: dict, ordered: bool = False) -> Path:
    """Write ``entries`` into the table file ``path``: an entry of the same ``key`` there is
    replaced, the others kept, ``about`` (what was measured, where) updated; ``ordered``: the
    entries sorted by ``key``, else the kept ones first."""
    old = json.loads(path.read_text()) if path.exists() else {"entries": []}
    fresh = {key(e) for e in entries}
    merged = [e for e in old["entries"] if key(e) not in fresh] + entries
    table = {**{k: v for k, v in old.items() if k != "entries"}, **about, "entries": sorted(merged, key=key) if ordered else merged}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1) + "\n")
    return path
