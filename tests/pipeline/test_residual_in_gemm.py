"""fuser.pipeline.residual_in_gemm: a layer's last residual add, where the residual is a buffer
only the add reads, is done by the linear layer before it (``addmm_`` into the residual): the
add launches nothing. Against eager on transformers' decoder layers over several decode steps
and after a weight update; every case where writing into the residual could be seen, or the
sum would differ, keeps the add."""

import copy

import pytest
import torch
import torch.nn as nn

import fuser
from fuser.install.splice import STATE_ATTR
from fuser.validate.tolerance import LAYER, mismatch
from tests.model.test_decode import PROMPT, STEPS, greedy, prefilled, step
from tests.model.test_model import causal_lm

D = 48


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


def rms_norm(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


class Block(nn.Module):
    """``h = x + y`` and its RMSNorm in one kernel, then ``h + proj(norm(h))``: h is a fresh
    output of that kernel. The variants break one condition each."""

    def __init__(self, bias=False, return_h=False, proj_dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D) * 0.1 + 1)
        self.proj = nn.Linear(D, D, bias=bias, dtype=proj_dtype)
        self.return_h = return_h

    def forward(self, x, y):
        h = x + y
        out = h + self.proj(rms_norm(h, self.weight).to(self.proj.weight.dtype))
        return (out, h) if self.return_h else out


class OnInput(Block):
    """The residual is the call's input: writing into it would change the caller's tensor."""

    def forward(self, x, y):
        return x + self.proj(rms_norm(x + y, self.weight))


def inputs(T=5, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, D, generator=g).to(dtype), torch.randn(T, D, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_add_is_done_by_the_gemm_and_the_result_is_eager_s(dtype):
    torch.manual_seed(0)
    block = Block().to(dtype)
    result = fuser.check(block, inputs(dtype=dtype))
    assert result.ok, result.text()
    (entry,) = result.report.residuals_in_gemm
    add, linear = entry.split(" + ")
    assert linear == "proj" and add not in [u.node for u in result.report.unfused], result.report.text()
    assert "residuals added by the GEMM before them" in result.report.text()

    off = fuser.explain(block, inputs(dtype=dtype), disable_passes=("residual_in_gemm",))
    assert off.residuals_in_gemm == [] and add in [u.node for u in off.unfused]
    assert off.launches_after == result.report.launches_after + 1

    eager = copy.deepcopy(block)
    fuser.apply(block, inputs(dtype=dtype))
    for seed, T in ((1, 1), (2, 7), (3, 16)):  # other token counts, inputs never written
        x, y = inputs(T, dtype, seed)
        kept = (x.clone(), y.clone())
        problem = mismatch(block(x, y), eager(x, y), f"T={T}", LAYER)
        assert problem is None, problem
        assert torch.equal(x, kept[0]) and torch.equal(y, kept[1])
    assert block.__dict__[STATE_ATTR].calls.fused == 3


def test_a_weight_changed_after_apply_is_used():
    torch.manual_seed(0)
    block = Block()
    fuser.apply(block, inputs())
    block.proj.weight.mul_(-2.0)  # in place, as a weight load does
    eager = copy.deepcopy(block)
    fuser.restore(eager)
    x, y = inputs(seed=4)
    assert mismatch(block(x, y), eager(x, y), "after the update", LAYER) is None
    block.proj.weight = nn.Parameter(torch.randn(D, D))  # replaced
    eager.proj.weight = nn.Parameter(block.proj.weight.detach().clone())
    assert mismatch(block(x, y), eager(x, y), "after the replacement", LAYER) is None


def hooked():
    block = Block()
    block.proj.register_forward_hook(lambda module, args, out: out * 2.0)
    return block


def wrapped():
    """A forward set on the instance (an offloading wrapper's): only a module call runs it."""
    block = Block()
    inner = block.proj.forward
    block.proj.forward = lambda x: inner(x) * 2.0
    return block


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: Block(bias=True), id="a bias"),
        pytest.param(lambda: Block(return_h=True), id="the residual read again"),
        pytest.param(lambda: OnInput(), id="the residual an input"),
        pytest.param(lambda: Block(proj_dtype=torch.bfloat16), id="another dtype"),
        pytest.param(hooked, id="a hook on the linear"),
        pytest.param(wrapped, id="a forward of the linear's own"),
    ],
)
def test_where_the_write_could_be_seen_or_the_sum_differ_the_add_stays(make):
    torch.manual_seed(0)
    block = make()
    x, y = inputs()
    kept = (x.clone(), y.clone())
    result = fuser.check(block, (x, y))
    assert result.ok, result.text()
    assert result.report.residuals_in_gemm == [], result.report.text()
    assert torch.equal(x, kept[0]) and torch.equal(y, kept[1])


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_each_decoder_layer_s_last_add_is_done_by_its_down_projection(name):
    """transformers' layers as shipped, greedy decode from a static cache: the logits of every
    step are eager's, and again after a weight update of one layer's down projection."""
    model = causal_lm(name, layers=2)
    cache, tokens = prefilled(model)
    eager_model = copy.deepcopy(model)
    report = fuser.apply(model, (), example_kwargs=step(tokens, PROMPT, copy.deepcopy(cache)))
    (group,) = report.groups
    assert [e.split(" + ")[1] for e in group.report.residuals_in_gemm] == ["mlp.down_proj"], group.report.text()
    assert "residuals added by the GEMM" in report.text()

    for update in (False, True):
        if update:
            for m in (model, eager_model):
                m.model.layers[1].mlp.down_proj.weight.mul_(1.5)
        eager_cache, fused_cache = copy.deepcopy(cache), copy.deepcopy(cache)
        eager = greedy(eager_model, eager_cache, tokens)
        calls = [layer.__dict__[STATE_ATTR].calls.fused for layer in model.model.layers]
        fused = greedy(model, fused_cache, tokens)
        assert [layer.__dict__[STATE_ATTR].calls.fused - c for layer, c in zip(model.model.layers, calls)] == [STEPS, STEPS]
        for i, (got, expected) in enumerate(zip(fused, eager)):
            problem = mismatch(got, expected, f"logits at step {i}{' after the update' if update else ''}", LAYER)
            assert problem is None, problem


@pytest.mark.parametrize("where", ["proj", "global"])
def test_a_hook_put_on_the_linear_after_apply_runs_the_call_eager_and_says_so(where, recwarn):
    torch.manual_seed(0)
    block = Block()
    fuser.apply(block, inputs())
    assert block.__dict__[STATE_ATTR].report.residuals_in_gemm
    eager = copy.deepcopy(block)
    fuser.restore(eager)
    doubled = lambda module, args, out: out * 2.0 if isinstance(module, nn.Linear) else out  # noqa: E731
    if where == "proj":
        handles = [m.proj.register_forward_hook(doubled) for m in (block, eager)]
    else:
        handles = [nn.modules.module.register_module_forward_hook(doubled)]
    try:
        x, y = inputs(seed=5)
        assert mismatch(block(x, y), eager(x, y), "with the hook", LAYER) is None
    finally:
        for handle in handles:
            handle.remove()
    (reason,) = block.__dict__[STATE_ATTR].calls.declined
    assert "forward hook" in reason
    assert any("forward hook" in str(w.message) for w in recwarn)
    assert mismatch(block(x, y), eager(x, y), "hook removed", LAYER) is None  # fused again
    assert block.__dict__[STATE_ATTR].calls.fused == 1


def test_a_copy_watches_its_own_linear_layer_s_hooks():
    torch.manual_seed(0)
    block = Block()
    fuser.apply(block, inputs())
    twin = copy.deepcopy(block)
    twin.proj.register_forward_hook(lambda module, args, out: out * 2.0)
    x, y = inputs(seed=6)
    with pytest.warns(UserWarning, match="forward hook"):
        twin(x, y)
    block(x, y)
    assert block.__dict__[STATE_ATTR].calls.fused == 1 and not block.__dict__[STATE_ATTR].calls.declined
    assert twin.__dict__[STATE_ATTR].calls.fused == 0
