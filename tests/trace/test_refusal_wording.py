"""Wording a refusal, or choosing the leaf an error asks for, runs none of the user's objects'
code beyond the error's message (fuser.trace.refusal, fuser.trace.leaves): a lazy import held
by name in a loaded module (sglang's ``LazyImport``, which imports what it stands for on any
attribute read) stays unimported, and an error whose message cannot be read is still refused
by name. The user gets fuser's refusal, never an ``ImportError`` raised while describing it."""

import sys
import types

import pytest
import torch
import torch.nn as nn

import fuser

MISSING = "fuser_test_module_that_is_not_installed"


class LazyImport:
    """sglang.utils.LazyImport's behaviour: any attribute it does not hold imports its module."""

    def __init__(self, module_name: str):
        self.module_name = module_name

    def __getattr__(self, name: str):
        import importlib

        return getattr(importlib.import_module(self.module_name), name)

    def __call__(self, *args, **kwargs):
        raise AssertionError("never called")


@pytest.fixture
def lazy_import_loaded(monkeypatch):
    """A loaded module of the user's library holding a lazy import of a module not installed."""
    module = types.ModuleType("fuser_test_lazy_holder")
    module.__file__ = "/virtual/fuser_test_lazy_holder.py"
    module.Engine = LazyImport(MISSING)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with pytest.raises(ModuleNotFoundError):
        module.Engine.__code__  # what reading it by attribute does
    return module


def branch_on_data(x):
    if x.sum() > 0:  # a branch on data: this function becomes a leaf
        return x * 2
    return -x


class CallsAHelper(nn.Module):
    def forward(self, x):
        return torch.sigmoid(branch_on_data(x) + 1)


class ChecksInAMethod(nn.Module):
    """The check is a method, which no module holds by name: nothing to make a leaf of."""

    def check(self, x):
        if x.amax() > 100:  # REFUSED-HERE
            raise ValueError("too large")

    def forward(self, x):
        self.check(x)
        return x * 2


class Unprintable(Exception):
    def __str__(self):
        import importlib

        importlib.import_module(MISSING)
        return "never"


class RaisesUnprintable(nn.Module):
    def forward(self, x):
        y = x * 2
        if y.shape[-1] == 8:
            raise Unprintable()
        return y


def test_a_function_leaf_is_chosen_without_importing_a_lazy_import(lazy_import_loaded):
    x = torch.randn(3, 8)
    module = CallsAHelper()
    report = fuser.apply(module, (x,))
    assert [leaf["name"] for leaf in report.automatic_leaves] == [f"{__name__}.branch_on_data"]
    torch.testing.assert_close(module(x), torch.sigmoid(branch_on_data(x) + 1))
    assert MISSING not in sys.modules


def test_a_refusal_is_worded_without_importing_a_lazy_import(lazy_import_loaded):
    with pytest.raises(fuser.TraceRefused, match="control flow") as excinfo:
        fuser.explain(ChecksInAMethod(), (torch.randn(3, 8),))
    assert "test_refusal_wording.py" in str(excinfo.value)
    with pytest.raises(fuser.FuserError, match="control flow"):
        fuser.apply(ChecksInAMethod(), (torch.randn(3, 8),))
    assert MISSING not in sys.modules


def test_an_error_whose_message_cannot_be_read_is_refused_by_its_type():
    with pytest.raises(fuser.TraceRefused, match="Unprintable") as excinfo:
        fuser.explain(RaisesUnprintable(), (torch.randn(3, 8),))
    assert "message could not be read" in str(excinfo.value)
    with pytest.raises(fuser.FuserError, match="Unprintable"):
        fuser.apply(RaisesUnprintable(), (torch.randn(3, 8),))
