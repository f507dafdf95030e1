"""fuser.pipeline.early_weights: a decode GEMM launched with PDL reads its first chunk of weight
before its wait only where the kernel just before it is one of the same forward that surely
launches, and never where the forward writes a module attribute in place; each launcher made
again under the early configuration computes what it did; a model's greedy decode with the
early reads gives eager's logits, after a weight update too. (In the interpreter PDL itself does
not run: the GEMMs' configurations say PDL, their launches go without it. The compiled kernel
with PDL and the early read is checked against its reference in tests/kernels/test_decode_gemm.py
on the GPU.)"""

import copy
import dataclasses
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import fuser
from fuser.install import decode_gemm
from fuser.install.decode_gemm import Config
from fuser.install.fused_graph import REGION_META
from fuser.pipeline import decode_gemms, early_weights, gated_in_gemm, norm_in_gemm
from fuser.tools.capture import capture_decode
from fuser.validate.tolerance import LAYER, mismatch
from tests.model.test_decode import PROMPT, greedy, prefilled, step
from tests.model.test_model import causal_lm
from tests.pipeline.test_decode_gemms import shapes, write_table

PDL = Config(16, 32, 2, 16, pdl=True)


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


def graph_of(*steps) -> tuple[fx.Graph, nn.Module]:
    """x -> each step in turn: "gemm" (the decode GEMM under PDL), "kernel" (one of fuser's),
    "view", "identity" (a module that launches nothing), "write" (an in-place add to an attribute)."""
    module = nn.Module()
    for i in range(len(steps)):
        module.register_parameter(f"w{i}", nn.Parameter(torch.randn(8, 8)))
    module.identity = nn.Identity()
    graph = fx.Graph()
    x = graph.placeholder("x")
    for i, kind in enumerate(steps):
        if kind == "gemm":  # named by its weight, w<i>
            x = graph.call_function(decode_gemm.launcher(PDL), (x, graph.get_attr(f"w{i}")))
        elif kind == "kernel":
            x = graph.call_function(torch.sin, (x,))
            x.meta[REGION_META] = object()
        elif kind == "view":
            x = graph.call_method("view", (x, -1))
        elif kind == "identity":
            x = graph.call_module("identity", (x,))
        else:
            graph.call_method("add_", (graph.get_attr("w0"), 1.0)).name = f"{kind}_{i}"
            continue
        x.name = f"{kind}_{i}"
    graph.output(x)
    return graph, module


def early_of(graph: fx.Graph) -> list[bool]:
    return [decode_gemm.launch_of(n.target)[0].early for n in graph.nodes if decode_gemm.launch_of(n.target)]


def test_a_gemm_after_a_kernel_of_the_forward_reads_early_and_the_first_waits():
    graph, module = graph_of("gemm", "kernel", "view", "gemm", "gemm")
    done, waiting = early_weights.early_weights(graph, module)
    assert early_of(graph) == [False, True, True]
    assert done == ["w3", "w4"] and list(waiting) == ["w0"] and "first kernel" in waiting["w0"]


def test_views_and_modules_that_may_launch_nothing_do_not_count_as_a_kernel_before():
    graph, module = graph_of("view", "identity", "gemm")
    done, waiting = early_weights.early_weights(graph, module)
    assert early_of(graph) == [False] and done == [] and list(waiting) == ["w2"]


def test_a_kernel_a_call_may_not_launch_does_not_count_as_a_kernel_before():
    # run once per model forward, or handed over by the layer before: in most calls no launch
    graph, module = graph_of("kernel", "gemm", "kernel", "gemm")
    first, second = [n for n in graph.nodes if REGION_META in n.meta]
    done, waiting = early_weights.early_weights(graph, module, unsure=(first.meta[REGION_META],))
    assert early_of(graph) == [False, True] and done == ["w3"] and list(waiting) == ["w1"]


@pytest.mark.parametrize("spelling", ["add_", "iadd"])
def test_a_forward_that_writes_an_attribute_in_place_reads_no_weight_early(spelling):
    graph, module = graph_of("kernel", "gemm", "write")
    if spelling == "iadd":  # self.w0 += 1.0, as traced
        write = [n for n in graph.nodes if n.name == "write_2"][0]
        write.op, write.target = "call_function", operator.iadd
    done, waiting = early_weights.early_weights(graph, module)
    assert early_of(graph) == [False] and done == []
    assert "writes a module attribute in place (write_2)" in waiting["w1"]


def test_a_gemm_without_pdl_is_left_as_it_is():
    graph, module = graph_of("kernel", "gemm")
    gemm = [n for n in graph.nodes if decode_gemm.launch_of(n.target)][0]
    gemm.target = decode_gemm.launcher(dataclasses.replace(PDL, pdl=False))
    assert early_weights.early_weights(graph, module) == ([], {})
    assert early_of(graph) == [False]


def test_each_launcher_made_again_under_another_configuration_computes_the_same():
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(1, 64, generator=g), torch.randn(1, 48, generator=g)
    w, nw = torch.randn(48, 64, generator=g) / 8, 1 + 0.1 * torch.randn(64, generator=g)
    plain = Config(16, 32, 2, 16)
    gated = gated_in_gemm.gated_linear(plain, "silu", lambda a, b: F.silu(a) * b)
    launchers = {
        "plain": (decode_gemm.launcher(plain), (x, w)),
        "residual": (decode_gemms.accumulate_with(plain), (r, x, w)),
        "gated": (gated, (x, w)),
        "normed": (norm_in_gemm.normed_linear(decode_gemm.launcher(plain), None, 2, 0, None, 0, (), 1, "weight_after_cast", 1e-6), (x, nw, w)),
        "normed gated": (norm_in_gemm.normed_linear(gated, None, 2, 0, None, 0, (), 1, "weight_after_cast", 1e-6), (x, nw, w)),
    }  # fmt: skip
    for name, (launcher, args) in launchers.items():
        config, remake = decode_gemm.launch_of(launcher)
        assert config == plain, name
        again = remake(dataclasses.replace(config, early=True))
        assert decode_gemm.launch_of(again)[0].early, name
        expected = launcher(*[a.clone() for a in args])
        got = again(*[a.clone() for a in args])
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=name)


def test_a_model_s_gemms_after_its_first_kernel_read_early_and_decode_as_eager(tmp_path, monkeypatch):
    model = causal_lm("llama", layers=2)
    cache, tokens = prefilled(model)
    eager_model = copy.deepcopy(model)
    monkeypatch.setenv(decode_gemm.TABLE_ENV, write_table(tmp_path, shapes(model.model.layers[0])))
    real_config = decode_gemms._config
    monkeypatch.setattr(decode_gemms, "_config", lambda n, k, weight, pdl: real_config(n, k, weight, True))  # the GPU's PDL
    monkeypatch.setattr(decode_gemm, "PDL_ROWS", 0)  # ... but launched without it: the interpreter has none
    early = []
    real_launch = decode_gemm._launch
    monkeypatch.setattr(decode_gemm, "_launch", type("Spy", (), {"__getitem__": lambda self, grid: lambda *a, **k: early.append(k["EARLY"]) or real_launch[grid](*a, **k)})())  # fmt: skip

    report = fuser.apply(model, (), example_kwargs=step(tokens, PROMPT, copy.deepcopy(cache)))
    (group,) = report.groups
    said = group.report
    # the merged q/k/v GEMM computes the input norm: the layer's first kernel, after the caller's
    assert said.early_weights == ["self_attn.o_proj", "merged_mlp_gate_proj", "mlp.down_proj"], said.text()
    assert list(said.early_waiting) == ["merged_self_attn_q_proj"] and "first kernel" in said.early_waiting["merged_self_attn_q_proj"]
    assert "reading their weight's first chunk while the kernel before them ends" in report.text()

    for m in (model, eager_model):  # an update after apply: o_proj's weight reads early, the merged q/k/v's waits
        layer = m.model.layers[1].self_attn
        layer.o_proj.weight.mul_(0.5)
        layer.q_proj.weight.mul_(2.0)
    early.clear()
    expected = greedy(eager_model, copy.deepcopy(cache), tokens)
    got = greedy(model, copy.deepcopy(cache), tokens)
    # a step: each layer's q/k/v waiting and three early; then the head (its shape the merged
    # q/k/v's here, so in the table), the final norm its prologue: its forward's first kernel
    assert early == ([False, True, True, True] * 2 + [False]) * len(got), early
    for i, (a, b) in enumerate(zip(got, expected)):
        problem = mismatch(a, b, f"logits at step {i}", LAYER)
        assert problem is None, problem


class LongGlueThenGemms(nn.Module):
    """A long elementwise kernel (one row of 16384, sixteen rounds) whose output the first GEMM
    reads, its activation, the second GEMM: on the GPU both GEMMs follow one of fuser's kernels."""

    def __init__(self, wide=16384, narrow=2048):
        super().__init__()
        self.up = nn.Linear(wide, narrow, bias=False)
        self.down = nn.Linear(narrow, wide, bias=False)

    def forward(self, x):
        y = x
        for _ in range(16):
            y = torch.sin(y) * 0.5 + torch.cos(x) * 0.25
        return self.down(F.silu(self.up(y)))


@pytest.mark.gpu
def test_on_the_gpu_early_reads_in_a_captured_graph_read_what_the_kernel_before_wrote(tmp_path, monkeypatch):
    """Each GEMM, launched with PDL right after one of fuser's kernels, reads its weight before its
    wait and its input after it: 20 replays of a CUDA graph on new inputs give eager's output."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    torch.manual_seed(0)
    model = LongGlueThenGemms().cuda().to(torch.bfloat16)
    eager = copy.deepcopy(model)
    table = write_table(tmp_path, {(2048, 16384), (16384, 2048)}, up_to=1, dtype="bfloat16", config=dict(block_n=4, block_k=2048, warps=4))
    monkeypatch.setenv(decode_gemm.TABLE_ENV, table)
    static = torch.randn(1, 16384, device="cuda", dtype=torch.bfloat16)
    report = fuser.apply(model, (static.clone(),))
    assert report.early_weights == ["up", "down"], report.text()
    captured = capture_decode(model, lambda batch: (static,), [1])
    assert captured.captured == [1], captured.failed
    graph, out = captured.graphs[1].graph, captured.graphs[1].output
    for seed in range(20):
        static.copy_(torch.randn(1, 16384, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        problem = mismatch(out, eager(static.clone()), f"replay {seed}", LAYER)
        assert problem is None, problem
