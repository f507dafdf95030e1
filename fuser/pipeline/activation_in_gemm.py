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
would change the result. The GEMM is exactly ``torch.nn.Linear`` (no subclass: a quantised one
is one) with a bias (cuBLASLt's epilogue is the bias's), no hooks and no forward set on the
instance, or ``torch.addmm`` of a bias row with no ``beta`` or ``alpha`` (GPT-2's ``Conv1D``, whose
rows are viewed back to the input's shape: the views stay, now of the GEMM with the
activation); weight, bias and input of one floating dtype, its output read by the activation
alone; the activation's kernel (or its ops, left to PyTorch) computes that and nothing else. The
weight and bias are read at each call, so a weight loaded or updated after apply is used.
"""

from __future__ import annotations

import math
import operator
from pathlib import Path

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fuser.ir.canonical_op import viewed
from fuser.install.fused_graph import REGION_META
from fuser.match.matcher import match_pattern
from fuser.pattern import Pattern, tensor
from fuser.pipeline.residual_in_gemm import plain_linear
from fuser.trace.tracing import Traced


def addmm_activation(bias: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, gelu: bool) -> torch.Tensor:
    """``act(bias + mat1 @ mat2)``, ``act`` the tanh GELU (``gelu``) or ReLU, bias and activation
    applied by the GEMM's epilogue before its one rounding."""
    if mat1.device.type != "cuda":  # PyTorch's CPU _addmm_activation computes the exact GELU, not the tanh one
        out = torch.addmm(bias, mat1, mat2)
        return F.gelu(out, approximate="tanh") if gelu else F.relu(out)
    return torch._addmm_activation(bias, mat1, mat2, use_gelu=gelu)


def linear_activation(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, gelu: bool) -> torch.Tensor:
    """``act(F.linear(x, weight, bias))`` by :func:`addmm_activation`."""
    out = addmm_activation(bias, x.reshape(-1, x.shape[-1]), weight.t(), gelu)
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
                        shared: list, merged: dict[str, tuple[str, ...]]) -> tuple[list[tuple[str, str, str, bool]], dict[str, str]]:  # fmt: skip
    """Rewrite every such activation of the fused ``graph`` in place (``survivors``: the traced
    nodes it still runs as they are; ``shared``: the regions run once per model forward;
    ``merged``: each linear layer run in one GEMM with others -> the layers of that GEMM).
    Returns ``(activation's output, its name, the GEMM's name, whether a linear layer's call is
    bypassed)`` of each rewritten, and for each activation of a GEMM left apart, why."""
    nodes = {n.name: n for n in graph.nodes}
    done, apart, taken = [], {}, set()
    for pattern, gelu in ACTIVATIONS:
        matches, _ = match_pattern(pattern, traced, cops, taken)
        for m in matches:
            taken |= m.nodes
            gemm = _gemm_of(m.inputs[0], module, cops)
            if gemm is None:
                continue
            node, name = gemm
            what = f"{m.outputs[0].name} ({pattern.name}) of {name}"
            if node.op == "call_module" and node.target in merged:
                apart[what] = (f"its layer runs in one GEMM with {' and '.join(n for n in merged[node.target] if n != node.target)} "
                               "(merge_projections), which an epilogue of its columns alone cannot follow")  # fmt: skip
                continue
            read, others = _read(node, m, cops)
            why = _why_not(m, node, read, others, module, traced, nodes, survivors, shared) if gelu is not None else (
                "the exact (erf) GELU: cuBLASLt's epilogue computes the tanh one")
            if why:
                apart[what] = why
                continue
            _rewrite(graph, nodes[node.name], nodes[read.name] if read is not node else None,
                     fused_output(m, nodes, survivors, shared), m, nodes, gelu)  # fmt: skip
            done.append((m.outputs[0].name, pattern.name, name, node.op == "call_module"))
            nodes = {n.name: n for n in graph.nodes}  # (the rewrite erased some)
    graph.lint()
    return done, apart


def _gemm_of(x: fx.Node, module: nn.Module, cops: dict) -> tuple[fx.Node, str] | None:
    """The traced GEMM whose output the activation reads (through views: GPT-2's ``Conv1D``
    views ``torch.addmm``'s rows back to the input's shape), and its name: a linear layer's
    call, or ``torch.addmm`` (named by its weight's module); None for anything else."""
    while viewed(cops.get(x)) is not None:
        x = viewed(cops[x])
    if x.op == "call_module":
        return (x, x.target) if isinstance(module.get_submodule(x.target), nn.Linear) else None
    if x.op == "call_function" and x.target is torch.addmm:
        weight = x.args[2] if len(x.args) == 3 else None
        owner = weight.target.rpartition(".")[0] if isinstance(weight, fx.Node) and weight.op == "get_attr" else ""
        return x, f"{owner or x.name} (torch.addmm)"
    return None


def _read(gemm: fx.Node, m, cops: dict) -> tuple[fx.Node, set]:
    """The value the activation reads: the GEMM's output or the last of the views that lead
    from it to the activation alone (a reshape to the same shape is the value itself); and
    what else reads the GEMM's output or those views."""
    node = read = gemm
    while not set(node.users) <= m.nodes:
        (user, *more) = node.users
        if more or viewed(cops.get(user)) is None:
            return read, set(node.users) - m.nodes
        node = user
        read = read if cops[node].op == "identity" else node
    return read, set()


def _why_not(m, gemm: fx.Node, read: fx.Node, others: set, module: nn.Module, traced: Traced, nodes: dict, survivors: set,
             shared: list) -> str | None:  # fmt: skip
    if gemm.name not in nodes:
        return "its GEMM does not run as itself in the fused graph"
    if gemm.op == "call_module":
        if not plain_linear(gemm, module, bias=True):
            return "not exactly torch.nn.Linear with a bias (cuBLASLt applies the activation with the bias), no hooks, no forward of its own"
        layer = module.get_submodule(gemm.target)
        operands = [traced.value(gemm.args[0]), layer.weight, layer.bias]
    else:
        if len(gemm.args) != 3 or gemm.kwargs or not all(isinstance(a, fx.Node) for a in gemm.args):
            return "torch.addmm with a beta, alpha or operand the epilogue does not take"
        operands = [traced.value(a) for a in gemm.args]
        if operands[0].dim() != 1:
            return "torch.addmm adding a matrix, not a bias row (cuBLASLt's epilogue adds a bias)"
    if others:
        return f"its output is read by {', '.join(sorted(u.name for u in others))} too"
    if read is not gemm and read.name not in nodes:
        return "its output is viewed inside the activation's kernel, a view the fused graph no longer makes"
    dtypes = {t.dtype for t in operands}
    dtype = operands[0].dtype
    if len(dtypes) != 1 or dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"input, weight and bias of dtypes {sorted(str(d) for d in dtypes)}, not one floating dtype"
    if dtype == torch.float32 and operands[0].device.type == "cuda":
        return "fp32 on CUDA: cuBLAS runs the epilogue of a small fp32 GEMM as a kernel of its own, saving no launch"
    if fused_output(m, nodes, survivors, shared) is None:
        return "its activation shares a kernel with other glue"
    return None


def fused_output(m, nodes: dict, survivors: set, shared: list) -> fx.Node | None:
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


def _rewrite(graph: fx.Graph, gemm: fx.Node, view: fx.Node | None, out: fx.Node, m, nodes: dict, gelu: bool) -> None:
    """The GEMM becomes one with the activation; what read the activation reads it (through
    the views between them, ``view`` the last, where there are any); the activation's kernel
    or ops go."""
    with graph.inserting_before(gemm):
        if gemm.op == "call_module":
            weight = graph.get_attr(f"{gemm.target}.weight")
            bias = graph.get_attr(f"{gemm.target}.bias")
            fused = graph.call_function(linear_activation, (gemm.args[0], weight, bias, gelu))
        else:
            fused = graph.call_function(addmm_activation, (*gemm.args, gelu))
    gemm.replace_all_uses_with(fused)
    graph.erase_node(gemm)
    out.replace_all_uses_with(view if view is not None else fused)
    if out.op == "call_function" and out.target is operator.getitem and REGION_META in out.args[0].meta:
        call = out.args[0]
        graph.erase_node(out)
        graph.erase_node(call)
    else:
        for node in sorted((nodes[n.name] for n in m.nodes if n.name in nodes), key=graph_order(graph), reverse=True):
            graph.erase_node(node)


def graph_order(graph: fx.Graph):
    """A sort key: a node's place in ``graph``."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__
