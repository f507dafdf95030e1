"""norm_in_gemm: an RMSNorm whose output only a GEMM on the decode GEMM kernel reads, computed by
that kernel as its prologue: no launch for the norm.

A decoder layer's attention and MLP each start with an RMSNorm of the hidden states (after the
residual add, for the MLP's) and a GEMM of its output (the merged q/k/v projection, the merged
gate/up). Where that GEMM runs on fuser's decode GEMM kernel (:mod:`fuser.pipeline.decode_gemms`,
and :mod:`fuser.pipeline.gated_in_gemm` for the gate/up), each program of the kernel reads the
norm's input rows (a few KB), sums their squares itself and normalises each chunk of the
reduction before its product with the weight (:func:`fuser.install.decode_gemm.normed`); where
the norm is of a residual add, the sum is added there too and stored once, the residual the
layer goes on with. At token counts past the table's ``up_to`` the norm's kernel runs and then
PyTorch's GEMM, as before.

Taken where the norm is found by what it computes — transformers' Llama, Qwen and Mistral norm
(``weight * x.to(dtype)``), an fp32 weight's (``(x * weight).to(dtype)``), Gemma's
(``1 + weight``) — its own kernel computes exactly the norm (and the add before it, of two
tensors of one shape), and the GEMM's input is the norm's output alone.
"""

from __future__ import annotations

import inspect
import operator
from pathlib import Path
from typing import Callable

import torch
import torch.fx as fx

from fuser.install import decode_gemm
from fuser.install.fused_graph import REGION_META
from fuser.match.matcher import match_pattern
from fuser.pattern import Param, Pattern, is_param, tensor
from fuser.trace.tracing import Traced


def _weight_after_cast(x, weight, eps=Param(1e-6)):
    xf = x.to(torch.float32)
    variance = xf.pow(2).mean(-1, keepdim=True)
    xf = xf * torch.rsqrt(variance + eps)
    return weight * xf.to(x.dtype)


def _weight_in_fp32(x, weight, eps=Param(1e-6)):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight).to(x.dtype)


def _one_plus_weight(x, weight, eps=Param(1e-6)):
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).type_as(x)


def _pattern(name: str, reference) -> Pattern:
    params = {n: p.default for n, p in inspect.signature(reference).parameters.items() if is_param(p.default)}
    return Pattern(name=name, path=Path(__file__), reference=reference, template="row_reduce",
                   inputs=dict(x=tensor("T, ..., N", "bfloat16 float16 float32"), weight=tensor("N", "bfloat16 float16 float32")),
                   params=params, example=dict(N=64))  # fmt: skip


#: Each RMSNorm form the kernel's prologue computes (its name in decode_gemm.NORMS), as a pattern.
FORMS: tuple[tuple[Pattern, str], ...] = tuple((_pattern(form, ref), form) for form, ref in (
    ("weight_after_cast", _weight_after_cast), ("weight_in_fp32", _weight_in_fp32), ("one_plus_weight", _one_plus_weight),
))  # fmt: skip


def norm_in_gemm(graph: fx.Graph, traced: Traced, cops: dict, shared: list, handed_over: list) -> tuple[list[str], dict[str, str]]:
    """Rewrite each such norm and its GEMM of the fused ``graph`` in place (``shared``: regions of
    kernels run once per forward; ``handed_over``: those that take the layer before's). Returns
    what was rewritten, and for each norm read by a GEMM on the kernel but left apart, why."""
    if not any(_gemm_kind(n) for n in graph.nodes):
        return [], {}  # no GEMM on the kernel (no table for this GPU): no pattern to match
    done, apart, taken = [], {}, set()
    for pattern, form in FORMS:
        matches, _ = match_pattern(pattern, traced, cops, taken)
        for m in matches:
            taken |= m.nodes
            found = _norm_kernel(graph, m, shared, traced)
            if found is None:
                continue
            kernel, added = found
            outputs = kernel.meta[REGION_META].outputs
            if any(u.op != "call_function" or u.target is not operator.getitem for u in kernel.users):
                continue
            items = {u.args[1]: u for u in kernel.users}
            normed = items.get(outputs.index(m.outputs[0]))
            readers = [u for u in normed.users if not _reads_shape(u)] if normed is not None else []
            gemm = readers[0] if len(readers) == 1 else None
            what = f"{m.outputs[0].name} ({form} RMSNorm{' of an add' if added is not None else ''})"
            if gemm is None or not _gemm_kind(gemm) or gemm.args[0] is not normed or len(gemm.args) != 2 or gemm.kwargs:
                if any(_gemm_kind(u) for u in readers):
                    apart[what] = "its output is read by more than the GEMM's input"
                continue
            if set(items) - {outputs.index(m.outputs[0])} - ({outputs.index(added)} if added is not None else set()):
                apart[what] = "its kernel computes more than the norm and the add"
                continue
            if any(kernel.meta[REGION_META] is r for r in handed_over):
                apart[what] = "its kernel takes the norm the layer before computed (glue across layers)"
                continue
            read = set(kernel.meta[REGION_META].inputs)
            if not ({m.inputs[1], *(added.args if added is not None else m.inputs[:1])} <= read):
                apart[what] = "its kernel reads the norm's inputs through ops of its own (an identity dropout, a view)"
                continue
            done.append(f"{what}: by the decode GEMM kernel of {_weight_name(gemm)}")
            _rewrite(graph, kernel, items, outputs, m, added, gemm, normed, form)
    graph.lint()
    return done, apart


def _weight_name(gemm: fx.Node) -> str:
    weight = gemm.args[1]
    return weight.target if isinstance(weight, fx.Node) and weight.op == "get_attr" else str(weight)


def _reads_shape(node: fx.Node) -> bool:
    """Does ``node`` read only its input's shape (``x.size()``, ``x.shape``, ``x.dim()``)?"""
    if node.op == "call_method":
        return node.target in ("size", "dim")
    return node.op == "call_function" and node.target is getattr and node.args[1:] in (("shape",), ("ndim",))


def _gemm_kind(node: fx.Node) -> str | None:
    """"plain" for a call of the decode GEMM kernel on ``(x, weight)``, "gated" for one of a gated
    pair's (:func:`fuser.pipeline.gated_in_gemm.gated_linear`); None for any other node."""
    if node.op != "call_function":
        return None
    if decode_gemm.config_of(node.target) is not None:
        return "plain"
    return "gated" if getattr(node.target, "gated", None) is not None else None


def _norm_kernel(graph: fx.Graph, m, shared: list, traced: Traced) -> tuple[fx.Node, fx.Node | None] | None:
    """The fused kernel's call that computes exactly the norm of match ``m`` (and the add that
    makes its input, of two tensors of one shape and dtype: returned too), not shared between
    layers; None where there is none."""
    x = m.inputs[0]
    add = x if _is_add(x, traced) else None
    for node in graph.nodes:
        region = node.meta.get(REGION_META)
        if region is None or region.stores or any(region is s for s in shared):
            continue
        if region.covered == m.nodes:
            return node, None
        if add is not None and region.covered == m.nodes | {add} and set(region.outputs) <= {m.outputs[0], add}:
            return node, add
    return None


def _is_add(node: fx.Node, traced: Traced) -> bool:
    """``a + b`` of two tensors of one shape and dtype (a residual add), as traced."""
    if node.op != "call_function" or node.target not in (operator.add, torch.add) or len(node.args) != 2 or node.kwargs:
        return False
    a, b = node.args
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return False
    values = [traced.value(n) for n in (a, b, node)]
    return all(isinstance(v, torch.Tensor) and v.shape == values[2].shape and v.dtype == values[2].dtype for v in values)


def _rewrite(graph: fx.Graph, kernel: fx.Node, items: dict, outputs: list, m, added, gemm: fx.Node, normed: fx.Node,
             form: str) -> None:  # fmt: skip
    """The GEMM becomes :func:`normed_linear` of the norm's inputs; what read the add's sum reads
    the new call's second output; the norm's kernel and its items go."""
    region = kernel.meta[REGION_META]
    inputs = list(region.inputs)
    x_at, weight_at = inputs.index(m.inputs[0]) if added is None else None, inputs.index(m.inputs[1])
    adds_at = tuple(inputs.index(a) for a in added.args) if added is not None else ()
    eps = float(next(iter(m.params.values())))
    call = normed_linear(gemm.target, kernel.target, len(inputs), outputs.index(m.outputs[0]),
                         outputs.index(added) if added is not None else None, x_at, adds_at, weight_at, form, eps)
    weight = gemm.args[1]
    if isinstance(weight, fx.Node) and weight.op == "get_attr":
        kernel.prepend(weight)  # (read by the call standing where the norm's kernel stood)
    with graph.inserting_before(kernel):
        fused = graph.call_function(call, (*kernel.args, weight))
        out = graph.call_function(operator.getitem, (fused, 0))
    gemm.replace_all_uses_with(out)
    graph.erase_node(gemm)
    same_shape = kernel.args[x_at] if added is None else None  # the norm's input, or the add's sum below
    if added is not None:
        sum_item = items[outputs.index(added)]
        with graph.inserting_after(out):
            h = graph.call_function(operator.getitem, (fused, 1))
        sum_item.replace_all_uses_with(h)
        graph.erase_node(sum_item)
        same_shape = h
    for reader in list(normed.users):  # shape reads: of a value of the norm's shape
        reader.replace_input_with(normed, same_shape)
    graph.erase_node(normed)
    graph.erase_node(kernel)


def normed_linear(gemm: Callable, kernel: Callable, arity: int, normed_at: int, sum_at: int | None, x_at: int | None,
                  adds_at: tuple, weight_at: int, form: str, eps: float) -> Callable:  # fmt: skip
    """The GEMM ``gemm`` (the decode GEMM kernel's plain or gated call) of the RMSNorm its
    ``kernel`` computed, in one launch where the kernel takes the call: returns ``(out,)``, or
    ``(out, the add's sum)``. Else ``kernel`` and then ``gemm``, as before."""
    config = decode_gemm.config_of(gemm) or gemm.gated[0]
    activation = gemm.gated[1] if decode_gemm.config_of(gemm) is None else None

    def normed_by_kernel(*args):
        inputs, weight = args[:arity], args[arity]
        x, added = (inputs[x_at], None) if sum_at is None else (inputs[adds_at[0]], inputs[adds_at[1]])
        norm_weight = inputs[weight_at]
        if decode_gemm.takes(x, weight, config) and _takes_norm(x, added, norm_weight):
            norm = decode_gemm.Norm(form, norm_weight, eps, added)
            result = decode_gemm.gated(x, weight, config, activation, norm) if activation else decode_gemm.normed(x, weight, config, norm)
            return result if sum_at is not None else (result,)
        outs = kernel(*inputs)
        out = gemm(outs[normed_at], weight)
        return (out,) if sum_at is None else (out, outs[sum_at])

    def under(other: decode_gemm.Config) -> Callable:
        return normed_linear(decode_gemm.launch_of(gemm)[1](other), kernel, arity, normed_at, sum_at, x_at, adds_at, weight_at, form, eps)

    normed_by_kernel.decode_gemm_launch = (config, under)
    return normed_by_kernel


def _takes_norm(x: torch.Tensor, added: torch.Tensor | None, norm_weight: torch.Tensor) -> bool:
    if norm_weight.shape != (x.shape[-1],) or norm_weight.device != x.device or norm_weight.stride(0) != 1:
        return False
    return added is None or (added.shape == x.shape and added.dtype == x.dtype and added.device == x.device)
