"""Residual add + weighted RMSNorm: returns the normed sum and the new residual (one pass)."""

import torch

from fuser.pattern import Param, tensor


def reference(x, residual, weight, eps=Param(1e-6)):
    h = x + residual
    hf = h.float()
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return (hf * weight).to(h.dtype), h


PATTERN = dict(
    template="row_reduce",
    inputs=dict(
        x=tensor("T, ..., N", "bfloat16 float16 float32"),
        residual=tensor("T, ..., N", "bfloat16 float16 float32"),
        weight=tensor("N", "bfloat16 float16 float32"),
    ),
    example=dict(N=64),
)
