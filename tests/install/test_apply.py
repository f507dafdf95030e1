"""fuser.apply / fuser.restore / fuser.check: in-place splicing, the guard, and validation."""

import dataclasses
import inspect
import os
import threading

import pytest
import torch
import torch.nn as nn
from helpers import spied_launches

import fuser
from examples.dsv4 import layer as dsv4
from fuser.validate import against_eager
from fuser.validate.tolerance import KERNEL, mismatch

THIS_FILE = os.path.basename(__file__)


# ---------------------------------------------------------------------------------------------
# The tiny DSv4 layer: in place, same parameters, same state
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fused_layer():
    layer, inputs = dsv4.tiny(T=5)
    params = {n: p for n, p in layer.named_parameters()}
    param_ids = {n: id(p) for n, p in params.items()}
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    report = dsv4.fuse_layer(layer, inputs)[""].report  # the layer, and nested its shared expert
    return layer, inputs, report, param_ids, params, state


def test_apply_keeps_the_same_parameter_objects(fused_layer):
    layer, _, report, param_ids, params, _ = fused_layer
    assert report.chains, "nothing was fused"
    assert fuser.is_fused(layer) and fuser.is_fused(layer.get_submodule(dsv4.SHARED_EXPERT))
    after = {n: id(p) for n, p in layer.named_parameters()}
    assert after == param_ids
    for n, p in layer.named_parameters():
        assert p is params[n]


def test_apply_leaves_state_dict_keys_and_values_unchanged(fused_layer):
    layer, _, _, _, _, state = fused_layer
    after = layer.state_dict()
    assert list(after) == list(state)
    for k, v in state.items():
        assert after[k].dtype == v.dtype and torch.equal(after[k], v), k


def test_apply_twice_raises(fused_layer):
    layer, inputs, _, _, _, _ = fused_layer
    fused_forward = layer.forward
    with pytest.raises(fuser.FuserError, match="already fused"):
        fuser.apply(layer, inputs)
    assert layer.forward is fused_forward
    assert fuser.is_fused(layer)


def test_restore_gives_back_the_original_forward():
    layer, inputs = dsv4.tiny(T=5)
    reference, ref_inputs = dsv4.tiny(T=5)  # never fused
    fuser.apply(layer, inputs)
    assert "forward" in layer.__dict__
    fuser.restore(layer)

    assert "forward" not in layer.__dict__
    assert not hasattr(layer, "_fuser_state")
    assert not fuser.is_fused(layer)
    assert layer.forward.__func__ is type(layer).forward
    assert layer.forward.__self__ is layer
    with torch.no_grad():
        out, ref = layer(*inputs), reference(*ref_inputs)
    assert torch.equal(out, ref)
    assert torch.equal(layer.self_attn.attn.keys(), reference.self_attn.attn.keys())
    with pytest.raises(ValueError):
        fuser.restore(layer)  # nothing left to restore


# ---------------------------------------------------------------------------------------------
# The guard, on a small module whose shape works at any hidden size
# ---------------------------------------------------------------------------------------------


class ScaledNorm(nn.Module):
    """Weight-free RMSNorm then an affine: a pattern kernel and a generic one, merged into one."""

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (xf.to(x.dtype) * 2 + 1).to(x.dtype)


def bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.fixture(scope="module")
def guarded():
    with spied_launches() as calls:
        m = ScaledNorm()
        report = fuser.apply(m, (bf16(5, 64),))
    return m, report, calls


def eager(x):
    return ScaledNorm()(x)


def test_guard_runs_fused_kernels_at_another_token_count(guarded):
    m, report, calls = guarded
    assert [c.pattern for c in report.chains] == ["rmsnorm_weightless+generic"]
    calls.clear()
    x = bf16(7, 64, seed=1)
    out = m(x)
    assert sorted(calls) == sorted(c.pattern for c in report.chains)
    assert mismatch(out, eager(x), "output", KERNEL) is None


@pytest.mark.parametrize(
    "x",
    [
        pytest.param(bf16(5, 64).float(), id="dtype"),
        pytest.param(bf16(5, 32), id="hidden-size"),
        pytest.param(bf16(5, 4, 64), id="rank"),
        pytest.param(bf16(0, 64), id="no-tokens"),
    ],
)
def test_guard_falls_back_to_eager(guarded, x):
    m, _, calls = guarded
    assert m.__dict__["_fuser_state"].guard.why_not((x,), {}) is not None
    calls.clear()
    out = m(x)
    assert calls == [], "a fused kernel ran although the guard should have refused"
    expected = eager(x)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    assert torch.equal(out, expected)


def test_the_guarded_forward_keeps_the_module_signature(guarded):
    m, _, _ = guarded
    assert str(inspect.signature(m.forward)) == str(inspect.signature(ScaledNorm.forward.__get__(m))) == "(x)"


def test_user_predicate_false_never_runs_fused_kernels():
    with spied_launches() as calls:
        m = ScaledNorm()
        report = fuser.apply(m, (bf16(5, 64),), guard=lambda *a, **k: False)
    assert report.chains
    assert m.__dict__["_fuser_state"].guard.why_not((bf16(5, 64),), {}) == "the user guard declined"
    calls.clear()
    for T in (1, 5, 9):
        x = bf16(T, 64, seed=T)
        assert torch.equal(m(x), eager(x))
    assert calls == []


# ---------------------------------------------------------------------------------------------
# A module fuser cannot trace is left exactly as it was
# ---------------------------------------------------------------------------------------------


class BranchesOnTokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64))
        self.register_buffer("seen", torch.zeros(64))

    def forward(self, x):
        self.seen.add_(x.sum(0))
        if x.shape[0] % 2 == 0:  # UNTRACEABLE
            x = x * 2
        return x * self.weight


def test_apply_on_untraceable_module_raises_and_leaves_it_unchanged():
    m = BranchesOnTokens()
    x = torch.randn(6, 64)
    params = {n: (p, p.clone()) for n, p in m.named_parameters()}
    buffers = {n: (b, b.clone()) for n, b in m.named_buffers()}
    dict_before = dict(m.__dict__)

    with pytest.raises(fuser.FuserError) as excinfo:
        fuser.apply(m, (x,))

    line = next(i for i, s in enumerate(open(__file__), 1) if s.rstrip().endswith("# UNTRACEABLE"))
    assert f"{THIS_FILE}:{line}" in str(excinfo.value)
    assert isinstance(excinfo.value.__cause__, fuser.TraceRefused)
    assert "forward" not in m.__dict__
    assert "_fuser_state" not in m.__dict__ and not hasattr(m, "_fuser_state")
    assert not fuser.is_fused(m)
    assert m.__dict__.keys() == dict_before.keys()
    for n, p in m.named_parameters():
        assert p is params[n][0] and torch.equal(p, params[n][1]), n
    for n, b in m.named_buffers():
        assert b is buffers[n][0] and torch.equal(b, buffers[n][1]), n
    # Still the plain eager module.
    assert m.forward.__func__ is BranchesOnTokens.forward


# ---------------------------------------------------------------------------------------------
# Validation: a kernel that computes the wrong values is caught
# ---------------------------------------------------------------------------------------------


def test_apply_time_validation_rejects_a_wrong_kernel_and_does_not_splice_it():
    with spied_launches(corrupt="rmsnorm_weightless") as calls:
        m = ScaledNorm()
        report = fuser.apply(m, (bf16(5, 64),))

    rejected = [r for r in report.rejected if r.category == "validation"]
    # The merged kernel fails, then its parts are validated on their own: the norm fails too.
    assert [r.pattern for r in rejected] == ["rmsnorm_weightless+generic", "rmsnorm_weightless"]
    assert all(r.reason for r in rejected) and rejected[0].reason.endswith("run unmerged")
    assert "rmsnorm_weightless" not in [c.pattern for c in report.chains]
    assert [c.pattern for c in report.chains] == ["generic"]
    assert any("disagreed" in u.reason for u in report.unfused)

    calls.clear()
    for T in (2, 5):
        x = bf16(T, 64, seed=T)
        assert mismatch(m(x), eager(x), "output", KERNEL) is None
    assert calls and "rmsnorm_weightless" not in calls


@pytest.mark.gpu
def test_on_a_gpu_kernels_are_validated_side_by_side_with_the_same_verdicts(monkeypatch):
    """On a GPU the kernels of a module are validated in threads, so that their compiles overlap
    (fuser.validate.against_eager.validate_all): the wrong kernel is still the one rejected."""
    threads = set()
    real = against_eager.validate

    def validate(kernel, values, cops):
        threads.add(threading.get_ident())
        return real(kernel, values, cops)

    monkeypatch.setattr(against_eager, "validate", validate)
    with spied_launches(corrupt="rmsnorm_weightless"):
        m = ScaledNorm()
        report = fuser.apply(m, (bf16(5, 64).cuda(),))

    rejected = [r.pattern for r in report.rejected if r.category == "validation"]
    assert rejected == ["rmsnorm_weightless+generic", "rmsnorm_weightless"]
    assert [c.pattern for c in report.chains] == ["generic"]
    assert threads - {threading.get_ident()}  # the two parts ran in the pool's threads
    x = bf16(7, 64, seed=7).cuda()
    assert mismatch(m(x), eager(x), "output", KERNEL) is None


def test_check_reports_a_wrong_kernel_when_validation_is_off():
    m = ScaledNorm()
    x = bf16(5, 64)
    with spied_launches(corrupt="generic"):
        result = fuser.check(m, (x,), validate=False)
    assert not result.ok
    assert result.problems and any(p.startswith("output") for p in result.problems)
    assert "FAILED" in result.text()
    # check() restores the module when done.
    assert not fuser.is_fused(m) and "forward" not in m.__dict__



class UnsortedTopK(nn.Module):
    """A router returning the picks of ``topk(sorted=False)``: their order is the
    implementation's, so a fused kernel may list them in another (valid) order than eager."""

    def forward(self, x):
        scores = torch.sigmoid(x.float())
        ids = torch.topk(scores, 4, dim=-1, sorted=False).indices
        return ids, scores.gather(1, ids) * 2.0


def test_check_compares_unsorted_topk_picks_in_one_order():
    x = torch.randn(6, 37, generator=torch.Generator().manual_seed(0))
    result = fuser.check(UnsortedTopK(), (x,))
    assert result.ok, result.text()
    with spied_launches(corrupt="generic"):  # a wrong kernel still fails the check
        result = fuser.check(UnsortedTopK(), (x,), validate=False)
    assert not result.ok and any(p.startswith("output") for p in result.problems), result.text()


@dataclasses.dataclass
class Pair:
    scaled: torch.Tensor
    shifted: torch.Tensor


class DictOut(nn.Module):
    def forward(self, x):
        return {"scaled": torch.sigmoid(x) * 3.0, "shifted": x * 2.0 + 1.0}


class DataclassOut(nn.Module):
    def forward(self, x):
        return Pair(torch.sigmoid(x) * 3.0, x * 2.0 + 1.0)


@pytest.mark.parametrize("module", [DictOut(), DataclassOut()], ids=lambda m: type(m).__name__)
def test_check_compares_outputs_in_a_dict_or_a_dataclass(module):
    x = torch.randn(5, 33, generator=torch.Generator().manual_seed(1))
    result = fuser.check(module, (x,))
    assert result.ok, result.text()
    with spied_launches(corrupt="generic"):  # a wrong kernel fails it, naming the field
        result = fuser.check(module, (x,), validate=False)
    assert not result.ok and any(p.startswith(("output['", "output.")) for p in result.problems), result.text()


# ---------------------------------------------------------------------------------------------
# A forward set on the instance (a wrapper or hook installed as ``module.forward``)
# ---------------------------------------------------------------------------------------------


class Sigmoid3(nn.Module):
    def forward(self, x):
        return (torch.sigmoid(x.float()) * 3).to(x.dtype)


def with_instance_forward():
    m = Sigmoid3()
    class_forward = m.forward

    def wrapped(x):
        return class_forward(x) * 2

    m.forward = wrapped
    return m, wrapped


def test_apply_refuses_an_instance_forward_and_leaves_it_in_place():
    m, wrapped = with_instance_forward()
    x = bf16(4, 32)
    expected = m(x)
    with pytest.raises(fuser.FuserError, match="forward set on the instance"):
        fuser.apply(m, (x,))
    assert m.__dict__["forward"] is wrapped
    assert not fuser.is_fused(m)
    assert torch.equal(m(x), expected)


class ScaledByPythonValues(nn.Module):
    """Scales by a tensor its forward makes from Python values (fx reads it as a
    ``_tensor_constant`` attribute), then a second tensor made the same way is added."""

    def __init__(self, width: int):
        super().__init__()
        self.scales = [0.5 + i / width for i in range(width)]

    def forward(self, x, r):
        h = (x + r).float() * torch.tensor(self.scales)
        return (h + torch.tensor([0.25])).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tensors_the_forward_makes_from_python_values_are_constants_of_the_fused_forward(dtype):
    module = ScaledByPythonValues(37)
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(3, 37, generator=g).to(dtype) for _ in range(2))
    attributes = set(vars(module))
    with torch.no_grad():
        expected = module(x, r)
    report = fuser.apply(module, (x, r))
    try:
        assert report.launches_after == 1, report.text()
        with torch.no_grad():
            got, at_one = module(x, r), module(x[:1], r[:1])
        assert mismatch(got, expected, "output", KERNEL) is None
        assert mismatch(at_one, expected[:1], "output at T=1", KERNEL) is None
    finally:
        fuser.restore(module)
    assert set(vars(module)) == attributes  # nothing of the trace is left on the module
    fuser.explain(module, (x, r))
    assert set(vars(module)) == attributes


BUILT_CONFIGS = []


@dataclasses.dataclass
class ScaleConfig:
    scale: float = 0.5

    def __post_init__(self):
        BUILT_CONFIGS.append(self)


@fuser.opaque
def scaled_by_config(x, config: ScaleConfig):
    return x * config.scale


class GivesAConfigToALeaf(nn.Module):
    """Passes a dataclass (as transformers passes its config) to an opaque function: the
    graph reads the very object (fx alone would build it again at every call)."""

    def __init__(self):
        super().__init__()
        self.config = ScaleConfig()

    def forward(self, x, r):
        return scaled_by_config((x + r).relu(), self.config) + 1


def test_a_dataclass_given_to_a_leaf_is_passed_as_it_is():
    module = GivesAConfigToALeaf()
    BUILT_CONFIGS.clear()
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(3, 40, generator=g) for _ in range(2))
    with torch.no_grad():
        expected = module(x, r)
    report = fuser.apply(module, (x, r))
    try:
        with torch.no_grad():
            got = module(x, r)
        assert mismatch(got, expected, "output", KERNEL) is None
        assert report.launches_after < report.launches_before, report.text()
        assert BUILT_CONFIGS == []  # never built again, neither by the trace nor by the fused forward
    finally:
        fuser.restore(module)
