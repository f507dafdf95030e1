"""The guard sees the module itself, not only the call: a module fused in one dtype, on one
device, in eval mode, runs its own forward once any of that changes (``.float()``, ``.half()``,
``.train()``), and its fused forward again once it is back as it was fused."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import spied_launches

import fuser
from fuser.validate.tolerance import KERNEL, mismatch


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class NormThenDropout(nn.Module):
    """An RMSNorm with a weight (its dtype decides the output's), then dropout."""

    def __init__(self, n: int = 32):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * randn(n, seed=1))
        self.dropout = nn.Dropout(0.5)

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.dropout(self.weight * h.to(x.dtype))


@pytest.fixture
def launches():
    with spied_launches() as calls:
        yield calls


def own_forward(module, x, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        return type(module).forward(module, x)


def called(module, x, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        return module(x)


@pytest.mark.parametrize("convert", ["float", "half", "double"])
def test_a_module_converted_after_apply_runs_its_own_forward(convert, launches):
    module, x = NormThenDropout().eval().to(torch.bfloat16), randn(5, 32).to(torch.bfloat16)
    fuser.apply(module, (x,))
    launches.clear()
    called(module, x)
    assert launches, "fused as it was, the module runs its kernels"
    getattr(module, convert)()
    launches.clear()
    got, expected = called(module, x), own_forward(module, x)
    assert launches == [], "the parameters' dtype changed: the module's own forward runs"
    assert got.dtype == expected.dtype != torch.bfloat16  # the fused graph would return bf16
    assert torch.equal(got, expected)
    module.to(torch.bfloat16)
    launches.clear()
    called(module, x)
    assert launches, "converted back, the fused forward runs again"


def test_a_module_put_in_training_mode_after_apply_runs_its_dropout(launches):
    module, x = NormThenDropout().eval(), randn(6, 32)
    fuser.apply(module, (x,))
    module.train()
    launches.clear()
    got, expected = called(module, x, seed=3), own_forward(module, x, seed=3)
    assert launches == []
    assert (got == 0).sum() == (expected == 0).sum() > 0, "dropout zeroes values in training mode"
    assert torch.equal(got, expected)
    module.eval()
    launches.clear()
    got = called(module, x)
    assert launches and (got == 0).sum() == 0
    assert mismatch(got, own_forward(module, x), "output", KERNEL) is None


def test_a_submodule_put_in_training_mode_is_seen(launches):
    module, x = NormThenDropout().eval(), randn(6, 32)
    fuser.apply(module, (x,))
    module.dropout.train()
    launches.clear()
    assert torch.equal(called(module, x, seed=4), own_forward(module, x, seed=4))
    assert launches == []


def test_a_parameter_replaced_by_one_of_another_dtype_is_seen(launches):
    module, x = NormThenDropout().eval(), randn(6, 32)
    fuser.apply(module, (x,))
    module.weight = nn.Parameter(module.weight.detach().double())
    launches.clear()
    got = called(module, x)
    assert launches == [] and got.dtype == torch.float64
    assert torch.equal(got, own_forward(module, x))


def test_a_qwen3_layer_made_float32_after_apply_runs_its_own_forward(launches):
    """transformers' Qwen3 layer fused in bf16, then made float32 and called with the same bf16
    inputs: eager runs (its RMSNorm returns float32 through its float32 weight), where the fused
    graph raised ``expected m1 and m2 to have the same dtype`` in a projection."""
    from examples.zoo import layers as zoo

    layer, args, kwargs = zoo.build("qwen3", T=3)  # bf16
    fuser.apply(layer, args, example_kwargs=kwargs)
    layer.float()
    launches.clear()
    with torch.no_grad():
        got = layer(*args, **kwargs)
        expected = type(layer).forward(layer, *args, **kwargs)
    assert launches == []
    got, expected = (got[0], expected[0]) if isinstance(got, tuple) else (got, expected)
    assert got.dtype == torch.float32 and torch.equal(got, expected)


def test_a_submodule_replaced_after_apply_is_seen(launches):
    module, x = NormThenDropout().eval(), randn(6, 32)
    fuser.apply(module, (x,))
    module.dropout = nn.Dropout(0.5).train()
    launches.clear()
    assert torch.equal(called(module, x, seed=5), own_forward(module, x, seed=5))
    assert launches == []
