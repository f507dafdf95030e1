"""MoE routing glue in row programs: integer index arithmetic, row gathers from tables with
rows of another count (``hidden[perm // top_k]``), and the gathered rows regrouped per token
and summed (``out[inv_perm].view(T, k, H).sum(1)``) — each against eager PyTorch."""

import pytest
import torch
import torch.nn as nn

import fuser
from helpers import fused_output
from tests.kernels.test_expert_sort import GroupedExperts, _experts_inputs


class GatherByQuotient(nn.Module):
    """``table[index // 3]`` with negative quotients (rows counted from the end, as PyTorch)."""

    def forward(self, table, index):
        return table[index // 3] * 2.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 5, 33])
def test_floor_division_and_row_gather_match_pytorch(T, dtype):
    generator = torch.Generator().manual_seed(T)
    table = torch.randn(T, 40, generator=generator).to(dtype)
    index = torch.randint(-3 * T, 3 * T, (T,), generator=generator)
    index[0] = -1  # -1 // 3 is -1 (floor), the last row; truncation would give row 0
    module = GatherByQuotient()
    result = fuser.check(module, (table, index))
    assert result.ok, result.problems
    assert result.report.launches_after == 1, result.report.text()
    assert torch.equal(fused_output(module, (table, index)), table[index // 3] * 2.0)


@pytest.mark.parametrize("T,k,E", [(1, 2, 8), (7, 2, 8), (33, 4, 16)])
def test_moe_gathers_and_the_sum_over_experts_are_one_kernel(T, k, E):
    """transformers' grouped_mm routing (with the GEMMs replaced by a scale): the gathers by
    ``perm``, the weighting, the gather by the inverse permutation and the sum over the k
    experts of each token are one kernel; the sort, with the inverse permutation
    (``inv[perm] = arange``), is the other."""
    module = GroupedExperts(E)
    inputs = _experts_inputs(T, k, E, seed=T)
    expected = module(*inputs)
    result = fuser.check(module, inputs)
    assert result.ok, result.problems
    report = result.report
    assert report.launches_after == 2, report.text()
    assert not report.unfused, report.text()
    got = fused_output(module, inputs)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], expected[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sum_over_experts_splits_its_columns_across_programs(dtype):
    """At T=1 one program per token would run the whole sum over the k gathered rows alone: the
    kernel tiles the hidden axis (1100 wide: two tiles, the last one masked)."""
    module = GroupedExperts(8)
    hidden, index, weights = _experts_inputs(3, 2, 8, seed=11, width=1100)
    inputs = (hidden.to(dtype), index, weights.to(dtype))
    expected = module(*inputs)
    result = fuser.check(module, inputs)
    assert result.ok, result.problems
    (chain,) = [c for c in result.report.chains if c.template != "expert_sort"]
    assert "tile = tl.program_id(1)" in open(chain.path).read(), chain.path
    got = fused_output(module, inputs)
    torch.testing.assert_close(got[0], expected[0], **({"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}))


@pytest.mark.gpu
def test_moe_routing_kernels_on_the_gpu():
    module = GroupedExperts(16)
    inputs = tuple(x.cuda() for x in _experts_inputs(64, 4, 16, seed=3))
    result = fuser.check(module, inputs)
    assert result.ok, result.problems
    assert result.report.launches_after == 2, result.report.text()


class HashRouter(nn.Module):
    """sglang's hash routing on its torch path (``HashTopK._forward_torch``, no shared slot):
    each token's experts read from a token-to-expert table by its id into a zero-filled
    buffer, its scores gathered at them into another, renormalised in place."""

    def __init__(self, vocab: int, k: int, experts: int, table_dtype):
        super().__init__()
        table = torch.randint(0, experts, (vocab, k), generator=torch.Generator().manual_seed(vocab + k))
        self.register_buffer("tid2eid", table.to(table_dtype))
        self.k = k

    def forward(self, router_logits, input_ids):
        scores = torch.nn.functional.softplus(router_logits).sqrt()
        ids = torch.zeros((scores.shape[0], self.k), dtype=torch.int32, device=scores.device)
        weights = torch.zeros((scores.shape[0], self.k), dtype=scores.dtype, device=scores.device)
        ids[:, :] = self.tid2eid[input_ids]
        weights[:, :] = scores.gather(1, ids[:, :])
        weights[:, :] /= weights[:, :].sum(dim=-1, keepdim=True) + 1e-20
        return weights, ids


#: The renormalised weights: fp32 math, rounded once to the scores' dtype.
HASH_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T,k,E", [(1, 6, 256), (5, 1, 8), (33, 9, 48)])
def test_a_hash_router_is_one_kernel_reading_its_table_at_the_token_ids(T, k, E, dtype, table_dtype):
    """The ids (an integer table's rows, cast to the buffer's int32), the scores' gather and
    the renormalisation: one kernel, its ids exact, its weights within the dtype's rounding;
    the report counts eager's launches, the two fills and the three writes among them. An int64
    table is cast to the buffer's int32 in the kernel."""
    module = HashRouter(vocab=97, k=k, experts=E, table_dtype=table_dtype)
    generator = torch.Generator().manual_seed(T * k)
    inputs = (torch.randn(T, E, generator=generator).to(dtype), torch.randint(0, 97, (T,), generator=generator))
    expected = module(*inputs)
    result = fuser.check(module, inputs)
    assert result.ok, result.problems
    report = result.report
    # eager: softplus, sqrt, two fills, the lookup and its write, the gather and its write, the
    # sum, the add, the division and its write (views launch nothing)
    assert (report.launches_before, report.launches_after) == (12, 1), report.text()
    weights, ids = fused_output(module, inputs)
    assert ids.dtype == torch.int32 and torch.equal(ids, expected[1])
    tol = HASH_TOLERANCE[dtype]
    torch.testing.assert_close(weights, expected[0], rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("T", [1, 64])
def test_a_hash_router_is_one_kernel_on_the_gpu(T, table_dtype):
    module = HashRouter(vocab=1000, k=6, experts=256, table_dtype=table_dtype).cuda()
    generator = torch.Generator().manual_seed(T)
    inputs = (torch.randn(T, 256, generator=generator).bfloat16().cuda(), torch.randint(0, 1000, (T,), generator=generator).cuda())
    expected = module(*inputs)
    result = fuser.check(module, inputs)
    assert result.ok, result.problems
    assert result.report.launches_after == 1, result.report.text()
    weights, ids = fused_output(module, inputs)
    assert torch.equal(ids, expected[1])
    torch.testing.assert_close(weights, expected[0], rtol=HASH_TOLERANCE[torch.bfloat16], atol=HASH_TOLERANCE[torch.bfloat16])
