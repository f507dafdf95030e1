"""Token rows repeated block by block (``x.repeat(E, 1)``, row e·T + t) and the elementwise ops
over them (fuser/trace/repeated_rows.py): rewritten in the trace over [E, T, ...], so that the
repeat is a broadcast in the kernel of the ops after it. transformers' Llama-4 MoE block fuses
its routed-expert input into one kernel and matches eager over several token counts; eager's
launches are still counted as eager runs them; a repeat of anything else is left as it was."""

import copy

import pytest
import torch
import torch.nn as nn

import fuser
from examples.zoo import layers as zoo
from fuser.install.splice import STATE_ATTR
from fuser.validate.tolerance import KERNEL, mismatch
from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

TOKENS = (1, 5, 17)


def fused_call(module, *args):
    why_not = module.__dict__[STATE_ATTR].guard.why_not(args, {})
    assert why_not is None, f"the fused forward would not run: {why_not}"
    with torch.no_grad():
        return module(*args)


def assert_matches(actual, expected, what: str):
    problem = mismatch(actual, expected, what, KERNEL)
    assert problem is None, problem


def unfused_ops(report) -> list[str]:
    return [u.op for u in report.unfused]


# --- transformers' Llama-4 MoE block -----------------------------------------------------------
def llama4_moe(dtype) -> nn.Module:
    torch.manual_seed(0)
    moe = Llama4TextMoe(zoo.config("llama4", "cpu"))
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape) * 0.1)
    return moe.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_llama4_routed_input_is_one_kernel_and_matches_eager(dtype):
    moe = llama4_moe(dtype)
    eager = copy.deepcopy(moe)
    hidden = {T: torch.randn(T, 1, moe.hidden_dim, generator=torch.Generator().manual_seed(T)).to(dtype) for T in TOKENS}
    report = fuser.apply(moe, (hidden[5],))
    apart = fuser.explain(eager, (hidden[5],), disable_passes=("repeated_rows",))
    assert "repeat" in unfused_ops(apart) and "repeat" not in unfused_ops(report), report.text()
    (routed,) = [c for c in report.chains if "expand" in c.nodes]
    # the router's top-k, its scatter into -inf and sigmoid, and the tokens weighted per expert
    assert {"topk", "scatter", "sigmoid", "mul", "contiguous"} <= {n.rstrip("_0123456789") for n in routed.nodes}
    # eager's own launches, counted as eager runs them; fused: that kernel, the experts' and the
    # shared expert's activations, the experts' sum with the shared expert's output
    assert report.launches_before == apart.launches_before
    assert report.launches_after == 4 < apart.launches_after, report.text()
    for T in TOKENS:
        got, want = fused_call(moe, hidden[T]), eager(hidden[T])
        assert_matches(got[0], want[0], f"output at T={T}")


# --- left as it was ----------------------------------------------------------------------------
class RepeatedColumnsToo(nn.Module):
    def forward(self, x, s):
        return x.repeat(3, 2) * s.transpose(0, 1).reshape(-1, 1)


class RepeatedWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 16))

    def forward(self, x):
        return x * self.w.repeat(3, 1).sum(0)


class WrittenAfterTheRepeat(nn.Module):
    """x is changed in place after its repeat, through a view of it: the repeat keeps the value
    x had."""

    def forward(self, x, s):
        routed = x.repeat(s.shape[1], 1)
        x.view(-1).mul_(2.0)
        return routed * s.transpose(0, 1).reshape(-1, 1), x


class RepeatReadToo(nn.Module):
    """The repeat is an output as well: it stays, and the product is still fused."""

    def forward(self, x, s):
        routed = x.repeat(s.shape[1], 1)
        return routed, routed * s.transpose(0, 1).reshape(-1, 1)


def test_a_repeat_of_the_columns_too_stays_eager_and_correct():
    x, s = torch.randn(5, 16), torch.rand(5, 3)
    result = fuser.check(RepeatedColumnsToo(), (x, s))
    assert result.ok, result.problems
    assert "repeat" in unfused_ops(result.report)
    assert not any("expand" in c.nodes for c in result.report.chains)


def test_a_repeated_value_that_is_also_returned_is_kept():
    x, s = torch.randn(5, 16), torch.rand(5, 3)
    module = RepeatReadToo()
    report = fuser.apply(module, (x, s))
    try:
        assert any("expand" in c.nodes for c in report.chains), report.text()
        for T in TOKENS:
            x, s = torch.randn(T, 16), torch.rand(T, 3)
            got = fused_call(module, x, s)
            assert torch.equal(got[0], x.repeat(3, 1))
            assert torch.equal(got[1], x.repeat(3, 1) * s.transpose(0, 1).reshape(-1, 1))
            assert got[1].is_contiguous()
    finally:
        fuser.restore(module)


def test_a_repeat_of_a_value_written_in_place_is_not_rewritten():
    x, s = torch.randn(5, 16), torch.rand(5, 3)
    result = fuser.check(WrittenAfterTheRepeat(), (x, s))
    assert result.ok, result.problems
    assert "repeat" in unfused_ops(result.report), result.report.text()


def test_a_repeat_of_a_weight_is_not_rewritten():
    report = fuser.explain(RepeatedWeight(), (torch.randn(5, 16),))
    assert not any("expand" in c.nodes for c in report.chains), report.text()
