"""Sizes no call can change, read as their ints (fuser.canon.views.fixed_size): transformers' MoE
experts divide the sorted pair positions by their top-k read off the router's indices
(``perm // top_k_index.size(-1)``). After a call given state (a KV cache's update) the trace
keeps sizes as values of the call, since they may differ from call to call; the k of a
``topk`` never does, so that division is index arithmetic a kernel computes. Any other size
read there stays a value of the call (the cache's length grows)."""

import torch
import torch.nn as nn
from transformers import DynamicCache

from fuser.canon.canonicalize import canonicalize
from fuser.trace.tracing import trace
from tests.model.test_model import causal_lm

E = 16


class Dispatch(nn.Module):
    """Router logits computed after a cache update (so the trace reads sizes as values), then
    the dispatch of transformers' ``integrations/moe.py``: each token's k picks sorted by
    expert, and the hidden row of each pick at ``perm // divisor(top_k_index, keys)``."""

    def __init__(self, k: int, divisor):
        super().__init__()
        self.k, self.divisor = k, divisor
        self.proj, self.gate = nn.Linear(E, E), nn.Linear(E, 8)

    def forward(self, x, cache):
        keys, _ = cache.update(self.proj(x)[:, None, None], self.proj(x)[:, None, None], 0)
        logits = self.gate(x + keys.mean(2)[:, 0])
        top_k_index = torch.topk(logits, self.k, dim=-1).indices
        _, perm = torch.sort(top_k_index.reshape(-1))
        return x[perm // self.divisor(top_k_index, keys)]


def floordiv_of(module):
    cache = DynamicCache(config=causal_lm("llama", layers=1).config)
    cache.update(torch.randn(5, 1, 3, E), torch.randn(5, 1, 3, E), 0)
    traced = trace(module, (torch.randn(5, E), cache))
    (node,) = [n for n in traced.graph.nodes if n.name.startswith("floordiv")]
    return canonicalize(traced)[node], node


def test_the_k_of_a_topk_read_as_a_size_is_its_literal():
    for k in (1, 2, 3):
        cop, node = floordiv_of(Dispatch(k, lambda index, keys: index.size(-1)))
        assert isinstance(node.args[1], torch.fx.Node) and node.args[1].target == "size", node.args  # a value of the call
        assert cop.op == "floordiv" and cop.args[1] == k, cop


def test_another_size_stays_a_value_of_the_call():
    """The cache's length grows at every step: never a literal."""
    cop, node = floordiv_of(Dispatch(2, lambda index, keys: keys.size(-2)))
    assert isinstance(node.args[1], torch.fx.Node)
    assert cop.op == "floordiv[int64]" and cop.args[1] is node.args[1], cop
