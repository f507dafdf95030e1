"""GPU tests: compiled Triton kernels (not the interpreter), the real-size DSv4 layer, and a
CUDA-graph replay of the fused layer. Selected with ``pytest -m gpu`` (``make gpu-test``) on a
machine with a CUDA GPU; CI has none and deselects them (pyproject addopts)."""

import pytest
import torch

import fuser
from examples.dsv4 import layer as dsv4
from fuser.tolerance import LAYER, mismatch

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _cuda():
    assert torch.cuda.is_available(), "the gpu tests need a CUDA device (run them with -m gpu on the GPU machine)"


def _eager_and_fused(factory, T):
    module, inputs = factory(T=T, device="cuda")
    fresh, fresh_inputs = factory(T=T, device="cuda")
    with torch.no_grad():
        expected = fresh(*fresh_inputs)
    report = fuser.apply(module, inputs)
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
    fuser.apply(module, inputs)
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
    report = result.report
    assert {c.pattern for c in report.chains} >= {"mhc_sinkhorn_rms", "mhc_post", "rmsnorm", "swiglu_clamp"}
    assert report.launches_after * 5 <= report.launches_before


def test_fused_layer_replays_in_a_cuda_graph():
    module, inputs = dsv4.tiny(T=16, device="cuda")
    fresh, fresh_inputs = dsv4.tiny(T=16, device="cuda")
    fuser.apply(module, inputs)
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
