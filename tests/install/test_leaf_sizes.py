"""A kernel fed by a call given state (a dynamic cache's update, which grows each step while the
inputs the guard checks keep their sizes) checks the sizes it was built for, and raises naming
them, rather than computing on part of a grown value. (transformers' DynamicCache is known to
grow: glue at its length stays eager, fuser.pipeline.growing_state; these tests switch that
off to reach the check behind it, which any other state that grows meets.)"""

import copy

import pytest
import torch
from transformers import DynamicCache

import fuser
from fuser.install.leaf_sizes import StateSizeChanged
from tests.model.test_model import causal_lm


class SoftmaxAttention(torch.nn.Module):
    """Attention whose softmax over the keys is glue: its width is the cache's length."""

    def __init__(self):
        super().__init__()
        self.q, self.k = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x, cache):
        k, v = cache.update(self.k(x).unsqueeze(1), self.k(x).unsqueeze(1), 0)
        w = torch.softmax((self.q(x).unsqueeze(1) @ k.transpose(-1, -2) * 0.25).float(), -1).to(x.dtype)
        return x + (w @ v).squeeze(1)


def cache_holding(length: int) -> DynamicCache:
    cache = DynamicCache(config=causal_lm("llama", layers=1).config)
    g = torch.Generator().manual_seed(length)
    cache.update(torch.randn(2, 1, length, 16, generator=g), torch.randn(2, 1, length, 16, generator=g), 0)
    return cache


def test_a_kernel_fed_by_a_grown_cache_raises_naming_the_size():
    module = SoftmaxAttention().eval()
    x = torch.randn(2, 1, 16)
    fuser.apply(module, (x, cache_holding(4)), disable_passes=("growing_state",))
    same = cache_holding(4)
    with torch.no_grad():
        expected = type(module).forward(module, x, copy.deepcopy(same))
        assert torch.allclose(module(x, copy.deepcopy(same)), expected, atol=1e-6)
        with pytest.raises(StateSizeChanged, match=r"of size \('T', 1, 1, 5\) and got \(2, 1, 1, 7\)"):
            module(x, cache_holding(6))


class MaskedAttention(SoftmaxAttention):
    """An attention mask that reaches only a leaf (sdpa), beside glue over the cache's keys: the
    mask's length is the keys' length, so the guard holds it."""

    def forward(self, x, mask, cache):
        k, v = cache.update(self.k(x).unsqueeze(1), self.k(x).unsqueeze(1), 0)
        q = self.q(x).unsqueeze(1)
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        w = torch.softmax((q @ k.transpose(-1, -2) * 0.25).float(), -1).to(x.dtype)
        return x + attended.squeeze(1) + (w @ v).squeeze(1)


def test_a_mask_as_long_as_a_cache_a_kernel_reads_is_held_and_a_grown_call_declined():
    module = MaskedAttention().eval()
    x = torch.randn(2, 1, 16)
    report = fuser.apply(module, (x, torch.zeros(2, 1, 1, 5), cache_holding(4)), disable_passes=("growing_state",))
    assert "mask" not in report.free_sizes, report.free_sizes
    with torch.no_grad():
        grown, mask = cache_holding(6), torch.zeros(2, 1, 1, 7)
        expected = type(module).forward(module, x, mask, copy.deepcopy(grown))
        assert torch.allclose(module(x, mask, grown), expected, atol=1e-6)  # declined, not raised
    assert fuser.stats(module)[""]["declined"] == {"mask dim 3 is 7, traced with 5": 1}


class KeysByLength(SoftmaxAttention):
    """DeepSeek-V3's MLA: the cached latents viewed by the cache's length (``kv.shape[2]``)."""

    def forward(self, x, cache):
        k, v = cache.update(self.k(x).unsqueeze(1), self.k(x).unsqueeze(1), 0)
        batch, _, length, _ = k.shape
        keys = (k * 2.0).view(batch, length, 4, 4).transpose(1, 2)  # heads of 4
        return x * keys.mean((1, 2, 3)).view(-1, 1, 1) + v.mean(2)


def test_a_size_of_a_grown_cache_is_read_at_run_time_not_held():
    module = KeysByLength().eval()
    x = torch.randn(2, 1, 16)
    fuser.apply(module, (x, cache_holding(4)))
    for length in (4, 6, 9):
        with torch.no_grad():
            expected = type(module).forward(module, x, cache_holding(length))
            assert torch.allclose(module(x, cache_holding(length)), expected, atol=1e-6), length
    assert fuser.stats(module)[""] == {"fused": 3, "declined": {}}
