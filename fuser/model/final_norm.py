"""final_norm: the last layer of a stack computes the model's final norm — glue across layers at
the stack's end.

Within a stack each layer's last kernel also computes the next layer's entry kernel (its input
norm) and hands the results over (:mod:`fuser.pipeline.next_layer_entry`). After the last layer
the model calls its final norm (transformers' ``model.norm``) on the stack's output: one more
launch, which the last layer's kernel can do instead where the norm computes what the layers'
entry kernel computes. Taken where:

* the module is called on the last layer's output (its recorded input equals that output);
* its fused forward is that one kernel: it reads only its input and its own parameters, and
  returns the kernel's one output;
* its ops are the entry kernel's, in the same order on the same arguments, literals included
  (an RMSNorm of the same eps; :func:`ops_key`);
* the entry kernel, launched on the norm's recorded input and the norm's parameters, gives the
  norm's recorded output.

Then the last layer's :data:`~fuser.pipeline.next_layer_entry.NEXT` reads the norm's parameters
where a next layer's are read (:class:`FinalNorm`), so its hand-over is keyed as the entry
kernel's launch on the stack's output and the norm's parameters; and the norm's fused forward
(:class:`TakesHandOver`) looks for that launch's results in the model forward's memo before it
runs its own kernel. A norm called outside the model's forward, or on other hidden states, runs
its kernel as before.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn as nn

from fuser.install import once_per_forward as memo
from fuser.install.splice import STATE_ATTR
from fuser.pipeline.fuse_module import Plan
from fuser.pipeline.next_layer_entry import NEXT, Entry, HandOver, computing_kernels, entries_of, hidden_output
from fuser.validate.against_eager import INTERPRETER_LOCK
from fuser.validate.tolerance import LAYER, mismatch


def ops_key(graph: fx.Graph, entry: Entry) -> tuple[list, list[str]]:
    """The entry's nodes in graph order, each as (op, target, arguments): its inputs by the order
    they are first read, its own nodes by position, literals as they are; and its inputs' names
    in that order. Two entries of equal keys compute the same from inputs matched by position."""
    by_name = {n.name: n for n in graph.nodes}
    nodes = [by_name[name] for name in entry.nodes]
    own = {node: i for i, node in enumerate(nodes)}
    inputs: list[str] = []

    def keyed(a):
        if not isinstance(a, fx.Node):
            return a
        if a in own:
            return ("node", own[a])
        if a.name not in inputs:
            inputs.append(a.name)
        return ("input", inputs.index(a.name))

    key = [(n.op, str(n.target), repr(fx.node.map_aggregate(n.args, keyed)), repr(fx.node.map_aggregate(n.kwargs, keyed)))
           for n in nodes]  # fmt: skip
    key.append(("outputs", tuple(own.get(by_name[name]) for name in entry.outputs)))
    return key, inputs


class FinalNorm:
    """The last layer's :data:`NEXT`: the final norm's parameters where the layer's entry kernel
    reads its own (``_fuser_next.input_layernorm.weight`` -> the norm's ``weight``). ``paths``:
    the entry's parameter path -> the norm's. The norm is read at each call, as
    ``owner.<name>``: a deep copy of the model reads its own copy's."""

    def __init__(self, owner: nn.Module, name: str, paths: dict[str, str], prefix: str = ""):
        self.owner, self.name, self.paths, self.prefix = owner, name, paths, prefix

    def __getattr__(self, attr):
        if attr.startswith("__") or attr in ("owner", "name", "paths", "prefix"):
            raise AttributeError(attr)
        path = self.prefix + attr
        if path in self.paths:
            return operator.attrgetter(self.paths[path])(self.owner.get_submodule(self.name))
        if any(p.startswith(path + ".") for p in self.paths):
            return FinalNorm(self.owner, self.name, self.paths, path + ".")
        raise AttributeError(f"the final norm {self.name} has no parameter in place of the next layer's {path}")

    def __deepcopy__(self, copies: dict) -> "FinalNorm":
        return FinalNorm(copies.get(id(self.owner), self.owner), self.name, self.paths, self.prefix)

    def __copy__(self) -> "FinalNorm":
        return FinalNorm(self.owner, self.name, self.paths, self.prefix)


class TakesHandOver:
    """The final norm's fused forward, taking the results the last layer handed over for the
    entry kernel's launch on its input and its parameters (``hand``'s launch, its arguments in
    ``hand``'s order) where there are any, running its own kernel otherwise."""

    def __init__(self, fused, hand: HandOver, sources: tuple):
        self.fused, self.hand = fused, hand
        self.sources = sources  # per entry input: None (the hidden states) or the norm's parameter path

    def __call__(self, module: nn.Module, hidden: torch.Tensor, *rest):
        values = [hidden if path is None else operator.attrgetter(path)(module) for path in self.sources]
        found = memo.take(self.hand.launch, tuple(values[i] for i in self.hand.inputs))
        return found[0] if found is not None else self.fused(module, hidden, *rest)

    def __deepcopy__(self, copies: dict) -> "TakesHandOver":
        return self  # holds no module: the launcher and paths are shared by every copy


def called_on_output(norm_call, layer_call) -> bool:
    """Was the module of ``norm_call`` (a recorded call) called on the output of the layer of
    ``layer_call``? Its first argument equals that output."""
    args, expected = norm_call[0], layer_call[2]
    return bool(args) and isinstance(args[0], torch.Tensor) and expected is not None and _same(args[0], expected)


def hand_to_final_norm(last: nn.Module, layer_plan: Plan, owner: nn.Module, name: str, norm_plan: Plan, norm_call) -> list[str]:
    """Make ``last`` (a stack's last layer, fused with ``layer_plan``) compute ``owner.<name>``,
    the final norm called on its output (:func:`called_on_output`), fused with ``norm_plan``
    (``norm_call``: its recorded call), and that norm take it. Returns the layer's kernels that
    compute it. Raises :class:`NotHanded` with the reason where it cannot."""
    hands = [h for h in layer_plan.hand_overs if h.launch is not None]
    if len(hands) != 1:
        raise NotHanded(f"the last layer hands over {len(hands)} entry kernels, not one")
    (hand,) = hands
    norm_args, _, norm_out = norm_call
    if norm_out is None:
        raise NotHanded("it returned no tensor")
    norm_entry = _whole_entry(norm_plan)
    layer_key, layer_inputs = ops_key(layer_plan.traced_graph, hand.entry)
    norm_key, norm_inputs = ops_key(norm_plan.traced.graph, norm_entry)
    if layer_key != norm_key:
        raise NotHanded(f"its kernel computes other ops than the layers' entry kernel ({hand.entry.kernel})")
    sources, paths = _sources(hand.entry, layer_inputs, layer_plan.traced_graph, norm_entry, norm_inputs, norm_plan.traced.graph)
    module = owner.get_submodule(name)
    values = [norm_args[0] if path is None else operator.attrgetter(path)(module) for path in sources]
    with INTERPRETER_LOCK, torch.no_grad():
        got = hand.launch(*(values[i] for i in hand.inputs))
    problem = mismatch(got[0], norm_out, "the entry kernel on the final norm's input", LAYER)
    if problem:
        raise NotHanded(problem)
    object.__setattr__(last, NEXT, FinalNorm(owner, name, paths))
    state = module.__dict__[STATE_ATTR]
    state.fused = TakesHandOver(state.fused, hand, sources)
    return computing_kernels(layer_plan.kernels, layer_plan.traced.graph, hand) or ["PyTorch"]


class NotHanded(ValueError):
    """Why the last layer does not compute the final norm."""


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def _whole_entry(p: Plan) -> Entry:
    """The norm's one kernel, as an entry: reading only its input and parameters, returning its
    one output, and all its forward computes."""
    if len(p.kernels) != 1:
        raise NotHanded(f"its fused forward is {len(p.kernels)} kernels, not one")
    entries, why = entries_of(p.kernels, p.traced, p.cops, p.shared_kernels)
    if not entries:
        raise NotHanded(why)
    (entry,) = entries
    out = hidden_output(p.traced)
    if len(entry.outputs) != 1 or out is None or out.name != entry.outputs[0]:
        raise NotHanded("it returns more than its kernel's one output")
    computed = [n.name for n in p.traced.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    others = [name for name in computed if name not in entry.nodes]
    if others:
        raise NotHanded(f"its forward computes more than its kernel: {', '.join(others)}")
    return entry


def _sources(layer_entry: Entry, layer_inputs: list[str], layer_graph: fx.Graph, norm_entry: Entry, norm_inputs: list[str],
             norm_graph: fx.Graph) -> tuple[tuple[str | None, ...], dict[str, str]]:  # fmt: skip
    """Per input of the layers' entry kernel (its order) what the norm gives it: its parameter's
    path, or None for the hidden states; and the layer's parameter path -> the norm's."""
    layer_nodes, norm_nodes = {n.name: n for n in layer_graph.nodes}, {n.name: n for n in norm_graph.nodes}
    matched = dict(zip(layer_inputs, norm_inputs))
    sources, paths = [], {}
    for name in layer_entry.inputs:
        node, other = layer_nodes[name], norm_nodes[matched[name]]
        if name == layer_entry.hidden and other.name == norm_entry.hidden:
            sources.append(None)
        elif node.op == "get_attr" and other.op == "get_attr":
            sources.append(other.target)
            paths[node.target] = other.target
        else:
            raise NotHanded(f"its input {other.name} is not where the layers' entry kernel reads {name}")
    return tuple(sources), paths
