"""fuser.install.any_size: a kernel of the call's inputs alone (an additive mask made from a
boolean one) runs its glue as PyTorch's ops where an input comes at a length it was not built
for, so the guard leaves that length free: a mask that grows a key each step (a dynamic cache)
keeps the fused path."""

import torch
import torch.nn as nn
import torch.nn.functional as F

import fuser
import fuser.install.any_size
import fuser.pipeline.pass_list
from fuser.validate.tolerance import LAYER, mismatch

E, HEADS = 16, 2


class MaskedAttention(nn.Module):
    """Attention over keys and values given as inputs, its boolean mask made additive (two ops
    of the mask alone) as transformers' sdpa path makes it."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(E, E)

    def forward(self, x, keys, values, mask):
        q = self.q(x).view(x.shape[0], x.shape[1], HEADS, E // HEADS).transpose(1, 2)
        additive = torch.where(mask, 0.0, -1e4).to(x.dtype)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=additive)
        return x + out.transpose(1, 2).reshape(x.shape)


def call(batch: int, keys: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed + keys)
    x = torch.randn(batch, 1, E, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(batch, HEADS, keys, E // HEADS, generator=g).to(torch.bfloat16) for _ in range(2))
    mask = torch.rand(batch, 1, 1, keys, generator=g) > 0.3
    mask[..., 0] = True  # (every row attends to a key)
    return x, k, v, mask


def test_a_mask_of_the_call_s_inputs_alone_may_grow_and_runs_its_ops_at_other_lengths(monkeypatch):
    paths = []
    real = fuser.install.any_size.at_any_size

    def recording(launch, ops, inputs, traced):
        return real(lambda *a: paths.append("kernel") or launch(*a), lambda *a: paths.append("ops") or ops(*a), inputs, traced)

    monkeypatch.setattr(fuser.pipeline.pass_list, "at_any_size", recording)
    module = MaskedAttention().to(torch.bfloat16).eval()
    report = fuser.apply(module, call(2, 23))
    (mask_kernel,) = [c for c in report.chains if "where" in c.nodes]
    assert report.shared == [mask_kernel.kernel] and report.free_sizes.get("mask") == [3], report.text()
    assert "PyTorch's ops at sizes it was not built for" in report.text()

    paths.clear()
    for keys, batch in ((23, 2), (24, 2), (31, 3), (23, 5)):  # the batch follows the tokens: the kernel takes any
        args = call(batch, keys, seed=1)
        with torch.no_grad():
            expected = type(module).forward(module, *args)
            got = module(*args)
        assert mismatch(got, expected, f"{keys} keys, batch {batch}", LAYER) is None
    assert paths == ["kernel", "ops", "ops", "kernel"]
    assert fuser.stats(module)[""] == {"fused": 4, "declined": {}}, fuser.stats(module)


def test_the_ops_of_a_region_that_calls_a_module_are_not_taken():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    norm = graph.call_module("norm", (x,))
    graph.output(norm)

    class Region:
        covered, inputs, outputs = {norm}, [x], [norm]

    assert fuser.install.any_size.eager_region(Region, graph) is None
