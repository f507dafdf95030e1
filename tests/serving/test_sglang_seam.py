"""fuser's compile seam (``fuser/serving/engines/sglang_seam.py``) against the real sglang 0.5.23 on the CPU.

Each scenario is a fresh process (``tests/serving/sglang_env/seam_scenarios.py``): sglang's plugin
loader installs fuser's ``compile_in_capture_mode``; sglang's own ``hc_pre`` and
``deepseek_v4_mhc.post`` then run under sglang's ``model_capture_mode()`` with
``torch.compile`` replaced by a function that raises.
"""

from __future__ import annotations

import pytest
from test_sglang_plugin import ENV_DIR, run_python

SEAM = {"sglang.srt.model_executor.runner_utils.capture_mode", "sglang.srt.model_executor.runner",
        "sglang.srt.models.deepseek_v4", "sglang.srt.models.deepseek_v4_mhc"}
HC_PRE = "DeepseekV4DecoderLayerBase.hc_pre.<locals>.hc_pre_torch_impl (deepseek_v4.py:3357)"
POST = "post.<locals>.post_torch_impl (deepseek_v4_mhc.py:601)"


@pytest.fixture(scope="module", params=["before", "after"])
def seam(request):
    """``before``: sglang's DSv4 modules imported before the plugin loader runs."""
    return run_python(f"{ENV_DIR / 'seam_scenarios.py'}", {"FUSER_ENABLE": "1"}, argv=[request.param])


def test_plugin_loader_rebinds_every_copy_of_the_decorator(seam):
    assert SEAM <= set(seam["bindings"]) and all(seam["bindings"].values()) and seam["same_everywhere"]


def test_torch_compile_is_never_called(seam):
    assert seam["torch_compile_calls"] == []


def test_both_closures_are_fused_at_the_warm_up(seam):
    by_name = {}
    for entry in seam["summary"]:
        by_name.setdefault(entry["name"], []).append(entry)
    (post,) = by_name[POST]
    first_layer = by_name[HC_PRE][0]
    assert first_layer["state"] == "fused" and post["state"] == "fused"
    before, after = first_layer["launches"]
    assert after < before
    assert post["launches"][1] < post["launches"][0]


def test_later_calls_in_the_capture_run_the_fused_forward(seam):
    # hc_pre: the captured call and another batch size; post: the captured call.
    assert seam["fused_runs"] == {"hc_pre_torch_impl": 2, "post_torch_impl": 1}


def test_fused_matches_eager(seam):
    assert {k: v for k, v in seam["errors"].items() if not v <= 1e-5} == {}


def test_a_first_call_inside_a_capture_runs_eager_and_is_logged(seam):
    # The closure over a second layer object is a new key; its first call is in the capture.
    states = [e["state"] for e in seam["summary"] if e["name"] == HC_PRE]
    assert states == ["fused", "waiting"]
    (message,) = [m for m in seam["log"] if "during CUDA-graph capture" in m]
    assert HC_PRE in message and "runs eager" in message
    assert seam["errors"]["hc_pre first call in capture"] == 0.0


def test_seam_off_keeps_sglangs_decorator():
    off = run_python(f"{ENV_DIR / 'seam_scenarios.py'}", {"FUSER_ENABLE": "1", "FUSER_COMPILE_SEAM": "0"},
                     argv=["off"])
    assert not any(off["bindings"].values())
    assert off["torch_compile_calls"] == ["DeepseekV4DecoderLayerBase.hc_pre.<locals>.hc_pre_torch_impl"]
    assert "torch.compile" in off["compile_error"]
