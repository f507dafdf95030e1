"""Weighted RMSNorm in fp32, cast back once (sglang RMSNorm.forward_native; DSv4 B, C2, F)."""

import torch

from fuser.pattern import Param, tensor


def reference(x, weight, eps=Param(1e-6)):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight).to(x.dtype)


PATTERN = dict(
    template="row_reduce",
    inputs=dict(
        x=tensor("T, ..., N", "bfloat16 float16 float32"),
        weight=tensor("N", "bfloat16 float16 float32"),
    ),
    example=dict(N=64),
)
