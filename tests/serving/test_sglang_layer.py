"""The plugin on sglang's real DeepSeek-V4 decoder layers (CPU, sglang 0.5.23 as installed).

``tests/serving/sglang_env/layer_scenarios.py`` builds sglang's ``DeepseekV4CudaDecoderLayer`` as
sglang ships it (tiny config; compress ratios 0, 4 and 128; hash and top-k routing; world
size 1 on gloo; inside ``layer_stack``) and the ``DeepseekV4DecoderLayer`` alias, in a fresh
process with the plugin loaded by sglang's own plugin loader and sglang's torch fallbacks
selected by its own switches (``SGLANG_FORCE_FUSED_OP_BACKEND=torch``, the mHC ones).

The layer's forward needs sglang's DSv4 attention backend, which has no CPU path: each target
that runs on the CPU (the MoE block, which takes ``forward_batch``, and the two layer norms)
is called as the layer calls it, with sglang's own ``ForwardBatch``, in the decode mode as the
layer's splice sets it; and the layer's own forward runs under the splice with its attention
replaced by a stand-in leaf (sglang has no torch reference of the DSv4 attention).
"""

from __future__ import annotations

import pytest
from test_sglang_plugin import ENV_DIR, run_python

# sglang's classes the plugin keeps as leaves whatever the backend, by the base class that makes them one.
KERNEL_BASES = {"LinearBase", "FusedMoE", "RadixAttention"}
CALLED = ("mlp", "input_layernorm", "post_attention_layernorm")
TOKENS = ("4", "1", "13")


@pytest.fixture(scope="module")
def layers():
    return run_python(ENV_DIR / "layer_scenarios.py", {"FUSER_ENABLE": "1"})


@pytest.fixture(scope="module")
def explained():
    return run_python(ENV_DIR / "layer_scenarios.py", {"FUSER_ENABLE": "1", "FUSER_EXPLAIN": "1"}, ["explain"])


def called_targets(layers):
    return [(name, call) for name, call in layers["calls"].items()]


def test_the_fixture_builds_every_variant(layers):
    assert layers["ratios"] == [0, 4, 128]
    assert layers["routing"] == ["HashTopK", "TopK", "TopK"]
    assert layers["alias_class"] == "DeepseekV4PlatformDecoderLayer"  # the alias off CUDA


def test_default_layer_names_match_on_cuda_and_on_the_platform_alias(layers):
    assert layers["matches"] == {"DeepseekV4CudaDecoderLayer": True, "DeepseekV4PlatformDecoderLayer": True}


def test_gemms_experts_attention_and_the_compressor_are_leaves(layers):
    kinds = {"ReplicatedLinear", "ColumnParallelLinear", "MergedColumnParallelLinear", "RowParallelLinear",
             "FusedMoE", "RadixAttention", "Compressor"}
    seen = {(p, c, d) for decisions in layers["decisions"] for p, c, d in decisions if c in kinds}
    seen |= {(f"mlp.{p}", c, "leaf") for p, c in layers["moe_leaves"].items()}  # kept opaque in its trace
    assert {c for _, c, _ in seen} == kinds
    assert {d for _, _, d in seen} == {"leaf"}
    assert layers["moe_leaves"] == {"experts": "FusedMoE", "shared_experts.gate_up_proj": "MergedColumnParallelLinear",
                                    "shared_experts.down_proj": "RowParallelLinear"}
    for path, bases in layers["leaf_bases"].items():
        # The compressor is a fused op that takes forward_batch (it writes the KV cache).
        assert KERNEL_BASES & set(bases) or "BaseFusedOp" in bases, (path, bases)


def test_fused_ops_running_their_torch_reference_are_glue_and_with_a_kernel_backend_leaves(layers):
    glue = {(p, c) for decisions in layers["decisions"] for p, c, d in decisions
            if c in {"RMSNorm", "RotaryEmbedding", "DeepseekScalingRotaryEmbedding"}}
    targets = {(p, c) for decisions in layers["decisions"] for p, c, d in decisions if d == "target"}
    assert glue and glue <= targets
    kernel_backend = layers["kernel_backend_leaves"]
    assert set(kernel_backend["fused_ops"].values()) == {"leaf"}
    assert {"input_layernorm", "post_attention_layernorm", "self_attn.q_norm"} <= set(kernel_backend["fused_ops"])
    assert kernel_backend["targets"] == ["mlp"]  # the MoE block alone


def test_attention_is_searched_and_the_moe_block_taking_forward_batch_is_a_target(layers):
    for decisions in layers["decisions"]:
        decided = {p: (c, d) for p, c, d in decisions}
        assert decided["self_attn"] == ("MQALayer", "searched")
        assert decided["mlp"] == ("DeepseekV2MoE", "target")
        assert not any(p.startswith("mlp.") for p in decided)  # traced, not searched
    assert ("C4Indexer", "searched") == {p: (c, d) for p, c, d in layers["decisions"][1]}["self_attn.indexer"]


def test_every_layer_is_spliced_with_its_targets(layers):
    assert layers["spliced"] == ["layers.0", "layers.1", "layers.2", "layers.3"]
    assert layers["install_log"] == []
    for name, targets in layers["targets"].items():
        assert {f"{name}.{path}" for path in CALLED} <= set(targets)
        assert f"{name}.self_attn" not in targets


def test_each_called_target_is_fused_at_its_first_decode_call(layers):
    for name, call in called_targets(layers):
        assert call["state"] == "fused", (name, call["log"])
        (message,) = call["log"]
        assert message.startswith(f"fuser: {name} fused:")
        assert call["fused_graph_runs"] == 2, name  # the two later decode calls ran the fused graph


def test_the_moe_block_fuses_with_forward_batch_as_the_layer_hands_it(layers):
    # Mid-layer, sglang's residual stream on forward_batch holds a process group: no deep copy
    # can be made; apply's runs get a copy with its tensors cloned (fuser.trace.call_spec.copy_state).
    for i in range(3):
        call = layers["calls"][f"layers.{i}.mlp"]
        assert call["batch_deep_copyable"] is False
        assert call["state"] == "fused"


def test_what_each_target_fuses_is_glue_never_a_gemm(layers):
    for name, call in called_targets(layers):
        before, after = call["launches"]
        assert after < before, (name, call["launches"])
        assert call["gemm_in_a_chain"] == [], name
    for i in range(3):
        assert layers["calls"][f"layers.{i}.input_layernorm"]["launches"][1] == 1  # the norm is one kernel
        assert layers["calls"][f"layers.{i}.post_attention_layernorm"]["launches"][1] == 1


def test_the_hash_router_is_traced_into_inside_the_fused_moe_block(layers):
    """Its assert that the token counts of its inputs agree (hash_topk.py:242) is decided for
    every count: no target keeps a leaf, and the router's gather of the scores is fused."""
    assert [c["automatic_leaves"] for _, c in called_targets(layers)] == [[]] * 9
    nodes = [n for c in layers["calls"]["layers.0.mlp"]["chains"] for n in c["nodes"]]
    assert any(n.startswith("gather") for n in nodes), nodes


def test_decode_calls_at_several_batch_sizes_match_eager(layers):
    for name, call in called_targets(layers):
        assert set(call["errors"]) == set(TOKENS), name
        for tokens, error in call["errors"].items():
            assert isinstance(error, float), (name, tokens, error)  # else fuser.validate.tolerance.LAYER's mismatch
        assert all(left * 4 <= int(tokens) for tokens, left in call["left_out_rows"].items())


def test_a_call_in_another_forward_mode_runs_the_modules_own_code(layers):
    for name, call in called_targets(layers):
        assert call["extend_took_fused_path"] is False, name
        assert call["extend_same_as_own_code"] is True, name


def test_engine_wide_flags_read_by_the_trace_are_guarded(layers):
    backend = "sglang.kernels.fused_op.get_fused_op_backend()"
    piecewise = ("sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph.context_manager"
                 ".is_in_tc_piecewise_cuda_graph()")
    for name, call in called_targets(layers):
        expected = {backend, piecewise} if name.endswith(".mlp") else {backend}
        assert set(call["globals_read"]) == expected, name
        assert call["globals_read"][backend] == "<KernelBackend.TORCH: 'torch'>"


def test_a_call_where_a_global_differs_runs_the_original_code(layers):
    runs = layers["fused_op_backend_changed"]
    assert runs["as fused"] == 1
    assert runs["backend unset"] == 1  # set_fused_op_backend(None): the module's own dispatch ran
    # Inside sglang's piecewise graph the module's own code took its piecewise path (a CUDA-only op).
    assert runs["piecewise error"] == "Could not run 'sglang::moe_forward_piecewise_cuda_graph_impl'"
    assert runs["inside a piecewise graph"] == 1
    assert runs["back as fused"] == 2
    assert runs["backend"] == "KernelBackend.TORCH"


def test_each_layers_mhc_glue_is_fused_through_the_compile_seam(layers):
    seam = {}
    for entry in layers["seam_summary"]:
        seam.setdefault(entry["name"].split(" ")[0].rsplit(".", 1)[-1], []).append(entry)
    assert [e["state"] for e in seam["hc_pre_torch_impl"]] == ["fused"] * 3  # one per layer
    assert [e["state"] for e in seam["post_torch_impl"]] == ["fused"]
    for entry in seam["hc_pre_torch_impl"] + seam["post_torch_impl"]:
        before, after = entry["launches"]
        assert after < before
    assert layers["torch_compile_calls"] == []


def test_fused_mhc_glue_matches_eager_on_every_layer(layers):
    assert {k: v for k, v in layers["seam"].items() if not v <= 1e-5} == {}


def test_the_moe_blocks_capture_mode_read_is_guarded(layers):
    # With the side stream sglang gives the MoE on CUDA, DeepseekV2MoE.forward reads
    # get_is_capture_mode() (deepseek_v2.py:1100): traced as False, guarded at every call.
    read = layers["capture_mode_read"]
    assert read["state"] == "fused"
    assert read["globals_read"]["sglang.srt.model_executor.runner_utils.capture_mode.get_is_capture_mode()"] == "False"
    assert read["fused_runs"] == 1
    # In capture mode the module's own code ran, into its dual-stream path (CUDA streams: it
    # stops there on the CPU); the fused graph did not run.
    assert "forward_normal_dual_stream" in read["capture_call_ran"]
    assert read["fused_runs_after_capture_call"] == 1


def test_values_the_fused_moe_block_holds_are_declared_to_sglangs_weight_updater(layers):
    # The top-k correction bias reaches the trace through sglang's TopKConfig (an object, not a
    # parameter path): the fused block holds it as a constant (a view of the gate's parameter),
    # which the plugin declares through model._derived_weight_cache_error.
    declared = layers["derived_weight_cache_error"]
    assert declared and ".mlp: " in declared


def test_the_real_layer_forward_spliced_runs_its_fused_targets_in_decode_mode(layers):
    # sglang's own layer forward (boundaries, mHC, MoE), its attention a stand-in leaf (the DSv4
    # attention backend has no CPU path): decode calls in capture mode, as sglang's warm-ups.
    run = layers["layer_forward"]
    for name, targets in run["targets"].items():
        assert targets == [f"{name}.mlp", f"{name}.input_layernorm", f"{name}.post_attention_layernorm"]
    assert set(run["states"].values()) == {"fused"}
    assert set(run["fused_graph_runs"].values()) == {2}  # both later calls, in every target
    assert len(run["errors"]) == 6
    for call, error in run["errors"].items():
        assert isinstance(error, float), (call, error)  # else fuser.validate.tolerance.LAYER's mismatch


def test_the_real_layer_forward_in_another_forward_mode_runs_its_own_code(layers):
    run = layers["layer_forward"]
    assert run["extend_same_as_own_code"] == {"layers.0": True, "layers.1": True}
    assert set(run["extend_took_fused_path"].values()) == {False}


def test_the_real_layer_forward_in_capture_mode_runs_its_mhc_closures_fused(layers):
    seam = layers["layer_forward"]["seam"]
    # One new hc_pre closure per layer (its cells hold the layer); the post closure's cells hold
    # the same values in every layer, so the entry fused before serves these layers too.
    assert [e["name"].split(" ")[0].rsplit(".", 1)[-1] for e in seam] == ["hc_pre_torch_impl"] * 2
    assert {e["state"] for e in seam} == {"fused"}
    assert layers["torch_compile_calls"] == []


def test_explain_logs_the_splice_decisions_once_per_layer_structure(explained):
    tables = [m.splitlines() for m in explained["install_log"]
              if m.splitlines()[0].endswith("leaves, searched modules and fusion targets")]
    # compress ratio 0, 4 (compressor and indexer) and 128 (compressor) differ; the alias is another class
    assert [t[0].split()[1] for t in tables] == ["layers.0", "layers.1", "layers.2", "layers.3"]
    assert [t[0].split()[2] for t in tables] == ["(DeepseekV4CudaDecoderLayer):"] * 3 + ["(DeepseekV4PlatformDecoderLayer):"]
    for table in tables:
        rows = {line.split()[0]: tuple(line.split()[1:]) for line in table[1:]}
        assert rows["self_attn"] == ("MQALayer", "searched") and rows["mlp"] == ("DeepseekV2MoE", "target")
        assert rows["self_attn.wqkv_a"] == ("ReplicatedLinear", "leaf")
    assert ("C4Indexer", "searched") == {line.split()[0]: tuple(line.split()[1:]) for line in tables[1]}["self_attn.indexer"]


def test_explain_logs_the_whole_report_of_each_fused_target_and_closure(explained):
    log = explained["layer_forward"]["log"]
    launches = explained["layer_forward"]["launches"]
    assert set(launches) == {f"layers.{i}.{p}" for i in (0, 1) for p in CALLED}
    for target, (before, after) in launches.items():
        (at,) = [i for i, m in enumerate(log) if m.startswith(f"fuser: {target} fused: {before} glue launches -> {after}")]
        report = log[at + 1]
        assert report.startswith("fuser report for "), report
        assert f"glue kernel launches per call: {before} eager -> {after} fused" in report
    seam = {i: m.split()[3].split(".")[-1] for i, m in enumerate(log) if m.startswith("fuser: compile seam: ")}
    # hc_pre once per layer (its closure holds the layer); post once (its cells hold no layer's values)
    assert sorted(seam.values()) == ["hc_pre_torch_impl", "hc_pre_torch_impl", "post_torch_impl"]
    for at, closure in seam.items():
        launches = {"hc_pre_torch_impl": "6 eager -> 2 fused", "post_torch_impl": "5 eager -> 1 fused"}[closure]
        assert log[at + 1].startswith(f"fuser report for {closure}") and launches in log[at + 1]


def test_without_explain_the_plugin_logs_one_line_per_fused_module(layers):
    for name, call in called_targets(layers):
        (message,) = call["log"]
        assert "\n" not in message and "fuser report" not in message
