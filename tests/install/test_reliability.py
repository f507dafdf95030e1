"""A fused module never gives a silently wrong result: concurrent apply, copies and pickles,
weights changed after apply, autograd, changed scalar attributes, bad example inputs."""

import copy
import io
import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import spied_launches

import fuser
import fuser.install.fixed_at_apply
import fuser.install.splice
from fuser.ir.report import Report
from fuser.validate.tolerance import KERNEL, mismatch


@pytest.fixture
def launches():
    """The patterns of the fused kernels launched, in order (every launcher fuser emits is wrapped)."""
    with spied_launches() as calls:
        yield calls


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class RMSNorm(nn.Module):
    """As transformers' Qwen3RMSNorm writes it: the epsilon is a plain attribute."""

    def __init__(self, n: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * randn(n, seed=1))
        self.variance_epsilon = eps

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))


class ScaledProjection(nn.Module):
    """A norm, then a GEMM whose weight is glue computed from two parameters (``w * scale``)."""

    def __init__(self, n: int = 32, out: int = 16):
        super().__init__()
        self.norm = RMSNorm(n)
        self.w = nn.Parameter(randn(out, n, seed=2))
        self.scale = nn.Parameter(torch.full((out, 1), 0.5))

    def forward(self, x):
        return F.linear(self.norm(x), self.w * self.scale)


def eager(module, x):
    """``module``'s own forward, whatever fuser installed."""
    with torch.no_grad():
        return type(module).forward(module, x)


def assert_matches_eager(module, x):
    with torch.no_grad():
        got = module(x)
    problem = mismatch(got, eager(module, x), "output", KERNEL)
    assert problem is None, problem


# ---------------------------------------------------------------------------------------------
# Concurrent apply: fused once or not at all
# ---------------------------------------------------------------------------------------------


def test_concurrent_apply_fuses_once_and_restores_to_eager(launches):
    m, x = ScaledProjection(), randn(4, 32)
    start = threading.Barrier(2)
    outcomes = []

    def apply():
        start.wait()
        try:
            outcomes.append(fuser.apply(m, (x,)))
        except fuser.FuserError as e:
            outcomes.append(e)

    threads = [threading.Thread(target=apply) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert sorted(type(o).__name__ for o in outcomes) == ["FuserError", "Report"], outcomes
    assert fuser.is_fused(m)
    assert m.forward.module is m and isinstance(m.forward, fuser.install.splice.GuardedForward)
    launches.clear()
    assert_matches_eager(m, x)
    assert launches, "the fused forward should run"

    fuser.restore(m)
    assert not fuser.is_fused(m) and "forward" not in m.__dict__
    launches.clear()
    assert_matches_eager(m, x)
    assert launches == [], "a fused kernel still runs after restore"
    with pytest.raises(ValueError, match="not fused"):
        fuser.restore(m)


# ---------------------------------------------------------------------------------------------
# Copies and pickles
# ---------------------------------------------------------------------------------------------


def test_a_deep_copy_computes_with_its_own_parameters(launches):
    m, x = ScaledProjection(), randn(4, 32)
    fuser.apply(m, (x,))
    twin = copy.deepcopy(m)
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
    assert fuser.is_fused(twin)
    launches.clear()
    with torch.no_grad():
        got = twin(x)
    assert launches, "the copy should run fused"
    expected = eager(twin, x)
    assert expected.abs().max() > 0.1  # the copy's weights are not the zeroed ones
    assert mismatch(got, expected, "output", KERNEL) is None
    assert_matches_eager(m, x)  # and the original sees its own (zeroed) weights
    fuser.restore(twin)
    assert not fuser.is_fused(twin) and fuser.is_fused(m)


def test_torch_save_and_load_gives_a_working_eager_module():
    m, x = ScaledProjection(), randn(4, 32)
    expected = eager(m, x)
    fuser.apply(m, (x,))
    buffer = io.BytesIO()
    torch.save(m, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert not fuser.is_fused(loaded) and "forward" not in loaded.__dict__
    assert not [k for k in loaded.__dict__ if k.startswith("_fuser")]
    with torch.no_grad():
        assert torch.equal(loaded(x), expected)
    fuser.apply(loaded, (x,))  # and it can be fused again
    assert_matches_eager(loaded, x)
    assert fuser.is_fused(m)  # saving left the original fused


# ---------------------------------------------------------------------------------------------
# Values precomputed from parameters follow the parameters
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def projection(launches):  # fused with the launchers counted
    m, x = ScaledProjection(), randn(4, 32)
    report = fuser.apply(m, (x,))
    assert report.precomputed, f"the weight product should be precomputed:\n{report.text()}"
    return m, x


def test_an_in_place_write_to_a_parameter_is_seen(projection, launches):
    m, x = projection
    with torch.no_grad():
        m.scale.fill_(3.0)
    launches.clear()
    assert_matches_eager(m, x)
    assert launches, "the fused forward should still run, with the recomputed product"


def test_load_state_dict_is_seen(projection):
    m, x = projection
    other = ScaledProjection()
    with torch.no_grad():
        other.w.mul_(-2.0)
        other.scale.fill_(1.5)
    m.load_state_dict(other.state_dict())
    assert_matches_eager(m, x)
    with torch.no_grad():
        assert mismatch(m(x), eager(other, x), "output", KERNEL) is None


def test_a_replaced_parameter_storage_is_seen(projection):
    m, x = projection
    m.w.data = randn(16, 32, seed=7)
    assert_matches_eager(m, x)


def test_a_change_seen_during_a_capture_runs_eager_and_warns_once(projection, launches, monkeypatch):
    m, x = projection
    monkeypatch.setattr(fuser.install.fixed_at_apply, "capturing", lambda: True)
    with torch.no_grad():
        m.scale.fill_(3.0)
    launches.clear()
    with pytest.warns(UserWarning, match="CUDA-graph capture"):
        assert_matches_eager(m, x)
    assert launches == [], "a stale precomputed value must not be used"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_matches_eager(m, x)  # no second warning
    monkeypatch.setattr(fuser.install.fixed_at_apply, "capturing", lambda: False)
    assert_matches_eager(m, x)
    assert launches, "outside the capture the value is recomputed and the fused forward runs"


# ---------------------------------------------------------------------------------------------
# Autograd runs the eager code
# ---------------------------------------------------------------------------------------------


def test_backward_through_a_fused_module_gives_the_eager_gradients(launches):
    m, x = ScaledProjection(), randn(4, 32)
    reference = copy.deepcopy(m)
    fuser.apply(m, (x,))

    launches.clear()
    m(x).sum().backward()
    assert launches == [], "the fused kernels have no backward"
    reference(x).sum().backward()
    for (name, p), q in zip(m.named_parameters(), reference.parameters()):
        assert p.grad is not None and torch.allclose(p.grad, q.grad), name

    with torch.no_grad():
        m(x)
    assert launches, "without autograd the fused forward runs"


def test_requires_grad_is_read_at_each_call(launches):
    m, x = ScaledProjection(), randn(4, 32)
    m.requires_grad_(False)
    fuser.apply(m, (x,))
    launches.clear()
    m(x)  # grad mode on, but nothing requires grad
    assert launches
    m.requires_grad_(True)
    launches.clear()
    m(x).sum().backward()
    assert launches == [] and m.w.grad is not None
    launches.clear()
    m(x.requires_grad_(True)).sum()  # an input requiring grad is enough
    assert launches == []


# ---------------------------------------------------------------------------------------------
# Scalar attributes captured as literals
# ---------------------------------------------------------------------------------------------


def test_captured_attributes_are_reported_and_a_change_runs_eager(launches):
    m, x = ScaledProjection(), randn(4, 32)
    report = fuser.apply(m, (x,))
    assert report.literals == {"norm.variance_epsilon": 1e-6}
    assert "norm.variance_epsilon=1e-06" in report.text()
    assert '"norm.variance_epsilon": 1e-06' in report.json()

    m.norm.variance_epsilon = 0.5
    launches.clear()
    with pytest.warns(UserWarning, match="norm.variance_epsilon"):
        assert_matches_eager(m, x)
    assert launches == [], "the fused forward holds the old epsilon"
    m.norm.variance_epsilon = 1e-6
    assert_matches_eager(m, x)
    assert launches, "back at the fused value, the fused forward runs again"


# ---------------------------------------------------------------------------------------------
# Example inputs fuser cannot trace on
# ---------------------------------------------------------------------------------------------


def test_example_inputs_without_tokens_are_refused():
    m = ScaledProjection()
    with pytest.raises(fuser.FuserError, match="example inputs need at least one token: input `x`"):
        fuser.apply(m, (randn(0, 32),))
    assert not fuser.is_fused(m)


def test_a_meta_input_is_named():
    with pytest.raises(fuser.FuserError, match="input `x` is on the meta device"):
        fuser.apply(ScaledProjection(), (torch.empty(4, 32, device="meta"),))


def test_a_parameter_on_another_device_is_named():
    m = ScaledProjection()
    m.norm.weight = nn.Parameter(torch.empty(32, device="meta"))
    with pytest.raises(fuser.FuserError, match="parameter `norm.weight` is on the meta device"):
        fuser.apply(m, (randn(4, 32),))
    assert not fuser.is_fused(m)


def test_inputs_and_parameters_on_different_devices_are_named(monkeypatch):
    """Two real devices are not at hand on every machine: a parameter that reports another
    device stands in for one."""
    m = ScaledProjection()
    monkeypatch.setattr(type(m.w), "device", property(lambda t: torch.device("cuda", 1) if t is m.w else t.data.device))
    with pytest.raises(fuser.FuserError, match=r"parameter `w` is on cuda:1 but input `x` is on cpu"):
        fuser.explain(m, (randn(4, 32),))


# ---------------------------------------------------------------------------------------------
# The report names the kernel files where they are
# ---------------------------------------------------------------------------------------------


def test_the_report_shows_the_real_kernel_path(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSER_KERNEL_DIR", str(tmp_path))
    report = fuser.explain(ScaledProjection(), (randn(4, 32),))
    assert report.chains
    for chain in report.chains:
        path = Path(chain.path)
        assert path.parent == tmp_path and path.is_file() and path.stem == chain.kernel
        assert str(path) in report.text()
    assert isinstance(report, Report) and report.to_json()["chains"][0]["path"] == report.chains[0].path
