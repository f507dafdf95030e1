"""activation_in_gemm: a ReLU or tanh GELU applied to a linear layer's output alone is applied
by the GEMM itself.

In GPT-J, Phi-2, StarCoder2 or OPT the MLP's activation sits alone between its two GEMMs:
fused or not, it is one launch of its own that reads and writes the whole intermediate. cuBLASLt
applies a bias and then a ReLU or a tanh GELU in the GEMM's epilogue, on the fp32 accumulator
(``torch._addmm_activation``): on an H100 that costs 0.0–0.5 µs on the GEMM at 1–32 tokens where
PyTorch's activation kernel takes 1.5–2.9 µs (``benchmarks/probe_gemm_activation.py``). So
``act(fc(x))`` becomes one call, the result rounded once where eager rounds the product and then
each activation step. In fp16 and bf16 only on CUDA: for a small fp32 GEMM cuBLAS runs the
epilogue as a kernel of its own (the CPU, where tests run, takes every dtype).

The activation is found by what it computes, not by its class: ``F.relu``, ``F.gelu(x,
approximate="tanh")``, and the tanh GELU as transformers writes it out (``gelu_new``,
``gelu_fast``) are matched op by op, literal by literal (:mod:`fuser.match.matcher`). The exact
(erf) GELU is not: cuBLASLt's GELU is the tanh one, and swapping one function for the other
would change the result. Only exactly ``torch.nn.Linear`` (no subclass: a quantised one is one)
with a bias (cuBLASLt's epilogue is the bias's), no hooks and no forward set on the instance,
weight, bias and input of one floating dtype, its output read by the activation alone; the
activation's kernel (or its ops, left to PyTorch) computes that and nothing else. The weight and
bias are read from the module at each call, so a weight loaded or updated after apply is used.
"""

from __future__ import annotations

import math
import operator
from pathlib import Path

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fuser.install.fused_graph import REGION_META
from fuser.match.matcher import match_pattern
from fuser.pattern import Pattern, tensor
from fuser.pipeline.residual_in_gemm import plain_linear
from fuser.trace.tracing import Traced


def linear_activation(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, gelu: bool) -> torch.Tensor:
    """``act(x @ weight.T + bias)``, ``act`` the tanh GELU (``gelu``) or ReLU, bias and activation
    applied by the GEMM's epilogue before its one rounding."""
    if x.device.type != "cuda":  # PyTorch's CPU _addmm_activation computes the exact GELU, not the tanh one
        out = F.linear(x, weight, bias)
        return F.gelu(out, approximate="tanh") if gelu else F.relu(out)
    rows = x.reshape(-1, x.shape[-1])
    out = torch._addmm_activation(bias, rows, weight.t(), use_gelu=gelu)
    return out.view(*x.shape[:-1], weight.shape[0])


def _relu(x):
    return F.relu(x)


def _gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


def _gelu_new(x):  # transformers' NewGELUActivation
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _gelu_fast(x):  # transformers' FastGELUActivation
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def _gelu_erf(x):
    return F.gelu(x)


def _pattern(name: str, reference) -> Pattern:
    return Pattern(name=name, path=Path(__file__), reference=reference, template="pointwise",
                   inputs=dict(x=tensor("T, ..., N", "bfloat16 float16 float32")), params={},
                   example=dict(N=64))  # fmt: skip


#: Each spelling, and whether it is the GELU (else ReLU); None: an activation no epilogue
#: computes, matched to say so in the report.
ACTIVATIONS: tuple[tuple[Pattern, bool | None], ...] = (
    (_pattern("relu", _relu), False),
    (_pattern("gelu_tanh", _gelu_tanh), True),
    (_pattern("gelu_new", _gelu_new), True),
    (_pattern("gelu_fast", _gelu_fast), True),
    (_pattern("gelu", _gelu_erf), None),
)


def activations_in_gemm(graph: fx.Graph, module: nn.Module, traced: Traced, cops: dict, survivors: set,
                        shared: list, merged: dict[str, tuple[str, ...]]) -> tuple[list[tuple[str, str, str]], dict[str, str]]:  # fmt: skip
    """Rewrite every such activation of the fused ``graph`` in place (``survivors``: the traced
    nodes it still runs as they are; ``shared``: the regions run once per model forward;
    ``merged``: each linear layer run in one GEMM with others -> the layers of that GEMM).
    Returns ``(activation's output, its name, linear layer)`` of each rewritten, and for each
    activation of a linear layer left apart, why."""
    nodes = {n.name: n for n in graph.nodes}
    done, apart, taken = [], {}, set()
    for pattern, gelu in ACTIVATIONS:
        matches, _ = match_pattern(pattern, traced, cops, taken)
        for m in matches:
            taken |= m.nodes
            source = m.inputs[0]
            if source.op == "call_module" and source.target in merged:
                apart[f"{m.outputs[0].name} ({pattern.name}) of {source.target}"] = (
                    f"its layer runs in one GEMM with {' and '.join(n for n in merged[source.target] if n != source.target)} "
                    "(merge_projections), which an epilogue of its columns alone cannot follow")
                continue
            linear = nodes.get(source.name)
            if linear is None or linear.op != "call_module" or not isinstance(module.get_submodule(linear.target), nn.Linear):
                continue
            why = _why_not(m, linear, module, traced, nodes, survivors, shared) if gelu is not None else (
                "the exact (erf) GELU: cuBLASLt's epilogue computes the tanh one")
            if why:
                apart[f"{m.outputs[0].name} ({pattern.name}) of {linear.target}"] = why
                continue
            _rewrite(graph, linear, _fused_output(m, nodes, survivors, shared), m, nodes, gelu)
            done.append((m.outputs[0].name, pattern.name, linear.target))
    graph.lint()
    return done, apart


def _why_not(m, linear: fx.Node, module: nn.Module, traced: Traced, nodes: dict, survivors: set, shared: list) -> str | None:
    layer = module.get_submodule(linear.target)
    if not plain_linear(linear, module, bias=True):
        return "not exactly torch.nn.Linear with a bias (cuBLASLt applies the activation with the bias), no hooks, no forward of its own"
    readers = {u for u in m.inputs[0].users}
    if not readers <= m.nodes:
        return f"its output is read by {', '.join(sorted(u.name for u in readers - m.nodes))} too"
    value = traced.value(m.inputs[0])
    dtypes = {value.dtype, layer.weight.dtype, layer.bias.dtype}
    if len(dtypes) != 1 or value.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"input, weight and bias of dtypes {sorted(str(d) for d in dtypes)}, not one floating dtype"
    if value.dtype == torch.float32 and value.device.type == "cuda":
        return "fp32 on CUDA: cuBLAS runs the epilogue of a small fp32 GEMM as a kernel of its own, saving no launch"
    if _fused_output(m, nodes, survivors, shared) is None:
        return "its activation shares a kernel with other glue"
    return None


def _fused_output(m, nodes: dict, survivors: set, shared: list) -> fx.Node | None:
    """The fused graph's node for the activation's output: its own, where all its ops run as
    they are, or the output of the kernel that computes exactly the activation; else None."""
    out = m.outputs[0]
    if m.nodes <= survivors:
        return nodes[out.name]
    for node in nodes.values():
        region = node.meta.get(REGION_META)
        if (region is not None and region.covered == m.nodes and region.outputs == [out] and not region.stores
                and not any(region is s for s in shared)):  # fmt: skip
            items = [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
            return items[0] if len(items) == 1 and len(node.users) == 1 else None
    return None


def _rewrite(graph: fx.Graph, linear: fx.Node, out: fx.Node, m, nodes: dict, gelu: bool) -> None:
    with graph.inserting_before(linear):
        weight = graph.get_attr(f"{linear.target}.weight")
        bias = graph.get_attr(f"{linear.target}.bias")
        fused = graph.call_function(linear_activation, (linear.args[0], weight, bias, gelu))
    out.replace_all_uses_with(fused)
    if out.op == "call_function" and out.target is operator.getitem and REGION_META in out.args[0].meta:
        call = out.args[0]
        graph.erase_node(out)
        graph.erase_node(call)
    else:
        for node in sorted((nodes[n.name] for n in m.nodes if n.name in nodes), key=_position(graph), reverse=True):
            graph.erase_node(node)
    graph.erase_node(linear)


def _position(graph: fx.Graph):
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__
