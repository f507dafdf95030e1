"""launch_config: warps per fused kernel, chosen offline per GPU, looked up when a kernel is emitted.

``benchmarks/tune_launch.py`` times each kernel of a model at every warp count on one GPU and
writes ``fuser/launch_configs/<GPU>.json`` (committed data, shipped with the package). At apply
time a kernel's ``num_warps`` comes from the table of the GPU it is built on, never from a
benchmark:

1. the entry for this very kernel (the hash of its body), else
2. the entry of the same template, pattern and dtype with the nearest feature size, else
3. the entry of the same template and dtype with the nearest feature size, else
4. the heuristic in :mod:`fuser.lower` (and always on the CPU, where the interpreter ignores it).
"""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path

import torch

TABLE_DIR = Path(__file__).resolve().parent / "launch_configs"


def gpu_key(name: str) -> str:
    """'NVIDIA H200' -> 'NVIDIA_H200' (a file name)."""
    return re.sub(r"[^0-9A-Za-z]+", "_", name).strip("_")


@functools.lru_cache(maxsize=None)
def current_gpu() -> str | None:
    if not torch.cuda.is_available():
        return None
    return gpu_key(torch.cuda.get_device_name())


@functools.lru_cache(maxsize=None)
def load_table(gpu: str) -> tuple[dict, ...]:
    path = TABLE_DIR / f"{gpu}.json"
    if not path.exists():
        return ()
    return tuple(json.loads(path.read_text())["entries"])


def entry_key(spec) -> dict:
    """What a table entry is matched on: the kernel body's hash, template, pattern, dtype, size."""
    from dataclasses import replace

    from fuser.emit import kernel_source

    stem, _ = kernel_source(replace(spec, warps=1))  # the body alone: warps fixed
    return {
        "kernel": stem.rsplit("_", 1)[-1],
        "template": spec.template,
        "pattern": spec.pattern,
        "dtype": str(spec.inputs[0].dtype).removeprefix("torch.") if spec.inputs else "",
        "size": spec.program.numel if spec.program else 0,
    }


def lookup(spec, gpu: str | None) -> int | None:
    """The tuned ``num_warps`` for ``spec`` on ``gpu``, or None (use the heuristic)."""
    table = load_table(gpu) if gpu else ()
    if not table or spec.program is None:
        return None
    key = entry_key(spec)
    for entry in table:
        if entry["kernel"] == key["kernel"]:
            return entry["num_warps"]
    for fields in (("template", "pattern", "dtype"), ("template", "dtype")):
        near = [e for e in table if all(e[f] == key[f] for f in fields)]
        if near:
            best = min(near, key=lambda e: abs(math.log2(max(e["size"], 1)) - math.log2(max(key["size"], 1))))
            return best["num_warps"]
    return None
