"""GPU tests: compiled Triton kernels (not the interpreter), the real-size DSv4 layer, and a
CUDA-graph replay of the fused layer. Selected with ``pytest -m gpu`` (``make gpu-test``) on a
machine with a CUDA GPU; CI has none and deselects them (pyproject addopts).

The DSv4 layer is fused with ``dsv4.fuse_layer``: the layer and, nested, the shared expert inside
its side-stream leaf."""

import pytest
import torch

import fuser
from examples.dsv4 import layer as dsv4
from fuser.validate.tolerance import LAYER, mismatch

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _cuda():
    assert torch.cuda.is_available(), "the gpu tests need a CUDA device (run them with -m gpu on the GPU machine)"


def _eager_and_fused(factory, T):
    module, inputs = factory(T=T, device="cuda")
    fresh, fresh_inputs = factory(T=T, device="cuda")
    with torch.no_grad():
        expected = fresh(*fresh_inputs)
    report = dsv4.fuse_layer(module, inputs)[""].report
    with torch.no_grad():
        got = module(*inputs)
    return module, inputs, got, expected, fresh, report


@pytest.mark.parametrize("factory", [dsv4.tiny, dsv4.tiny_hash], ids=["tiny", "tiny_hash"])
@pytest.mark.parametrize("T", [1, 3, 16])
def test_tiny_layer_fused_matches_eager_on_gpu(factory, T):
    module, _, got, expected, fresh, report = _eager_and_fused(factory, T)
    assert mismatch(got, expected, "output", LAYER) is None
    cache = dict(module.named_buffers())
    for name, buffer in fresh.named_buffers():
        assert mismatch(cache[name], buffer, name, LAYER) is None
    assert report.launches_after * 5 <= report.launches_before


def test_one_trace_serves_every_token_count_on_gpu():
    module, inputs = dsv4.tiny(T=8, device="cuda")
    dsv4.fuse_layer(module, inputs)
    for T in (1, 2, 5, 40):
        other, other_inputs = dsv4.tiny(T=T, device="cuda")
        _, fused_inputs = dsv4.tiny(T=T, device="cuda")
        for (_, mine), (_, theirs) in zip(module.named_buffers(), other.named_buffers()):
            mine.copy_(theirs)  # the same kv-cache state as the eager copy
        with torch.no_grad():
            expected = other(*other_inputs)
            got = module(*fused_inputs)
        assert module._fuser_state.guard.why_not(fused_inputs, {}) is None
        assert mismatch(got, expected, f"T={T}", LAYER) is None


def test_flash_layer_check_passes():
    module, inputs = dsv4.flash(T=8, device="cuda")
    result = fuser.check(module, inputs)
    assert result.ok, result.text()
    report = result.report  # the layer's own glue: the shared expert's SwiGLU is inside a leaf
    parts = {part for c in report.chains for part in c.pattern.split("+")}  # a merged kernel: "a+b"
    assert parts >= {"mhc_sinkhorn_rms", "mhc_post", "rmsnorm"}
    assert report.launches_after * 5 <= report.launches_before


def test_fused_layer_replays_in_a_cuda_graph():
    module, inputs = dsv4.tiny(T=16, device="cuda")
    fresh, fresh_inputs = dsv4.tiny(T=16, device="cuda")
    dsv4.fuse_layer(module, inputs)
    static = [x.clone() for x in inputs]
    stream = torch.cuda.Stream()
    with torch.no_grad(), torch.cuda.stream(stream):
        for _ in range(2):  # warm-ups on the capture stream compile every kernel first
            module(*static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph, stream=stream):
        out = module(*static)
    # The warm-ups wrote the kv cache; replay from the same state the eager run starts from.
    for (_, buffer), (_, initial) in zip(module.named_buffers(), fresh.named_buffers()):
        buffer.copy_(initial)
    graph.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        expected = fresh(*fresh_inputs)
    assert mismatch(out, expected, "replayed output", LAYER) is None


def test_flash_shared_expert_forks_onto_a_side_stream_in_captured_graphs():
    """sglang's capture mode: the shared expert runs on an alternate stream inside the captured
    graphs (fuser keeps the fork and the join as leaves; the nested apply fuses its SwiGLU).
    Every size captures with no compile during capture, and replays match eager."""
    from examples.dsv4.compare import compare_routed, run_with_expert_ids
    from fuser.tools.capture import capture_decode

    sizes = [1, 8, 64]
    module, inputs = dsv4.flash(T=max(sizes), device="cuda")
    eager, eager_inputs = dsv4.flash(T=max(sizes), device="cuda")
    sliced = lambda bs: tuple(x[:bs] for x in inputs)  # noqa: E731 - static buffers, as sglang's
    plans = dsv4.fuse_layer(module, sliced(8))
    assert [c.pattern for c in plans[dsv4.SHARED_EXPERT].report.chains] == ["swiglu_clamp"]

    # The streams each expert is captured on: the fork must put the shared one on another.
    streams = {"shared": set(), "routed": set()}

    def recorder(key):
        def hook(_, args):
            if torch.cuda.is_current_stream_capturing():
                streams[key].add(torch.cuda.current_stream().stream_id)

        return hook

    hooks = [
        module.get_submodule(dsv4.SHARED_EXPERT).register_forward_pre_hook(recorder("shared")),
        module.mlp.experts.register_forward_pre_hook(recorder("routed")),
    ]
    try:
        with dsv4.capture_mode():
            result = capture_decode(module, sliced, sizes, variant="fuser")
    finally:
        for hook in hooks:
            hook.remove()
    assert result.failed == {} and sorted(result.captured) == sizes, result.summary()
    assert result.compiles_during_capture == 0
    assert streams["shared"] and streams["routed"], streams
    assert streams["shared"].isdisjoint(streams["routed"]), f"the shared expert was not forked: {streams}"
    assert module.mlp.shared_experts.fork.pending is None, "a fork was left without its join"

    for bs in sizes:  # one at a time: the graphs share one memory pool
        captured = result.graphs[bs]
        captured.graph.replay()
        torch.cuda.synchronize()
        # The same fused kernels run eagerly, outside capture mode (no fork): the same values.
        fused_out, fused_ids = run_with_expert_ids(module, sliced(bs))
        assert mismatch(captured.output, fused_out, f"bs={bs} replay vs fused eager", LAYER) is None
        # Against the eager layer, forgiving tokens whose top-k expert set a near-tie flipped.
        expected, eager_ids = run_with_expert_ids(eager, tuple(x[:bs] for x in eager_inputs))
        comparison = compare_routed(captured.output, expected, eager_ids, fused_ids, f"bs={bs}")
        assert comparison.ok, comparison.entry


def test_bench_counts_kernels_inside_heavy_calls_as_heavy():
    """fuser bench classifies a kernel by the op that launched it: everything a heavy function
    (F.linear here, whatever kernels cuBLAS picks) launches is heavy, the elementwise op glue."""
    import torch.nn.functional as F

    from fuser.tools.bench import kernel_classes

    w = torch.randn(256, 4096, device="cuda")

    def forward(x):
        return F.linear(x, w) * 2.0

    for T in (1, 512):
        classes = kernel_classes(forward, (torch.randn(T, 4096, device="cuda"),))
        glue = [name for name, c in classes if c == "glue"]
        assert len(glue) == 1 and len(classes) >= 2, classes
