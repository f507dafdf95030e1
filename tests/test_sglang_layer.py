"""The plugin on sglang's real DeepSeek-V4 decoder layers (CPU, sglang 0.5.23 as installed).

``tests/sglang_env/layer_scenarios.py`` builds sglang's ``DeepseekV4CudaDecoderLayer`` as
sglang ships it (tiny config; compress ratios 0, 4 and 128; hash and top-k routing; world
size 1 on gloo; inside ``layer_stack``) and the ``DeepseekV4DecoderLayer`` alias, in a fresh
process with the plugin loaded by sglang's own plugin loader.
"""

from __future__ import annotations

import pytest
from test_sglang_plugin import ENV_DIR, run_python

# sglang's classes the plugin must keep as leaves, by the base class that makes them one.
LEAF_BASES = {"LinearBase", "FusedMoE", "RadixAttention", "BaseFusedOp"}


@pytest.fixture(scope="module")
def layers():
    return run_python(ENV_DIR / "layer_scenarios.py", {"FUSER_ENABLE": "1"})


def test_the_fixture_builds_every_variant(layers):
    assert layers["ratios"] == [0, 4, 128]
    assert layers["routing"] == ["HashTopK", "TopK", "TopK"]
    assert layers["alias_class"] == "DeepseekV4PlatformDecoderLayer"  # the alias off CUDA


def test_default_layer_names_match_on_cuda_and_on_the_platform_alias(layers):
    assert layers["matches"] == {"DeepseekV4CudaDecoderLayer": True, "DeepseekV4PlatformDecoderLayer": True}


def test_gemms_experts_attention_and_sglang_kernels_are_leaves(layers):
    kinds = {"ReplicatedLinear", "ColumnParallelLinear", "MergedColumnParallelLinear", "RowParallelLinear",
             "FusedMoE", "RadixAttention", "RMSNorm", "TopK", "SiluAndMul", "Compressor"}
    seen = {(p, c, d) for decisions in layers["decisions"] for p, c, d in decisions if c in kinds}
    assert {c for _, c, _ in seen} == kinds
    assert {d for _, _, d in seen} == {"leaf"}
    for path, bases in layers["leaf_bases"].items():
        assert LEAF_BASES & set(bases), (path, bases)


def test_modules_taking_forward_batch_are_searched_not_traced(layers):
    searched = {(p, c) for decisions in layers["decisions"] for p, c, d in decisions if d == "searched"}
    assert {("self_attn", "MQALayer"), ("mlp", "DeepseekV2MoE"), ("mlp.gate", "MoEGate"),
            ("mlp.shared_experts", "DeepseekV2MLP"), ("self_attn.indexer", "C4Indexer")} <= searched


def test_the_only_target_is_the_hash_router(layers):
    targets = [[(p, c) for p, c, d in decisions if d == "target"] for decisions in layers["decisions"]]
    assert targets == [[("mlp.topk", "HashTopK")], [], []]


def test_nothing_is_wrapped_for_no_glue(layers):
    # Layers 1 and 2 (top-k routing) have no target: they are not spliced, and say why.
    assert layers["spliced"] == ["layers.0", "layers.3"]
    assert layers["wrapped"] == ["layers.0", "layers.0.mlp.topk", "layers.3", "layers.3.mlp.topk"]
    skipped = [m for m in layers["install_log"] if "no submodule to fuse" in m]
    assert [m.split(" ")[1] for m in skipped] == ["layers.1", "layers.2"]


def test_an_untraceable_target_stays_eager_logged_with_file_and_line(layers):
    topk = layers["hash_topk"]
    assert topk["state"] == "eager" and topk["same"] and topk["forward_left"] is False
    (message,) = topk["log"]
    assert message.startswith("fuser: layers.0.mlp.topk left eager:") and "hash_topk.py:242" in message


def test_each_layers_mhc_glue_is_fused_through_the_compile_seam(layers):
    seam = {}
    for entry in layers["seam"]:
        seam.setdefault(entry["name"].split(" ")[0].rsplit(".", 1)[-1], []).append(entry)
    assert [e["state"] for e in seam["hc_pre_torch_impl"]] == ["fused"] * 3  # one per layer
    assert [e["state"] for e in seam["post_torch_impl"]] == ["fused"]
    for entry in seam["hc_pre_torch_impl"] + seam["post_torch_impl"]:
        before, after = entry["launches"]
        assert after < before
    assert layers["torch_compile_calls"] == []


def test_fused_mhc_glue_matches_eager_on_every_layer(layers):
    assert {k: v for k, v in layers["errors"].items() if not v <= 1e-5} == {}
