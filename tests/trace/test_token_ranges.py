"""A branch on the token count against a threshold (sglang's ``x.shape[0] >= 1024`` for its
DeepGEMM pre-norm) is taken as traced, for the counts where its answer holds; the guard runs
the module's own code for any other count (fuser.trace.proxy.decided_for_a_token_range)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fuser
from fuser.trace.tracing import trace

HIDDEN = 8


class Threshold(nn.Module):
    """Glue that takes another path from ``limit`` tokens on."""

    def __init__(self, limit: int, rows_per_token: int = 1):
        super().__init__()
        self.limit, self.rows = limit, rows_per_token

    def forward(self, x):
        if x.shape[0] * self.rows >= self.limit:
            return torch.sigmoid(x) * 3.0
        return torch.tanh(x) * x + 1.0


@pytest.mark.parametrize("traced, kept, shown", [
    (4, (1, 63), "1 to 63 tokens"),  # below the limit: the counts up to it
    (70, (64, None), "64 tokens or more"),  # above it: the counts from it on
])
def test_a_branch_on_the_token_count_holds_for_the_counts_that_answer_it_alike(traced, kept, shown):
    module = Threshold(64)
    report = fuser.apply(module, (torch.randn(traced, HIDDEN),))
    (line,) = report.token_ranges
    assert line.endswith(f"test_token_ranges.py:{Threshold.forward.__code__.co_firstlineno + 1}: for {shown}")
    low, high = kept
    inside = [low, traced, high if high is not None else 300]
    outside = [high + 1] if high is not None else [low - 1, 1]
    for tokens in inside + outside:
        x = torch.randn(tokens, HIDDEN)
        want = torch.sigmoid(x) * 3.0 if tokens >= 64 else torch.tanh(x) * x + 1.0
        torch.testing.assert_close(module(x), want)
    stats = fuser.stats(module)[""]
    assert stats["fused"] == len(inside)
    assert sum(stats["declined"].values()) == len(outside)
    for reason in stats["declined"]:
        assert f"tokens: a branch on the token count was traced for {shown} (" in reason


def test_a_size_of_several_rows_a_token_counts_in_tokens():
    module = Threshold(10, rows_per_token=2)  # 2 * tokens >= 10: the answer changes at 5 tokens
    traced = trace(module, (torch.randn(3, HIDDEN),))
    (branch,) = traced.token_ranges
    assert (branch.low, branch.high) == (1, 4)


def test_a_branch_whose_answer_changes_at_the_next_count_is_refused():
    module = Threshold(5)
    with pytest.raises(fuser.FuserError, match="Python control flow on a traced value"):
        fuser.apply(module, (torch.randn(4, HIDDEN),))  # 4 < 5 but 5 >= 5: no count range around T
