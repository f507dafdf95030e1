"""Shared helpers for the golden, matching and fallback tests."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fuser
import fuser.pipeline.passes
from fuser.pattern import patterns_dir
from fuser.match.pattern_files import load_pattern
from fuser.install.splice import STATE_ATTR

ROOT = Path(__file__).resolve().parent.parent


# --- kernel launches ---------------------------------------------------------------------------
@contextlib.contextmanager
def spied_launches(corrupt: str | None = None):
    """Wrap every kernel launcher fuser emits: record each call's pattern; for launchers of the
    pattern ``corrupt`` (or of a merged kernel with it among its parts), add 1.0 to every output
    (a kernel that computes the wrong values)."""
    real_emit = fuser.pipeline.passes.emit
    calls: list[str] = []

    def emit(spec):
        path, launch = real_emit(spec)

        def spy(*args, **options):
            calls.append(spec.pattern)
            outs = launch(*args, **options)
            if corrupt in spec.pattern.split("+"):
                outs = tuple(o + 1.0 for o in outs)
            return outs

        spy.__name__ = spy.__qualname__ = launch.__name__
        return path, spy

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fuser.pipeline.passes, "emit", emit)
        yield calls


def fused_output(module: torch.nn.Module, inputs: tuple, corrupt: str | None = None, **apply_options):
    """``module(*inputs)`` through its fused forward: fused, called once without autograd (the
    fused kernels have no backward), restored. The call must take the fused graph (a guard that declines it fails here). ``corrupt`` as in
    :func:`spied_launches` (with ``validate=False``, a broken kernel gets through)."""
    with spied_launches(corrupt):
        fuser.apply(module, inputs, **apply_options)
        try:
            state = module.__dict__[STATE_ATTR]
            fused, runs = state.fused, []
            state.fused = lambda *args: runs.append(1) or fused(*args)
            with torch.no_grad():
                out = module(*inputs)
        finally:
            fuser.restore(module)
    assert runs, f"{type(module).__name__}: the guard declined the call; the fused forward did not run"
    return out


# --- patterns ----------------------------------------------------------------------------------
def pattern(name: str):
    """The pattern ``patterns/<name>.py`` (its ``reference`` is the golden reference)."""
    return load_pattern(patterns_dir() / f"{name}.py")


# --- inputs ------------------------------------------------------------------------------------
def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(g: torch.Generator, *shape, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    """Normal samples drawn in fp32 and rounded once to ``dtype``."""
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


# --- modules ------------------------------------------------------------------------------------
class BF16RMSNorm(torch.nn.Module):
    """A bf16 RMSNorm as model code writes it: the chain the ``rmsnorm`` pattern fuses."""

    def __init__(self, n: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (xf * self.weight).to(x.dtype)


# --- the fused module ---------------------------------------------------------------------------
def fused_call(module: torch.nn.Module, *args):
    """Call a fused module, first checking that its guard takes the fused path for ``args``."""
    state = module.__dict__.get(STATE_ATTR)
    assert state is not None, f"{type(module).__name__} is not fused"
    why_not = state.guard.why_not(args, {})
    assert why_not is None, f"the fused forward would not run: {why_not}"
    with torch.no_grad():
        return module(*args)


def eager_call(module: torch.nn.Module, *args):
    assert STATE_ATTR not in module.__dict__, "expected the eager module"
    with torch.no_grad():
        return module(*args)


# --- comparisons -------------------------------------------------------------------------------
def assert_close(actual, expected, tolerances: dict, what: str = "output"):
    """Same structure, dtypes and shapes; values within ``tolerances[dtype]`` (integers equal);
    NaN where NaN."""
    if isinstance(expected, (tuple, list)):
        assert isinstance(actual, (tuple, list)) and len(actual) == len(expected), f"{what}: structure differs"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_close(a, e, tolerances, f"{what}[{i}]")
        return
    assert isinstance(actual, torch.Tensor), f"{what}: {type(actual).__name__}, expected a tensor"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, expected {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    if not expected.is_floating_point():  # indices and the like: exactly
        assert torch.equal(actual, expected), f"{what}: {actual} differs from {expected}"
        return
    rtol, atol = tolerances[expected.dtype]
    torch.testing.assert_close(
        actual.detach().float(), expected.detach().float(), rtol=rtol, atol=atol, equal_nan=True,
        msg=lambda m: f"{what} ({expected.dtype}, rtol={rtol:g}, atol={atol:g}): {m}",
    )  # fmt: skip


# --- the report --------------------------------------------------------------------------------
class NotClaimed(AssertionError):
    """A chain was not fused by the expected pattern (or not with the expected parameters)."""


class WrongCategory(AssertionError):
    """A pattern was rejected, but under another category than expected."""


def chains(report, pattern_name: str):
    return [c for c in report.chains if c.pattern == pattern_name]


def assert_claimed(report, pattern_name: str, *, template: str | None = None, params: dict | None = None,
                   whole: bool = True):
    """Exactly one chain of ``pattern_name``, with ``template`` and ``params``; with ``whole``,
    no other kernel and no glue left unfused (the pattern covers the whole chain)."""
    found = chains(report, pattern_name)
    if len(found) != 1:
        raise NotClaimed(f"expected one {pattern_name} chain, got {len(found)}:\n{report.text()}")
    chain = found[0]
    if template is not None and chain.template != template:
        raise NotClaimed(f"{pattern_name} used template {chain.template!r}, expected {template!r}")
    if params is not None:
        got = {k: chain.params.get(k) for k in params}
        if got != params:
            raise NotClaimed(f"{pattern_name} captured {chain.params}, expected {params}:\n{report.text()}")
    if whole:
        others = [c.pattern for c in report.chains if c is not chain]
        if others or report.unfused:
            raise NotClaimed(f"{pattern_name} did not cover the whole chain:\n{report.text()}")
    return chain


def assert_not_claimed(report, pattern_name: str, *, category: str | None = None):
    """``pattern_name`` fused nothing; with ``category``, it was rejected under that category."""
    assert not chains(report, pattern_name), f"{pattern_name} should not match:\n{report.text()}"
    if category is None:
        return None
    rejected = [r for r in report.rejected if r.pattern == pattern_name]
    assert rejected, f"{pattern_name} should be reported as rejected ({category}):\n{report.text()}"
    if not any(r.category == category for r in rejected):
        raise WrongCategory(
            f"{pattern_name} rejected as {[r.category for r in rejected]}, expected {category!r}: "
            f"{[r.reason for r in rejected]}"
        )
    return next(r for r in rejected if r.category == category)


# --- code that may take the interpreter down ---------------------------------------------------
def run_isolated(source: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run ``source`` in a fresh interpreter (rooted at the checkout, Triton interpreted), so that
    a crash of the process fails only the test that ran it."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def describe_exit(result: subprocess.CompletedProcess) -> str:
    how = f"killed by signal {-result.returncode}" if result.returncode < 0 else f"exit status {result.returncode}"
    return f"{how}\nstdout:\n{result.stdout[-2000:]}\nstderr:\n{result.stderr[-2000:]}"
