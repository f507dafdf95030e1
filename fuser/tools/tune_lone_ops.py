"""tune_lone_ops: time PyTorch's kernel for one op alone against the kernel fuser makes for it, per
op kind, width and dtype, on this GPU, and write the lone-op table :mod:`fuser.regions.lone_ops`
reads when it decides whether a lone op between heavy ops gets a kernel of its own.

    fuser tune --lone-ops [--ops layer_norm,gelu] [--widths 64,4096] [--dtypes bfloat16] [--out DIR]
    PYTHONPATH=. python benchmarks/tune_lone_ops.py          # the standard set, the same table

Each op runs alone in a small module (:class:`LoneOp`) on ``[T, width]`` rows; fuser plans it
with every lone op fused (:func:`fuser.regions.lone_ops.forced`), and the one kernel it makes is
timed on the module's recorded inputs at each decode token count, as is PyTorch's op on the same
rows, each as back-to-back launches replayed from a CUDA graph
(:func:`fuser.tools.tune.time_launches_us`). The table (``<GPU>-lone_ops.json``) is merged into
``DIR`` (default: ``fuser/codegen/launch_configs/``): an entry of the same op, width and dtype is
replaced.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from fuser.regions import lone_ops

#: The standard set: op kind -> the dtypes it reads (a cast reads the dtype it casts from).
STANDARD_OPS: dict[str, tuple[str, ...]] = {
    "layer_norm": ("bfloat16", "float16", "float32"),
    "layer_norm_nobias": ("bfloat16", "float16", "float32"),
    "rms_norm": ("bfloat16", "float16", "float32"),
    "gelu": ("bfloat16", "float16", "float32"),
    "gelu_tanh": ("bfloat16", "float16", "float32"),
    "relu": ("bfloat16", "float16", "float32"),
    "relu2": ("bfloat16", "float16", "float32"),
    "silu": ("bfloat16", "float16", "float32"),
    "softmax": ("bfloat16", "float16", "float32"),
    "cast_to_float32": ("bfloat16", "float16"),
    "cast_to_bfloat16": ("float32",),
}
#: Hidden sizes and head dims of today's models.
STANDARD_WIDTHS = (64, 128, 256, 512, 1024, 1536, 2048, 2560, 3072, 4096, 5120, 7168, 8192)
#: Decode token counts.
DECODE_TOKENS = (1, 2, 4, 8, 16)


class LoneOpError(RuntimeError):
    """An op of the standard set that fuser did not make exactly one kernel for."""


class LoneOp(nn.Module):
    """One op of kind ``kind`` on rows of ``width``, as a model spells it (``forward``, what fuser
    traces) and as PyTorch's own op (:meth:`torch_op`, what it is timed against)."""

    def __init__(self, kind: str, width: int, dtype: torch.dtype):
        super().__init__()
        if kind not in STANDARD_OPS:
            raise ValueError(f"no lone op {kind!r}; the ops are: {', '.join(STANDARD_OPS)}")
        self.kind, self.width = kind, width
        if kind in ("layer_norm", "layer_norm_nobias", "rms_norm"):
            self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(width, dtype=dtype))
        if kind == "layer_norm":
            self.bias = nn.Parameter(0.1 * torch.randn(width, dtype=dtype))

    def forward(self, x):
        kind = self.kind
        if kind == "rms_norm":  # as transformers' RMSNorm writes it (fuser's rmsnorm pattern)
            xf = x.float()
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
            return (xf * self.weight).to(x.dtype)
        return self.torch_op(x)

    def torch_op(self, x):
        kind = self.kind
        if kind in ("layer_norm", "layer_norm_nobias"):
            return F.layer_norm(x, (self.width,), self.weight, getattr(self, "bias", None), 1e-5)
        if kind == "rms_norm":
            return F.rms_norm(x, (self.width,), self.weight, 1e-6)
        if kind == "gelu":
            return F.gelu(x)
        if kind == "gelu_tanh":
            return F.gelu(x, approximate="tanh")
        if kind == "relu":
            return torch.relu(x)
        if kind == "relu2":
            return torch.relu(x).square()
        if kind == "silu":
            return F.silu(x)
        if kind == "softmax":
            return torch.softmax(x, dim=-1)
        return x.to(getattr(torch, kind.removeprefix("cast_to_")))


def measure(kind: str, width: int, dtype: str, tokens=DECODE_TOKENS, device="cuda", timer: Callable | None = None) -> dict:
    """One table entry: PyTorch's op and fuser's kernel for it, in µs per launch at each token
    count. ``timer(launch, args)`` times back-to-back launches (default: in a CUDA graph)."""
    from fuser.pipeline.fuse_module import plan
    from fuser.tools.tune import time_launches_us, token_rows
    from fuser.validate.against_eager import record_values

    timer = timer or time_launches_us
    module = LoneOp(kind, width, getattr(torch, dtype)).to(device)
    x = torch.randn(max(tokens), width, device=device, dtype=getattr(torch, dtype))
    with lone_ops.forced(True):
        p = plan(module, (x,))
    what = f"{kind} at width {width}, {dtype}"
    if len(p.kernels) != 1:
        left = "; ".join(f"{u.node}: {u.reason}" for u in p.report.unfused) or "nothing left eager"
        raise LoneOpError(f"{what}: fuser made {len(p.kernels)} kernels where one was expected ({left})")
    kernel = p.kernels[0]
    args = record_values(module, p.traced, p.cops).inputs_of(kernel.region)

    def torch_op(x):
        return module.torch_op(x)

    with torch.no_grad():
        fuser_us = {str(T): round(timer(kernel.launch, token_rows(args, kernel.spec.inputs, T)), 3) for T in tokens}
        torch_us = {str(T): round(timer(torch_op, (x[:T],)), 3) for T in tokens}
    fused = sum(fuser_us.values()) < sum(torch_us.values())
    return {"op": kind, "width": width, "dtype": dtype, "torch_us": torch_us, "fuser_us": fuser_us,
            "fused": fused, "kernel": kernel.path.stem}  # fmt: skip


def measure_all(ops=None, widths=STANDARD_WIDTHS, dtypes=None, tokens=DECODE_TOKENS, device="cuda",
                timer: Callable | None = None, log: Callable = print) -> list[dict]:  # fmt: skip
    """Entries for ``ops`` (default: :data:`STANDARD_OPS`) at every width and dtype each reads
    (``dtypes`` narrows them)."""
    entries = []
    for kind in ops or STANDARD_OPS:
        if kind not in STANDARD_OPS:
            raise ValueError(f"no lone op {kind!r}; the ops are: {', '.join(STANDARD_OPS)}")
        for dtype in STANDARD_OPS[kind]:
            if dtypes and dtype not in dtypes:
                continue
            for width in widths:
                entry = measure(kind, width, dtype, tokens, device, timer)
                entries.append(entry)
                torch_mean = sum(entry["torch_us"].values()) / len(tokens)
                fuser_mean = sum(entry["fuser_us"].values()) / len(tokens)
                log(f"{kind:>18} {dtype:>9} width {width:>5}: PyTorch {torch_mean:7.2f} µs, fuser {fuser_mean:7.2f} µs "
                    f"-> {'fused' if entry['fused'] else 'left to PyTorch'}")  # fmt: skip
    return entries


def write_table(entries: list[dict], out_dir: Path, gpu: str, about: dict) -> Path:
    """Merge ``entries`` into ``out_dir/<gpu>-lone_ops.json`` (an entry of the same op, width
    and dtype is replaced), entries in order of op, dtype and width."""
    from fuser.tools.tune import merge_into_table

    path = Path(out_dir) / f"{gpu}{lone_ops.TABLE_SUFFIX}"
    return merge_into_table(path, entries, key=lambda e: (e["op"], e["dtype"], e["width"]), about=about, ordered=True)
