"""Per-dtype tolerances for comparing a fused result with the eager one.

Two levels:

* ``KERNEL`` — one fused chain against its eager ops (apply-time validation, golden tests).
  bf16 allows two units in the last place (2^-6 relative: an ulp is 2^-7 of the binade's
  start): the kernel computes the chain in fp32 and may round one ulp apart from PyTorch
  (the GPU's approximate rsqrt, another order of a sum), and a chain that rounds to bf16
  twice, as eager does (a norm rounded, then its bf16 weight multiplied and rounded again),
  carries that ulp into a second; Triton's CPU interpreter truncates fp32->bf16 instead of
  rounding to nearest. fp8 e4m3 allows one unit (2^-3): the rounding is
  exact, but an fp32 input one ulp apart may fall on the other side of an fp8 rounding edge.
* ``LAYER`` — a whole module's output and buffers (``fuser check``). Each one-ulp
  difference passes through later GEMMs and bf16 roundings, so elementwise bounds do not
  fit: on the tiny DSv4 layer, changing the *input* by one bf16 ulp moves the output by
  ~1% in norm and up to 0.05 at 4.0, and the fused layer differs from eager by the same
  (1.2%, 0.09). The layer check therefore bounds the normwise relative error
  ``|a - e| / |e|`` and the largest error relative to the largest value; a wrong kernel
  gives errors of order one in both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

#: dtype -> (rtol, atol), for one fused chain
KERNEL = {
    torch.float32: (1e-4, 1e-5),
    torch.float16: (2e-3, 1e-3),
    torch.bfloat16: (2**-6, 1e-2),
    torch.float8_e4m3fn: (2**-3, 2**-9),  # one unit in the last place; the subnormal step
}
#: dtype -> (normwise rtol, max error relative to max |value|), for a whole module
LAYER = {
    torch.float32: (1e-4, 1e-3),
    torch.float16: (4e-3, 1.6e-2),
    torch.bfloat16: (2**-5, 2**-4),
}


def tolerance(dtype: torch.dtype, level: dict = KERNEL) -> tuple[float, float]:
    return level.get(dtype, (0.0, 0.0))


def mismatch(actual, expected, what: str = "value", level: dict = KERNEL, tol_dtype=None) -> str | None:
    """None when ``actual`` matches ``expected`` within its dtype's tolerance, else why not.

    ``tol_dtype`` overrides the dtype whose tolerance applies: an fp32 value computed from a
    bf16 one carries bf16's precision, whatever dtype it is stored in.
    """
    if isinstance(expected, (tuple, list)):
        if not isinstance(actual, (tuple, list)) or len(actual) != len(expected):
            return f"{what}: structure differs"
        for i, (a, e) in enumerate(zip(actual, expected)):
            problem = mismatch(a, e, f"{what}[{i}]", level, tol_dtype)
            if problem:
                return problem
        return None
    if isinstance(expected, Mapping):  # a dict, transformers' ModelOutput
        if not isinstance(actual, Mapping) or list(actual) != list(expected):
            return f"{what}: keys differ"
        for key, e in expected.items():
            problem = mismatch(actual[key], e, f"{what}[{key!r}]", level, tol_dtype)
            if problem:
                return problem
        return None
    if dataclasses.is_dataclass(expected) and not isinstance(expected, type):
        if type(actual) is not type(expected):
            return f"{what}: got {type(actual).__name__}, expected {type(expected).__name__}"
        for field in dataclasses.fields(expected):
            problem = mismatch(getattr(actual, field.name), getattr(expected, field.name), f"{what}.{field.name}", level, tol_dtype)
            if problem:
                return problem
        return None
    if not isinstance(expected, torch.Tensor):
        return None if actual == expected else f"{what}: {actual!r} != {expected!r}"
    if not isinstance(actual, torch.Tensor) or actual.shape != expected.shape or actual.dtype != expected.dtype:
        got = f"{actual.dtype} {tuple(actual.shape)}" if isinstance(actual, torch.Tensor) else type(actual).__name__
        return f"{what}: got {got}, expected {expected.dtype} {tuple(expected.shape)}"
    rtol, atol = tolerance(tol_dtype or expected.dtype, level)
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if not e.is_floating_point():
        return None if torch.equal(a, e) else f"{what}: {int((a != e).sum())} elements differ"
    if level is LAYER:
        return _layer_mismatch(a.double(), e.double(), what, rtol, atol, expected.dtype)
    if torch.allclose(a.float(), e.float(), rtol=rtol, atol=atol, equal_nan=True):
        return None
    diff = (a.float() - e.float()).abs().nan_to_num(float("inf"))
    return f"{what}: max |diff| {diff.max().item():.3g} over rtol={rtol:g}, atol={atol:g} ({expected.dtype})"


def _layer_mismatch(a, e, what, norm_rtol, max_rtol, dtype) -> str | None:
    if not torch.equal(a.isnan(), e.isnan()) or not torch.equal(a.isinf(), e.isinf()):
        return f"{what}: NaN/Inf positions differ"
    finite = e.isfinite()
    a, e = a[finite], e[finite]
    if e.numel() == 0:
        return None
    diff = a - e
    norm_err = (diff.norm() / e.norm().clamp_min(1e-30)).item()
    max_err = (diff.abs().max() / e.abs().max().clamp_min(1e-30)).item()
    if norm_err <= norm_rtol and max_err <= max_rtol:
        return None
    return (
        f"{what}: normwise relative error {norm_err:.3g} (limit {norm_rtol:g}), "
        f"max error / max value {max_err:.3g} (limit {max_rtol:g}) ({dtype})"
    )


_PRECISION = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, torch.float64: 3}


def least_precise(dtypes) -> torch.dtype | None:
    """The floating dtype with the fewest mantissa bits among ``dtypes`` (None if none is)."""
    floats = [d for d in dtypes if d in _PRECISION]
    return min(floats, key=_PRECISION.get) if floats else None


#: A top-k choice is a near tie where the k-th and the next score differ by at most this much,
#: relative to the k-th (bf16 holds 8 bits: a few of its last-bit steps).
NEAR_TIE = 2.0**-6


def near_tie_rows(scores: torch.Tensor, k: int, largest: bool = True) -> set[int]:
    """Rows (dim 0) of ``scores`` where a top-k along the last axis has its k-th and next-best
    scores within NEAR_TIE of each other: there a last-bit difference (or an exact tie, which
    torch may break either way) picks the other one, and either pick is right."""
    if scores.dim() < 2 or not 0 < k < scores.shape[-1]:
        return set()
    ranked = scores.detach().float().sort(dim=-1, descending=largest).values
    kth, next_ = ranked[..., k - 1], ranked[..., k]
    close = (kth - next_).abs() <= NEAR_TIE * kth.abs().clamp_min(torch.finfo(torch.float32).tiny)
    return {int(r) for r in close.reshape(close.shape[0], -1).any(-1).nonzero().flatten()}


def rows_besides_ties(tied: set[int], rows: int) -> list[int] | None:
    """The rows to compare once the near-tie rows ``tied`` are left out; None when there is
    none to leave out, or more than a quarter of the rows (near ties everywhere would say
    nothing of the kernel)."""
    if not tied or len(tied) * 4 > rows:
        return None
    return [r for r in range(rows) if r not in tied]
