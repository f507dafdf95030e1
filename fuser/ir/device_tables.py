"""device_tables: where the tables measured offline per GPU are kept and which GPU this is.

fuser reads per-GPU tables measured offline, never timings taken while serving: the warps of
each fused kernel (:mod:`fuser.codegen.launch_config`), whether a lone op is faster as a
fuser kernel (:mod:`fuser.regions.lone_ops`) and where a GEMM runs on fuser's decode GEMM kernel
(:mod:`fuser.install.decode_gemm`). Each is a JSON file named after the GPU
(``NVIDIA_H200.json``, ``NVIDIA_H200-lone_ops.json``) in fuser's own directory,
``fuser/codegen/launch_configs/``, or in directories the user names in ``$FUSER_LAUNCH_CONFIGS``
(``:``-separated, read first). Every stage may read them, so they live here.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import torch

TABLE_DIR = Path(__file__).resolve().parent.parent / "codegen" / "launch_configs"
USER_TABLES = "FUSER_LAUNCH_CONFIGS"


def gpu_key(name: str) -> str:
    """'NVIDIA H200' -> 'NVIDIA_H200' (a file name)."""
    return re.sub(r"[^0-9A-Za-z]+", "_", name).strip("_")


@functools.lru_cache(maxsize=None)
def current_gpu() -> str | None:
    if not torch.cuda.is_available():
        return None
    return gpu_key(torch.cuda.get_device_name())


class LaunchTableError(ValueError):
    """A launch table that cannot be read; names the file (or the directory) and the variable."""


def table_dirs() -> list[Path]:
    """Where tables are read from: the user's directories first, then fuser's own. A directory
    named in $FUSER_LAUNCH_CONFIGS that does not exist is an error, not a table silently missed."""
    user = [Path(p) for p in os.environ.get(USER_TABLES, "").split(os.pathsep) if p]
    for directory in user:
        if not directory.is_dir():
            raise LaunchTableError(f"{USER_TABLES} names {directory}, which is not a directory")
    return user + [TABLE_DIR]


def table_file(env: str, suffix: str, gpu: str | None, error: type[Exception]) -> Path | None:
    """The file of a table read one file at a time: the one ``$env`` names (``error`` where it
    is not a file), else ``gpu``'s (``<gpu><suffix>``) in the first table directory that has it;
    None if neither."""
    named = os.environ.get(env)
    if named:
        path = Path(named)
        if not path.is_file():
            raise error(f"{env} names {path}, which is not a file")
        return path
    if gpu is None:
        return None
    return next((d / f"{gpu}{suffix}" for d in table_dirs() if (d / f"{gpu}{suffix}").is_file()), None)


def table_entries(path: Path, where: str, error: type[Exception]) -> list:
    """The ``entries`` list of a table file, or ``error`` naming ``where`` and what is wrong (not
    JSON, no ``entries`` list)."""
    try:
        table = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise error(f"{where}: {e}") from None
    entries = table.get("entries") if isinstance(table, dict) else None
    if not isinstance(entries, list):
        raise error(f'{where}: no "entries" list')
    return entries
