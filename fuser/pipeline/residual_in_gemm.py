"""residual_in_gemm: a residual added to a linear layer's output is added by the GEMM itself.

A decoder layer ends with ``hidden = residual + down_proj(x)``: after each layer's glue is fused,
that add is left alone between the GEMM and the next layer (one launch a layer: 16 in a
Llama-3.2-1B step), since the next layer's first kernel belongs to another call. A GEMM can add
to what its output buffer holds (BLAS's ``C = A·B + beta·C`` with beta = 1), so where the residual
is a buffer of this forward that nothing else reads — an output of one of the fused kernels, not
an input of the call, not a kernel's output shared across layers, not written into a slice of
another tensor — the add and the linear layer become one ``addmm_`` into that buffer: no launch
for the add, the residual read once by the GEMM's epilogue. The result is the same sum, rounded
once where eager rounds the product and then the sum.

Only exactly ``torch.nn.Linear`` (not a subclass: a quantised linear is one) without a bias,
without hooks or a forward of its own set on the instance, its output read by the add alone, with the residual, the product and the weight
of one dtype and the sum of the product's shape (no broadcasting). The weight is read from the
module at each call, so a weight loaded or updated after apply is used.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn as nn

from fuser.install.fused_graph import REGION_META
from fuser.trace.tracing import Traced

_ADDS = (operator.add, torch.add)


def accumulate(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``residual + x @ weight.T``, computed by one GEMM into ``residual`` (beta = 1)."""
    if not residual.is_contiguous():  # (a kernel's outputs are; any other layout still gets the sum)
        return residual + torch.nn.functional.linear(x, weight)
    residual.view(-1, residual.shape[-1]).addmm_(x.reshape(-1, x.shape[-1]), weight.t())
    return residual


def residuals_in_gemm(graph: fx.Graph, module: nn.Module, traced: Traced, shared: list) -> list[tuple[str, str]]:
    """Rewrite every such add of the fused ``graph`` in place (``shared``: the regions of kernels
    run once per model forward, whose outputs other layers read too); returns the traced name
    of each add rewritten with its linear layer's (``("add_5", "mlp.down_proj")``)."""
    traced_nodes = {n.name: n for n in traced.graph.nodes}
    done = []
    for add in list(graph.nodes):
        pair = _residual_and_linear(add, module, shared)
        if pair is None or not _same_shape_and_dtype(add, pair, module, traced_nodes, traced):
            continue
        residual, linear = pair
        with graph.inserting_before(add):
            weight = graph.get_attr(f"{linear.target}.weight")
            summed = graph.call_function(accumulate, (residual, linear.args[0], weight))
        add.replace_all_uses_with(summed)
        graph.erase_node(add)
        graph.erase_node(linear)
        done.append((add.name, linear.target))
    graph.lint()
    return done


def _residual_and_linear(add: fx.Node, module: nn.Module, shared: list) -> tuple[fx.Node, fx.Node] | None:
    is_add = (add.op == "call_function" and add.target in _ADDS) or (add.op == "call_method" and add.target == "add")
    if not is_add or len(add.args) != 2 or add.kwargs or not all(isinstance(a, fx.Node) for a in add.args):
        return None
    for linear, residual in (add.args, add.args[::-1]):
        if plain_linear(linear, module) and set(linear.users) == {add} and _fresh(residual, shared) and set(residual.users) == {add}:
            return residual, linear
    return None


def plain_linear(node: fx.Node, module: nn.Module, bias: bool = False) -> bool:
    """Is ``node`` a call of exactly ``torch.nn.Linear``, with a bias or (``bias=False``) without,
    no hooks, no forward set on the instance?"""
    if node.op != "call_module" or len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], fx.Node):
        return False
    layer = module.get_submodule(node.target)
    hooks = (layer._forward_hooks, layer._forward_pre_hooks, nn.modules.module._global_forward_hooks,
             nn.modules.module._global_forward_pre_hooks)  # fmt: skip
    # (a forward set on the instance, an offloading wrapper's, runs only when the module is called)
    return type(layer) is nn.Linear and "forward" not in layer.__dict__ and (layer.bias is not None) == bias and not any(hooks)


def _fresh(node: fx.Node, shared: list) -> bool:
    """Is ``node`` an output of a fused kernel that allocates it at each call, read by no other
    call (not a kernel shared across layers, not written into another tensor's slice)?"""
    if node.op != "call_function" or node.target is not operator.getitem:
        return False
    call, k = node.args
    region = call.meta.get(REGION_META) if isinstance(call, fx.Node) else None
    if region is None or any(region is s for s in shared) or not isinstance(k, int):
        return False
    return region.outputs[k] not in region.stores


def _same_shape_and_dtype(add: fx.Node, pair, module: nn.Module, traced_nodes: dict, traced: Traced) -> bool:
    residual, linear = pair
    call, k = residual.args
    values = [traced.value(call.meta[REGION_META].outputs[k])]
    for node in (add, linear):
        origin = traced_nodes.get(node.name)
        if origin is None:
            return False
        values.append(traced.value(origin))
    weight = module.get_submodule(linear.target).weight
    if not all(isinstance(v, torch.Tensor) for v in values):
        return False
    return len({(tuple(v.shape), v.dtype) for v in values}) == 1 and weight.dtype == values[0].dtype
