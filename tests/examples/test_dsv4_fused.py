"""The whole tiny DeepSeek-V4 decode layer, fused by fuser, against eager.

The layer is fused with ``dsv4.fuse_layer``: ``fuser.apply`` on the layer, and a nested one on
the shared expert, whose glue (the clamped SwiGLU) sits inside the side-stream leaf.
"""

from collections import Counter

import pytest
import torch

from examples.dsv4 import layer as dsv4
from fuser.validate.tolerance import LAYER, mismatch

FACTORIES = {"tiny": dsv4.tiny, "tiny_hash": dsv4.tiny_hash}
SHARED = dsv4.SHARED_EXPERT


@pytest.fixture(scope="module", params=sorted(FACTORIES))
def fused(request):
    """(factory, the layer fused at T=5, the reports: "" the layer's, SHARED the shared expert's)."""
    factory = FACTORIES[request.param]
    layer, inputs = factory(T=5)
    reports = {name: plan.report for name, plan in dsv4.fuse_layer(layer, inputs).items()}
    return factory, layer, reports


@pytest.mark.parametrize("T", [1, 3, 16])
def test_fused_layer_matches_eager(fused, T):
    factory, layer, _ = fused
    # The same seed gives the same weights and KV history at every T; only the inputs differ.
    eager, inputs = factory(T=T)
    attn, eager_attn = layer.self_attn.attn, eager.self_attn.attn
    for (name, p), (_, q) in zip(layer.named_parameters(), eager.named_parameters()):
        assert torch.equal(p, q), name
    with torch.no_grad():
        attn.load_state_dict(eager_attn.state_dict())  # earlier calls wrote into the fused layer's cache
    assert layer.__dict__["_fuser_state"].guard.why_not(inputs, {}) is None, "the fused path must run"
    shared_input = torch.empty(T, layer.cfg.hidden_size, dtype=torch.bfloat16)
    shared_guard = layer.get_submodule(SHARED).__dict__["_fuser_state"].guard
    assert shared_guard.why_not((shared_input,), {}) is None, "the shared expert's fused path must run"

    with torch.no_grad():
        expected = eager(*inputs)
        got = layer(*inputs)

    # Whole-layer tolerance (LAYER) is wider than the per-kernel one (KERNEL): each fused kernel
    # may round one bf16 ulp apart from PyTorch, and those differences then pass through the
    # GEMMs, attention, experts and later bf16 roundings of the layer, which amplify them (a
    # one-ulp change of the layer input alone moves its output by several ulps).
    assert got.shape == expected.shape and got.dtype == expected.dtype
    problem = mismatch(got, expected, "output", LAYER)
    assert problem is None, problem
    # The cache: the slots this call wrote hold the same keys, dequantised (compared on their
    # own, so the untouched history does not dilute the error), and nothing else changed.
    _, positions, req_pool_indices, _ = inputs
    slots = positions % layer.cfg.window_size
    cache, eager_cache = attn.keys(), eager_attn.keys()
    written = torch.zeros(cache.shape[:2], dtype=torch.bool)
    written[req_pool_indices, slots] = True
    problem = mismatch(cache[written], eager_cache[written], "kv cache (written slots)", LAYER)
    assert problem is None, problem
    assert torch.equal(cache[~written], eager_cache[~written]), "the fused forward wrote outside its slots"


def test_glue_launches_drop_at_least_five_fold(fused):
    _, _, reports = fused
    before = sum(r.launches_before for r in reports.values())
    after = sum(r.launches_after for r in reports.values())
    assert before > 0
    assert after * 5 <= before, "\n\n".join(r.text() for r in reports.values())


def test_report_names_the_expected_patterns(fused):
    _, _, reports = fused
    report = reports[""]
    # A merged kernel is named after its parts ("mhc_sinkhorn_rms+generic+rmsnorm").
    by_pattern = Counter(part for c in report.chains for part in c.pattern.split("+"))
    # The mix scaling (GEMM output * rsqrt) joins the Sinkhorn block: mhc_sinkhorn_rms. The
    # shared expert's SwiGLU is inside the side-stream leaf: the nested apply fuses it.
    expected = {"mhc_sinkhorn_rms": 2, "mhc_post": 2, "rmsnorm": 3, "rmsnorm_weightless": 1, "swiglu_clamp": 0}
    for pattern, count in expected.items():
        assert by_pattern[pattern] == count, f"{pattern}: {by_pattern[pattern]} chains, expected {count}\n{report.text()}"
    for chain in report.chains:
        parts = chain.pattern.split("+")
        # A merged kernel keeps its parts' parameters, each named after its pattern.
        params = chain.params if len(parts) > 1 else {f"{chain.pattern}.{k}": v for k, v in chain.params.items()}
        if "mhc_sinkhorn_rms" in parts:
            assert params["mhc_sinkhorn_rms.iters"] == 20
            assert params["mhc_sinkhorn_rms.eps"] == pytest.approx(1e-6)
            assert params["mhc_sinkhorn_rms.post_scale"] == pytest.approx(2.0)
        for norm in {"rmsnorm", "rmsnorm_weightless"} & set(parts):
            assert params[f"{norm}.eps"] == pytest.approx(1e-6)
        assert chain.launches_replaced >= 1 and chain.nodes and chain.outputs


def test_mhc_pre_runs_as_one_kernel_after_its_mix_gemm(fused):
    """DSV4.md A4-A6 and B (split, Sinkhorn, stream combine, RMSNorm) in one launch, and the mHC
    post merged with the next pre's mix statistics (sglang's mhc_fused_post_pre)."""
    _, _, reports = fused
    patterns = [c.pattern for c in reports[""].chains]
    assert patterns.count("mhc_sinkhorn_rms+generic+rmsnorm") == 2, patterns
    assert "mhc_post+generic" in patterns, patterns


def test_nested_apply_fuses_the_shared_swiglu_with_its_limits(fused):
    _, layer, reports = fused
    report = reports[SHARED]
    assert report.module == "DeepseekV2MLP"
    limit = layer.cfg.swiglu_limit
    (chain,) = report.chains
    assert chain.pattern == "swiglu_clamp"
    assert chain.params == {"low": -limit, "high": limit}
    assert report.launches_after == 1 and report.unfused == []


def test_every_unfused_node_has_a_reason(fused):
    _, _, reports = fused
    for report in reports.values():
        for u in report.unfused:
            assert isinstance(u.reason, str) and u.reason.strip(), u
            assert u.launches >= 1


def test_no_kernel_failed_validation(fused):
    _, _, reports = fused
    for report in reports.values():
        failed = [r for r in report.rejected if r.category == "validation"]
        assert failed == [], failed
        for r in report.rejected:
            assert r.reason.strip(), r


def test_the_side_stream_fork_and_join_stay_leaves_in_order():
    """The fused graph calls the fork, the routed experts and the join in the model's order: the
    sum reads the shared expert only through the join."""
    layer, inputs = dsv4.tiny(T=5)
    plan = dsv4.fuse_layer(layer, inputs)[""]
    calls = [n.target for n in plan.graph.nodes if n.op == "call_module" and n.target.startswith("mlp.")]
    assert calls.index("mlp.shared_experts") < calls.index("mlp.experts") < calls.index("mlp.join")
    (fork,) = [n for n in plan.graph.nodes if n.target == "mlp.shared_experts"]
    assert [u.target for u in fork.users] == ["mlp.join"]


def test_traced_in_capture_mode_on_the_cpu_fuses_and_matches_eager():
    """Capture mode forks onto a side stream on CUDA only: on the CPU the layer traces, fuses and
    runs in capture mode as outside it."""
    layer, inputs = dsv4.tiny(T=5)
    eager, eager_inputs = dsv4.tiny(T=5)
    with dsv4.capture_mode():
        assert dsv4.is_capture_mode()
        reports = {name: plan.report for name, plan in dsv4.fuse_layer(layer, inputs).items()}
        with torch.no_grad():
            got = layer(*inputs)
            expected = eager(*eager_inputs)
    assert not dsv4.is_capture_mode()
    assert [c.pattern for c in reports[SHARED].chains] == ["swiglu_clamp"]
    assert reports[""].launches_after * 5 <= reports[""].launches_before
    assert layer.mlp.shared_experts.fork.pending is None and not layer.mlp.shared_experts.fork.streams
    problem = mismatch(got, expected, "output", LAYER)
    assert problem is None, problem


def test_bench_marks_heavy_leaves_but_not_the_side_stream_wrapper():
    """fuser bench counts kernels between a leaf's markers as heavy: the side-stream wrapper must
    get none, so the shared expert's SwiGLU still counts as glue (its GEMMs are heavy by name)."""
    from fuser.tools.bench import mark_leaves

    layer, _ = dsv4.tiny(T=1)
    mark_leaves(layer)
    marked = {name for name, m in layer.named_modules() if "forward" in m.__dict__}
    assert marked == {"self_attn.attn", "mlp.experts", "mlp.join"}
