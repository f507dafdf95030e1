"""The sglang plugin against the real sglang 0.5.23 package (imported on the CPU).

Each scenario runs in a fresh Python process, as sglang's scheduler processes do: the plugin is
found through the ``sglang.srt.plugins`` entry point and applied by sglang's own plugin loader
and HookRegistry. ``tests/serving/sglang_env`` goes on PYTHONPATH for a torchvision stand-in (sglang
imports torchvision; its wheels need CUDA torch).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

from helpers import ROOT

ENV_DIR = ROOT / "tests" / "serving" / "sglang_env"


def run_python(code_or_file, env_extra: dict, argv: list[str] = ()) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FUSER_")}
    env.update(env_extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ENV_DIR), str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_INTERPRET", "1")
    args = [sys.executable, str(code_or_file)] if str(code_or_file).endswith(".py") else [
        sys.executable, "-c", code_or_file]
    args += list(argv)
    proc = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("FUSER-RESULT ")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1].split(" ", 1)[1])


def test_entry_point_names_the_register_function():
    (ep,) = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "fuser"]
    from fuser.serving.engines.sglang import register

    assert ep.value == "fuser.serving.engines.sglang:register" and ep.load() is register


REAL_RUNNER = textwrap.dedent(
    """
    import inspect, json, os
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.models import deepseek_v4
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry
    from fuser.serving.engines import sglang as sglang_plugin

    out = {"signature_before": str(inspect.signature(ModelRunner.initialize))}
    load_plugins()  # FUSER_ENABLE unset: fuser's entry point runs and registers nothing
    out["hooked_when_disabled"] = bool(HookRegistry._hooks.get(sglang_plugin.INITIALIZE))
    os.environ["FUSER_ENABLE"] = "1"
    sglang_plugin.register()
    HookRegistry.apply_hooks()
    out["hooked_when_enabled"] = any(h is sglang_plugin.after_initialize
                                     for _, h, _ in HookRegistry._hooks[sglang_plugin.INITIALIZE])
    out["wrapped"] = hasattr(ModelRunner.initialize, "__wrapped__")
    out["signature_after"] = str(inspect.signature(ModelRunner.initialize))
    out["layers"] = {name: "forward_batch" in inspect.signature(getattr(deepseek_v4, name).forward).parameters
                     for name in sglang_plugin.DEFAULT_LAYERS}
    print("FUSER-RESULT " + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def real_runner():
    return run_python(REAL_RUNNER, {})


def test_disabled_by_default(real_runner):
    assert real_runner["hooked_when_disabled"] is False


def test_enabled_hook_wraps_initialize_and_keeps_its_signature(real_runner):
    assert real_runner["hooked_when_enabled"] and real_runner["wrapped"]
    assert real_runner["signature_after"] == real_runner["signature_before"] == "(self)"


def test_default_layers_are_sglangs_deepseek_v4_classes(real_runner):
    # Both names exist in sglang.srt.models.deepseek_v4 and take the forward_batch the guard reads.
    assert real_runner["layers"] == {"DeepseekV4CudaDecoderLayer": True, "DeepseekV4DecoderLayer": True}


@pytest.fixture(scope="module")
def scenarios():
    return run_python(ENV_DIR / "plugin_scenarios.py", {"FUSER_ENABLE": "1"})


def test_sglang_loader_runs_the_hook(scenarios):
    assert scenarios["hook_registered"] and scenarios["initialize_wrapped"]
    assert scenarios["layer_spliced"]


def test_draft_workers_and_torch_compile_are_skipped(scenarios):
    assert scenarios["draft_untouched"] and scenarios["torch_compile_untouched"]


def test_spliced_layer_keeps_its_signature(scenarios):
    assert scenarios["signature_kept"] and scenarios["wrapped_name"] == "forward"


def test_fused_at_first_decode_call_only(scenarios):
    assert scenarios["fused_after_non_decode"] is False
    assert scenarios["fused_after_decode"] is True


def test_only_decode_mode_takes_the_fused_path(scenarios):
    runs = scenarios["runs"]
    assert {mode for mode, run in runs.items() if run["fused"]} == {"DECODE"}
    assert {"EXTEND", "MIXED", "IDLE", "TARGET_VERIFY"} <= {m for m, r in runs.items() if r["fused"] is False}
    assert {mode: run["mismatch"] for mode, run in runs.items() if run["mismatch"]} == {}


def test_other_batch_sizes_reuse_the_fused_forward(scenarios):
    assert scenarios["other_batch_fused"] and scenarios["other_batch_mismatch"] is None


def test_weight_derived_values_are_declared_to_sglang(scenarios):
    assert "_fuser_const_0" in scenarios["derived_weight_cache_error"]


def test_overlap_startup_reads_live_weights(scenarios):
    # --startup-weight-load-mode overlap copies the real weights in after capture.
    assert scenarios["overlap_constants"] == [] and scenarios["overlap_declared"] is False
    assert scenarios["overlap_new_weights_mismatch"] is None


def test_uninstall_restores_every_forward(scenarios):
    assert scenarios["uninstalled"]


def test_untraceable_module_stays_eager_or_raises_when_strict(scenarios):
    assert scenarios["untraceable_targets"] == {"layers.0.odd": "eager"}
    assert scenarios["untraceable_output_ok"]
    assert "layers.0.odd cannot be fused" in scenarios["strict_error"]
    assert "plugin_scenarios.py:" in scenarios["strict_error"] and ".item()" in scenarios["strict_error"]


def test_first_decode_call_during_capture_runs_eager_and_is_logged(scenarios):
    assert scenarios["capture_fused"] is False and scenarios["capture_mismatch"] is None
    (message,) = [m for m in scenarios["capture_log"] if "during CUDA-graph capture" in m]
    assert "layers.0.inner" in message and "runs eager" in message


def test_first_decode_call_during_capture_raises_when_strict(scenarios):
    assert "layers.0.inner" in scenarios["capture_strict_error"]
    assert "during CUDA-graph capture" in scenarios["capture_strict_error"]


def test_a_call_after_the_capture_fuses(scenarios):
    assert scenarios["fused_after_capture"] is True


def test_options_from_env():
    from fuser.serving.engines.sglang import DEFAULT_LAYERS, Options

    assert Options.from_env({}) == Options()
    assert Options.from_env({}).layers == DEFAULT_LAYERS
    opts = Options.from_env({"FUSER_ENABLE": "1", "FUSER_LAYERS": "A, B", "FUSER_LEAVES": "x",
                             "FUSER_PATTERNS": os.pathsep.join(["p.py", "q.py"]), "FUSER_STRICT": "yes"})
    assert opts.enable and opts.strict and not opts.draft
    assert opts.layers == ("A", "B") and opts.leaves == ("x",) and opts.patterns == ("p.py", "q.py")
    assert opts.apply_options() == {"patterns": ["p.py", "q.py"], "leaves": ["x"]}
    assert Options.from_env({"FUSER_PRECOMPUTE": "0"}).apply_options() == {"precompute": False}
    assert opts.compile_seam and not Options.from_env({"FUSER_COMPILE_SEAM": "0"}).compile_seam
    assert Options.from_env({"FUSER_EXPLAIN": "1"}).explain and not opts.explain


def test_a_bad_flag_value_is_an_error_naming_the_variable():
    from fuser.serving.engines.sglang import Options

    with pytest.raises(ValueError, match="FUSER_STRICT='maybe'"):
        Options.from_env({"FUSER_STRICT": "maybe"})
