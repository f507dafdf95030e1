"""Leaves the trace makes by itself (fuser.trace.leaves): a function it cannot go into, custom ops,
C extensions' functions given tensors; each is one call in the graph, reported with its file
and line, and the glue around it is still fused and checked against eager."""

import subprocess
import sys
import sysconfig
import textwrap
import types

import pytest
import torch
import torch.nn as nn

import fuser
from fuser.trace.tracing import trace


def rms(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _module(name: str, source: str) -> types.ModuleType:
    """A module of the user's library, loaded like any other (in ``sys.modules``)."""
    module = types.ModuleType(name)
    module.__file__ = f"/virtual/{name}.py"
    exec(compile(textwrap.dedent(source), module.__file__, "exec"), module.__dict__)
    sys.modules[name] = module
    return module


# A private helper in another module that syncs with the host: untraceable, so a leaf.
HELPERS = """
    import functools
    import torch

    def _scaled_by_max(x):
        peak = x.abs().max().item()  # HOST-READ
        return x / peak

    def logged(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return fn(*args, **kwargs)
        return wrapper

    @logged
    def clipped(x):
        if x.max() > 1:  # DATA-BRANCH
            return x.clamp(max=1)
        return x
    """
helpers = _module("fuser_test_leaf_helpers", HELPERS)


def _helper_line(marker: str) -> int:
    lines = textwrap.dedent(HELPERS).splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.rstrip().endswith(f"# {marker}"))


def the_one_leaf(traced, function, name: str, where: str):
    """The trace's one automatic leaf, after checking it is ``name`` at ``where`` and that the
    graph calls ``function`` once."""
    calls = [n for n in traced.graph.nodes if n.op == "call_function" and n.target is function]
    assert len(calls) == 1, calls
    (leaf,) = traced.automatic_leaves
    assert (leaf.name, leaf.where) == (name, where)
    return leaf


class Normed(nn.Module):
    """A layer with a norm weight; what it does around the norm is each test's."""

    def __init__(self, n=16):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(n) + 0.5)


class HostReadThroughAHelper(Normed):
    def forward(self, x):
        h = torch.sigmoid(rms(x, self.weight))
        return helpers._scaled_by_max(h) * 3 + x


def test_a_private_helper_that_cannot_be_traced_is_a_reported_leaf():
    layer = HostReadThroughAHelper()
    x = torch.randn(5, 16)
    traced = trace(layer, (x,))
    where = f"/virtual/fuser_test_leaf_helpers.py:{_helper_line('HOST-READ')}"
    leaf = the_one_leaf(traced, helpers._scaled_by_max, "fuser_test_leaf_helpers._scaled_by_max", where)
    assert not any(n.op == "call_method" and n.target == "item" for n in traced.graph.nodes)
    assert "host read" in leaf.reason
    result = fuser.check(layer, (x,))
    assert result.ok, result.problems
    assert result.report.launches_after < result.report.launches_before - 1  # the norm is one kernel
    assert "leaf (automatic): fuser_test_leaf_helpers._scaled_by_max" in result.report.text()
    assert helpers._scaled_by_max.__code__.co_name == "_scaled_by_max"  # left unpatched


class BranchThroughADecorator(Normed):
    def forward(self, x):
        return helpers.clipped(rms(x, self.weight)) + x


def test_a_decorated_helper_is_a_leaf_as_the_module_holds_it():
    layer = BranchThroughADecorator()
    x = torch.randn(4, 16) * 3
    traced = trace(layer, (x,))
    where = f"/virtual/fuser_test_leaf_helpers.py:{_helper_line('DATA-BRANCH')}"
    the_one_leaf(traced, helpers.clipped, "fuser_test_leaf_helpers.clipped", where)  # the wrapper the module holds
    result = fuser.check(layer, (x,))
    assert result.ok, result.problems


# Custom ops outside aten: one that returns its result and one that writes an out argument.
torch.library.define("fuser_test::doubled", "(Tensor x) -> Tensor")
torch.library.impl("fuser_test::doubled", "cpu")(lambda x: x * 2)
torch.library.define("fuser_test::doubled_into", "(Tensor(a!) out, Tensor x) -> ()")


@torch.library.impl("fuser_test::doubled_into", "cpu")
def _doubled_into(out, x):
    out.copy_(x * 2)


class CustomOps(Normed):
    def forward(self, x):
        h = torch.ops.fuser_test.doubled(torch.sigmoid(rms(x, self.weight)))  # CUSTOM-OP
        out = torch.empty_like(h)
        torch.ops.fuser_test.doubled_into(out, torch.tanh(h))  # CUSTOM-OUT
        return torch.relu(out) * 3 + x


def test_custom_ops_are_reported_leaves_and_what_they_write_is_read_after_them():
    layer = CustomOps()
    x = torch.randn(5, 16)
    traced = trace(layer, (x,))
    names = [a.name for a in traced.automatic_leaves]
    assert names == ["torch.ops.fuser_test.doubled", "torch.ops.fuser_test.doubled_into"]
    lines = [int(a.where.rsplit(":", 1)[1]) for a in traced.automatic_leaves]
    assert lines == [_line("CUSTOM-OP"), _line("CUSTOM-OUT")]
    result = fuser.check(layer, (x,))
    # The kernel after `doubled_into` reads `out` as the op left it: validated against eager.
    assert result.ok, result.problems
    assert "rmsnorm" in {c.pattern for c in result.report.chains}
    assert result.report.launches_after <= 3


def _line(marker: str) -> int:
    return next(i for i, line in enumerate(open(__file__), 1) if line.rstrip().endswith(f"# {marker}"))


# A C extension that reads the tensors' memory itself (as a pybind or raw CPython kernel does).
C_SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static PyObject *address(PyObject *t) {
    return PyObject_CallMethod(t, "data_ptr", NULL);
}

static PyObject *doubled_into(PyObject *self, PyObject *args) {
    PyObject *out, *x;
    if (!PyArg_ParseTuple(args, "OO", &out, &x)) return NULL;
    PyObject *po = address(out), *px = address(x), *pn = PyObject_CallMethod(x, "numel", NULL);
    if (!po || !px || !pn) { Py_XDECREF(po); Py_XDECREF(px); Py_XDECREF(pn); return NULL; }
    float *o = (float *)PyLong_AsVoidPtr(po), *v = (float *)PyLong_AsVoidPtr(px);
    long n = PyLong_AsLong(pn);
    for (long i = 0; i < n; i++) o[i] = 2.0f * v[i];
    Py_DECREF(po); Py_DECREF(px); Py_DECREF(pn);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {{"doubled_into", doubled_into, METH_VARARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "fuser_test_ext", NULL, -1, methods};
PyMODINIT_FUNC PyInit_fuser_test_ext(void) { return PyModule_Create(&module); }
"""


@pytest.fixture(scope="module")
def extension(tmp_path_factory):
    """The extension, built with the machine's C compiler against this Python's headers."""
    directory = tmp_path_factory.mktemp("ext")
    (directory / "ext.c").write_text(C_SOURCE)
    target = directory / f"fuser_test_ext{sysconfig.get_config_var('EXT_SUFFIX')}"
    include = sysconfig.get_paths()["include"]
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", f"-I{include}", "ext.c", "-o", str(target)], cwd=directory, check=True)
    sys.path.insert(0, str(directory))
    try:
        import fuser_test_ext
    finally:
        sys.path.remove(str(directory))
    return fuser_test_ext


def test_a_c_extension_given_tensors_is_one_reported_call(extension):
    class WithExtension(Normed):
        def forward(self, x):
            h = torch.sigmoid(rms(x, self.weight))
            out = torch.empty_like(h)
            extension.doubled_into(out, h)  # C-CALL
            return torch.tanh(out) + x

    layer = WithExtension()
    x = torch.randn(5, 16)
    traced = trace(layer, (x,))
    leaf = the_one_leaf(traced, extension.doubled_into, "fuser_test_ext.doubled_into", f"{__file__}:{_line('C-CALL')}")
    assert "compiled function" in leaf.reason
    result = fuser.check(layer, (x,))
    assert result.ok, result.problems
    fuser.apply(layer, (x,))
    for T in (1, 7):
        x = torch.randn(T, 16)
        with torch.no_grad():
            torch.testing.assert_close(layer(x), torch.tanh(2 * torch.sigmoid(rms(x, layer.weight))) + x)
