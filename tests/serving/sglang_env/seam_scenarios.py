"""fuser's compile seam inside the real sglang package, in one fresh process; prints JSON.

Run by tests/serving/test_sglang_seam.py with this folder on PYTHONPATH. sglang's own plugin loader
(``load_plugins``: entry-point discovery, then ``HookRegistry.apply_hooks``) installs fuser's
``compile_in_capture_mode``; then sglang's own ``DeepseekV4CudaDecoderLayer.hc_pre`` and
``deepseek_v4_mhc.post`` run on the CPU with sglang's torch fallbacks, under sglang's
``model_capture_mode()``, with ``torch.compile`` replaced by a function that raises.

``python seam_scenarios.py before|after``: import sglang's DSv4 modules before the plugin
loader runs (the stale ``from ... import`` copies must be rebound) or after it;
``off``: with ``FUSER_COMPILE_SEAM=0`` (sglang's decorator stays, and compiles).
"""

from __future__ import annotations

import json
import logging
import sys

import torch
from sglang_cpu import (
    TorchCompileCalled,
    captured_log,
    fail_on_torch_compile,
    init_single_process_dist,
    pretend_capturing,
    sinkhorn_on_cpu,
    use_torch_fallbacks,
)

logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
HIDDEN, MULT = 64, 4


def import_dsv4():
    from sglang.srt.models import deepseek_v4, deepseek_v4_mhc

    return deepseek_v4, deepseek_v4_mhc


def mhc_weights(seed: int):
    g = torch.Generator().manual_seed(seed)
    mix = (2 + MULT) * MULT
    return (torch.nn.Parameter(torch.randn(mix, MULT * HIDDEN, generator=g) * 0.05),
            torch.nn.Parameter(torch.rand(3, generator=g)),
            torch.nn.Parameter(torch.randn(mix, generator=g) * 0.1))


def residual(tokens: int, seed: int) -> torch.Tensor:
    return torch.randn(tokens, MULT, HIDDEN, generator=torch.Generator().manual_seed(seed)).bfloat16()


def max_error(got, expected) -> float:
    pairs = [(g, e) for g, e in zip(got, expected) if isinstance(g, torch.Tensor)]
    assert len(pairs) == len([e for e in expected if isinstance(e, torch.Tensor)])
    return max(float((g.float() - e.float()).abs().max()) for g, e in pairs)


def fused_runs(entry) -> list[int]:
    """Count, from now on, the calls of a seam entry that run the fused graph."""
    from fuser.install.splice import STATE_ATTR

    state = entry.module.__dict__[STATE_ATTR]
    counter, fused = [0], state.fused

    def counting(*args, **kwargs):
        counter[0] += 1
        return fused(*args, **kwargs)

    state.fused = counting
    return counter


def main(order: str) -> dict:
    out = {}
    use_torch_fallbacks()
    if order == "before":
        import_dsv4()
    from sglang.srt.plugins import load_plugins

    load_plugins()
    deepseek_v4, mhc = import_dsv4()
    from sglang.srt.model_executor import runner
    from sglang.srt.model_executor.runner_utils import capture_mode

    from fuser.serving.engines import sglang_seam

    out["bindings"] = sglang_seam.bindings()
    out["same_everywhere"] = (deepseek_v4.compile_in_capture_mode is capture_mode.compile_in_capture_mode
                              is mhc.compile_in_capture_mode is runner.compile_in_capture_mode)
    compiled = fail_on_torch_compile()
    init_single_process_dist()
    sinkhorn_on_cpu()

    layer_cls = deepseek_v4.DeepseekV4CudaDecoderLayer
    hc_fn, hc_scale, hc_base = mhc_weights(0)
    config = dict(rms_norm_eps=1e-6, hc_mult=MULT, hc_sinkhorn_iters=20, hc_eps=1e-6)
    layer = type("HcState", (), config)()  # the attributes hc_pre reads of its layer
    cfg = mhc.HcConfig(mult=MULT, sinkhorn_iters=20, eps=1e-6, rms_eps=1e-6, hidden=HIDDEN,
                       pre_from_prev=False, cp_prefill=False)

    def pre(x, on=layer):
        return layer_cls.hc_pre(on, x, hc_fn, hc_scale, hc_base)

    def post(x, res, post_mix, comb):
        return (mhc.post(cfg, x, res, post_mix, comb),)

    if order == "off":  # FUSER_COMPILE_SEAM=0: sglang's own decorator, which compiles
        with torch.no_grad(), capture_mode.model_capture_mode():
            try:
                pre(residual(5, 1))
            except TorchCompileCalled as e:
                out["compile_error"] = str(e)
        out["torch_compile_calls"] = compiled
        return out

    with torch.no_grad():
        warm, captured, other = residual(5, 1), residual(5, 2), residual(3, 3)
        eager = {name: pre(x) for name, x in (("warm", warm), ("captured", captured), ("other", other))}
        y, post_mix, comb = eager["warm"][0], eager["warm"][1], eager["warm"][2]
        post_eager = post(y, warm, post_mix, comb)
        with captured_log() as messages, capture_mode.model_capture_mode():
            warm_fused = pre(warm)  # sglang's warm-up: capture mode on, stream not capturing
            post_warm = post(y, warm, post_mix, comb)
            seam = sglang_seam.seam()
            entries = {e.function.__name__: e for e in seam.entries.values()}
            counters = {name: fused_runs(e) for name, e in entries.items() if e.state == "fused"}
            with pretend_capturing():
                captured_fused = pre(captured)  # the capture: the fused forward again
                post_captured = post(y, warm, post_mix, comb)
                other_fused = pre(other)  # another batch size
                stranger = type("HcState", (), config)()  # a closure over another layer
                first_in_capture = pre(warm, on=stranger)
        out["log"] = messages
    out["summary"] = seam.summary()
    out["fused_runs"] = {name: c[0] for name, c in counters.items()}
    out["errors"] = {
        "hc_pre warm-up": max_error(warm_fused, eager["warm"]),
        "hc_pre in capture": max_error(captured_fused, eager["captured"]),
        "hc_pre other batch": max_error(other_fused, eager["other"]),
        "hc_pre first call in capture": max_error(first_in_capture, eager["warm"]),
        "post warm-up": max_error(post_warm, post_eager),
        "post in capture": max_error(post_captured, post_eager),
    }
    out["torch_compile_calls"] = compiled
    return out


if __name__ == "__main__":
    print("FUSER-RESULT " + json.dumps(main(sys.argv[1])))
