"""A call the guard declines is never silent: every call of a fused module is counted, fused or
declined by reason; the first decline of a module warns, naming the reason."""

import warnings

import pytest
import torch

import fuser
from fuser.install.splice import AUTOGRAD, call_counts
from tests.install.test_reliability import RMSNorm, randn


def calls(module, x):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            module(x)
    return [str(w.message) for w in caught if "fuser:" in str(w.message)]


def test_fused_and_declined_calls_are_counted_by_reason():
    module = RMSNorm(32)
    fuser.apply(module, (randn(4, 32),))
    assert calls(module, randn(7, 32)) == []  # another token count: fused
    first = calls(module, randn(4, 32).double())  # another dtype: declined
    assert len(first) == 1 and "RMSNorm runs its own forward" in first[0] and "x is torch.float64 (4, 32)" in first[0]
    assert calls(module, randn(4, 32).double()) == []  # counted, not warned again
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        module(randn(4, 32))  # grad enabled and the weight requires grad
    counts = call_counts(module)[""]
    assert counts["fused"] == 1
    assert counts["declined"] == {"x is torch.float64 (4, 32) on cpu": 2, AUTOGRAD: 1}


def test_the_users_own_guard_declining_is_counted_without_a_warning():
    module = RMSNorm(32)
    fuser.apply(module, (randn(4, 32),), guard=lambda x: x.shape[0] < 8)
    assert calls(module, randn(9, 32)) == []
    assert call_counts(module)[""]["declined"] == {"the user guard declined": 1}


def test_a_model_counts_the_calls_of_each_fused_layer():
    from tests.install.test_once_per_forward import Stack, inputs

    model = Stack()
    fuser.apply(model, inputs(0))
    before = call_counts(model)  # apply's own checks of each layer
    with torch.no_grad():
        model(*inputs(1))
        model(*inputs(2))
    counts = call_counts(model)
    assert {f"layers.{i}" for i in range(3)} <= set(counts)
    for i in range(3):
        assert counts[f"layers.{i}"]["fused"] - before[f"layers.{i}"]["fused"] == 2, counts
        assert counts[f"layers.{i}"]["declined"] == {}, counts


@pytest.mark.parametrize("convert", ["double"])
def test_a_module_changed_after_apply_warns_with_what_changed(convert):
    module = RMSNorm(32)
    fuser.apply(module, (randn(4, 32),))
    getattr(module, convert)()
    (message,) = calls(module, randn(4, 32))
    assert "RMSNorm.weight is torch.float64 on cpu, fused as torch.float32 on cpu" in message
