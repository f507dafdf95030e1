"""Per-dtype tolerances for comparing a fused result with the eager one.

bf16 allows two units in the last place relative (2 * 2^-8): the fused kernel computes each
chain in fp32 and may round an intermediate one ulp apart from PyTorch, and Triton's CPU
interpreter truncates fp32->bf16 instead of rounding to nearest.
"""

from __future__ import annotations

import torch

#: dtype -> (rtol, atol)
TOLERANCES = {
    torch.float32: (1e-4, 1e-5),
    torch.float16: (2e-3, 1e-3),
    torch.bfloat16: (2 ** -7, 1e-2),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    return TOLERANCES.get(dtype, (0.0, 0.0))


def mismatch(actual, expected, what: str = "value") -> str | None:
    """None when ``actual`` matches ``expected`` within its dtype's tolerance, else why not."""
    if isinstance(expected, (tuple, list)):
        if not isinstance(actual, (tuple, list)) or len(actual) != len(expected):
            return f"{what}: structure differs"
        for i, (a, e) in enumerate(zip(actual, expected)):
            problem = mismatch(a, e, f"{what}[{i}]")
            if problem:
                return problem
        return None
    if not isinstance(expected, torch.Tensor):
        return None if actual == expected else f"{what}: {actual!r} != {expected!r}"
    if not isinstance(actual, torch.Tensor) or actual.shape != expected.shape or actual.dtype != expected.dtype:
        got = f"{actual.dtype} {tuple(actual.shape)}" if isinstance(actual, torch.Tensor) else type(actual).__name__
        return f"{what}: got {got}, expected {expected.dtype} {tuple(expected.shape)}"
    rtol, atol = tolerance(expected.dtype)
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if not e.is_floating_point():
        return None if torch.equal(a, e) else f"{what}: {int((a != e).sum())} elements differ"
    if torch.allclose(a.float(), e.float(), rtol=rtol, atol=atol, equal_nan=True):
        return None
    diff = (a.float() - e.float()).abs().nan_to_num(float("inf"))
    return f"{what}: max |diff| {diff.max().item():.3g} over rtol={rtol:g}, atol={atol:g} ({expected.dtype})"
