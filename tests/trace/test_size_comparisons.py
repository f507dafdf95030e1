"""fuser.trace: comparisons of sizes that follow the tokens, decided once for every token count.

``assert ids.shape[0] == x.shape[0] == logits.shape[0]`` (sglang's hash router checks its
inputs so) compares two sizes that grow alike: the answer is the same at every count, and
the trace takes it. Sizes that grow differently stay a branch on the batch: refused.
"""

import pytest
import torch
import torch.nn as nn

import fuser
from fuser.trace.tracing import trace


class ChainedSizeCheck(nn.Module):
    def forward(self, x, ids, logits):
        assert ids.shape[0] == x.shape[0] == logits.shape[0], "one row per token"
        return torch.sigmoid(logits) * x.sum(-1, keepdim=True) + ids[:, None]


class OffsetAndScaledSizes(nn.Module):
    """``pairs`` has two rows per token; ``x.shape[0] + 1 > x.size(0)`` holds at every count."""

    def forward(self, x, pairs):
        if 2 * x.shape[0] != pairs.shape[0] or not x.shape[0] + 1 > x.size(0):
            return x
        return x * 2 + pairs.view(x.shape[0], 2, -1).sum(1)


class SizesThatGrowApart(nn.Module):
    def forward(self, x, pairs):
        if x.shape[0] == pairs.shape[0]:  # 3 vs 6 rows here, 4 vs 8 one token later: not decided
            return x
        return x * 2


def test_a_chained_check_of_token_counts_is_decided_and_the_code_after_it_traced():
    x, ids, logits = torch.randn(3, 8), torch.tensor([1, 2, 3]), torch.randn(3, 4)
    traced = trace(ChainedSizeCheck(), (x, ids, logits))
    assert traced.automatic_leaves == []
    gm = torch.fx.GraphModule(ChainedSizeCheck(), traced.graph)
    x, ids, logits = torch.randn(5, 8), torch.tensor([4, 0, 2, 1, 7]), torch.randn(5, 4)
    torch.testing.assert_close(gm(x, ids, logits), ChainedSizeCheck()(x, ids, logits))


def test_sizes_at_a_fixed_offset_or_a_multiple_are_decided():
    x, pairs = torch.randn(3, 8), torch.randn(6, 8)
    traced = trace(OffsetAndScaledSizes(), (x, pairs))
    gm = torch.fx.GraphModule(OffsetAndScaledSizes(), traced.graph)
    x, pairs = torch.randn(7, 8), torch.randn(14, 8)
    torch.testing.assert_close(gm(x, pairs), x * 2 + pairs.view(7, 2, 8).sum(1))


def test_sizes_that_grow_apart_are_still_a_branch_on_the_batch():
    with pytest.raises(fuser.TraceRefused, match="control flow") as excinfo:
        trace(SizesThatGrowApart(), (torch.randn(3, 8), torch.randn(6, 8)))
    assert "test_size_comparisons.py" in str(excinfo.value)
