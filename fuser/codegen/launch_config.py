"""launch_config: warps per fused kernel, chosen offline per GPU, looked up when a kernel is emitted.

``fuser tune FILE.py:FACTORY`` (:mod:`fuser.tools.tune`) times each kernel of a model at every warp
count on one GPU and writes a table ``<GPU>.json``; fuser's own tables ship in
``fuser/launch_configs/``, and ``$FUSER_LAUNCH_CONFIGS`` (directories, ``:``-separated) adds
a user's, searched first. At apply time a kernel's ``num_warps`` comes from the table of the
GPU it is built on, never from a benchmark:

1. the entry for this very kernel (:func:`kernel_hash`: a hash of what it is made of), else
2. the heuristic below (:func:`heuristic_warps`; always on the CPU, where the interpreter ignores it).

The same directories hold each GPU's lone-op table, ``<GPU>-lone_ops.json`` (``fuser tune
--lone-ops``): whether one op alone between heavy ops gets a kernel of its own
(:mod:`fuser.regions.lone_ops`).

An entry applies to its own kernel only: warps tuned for one kernel say little about another
of the same size (a DSv4 mHC entry chose 1 warp where a 4096-wide RMSNorm wants 8).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import replace
from pathlib import Path

# (TABLE_DIR, current_gpu and gpu_key are read from here too: where the tables are, this GPU)
from fuser.ir.device_tables import TABLE_DIR, USER_TABLES, LaunchTableError, current_gpu, gpu_key, table_dirs, table_entries  # noqa: F401
from fuser.lower.warps import elements_per_warp, warps_for
from fuser.pattern import templates_dir


@functools.lru_cache(maxsize=None)
def load_table(gpu: str) -> dict[str, int]:
    """kernel hash -> num_warps for ``gpu``, over every table directory (the first one wins)."""
    warps: dict[str, int] = {}
    for directory in reversed(table_dirs()):
        path = directory / f"{gpu}.json"
        if path.exists():
            warps.update(_entries(path))
    return warps


def _entries(path: Path) -> dict[str, int]:
    """A table file's entries (kernel hash -> warps), or an error naming the file and what is
    wrong: not JSON, no ``entries`` list, an entry without a ``kernel`` string or with warps that
    are not a power of two from 1 to 32."""
    where = f"launch table {path} (read through {USER_TABLES} or fuser's own)"
    entries = table_entries(path, where, LaunchTableError)
    found = {}
    for i, entry in enumerate(entries):
        kernel = entry.get("kernel") if isinstance(entry, dict) else None
        warps = entry.get("num_warps") if isinstance(entry, dict) else None
        if not isinstance(kernel, str) or type(warps) is not int or warps not in (1, 2, 4, 8, 16, 32):
            raise LaunchTableError(f"{where}: entry {i} needs a \"kernel\" hash and \"num_warps\" of 1, 2, 4, 8, 16 or 32, has {entry!r}")
        found[kernel] = warps
    return found


def entry_key(spec) -> dict:
    """What a table entry is matched on (:func:`kernel_hash`) and what it records about the kernel."""
    return {
        "kernel": kernel_hash(spec),
        "template": spec.template,
        "pattern": spec.pattern,
        "dtype": str(spec.inputs[0].dtype).removeprefix("torch.") if spec.inputs else "",
        "size": spec.program.numel if spec.program else 0,
    }


def kernel_hash(spec) -> str:
    """A hash of what the kernel of ``spec`` (an :class:`fuser.codegen.emit.KernelSpec`) is made of: its
    template and the shared frames it extends, its operands, parameters and row program, but
    not its warps nor what the heuristic would give it (a table entry stands in for those).
    Computed from that data, before anything is rendered."""
    program = replace(spec.program, num_warps=0, per_warp=0) if spec.program is not None else None
    made_of = (spec.template, spec.pattern, spec.inputs, spec.outputs, sorted(spec.params.items()),
               sorted(spec.sizes.items()), program, _template_sources(spec.template))  # fmt: skip
    return hashlib.sha256(repr(made_of).encode()).hexdigest()[:12]


@functools.lru_cache(maxsize=None)
def _template_sources(template: str) -> tuple[str, ...]:
    """The text of ``template`` and of the shared frames (``_*.py.jinja``) templates extend."""
    paths = [templates_dir() / f"{template}.py.jinja", *sorted(templates_dir().glob("_*.py.jinja"))]
    return tuple(p.read_text() for p in paths)


def lookup(spec, gpu: str | None) -> int | None:
    """The tuned ``num_warps`` for this very kernel on ``gpu``, or None (use the heuristic)."""
    table = load_table(gpu) if gpu else {}
    if not table or spec.program is None:
        return None
    return table.get(entry_key(spec)["kernel"])


def heuristic_warps(numel: int, reducing: bool, tiled: bool, leading: bool, op_names: set[str]) -> int:
    """Warps for a row program without a launch-table entry of its own, by its block's size
    and what it does (:func:`elements_per_warp`)."""
    return warps_for(numel, elements_per_warp(reducing, tiled, leading, op_names))
