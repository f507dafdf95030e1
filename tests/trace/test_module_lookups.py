"""Module-level lookups in a forward, read as values at trace time and traced through:
transformers' ``ACT2FN[name]`` (a ``ClassInstantier`` that makes a fresh activation module at
each lookup), a registry of module classes, ``getattr`` on a module's globals, and a module made
in the forward with weights of its own. None of these is a submodule of the module fused: eager
makes each anew at every call, so the trace goes into its forward instead of keeping it as a
call of a submodule that must be installed."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fuser
from fuser.trace.tracing import trace
from fuser.validate.tolerance import LAYER, mismatch

transformers_activations = pytest.importorskip("transformers.activations")
ACT2FN = transformers_activations.ACT2FN


class Scaled(nn.Module):
    """An activation with a weight of its own, made anew at each lookup (as XIELU is)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.full((32,), 0.5))

    def forward(self, x):
        return F.silu(x) * self.scale


REGISTRY = {"silu": nn.SiLU, "scaled": Scaled}


def helper(x, act):
    return act(x) * 2


class Lookups(nn.Module):
    def __init__(self, how: str, act: str = "gelu_new"):
        super().__init__()
        self.how, self.act = how, act
        self.weight = nn.Parameter(torch.rand(32) + 0.5)
        self.up = nn.Linear(32, 32, bias=False)

    def forward(self, x):
        h = x * self.weight
        if self.how == "act2fn":
            h = ACT2FN[self.act](h)
        elif self.how == "registry":
            h = REGISTRY[self.act]()(h)
        elif self.how == "getattr":
            h = getattr(F, self.act)(h)
        elif self.how == "passed":
            h = helper(h, ACT2FN[self.act])
        return self.up(h + 1.0) * 2


CASES = [("act2fn", "gelu_new"), ("act2fn", "silu"), ("act2fn", "relu2"), ("registry", "silu"),
         ("registry", "scaled"), ("getattr", "silu"), ("passed", "gelu_new")]  # fmt: skip


@pytest.mark.parametrize("how,act", CASES, ids=[f"{h}-{a}" for h, a in CASES])
def test_lookup_in_forward_traces_through(how, act):
    torch.manual_seed(0)
    module = Lookups(how, act).eval()
    x = torch.randn(3, 32)
    traced = trace(module, (x,))
    assert traced.automatic_leaves == []
    assert not [n for n in traced.graph.nodes if n.op == "call_module" and n.target != "up"]
    assert set(dict(module.named_modules())) == {"", "up"}  # nothing registered by the trace
    with torch.no_grad():
        expected = module(x)
        report = fuser.apply(module, (x,))
        assert report.launches_after < report.launches_before
        assert mismatch(module(x), expected, "output", LAYER) is None
        x2 = torch.randn(5, 32)  # another token count: the same graph
        fused = module(x2)
        assert fuser.stats(module)[""]["fused"] == 2
        fuser.restore(module)
        assert mismatch(fused, module(x2), "output", LAYER) is None
