"""Sizes of an input that reaches no kernel through glue (an attention mask passed through eager
ops to sdpa) may differ from call to call: the guard does not hold them, unless a literal of
the graph may have been read off them."""

import torch
import torch.nn.functional as F

import fuser


class Attention(torch.nn.Module):
    def __init__(self, sliced: bool = False):
        super().__init__()
        self.q, self.o = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        self.sliced = sliced

    def forward(self, x, k, v, mask):
        if self.sliced:  # the mask cut to the keys' length, read as a number at trace time
            mask = mask[..., : k.shape[-2]]
        q = self.q(x).unsqueeze(1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.where(mask, 0.0, float("-inf")))
        return F.silu(self.o(out.squeeze(1))) * x


def inputs(length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x, k, v = torch.randn(2, 1, 16, generator=g), torch.randn(2, 1, length, 16, generator=g), torch.randn(2, 1, length, 16, generator=g)
    mask = torch.ones(2, 1, 1, length, dtype=torch.bool)
    mask[0, ..., :2] = False
    return x, k, v, mask


def test_a_mask_that_reaches_only_a_leaf_may_grow():
    module = Attention().eval()
    report = fuser.apply(module, inputs(6))
    # the keys' length and width: only the attention reads them (it raises on a width that does not fit)
    assert report.free_sizes == {"k": [2, 3], "v": [2, 3], "mask": [3]}, report.free_sizes
    for length in (7, 11):
        args = inputs(length, seed=length)
        with torch.no_grad():
            expected = type(module).forward(module, *args)
            got = module(*args)
        assert torch.allclose(got, expected, atol=1e-6)
    assert fuser.stats(module)[""]["declined"] == {}, fuser.stats(module)


def test_a_size_the_graph_holds_as_a_literal_stays_held():
    module = Attention(sliced=True).eval()
    report = fuser.apply(module, inputs(6))
    assert report.free_sizes == {"k": [3], "v": [3]}, report.free_sizes  # the length 6 is a literal of the slice
    assert report.sizes_near_literals == {"k": [2], "v": [2], "mask": [3]}, report.sizes_near_literals
    assert "held at their sizes because a literal of the graph lies next to them" in report.text()
    with torch.no_grad():
        module(*inputs(7))
    reason = "k dim 2 is 7, traced with 6 (held: a literal of the graph lies next to 6)"
    assert fuser.stats(module)[""]["declined"] == {reason: 1}, fuser.stats(module)


def test_only_sizes_next_to_a_literal_are_said_to_be_held_by_one():
    report = fuser.apply(Attention(sliced=True).eval(), inputs(9))  # the slice's literal is 9
    assert report.sizes_near_literals == {"k": [2], "v": [2], "mask": [3]}, report.sizes_near_literals
    report = fuser.apply(Attention().eval(), inputs(6))
    assert report.sizes_near_literals == {}, report.sizes_near_literals
