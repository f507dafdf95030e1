"""The lone-op table of this GPU: PyTorch's kernel for one op alone against fuser's, per op kind,
width and dtype at decode token counts, written to fuser/codegen/launch_configs/<GPU>-lone_ops.json
(fuser.regions.lone_ops reads it to decide whether a lone op between heavy ops gets a kernel).

    PYTHONPATH=. python benchmarks/tune_lone_ops.py                       # the standard set
    PYTHONPATH=. python benchmarks/tune_lone_ops.py --ops layer_norm,gelu --widths 2048,4096

The same as ``fuser tune --lone-ops``; options narrow the set, and each run merges its entries
into the table, so the set can be measured in parts.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from fuser.codegen.launch_config import TABLE_DIR, current_gpu
from fuser.tools import bench
from fuser.tools import tune_lone_ops as lone


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", help=f"op kinds, comma-separated (default: {','.join(lone.STANDARD_OPS)})")
    p.add_argument("--widths", help=f"row widths (default: {','.join(map(str, lone.STANDARD_WIDTHS))})")
    p.add_argument("--dtypes", help="dtypes, comma-separated (default: each op's)")
    p.add_argument("--tokens", help=f"decode token counts (default: {','.join(map(str, lone.DECODE_TOKENS))})")
    p.add_argument("--out", default=str(TABLE_DIR), help="directory of the table (default: %(default)s)")
    return p


def main(argv=None, *, timer=None, device: str = "cuda", gpu: str | None = None) -> Path:
    """Measure and write the table; returns its path. ``timer``, ``device`` and ``gpu`` are for
    running it on the CPU in a test (a GPU run uses CUDA-graph timing and the GPU's name)."""
    args = _parser().parse_args(argv)
    gpu = gpu or current_gpu()
    if gpu is None or (device == "cuda" and not torch.cuda.is_available()):
        raise SystemExit("tune_lone_ops times kernels on a CUDA GPU and there is none here")

    def split(text, cast=str):
        return tuple(cast(t.strip()) for t in text.split(",") if t.strip()) if text else None

    started = time.perf_counter()
    entries = lone.measure_all(split(args.ops), split(args.widths, int) or lone.STANDARD_WIDTHS, split(args.dtypes),
                               split(args.tokens, int) or lone.DECODE_TOKENS, device, timer)  # fmt: skip
    about = {**bench.stamp(), "tokens": list(split(args.tokens, int) or lone.DECODE_TOKENS)}
    path = lone.write_table(entries, Path(args.out), gpu, about)
    fused = sum(e["fused"] for e in entries)
    print(f"wrote {path}: {len(entries)} ops alone, {fused} faster as fuser's kernel ({time.perf_counter() - started:.0f} s)")
    return path


if __name__ == "__main__":
    main(sys.argv[1:])
