"""per_slice_norms: one LayerNorm applied to each slice of a tensor, with weights of its own per
slice, and the slices put back together — rewritten in a traced graph as one LayerNorm over the
whole tensor with the weights stacked.

StableLM's per-head q/k norms (transformers' ``StableLmLayerNormPerHead``) are written

    torch.cat([norm_h(x_h) for norm_h, x_h in zip(self.norms, torch.split(x, 1, dim=1))], dim=1)

which traces into a split, one ``F.layer_norm`` a head (each with its own ``get_attr`` weight)
and a cat. A kernel of that graph normalizes every head and then picks each head's part, one
select a head; as one norm it reads each row once:

    (F.layer_norm(x.float(), shape, None, None, eps) * W + B).to(x.dtype)

``W`` is the slices' weights stacked along the split dim (``torch.stack`` of each weight viewed
to broadcast against ``x``), ``B`` likewise: values of parameters alone, which the pipeline's
``precompute`` step computes at apply time and again whenever a weight changes (where no kernel
takes them in). The affine part is computed in fp32 and rounded once, as eager's LayerNorm
does; without weights or biases the norm is the one each slice had, on the whole tensor.

Rewritten only when all of this holds (anything else is left as it was):

- ``torch.split(x, 1, dim)`` / ``x.split(1, dim)``, ``torch.chunk`` / ``x.chunk`` into parts
  one wide, or ``torch.unbind`` / ``x.unbind``, along a dim that does not follow the tokens and
  comes before the normalized dims (slices wider than one would need the weights repeated
  along the dim or ``x`` reshaped around the norm: not done);
- every part, in order, the input of an ``F.layer_norm`` of the same normalized shape and eps,
  whose weights are all parameters of that shape and one dtype or all absent, biases likewise,
  and whose result nothing but the join reads;
- those results joined in that order along the split dim: ``torch.cat`` (``torch.stack`` after
  an unbind), giving a tensor of ``x``'s shape.
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

_LAYER_NORM_ARGS = tuple(inspect.signature(F.layer_norm).parameters)  # input, normalized_shape, weight, bias, eps
_SPLIT_FUNCTIONS = {torch.split: "split", torch.chunk: "chunk", torch.unbind: "unbind"}
_SPLIT_METHODS = ("split", "chunk", "unbind")
# each split's parameters after the tensor, as the function and the method name them
_SPLIT_ARGS = {
    ("call_function", "split"): ("split_size_or_sections", "dim"),
    ("call_method", "split"): ("split_size", "dim"),
    ("call_function", "chunk"): ("chunks", "dim"),
    ("call_method", "chunk"): ("chunks", "dim"),
    ("call_function", "unbind"): ("dim",),
    ("call_method", "unbind"): ("dim",),
}
_CATS = (torch.cat, torch.concat, torch.concatenate)


@dataclass
class PerSliceNorms:
    """A matched join: the tensor split, along which dim, the per-slice norms in order, and
    what they share (weights and biases: one node a slice)."""

    source: fx.Node
    dim: int
    norms: list[fx.Node]
    shape: tuple[int, ...]
    eps: float
    weights: list[fx.Node] | None
    biases: list[fx.Node] | None


def per_slice_norms(graph: fx.Graph, shadows: dict, state: list) -> list:
    """Trace rewrite: a LayerNorm per slice of one tensor, joined back, as one LayerNorm with
    the weights stacked (this module); ``shadows`` gets the new nodes' values. Changes nothing
    the report lists."""
    for node in list(graph.nodes):
        found = matched(node, shadows)
        if found is not None:
            _rewrite(graph, shadows, node, found)
    graph.lint()
    return []


def matched(join: fx.Node, shadows: dict) -> PerSliceNorms | None:
    """The per-slice norms that ``join`` puts back together, or None where it is anything else."""
    if join.op != "call_function" or join.target not in (*_CATS, torch.stack) or len(join.args) > 2:
        return None
    parts = join.args[0] if join.args else join.kwargs.get("tensors")
    dim = join.args[1] if len(join.args) > 1 else join.kwargs.get("dim", 0)
    if not isinstance(parts, (list, tuple)) or len(parts) < 2 or not isinstance(dim, int):
        return None
    norms = [_layer_norm(p) for p in parts]
    if None in norms or any(len(p.users) != 1 for p in parts):
        return None  # a part that is no norm, or a norm read elsewhere too
    split = _split_of([n["input"] for n in norms], shadows)
    if split is None or (split[0] == "unbind") != (join.target is torch.stack):
        return None  # a cat after a split or chunk, a stack after an unbind
    _, source, split_dim, width = split
    if width != 1:
        return None  # slices wider than one: not rewritten (module docstring)
    x, out = _tensors(shadows, source), _tensors(shadows, join)
    if x is None or out is None or any(a.shape != b.shape for a, b in zip(x, out)):
        return None
    rank = x[0].dim()
    if split_dim % rank != dim % rank or x[0].shape[split_dim] != x[1].shape[split_dim]:
        return None  # joined along another dim, or split along the tokens
    shape, eps = norms[0]["normalized_shape"], norms[0]["eps"]
    if not isinstance(shape, (tuple, list)) or not all(type(s) is int for s in shape) or not isinstance(eps, (int, float)):
        return None
    shape = tuple(shape)
    if any(tuple(n["normalized_shape"]) != shape or n["eps"] != eps for n in norms):
        return None
    if split_dim % rank >= rank - len(shape):
        return None  # the split dim is one of the normalized dims
    weights = _parameters([n["weight"] for n in norms], shadows, shape)
    biases = _parameters([n["bias"] for n in norms], shadows, shape)
    if weights is False or biases is False:
        return None
    return PerSliceNorms(source, split_dim % rank, list(parts), shape, float(eps), weights, biases)


def _layer_norm(node) -> dict | None:
    """The arguments of an ``F.layer_norm`` call by name, or None where ``node`` is no such call."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target is not F.layer_norm:
        return None
    if len(node.args) > len(_LAYER_NORM_ARGS) or any(k not in _LAYER_NORM_ARGS for k in node.kwargs):
        return None
    bound = {"weight": None, "bias": None, "eps": 1e-5, **dict(zip(_LAYER_NORM_ARGS, node.args)), **node.kwargs}
    return bound if isinstance(bound.get("input"), fx.Node) and "normalized_shape" in bound else None


def _split_of(pieces: list[fx.Node], shadows: dict) -> tuple | None:
    """(the split's kind, the tensor split, the dim, each part's width along it) where
    ``pieces`` are all the parts of one split into parts of one size, in order; else None."""
    if not all(p.op == "call_function" and p.target is operator.getitem and len(p.args) == 2 for p in pieces):
        return None
    split = pieces[0].args[0]
    if not isinstance(split, fx.Node) or any(p.args[0] is not split or p.args[1] != i for i, p in enumerate(pieces)):
        return None
    kind = _SPLIT_FUNCTIONS.get(split.target) if split.op == "call_function" else split.target
    names = _SPLIT_ARGS.get((split.op, kind))
    if names is None or not split.args or not isinstance(split.args[0], fx.Node):
        return None
    source, args = split.args[0], split.args[1:]
    if len(args) > len(names) or any(k not in names for k in split.kwargs):
        return None
    dim = {"dim": 0, **dict(zip(names, args)), **split.kwargs}["dim"]
    made = shadows.get(split.name)
    if not isinstance(dim, int) or made is None:
        return None
    widths = set()
    for parts in made:
        if not isinstance(parts, (tuple, list)) or len(parts) != len(pieces) or not all(isinstance(v, torch.Tensor) for v in parts):
            return None  # not every part is normed
        widths |= {1 if kind == "unbind" else v.shape[dim] for v in parts}
    if len(widths) != 1:
        return None  # parts of different sizes
    return kind, source, dim, widths.pop()


def _tensors(shadows: dict, node: fx.Node) -> tuple | None:
    pair = shadows.get(node.name)
    return pair if pair is not None and all(isinstance(v, torch.Tensor) for v in pair) else None


def _parameters(nodes: list, shadows: dict, shape: tuple) -> list[fx.Node] | None | bool:
    """``nodes`` where each reads a parameter (``get_attr``) of ``shape``, all of one dtype;
    None where every one is absent; False otherwise."""
    if all(n is None for n in nodes):
        return None
    if not all(isinstance(n, fx.Node) and n.op == "get_attr" for n in nodes):
        return False
    values = [shadows.get(n.name, (None,))[0] for n in nodes]
    if not all(isinstance(v, torch.nn.Parameter) and tuple(v.shape) == shape for v in values):
        return False
    return nodes if len({v.dtype for v in values}) == 1 else False


def _rewrite(graph: fx.Graph, shadows: dict, join: fx.Node, found: PerSliceNorms) -> None:
    """Put the one norm in place of ``join`` (with its values at both traced sizes), and erase
    the per-slice norms and what only they read."""
    x = shadows[found.source.name][0]
    dtype = x.dtype
    # each weight's shape against x: ones from the dim after the split one up to the normalized dims
    each = (1,) * (x.dim() - len(found.shape) - found.dim - 1) + found.shape
    made: dict[fx.Node, list] = {}

    def value(node: fx.Node, at: int):
        return made[node][at] if node in made else shadows[node.name][at]

    def add(op: str, target, *args, **kwargs) -> fx.Node:
        node = graph.create_node(op, target, args, kwargs)
        node.meta = dict(join.meta)
        run = (lambda a, *rest, **k: getattr(a, target)(*rest, **k)) if op == "call_method" else target
        made[node] = []
        for at in (0, 1):
            args_at, kwargs_at = fx.node.map_arg((args, kwargs), lambda a: value(a, at))
            made[node].append(run(*args_at, **kwargs_at))
        return node

    def stacked(params: list[fx.Node]) -> fx.Node:
        # Each parameter viewed first, the stack last: the value a kernel reads is the stack
        # itself, which ``precompute`` can hold.
        if each != found.shape:
            params = [add("call_method", "view", p, *each) for p in params]
        return add("call_function", torch.stack, list(params))

    with graph.inserting_before(join):
        out = found.source
        if (found.weights or found.biases) and dtype != torch.float32:
            out = add("call_method", "float", out)
        out = add("call_function", F.layer_norm, out, found.shape, weight=None, bias=None, eps=found.eps)
        if found.weights is not None:
            out = add("call_function", operator.mul, out, stacked(found.weights))
        if found.biases is not None:
            out = add("call_function", operator.add, out, stacked(found.biases))
        if made[out][0].dtype != dtype:
            out = add("call_method", "to", out, dtype)
    for node, pair in made.items():
        shadows[node.name] = tuple(pair)
    join.replace_all_uses_with(out)
    pieces = [norm.args[0] if norm.args else norm.kwargs["input"] for norm in found.norms]
    for node in [join, *found.norms, *pieces, pieces[0].args[0]]:
        if not node.users:
            graph.erase_node(node)
