"""launch_config: warps per fused kernel, chosen offline per GPU, looked up when a kernel is emitted.

``fuser tune FILE.py:FACTORY`` (:mod:`fuser.tune`) times each kernel of a model at every warp
count on one GPU and writes a table ``<GPU>.json``; fuser's own tables ship in
``fuser/launch_configs/``, and ``$FUSER_LAUNCH_CONFIGS`` (directories, ``:``-separated) adds
a user's, searched first. At apply time a kernel's ``num_warps`` comes from the table of the
GPU it is built on, never from a benchmark:

1. the entry for this very kernel (the hash of its body), else
2. the heuristic in :mod:`fuser.lower` (and always on the CPU, where the interpreter ignores it).

An entry applies to its own kernel only: warps tuned for one kernel say little about another
of the same size (a DSv4 mHC entry chose 1 warp where a 4096-wide RMSNorm wants 8).
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import torch

TABLE_DIR = Path(__file__).resolve().parent / "launch_configs"
USER_TABLES = "FUSER_LAUNCH_CONFIGS"


def gpu_key(name: str) -> str:
    """'NVIDIA H200' -> 'NVIDIA_H200' (a file name)."""
    return re.sub(r"[^0-9A-Za-z]+", "_", name).strip("_")


@functools.lru_cache(maxsize=None)
def current_gpu() -> str | None:
    if not torch.cuda.is_available():
        return None
    return gpu_key(torch.cuda.get_device_name())


def table_dirs() -> list[Path]:
    """Where tables are read from: the user's directories first, then fuser's own."""
    user = [Path(p) for p in os.environ.get(USER_TABLES, "").split(os.pathsep) if p]
    return user + [TABLE_DIR]


@functools.lru_cache(maxsize=None)
def load_table(gpu: str) -> dict[str, int]:
    """kernel hash -> num_warps for ``gpu``, over every table directory (the first one wins)."""
    warps: dict[str, int] = {}
    for directory in reversed(table_dirs()):
        path = directory / f"{gpu}.json"
        if path.exists():
            warps.update({e["kernel"]: e["num_warps"] for e in json.loads(path.read_text())["entries"]})
    return warps


def entry_key(spec) -> dict:
    """What a table entry is matched on — the kernel body's hash — and what it records about it."""
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
    """The tuned ``num_warps`` for this very kernel on ``gpu``, or None (use the heuristic)."""
    table = load_table(gpu) if gpu else {}
    if not table or spec.program is None:
        return None
    return table.get(entry_key(spec)["kernel"])
