"""The glue launches of sglang's real DeepSeek-V4 layer's decode call, eager and fused (CPU).

``tests/serving/sglang_env/count_scenarios.py`` builds sglang 0.5.23's
``DeepseekV4CudaDecoderLayer`` at compress ratios 0, 4 and 128 with hash and with top-k routing
(its attention the stand-in leaf of ``layer_scenarios.py``: sglang's DSv4 attention has no CPU
path), installs the plugin, and counts what each decode call launches as it runs
(``launch_count.py``): every ATen op that launches a kernel and every Triton launch, sglang's
TileLang Sinkhorn (its torch reference here) as one launch; the attention and the routed
experts counted apart, the GEMMs apart from the glue. Eager is the layer's own forward; fused
is the spliced layer in capture mode after the warm-up that fuses (what sglang's CUDA graphs
hold) and outside capture mode (an eager decode step, a batch larger than any captured). The
plugin fuses each layer whole (``fallbacks``, ``defaults``, ``no_graphs``); ``targets`` is the
same layers with ``FUSER_WHOLE_LAYER=0``, each target fused on its own and the mHC closures
through the compile seam (the whole layer's fallback).
"""

from __future__ import annotations

import pytest
from test_sglang_plugin import ENV_DIR, run_python

#: The issue's bound on a decode call's glue with sglang's torch fallbacks.
BOUND = 16
HC_PRE, POST = "DeepseekV4DecoderLayerBase.hc_pre.<locals>.hc_pre_torch_impl", "post.<locals>.post_torch_impl"


def count(variant: str) -> dict:
    return run_python(ENV_DIR / "count_scenarios.py", {"FUSER_ENABLE": "1"}, [variant])


@pytest.fixture(scope="module")
def fallbacks():
    return count("fallbacks")


@pytest.fixture(scope="module")
def targets():
    return count("targets")


@pytest.fixture(scope="module")
def defaults():
    return count("defaults")


@pytest.fixture(scope="module")
def no_graphs():
    return count("no_graphs")


def layers(run):
    return [layer for routing in ("hash", "topk") for layer in run.get(routing, [])]


def glue(calls: dict) -> set[int]:
    return {c["glue"] for c in calls.values()}


ROUTED = [("HashTopK", 0), ("HashTopK", 4), ("HashTopK", 128), ("TopK", 0), ("TopK", 4), ("TopK", 128)]


def test_every_ratio_and_routing_is_counted_each_layer_fused_whole(fallbacks):
    assert [(x["routing"], x["ratio"]) for x in layers(fallbacks)] == ROUTED
    for layer in layers(fallbacks):
        assert layer["whole"] == "fused", layer["log"]
        assert set(layer["states"].values()) == {"waiting"}  # the fallback: never needed
        assert layer["seam"] == {}  # the mHC closures are traced in the layer's graph


def test_with_the_layer_not_fused_whole_its_targets_and_the_seams_closures_are(targets):
    assert [(x["routing"], x["ratio"]) for x in layers(targets)] == ROUTED
    for layer in layers(targets):
        assert layer["whole"] is None
        assert set(layer["states"].values()) == {"fused"}, layer["log"]
        assert set(layer["seam"]) == {"hc_pre_torch_impl", "post_torch_impl"}


def test_a_decode_call_launches_the_same_glue_at_every_batch_size(fallbacks, targets):
    for layer in layers(fallbacks) + layers(targets):
        for mode in ("eager", "captured", "eager_decode"):
            assert len(glue(layer[mode])) == 1, (layer["name"], mode, layer[mode])


def test_the_attention_the_experts_and_the_gemms_are_counted_apart_and_unchanged(fallbacks, targets):
    for layer in layers(fallbacks) + layers(targets):
        for mode in ("eager", "captured", "eager_decode"):
            for call in layer[mode].values():
                assert call["apart"] == {"attention": 1, "experts": 1}
        gemms = {c["gemm"] for mode in ("eager", "captured", "eager_decode") for c in layer[mode].values()}
        assert len(gemms) == 1 and gemms.pop() > 0  # fuser fuses no GEMM


def test_what_ran_agrees_with_what_the_layers_report_says_was_saved(fallbacks):
    for layer in layers(fallbacks):
        (eager,) = glue(layer["eager"])
        before, after = layer["whole_report"]
        for mode in ("captured", "eager_decode"):
            assert glue(layer[mode]) == {eager - (before - after)}, (layer["name"], mode, eager, before, after)


def test_sglangs_own_kernels_in_the_layer_launch_as_in_eager(fallbacks):
    """The Sinkhorn (a TileLang kernel; its torch reference here, as a custom op) and
    ``mhc_combine`` (sglang's Triton kernel) are leaves of the layer's graph: two each."""
    for layer in layers(fallbacks):
        for mode in ("eager", "captured", "eager_decode"):
            for call in layer[mode].values():
                ops = call["glue_ops"]
                assert ops.get("kernel:hc_split_sinkhorn", 0) + ops.get("hc_split_sinkhorn", 0) == 2, (mode, ops)
                assert ops["triton:_mhc_combine_kernel"] == 2, (mode, ops)


def test_what_ran_agrees_with_what_the_reports_say_was_saved(targets):
    """Counted as it ran, a call saves what the fused targets' and closures' reports say,
    each as many times as the call runs it."""
    for layer in layers(targets):
        (eager,) = glue(layer["eager"])
        (captured,) = glue(layer["captured"])
        calls = {HC_PRE: 0, POST: 0}
        calls.update({k: v // len(layer["captured"]) for k, v in layer["closure_calls"].items()})
        saved = sum(before - after for before, after in layer["reports"].values())
        saved += calls[HC_PRE] * (layer["seam"]["hc_pre_torch_impl"][0] - layer["seam"]["hc_pre_torch_impl"][1])
        saved += calls[POST] * (layer["seam"]["post_torch_impl"][0] - layer["seam"]["post_torch_impl"][1])
        assert calls == {HC_PRE: 2, POST: 2}  # the attention's and the MoE's boundary
        assert eager - captured == saved, (layer["name"], eager, captured, layer["reports"], layer["seam"])
        # Each target's own launches, counted inside it, are its report's.
        eager_sections = layer["eager"]["4"]["sections"]
        fused_sections = layer["captured"]["4"]["sections"]
        for name, (before, after) in layer["reports"].items():
            assert (eager_sections[name], fused_sections[name]) == (before, after), (layer["name"], name)


def test_fused_decode_calls_match_eager(fallbacks, targets, no_graphs):
    for layer in layers(fallbacks) + layers(targets) + layers(no_graphs):
        assert layer["errors"], layer["name"]
        for call, error in layer["errors"].items():
            assert isinstance(error, float), (layer["name"], call, error)  # else fuser.validate.tolerance.LAYER's mismatch


def test_a_topk_layers_decode_call_is_within_the_bound_in_capture_mode_and_out(fallbacks, targets):
    for layer in fallbacks["topk"] + targets["topk"]:
        (eager,) = glue(layer["eager"])
        assert glue(layer["captured"]) == glue(layer["eager_decode"])
        (fused,) = glue(layer["captured"])
        assert fused <= BOUND < eager, (layer["name"], eager, fused)


def test_a_hash_layers_decode_call_is_within_the_bound(fallbacks, targets):
    for layer in fallbacks["hash"] + targets["hash"]:
        assert glue(layer["captured"]) == glue(layer["eager_decode"])
        (fused,) = glue(layer["captured"])
        assert fused <= BOUND


def test_the_layer_fused_whole_launches_less_than_its_targets_fused_one_by_one(fallbacks, targets):
    """Traced whole, the attention boundary's mHC post and the FFN boundary's pre are one
    kernel, and so are the MoE block's scaling and output add and the FFN boundary's post."""
    for whole, apart in zip(layers(fallbacks), layers(targets), strict=True):
        (fused_whole,) = glue(whole["captured"])
        (fused_apart,) = glue(apart["captured"])
        assert fused_whole < fused_apart, (whole["name"], fused_whole, fused_apart)


def test_an_eager_decode_step_runs_the_seams_closures_fused(targets):
    for layer in layers(targets):
        assert layer["closure_calls_eager_decode"] == {HC_PRE: 2 * 2, POST: 2 * 2}  # two calls
        assert glue(layer["eager_decode"]) == glue(layer["captured"])


def test_an_eager_decode_step_runs_the_layer_fused_whole(fallbacks):
    for layer in layers(fallbacks):
        assert layer["closure_calls_eager_decode"] == {}  # traced in the layer's graph, never called
        assert glue(layer["eager_decode"]) == glue(layer["captured"])


def test_without_cuda_graphs_the_first_decode_call_fuses_the_layer_whole(no_graphs):
    for layer in no_graphs["topk"]:
        assert layer["whole"] == "fused"
        assert layer["captured"] == {}  # never in capture mode
        (eager,) = glue(layer["eager"])
        (fused,) = glue(layer["eager_decode"])
        assert fused <= BOUND < eager
    assert [m for m in no_graphs["log"] if "left eager" in m or "during CUDA-graph capture" in m] == []
    assert any(m.startswith("fuser: layers.0 fused: ") for m in no_graphs["log"])


def test_sglangs_defaults_where_they_run_on_the_cpu_count_as_its_torch_fallbacks(fallbacks, defaults):
    """On the CPU sglang's fused-op dispatch finds no kernel and takes the torch path, and its
    DeepGEMM pre-norm starts at 1024 rows: its defaults launch what its fallbacks launch."""
    assert defaults["variant"] == "defaults"
    # its DeepGEMM pre-norm branch on the token count (1024 rows) taken as traced below 1024
    assert {layer["whole"] for layer in layers(defaults)} == {"fused"}
    for a, b in zip(layers(fallbacks), layers(defaults), strict=True):
        for mode in ("eager", "captured", "eager_decode"):
            assert {t: c["glue_ops"] for t, c in a[mode].items()} == {t: c["glue_ops"] for t, c in b[mode].items()}
