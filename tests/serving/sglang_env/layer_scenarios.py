"""The plugin on sglang's real DeepSeek-V4 decoder layers, in one fresh process; prints JSON.

Run by tests/serving/test_sglang_layer.py with this folder on PYTHONPATH. sglang's
``DeepseekV4CudaDecoderLayer`` (and the ``DeepseekV4DecoderLayer`` alias, the platform class
off CUDA) is built as sglang ships it: a tiny config, compress ratios 0, 4 and 128, hash and
top-k routing, world size 1 on gloo, inside ``layer_stack``. sglang's torch fallbacks are
selected with its own switches (:data:`sglang_cpu.TORCH_FALLBACKS`); the TileLang Sinkhorn,
which has no CPU path, is sglang's own torch reference.

The layer's forward cannot run here as sglang ships it: its attention (``MQALayer`` through the DSv4 attention
backend, its compressor and indexer) has no CPU path, and sglang ships no torch reference of
it. So each selected target that runs on the CPU (the MoE block, the two layer norms) is called
as the layer calls it, with sglang's own ``ForwardBatch``, inside the decode mode exactly as the
layer's splice sets it for a ``forward_mode.is_decode()`` call; outside it, as the splice leaves
any other call. The layer's own forward is run too, with its attention replaced by a stand-in
leaf (:class:`AttentionStandIn`), under the splice.
"""

from __future__ import annotations

import contextlib
import functools
import json
from dataclasses import replace
import logging
import sys
from pathlib import Path

import torch
from sglang_cpu import (
    build_dsv4_layers,
    captured_log,
    decode_batch,
    fail_on_torch_compile,
    init_single_process_dist,
    pretend_capturing,
    sinkhorn_on_cpu,
    use_torch_fallbacks,
)

from fuser.validate.tolerance import LAYER, mismatch, near_tie_rows, rows_besides_ties

sys.path.append(str(Path(__file__).resolve().parents[1]))  # tests/: the serving test helpers
from serving_helpers import FusedGraphRuns, decode_mode  # noqa: E402

logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

#: The targets called here: those whose code runs on the CPU (the attention's do not).
CALLED = ("mlp", "input_layernorm", "post_attention_layernorm")
#: Token counts of the decode calls, the first one (sglang's warm-up) fusing.
TOKENS = (4, 1, 13)
GEMM_OPS = ("linear", "mm", "matmul", "bmm", "addmm", "einsum")


def setup() -> None:
    """sglang's torch fallbacks, its plugin loader (FUSER_ENABLE=1: the compile seam and the
    initialize hook), world size 1, and the Sinkhorn's torch reference."""
    use_torch_fallbacks()
    from sglang.srt.plugins import load_plugins

    load_plugins()
    init_single_process_dist()
    sinkhorn_on_cpu()


def main() -> dict:
    out = {}
    setup()
    from sglang.srt.models import deepseek_v4

    from fuser.serving.engines import sglang as sglang_plugin

    from fuser.serving.engines import sglang_seam
    from fuser.serving.targets import leaf_paths

    compiled = fail_on_torch_compile()
    config, layers = build_dsv4_layers(deepseek_v4.DeepseekV4CudaDecoderLayer)
    _, alias_layers = build_dsv4_layers(deepseek_v4.DeepseekV4DecoderLayer, (0,))
    out["alias_class"] = type(alias_layers[0]).__name__
    out["routing"] = [type(layer.mlp.topk).__name__ for layer in layers]
    out["ratios"] = [layer.self_attn.compress_ratio for layer in layers]
    out["decisions"] = [sglang_plugin.decisions(layer) for layer in layers]
    out["leaf_bases"] = {path: [c.__name__ for c in type(layers[1].get_submodule(path)).__mro__]
                         for path, _, decision in out["decisions"][1] if decision == "leaf"}
    out["kernel_backend_leaves"] = fused_ops_with_a_kernel_backend(layers[1])
    # What the MoE block's trace keeps opaque (it is a target: its children get no decision).
    out["moe_leaves"] = {path: type(layers[1].mlp.get_submodule(path)).__name__
                         for path in leaf_paths(layers[1].mlp, sglang_plugin.is_leaf)}

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([*layers, *alias_layers])
    with captured_log() as messages:
        splices = sglang_plugin.install(model, sglang_plugin.Options.from_env())
    out["install_log"] = messages
    out["spliced"] = [s.name for s in splices]
    out["targets"] = {s.name: [t.name for t in s.targets] for s in splices}
    out["matches"] = {type(layer).__name__: sglang_plugin.layer_class_matches(type(layer), sglang_plugin.DEFAULT_LAYERS)
                      for layer in model.layers}

    out["calls"] = {}
    for i, layer in enumerate(layers):
        targets = {t.name.split(".", 2)[2]: t for t in splices[i].targets}
        for path in CALLED:
            out["calls"][f"layers.{i}.{path}"] = drive(layer, path, targets[path], config)
    out["derived_weight_cache_error"] = getattr(model, sglang_plugin.DERIVED_CACHE_ATTR, None)
    out["fused_op_backend_changed"] = backend_changed_runs_eager(layers[1], splices[1], config)
    out["capture_mode_read"] = capture_mode_read_is_guarded(deepseek_v4.DeepseekV4CudaDecoderLayer, config)
    out["seam"] = mhc_through_the_seam(layers, config)
    out["seam_summary"] = sglang_seam.seam().summary()
    out["layer_forward"] = spliced_layer_forward(deepseek_v4.DeepseekV4CudaDecoderLayer, config)
    # The closures the layer forwards' capture-mode calls met (one entry per layer and closure).
    out["layer_forward"]["seam"] = sglang_seam.seam().summary()[len(out["seam_summary"]):]
    out["torch_compile_calls"] = compiled
    return out


def explain() -> dict:
    """What the plugin logs with FUSER_EXPLAIN=1: its decisions when it splices the real layers
    (compress ratios 0, 4 and 128, and the alias class), then each target's and each compile
    seam closure's whole report as the layer forward (attention a stand-in) fuses them."""
    setup()
    from sglang.srt.models import deepseek_v4

    from fuser.serving.engines import sglang as sglang_plugin

    _, layers = build_dsv4_layers(deepseek_v4.DeepseekV4CudaDecoderLayer)
    config, alias_layers = build_dsv4_layers(deepseek_v4.DeepseekV4DecoderLayer, (0,))
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([*layers, *alias_layers])
    with captured_log() as messages:
        sglang_plugin.install(model, sglang_plugin.Options.from_env())
    return {"install_log": messages, "layer_forward": spliced_layer_forward(deepseek_v4.DeepseekV4CudaDecoderLayer, config)}


# ------------------------------------------------------------------------------------------
# The targets, called as the layer calls them
# ------------------------------------------------------------------------------------------


def batch_as_the_layer_has_it(layer, tokens: int, mode_name: str = "DECODE"):
    """sglang's ``ForwardBatch`` as the layer hands it to its MoE block: the layer stack started
    on it and the layer's attention boundary run (its mHC pre), so that its residual stream
    holds what sglang's boundaries put there (among it a process group, which no deep copy
    can take)."""
    from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
    from sglang.srt.models.deepseek_v4_boundary import LayerCall

    batch = decode_batch(tokens, mode_name)
    residual_batch.start(batch)
    streams = torch.randn(tokens, layer.hc_mult, layer.hidden_size, generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        layer.attn_boundary.prepare(streams.bfloat16(), batch, read_context=LayerCall(batch.input_ids, batch.input_ids))
    return batch


def deep_copyable(batch) -> bool:
    import copy

    try:
        copy.deepcopy(batch)
    except (TypeError, RuntimeError):
        return False
    return True


def call_target(layer, path: str, hidden: torch.Tensor, batch):
    """``layer.<path>`` called as ``DeepseekV4CudaDecoderLayer.forward`` and its boundaries call it."""
    if path == "mlp":
        return layer.mlp(hidden, batch, input_ids=batch.input_ids, input_ids_global=batch.input_ids,
                         skip_shared_experts=False, return_moe_output=False, leave_output_sum=True)
    return layer.get_submodule(path)(hidden)


def tensors_of(result) -> list[torch.Tensor]:
    """The tensors of a target's result (the MoE block returns sglang's ``MoEOutput``)."""
    if isinstance(result, torch.Tensor):
        return [result]
    return [result.routed, result.shared]


def near_ties(layer, hidden: torch.Tensor) -> set[int]:
    """Tokens whose top-k expert choice is a near tie (sglang's ``TopK`` picks on the biased
    sqrt-softplus score): there a last-bit difference picks the other expert, and both are right."""
    if type(layer.mlp.topk).__name__ != "TopK":
        return set()  # hash routing: the ids pick the experts
    logits = torch.nn.functional.linear(hidden, layer.mlp.gate.weight).float()
    score = torch.nn.functional.softplus(logits).sqrt() + layer.mlp.gate.e_score_correction_bias
    return near_tie_rows(score, layer.mlp.topk.topk_config.top_k)


def compare(got, expected, rows) -> float | str:
    """The largest normwise relative error of the tensors, or the mismatch (fuser's layer tolerance)."""
    worst = 0.0
    for i, (a, e) in enumerate(zip(tensors_of(got), tensors_of(expected))):
        if rows is not None:
            a, e = a[rows], e[rows]
        problem = mismatch(a, e, f"output {i}", LAYER)
        if problem:
            return problem
        worst = max(worst, float((a.double() - e.double()).norm() / e.double().norm().clamp_min(1e-30)))
    return worst


def drive(layer, path: str, target, config) -> dict:
    """Decode calls of one target at every token count (the first fuses it), each against the
    module's own forward; then a call in another mode."""
    g = torch.Generator().manual_seed(7)
    result = {"errors": {}, "left_out_rows": {}}
    spy = None
    for tokens in TOKENS:
        hidden = torch.randn(tokens, config.hidden_size, generator=g).bfloat16()
        batch = batch_as_the_layer_has_it(layer, tokens) if path == "mlp" else decode_batch(tokens)
        with torch.no_grad():
            eager = call_target(layer, path, hidden, batch)  # outside the mode: the module's own code
            with decode_mode(), captured_log() as messages:
                fused = call_target(layer, path, hidden, batch)
        if spy is None:
            result["batch_deep_copyable"] = deep_copyable(batch)
            result["log"] = messages
            result["state"] = target.state
            if target.state != "fused":
                return result
            spy = FusedGraphRuns(target)
        rows = rows_besides_ties(near_ties(layer, hidden) if path == "mlp" else set(), tokens)
        result["errors"][tokens] = compare(fused, eager, rows)
        result["left_out_rows"][tokens] = 0 if rows is None else tokens - len(rows)
    result["fused_graph_runs"] = spy.count  # the first call ran before the spy was in place
    report = target.report
    result["launches"] = [report.launches_before, report.launches_after]
    result["chains"] = [{"pattern": c.pattern, "nodes": c.nodes, "launches": c.launches_replaced} for c in report.chains]
    result["gemm_in_a_chain"] = [n for c in report.chains for n in c.nodes if n.rstrip("_0123456789") in GEMM_OPS]
    result["automatic_leaves"] = report.automatic_leaves
    result["precomputed"] = list(report.precomputed)
    result["globals_read"] = {k: repr(v) for k, v in target.globals.read().items()}

    # Another forward_mode: the splice runs the layer outside the mode; the module's own code runs.
    tokens = 3
    hidden = torch.randn(tokens, config.hidden_size, generator=g).bfloat16()
    before = spy.count
    with torch.no_grad():
        other = call_target(layer, path, hidden, decode_batch(tokens, "EXTEND"))
        expected = target.module.__class__.forward(target.module, *split_call(layer, path, hidden, decode_batch(tokens, "EXTEND")))
    result["extend_took_fused_path"] = spy.count != before
    result["extend_same_as_own_code"] = all(torch.equal(a, b) for a, b in zip(tensors_of(other), tensors_of(expected)))
    return result


def split_call(layer, path, hidden, batch) -> tuple:
    """The positional arguments of ``call_target`` for the class's own forward."""
    if path == "mlp":
        return (hidden, batch, None, batch.input_ids, batch.input_ids, False, False, True)
    return (hidden,)


def backend_changed_runs_eager(layer, splice, config) -> dict:
    """sglang's process-wide fused-op backend changed after fusion (``set_fused_op_backend``):
    the targets that ran its torch reference run their own code again."""
    from sglang.kernels.fused_op import KernelBackend, get_fused_op_backend, set_fused_op_backend
    from sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph.context_manager import (
        enable_tc_piecewise_cuda_graph,
    )

    target = next(t for t in splice.targets if t.name.endswith(".mlp"))
    spy = FusedGraphRuns(target)
    hidden = torch.randn(2, config.hidden_size, generator=torch.Generator().manual_seed(3)).bfloat16()
    calls = {}
    with decode_mode(), torch.no_grad():
        call_target(layer, "mlp", hidden, decode_batch(2))
        calls["as fused"] = spy.count
        set_fused_op_backend(None)
        try:
            call_target(layer, "mlp", hidden, decode_batch(2))
            calls["backend unset"] = spy.count
        finally:
            set_fused_op_backend(KernelBackend.TORCH)
        # Inside sglang's piecewise CUDA graph the MoE block's own code takes another path:
        # its experts (FusedMoE.forward, fused_moe_triton/layer.py:1670, a leaf whose read
        # the guard compares too) call ``sglang::moe_forward_piecewise_cuda_graph_impl``,
        # which has no CPU kernel. Its error says that this call ran the module's own code.
        try:
            with enable_tc_piecewise_cuda_graph():
                call_target(layer, "mlp", hidden, decode_batch(2))
            calls["piecewise error"] = None
        except NotImplementedError as e:
            calls["piecewise error"] = str(e).split(" with arguments")[0]
        calls["inside a piecewise graph"] = spy.count
        call_target(layer, "mlp", hidden, decode_batch(2))
        calls["back as fused"] = spy.count
    calls["backend"] = str(get_fused_op_backend())
    return calls


def capture_mode_read_is_guarded(layer_class, config) -> dict:
    """``DeepseekV2MoE.forward`` reads ``get_is_capture_mode()`` (deepseek_v2.py:1100) when its
    MoE has a side stream, which sglang gives it on CUDA only (``alt_streams[0]``,
    deepseek_v4.py:3143). With one given here (an object: the non-capture path never uses it),
    the trace reads the flag; in capture mode the guard sends the call to the module's own code,
    which takes its dual-stream path (``forward_normal_dual_stream``: CUDA streams, so it stops
    on the CPU, which says where it went)."""
    import traceback

    from sglang.srt.model_executor.runner_utils import capture_mode

    from fuser.serving.engines import sglang as sglang_plugin

    _, (_, layer) = build_dsv4_layers(layer_class, (0, 0))  # the second layer routes by top-k
    layer.mlp.alt_stream = object()
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([layer])
    (splice,) = sglang_plugin.install(model, sglang_plugin.Options.from_env())
    target = next(t for t in splice.targets if t.name.endswith(".mlp"))
    hidden = torch.randn(3, config.hidden_size, generator=torch.Generator().manual_seed(5)).bfloat16()
    result = {}
    with decode_mode(), torch.no_grad():
        call_target(layer, "mlp", hidden, decode_batch(3))
        result["state"] = target.state
        result["globals_read"] = {k: repr(v) for k, v in target.globals.read().items()}
        spy = FusedGraphRuns(target)
        call_target(layer, "mlp", hidden, decode_batch(3))
        result["fused_runs"] = spy.count
        try:
            with capture_mode.model_capture_mode():
                call_target(layer, "mlp", hidden, decode_batch(3))
            result["capture_call_ran"] = []
        except Exception as e:  # noqa: BLE001 - where the module's own code went
            result["capture_call_ran"] = [frame.name for frame in traceback.extract_tb(e.__traceback__)]
        result["fused_runs_after_capture_call"] = spy.count
    return result


def fused_ops_with_a_kernel_backend(layer) -> dict:
    """The plugin's decision on sglang's fused ops when their backend is a kernel (forced to
    Triton here: what a CUDA machine's dispatch picks): leaves."""
    from sglang.kernels.fused_op import KernelBackend, set_fused_op_backend

    from fuser.serving.engines import sglang as sglang_plugin

    set_fused_op_backend(KernelBackend.TRITON)
    try:
        decisions = sglang_plugin.decisions(layer)
        fused_ops = {path: decision for path, _, decision in decisions
                     if sglang_plugin.is_fused_op(layer.get_submodule(path))}
        return {"fused_ops": fused_ops, "targets": [path for path, _, d in decisions if d == "target"]}
    finally:
        set_fused_op_backend(KernelBackend.TORCH)


# ------------------------------------------------------------------------------------------
# The layer's own forward, with a stand-in attention
# ------------------------------------------------------------------------------------------


class AttentionStandIn(torch.nn.Module):
    """Takes the place of the layer's ``MQALayer`` on the CPU, where sglang's DSv4 attention
    backend has no path (and sglang has no torch reference of it): an opaque leaf computing a
    function of its input alone, with its own weight. Every attribute the layer and its
    boundaries read off the attention (its TP sizes, ``maybe_use_decode_attn_tp``, ...) is the
    real module's."""

    def __init__(self, real: torch.nn.Module, hidden_size: int):
        super().__init__()
        self.real = real
        generator = torch.Generator().manual_seed(11)
        self.mix = torch.nn.Parameter(torch.randn(hidden_size, hidden_size, generator=generator) * 0.05)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["real"], name)

    def forward(self, x, positions, forward_batch, x_quant=None, defer_all_reduce=False):
        return torch.tanh(x.float() @ self.mix.float()).to(x.dtype)


def run_layer(forward, layer, streams: torch.Tensor, batch) -> torch.Tensor:
    """One call of a decoder layer as ``DeepseekV4Model`` makes it: the layer stack started on
    the batch, then the layer with its keyword arguments."""
    from sglang.srt.layers.layer_boundary.residual import batch as residual_batch

    residual_batch.start(batch)
    positions = torch.arange(streams.shape[0])
    return forward(positions=positions, hidden_states=streams, input_ids=batch.input_ids,
                   forward_batch=batch, input_ids_global=batch.input_ids)


def spliced_layer_forward(layer_class, config) -> dict:
    """sglang's layer forward, spliced target by target (``FUSER_WHOLE_LAYER=0``, what a layer
    that cannot be fused whole falls back to), with the attention a stand-in leaf: decode calls in
    capture mode (sglang's warm-ups: the first fuses the targets it reaches and the compile
    seam's closures) at several token counts against the layer's own forward outside capture
    mode, then a call in another forward_mode."""
    import fuser
    from sglang.srt.model_executor.runner_utils import capture_mode

    from fuser.serving.engines import sglang as sglang_plugin

    _, layers = build_dsv4_layers(layer_class, (0, 4))  # hash routing; top-k with a compressor
    fuser.opaque(AttentionStandIn)
    for layer in layers:
        layer.self_attn = AttentionStandIn(layer.self_attn, config.hidden_size)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(layers)
    with captured_log() as log:  # what the plugin logs (with FUSER_EXPLAIN=1, its explain output)
        splices = sglang_plugin.install(model, replace(sglang_plugin.Options.from_env(), whole_layer=False))
        g = torch.Generator().manual_seed(13)
        out = {"targets": {s.name: [t.name for t in s.targets] for s in splices}, "errors": {}, "log": log}
        spies = {}
        for tokens in TOKENS:
            for layer, splice in zip(layers, splices):
                streams = torch.randn(tokens, config.hc_mult, config.hidden_size, generator=g).bfloat16()
                with torch.no_grad():
                    eager = run_layer(functools.partial(type(layer).forward, layer), layer, streams, decode_batch(tokens))
                    with capture_mode.model_capture_mode():
                        fused = run_layer(layer, layer, streams, decode_batch(tokens))
                for target in splice.targets:
                    if target.state == "fused" and target.name not in spies:
                        spies[target.name] = FusedGraphRuns(target)
                out["errors"][f"{splice.name} T={tokens}"] = compare(fused, eager, None)
        out["states"] = {t.name: t.state for s in splices for t in s.targets}
        out["fused_graph_runs"] = {name: spy.count for name, spy in spies.items()}
        out["launches"] = {t.name: [t.report.launches_before, t.report.launches_after]
                           for s in splices for t in s.targets if t.report is not None}

        runs_before = dict(out["fused_graph_runs"])
        tokens = 3
        streams = torch.randn(tokens, config.hc_mult, config.hidden_size, generator=g).bfloat16()
        extend = {}
        with torch.no_grad():
            for layer, splice in zip(layers, splices):
                spliced = run_layer(layer, layer, streams, decode_batch(tokens, "EXTEND"))
                own = run_layer(functools.partial(type(layer).forward, layer), layer, streams, decode_batch(tokens, "EXTEND"))
                extend[splice.name] = torch.equal(spliced, own)
        out["extend_same_as_own_code"] = extend
        out["extend_took_fused_path"] = {name: spy.count != runs_before[name] for name, spy in spies.items()}
    return out


# ------------------------------------------------------------------------------------------
# The mHC glue, through the compile seam
# ------------------------------------------------------------------------------------------


def mhc_through_the_seam(layers, config) -> dict:
    """sglang's own hc_pre of each real layer, and its post, in capture mode: fused at the
    warm-up, the fused forward in the (pretended) capture, never torch.compile."""
    from sglang.srt.model_executor.runner_utils import capture_mode

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
    return results


# ------------------------------------------------------------------------------------------
# The layer fused whole
# ------------------------------------------------------------------------------------------


def run_stack(layers, streams: torch.Tensor, batch) -> list[torch.Tensor]:
    """One decode step through a stack of layers as ``DeepseekV4Model`` makes it: the layer
    stack started on the batch once, each layer given the previous one's output (and the
    residual stream it left on the batch); each layer's output."""
    from sglang.srt.layers.layer_boundary.residual import batch as residual_batch

    residual_batch.start(batch)
    positions, hidden, outputs = torch.arange(streams.shape[0]), streams, []
    for layer in layers:
        hidden = layer(positions=positions, hidden_states=hidden, input_ids=batch.input_ids,
                       forward_batch=batch, input_ids_global=batch.input_ids)
        outputs.append(hidden)
    return outputs


def stream_left(batch, out) -> dict:
    """What the layer left on ``forward_batch``: its residual stream's fields."""
    stream = batch.residual_stream
    return {"residual_is_output": stream.residual is out, "pending": repr(stream.pending),
            "transport": repr(stream.transport)}


def whole() -> dict:
    """The plugin's default: each layer fused whole at its first decode call (attention a
    stand-in leaf), at compress ratios 0, 4 and 128 with hash and with top-k routing. Decode
    calls in capture mode (the first one, sglang's warm-up, fuses) and outside it, at several
    token counts, against the layer's own forward; what each call leaves on ``forward_batch``;
    a call in another forward mode. Then a layer whose residual stream is not declared to the
    trace: it cannot be fused whole, and its targets fuse one by one (``FUSER_STRICT=1``: raised)."""
    setup()
    import fuser
    from sglang.srt.layers.layer_boundary.residual.stream import ResidualStream
    from sglang.srt.model_executor.runner_utils import capture_mode
    from sglang.srt.models import deepseek_v4

    from fuser.serving import engine
    from fuser.serving.engines import sglang as sglang_plugin

    fuser.opaque(AttentionStandIn)
    out = {"routings": {}}
    g = torch.Generator().manual_seed(19)
    with captured_log() as log:
        for hash_layers in (3, 0):
            config, layers = build_dsv4_layers(deepseek_v4.DeepseekV4CudaDecoderLayer, (0, 4, 128), hash_layers)
            for layer in layers:
                layer.self_attn = AttentionStandIn(layer.self_attn, config.hidden_size)
            model = torch.nn.Module()
            model.layers = torch.nn.ModuleList(layers)
            splices = sglang_plugin.install(model, sglang_plugin.Options.from_env())
            run = {"errors": {}, "left": {}, "eager_left": {}}
            spies = {}
            own = [functools.partial(type(layer).forward, layer) for layer in layers]
            for tokens, captured in ((4, True), (1, True), (13, True), (2, False), (7, False)):
                streams = torch.randn(tokens, config.hc_mult, config.hidden_size, generator=g).bfloat16()
                eager_batch, batch = decode_batch(tokens), decode_batch(tokens)
                mode = capture_mode.model_capture_mode() if captured else contextlib.nullcontext()
                with torch.no_grad():
                    eager = run_stack(own, streams, eager_batch)
                    with mode:
                        fused = run_stack(layers, streams, batch)
                for splice in splices:
                    if splice.whole.state == "fused" and splice.name not in spies:
                        spies[splice.name] = FusedGraphRuns(splice.whole)
                when = f"T={tokens}{'' if captured else ' eager decode'}"
                for splice, a, b in zip(splices, fused, eager):
                    run["errors"][f"{splice.name} {when}"] = compare(a, b, None)
                run["left"][when] = stream_left(batch, fused[-1])
                run["eager_left"][when] = stream_left(eager_batch, eager[-1])
            run["routing"] = type(layers[0].mlp.topk).__name__
            run["whole"] = {s.name: s.whole.state for s in splices}
            run["targets"] = {t.name: t.state for s in splices for t in s.targets}
            run["fused_graph_runs"] = {name: spy.count for name, spy in spies.items()}
            run["launches"] = {s.name: [s.whole.report.launches_before, s.whole.report.launches_after]
                               for s in splices if s.whole.report is not None}
            run["state_reads"] = {s.name: s.whole.report.state_reads for s in splices if s.whole.report is not None}
            with torch.no_grad():
                streams = torch.randn(3, config.hc_mult, config.hidden_size, generator=g).bfloat16()
                extend = run_layer(layers[0], layers[0], streams, decode_batch(3, "EXTEND"))
                own = run_layer(functools.partial(type(layers[0]).forward, layers[0]), layers[0], streams,
                                decode_batch(3, "EXTEND"))
            run["extend_same_as_own_code"] = torch.equal(extend, own)
            run["extend_took_fused_path"] = spies["layers.0"].count != run["fused_graph_runs"]["layers.0"]
            out["routings"][run["routing"]] = run
            for splice in splices:
                splice.remove()
    out["log"] = log

    # The stream not declared: the trace stops at sglang's own check (prepare.py), as before.
    delattr(ResidualStream, "__fuser_traced_through__")
    undeclared = replace(sglang_plugin.SGLANG, traced_through=())
    config, layers = build_dsv4_layers(deepseek_v4.DeepseekV4CudaDecoderLayer, (0,), 0)
    layers[0].self_attn = AttentionStandIn(layers[0].self_attn, config.hidden_size)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(layers)
    fallback = {}
    for strict in (False, True):
        options = replace(sglang_plugin.Options.from_env(), strict=strict)
        splices = engine.install(model, undeclared, options)
        streams = torch.randn(4, config.hc_mult, config.hidden_size, generator=g).bfloat16()
        with torch.no_grad(), captured_log() as messages:
            eager = run_layer(functools.partial(type(layers[0]).forward, layers[0]), layers[0], streams, decode_batch(4))
            try:
                fused = run_layer(layers[0], layers[0], streams, decode_batch(4))
                fallback["error"] = compare(fused, eager, None)
            except fuser.FuserError as e:
                fallback["strict_raised"] = str(e)
        if not strict:
            fallback["log"] = messages
            fallback["whole"] = splices[0].whole.state
            fallback["targets"] = {t.name: t.state for t in splices[0].targets}
        for splice in splices:
            splice.remove()
    out["fallback"] = fallback
    return out


if __name__ == "__main__":
    scenario = {"explain": explain, "whole": whole}.get(sys.argv[1] if sys.argv[1:] else "", main)
    print("FUSER-RESULT " + json.dumps(scenario(), default=str))
