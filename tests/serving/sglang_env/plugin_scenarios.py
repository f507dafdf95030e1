"""The fuser plugin inside the real sglang package, in one fresh process; prints JSON.

Run by tests/serving/test_sglang_plugin.py with this folder on PYTHONPATH (its sitecustomize makes
sglang importable without torchvision). sglang cannot build or run a model without a GPU
stack, so ``ModelRunner.initialize`` is replaced by a stand-in that only sets ``runner.model``
*before* sglang's plugin loader applies the hooks: what runs is sglang's own plugin discovery,
HookRegistry wrapping and AFTER-hook call, with fuser's hook inside. The decoder layer is a
stand-in with the signature of sglang's DeepseekV4 layer, holding the DSv4 example layer.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn

from examples.dsv4.layer import tiny
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.model_runner import ModelRunner

import fuser
from fuser.serving.engines import sglang as sglang_plugin
from fuser.install.splice import STATE_ATTR
from fuser.validate.tolerance import LAYER, mismatch
from sglang_cpu import captured_log

logging.basicConfig(level=logging.WARNING, stream=sys.stderr)


class StandInDecoderLayer(nn.Module):
    """sglang's DeepseekV4 layer signature; the DSv4 example layer does the work."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, positions, hidden_states, input_ids, forward_batch, input_ids_global, *,
                allow_cross_layer_fusion=True):
        return self.inner(hidden_states, positions, forward_batch.req_pool_indices, input_ids)


class Untraceable(nn.Module):
    def forward(self, x):
        return x * float(x.abs().max().item())  # a host sync: the tracer refuses it


class StandInModel(nn.Module):
    def __init__(self, *layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, positions, hidden_states, input_ids, forward_batch):
        for layer in self.layers:
            hidden_states = layer(positions=positions, hidden_states=hidden_states, input_ids=input_ids,
                                  forward_batch=forward_batch, input_ids_global=input_ids)
        return hidden_states


class StandInOtherLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.odd = Untraceable()

    def forward(self, positions, hidden_states, input_ids, forward_batch, input_ids_global):
        return hidden_states + 0 * self.odd(hidden_states.float()).to(hidden_states.dtype)


BUILD = {}


def stand_in_initialize(self):
    """What sglang's initialize does that matters here: the model exists afterwards."""
    self.model = BUILD["model"]()


def new_runner(model_factory, draft=False, torch_compile=False, weight_load="serial"):
    BUILD["model"] = model_factory
    runner = ModelRunner.__new__(ModelRunner)
    runner.is_draft_worker = draft
    runner.server_args = SimpleNamespace(enable_torch_compile=torch_compile, startup_weight_load_mode=weight_load)
    runner.capture_tail_hooks = []
    ModelRunner.initialize(runner)  # sglang's hook wrapper around the stand-in
    return runner


def dsv4_model():
    layer, inputs = tiny(T=5, seed=1)
    return StandInModel(StandInDecoderLayer(layer))


def batch(mode, inputs):
    hidden_states, positions, req_pool_indices, input_ids = inputs
    return SimpleNamespace(forward_mode=mode, req_pool_indices=req_pool_indices)


def call(model, mode, inputs):
    hidden_states, positions, _, input_ids = inputs
    with torch.no_grad():
        return model(positions, hidden_states.clone(), input_ids, batch(mode, inputs))


def fused_calls(module) -> list[int]:
    """Count, from now on, the calls that fuser's guard sends down the fused forward."""
    guard = module.__dict__[STATE_ATTR].guard
    counter, check = [0], guard.check

    def counting(args, kwargs):
        traced_args, why_not = check(args, kwargs)
        counter[0] += traced_args is not None
        return traced_args, why_not

    guard.check = counting
    return counter


def main() -> dict:
    out = {}
    os.environ["FUSER_LAYERS"] = "StandInDecoderLayer,StandInOtherLayer"
    # The splice's targets, each on its own (a layer fused whole: test_sglang_layer_whole.py).
    os.environ["FUSER_WHOLE_LAYER"] = "0"
    # sglang's plugin loader: entry-point discovery, then HookRegistry.apply_hooks().
    ModelRunner.initialize = stand_in_initialize
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.plugins.hook_registry import HookRegistry

    out["hook_registered"] = any(hook is sglang_plugin.after_initialize
                                 for _, hook, _ in HookRegistry._hooks[sglang_plugin.INITIALIZE])
    out["initialize_wrapped"] = hasattr(ModelRunner.initialize, "__wrapped__")

    out["draft_untouched"] = not any(
        sglang_plugin.SPLICE_ATTR in m.__dict__ for m in new_runner(dsv4_model, draft=True).model.modules())
    out["torch_compile_untouched"] = not any(
        sglang_plugin.SPLICE_ATTR in m.__dict__ for m in new_runner(dsv4_model, torch_compile=True).model.modules())

    runner = new_runner(dsv4_model)
    model = runner.model
    layer, inner = model.layers[0], model.layers[0].inner
    out["layer_spliced"] = sglang_plugin.SPLICE_ATTR in layer.__dict__
    out["signature_kept"] = str(inspect.signature(layer.forward)) == str(
        inspect.signature(StandInDecoderLayer.forward.__get__(layer)))
    out["wrapped_name"] = layer.forward.__name__

    _, inputs = tiny(T=5, seed=2)
    others = [mode for mode in ForwardMode if mode != ForwardMode.DECODE]
    eager = {mode.name: call(model, mode, inputs) for mode in others}  # the original forward
    out["fused_after_non_decode"] = fuser.is_fused(inner)

    decoded = call(model, ForwardMode.DECODE, inputs)  # first decode call: fuse, then run fused
    out["fused_after_decode"] = fuser.is_fused(inner)
    eager["DECODE"] = eager["EXTEND"]  # the same math, run by the original forward
    counter = fused_calls(inner)
    runs = {"first DECODE": {"fused": None, "mismatch": mismatch(decoded, eager["DECODE"], "DECODE", LAYER)}}
    for mode in ForwardMode:
        before = counter[0]
        result = call(model, mode, inputs)
        runs[mode.name] = {"fused": counter[0] > before,
                           "mismatch": mismatch(result, eager[mode.name], mode.name, LAYER)}
    out["runs"] = runs
    _, other = tiny(T=3, seed=3)  # another batch size: the same fused forward
    other_eager = call(model, ForwardMode.EXTEND, other)
    before = counter[0]
    out["other_batch_mismatch"] = mismatch(call(model, ForwardMode.DECODE, other), other_eager, "T=3", LAYER)
    out["other_batch_fused"] = counter[0] > before
    out["derived_weight_cache_error"] = getattr(model, sglang_plugin.DERIVED_CACHE_ATTR, None)

    sglang_plugin.uninstall(model)
    out["uninstalled"] = ("forward" not in layer.__dict__ and "forward" not in inner.__dict__
                          and not fuser.is_fused(inner))

    # A module fuser cannot trace stays eager (and says why), or raises with FUSER_STRICT=1.
    runner = new_runner(lambda: StandInModel(StandInOtherLayer()))
    x = torch.randn(4, 8)
    with torch.no_grad():
        y = runner.model(None, x, None, SimpleNamespace(forward_mode=ForwardMode.DECODE))
    targets = runner.model.layers[0].__dict__[sglang_plugin.SPLICE_ATTR].targets
    out["untraceable_targets"] = {t.name: t.state for t in targets}
    out["untraceable_output_ok"] = bool(torch.equal(y, x))
    os.environ["FUSER_STRICT"] = "1"
    runner = new_runner(lambda: StandInModel(StandInOtherLayer()))
    try:
        runner.model(None, x, None, SimpleNamespace(forward_mode=ForwardMode.DECODE))
        out["strict_error"] = None
    except fuser.FuserError as e:
        out["strict_error"] = str(e)
    del os.environ["FUSER_STRICT"]

    # Overlap startup: the real weights are copied in after capture, so nothing is precomputed
    # from them and the fused forward reads them live.
    runner = new_runner(dsv4_model, weight_load="overlap")
    call(runner.model, ForwardMode.DECODE, inputs)
    inner = runner.model.layers[0].inner
    out["overlap_constants"] = list(inner.__dict__[STATE_ATTR].constants)
    out["overlap_declared"] = hasattr(runner.model, sglang_plugin.DERIVED_CACHE_ATTR)
    with torch.no_grad():
        gate = inner.mlp.gate.weight
        gate.copy_(torch.randn(gate.shape, generator=torch.Generator().manual_seed(9)) * gate.float().std())
    fresh = call(runner.model, ForwardMode.EXTEND, inputs)
    out["overlap_new_weights_mismatch"] = mismatch(call(runner.model, ForwardMode.DECODE, inputs), fresh,
                                                   "after a weight copy", LAYER)

    # The first decode call during a CUDA-graph capture runs eager (logged) instead of
    # tracing there; FUSER_STRICT=1 raises; a later call outside the capture fuses.
    runner = new_runner(dsv4_model)
    inner = runner.model.layers[0].inner
    real_available, real_capturing = torch.cuda.is_available, torch.cuda.is_current_stream_capturing
    torch.cuda.is_available = lambda: True
    torch.cuda.is_current_stream_capturing = lambda: True
    with captured_log() as messages:
        during = call(runner.model, ForwardMode.DECODE, inputs)
    out["capture_log"] = messages
    out["capture_fused"] = fuser.is_fused(inner)
    out["capture_mismatch"] = mismatch(during, call(runner.model, ForwardMode.EXTEND, inputs), "in capture", LAYER)
    os.environ["FUSER_STRICT"] = "1"
    strict_runner = new_runner(dsv4_model)
    try:
        call(strict_runner.model, ForwardMode.DECODE, inputs)
        out["capture_strict_error"] = None
    except fuser.FuserError as e:
        out["capture_strict_error"] = str(e)
    del os.environ["FUSER_STRICT"]
    torch.cuda.is_available, torch.cuda.is_current_stream_capturing = real_available, real_capturing
    call(runner.model, ForwardMode.DECODE, inputs)
    out["fused_after_capture"] = fuser.is_fused(inner)
    return out


if __name__ == "__main__":
    print("FUSER-RESULT " + json.dumps(main()))
