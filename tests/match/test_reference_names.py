"""A kernel lowered from a pattern match names its arguments and locals as the pattern's
reference does (its parameters, the variables it binds, ``out``), not after the model's graph
nodes; two matches in one kernel get distinct names; a chain no pattern matched keeps its
nodes' names."""

from __future__ import annotations

import re
import sys
import textwrap
from collections import Counter
from pathlib import Path

import torch
import torch.nn as nn

import fuser
from fuser.match.pattern_files import load_pattern
from fuser.match.pattern_graph import trace_pattern
from fuser.match.reference_names import names_bound
from fuser.pattern import patterns_dir

BF16 = torch.bfloat16


def builtin(name: str):
    return load_pattern(patterns_dir() / f"{name}.py")


def reference_names(name: str) -> Counter:
    pattern = builtin(name)
    return Counter(trace_pattern(pattern, pattern.example, {}, None, named=True).names.values())


def kernel_sources(module: nn.Module, inputs: tuple, **options) -> dict[str, str]:
    """pattern (or "a+b" of a merged kernel) -> the source of its kernel."""
    plan = fuser.plan(module, inputs, **options)
    return {k.region.pattern: Path(k.path).read_text() for k in plan.kernels}


def kernel_arguments(source: str) -> list[str]:
    """The ``*_ptr`` arguments of the @triton.jit function, without the suffix."""
    return re.findall(r"^    (\w+)_ptr,", source, flags=re.MULTILINE)


def assigned(source: str) -> list[str]:
    """The names the kernel body assigns at its top level (a loop's are indented further)."""
    body = source.split("@triton.jit")[-1].split("\ndef launch")[0]
    return re.findall(r"^    (\w+) = ", body, flags=re.MULTILINE)


# --- the names, read off the reference as it runs -----------------------------------------------
def test_inputs_variables_and_the_unnamed_output_are_named():
    # rmsnorm: def reference(x, weight, eps): xf = x.float(); xf = xf * rsqrt(...); return (...).to(...)
    assert reference_names("rmsnorm") == Counter({"x": 1, "weight": 1, "xf": 2, "out": 1})


def test_a_helper_the_reference_calls_names_its_values():
    # mhc_sinkhorn_rms calls mhc_sinkhorn's reference with ``mix * rms``, which calls it ``mixes``.
    names = reference_names("mhc_sinkhorn_rms")
    assert {"mix", "rms", "scale", "base", "mixes", "pre", "post", "c"} <= set(names)
    assert names["c"] > 20  # each of the loop's normalisations


def test_the_tracer_in_place_before_is_put_back():
    def other_tracer(frame, event, arg):
        return None

    before = sys.gettrace()
    sys.settrace(other_tracer)
    try:
        with names_bound({patterns_dir()}):
            assert sys.gettrace() is not other_tracer
        assert sys.gettrace() is other_tracer
    finally:
        sys.settrace(before)


# --- the kernel ---------------------------------------------------------------------------------
class SwigluFromProjection(nn.Module):
    """The clamped SwiGLU, spelt with other names than the pattern's (``h``, ``a``, ``b``)."""

    def forward(self, h):
        half = h.shape[-1] // 2
        a = torch.clamp(h[..., :half], max=10.0)
        b = torch.clamp(h[..., half:], -10.0, 10.0)
        return (torch.nn.functional.silu(a.float()) * b.float()).to(h.dtype)


def test_a_matched_kernel_reads_with_the_references_names():
    sources = kernel_sources(SwigluFromProjection(), (torch.randn(3, 64).to(BF16),))
    source = sources["swiglu_clamp"]
    assert kernel_arguments(source) == ["gate_up", "gate_up_1", "out"]
    assert "def launch(gate_up, gate_up_1):" in source
    assert "# gate_up (getitem): torch.bfloat16 [T, 32]" in source  # the header still names the node
    assert {"g", "u", "out"} <= set(assigned(source))
    code = source.split("@triton.jit")[-1]  # the kernel and its launcher, below the header
    for node_name in ("getitem", "clamp", "to"):
        assert not re.search(rf"(?<![\w.]){node_name}(_\d+)?\b", code), node_name  # not .to()


class TwoNorms(nn.Module):
    """Two RMSNorms of one activation (a query and a key norm): one kernel of two matches."""

    def __init__(self, width=64):
        super().__init__()
        self.wq = nn.Parameter(torch.randn(width).to(BF16))
        self.wk = nn.Parameter(torch.randn(width).to(BF16))

    @staticmethod
    def norm(hidden, weight):
        hf = hidden.float()
        hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (hf * weight).to(hidden.dtype)

    def forward(self, hidden):
        return self.norm(hidden, self.wq), self.norm(hidden, self.wk)


def test_two_matches_of_one_pattern_in_one_kernel_get_distinct_names():
    sources = kernel_sources(TwoNorms(), (torch.randn(4, 64).to(BF16),))
    source = sources["rmsnorm+rmsnorm"]  # validated against eager: the names compile and compute
    arguments = kernel_arguments(source)
    assert arguments == ["x", "weight", "weight_1", "out", "out_1"]
    locals_ = assigned(source)
    assert len(locals_) == len(set(locals_)), Counter(locals_).most_common(3)
    assert {"xf", "xf_1", "xf_2", "xf_3"} <= set(locals_)


FRAME_NAMES_PATTERN = '''
"""A reference whose variables are called as the kernel's frame calls its own values."""
import torch
from fuser.pattern import tensor

def reference(x):
    row = x.float()
    tl = torch.tanh(row)
    return (tl * 3 - 1).to(x.dtype)

PATTERN = dict(template="pointwise", inputs=dict(x=tensor("T, N", "bfloat16")), example=dict(N=32))
'''


class ScaledTanh(nn.Module):
    def forward(self, hidden):
        return (torch.tanh(hidden.float()) * 3 - 1).to(hidden.dtype)


def test_a_reference_name_never_shadows_the_frames(tmp_path):
    path = tmp_path / "frame_names.py"
    path.write_text(textwrap.dedent(FRAME_NAMES_PATTERN))
    sources = kernel_sources(ScaledTanh(), (torch.randn(3, 32).to(BF16),), patterns=[path])
    source = sources["frame_names"]  # validated against eager: ``row`` and ``tl`` still the frame's
    assert {"v_row", "v_tl"} <= set(assigned(source))
    assert assigned(source).count("row") == 1  # the frame's own: row = tl.program_id(0)


def test_a_chain_no_pattern_matched_keeps_its_nodes_names():
    sources = kernel_sources(ScaledTanh(), (torch.randn(3, 32).to(BF16),))
    source = sources["generic"]
    assert kernel_arguments(source) == ["hidden", "to"]
    assert {"tanh", "mul", "sub"} <= set(assigned(source))
