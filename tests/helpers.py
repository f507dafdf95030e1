"""Shared helpers for the golden, matching and fallback tests.

Import what a test module needs; importing ``reuse_loaded_patterns`` into a test module turns
on its autouse fixture there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fuser
import fuser.api
from fuser.pattern import load_pattern, load_patterns, patterns_dir
from fuser.splice import STATE_ATTR

ROOT = Path(__file__).resolve().parent.parent

#: True when Triton kernels run in its CPU interpreter (the default off a GPU).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


# --- pattern loading ---------------------------------------------------------------------------
_LOADED: dict = {}


def _load_patterns_once(paths=None, templates=None):
    """``fuser.pattern.load_patterns``, loading each set of files once per test session.

    ``plan()`` reloads the pattern files on every call, which gives new Pattern objects, and the
    matcher's trace cache is keyed on them: every plan then re-traces every reference (65 times
    for the Sinkhorn iteration search), seconds per call. Handing back the same objects keeps
    that cache warm; the files, the matching and everything after are unchanged.
    """
    key = (tuple(str(p) for p in (paths or ())), frozenset(templates or ()))
    if key not in _LOADED:
        _LOADED[key] = load_patterns(paths, templates)
    return list(_LOADED[key])


@pytest.fixture(autouse=True, scope="module")
def reuse_loaded_patterns():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fuser.api, "load_patterns", _load_patterns_once)
        yield


def pattern(name: str):
    """The pattern ``patterns/<name>.py`` (its ``reference`` is the golden reference)."""
    return load_pattern(patterns_dir() / f"{name}.py")


# --- inputs ------------------------------------------------------------------------------------
def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(g: torch.Generator, *shape, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    """Normal samples drawn in fp32 and rounded once to ``dtype``."""
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


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
    """Same structure, dtypes and shapes; values within ``tolerances[dtype]``; NaN where NaN."""
    if isinstance(expected, (tuple, list)):
        assert isinstance(actual, (tuple, list)) and len(actual) == len(expected), f"{what}: structure differs"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_close(a, e, tolerances, f"{what}[{i}]")
        return
    assert isinstance(actual, torch.Tensor), f"{what}: {type(actual).__name__}, expected a tensor"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, expected {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    rtol, atol = tolerances[expected.dtype]
    torch.testing.assert_close(
        actual.detach(), expected.detach(), rtol=rtol, atol=atol, equal_nan=True,
        msg=lambda m: f"{what} ({expected.dtype}, rtol={rtol:g}, atol={atol:g}): {m}",
    )  # fmt: skip


# --- the report --------------------------------------------------------------------------------
class NotClaimed(AssertionError):
    """A chain was not fused by the expected pattern (or not with the expected parameters)."""


class WrongCategory(AssertionError):
    """A pattern was rejected, but under another category than expected."""


def chains(report, pattern_name: str):
    return [c for c in report.chains if c.pattern == pattern_name]


def describe(report) -> str:
    return report.text()


def assert_claimed(report, pattern_name: str, *, template: str | None = None, params: dict | None = None,
                   whole: bool = True):
    """Exactly one chain of ``pattern_name``, with ``template`` and ``params``; with ``whole``,
    no other kernel and no glue left unfused (the pattern covers the whole chain)."""
    found = chains(report, pattern_name)
    if len(found) != 1:
        raise NotClaimed(f"expected one {pattern_name} chain, got {len(found)}:\n{describe(report)}")
    chain = found[0]
    if template is not None and chain.template != template:
        raise NotClaimed(f"{pattern_name} used template {chain.template!r}, expected {template!r}")
    if params is not None:
        got = {k: chain.params.get(k) for k in params}
        if got != params:
            raise NotClaimed(f"{pattern_name} captured {chain.params}, expected {params}:\n{describe(report)}")
    if whole:
        others = [c.pattern for c in report.chains if c is not chain]
        if others or report.unfused:
            raise NotClaimed(f"{pattern_name} did not cover the whole chain:\n{describe(report)}")
    return chain


def assert_not_claimed(report, pattern_name: str, *, category: str | None = None):
    """``pattern_name`` fused nothing; with ``category``, it was rejected under that category."""
    assert not chains(report, pattern_name), f"{pattern_name} should not match:\n{describe(report)}"
    if category is None:
        return None
    rejected = [r for r in report.rejected if r.pattern == pattern_name]
    assert rejected, f"{pattern_name} should be reported as rejected ({category}):\n{describe(report)}"
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
