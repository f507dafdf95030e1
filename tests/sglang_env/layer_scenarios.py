"""The plugin on sglang's real DeepSeek-V4 decoder layers, in one fresh process; prints JSON.

Run by tests/test_sglang_layer.py with this folder on PYTHONPATH. sglang's
``DeepseekV4CudaDecoderLayer`` (and the ``DeepseekV4DecoderLayer`` alias, the platform class
off CUDA) is built as sglang ships it: a tiny config, compress ratios 0, 4 and 128, hash and
top-k routing, world size 1 on gloo, inside ``layer_stack``. sglang's torch fallbacks are
selected; the TileLang Sinkhorn, which has no CPU path, is sglang's own torch reference.
"""

from __future__ import annotations

import json
import logging
import sys

import torch
from sglang_cpu import (
    build_dsv4_layers,
    captured_log,
    fail_on_torch_compile,
    init_single_process_dist,
    pretend_capturing,
    sinkhorn_on_cpu,
    use_torch_fallbacks,
)

logging.basicConfig(level=logging.WARNING, stream=sys.stderr)


def main() -> dict:
    out = {}
    use_torch_fallbacks()
    from sglang.srt.plugins import load_plugins

    load_plugins()  # FUSER_ENABLE=1: the compile seam and the initialize hook
    init_single_process_dist()
    sinkhorn_on_cpu()
    from sglang.srt.model_executor.runner_utils import capture_mode
    from sglang.srt.models import deepseek_v4

    from fuser import sglang_plugin, sglang_seam

    compiled = fail_on_torch_compile()
    config, layers = build_dsv4_layers(deepseek_v4.DeepseekV4CudaDecoderLayer)
    _, alias_layers = build_dsv4_layers(deepseek_v4.DeepseekV4DecoderLayer, (0,))
    out["alias_class"] = type(alias_layers[0]).__name__
    out["routing"] = [type(layer.mlp.topk).__name__ for layer in layers]
    out["ratios"] = [layer.self_attn.compress_ratio for layer in layers]
    out["decisions"] = [sglang_plugin.decisions(layer) for layer in layers]
    out["leaf_bases"] = {path: [c.__name__ for c in type(layers[0].get_submodule(path)).__mro__]
                         for path, _, decision in out["decisions"][0] if decision == "leaf"}

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([*layers, *alias_layers])
    with captured_log() as messages:
        splices = sglang_plugin.install(model, sglang_plugin.Options.from_env())
    out["install_log"] = messages
    out["spliced"] = [s.name for s in splices]
    out["wrapped"] = sorted(name for name, m in model.named_modules() if "forward" in m.__dict__)
    out["matches"] = {type(layer).__name__: sglang_plugin.layer_class_matches(type(layer), sglang_plugin.DEFAULT_LAYERS)
                      for layer in model.layers}

    # The one target of the hash layer: sglang's HashTopK, at its first decode call (the
    # layer's forward, which needs sglang's attention backend, cannot run here: the mode is
    # set as the splice sets it).
    from fuser import serving

    (target,) = splices[0].targets
    tokens = 5
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(tokens, config.hidden_size, generator=g).bfloat16()
    logits = torch.randn(tokens, config.n_routed_experts, generator=g)
    ids = torch.randint(0, config.vocab_size, (tokens,), generator=g)
    with torch.no_grad(), captured_log() as messages:
        expected = target.module_forward(hidden, logits, ids)
        serving._MODE.depth = 1
        try:
            got = layers[0].mlp.topk(hidden, logits, ids)
            again = layers[0].mlp.topk(hidden, logits, ids)
        finally:
            serving._MODE.depth = 0
    out["hash_topk"] = {"name": target.name, "state": target.state, "log": messages,
                        "same": all(torch.equal(a, b) for a, b in zip(got[:2], expected[:2]))
                        and all(torch.equal(a, b) for a, b in zip(again[:2], expected[:2])),
                        "forward_left": "forward" in layers[0].mlp.topk.__dict__}

    # sglang's own hc_pre of each real layer, and its post, in capture mode: fused at the
    # warm-up, the fused forward in the (pretended) capture, never torch.compile.
    g = torch.Generator().manual_seed(1)
    results = {}
    with torch.no_grad():
        for i, layer in enumerate(layers):
            x = torch.randn(5, config.hc_mult, config.hidden_size, generator=g).bfloat16()
            args = (layer.hc_attn_fn, layer.hc_attn_scale, layer.hc_attn_base)
            eager = layer.hc_pre(x, *args)
            post_eager = layer.hc_post(eager[0], x, eager[1], eager[2])
            with capture_mode.model_capture_mode():
                warm = layer.hc_pre(x, *args)
                layer.hc_post(eager[0], x, eager[1], eager[2])
                with pretend_capturing():
                    captured = layer.hc_pre(x, *args)
                    post = layer.hc_post(eager[0], x, eager[1], eager[2])
            results[f"layer {i}"] = max(float((a.float() - b.float()).abs().max())
                                        for a, b in [*zip(warm[:3], eager[:3]), *zip(captured[:3], eager[:3]),
                                                     (post, post_eager)])
    out["errors"] = results
    out["seam"] = sglang_seam.seam().summary()
    out["torch_compile_calls"] = compiled
    return out


if __name__ == "__main__":
    print("FUSER-RESULT " + json.dumps(main()))
