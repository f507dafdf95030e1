"""The glue launches of sglang's real DeepSeek-V4 layer's decode call, eager and fused; prints JSON.

Run by tests/serving/test_sglang_layer_launches.py in a fresh process with this folder on
PYTHONPATH. For each routing (hash, top-k) sglang's ``DeepseekV4CudaDecoderLayer`` is built at
compress ratios 0, 4 and 128 (:func:`sglang_cpu.build_dsv4_layers`), its attention the stand-in
leaf of :mod:`layer_scenarios` (sglang's DSv4 attention has no CPU path), the plugin installed.
Each layer's decode call is counted (:mod:`launch_count`) as its own forward runs it (eager),
then spliced in capture mode after the warm-up that fuses (what sglang's CUDA graphs hold), and
spliced outside capture mode (an eager decode step, a batch larger than any captured). The
attention and the routed experts are counted apart, the GEMMs apart from the glue.

Each layer is fused whole (the plugin's default), but in the ``targets`` variant.

``argv[1]``: ``fallbacks`` (sglang's torch fallbacks, :data:`sglang_cpu.TORCH_FALLBACKS`),
``targets`` (the same, with ``FUSER_WHOLE_LAYER=0``: each layer's targets fused one by one),
``no_graphs`` (the same, top-k routing only, without any capture mode: the first decode call
fuses, as in a server run without CUDA graphs), or
``defaults`` (sglang's defaults where they run on the CPU: the fused-op backend left to sglang's
dispatch and the DeepGEMM pre-norm switch unset; the TileLang mHC and the fused hash top-k,
CUDA kernels with no CPU path, off).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys

import torch
from layer_scenarios import AttentionStandIn, compare, run_layer
from launch_count import counting, one_launch
from sglang_cpu import TORCH_FALLBACKS, build_dsv4_layers, captured_log, init_single_process_dist, sinkhorn_on_cpu

from fuser.validate.tolerance import LAYER  # noqa: F401  (compare holds calls to it)

RATIOS = (0, 4, 128)
WARM_UP = 4
#: Token counts of the counted calls: in capture mode (graph sizes), and outside it (larger).
CAPTURED = (4, 1, 3)
EAGER_DECODE = (13, 2)
PORTS = {"fallbacks": 29651, "defaults": 29652, "no_graphs": 29653, "targets": 29654}
DEFAULTS_UNSET = ("SGLANG_FORCE_FUSED_OP_BACKEND", "SGLANG_OPT_DEEPGEMM_HC_PRENORM")


def setup(variant: str) -> None:
    os.environ.update(TORCH_FALLBACKS)
    if variant == "targets":  # the fallbacks, each layer's targets fused one by one
        os.environ["FUSER_WHOLE_LAYER"] = "0"
    if variant == "defaults":
        for name in DEFAULTS_UNSET:
            os.environ.pop(name)
    from sglang.srt.plugins import load_plugins

    load_plugins()
    init_single_process_dist(PORTS[variant])  # its own port: the two variants may run side by side
    sinkhorn_on_cpu()
    import sglang.kernels.ops.layernorm.mhc as kernels

    # sglang's TileLang Sinkhorn, its torch reference here (sinkhorn_on_cpu): one launch, as
    # the custom op it calls is in a fused graph.
    kernels.hc_split_sinkhorn = one_launch(kernels.hc_split_sinkhorn, "hc_split_sinkhorn")


class ClosureCalls:
    """The compile seam's closure calls by name (the seam sees them in capture mode only)."""

    def __init__(self, seam):
        self.counts: dict[str, int] = {}
        self.seam, call = seam, seam.call

        def counted(function, args, kwargs):
            self.counts[function.__qualname__] = self.counts.get(function.__qualname__, 0) + 1
            return call(function, args, kwargs)

        seam.call = counted

    def remove(self):
        del self.seam.call


def one_call(forward, streams, apart, sections):
    """One decode call of a layer as ``DeepseekV4Model`` makes it, counted: the batch, the
    positions and the start of the layer stack (once per model step, not per layer) are made
    before the count starts."""
    from sglang.srt.layers.layer_boundary.residual import batch as residual_batch

    batch = decode_batch_for(streams)
    residual_batch.start(batch)
    positions = torch.arange(streams.shape[0])
    with torch.no_grad(), counting(apart, sections) as launches:
        out = forward(positions=positions, hidden_states=streams, input_ids=batch.input_ids,
                      forward_batch=batch, input_ids_global=batch.input_ids)
    return out, launches.summary()


def decode_batch_for(streams):
    from sglang_cpu import decode_batch

    return decode_batch(streams.shape[0])


def routing(num_hash_layers: int, no_graphs: bool = False) -> list[dict]:
    import fuser
    from sglang.srt.models import deepseek_v4
    from sglang.srt.model_executor.runner_utils import capture_mode

    from fuser.serving.engines import sglang as sglang_plugin
    from fuser.serving.engines import sglang_seam

    config, layers = build_dsv4_layers(deepseek_v4.DeepseekV4CudaDecoderLayer, RATIOS, num_hash_layers)
    fuser.opaque(AttentionStandIn)
    for layer in layers:
        layer.self_attn = AttentionStandIn(layer.self_attn, config.hidden_size)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(layers)
    with captured_log() as log:
        splices = sglang_plugin.install(model, sglang_plugin.Options.from_env())
    g = torch.Generator().manual_seed(17)
    results = []
    for layer, splice in zip(layers, splices):
        streams = {t: torch.randn(t, config.hc_mult, config.hidden_size, generator=g).bfloat16()
                   for t in {WARM_UP, *CAPTURED, *EAGER_DECODE}}
        apart = {"attention": [layer.self_attn], "experts": [layer.mlp.experts]}
        targets = {t.name.rsplit(".", 1)[-1] if "." in t.name else t.name: t for t in splice.targets}
        sections = {path: layer.get_submodule(path) for path in ("mlp", "input_layernorm", "post_attention_layernorm")}
        own = functools.partial(type(layer).forward, layer)
        result = {"name": splice.name, "ratio": layer.self_attn.compress_ratio, "routing": type(layer.mlp.topk).__name__,
                  "eager": {}, "captured": {}, "eager_decode": {}, "errors": {}}
        for t in sorted(streams):
            eager, result["eager"][t] = one_call(own, streams[t], apart, sections)
            streams[t] = (streams[t], eager)
        # sglang's warm-up (capture mode): it fuses. Without CUDA graphs the first decode step does.
        warm_up = contextlib.nullcontext() if no_graphs else capture_mode.model_capture_mode()
        with torch.no_grad(), warm_up, captured_log() as fused_log:
            run_layer(layer, layer, streams[WARM_UP][0], decode_batch_for(streams[WARM_UP][0]))
        result["log"] = fused_log
        result["whole"] = splice.whole.state if splice.whole is not None else None
        if splice.whole is not None and splice.whole.report is not None:
            result["whole_report"] = [splice.whole.report.launches_before, splice.whole.report.launches_after]
        result["states"] = {name: t.state for name, t in targets.items()}
        result["reports"] = {name: [t.report.launches_before, t.report.launches_after]
                             for name, t in targets.items() if t.report is not None}
        closures = ClosureCalls(sglang_seam.seam())
        try:
            for t in () if no_graphs else CAPTURED:
                with capture_mode.model_capture_mode():
                    fused, result["captured"][t] = one_call(layer, streams[t][0], apart, sections)
                result["errors"][f"captured T={t}"] = compare(fused, streams[t][1], None)
            result["closure_calls"] = dict(closures.counts)
            closures.counts.clear()
            for t in EAGER_DECODE:
                fused, result["eager_decode"][t] = one_call(layer, streams[t][0], apart, sections)
                result["errors"][f"eager decode T={t}"] = compare(fused, streams[t][1], None)
            result["closure_calls_eager_decode"] = dict(closures.counts)
        finally:
            closures.remove()
        results.append(result)
    result_seam = {e["name"].split(" ")[0].rsplit(".", 1)[-1]: e for e in sglang_seam.seam().summary()}
    for result in results:
        result["seam"] = {name: e["launches"] for name, e in result_seam.items() if e["state"] == "fused"}
    for splice in splices:
        splice.remove()
    return results


def main(variant: str) -> dict:
    setup(variant)
    with captured_log() as log:
        if variant == "no_graphs":  # sglang without CUDA graphs: every decode step eager
            out = {"variant": variant, "topk": routing(0, no_graphs=True)}
        else:
            out = {"variant": variant, "hash": routing(len(RATIOS)), "topk": routing(0)}
    out["log"] = log
    return out


if __name__ == "__main__":
    print("FUSER-RESULT " + json.dumps(main(sys.argv[1]), default=str))
