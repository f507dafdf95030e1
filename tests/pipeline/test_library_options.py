"""fuser.pipeline.options.library_options: the options of ``fuser.apply`` completed from the
environment as the serving plugin and the CLI read it — ``FUSER_LEAVES`` adds leaves (each once,
the explicit ones first), ``FUSER_PRECOMPUTE`` sets ``precompute`` unless the call does — and the
leaves resolved by name, an unknown one a FuserError; what they name is a leaf in the plan."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fuser
from fuser.model.fuse_model import apply_model
from fuser.pipeline.fuse_module import FuserError
from fuser.pipeline.options import env_flag, env_names, library_options
from fuser.serving.options import Options

D = 8


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, 2 * D, bias=False)
        self.down = nn.Linear(D, D, bias=False)

    def forward(self, x):
        a, b = self.up(x).chunk(2, dim=-1)
        return self.down(F.silu(a) * b)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(D) + 0.5)
        self.w = nn.Parameter(torch.randn(D, D) / D**0.5)
        self.scale = nn.Parameter(torch.rand(D) + 0.5)
        self.mlp = Mlp()

    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return x + self.mlp(F.linear(h, self.w * self.scale))  # a weight product: precomputed


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = Stack()

    def forward(self, x):
        return self.model(x)


@pytest.fixture
def model():
    torch.manual_seed(0)
    return Model().eval()


def x():
    return torch.randn(4, D, generator=torch.Generator().manual_seed(1))


def mlp_is_a_leaf(p) -> bool:
    """The plan's graph calls the mlp as one node, and no chain fused its silu."""
    called = any(n.op == "call_module" and n.target == "mlp" for n in p.traced.graph.nodes)
    silu = any(n.target is F.silu for n in p.traced.graph.nodes)
    return called and not silu


# --- the environment -----------------------------------------------------------------------------
def test_fuser_leaves_are_added_after_the_explicit_ones(model):
    layers = model.model.layers
    got = library_options(model, {"leaves": [Layer]}, environ={"FUSER_LEAVES": " mlp , Stack"})["leaves"]
    assert got == [Layer, layers[0].mlp, layers[1].mlp, Stack]
    assert got[1] is layers[0].mlp and got[2] is layers[1].mlp


def test_a_leaf_named_twice_is_one_leaf(model):
    """The plugin passes FUSER_LEAVES's names as ``leaves`` and the library reads them again."""
    env = {"FUSER_LEAVES": "mlp,Mlp"}
    plugin = Options.from_env(env).apply_options()
    assert plugin == {"leaves": ["mlp", "Mlp"]}
    got = library_options(model, plugin, environ=env)["leaves"]
    assert got == [model.model.layers[0].mlp, model.model.layers[1].mlp, Mlp]
    # resolved already (the CLI's --leaf), then read again: the same leaves
    again = library_options(model, {"leaves": got}, environ=env)["leaves"]
    assert len(again) == 3 and all(a is b for a, b in zip(again, got))


def test_fuser_precompute_is_read_where_the_call_does_not_say(model):
    assert library_options(model, {}, environ={"FUSER_PRECOMPUTE": "0"})["precompute"] is False
    assert library_options(model, {}, environ={"FUSER_PRECOMPUTE": "yes"})["precompute"] is True
    assert "precompute" not in library_options(model, {}, environ={})
    assert "precompute" not in library_options(model, {}, environ={"FUSER_PRECOMPUTE": " "})


def test_an_explicit_precompute_wins_over_the_environment(model):
    assert library_options(model, {"precompute": True}, environ={"FUSER_PRECOMPUTE": "0"})["precompute"] is True
    assert library_options(model, {"precompute": False}, environ={"FUSER_PRECOMPUTE": "1"})["precompute"] is False


def test_a_bad_fuser_precompute_is_a_fuser_error(model):
    with pytest.raises(FuserError, match=r"FUSER_PRECOMPUTE='maybe': expected one of 1, true"):
        library_options(model, {}, environ={"FUSER_PRECOMPUTE": "maybe"})


def test_the_caller_s_options_are_left_as_they_were(model):
    options = {"leaves": ["mlp"], "patterns": ["p.py"]}
    got = library_options(model, options, environ={"FUSER_LEAVES": "Stack", "FUSER_PRECOMPUTE": "0"})
    assert options == {"leaves": ["mlp"], "patterns": ["p.py"]}
    assert got["patterns"] == ["p.py"] and got["precompute"] is False and len(got["leaves"]) == 3


def test_no_leaves_anywhere_adds_no_leaves_option(model):
    assert library_options(model, {"patterns": []}, environ={}) == {"patterns": []}


def test_the_helpers_read_flags_and_names():
    assert env_flag({"F": "On"}, "F") is True and env_flag({"F": "off"}, "F", True) is False
    assert env_flag({}, "F", True) is True and env_flag({"F": ""}, "F") is False
    with pytest.raises(ValueError, match="F='2'"):
        env_flag({"F": "2"}, "F")
    assert env_names({"N": "a, b,,c "}, "N") == ("a", "b", "c") and env_names({}, "N") == ()


# --- an unknown leaf ------------------------------------------------------------------------------
def test_an_unknown_leaf_is_a_fuser_error_naming_it(model):
    with pytest.raises(FuserError) as caught:
        library_options(model, {"leaves": ["mlp", "nosuchmodule"]}, environ={})
    message = str(caught.value)
    assert "'nosuchmodule' names no submodule" in message and "(its submodules: model)" in message
    assert "FUSER_LEAVES" not in message


def test_an_unknown_leaf_from_the_environment_says_so(model):
    with pytest.raises(FuserError, match=r"'nosuch' names no submodule.*\(from FUSER_LEAVES\)"):
        library_options(model, {"leaves": ["mlp"]}, environ={"FUSER_LEAVES": "mlp,nosuch"})


# --- what the names make leaves, in the plan --------------------------------------------------------
def test_the_control_plan_fuses_the_mlp_glue(model):
    p = fuser.plan(model.model.layers[1], (x(),), **library_options(model, {}, environ={}))
    assert not mlp_is_a_leaf(p)
    assert any(n.target is F.silu for n in p.traced.graph.nodes)


@pytest.mark.parametrize("name", ["model.layers.1.mlp", "mlp", "1.mlp", "Mlp"], ids=["full-path", "tail", "dotted-tail", "class"])
def test_a_name_of_the_model_makes_the_layer_s_submodule_a_leaf(model, name):
    """Names are relative to the module given to apply (the model), the plan is one layer's,
    as fuser.model.fuse_model plans each layer structure on its first layer."""
    options = library_options(model, {"leaves": [name]}, environ={})
    p = fuser.plan(model.model.layers[1], (x(),), **options)
    assert mlp_is_a_leaf(p), p.report.text()


def test_fuser_leaves_make_a_leaf_in_the_plan(model):
    options = library_options(model.model.layers[0], {}, environ={"FUSER_LEAVES": "mlp"})
    assert mlp_is_a_leaf(fuser.plan(model.model.layers[0], (x(),), **options))


def test_fuser_precompute_reaches_the_plan(model):
    layer = model.model.layers[0]
    ahead = fuser.plan(layer, (x(),), **library_options(layer, {}, environ={}))
    assert ahead.report.precomputed  # w * scale, computed once
    live = fuser.plan(layer, (x(),), **library_options(layer, {}, environ={"FUSER_PRECOMPUTE": "0"}))
    assert live.report.precomputed == []


@torch.no_grad()
def test_a_model_fused_layer_by_layer_keeps_the_named_leaf_in_every_layer(model):
    """fuser.model.fuse_model: the layers' plan, and the stack's own forward, whose leaves are
    its layers by name relative to it (``_children_called``) besides the model's."""
    expected = model(x())
    report = apply_model(model, (x(),), **library_options(model, {"leaves": ["mlp"]}, environ={}))
    try:
        (group,) = report.groups
        assert group.layers == ["model.layers.0", "model.layers.1"] and group.report is not None, report.text()
        assert group.report.chains  # the norm is fused
        assert not any("silu" in node for chain in group.report.chains for node in chain.nodes), group.report.text()
        before = {name: c["fused"] for name, c in fuser.stats(model).items()}
        torch.testing.assert_close(model(x()), expected)
        after = {name: c["fused"] for name, c in fuser.stats(model).items()}
        assert [after[n] - before[n] for n in group.layers] == [1, 1], (before, after)  # both ran fused
    finally:
        fuser.restore(model)


@torch.no_grad()
def test_one_layer_s_submodule_named_by_its_path_is_a_leaf_in_that_layer_only(model):
    """Layers whose named leaves differ are planned apart (fuser.model.layer_structure.groups_of):
    naming ``model.layers.1.mlp`` keeps layer 0's mlp glue fused."""
    expected = model(x())
    report = apply_model(model, (x(),), **library_options(model, {"leaves": ["model.layers.1.mlp"]}, environ={}))
    try:
        by_layer = {g.layers[0]: g.report for g in report.groups}
        assert sorted(by_layer) == ["model.layers.0", "model.layers.1"], report.text()
        fused_silu = {name: any("silu" in node for c in r.chains for node in c.nodes) for name, r in by_layer.items()}
        assert fused_silu == {"model.layers.0": True, "model.layers.1": False}, report.text()
        torch.testing.assert_close(model(x()), expected)
    finally:
        fuser.restore(model)
