"""sglang's real DeepSeek-V4 decoder layer fused whole by the plugin (CPU, sglang 0.5.23).

``layer_scenarios.py whole`` builds ``DeepseekV4CudaDecoderLayer`` as sglang ships it at compress
ratios 0, 4 and 128, with hash and with top-k routing, its attention the stand-in leaf (sglang's
DSv4 attention has no CPU path), and runs decode steps through the stack as
``DeepseekV4Model`` does: the layer stack started once, each layer given the previous one's
output and the residual stream it left on ``forward_batch``. The layer's boundaries hand the
residual on through that stream (``ResidualStream``, declared to the trace by the plugin:
``fuser.trace.state_objects``), so the layer's own forward is one fusion target. The launch
counts are ``test_sglang_layer_launches.py``'s.
"""

from __future__ import annotations

import pytest
from test_sglang_plugin import ENV_DIR, run_python

ROUTINGS = ("HashTopK", "TopK")
LAYERS = ("layers.0", "layers.1", "layers.2")


@pytest.fixture(scope="module")
def whole():
    return run_python(ENV_DIR / "layer_scenarios.py", {"FUSER_ENABLE": "1", "FUSER_EXPLAIN": "1"}, ["whole"])


def test_every_layer_is_fused_whole_at_its_first_decode_call_and_its_targets_are_not_needed(whole):
    assert set(whole["routings"]) == set(ROUTINGS)
    for run in whole["routings"].values():
        assert run["whole"] == dict.fromkeys(LAYERS, "fused")
        assert set(run["targets"].values()) == {"waiting"}
        # every later call, in capture mode and out, ran the layer's fused graph
        assert run["fused_graph_runs"] == dict.fromkeys(LAYERS, 4)


def test_decode_steps_through_the_stack_match_eager_at_every_token_count(whole):
    for run in whole["routings"].values():
        assert len(run["errors"]) == 3 * 5
        for call, error in run["errors"].items():
            assert isinstance(error, float), (call, error)  # else fuser.validate.tolerance.LAYER's mismatch


def test_each_layer_leaves_the_residual_stream_as_eager_does(whole):
    for run in whole["routings"].values():
        expected = {"residual_is_output": True, "pending": "None", "transport": "None"}
        assert set(map(str, run["left"].values())) == set(map(str, run["eager_left"].values())) == {str(expected)}


def test_a_layer_after_the_first_reads_its_input_as_the_streams_residual_guarded(whole):
    for run in whole["routings"].values():
        assert run["state_reads"]["layers.0"]["forward_batch.residual_stream.residual"] == "None"
        for name in ("layers.1", "layers.2"):
            reads = run["state_reads"][name]
            assert reads["forward_batch.residual_stream.residual"] == "the input hidden_states itself"
            assert reads["forward_batch.residual_stream.pending"] == "None"
            assert reads["forward_batch.forward_mode"] == "<ForwardMode.DECODE: 2>"


def test_a_call_in_another_forward_mode_runs_the_layers_own_code(whole):
    for run in whole["routings"].values():
        assert run["extend_same_as_own_code"] is True
        assert run["extend_took_fused_path"] is False


def test_explain_logs_the_layer_as_one_target_with_its_whole_report(whole):
    reports = [m for m in whole["log"] if m.startswith("fuser report for DeepseekV4CudaDecoderLayer")]
    assert len(reports) == 6  # three layers, two routings
    for report in reports:
        assert "fused chains (7):" in report
        assert "mhc_post+generic" in report and "generic+mhc_post" in report  # the boundaries' post, merged
        assert "torch.ops.fuser_tests.hc_split_sinkhorn" in report  # the Sinkhorn kernel's stand-in: a leaf
        assert "sglang.kernels.ops.layernorm.mhc.mhc_combine" in report  # sglang's Triton kernel: a leaf
        assert "leaf (automatic): self_attn" in report
    fused = [m for m in whole["log"] if m.startswith("fuser: layers.") and " fused: " in m]
    assert len(fused) == 6 and all(" glue launches -> 9 (guarded on " in m for m in fused)


def test_a_layer_that_cannot_be_fused_whole_falls_back_to_its_targets_logged_once(whole):
    """Without the stream declared, the trace stops at sglang's own check of the producer's
    update (``deepseek_v4_boundary.py``): the layer's targets fuse one by one, as before."""
    fallback = whole["fallback"]
    assert fallback["whole"] == "eager"
    assert set(fallback["targets"].values()) == {"fused"}
    assert isinstance(fallback["error"], float)
    (message,) = [m for m in fallback["log"] if "left eager" in m]
    assert message.startswith("fuser: layers.0 left eager: ")
    assert "deepseek_v4_boundary.py:267: TypeError: mHC read requires its producer's update" in message
    assert message.endswith("its fusion targets fuse one by one instead")
    assert fallback["strict_raised"].startswith("fuser: layers.0 cannot be fused: ")
