"""Glue at the length of a dynamic cache (which grows each call) stays eager
(fuser.pipeline.growing_state): an eager attention over transformers' DynamicCache — scores,
mask add, softmax — is left to PyTorch, the rest of the module is fused, and a later call with
a longer cache and mask takes the fused path and matches eager."""

import copy

import torch
import torch.nn as nn
from transformers import DynamicCache

import fuser
from fuser.pipeline.growing_state import REASON
from tests.model.test_model import causal_lm

DIM = 16


class EagerAttention(nn.Module):
    """transformers' eager attention, written out: the scores' mask add and softmax are glue."""

    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x, mask, cache):
        h = self.norm(x)
        k, v = cache.update(self.k(h).unsqueeze(1), self.v(h).unsqueeze(1), 0)
        scores = self.q(h).unsqueeze(1) @ k.transpose(-1, -2) * 0.25 + mask
        weights = torch.softmax(scores.float(), dim=-1).to(x.dtype)
        return x + self.o((weights @ v).squeeze(1)) * torch.sigmoid(x)


def cache_holding(length: int) -> DynamicCache:
    cache = DynamicCache(config=causal_lm("llama", layers=1).config)
    g = torch.Generator().manual_seed(length)
    cache.update(torch.randn(2, 1, length, DIM, generator=g), torch.randn(2, 1, length, DIM, generator=g), 0)
    return cache


def mask(keys: int) -> torch.Tensor:
    m = torch.zeros(2, 1, 1, keys)
    m[0, ..., 0] = float("-inf")  # the first sequence's first key is padding
    return m


def test_glue_at_the_cache_s_length_stays_eager_and_a_longer_call_is_fused():
    torch.manual_seed(0)
    module = EagerAttention().eval()
    x = torch.randn(2, 1, DIM)
    report = fuser.apply(module, (x, mask(5), cache_holding(4)))
    held = {u.op for u in report.unfused if u.reason == REASON}
    assert {"add", "softmax"} <= held, report.text()
    assert report.free_sizes.get("mask") == [3], report.free_sizes
    assert report.launches_after < report.launches_before
    with torch.no_grad():
        for length in (4, 6, 9):
            cache = cache_holding(length)
            expected = type(module).forward(module, x, mask(length + 1), copy.deepcopy(cache))
            torch.testing.assert_close(module(x, mask(length + 1), cache), expected, atol=1e-5, rtol=1e-5)
    assert fuser.stats(module)[""] == {"fused": 3, "declined": {}}


def test_switched_off_the_glue_is_fused_at_one_length_and_a_longer_call_declined():
    torch.manual_seed(0)
    module = EagerAttention().eval()
    x = torch.randn(2, 1, DIM)
    fuser.apply(module, (x, mask(5), cache_holding(4)), disable_passes=("growing_state",))
    with torch.no_grad():
        module(x, mask(7), cache_holding(6))
    assert fuser.stats(module)[""]["declined"] == {"mask dim 3 is 7, traced with 5": 1}
