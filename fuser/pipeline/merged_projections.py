"""merged_projections: the linear layers of a fused graph that read one input become one GEMM
on their weights concatenated at apply time (:mod:`fuser.install.merged_weights`), each layer's
output a column slice of its output.

At decode sizes each projection is a GEMV bound by launch latency and by reading its weight; q,
k and v (or gate and up) read the same activation, and one GEMM over their rows reads it once and
launches once. A group is merged only where the result is the same computation: layers that
are exactly ``torch.nn.Linear`` (not a subclass: a quantised linear is one), called on the same
value with nothing written in between, with weights of one dtype, device and input width,
biases on all or none, each weight in memory of its own (not tied to another parameter). A
slice of the merged output is not contiguous; every user of a layer's output that could need
it to be is checked: ``view``-like ops are replayed on a strided meta tensor, fuser's kernels
read strides, torch's own ops take any layout; any other call (a custom kernel in a leaf) keeps
the group apart, with its reason in the report.
"""

from __future__ import annotations

import operator
from collections import Counter

import torch
import torch.fx as fx
import torch.nn as nn

from fuser.canon.canonicalize import UNIT_VIEW, VIEW
from fuser.install.merged_weights import Group, MergedWeights
from fuser.trace.tracing import Traced


def merge_projections(graph: fx.Graph, module: nn.Module, traced: Traced, cops: dict, covered: set):
    """Merge the groups of ``graph`` (in place); returns ``(MergedWeights or None, what was
    merged, what was not and why)``."""
    owners = Counter(p.untyped_storage().data_ptr() for _, p in module.named_parameters(remove_duplicate=False))
    traced_nodes = {n.name: n for n in traced.graph.nodes}
    groups, merged, refused = [], [], {}
    for members in _candidates(graph, module):
        names = " + ".join(n.target for n in members)
        why = _why_not(members, module, owners, graph) or _layout_problem(members, module, traced, traced_nodes, cops, covered)
        if why:
            refused[names] = why
            continue
        group = Group.of(tuple(n.target for n in members), module.get_submodule(members[0].target).bias is not None)
        _rewrite(graph, members, group, module)
        groups.append(group)
        merged.append(names)
    return (MergedWeights(tuple(groups)) if groups else None), merged, refused


def _linear(module: nn.Module, node: fx.Node) -> nn.Linear | None:
    if node.op != "call_module" or len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], fx.Node):
        return None
    sub = module.get_submodule(node.target)
    return sub if type(sub) is nn.Linear and "forward" not in sub.__dict__ else None  # (an instance forward: a wrapper's)


def _candidates(graph: fx.Graph, module: nn.Module) -> list[list[fx.Node]]:
    """Linear calls on one value, parted by what must agree (dtype, device, input width, bias)."""
    by_input: dict = {}
    for node in graph.nodes:
        layer = _linear(module, node)
        if layer is not None:
            w = layer.weight
            key = (node.args[0], w.dtype, w.device, w.shape[1], layer.bias is not None)
            by_input.setdefault(key, []).append(node)
    return [members for members in by_input.values() if len(members) > 1]


def _why_not(members: list[fx.Node], module: nn.Module, owners: Counter, graph: fx.Graph) -> str | None:
    layers = [module.get_submodule(n.target) for n in members]
    for kind in ("weight", "bias"):
        params = [getattr(layer, kind) for layer in layers]
        if params[0] is None:
            continue
        if len({p.untyped_storage().data_ptr() for p in params}) == 1 and _consecutive(params):
            continue  # already the rows of one tensor (merged before, restored): merged again
        for name, p in zip((n.target for n in members), params):
            if not p.is_contiguous() or p.untyped_storage().nbytes() != p.numel() * p.element_size():
                return f"{name}.{kind} shares its memory with another tensor"
            if owners[p.untyped_storage().data_ptr()] > 1:
                return f"{name}.{kind} is tied to another parameter"
    order = list(graph.nodes)
    first, last = order.index(members[0]), order.index(members[-1])
    for node in order[first:last]:
        if node.op == "call_method" and node.target.endswith("_") or node.target in (operator.setitem,):
            return f"`{node.name}` writes in place between the layers' calls"
    return None


def _consecutive(params) -> bool:
    at = params[0].data_ptr()
    for p in params:
        if p.data_ptr() != at or not p.is_contiguous():
            return False
        at += p.numel() * p.element_size()
    return at - params[0].untyped_storage().data_ptr() == params[0].untyped_storage().nbytes()


def _layout_problem(members, module, traced: Traced, traced_nodes: dict, cops: dict, covered: set) -> str | None:
    """Why a user of a layer's output could not take a column slice of the merged output; None
    when every one can."""
    widths = [module.get_submodule(n.target).weight.shape[0] for n in members]
    offset = 0
    for node, width in zip(members, widths):
        origin = traced_nodes.get(node.name)
        if origin is None or origin.target != node.target:
            return f"`{node.name}` is not in the traced graph"
        value = traced.value(origin)
        whole = torch.empty((*value.shape[:-1], sum(widths)), dtype=value.dtype, device="meta")
        problem = _users_take(origin, whole[..., offset : offset + width], traced, cops, covered)
        if problem:
            return problem
        offset += width
    return None


def _users_take(node: fx.Node, strided: torch.Tensor, traced: Traced, cops: dict, covered: set) -> str | None:
    for user in node.users:
        if user in covered or user.op == "output":
            continue  # a fused kernel reads its inputs' strides; the caller gets a view
        cop = cops.get(user)
        if cop is not None and cop.kind in (VIEW, UNIT_VIEW):
            try:
                args, kwargs = torch.fx.node.map_arg((user.args, user.kwargs), lambda a: strided if a is node else _meta(traced.value(a)))
                result = getattr(torch.Tensor, user.target)(*args, **kwargs) if user.op == "call_method" else user.target(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - any failure keeps the group apart, said
                return f"`{user.name}` ({user.target}) cannot take a column slice: {type(e).__name__}: {e}"
            if isinstance(result, torch.Tensor):
                problem = _users_take(user, result, traced, cops, covered)
                if problem:
                    return problem
        elif not _takes_any_layout(user, traced):
            return f"`{user.name}` may need its input contiguous (not one of torch's own ops)"
    return None


def _meta(value):
    return torch.empty_like(value, device="meta") if isinstance(value, torch.Tensor) else value


def _takes_any_layout(node: fx.Node, traced: Traced) -> bool:
    if node.op == "call_method":
        return True  # a tensor method
    if node.op == "call_module":
        return type(traced.root.get_submodule(node.target)).__module__.startswith("torch.nn")
    module = getattr(node.target, "__module__", None) or ""
    return node.target in vars(operator).values() or module.startswith("torch")


def _rewrite(graph: fx.Graph, members: list[fx.Node], group: Group, module: nn.Module) -> None:
    """One ``F.linear`` on the merged weight where the first layer was called, each layer's
    output its slice."""
    widths = [module.get_submodule(n.target).weight.shape[0] for n in members]
    with graph.inserting_before(members[0]):
        weight = graph.get_attr(group.weight)
        bias = graph.get_attr(group.bias) if group.bias else None
        out = graph.call_function(torch.nn.functional.linear, (members[0].args[0], weight, bias))
        out.name = "merged_" + members[0].name
        offset = 0
        for node, width in zip(members, widths):
            piece = graph.call_function(operator.getitem, (out, (Ellipsis, slice(offset, offset + width))))
            node.replace_all_uses_with(piece)
            offset += width
    for node in members:
        graph.erase_node(node)
