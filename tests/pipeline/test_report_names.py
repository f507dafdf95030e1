"""``fuser explain`` names each fused chain and each op left eager by its submodule and the
user's source line, in columns as wide as their longest entry."""

import torch
import torch.nn as nn

import fuser


class Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, 16))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))  # NORM-LINE


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = Norm()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        return self.proj(self.norm(x + 1.0))


def line(marker: str) -> int:
    return next(i for i, s in enumerate(open(__file__), 1) if s.rstrip().endswith(f"# {marker}"))


def test_a_chain_is_named_by_its_submodule_and_source_line():
    report = fuser.explain(Block(), (torch.randn(3, 16),))
    (chain,) = [c for c in report.chains if "norm" in c.where]
    assert chain.where.startswith("norm (") and chain.where.endswith(f"test_report_names.py:{line('NORM-LINE')})"), chain.where
    text = report.text()
    assert f"at {chain.where}" in text
    rows = [r for r in text.splitlines() if "launches -> 1" in r]
    width = max(len(c.pattern) for c in report.chains)
    assert all(r[2 + width] == " " for r in rows), rows  # no pattern runs into the template column
