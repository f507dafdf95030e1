"""Leaves named by a user (fuser.trace.leaves.resolve_leaves), as ``fuser.apply(leaves=...)``,
``FUSER_LEAVES`` and the CLI's ``--leaf`` read them: a submodule's qualified name or the tail of
one, a class name, ``package.module.function``; each keeps what it names opaque in the trace
(one call node, the glue inside it not traced), and a name that names nothing raises."""

import sys
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fuser.trace.leaves import UnknownLeaf, resolve_leaves
from fuser.trace.tracing import trace

# A helper function of the user's library, loaded like any other (in ``sys.modules``).
helpers = types.ModuleType("fuser_test_named_leaf_helpers")
helpers.__file__ = "/virtual/fuser_test_named_leaf_helpers.py"
exec("import torch.nn.functional as F\ndef gate(a, b):\n    return F.silu(a) * b\n", helpers.__dict__)
sys.modules[helpers.__name__] = helpers

D = 8


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, 2 * D, bias=False)
        self.down = nn.Linear(D, D, bias=False)

    def forward(self, x):
        a, b = self.up(x).chunk(2, dim=-1)
        return self.down(helpers.gate(a, b))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(D) + 0.5)
        self.mlp = Mlp()

    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return x + self.mlp(h)


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Model(nn.Module):
    """A model as transformers nests one: ``model.layers.<i>.mlp``."""

    def __init__(self):
        super().__init__()
        self.model = Stack()
        self.head = nn.Linear(D, D, bias=False)

    def forward(self, x):
        return self.head(self.model(x))


@pytest.fixture
def model():
    torch.manual_seed(0)
    return Model().eval()


def x():
    return torch.randn(4, D)


def mlp_calls(traced) -> list[str]:
    """The call_module nodes of an Mlp: the Mlp kept as one call."""
    return [n.target for n in traced.graph.nodes if n.op == "call_module" and n.target.rsplit(".", 1)[-1] == "mlp"]


def gate_glue(traced) -> int:
    """The silu nodes in the graph: the Mlp's glue, traced into (0 when the Mlp is a leaf)."""
    return sum(1 for n in traced.graph.nodes if n.target in (F.silu, torch.nn.functional.silu))


def test_without_leaves_the_mlp_is_traced_into(model):
    """The control for the tests below: nothing named, the mlp's glue is in the graph."""
    traced = trace(model.model.layers[0], (x(),))
    assert mlp_calls(traced) == [] and gate_glue(traced) == 1


def test_a_tail_names_the_submodule_in_every_layer(model):
    layers = model.model.layers
    leaves = resolve_leaves(model, ["mlp"])
    assert len(leaves) == 2 and leaves[0] is layers[0].mlp and leaves[1] is layers[1].mlp
    for layer in layers:  # each layer traced on its own, as fuser.model.fuse_model does
        traced = trace(layer, (x(),), leaves=leaves)
        assert mlp_calls(traced) == ["mlp"] and gate_glue(traced) == 0
    whole = trace(model, (x(),), leaves=leaves)
    assert mlp_calls(whole) == ["model.layers.0.mlp", "model.layers.1.mlp"] and gate_glue(whole) == 0


def test_a_dotted_tail_names_the_submodules_it_ends(model):
    assert resolve_leaves(model, ["1.mlp"]) == [model.model.layers[1].mlp]
    assert resolve_leaves(model, ["layers.0.mlp"]) == [model.model.layers[0].mlp]


def test_a_full_qualified_name_reaches_that_layer_s_trace_only(model):
    layers = model.model.layers
    leaves = resolve_leaves(model, ["model.layers.1.mlp"])
    assert len(leaves) == 1 and leaves[0] is layers[1].mlp
    named = trace(layers[1], (x(),), leaves=leaves)
    assert mlp_calls(named) == ["mlp"] and gate_glue(named) == 0
    other = trace(layers[0], (x(),), leaves=leaves)  # the same name relative to layer 0: not it
    assert mlp_calls(other) == [] and gate_glue(other) == 1


def test_a_class_name_names_every_instance(model):
    assert resolve_leaves(model, ["Mlp"]) == [Mlp]
    traced = trace(model, (x(),), leaves=resolve_leaves(model, ["Mlp"]))
    assert mlp_calls(traced) == ["model.layers.0.mlp", "model.layers.1.mlp"] and gate_glue(traced) == 0


def test_a_function_path_names_the_function(model):
    (gate,) = resolve_leaves(model, ["fuser_test_named_leaf_helpers.gate"])
    assert gate is helpers.gate
    traced = trace(model.model.layers[0], (x(),), leaves=[gate])
    assert [n for n in traced.graph.nodes if n.op == "call_function" and getattr(n.target, "__name__", None) == "gate"]
    assert gate_glue(traced) == 0


def test_a_relative_name_given_to_the_trace_as_a_string_still_names_the_submodule(model):
    traced = trace(model.model.layers[0], (x(),), leaves=["mlp"])
    assert mlp_calls(traced) == ["mlp"] and gate_glue(traced) == 0


def test_what_is_not_a_string_is_taken_as_it_is_each_leaf_once(model):
    mlp = model.model.layers[0].mlp
    assert resolve_leaves(model, [Mlp, helpers.gate, mlp]) == [Mlp, helpers.gate, mlp]
    leaves = resolve_leaves(model, [mlp, "mlp", "model.layers.0.mlp", "Mlp", Mlp])
    assert len(leaves) == 3 and leaves[0] is mlp and leaves[1] is model.model.layers[1].mlp and leaves[2] is Mlp


@pytest.mark.parametrize("name", ["nosuchmodule", "mlpx", "layers.2.mlp", "", "fuser_test_named_leaf_helpers.nosuch"])
def test_a_name_naming_nothing_raises_naming_it_and_the_submodules(model, name):
    with pytest.raises(UnknownLeaf) as caught:
        resolve_leaves(model, ["mlp", name])
    assert isinstance(caught.value, ValueError) and caught.value.name == name
    message = str(caught.value)
    assert f"leaf {name!r} names no submodule" in message and "Model" in message
    assert "(its submodules: model, head)" in message


def test_an_unknown_name_given_to_a_plain_function_lists_no_submodules():
    with pytest.raises(UnknownLeaf, match=r"'mlp' names no submodule.*\(its submodules: none\)"):
        resolve_leaves(lambda t: t, ["mlp"])
