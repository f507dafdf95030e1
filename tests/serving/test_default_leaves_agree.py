"""The serving targets and a model's planning keep whole what the trace keeps whole
(fuser.trace.leaves.is_default_leaf): an ``nn.Linear`` or ``nn.Embedding`` running that type's
own forward; a subclass with a forward of its own (a router: the GEMM, then top-k and a
sigmoid) holds glue, and is traced into, a target's part and a model's submodule to fuse."""

import torch
import torch.nn as nn

from fuser.model import fuse_model
from fuser.serving.targets import is_fusers_leaf
from fuser.trace.leaves import is_default_leaf


class Router(nn.Linear):
    def forward(self, x):
        return torch.sigmoid(super().forward(x).topk(2, dim=-1).values)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.router = Router(8, 4, bias=False)
        self.proj = nn.modules.linear.NonDynamicallyQuantizableLinear(8, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 8)])
        self.norm = nn.LayerNorm(8)


def test_serving_leaves_are_the_traces():
    model = Model()
    for module in (model.embed, model.router, model.proj, model.norm):
        assert is_fusers_leaf(module) == is_default_leaf(module), type(module).__name__
    assert is_fusers_leaf(model.embed) and is_fusers_leaf(model.proj)
    assert not is_fusers_leaf(model.router)


def test_a_models_other_submodules_include_a_linear_subclass_with_its_own_forward():
    found = [name for name, _ in fuse_model._other_submodules(Model(), {"layers"})]
    assert found == ["router", "norm"]
