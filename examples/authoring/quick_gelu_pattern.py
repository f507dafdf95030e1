"""Quick GELU, x * sigmoid(1.702 x), in fp32 and rounded back once (the authoring guide's
worked example: docs/authoring.md)."""

import torch

from fuser.pattern import Param, tensor


def reference(x, alpha=Param(1.702)):
    xf = x.float()
    return (xf * torch.sigmoid(alpha * xf)).to(x.dtype)


PATTERN = dict(
    template="pointwise",
    inputs=dict(x=tensor("T, ..., N", "bfloat16 float16 float32")),
    example=dict(N=64),
)
