"""gated_in_gemm: the gated activation of an MLP, ``act(gate_proj(x)) * up_proj(x)``, computed by
the decode GEMM kernel that runs the merged gate/up projection: no launch for it.

Llama's, Qwen's, Mistral's and Gemma's MLPs merge their gate and up projections into one GEMM
(:mod:`fuser.pipeline.merged_projections`); at decode sizes that GEMM runs on fuser's decode GEMM
kernel where the GPU's table says so (:mod:`fuser.pipeline.decode_gemms`), and the product of
the activated gate and the up projection is one more launch after it. The kernel can give each
program the columns ``j`` of both halves and store ``act(gate[j]) * up[j]`` alone
(:func:`fuser.install.decode_gemm.gated`), each value rounded where eager rounds it (both halves,
the activation, the product). At token counts past the table's ``up_to`` the GEMM is PyTorch's
and the product runs as before: the kernel that computed it, or its ops.

Phi-3's and GLM-4's MLPs hold one ``gate_up_proj`` layer and chunk its output in two: the same
kernel takes that GEMM. Taken where the activation is found by what it computes (SiLU, or the
tanh GELU: Gemma's ``gelu_pytorch_tanh``), its gate is the merged group's first layer and its up
the second (a group of those two alone, merged in that order) or the first and second halves
of the one layer's output, and nothing else reads the GEMM's output: the product's kernel
computes exactly the product (or its ops run as they are).
"""

from __future__ import annotations

import operator
from pathlib import Path
from typing import Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

from fuser.install import decode_gemm
from fuser.install.fused_graph import REGION_META
from fuser.install.merged_weights import MergedWeights
from fuser.match.matcher import match_pattern
from fuser.pattern import Pattern, tensor
from fuser.pipeline.activation_in_gemm import fused_output, graph_order
from fuser.trace.tracing import Traced


def _silu_gate(gate, up):
    return F.silu(gate) * up


def _gelu_tanh_gate(gate, up):
    return F.gelu(gate, approximate="tanh") * up


def _pattern(name: str, reference) -> Pattern:
    return Pattern(name=name, path=Path(__file__), reference=reference, template="pointwise",
                   inputs=dict(gate=tensor("T, ..., N", "bfloat16 float16 float32"), up=tensor("T, ..., N", "bfloat16 float16 float32")),
                   params={}, example=dict(N=64))  # fmt: skip


#: Each gated activation, the kernel's name for its activation, and PyTorch's spelling of it.
GATES: tuple[tuple[Pattern, str, Callable], ...] = (
    (_pattern("silu_gate", _silu_gate), "silu", _silu_gate),
    (_pattern("gelu_tanh_gate", _gelu_tanh_gate), "gelu_tanh", _gelu_tanh_gate),
)


def gated_in_gemm(graph: fx.Graph, traced: Traced, cops: dict, survivors: set, shared: list,
                  merged: MergedWeights | None) -> tuple[list[str], dict[str, str]]:  # fmt: skip
    """Rewrite each such gated activation of the fused ``graph`` in place. Returns what was
    rewritten, and for each gated activation of a merged pair left apart, why."""
    if not any(n.op == "call_function" and decode_gemm.config_of(n.target) is not None for n in graph.nodes):
        return [], {}  # no GEMM on the kernel (no table for this GPU): no pattern to match
    nodes = {n.name: n for n in graph.nodes}
    done, apart, taken = [], {}, set()
    for pattern, activation, torch_gate in GATES:
        matches, _ = match_pattern(pattern, traced, cops, taken)
        for m in matches:
            taken |= m.nodes
            source = _source_of(m, merged, traced)
            if source is None:
                continue
            weight, gate, up = source
            gemm = _decode_gemm_of(graph, weight)
            if gemm is None:  # PyTorch's GEMM at every size (the report names shapes the table lacks)
                continue
            what = f"{m.outputs[0].name} ({activation}({gate}) * {up})"
            halves, between = _halves(gemm)
            out = fused_output(m, nodes, survivors, shared)
            why = _why_not(halves, out, m)
            if why:
                apart[what] = why
                continue
            _rewrite(graph, gemm, halves, between, out, m, nodes, activation, torch_gate)
            done.append(f"{what}: by {gemm.name}'s kernel")
            nodes = {n.name: n for n in graph.nodes}
    graph.lint()
    return done, apart


def _source_of(m, merged: MergedWeights | None, traced: Traced) -> tuple[str, str, str] | None:
    """Where the gate and the up come from: the weight attribute of the GEMM whose first and
    second halves of columns they are, and their names; None for anything else. Either a merged
    group of exactly the gate's and the up's linear layers, gate first, or one linear layer's
    output chunked in two along its last dim (``gate_up_proj(x).chunk(2, dim=-1)``: Phi-3, GLM-4)."""
    gate, up = m.inputs
    if gate.op == "call_module" and up.op == "call_module":
        group = next((g for g in (merged.groups if merged else ()) if g.layers == (gate.target, up.target)), None)
        return None if group is None else (group.weight, group.layers[0], group.layers[1])
    chunked = _chunk_items(gate, up, traced)
    if chunked is not None and chunked.op == "call_module":
        return f"{chunked.target}.weight", f"{chunked.target}[..., :half]", f"{chunked.target}[..., half:]"
    return None


def _chunk_items(first: fx.Node, second: fx.Node, traced: Traced | None) -> fx.Node | None:
    """``x`` where ``first, second`` are ``x.chunk(2, dim)``'s two items, ``dim`` the last of ``x``
    as traced (any, without ``traced``: the fused graph's chunk is the traced one); else None."""
    items = (first, second)
    if not all(n.op == "call_function" and n.target is operator.getitem for n in items) or first.args[0] is not second.args[0]:
        return None
    chunk = first.args[0]
    is_chunk = (chunk.op == "call_method" and chunk.target == "chunk") or (chunk.op == "call_function" and chunk.target is torch.chunk)
    if (first.args[1], second.args[1]) != (0, 1) or not is_chunk or not isinstance(chunk.args[0], fx.Node):
        return None
    source, *rest = chunk.args
    chunks, dim = (rest + [None, None])[:2]
    chunks, dim = chunk.kwargs.get("chunks", chunks), chunk.kwargs.get("dim", 0 if dim is None else dim)
    if chunks != 2 or (traced is not None and dim not in (-1, traced.value(source).dim() - 1)):
        return None
    return source


def _decode_gemm_of(graph: fx.Graph, weight: str) -> fx.Node | None:
    """The fused graph's call of the decode GEMM kernel on the merged ``weight``."""
    for node in graph.nodes:
        if node.op == "call_function" and decode_gemm.config_of(node.target) is not None and len(node.args) == 2:
            w = node.args[1]
            if isinstance(w, fx.Node) and w.op == "get_attr" and w.target == weight:
                return node
    return None


def _halves(gemm: fx.Node) -> tuple[tuple[fx.Node, fx.Node] | None, list[fx.Node]]:
    """The nodes of the GEMM's first and its second half of columns (``out[..., :h]`` and
    ``out[..., h:]``, or ``out.chunk(2, dim=-1)``'s items), and the chunk between; (None, [])
    where the GEMM's output is read otherwise."""
    users = list(gemm.users)
    if len(users) == 1 and len(users[0].users) == 2:
        items = sorted(users[0].users, key=lambda n: str(n.args[1:2]))
        if _chunk_items(*items, None) is gemm:
            return (items[0], items[1]), [users[0]]
    found = {}
    for user in users:
        index = user.args[1] if user.op == "call_function" and user.target is operator.getitem else None
        if not (isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis and isinstance(index[1], slice)):
            return None, []
        found[(index[1].start or 0, index[1].stop, index[1].step)] = user
    if len(found) != 2:
        return None, []
    (first, a), (second, b) = sorted(found.items(), key=lambda kv: kv[0][0])
    if first[0] != 0 or first[2] not in (None, 1) or second[2] not in (None, 1) or second[0] != first[1] or second[1] != 2 * first[1]:
        return None, []
    return (a, b), []


def _why_not(halves, out: fx.Node | None, m) -> str | None:
    if halves is None:
        return "the merged GEMM's output is read other than as its two halves"
    if out is None:
        return "the product shares a kernel with other glue"
    kernel = _product_kernel(out)
    if kernel is not None:
        if kernel.kwargs or set(kernel.args) != set(halves) or len(kernel.args) != 2:
            return "the product's kernel reads more than the two halves"
        if not set(halves[0].users) | set(halves[1].users) <= {kernel}:
            return "a half is read by more than the product's kernel"
    elif any(u.name not in {n.name for n in m.nodes} for h in halves for u in h.users):
        return "a half is read by more than the product"
    return None


def _product_kernel(out: fx.Node) -> fx.Node | None:
    """The fused kernel's call whose item ``out`` is; None where the product's ops run as they are."""
    if out.op == "call_function" and out.target is operator.getitem and REGION_META in out.args[0].meta:
        return out.args[0]
    return None


def _rewrite(graph: fx.Graph, gemm: fx.Node, halves, between: list, out: fx.Node, m, nodes: dict, activation: str,
             torch_gate: Callable) -> None:  # fmt: skip
    """The GEMM becomes :func:`gated_linear` of the product's kernel (or its ops, in PyTorch);
    what read the product reads it; the product's kernel or ops and the halves go."""
    config = decode_gemm.config_of(gemm.target)
    kernel = _product_kernel(out)
    if kernel is not None:
        rest, gone = _kernel_rest(kernel.target, [halves.index(a) for a in kernel.args]), [out, kernel]
    else:
        rest, gone = torch_gate, sorted((nodes[n.name] for n in m.nodes if n.name in nodes), key=graph_order(graph), reverse=True)
    with graph.inserting_before(gemm):
        fused = graph.call_function(gated_linear(config, activation, rest), gemm.args)
    out.replace_all_uses_with(fused)
    for node in (*gone, *halves, *between, gemm):
        graph.erase_node(node)


def gated_linear(config: decode_gemm.Config, activation: str, rest: Callable) -> Callable:
    """``act(a) * b`` of the halves of ``F.linear(x, weight)``: by the kernel where it takes the
    call, else PyTorch's GEMM and then ``rest(a, b)``."""

    def gated_by_kernel(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if decode_gemm.takes(x, weight, config):
            return decode_gemm.gated(x, weight, config, activation)
        out = F.linear(x, weight)
        half = weight.shape[0] // 2
        return rest(out[..., :half], out[..., half:])

    gated_by_kernel.gated = (config, activation)  # (read by fuser.pipeline.norm_in_gemm)
    gated_by_kernel.decode_gemm_launch = (config, lambda other: gated_linear(other, activation, rest))
    return gated_by_kernel


def _kernel_rest(kernel: Callable, order: list[int]) -> Callable:
    """The product's fused kernel, called on the halves in the order it takes them."""

    def product_by_its_kernel(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        halves = (gate, up)
        return kernel(*(halves[i] for i in order))[0]

    return product_by_its_kernel
