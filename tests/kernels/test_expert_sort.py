"""The expert-offset preparation of grouped-GEMM MoE (patterns/expert_sort.py, and
patterns/expert_sort_rows.py with the gather of each pair's hidden row): the kernel against
plain PyTorch over odd and realistic sizes, ties, out-of-range ids and both histc spellings;
the chain fused in transformers' own MoE layers; validation that is blind to the order an
unstable sort gives equal ids, and only to that."""

import pytest
import torch
import torch.nn as nn

import fuser
from examples.zoo import layers as zoo
import fuser.pipeline.passes
from fuser.codegen.emit import KernelSpec, emit
from fuser.lower.row_program import Operand
from fuser.validate.against_eager import _tie_order

OUTPUTS = ("sorted_ids", "perm", "offsets", "inverse")


def expert_sort_kernel(num_experts: int, outputs=OUTPUTS, rows: tuple[int, int, torch.dtype] | None = None):
    """The rendered kernel module and its launcher, for ``num_experts`` bins; with ``rows``
    (width, k, dtype) also the gathered hidden rows (patterns/expert_sort_rows.py)."""
    dtypes = dict(sorted_ids=torch.int64, perm=torch.int64, offsets=torch.int32, inverse=torch.int64)
    inputs = [Operand("in0", "expert_ids", (), torch.int64, True)]
    params = {"bins": num_experts, "top": num_experts - 1, "inverse": int("inverse" in outputs)}
    operands = [
        Operand(name, name, (num_experts,) if name == "offsets" else (), dtypes[name], name != "offsets") for name in outputs
    ]
    if rows is not None:
        width, k, dtype = rows
        inputs.append(Operand("in1", "hidden", (width,), dtype, True))
        at = len(operands) - ("inverse" in outputs)  # the pattern's order: ..., offsets, rows, inverse
        operands.insert(at, Operand("rows", "rows", (width,), dtype, True))
        params["k"] = k
    spec = KernelSpec("expert_sort", "expert_sort_rows" if rows else "expert_sort", inputs, operands, params)
    return emit(spec)


def reference(expert_ids: torch.Tensor, num_experts: int, count_int32: bool = False):
    """Stable sort, the cumulative histc counts of the ids cast as transformers casts them, and
    the inverse permutation."""
    sorted_ids, perm = torch.sort(expert_ids, stable=True)
    if count_int32:  # CUDA's .int() spelling; the CPU's histc takes no integers, so count directly
        wrapped = sorted_ids.int().long()
        counts = torch.stack([(wrapped == e).sum() for e in range(num_experts)])
    else:
        counts = torch.histc(sorted_ids.float(), bins=num_experts, min=0, max=num_experts - 1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return sorted_ids, perm, torch.cumsum(counts, dim=0, dtype=torch.int32), inverse


def routed_ids(T: int, k: int, E: int, seed: int) -> torch.Tensor:
    """top_k_index.reshape(-1) as a router makes it: k distinct experts per token."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, E, generator=generator)
    return scores.topk(min(k, E), dim=-1).indices.reshape(-1)


def assert_same(got, expected):
    for name, g, e in zip(OUTPUTS, got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape, f"{name}: {g.dtype} {tuple(g.shape)} vs {e.dtype} {tuple(e.shape)}"
        assert torch.equal(g, e), f"{name}: {int((g != e).sum())} of {g.numel()} elements differ"


# (T, k, E): every T, k and E at least twice, S = T * k from 1 to 4096.
SIZES = [
    (1, 1, 8), (1, 8, 256), (3, 2, 60), (3, 4, 32), (16, 8, 128), (16, 1, 60), (100, 2, 8),
    (100, 4, 256), (512, 1, 32), (512, 2, 128), (512, 8, 60),
]  # fmt: skip


@pytest.mark.parametrize("T,k,E", SIZES, ids=[f"T{t}-k{k}-E{e}" for t, k, e in SIZES])
def test_kernel_matches_a_stable_sort_and_histc(T, k, E):
    _, launch = expert_sort_kernel(E)
    ids = routed_ids(T, k, E, seed=T * 1000 + k * 10 + E)
    assert_same(launch(ids), reference(ids, E))


# (T, k, E, width): odd widths, one column block and several; few ids (the copy spread over
# many programs) and many (a program's share of the columns several blocks).
# Up to COPY_IDS ids the sort kernel copies the rows, above it a kernel of its own.
ROW_SIZES = [(1, 8, 256, 300), (3, 2, 60, 1), (5, 4, 32, 129), (64, 8, 128, 72), (512, 2, 8, 200), (300, 4, 16, 1030)]
ROW_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", ROW_DTYPES, ids=str)
@pytest.mark.parametrize("T,k,E,width", ROW_SIZES, ids=[f"T{t}-k{k}-E{e}-N{n}" for t, k, e, n in ROW_SIZES])
def test_rows_kernel_matches_the_sort_and_the_gather(T, k, E, width, dtype):
    """The rows are a copy: exact in every dtype (the tolerance is zero)."""
    _, launch = expert_sort_kernel(E, rows=(width, k, dtype))
    ids = routed_ids(T, k, E, seed=T + k + E + width)
    hidden = torch.randn(T, width, generator=torch.Generator().manual_seed(width)).to(dtype)
    sorted_ids, perm, offsets, rows, inverse = launch(ids, hidden)
    assert_same((sorted_ids, perm, offsets, inverse), reference(ids, E))
    assert rows.dtype == dtype and torch.equal(rows, hidden[reference(ids, E)[1] // k])


def test_rows_kernel_copies_in_the_sort_up_to_copy_ids_and_after_it_above():
    path, _ = expert_sort_kernel(8, rows=(16, 2, torch.float32))
    module = _module_of(path)
    assert [(T, k) for T, k, _, _ in ROW_SIZES if T * k > module.COPY_IDS] and [
        (T, k) for T, k, _, _ in ROW_SIZES if T * k <= module.COPY_IDS
    ], "ROW_SIZES covers both paths"


def test_rows_when_nobody_reads_the_permutation():
    _, launch = expert_sort_kernel(8, outputs=("offsets", "inverse"), rows=(40, 2, torch.bfloat16))
    for T in (7, 700):  # both copies
        ids = routed_ids(T, 2, 8, seed=T)
        hidden = torch.randn(T, 40).to(torch.bfloat16)
        offsets, rows, inverse = launch(ids, hidden)
        expected = reference(ids, 8)
        assert torch.equal(offsets, expected[2]) and torch.equal(inverse, expected[3])
        assert torch.equal(rows, hidden[expected[1] // 2])


def test_rows_of_a_strided_hidden_and_of_out_of_range_ids():
    """A hidden view with a column stride, and sentinel ids (the general sort path)."""
    _, launch = expert_sort_kernel(16, rows=(24, 3, torch.bfloat16))
    ids = routed_ids(20, 3, 16, seed=9)
    ids[::4] = 16
    hidden = torch.randn(20, 48).to(torch.bfloat16)[:, ::2]
    sorted_ids, perm, offsets, rows, inverse = launch(ids, hidden)
    expected = reference(ids, 16)
    assert_same((sorted_ids, perm, offsets, inverse), expected)
    assert torch.equal(rows, hidden[expected[1] // 3])


def test_ties_keep_the_order_of_their_positions():
    _, launch = expert_sort_kernel(8)
    for ids in (torch.full((37,), 5), torch.arange(40).flip(0) % 3, torch.tensor([7, 0, 7, 0, 7, 0, 7])):
        expected = reference(ids, 8)
        assert_same(launch(ids), expected)
        assert not torch.equal(expected[1], torch.arange(ids.numel())) or ids.unique().numel() == 1


def test_ids_out_of_range_sort_by_value_and_are_not_counted():
    """Expert parallelism's sentinels (ids >= E), negative ids, and ids beyond 2**49, whose sort
    takes the two-pass path."""
    _, launch = expert_sort_kernel(32)
    base = routed_ids(50, 4, 32, seed=1)
    sentinels = base.clone()
    sentinels[::5] = 32
    sentinels[1::7] = 40
    sentinels[2::9] = -1
    huge = sentinels.clone()
    huge[3::11] = 2**62
    huge[4::13] = -(2**62) + 7
    huge[5::17] = 2**40 + 3
    for ids in (sentinels, huge):
        expected = reference(ids, 32)
        assert int(expected[2][-1]) < ids.numel()  # some ids were dropped from the counts
        assert_same(launch(ids), expected)


def test_int32_spelling_counts_the_wrapped_ids():
    """On CUDA transformers counts ``expert_ids_g.int()``: an id of 2**32 + 3 counts as 3 there
    (and not at all through ``.float()``, the CPU spelling)."""
    path, _ = expert_sort_kernel(8)
    module = _module_of(path)
    ids = torch.tensor([2**32 + 3, 1, 3, 9, -1, 2**33, 0, 7, 7])
    for count_int32 in (False, True):
        sorted_ids = torch.empty_like(ids)
        perm = torch.empty_like(ids)
        offsets = torch.empty(8, dtype=torch.int32)
        inverse = torch.empty_like(ids)
        kernel = next(v for k, v in vars(module).items() if k.endswith("_kernel"))
        kernel[(1,)](ids, 1, ids.numel(), sorted_ids, 1, perm, 1, offsets, 1, inverse, 1, COUNT_INT32=count_int32,
               BLOCK=16, COUNT_BLOCK=16, COUNT_CHUNKS=1, RANK_BLOCK=16, RANK_CHUNKS=1)  # fmt: skip
        assert_same((sorted_ids, perm, offsets, inverse), reference(ids, 8, count_int32=count_int32))
    assert not torch.equal(reference(ids, 8, True)[2], reference(ids, 8, False)[2])


def _module_of(path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"expert_sort_test_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_outputs_nobody_reads_are_not_stored():
    path, launch = expert_sort_kernel(8, outputs=("perm", "offsets"))
    source = path.read_text()
    assert "sorted_ids_ptr" not in source and "perm_ptr" in source
    ids = routed_ids(9, 2, 8, seed=3)
    perm, offsets = launch(ids)
    _, expected_perm, expected_offsets, _ = reference(ids, 8)
    assert torch.equal(perm, expected_perm) and torch.equal(offsets, expected_offsets)


def test_more_ids_than_one_program_sorts_run_the_eager_ops():
    path, launch = expert_sort_kernel(8)
    module = _module_of(path)
    ids = routed_ids(1100, 8, 8, seed=4)  # 8800 > MAX_IDS
    assert ids.numel() > module.MAX_IDS
    sorted_ids, perm, offsets, inverse = launch(ids)
    expected = reference(ids, 8)
    assert torch.equal(sorted_ids, expected[0]) and torch.equal(offsets, expected[2])
    assert torch.equal(ids[perm], sorted_ids) and torch.equal(perm.sort().values, torch.arange(ids.numel()))
    assert torch.equal(perm[inverse], torch.arange(ids.numel()))


# --- in a model ---------------------------------------------------------------------------------
class GroupedExperts(nn.Module):
    """transformers' grouped_mm experts path (integrations/moe.py) with its expert GEMMs
    replaced by a per-row scale: sort by expert, offsets, gather, restore the order, sum."""

    def __init__(self, num_experts: int):
        super().__init__()
        self.num_experts = num_experts

    def forward(self, hidden_states, top_k_index, top_k_weights):
        num_top_k = top_k_index.size(-1)
        expert_ids = top_k_index.reshape(-1)
        expert_ids_g, perm = torch.sort(expert_ids)
        selected = hidden_states[perm // num_top_k]
        weights_g = top_k_weights.reshape(-1)[perm]
        device = hidden_states.device
        histc_input = expert_ids_g.float() if device.type in ("cpu", "mps") else expert_ids_g.int()
        tokens_per_expert = torch.histc(histc_input, bins=self.num_experts, min=0, max=self.num_experts - 1)
        offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
        out = selected * weights_g.unsqueeze(-1)
        inv_perm = torch.empty_like(perm)
        inv_perm[perm] = torch.arange(perm.size(0), device=device)
        out = out[inv_perm].view(hidden_states.shape[0], num_top_k, -1).sum(dim=1)
        return out, offsets


def _experts_inputs(T, k, E, seed, device="cpu", width=16):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, width, generator=generator)
    top_k_index = torch.randint(0, E, (T, k), generator=generator)  # repeats: ties across and within rows
    top_k_weights = torch.rand(T, k, generator=generator)
    return tuple(x.to(device) for x in (hidden, top_k_index, top_k_weights))


def test_validation_accepts_another_order_of_equal_ids():
    """At 128 ids the CPU's torch.sort orders equal ids differently from a stable sort; the
    kernel's stable order is still a valid result, so the chain is fused and the layer agrees."""
    inputs = _experts_inputs(64, 2, 8, seed=5)
    ids = inputs[1].reshape(-1)
    assert not torch.equal(torch.sort(ids).indices, torch.sort(ids, stable=True).indices)  # the case at hand
    module = GroupedExperts(8)
    result = fuser.check(module, inputs)
    assert result.ok, result.problems
    assert [c.pattern for c in result.report.chains if c.pattern.startswith("expert_sort")] == ["expert_sort_rows"], result.report.text()
    assert not [r for r in result.report.rejected if r.pattern.startswith("expert_sort")], result.report.text()


def test_validation_still_catches_rows_out_of_their_pairs_places(monkeypatch):
    """Rows are compared in the order the permutation's ties are put in, not up to any order:
    a kernel that swaps the rows of two pairs of different tokens is rejected."""
    real_emit = fuser.pipeline.passes.emit

    def emit_swapping_rows(spec):
        path, launch = real_emit(spec)
        if spec.pattern != "expert_sort_rows":
            return path, launch

        def swapped(*args):
            outputs = list(launch(*args))
            rows = outputs[3].clone()
            rows[[0, -1]] = rows[[-1, 0]]
            outputs[3] = rows
            return tuple(outputs)

        return path, swapped

    monkeypatch.setattr(fuser.pipeline.passes, "emit", emit_swapping_rows)
    report = fuser.explain(GroupedExperts(8), _experts_inputs(64, 2, 8, seed=5))
    assert not [c for c in report.chains if c.pattern == "expert_sort_rows"], report.text()
    (rejection,) = [r for r in report.rejected if r.pattern == "expert_sort_rows"]
    assert rejection.category == "validation", rejection


def test_validation_still_catches_a_wrong_permutation():
    keys = torch.tensor([0, 0, 1, 1, 1, 4])
    stable = torch.tensor([2, 5, 0, 3, 4, 1])  # positions of ids [1, 4, 0, 1, 1, 0] sorted stably
    ties_swapped = torch.tensor([5, 2, 4, 0, 3, 1])
    wrong = torch.tensor([2, 0, 5, 3, 4, 1])  # 0 and 5 swapped across two runs
    repeated = torch.tensor([2, 2, 0, 3, 4, 1])
    def ties_in_order(perm):
        return perm[_tie_order(perm, keys, 0)]

    assert torch.equal(ties_in_order(ties_swapped), stable)
    assert not torch.equal(ties_in_order(wrong), stable)
    assert not torch.equal(ties_in_order(repeated), stable)


def test_unmatched_histc_range_stays_eager():
    """histc over bins 0..E-1 counts ids in their own bins; another range is other math."""

    class OtherRange(GroupedExperts):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            expert_ids_g, perm = torch.sort(top_k_index.reshape(-1))
            counts = torch.histc(expert_ids_g.float(), bins=self.num_experts, min=0, max=self.num_experts)
            return hidden_states[perm // 2] * 2, torch.cumsum(counts, dim=0, dtype=torch.int32)

    report = fuser.explain(OtherRange(8), _experts_inputs(5, 2, 8, seed=6))
    assert not [c for c in report.chains if c.pattern.startswith("expert_sort")]
    assert {"sort", "histc", "cumsum"} <= {u.op for u in report.unfused}
    for name in ("expert_sort", "expert_sort_rows"):
        (rejection,) = [r for r in report.rejected if r.pattern == name]
        assert "constraint" in rejection.reason and "top=8" in rejection.reason


@pytest.mark.parametrize("name", ["qwen3_moe_proj", "mixtral_proj", "gpt_oss_proj", "deepseek_v3_proj"])
def test_transformers_moe_layers_fuse_the_expert_sort(name):
    layer, args, kwargs = zoo.FACTORIES[name](T=3, dtype=torch.float32)
    result = fuser.check(layer, args, example_kwargs=kwargs)
    assert result.ok, result.problems
    report = result.report
    (chain,) = [c for c in report.chains if c.pattern.startswith("expert_sort")]
    # sort, the histc input's cast, histc, cumsum, the inverse permutation's arange and index
    # write, and the hidden rows' perm // k and gather
    assert chain.pattern == "expert_sort_rows" and chain.launches_replaced == 8, report.text()
    assert chain.params["k"] == zoo.MODELS[name.removesuffix("_proj")]["tiny"]["num_experts_per_tok"], chain
    left = {u.op for u in report.unfused}
    assert not left & {"sort", "histc", "cumsum", "cast", "inverse_permutation", "floordiv", "gather_rows"}, report.text()


# --- on the GPU: compiled Triton, and CUDA's .int() spelling --------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("T,k,E", SIZES, ids=[f"T{t}-k{k}-E{e}" for t, k, e in SIZES])
def test_compiled_kernel_matches_a_stable_sort_and_histc(T, k, E):
    _, launch = expert_sort_kernel(E)
    ids = routed_ids(T, k, E, seed=T + k + E).cuda()
    ids[::7] = E  # a sentinel
    expected = reference(ids, E)
    got = launch(ids)
    assert_same(got, expected)
    counts = torch.histc(expected[0].int(), bins=E, min=0, max=E - 1)  # CUDA's own spelling
    assert torch.equal(got[2], torch.cumsum(counts, dim=0, dtype=torch.int32))


@pytest.mark.gpu
def test_cuda_spelling_of_the_histc_input_is_matched():
    module = GroupedExperts(8)
    result = fuser.check(module, _experts_inputs(64, 2, 8, seed=7, device="cuda"))
    assert result.ok, result.problems
    assert [c.pattern for c in result.report.chains if c.pattern.startswith("expert_sort")] == ["expert_sort_rows"], result.report.text()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ROW_DTYPES, ids=str)
@pytest.mark.parametrize("T,k,E,width", ROW_SIZES + [(512, 8, 128, 2048)], ids=lambda v: str(v))
def test_compiled_rows_kernel_matches_the_sort_and_the_gather(T, k, E, width, dtype):
    _, launch = expert_sort_kernel(E, rows=(width, k, dtype))
    ids = routed_ids(T, k, E, seed=T + k + E + width).cuda()
    hidden = torch.randn(T, width, device="cuda").to(dtype)
    sorted_ids, perm, offsets, rows, inverse = launch(ids, hidden)
    expected = reference(ids, E)
    assert_same((sorted_ids, perm, offsets, inverse), expected)
    assert torch.equal(rows, hidden[expected[1] // k])
