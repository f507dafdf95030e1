"""Clamped SwiGLU: silu(min(g, high)) * clamp(u, low, high) on [g | u], the clamps in the input
dtype, the product in fp32, rounded back (DSv4 G4, sglang silu_and_mul_clamp)."""

import torch
import torch.nn.functional as F

from fuser.pattern import Param, tensor


def reference(gate_up, low=Param(-10.0), high=Param(10.0)):
    inter = gate_up.shape[-1] // 2
    g = torch.clamp(gate_up[..., :inter], max=high)
    u = torch.clamp(gate_up[..., inter:], low, high)
    return (F.silu(g.float()) * u.float()).to(gate_up.dtype)


PATTERN = dict(
    template="pointwise",
    inputs=dict(gate_up=tensor("T, I2", "bfloat16 float16 float32")),
    example=dict(I2=64),
)
