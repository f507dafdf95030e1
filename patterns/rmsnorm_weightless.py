"""Weight-free RMSNorm in fp32, cast back (DSv4 C4: the per-head q norm, rounded before RoPE)."""

import torch

from fuser.pattern import Param, tensor


def reference(x, eps=Param(1e-6)):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


PATTERN = dict(
    template="row_reduce",
    inputs=dict(x=tensor("T, ..., N", "bfloat16 float16 float32")),
    example=dict(N=64),
)
