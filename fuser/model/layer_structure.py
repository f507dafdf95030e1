"""layer_structure: when two layers of a model can run one fused forward — the same structure
(:func:`structure`), and traces that are alike (:func:`graph_key`), or that differ only in int
arguments of leaf calls, each one attribute of the layer (:func:`attributes_read_by_leaves`),
which the fused graph then reads at run time (:func:`read_argument_at_run_time`)."""

from __future__ import annotations

import torch
import torch.nn as nn

from fuser.trace.leaves import LEAF, TOOK_OVER
from fuser.trace.refusal import module_path
from fuser.pipeline.fuse_module import Plan
from fuser.install.fixed_at_apply import read_attributes


def structure(layer: nn.Module) -> tuple:
    """What two layers must share to run one fused forward: class, parameter and buffer names,
    shapes and dtypes, and every flag, name or None attribute of the layer and its submodules
    (``is_sliding``, ``layer_type``: the trace takes their branches). Integer and float
    attributes are compared where the fused graph holds them (its literals)."""
    tensors = tuple((n, tuple(t.shape), t.dtype) for n, t in (*layer.named_parameters(), *layer.named_buffers()))
    flags = tuple(
        (name, key, value)
        for name, sub in layer.named_modules()
        for key, value in sorted(vars(sub).items())
        if not key.startswith("_") and (value is None or isinstance(value, (bool, str)))
    )
    return type(layer), tensors, flags


def groups_of(layers: list[tuple[str, nn.Module]], leaves=()) -> list[list[tuple[str, nn.Module]]]:
    """``layers`` (name, layer) in groups of one :func:`structure`, each in model order; layers
    whose submodules named as leaves (module instances among ``leaves``) differ by their names
    in the layer are apart (one layer's ``mlp`` named a leaf: that layer is planned alone)."""
    instances = {id(x) for x in leaves if isinstance(x, nn.Module)}
    groups: dict[tuple, list] = {}
    for name, layer in layers:
        named = tuple(sorted(n for n, m in layer.named_modules() if id(m) in instances))
        groups.setdefault((structure(layer), named), []).append((name, layer))
    return list(groups.values())


def attributes_read_by_leaves(p: Plan, first: nn.Module, layer: nn.Module, graph) -> list | None:
    """Where ``graph`` (``layer``'s trace) differs from ``p``'s only in int arguments of leaf
    calls, each the value of one attribute the plan holds as a literal in both layers: those
    (node name, argument position, attribute path); None when they differ in anything else."""
    mine, theirs = list(p.traced_graph.nodes), list(graph.nodes)
    if len(mine) != len(theirs):
        return None
    paths = tuple(p.literals)
    at_first, at_layer = dict(zip(paths, read_attributes(first, paths))), dict(zip(paths, read_attributes(layer, paths)))
    index_a, index_b = {n: i for i, n in enumerate(mine)}, {n: i for i, n in enumerate(theirs)}
    read = []
    for a, b in zip(mine, theirs):
        key_a, key_b = _node_key(a, index_a), _node_key(b, index_b)
        if key_a == key_b:
            continue
        same_call = (a.op, str(a.target), len(a.args), _keyed(a.kwargs, index_a)) == (b.op, str(b.target), len(b.args), _keyed(b.kwargs, index_b))
        if not a.meta.get(LEAF) or not same_call:
            return None
        for position, (x, y) in enumerate(zip(a.args, b.args)):
            if _keyed(x, index_a) == _keyed(y, index_b):
                continue
            if type(x) is not int or type(y) is not int:
                return None
            names = [n for n in paths if at_first[n] == x and at_layer[n] == y]
            if len(names) > 1:  # (a layer's and its attention's layer_idx): the calling module's own
                names = [n for n in names if n.rpartition(".")[0] == module_path(a)]
            if len(names) != 1:
                return None
            read.append((a.name, position, names[0]))
    return read


def _node_key(node, index) -> tuple:
    return node.op, str(node.target), _keyed(node.args, index), _keyed(node.kwargs, index)


def _keyed(value, index) -> str:
    """``value`` (a node's arguments, or one of them) with each node as its place in the graph."""
    return repr(torch.fx.node.map_aggregate(value, lambda a: ("node", index[a]) if isinstance(a, torch.fx.Node) else a))


def read_argument_at_run_time(graph, node_name: str, position: int, attribute: str) -> None:
    """Make argument ``position`` of the node named ``node_name`` (or of the call that took its
    place, :data:`~fuser.trace.leaves.TOOK_OVER`) a read of ``self.<attribute>``."""
    node = next(n for n in graph.nodes if node_name in (n.name, n.meta.get(TOOK_OVER)))
    with graph.inserting_before(node):
        read = graph.get_attr(attribute)
    node.update_arg(position, read)


def graph_key(graph) -> list:
    """The graph's ops in order, with their literal arguments and which nodes they read."""
    index = {n: i for i, n in enumerate(graph.nodes)}
    return [_node_key(n, index) for n in graph.nodes]
