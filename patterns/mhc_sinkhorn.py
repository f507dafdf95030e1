"""mHC split + Sinkhorn (DSV4.md A4-A5): mixes -> pre gates, post gates and the doubly
stochastic n x n stream-mixing matrix, every iteration in registers, one launch per call."""

import math

import torch

from fuser.pattern import Param, tensor


def reference(mixes, scale, base, eps=Param(1e-6), post_scale=Param(2.0), iters=Param(20, search=range(1, 65))):
    n = math.isqrt(mixes.shape[-1] + 1) - 1  # mixes holds (2 + n) * n values per token
    pre = torch.sigmoid(mixes[:, :n] * scale[0] + base[:n]) + eps
    post = post_scale * torch.sigmoid(mixes[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    c = (mixes[:, 2 * n :] * scale[2] + base[2 * n :]).view(-1, n, n)
    c = c.softmax(-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return pre, post, c


PATTERN = dict(
    template="sinkhorn",
    inputs=dict(
        mixes=tensor("T, M", "float32"),
        scale=tensor("3", "float32"),
        base=tensor("M", "float32"),
    ),
    example=dict(M=24),
)
