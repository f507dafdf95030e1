"""next_layer_entry: the next layer's first kernel computed by this layer's last one — glue across
layers.

A stack of decoder layers hands its hidden states from each layer to the next: a layer's last
glue makes them (its residual add) and the next layer's first kernel reads them with its own
weights (its input norm). Each layer fused on its own, those are two launches. Here a layer's
traced graph gets, after its output, a copy of the nodes of the next layer's *entry* kernel —
a kernel that reads only the hidden states and parameters and writes into no other tensor —
reading this layer's output and the next layer's parameters (through the attribute
:data:`NEXT`, a :class:`NextLayer`). The region builder fuses the copy into the kernel that
makes the output, and a :class:`HandOver` call after it leaves the copy's results in the model
forward's memo (:mod:`fuser.install.once_per_forward`), keyed on what the next layer's entry
kernel will be launched on: its launcher, the hidden states (memory, sizes, strides, version
counter) and the weights. The next layer's launch of its entry kernel looks there first
(:func:`~fuser.install.once_per_forward.take_handed_over`; each result is taken once, a fresh
buffer as a launch's would be) and runs only on a miss: the first layer, a layer called on its
own, hidden states written in between (their version moved), a next layer of other weights. A
hit is the very launch, on the very tensors, that the next layer would make, so where
:data:`NEXT` points decides only whether work is saved, never what a layer computes. Version
counters see every write PyTorch makes; a kernel of the model's own writing through a pointer
moves none, so no entry is taken where a leaf or an in-place op given the hidden states runs
before it in the next layer (:func:`entries_of`); the model's code between two layers (a plain
loop in transformers' models) is not looked at.

:mod:`fuser.model.fuse_model` plans a layer without it, finds the entry kernels
(:func:`entries_of`), plans it again with them (:func:`add_next_entries` runs right after the
trace: pass ``next_layer_entry``; ``glue_across_layers`` links each hand-over to the plan's
own entry kernel), and keeps the second plan where it saves launches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn

from fuser.install import once_per_forward as memo
from fuser.install.fixed_at_apply import read_attributes
from fuser.ir.canonical_op import META, MUTATION, UNIT_VIEW, VIEW
from fuser.trace.leaves import LEAF
from fuser.trace.tracer import run_node
from fuser.trace.tracing import Traced

#: The attribute of a fused layer that holds the layer its output goes to.
NEXT = "_fuser_next"


@dataclass(frozen=True)
class Entry:
    """A kernel of the first plan that reads only the hidden states and parameters (and writes
    into no other tensor): the traced nodes it computes (graph order; the views and no-op casts
    of the hidden states it reads through included), its inputs in launch order and its
    outputs, by name."""

    kernel: str
    hidden: str
    nodes: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def entries_of(kernels, traced: Traced, cops: dict, shared) -> tuple[list[Entry], str | None]:
    """The entry kernels among ``kernels`` (a plan's), and why there are none."""
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    if not placeholders:
        return [], "the layer has no input"
    hidden = placeholders[0]
    out = hidden_output(traced)
    if out is None or not _like(traced.value(out), traced.value(hidden)):
        return [], "the layer's output is not a tensor like its first input"
    order = {n: i for i, n in enumerate(traced.graph.nodes)}
    found = []
    for k in kernels:
        r = k.region
        if r.stores or k in shared or _written_before(hidden, r.position, traced, cops):
            continue
        nodes = _between(hidden, r, traced, cops)
        if nodes is not None:
            found.append(Entry(k.path.stem if k.path else "", hidden.name, tuple(n.name for n in sorted(nodes, key=order.__getitem__)),
                               tuple(n.name for n in r.inputs), tuple(n.name for n in r.outputs)))  # fmt: skip
    return found, None if found else ("no kernel reads only the hidden states and parameters (an input norm) "
                                      "before a leaf or an in-place op may write them")


def _written_before(hidden: fx.Node, position: fx.Node | None, traced: Traced, cops: dict) -> bool:
    """Does a leaf or an in-place op that may write the hidden states (given them, or a view of
    them) run before ``position``? A leaf's write through a pointer moves no version counter,
    so results handed over before it could be stale."""
    views = {hidden}
    for node in traced.graph.nodes:
        if node is position:
            return False
        cop = cops.get(node)
        reads = views.intersection(node.all_input_nodes)
        if reads and cop is not None and cop.kind in (VIEW, UNIT_VIEW):
            views.add(node)
        elif reads and (node.meta.get(LEAF) or cop is None or cop.kind == MUTATION):
            return True
    return False


def _between(hidden: fx.Node, region, traced: Traced, cops: dict) -> set[fx.Node] | None:
    """The nodes the region computes from ``hidden``: its covered nodes, and the views and
    no-op casts it reads through; None where it reads anything but ``hidden`` and parameters."""
    nodes, seen, reads_hidden = set(region.covered), set(), False
    todo = [*region.covered, *region.inputs]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node is hidden:
            reads_hidden = True
            continue
        if node.op == "get_attr" and isinstance(traced.value(node), nn.Parameter):
            continue
        if node not in region.covered:
            cop = cops.get(node)
            if node.op == "placeholder" or cop is None or not (cop.kind in (VIEW, UNIT_VIEW, META) or cop.op == "identity"):
                return None  # another input, or a value computed elsewhere
            nodes.add(node)
        todo += node.all_input_nodes
    return nodes if reads_hidden else None


def hidden_output(traced: Traced) -> fx.Node | None:
    """The node the layer returns as its hidden states: its output, or the first of a tuple."""
    output = next(n for n in traced.graph.nodes if n.op == "output")
    value = output.args[0]
    while isinstance(value, (tuple, list)) and value:
        value = value[0]
    return value if isinstance(value, fx.Node) and isinstance(traced.value(value), torch.Tensor) else None


def _like(a, b) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype


# --- the second plan's trace -----------------------------------------------------------------------
class HandOver:
    """The node that leaves an entry's results, computed for the next layer, in the memo. Its
    arguments: the entry kernel's inputs (as :class:`Entry` orders them), then its outputs.
    Linked to the plan's own entry kernel once planned (:meth:`link`); unlinked, it does
    nothing."""

    __fuser_opaque__ = True  # a leaf: kept where it is, never fused

    def __init__(self, entry: Entry):
        self.entry = entry
        self.__name__ = self.__qualname__ = f"hand_over_{entry.kernel or 'entry'}"
        self.__module__ = __name__
        self.launch = None  # the entry kernel's launcher (the plan's)
        self.inputs: tuple[int, ...] = ()  # launch argument i is argument inputs[i] here
        self.outputs: tuple[int, ...] = ()  # launch output i is output outputs[i] here

    def link(self, kernel) -> bool:
        """Hand over to ``kernel`` (the plan's entry kernel of the same nodes): False where its
        inputs or outputs are not the entry's."""
        r = kernel.region
        inputs, outputs = [n.name for n in r.inputs], [n.name for n in r.outputs]
        if sorted(inputs) != sorted(self.entry.inputs) or sorted(outputs) != sorted(self.entry.outputs):
            return False
        self.inputs = tuple(self.entry.inputs.index(n) for n in inputs)
        self.outputs = tuple(self.entry.outputs.index(n) for n in outputs)
        self.launch = kernel.launch
        return True

    def __call__(self, *values):
        if self.launch is None:
            return None
        count = len(self.entry.inputs)
        args = tuple(values[i] for i in self.inputs)
        results = tuple(values[count + i] for i in self.outputs)
        memo.hand_over(self.launch, args, results)
        return None


def computing_kernels(kernels, graph: fx.Graph, hand: HandOver) -> list[str]:
    """The names of the kernels (of a plan over ``graph``) that compute what ``hand`` hands over."""
    node = next(n for n in graph.nodes if n.target is hand)
    outputs = set(node.args[len(hand.entry.inputs):])
    return [k.path.stem for k in kernels if k.path and outputs & set(k.region.outputs)]


def add_next_entries(traced: Traced, entries: list[Entry], module: nn.Module) -> list[HandOver]:
    """After the layer's output, each entry's nodes again, reading the output for the hidden
    states and ``module.<NEXT>``'s parameters for the layer's own; each followed by its
    :class:`HandOver`. Their example values are computed on the example's (the planning layer's
    :data:`NEXT` must be set). Returns the hand-over nodes' targets, in ``entries``' order."""
    graph = traced.graph
    output = next(n for n in graph.nodes if n.op == "output")
    out = hidden_output(traced)
    by_name = {n.name: n for n in graph.nodes}
    made = []
    for entry in entries:
        env: dict[fx.Node, fx.Node] = {by_name[entry.hidden]: out}
        with graph.inserting_before(output):
            for name in entry.inputs:
                node = by_name[name]
                if node.op == "get_attr":
                    env[node] = read = graph.get_attr(f"{NEXT}.{node.target}")
                    (value,) = read_attributes(module, (read.target,))
                    traced.shadows[read.name] = (value, value)
            for name in entry.nodes:
                node = by_name[name]
                env[node] = copied = graph.node_copy(node, lambda n: env[n])
                copied.meta = {k: v for k, v in node.meta.items() if k != LEAF}
                traced.shadows[copied.name] = tuple(_run(copied, traced, side, module) for side in (0, 1))
            hand = HandOver(entry)
            call = graph.call_function(hand, tuple(env[by_name[n]] for n in entry.inputs + entry.outputs))
            call.meta[LEAF] = True
            traced.shadows[call.name] = (None, None)
        made.append(hand)
    graph.lint()
    return made


def _run(node: fx.Node, traced: Traced, side: int, module: nn.Module):
    """``node`` run eagerly on its inputs' example values at batch size ``side`` (0: T, 1: T+1)."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: traced.shadows[n.name][side])
    return run_node(node.op, node.target, args, kwargs, module)


# --- the layer a fused layer hands over to ------------------------------------------------------
@dataclass
class NextLayer:
    """The layer after a fused one in its stack (``stack[index]``), read through at each call:
    ``getattr(layer, NEXT).input_layernorm.weight``. Not a submodule (``state_dict``, ``.to()``
    and the module tree do not see it). A deep copy of the model points into the copy's
    stack; a copy of the layer alone keeps pointing into the original's (its hand-overs then
    meet no launch: it computes the same, as a layer called on its own does)."""

    stack: nn.Module
    index: int

    def __getattr__(self, name):
        if name.startswith("__") or name in ("stack", "index"):
            raise AttributeError(name)
        return getattr(self.stack[self.index], name)

    def __deepcopy__(self, copies: dict) -> "NextLayer":
        return NextLayer(copies.get(id(self.stack), self.stack), self.index)

    def __copy__(self) -> "NextLayer":
        return NextLayer(self.stack, self.index)

