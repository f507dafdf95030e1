"""Programmatic dependent launch (the ``pdl`` pass, fuser.pipeline.passes.launch_pdl): a row
program rendered for PDL waits for the kernel before it as its first act and is launched with
``launch_pdl``; nothing else is. The ordering on the GPU is tested under the ``gpu`` marker."""

from dataclasses import replace

import pytest
import torch
import torch.nn as nn

import fuser
from fuser.codegen.emit import PDL_ROWS, KernelSpec, kernel_source
from fuser.codegen.launch_config import entry_key
from fuser.validate.tolerance import KERNEL, mismatch


class NormThenScale(nn.Module):
    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * 2).to(x.dtype)


def row_program_spec() -> KernelSpec:
    (kernel,) = fuser.plan(NormThenScale(), (torch.randn(3, 64, dtype=torch.bfloat16),), validate=False).kernels
    return kernel.spec


def test_a_row_program_for_pdl_waits_first_and_is_launched_with_pdl():
    spec = row_program_spec()
    _, plain = kernel_source(spec)
    _, pdl = kernel_source(replace(spec, pdl=True))
    for text in ("gdc_wait()", "gdc_launch_dependents()", f"launch_pdl=n_rows <= {PDL_ROWS},", "from triton.language.extra.cuda import"):
        assert text not in plain and text in pdl, text
    kernel_start = pdl.index(":\n", pdl.index(f"def {spec_name(pdl)}("))  # the end of its signature
    assert pdl[kernel_start:].startswith(":\n    gdc_wait()  #") and "\n    gdc_launch_dependents()  #" in pdl[kernel_start:][:300]
    assert entry_key(replace(spec, pdl=True)) == entry_key(spec)  # a launch table's warps hold for both


def spec_name(text: str) -> str:
    """The @triton.jit kernel's name in a rendered kernel module."""
    return text.split("@triton.jit\ndef ")[-1].split("(")[0]


class Sinkhorn(nn.Module):
    """mHC's split and Sinkhorn (the hand-written ``sinkhorn`` template's pattern)."""

    def __init__(self, n=4, eps=1e-6):
        super().__init__()
        self.n, self.eps = n, eps
        self.scale = nn.Parameter(torch.randn(3) * 0.1 + 1)
        self.base = nn.Parameter(torch.randn((2 + n) * n) * 0.5)

    def forward(self, mixes):
        n, eps, scale, base = self.n, self.eps, self.scale, self.base
        pre = torch.sigmoid(mixes[:, :n] * scale[0] + base[:n]) + eps
        post = 2.0 * torch.sigmoid(mixes[:, n : 2 * n] * scale[1] + base[n : 2 * n])
        comb = (mixes[:, 2 * n :] * scale[2] + base[2 * n :]).view(-1, n, n)
        comb = comb.softmax(-1) + eps
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
        for _ in range(2):
            comb = comb / (comb.sum(-1, keepdim=True) + eps)
            comb = comb / (comb.sum(-2, keepdim=True) + eps)
        return pre, post, comb


def test_a_hand_written_template_is_never_launched_with_pdl():
    """A kernel that does not wait first must not be launched early: only a kernel whose code
    calls gdc_wait() gets launch_pdl, whatever its spec says."""
    kernels = fuser.plan(Sinkhorn(), (torch.randn(5, 24),), validate=False).kernels
    hand_written = [k.spec for k in kernels if k.spec is not None and k.spec.program is None]
    assert [spec.template for spec in hand_written] == ["sinkhorn"]
    _, text = kernel_source(replace(hand_written[0], pdl=True))
    assert "launch_pdl" not in text and "gdc_wait" not in text


def test_in_the_interpreter_no_kernel_is_made_for_pdl():
    plan = fuser.plan(NormThenScale(), (torch.randn(3, 64, dtype=torch.bfloat16),))
    assert plan.kernels and not any(k.spec.pdl for k in plan.kernels)
    assert "pdl" not in plan.report.disabled_passes


class TwoKernels(nn.Module):
    """A long elementwise kernel, then an RMSNorm of what it wrote (a pattern's kernel: two
    kernels with merging off): launched early, the second would read the first's output before
    it is written."""

    def forward(self, x):
        y = x
        for _ in range(16):  # long enough that the second kernel, launched early, would overtake it
            y = torch.sin(y) * 0.5 + torch.cos(x) * 0.25  # contracting: rounding differences shrink
        return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)


def _replays(pdl_wait: bool, monkeypatch) -> list[str]:
    if not pdl_wait:  # the negative control: launched with PDL, but without the wait
        import fuser.codegen.emit as emit

        render = emit.render
        monkeypatch.setattr(emit, "render", lambda spec, name: render(spec, name).replace("    gdc_wait()  #", "    pass  #"))
    m = TwoKernels()
    x = torch.randn(1, 1 << 20, device="cuda")  # one row: launched with PDL (PDL_ROWS)
    report = fuser.apply(m, (x,), disable_passes=("merge", "widen"), validate=False)
    assert len(report.chains) == 2, report.text()
    expected = TwoKernels()(x)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        m(x), m(x)  # warm-ups on the capture stream
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = m(x)
    problems = []
    for _ in range(50):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        problems.append(mismatch(out, expected, "normed", KERNEL))
    fuser.restore(m)
    return [p for p in problems if p]


@pytest.mark.gpu
def test_kernels_launched_with_pdl_read_what_the_kernel_before_wrote(monkeypatch):
    """Captured in a CUDA graph and replayed 50 times, the reduction always reads the finished
    elementwise output; without its gdc_wait (the control) it reads it early at least once."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    assert _replays(True, monkeypatch) == []
    with monkeypatch.context() as patched:
        assert _replays(False, patched), "without gdc_wait the race never showed: the test cannot tell"
