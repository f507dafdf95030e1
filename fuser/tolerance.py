"""Per-dtype tolerances for comparing a fused result with the eager one.

Two levels:

* ``KERNEL`` — one fused chain against its eager ops (apply-time validation, golden tests).
  bf16 allows two units in the last place relative (2 * 2^-8): the kernel computes the chain
  in fp32 and may round one ulp apart from PyTorch, and Triton's CPU interpreter truncates
  fp32->bf16 instead of rounding to nearest.
* ``LAYER`` — a whole module's output (``fuser check``): each one-ulp difference passes
  through later GEMMs and bf16 roundings; on the tiny DSv4 layer a one-ulp change of the
  input alone moves the output by up to 0.05 (4 ulps at 4.0), so bf16 allows 2^-5 relative.
"""

from __future__ import annotations

import torch

#: dtype -> (rtol, atol), for one fused chain
KERNEL = {
    torch.float32: (1e-4, 1e-5),
    torch.float16: (2e-3, 1e-3),
    torch.bfloat16: (2**-7, 1e-2),
}
#: dtype -> (rtol, atol), for a whole module's outputs and buffers
LAYER = {
    torch.float32: (1e-3, 1e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2**-5, 2**-5),
}


def tolerance(dtype: torch.dtype, level: dict = KERNEL) -> tuple[float, float]:
    return level.get(dtype, (0.0, 0.0))


def mismatch(actual, expected, what: str = "value", level: dict = KERNEL) -> str | None:
    """None when ``actual`` matches ``expected`` within its dtype's tolerance, else why not."""
    if isinstance(expected, (tuple, list)):
        if not isinstance(actual, (tuple, list)) or len(actual) != len(expected):
            return f"{what}: structure differs"
        for i, (a, e) in enumerate(zip(actual, expected)):
            problem = mismatch(a, e, f"{what}[{i}]", level)
            if problem:
                return problem
        return None
    if not isinstance(expected, torch.Tensor):
        return None if actual == expected else f"{what}: {actual!r} != {expected!r}"
    if not isinstance(actual, torch.Tensor) or actual.shape != expected.shape or actual.dtype != expected.dtype:
        got = f"{actual.dtype} {tuple(actual.shape)}" if isinstance(actual, torch.Tensor) else type(actual).__name__
        return f"{what}: got {got}, expected {expected.dtype} {tuple(expected.shape)}"
    rtol, atol = tolerance(expected.dtype, level)
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if not e.is_floating_point():
        return None if torch.equal(a, e) else f"{what}: {int((a != e).sum())} elements differ"
    if torch.allclose(a.float(), e.float(), rtol=rtol, atol=atol, equal_nan=True):
        return None
    diff = (a.float() - e.float()).abs().nan_to_num(float("inf"))
    return f"{what}: max |diff| {diff.max().item():.3g} over rtol={rtol:g}, atol={atol:g} ({expected.dtype})"
