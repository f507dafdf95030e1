"""mHC mix scaling + split + Sinkhorn (DSV4.md A3-A5): the mix GEMM's output times the
per-token rsqrt(mean(x^2) + eps), then the mhc_sinkhorn block, all in one launch."""

from pathlib import Path

from fuser.pattern import Param, tensor
from fuser.match.pattern_files import load_pattern

_sinkhorn = load_pattern(Path(__file__).with_name("mhc_sinkhorn.py")).reference


def reference(mix, rms, scale, base, eps=Param(1e-6), post_scale=Param(2.0), iters=Param(20, search=range(1, 65))):
    return _sinkhorn(mix * rms, scale, base, eps, post_scale, iters)


PATTERN = dict(
    template="sinkhorn",
    inputs=dict(
        mix=tensor("T, M", "float32"),
        rms=tensor("T, 1", "float32"),
        scale=tensor("3", "float32"),
        base=tensor("M", "float32"),
    ),
    example=dict(M=24),
)
