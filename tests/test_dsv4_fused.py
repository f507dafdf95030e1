"""The whole tiny DeepSeek-V4 decode layer, fused by fuser, against eager."""

from collections import Counter

import pytest
import torch

import fuser
from examples.dsv4 import layer as dsv4
from fuser.tolerance import LAYER, mismatch

FACTORIES = {"tiny": dsv4.tiny, "tiny_hash": dsv4.tiny_hash}


@pytest.fixture(scope="module", params=sorted(FACTORIES))
def fused(request):
    """(factory, the layer fused at T=5, its report)."""
    factory = FACTORIES[request.param]
    layer, inputs = factory(T=5)
    report = fuser.apply(layer, inputs)
    return factory, layer, report


@pytest.mark.parametrize("T", [1, 3, 16])
def test_fused_layer_matches_eager(fused, T):
    factory, layer, _ = fused
    # The same seed gives the same weights and KV history at every T; only the inputs differ.
    eager, inputs = factory(T=T)
    cache = layer.self_attn.attn.kv_cache
    eager_cache = eager.self_attn.attn.kv_cache
    for (name, p), (_, q) in zip(layer.named_parameters(), eager.named_parameters()):
        assert torch.equal(p, q), name
    with torch.no_grad():
        cache.copy_(eager_cache)  # earlier calls wrote into the fused layer's cache
    assert layer.__dict__["_fuser_state"].guard.why_not(inputs, {}) is None, "the fused path must run"

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
    # The cache: the slots this call wrote hold the same keys (compared on their own, so the
    # untouched history does not dilute the error), and nothing else changed.
    _, positions, req_pool_indices, _ = inputs
    slots = positions % layer.cfg.window_size
    written = torch.zeros(cache.shape[:2], dtype=torch.bool)
    written[req_pool_indices, slots] = True
    problem = mismatch(cache[written], eager_cache[written], "kv_cache (written slots)", LAYER)
    assert problem is None, problem
    assert torch.equal(cache[~written], eager_cache[~written]), "the fused forward wrote outside its slots"


def test_glue_launches_drop_at_least_five_fold(fused):
    _, _, report = fused
    assert report.launches_before > 0
    assert report.launches_after * 5 <= report.launches_before, report.text()


def test_report_names_the_expected_patterns(fused):
    _, _, report = fused
    by_pattern = Counter(c.pattern for c in report.chains)
    # The mix scaling (GEMM output * rsqrt) joins the Sinkhorn block: mhc_sinkhorn_rms.
    expected = {"mhc_sinkhorn_rms": 2, "mhc_post": 2, "rmsnorm": 3, "rmsnorm_weightless": 1, "swiglu_clamp": 1}
    for pattern, count in expected.items():
        assert by_pattern[pattern] == count, f"{pattern}: {by_pattern[pattern]} chains, expected {count}\n{report.text()}"
    for chain in report.chains:
        if chain.pattern == "mhc_sinkhorn_rms":
            assert chain.template == "sinkhorn"
            assert chain.params["iters"] == 20
            assert chain.params["eps"] == pytest.approx(1e-6)
            assert chain.params["post_scale"] == pytest.approx(2.0)
        if chain.pattern in ("rmsnorm", "rmsnorm_weightless"):
            assert chain.params["eps"] == pytest.approx(1e-6)
        assert chain.launches_replaced >= 1 and chain.nodes and chain.outputs


def test_swiglu_clamp_captures_its_limits(fused):
    _, layer, report = fused
    limit = layer.cfg.swiglu_limit
    (chain,) = [c for c in report.chains if c.pattern == "swiglu_clamp"]
    assert chain.params == {"low": -limit, "high": limit}


def test_every_unfused_node_has_a_reason(fused):
    _, _, report = fused
    for u in report.unfused:
        assert isinstance(u.reason, str) and u.reason.strip(), u
        assert u.launches >= 1


def test_no_kernel_failed_validation(fused):
    _, _, report = fused
    failed = [r for r in report.rejected if r.category == "validation"]
    assert failed == [], failed
    for r in report.rejected:
        assert r.reason.strip(), r
