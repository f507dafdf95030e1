"""tune_decode_gemm: time PyTorch's GEMM (cuBLAS) against fuser's decode GEMM kernel for each
weight shape at decode token counts, on this GPU, and write the decode-GEMM table
:mod:`fuser.install.decode_gemm` reads.

    fuser tune --decode-gemm [--shapes 2048x8192,3072x2048] [--dtypes bfloat16] [--tokens 1,2,4,8,16] [--out DIR]

For each shape (``N x K``: a weight of N rows of K) and dtype, every configuration of
:data:`CONFIGS` is checked against ``F.linear`` at the largest token count (a configuration that
disagrees is not timed) and timed at each token count, as is ``F.linear``, each as back-to-back
launches replayed from a CUDA graph (:func:`fuser.tools.tune.time_rotating_launches_us`), the
launches taking turns over copies of the weight that together exceed twice the GPU's L2 cache:
each launch reads its weight from memory, as each layer of a decode step does (one weight
launched again and again would be read from L2 where it fits, 50 MB on an H100). The entry keeps
the fastest configuration up to ``CORE_ROWS`` tokens, which run as one does (``config``), and,
where another, the fastest over the larger counts, which run on ``tl.dot`` (``config_rows``),
both times per token count, and ``up_to``: the largest token count up to which the kernel was
the faster at every count (0: never). The table (``<GPU>-decode_gemm.json``) is merged into
``DIR`` (default: fuser's ``fuser/codegen/launch_configs/``): an entry of the same shape and
dtype is replaced.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from fuser.install import decode_gemm
from fuser.install.decode_gemm import Config

#: The linear layers of the benchmarked models, merged as fuser merges them: ``(N, K)``.
STANDARD_SHAPES = (
    (3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048),  # Llama-3.2-1B: qkv, o, gate+up, down, head
    (6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096),  # Qwen3-8B
)  # fmt: skip
#: (block_n, block_k, warps): few output columns a program over wide chunks of the reduction win at
#: one row on an H100 (benchmarks/probe_pdl_gemv.py: 4 or 8 columns, chunks of 1024 or 2048)
CONFIGS = tuple(
    Config(bn, bk, warps, decode_gemm.MAX_ROWS)
    for bn, bk, warps in ((4, 1024, 4), (4, 2048, 4), (8, 1024, 4), (8, 2048, 4), (8, 2048, 8), (16, 512, 4), (16, 1024, 8), (32, 512, 8))
)
DECODE_TOKENS = (1, 2, 4, 8, 16)
#: A configuration whose output differs from ``F.linear``'s by more than this (relative to the
#: output's largest magnitude) is wrong, not slow.
AGREEMENT = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def up_to(torch_us: dict[int, float], fuser_us: dict[int, float]) -> int:
    """The largest token count up to which the kernel is the faster at every count (0: none)."""
    best = 0
    for t in sorted(torch_us):
        if fuser_us[t] >= torch_us[t]:
            break
        best = t
    return best


def cold_copies(weight: torch.Tensor, cache: int | None = None) -> list[torch.Tensor]:
    """``weight`` and as many copies as take the set past twice ``cache`` bytes (default: the
    GPU's L2 cache; none on the CPU)."""
    if cache is None:
        cache = torch.cuda.get_device_properties(weight.device).L2_cache_size if weight.device.type == "cuda" else 0
    size = weight.numel() * weight.element_size()
    return [weight] + [weight.clone() for _ in range(-(-2 * cache // size))]


def measure(n: int, k: int, dtype: torch.dtype, tokens=DECODE_TOKENS, device="cuda", timer: Callable | None = None,
            configs=CONFIGS) -> dict:  # fmt: skip
    """The entry of one weight shape and dtype. ``timer(launch, arg_sets)``: microseconds a launch."""
    if timer is None:
        from fuser.tools.tune import time_rotating_launches_us as timer
    g = torch.Generator(device).manual_seed(n + k)
    weight = (torch.randn(n, k, device=device, generator=g) / k**0.5).to(dtype)
    weights = cold_copies(weight)
    x = torch.randn(max(tokens), k, device=device, generator=g).to(dtype)
    expected = F.linear(x, weight).float()
    torch_us = {t: timer(F.linear, [(x[:t], w) for w in weights]) for t in tokens}
    timed, wrong = [], []
    for config in configs:
        got = decode_gemm.linear(x, weight, config).float()
        if (got - expected).abs().max() > AGREEMENT[dtype] * expected.abs().max().clamp_min(1e-6):
            wrong.append(config)
            continue
        timed.append((config, {t: timer(decode_gemm.linear, [(x[:t], w, config) for w in weights]) for t in tokens}))
    if not timed:
        raise RuntimeError(f"decode GEMM {n}x{k} {dtype}: no configuration agrees with F.linear ({len(wrong)} tried)")
    # the launch up to CORE_ROWS rows (a batch of one, the decode step that matters most, summed
    # on the CUDA cores as two rows are) and past them (tl.dot's), each its fastest
    one = [t for t in tokens if t <= decode_gemm.CORE_ROWS] or list(tokens)
    more = [t for t in tokens if t > decode_gemm.CORE_ROWS] or list(tokens)
    best, best_us = min(timed, key=lambda c: sum(c[1][t] for t in one))
    rows, rows_us = min(timed, key=lambda c: sum(c[1][t] for t in more))
    fuser_us = {t: (best_us if t in one else rows_us)[t] for t in tokens}
    entry = dict(
        n=n, k=k, dtype=str(dtype).removeprefix("torch."), up_to=up_to(torch_us, fuser_us),
        config=dict(block_n=best.block_n, block_k=best.block_k, warps=best.warps),
        torch_us={str(t): round(v, 3) for t, v in torch_us.items()}, fuser_us={str(t): round(v, 3) for t, v in fuser_us.items()},
        disagreed=len(wrong),
    )  # fmt: skip
    if rows != best:
        entry["config_rows"] = dict(block_n=rows.block_n, block_k=rows.block_k, warps=rows.warps)
    return entry


def measure_all(shapes=STANDARD_SHAPES, dtypes=("bfloat16",), tokens=DECODE_TOKENS, device="cuda", timer=None,
                log: Callable = print) -> list[dict]:  # fmt: skip
    entries = []
    for name in dtypes:
        dtype = getattr(torch, name, None)
        if dtype not in AGREEMENT:
            raise ValueError(f"no decode GEMM of dtype {name!r}; the dtypes are: {', '.join(str(d).removeprefix('torch.') for d in AGREEMENT)}")
        for n, k in shapes:
            entry = measure(n, k, dtype, tokens, device, timer)
            entries.append(entry)
            rows = f", {entry['config_rows']} at more rows" if "config_rows" in entry else ""
            log(f"{n:>7}x{k:<6} {name:>9}: PyTorch {entry['torch_us']}, fuser {entry['fuser_us']} "
                f"({entry['config']}{rows}) -> fuser's up to {entry['up_to']} tokens")  # fmt: skip
    return entries


def write_table(entries: list[dict], out_dir: Path, gpu: str, about: dict) -> Path:
    """Merge ``entries`` into ``out_dir/<gpu>-decode_gemm.json`` (an entry of the same shape and
    dtype is replaced), in order of dtype and shape."""
    from fuser.tools.tune import merge_into_table

    path = Path(out_dir) / f"{gpu}{decode_gemm.TABLE_SUFFIX}"
    return merge_into_table(path, entries, key=lambda e: (e["dtype"], e["n"], e["k"]), about=about, ordered=True)


def shapes_of(text: str) -> tuple[tuple[int, int], ...]:
    """``"2048x8192,3072x2048"`` as ``((2048, 8192), (3072, 2048))``."""
    try:
        return tuple((int(n), int(k)) for n, k in (part.lower().split("x") for part in text.split(",") if part.strip()))
    except ValueError:
        raise ValueError(f"--shapes takes NxK pairs, comma-separated (2048x8192,3072x2048); got {text!r}") from None
