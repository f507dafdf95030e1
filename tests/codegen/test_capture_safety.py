"""A fused kernel never JIT-compiles inside a CUDA-graph capture: it raises instead.

The CPU test exercises the guard fuser puts on every compiled Triton kernel (the interpreter
compiles nothing); the GPU test (``-m gpu``) forces a new Triton specialisation inside a real
capture and checks the error, and that capture works again after a warm-up at that shape.
"""

import pytest
import torch
from helpers import BF16RMSNorm

import fuser
from fuser.codegen.emit import forbid_compile_during_capture


class FakeJIT:
    """The part of triton.runtime.jit.JITFunction the guard wraps."""

    def __init__(self):
        self.compiled = []
        self.fn = lambda: None
        self.fn.__name__ = "rmsnorm_kernel"

    def _do_compile(self, key, *args, **kwargs):
        self.compiled.append(key)
        return f"binary for {key}"


def test_compile_outside_capture_goes_through(monkeypatch):
    kernel = FakeJIT()
    forbid_compile_during_capture(kernel, "kernels/rmsnorm_abc.py")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert kernel._do_compile("k1") == "binary for k1" and kernel.compiled == ["k1"]


def test_compile_during_capture_raises_naming_the_kernel(monkeypatch):
    kernel = FakeJIT()
    forbid_compile_during_capture(kernel, "kernels/rmsnorm_abc.py")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(fuser.CaptureCompileError, match=r"rmsnorm_abc\.py: rmsnorm_kernel would be JIT-compiled"):
        kernel._do_compile("k2")
    assert kernel.compiled == []


def test_objects_without_a_compile_hook_are_left_alone():
    class Interpreted:
        pass

    kernel = Interpreted()
    forbid_compile_during_capture(kernel, "kernels/x.py")
    assert vars(kernel) == {}


@pytest.mark.gpu
def test_new_specialisation_inside_a_real_capture_raises():
    assert torch.cuda.is_available(), "run with -m gpu on a CUDA machine"
    n = 64
    module = BF16RMSNorm(n).cuda()
    x = torch.randn(8, n, device="cuda", dtype=torch.bfloat16)
    fuser.apply(module, (x,))
    # A row stride of 65 (not divisible by 16) is a specialisation the apply-time launch never saw.
    odd = torch.randn(8, n + 1, device="cuda", dtype=torch.bfloat16)[:, :n]
    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    with pytest.raises(fuser.CaptureCompileError, match="while a CUDA graph is being captured"):
        with torch.no_grad(), torch.cuda.graph(graph, stream=stream):
            module(odd)
    torch.cuda.synchronize()
    with torch.no_grad(), torch.cuda.stream(stream):
        expected = module(odd)  # a warm-up at this shape compiles it, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph, stream=stream):
        out = module(odd)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
