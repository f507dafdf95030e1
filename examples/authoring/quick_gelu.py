"""A module with a chain no built-in pattern names: the "quick GELU" x * sigmoid(1.702 x),
computed in fp32 and rounded back. docs/authoring.md turns it into a pattern."""

import torch
import torch.nn as nn


class QuickGeluBlock(nn.Module):
    def __init__(self, hidden: int = 64):
        super().__init__()
        self.up = nn.Linear(hidden, 2 * hidden, bias=False, dtype=torch.bfloat16)
        self.down = nn.Linear(2 * hidden, hidden, bias=False, dtype=torch.bfloat16)

    def forward(self, x):
        h = self.up(x)
        hf = h.float()
        h = (hf * torch.sigmoid(1.702 * hf)).to(h.dtype)
        return self.down(h)


def block(T: int = 5, hidden: int = 64, seed: int = 0, device="cpu"):
    torch.manual_seed(seed)
    module = QuickGeluBlock(hidden).to(device).eval()
    return module, (torch.randn(T, hidden, dtype=torch.bfloat16, device=device),)
