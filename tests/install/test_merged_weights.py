"""Linear layers that read one input run as one GEMM on their weights merged at apply time
(fuser.pipeline.merged_projections, fuser.install.merged_weights): against eager, with the
layers' parameters views of the merged tensor — loaded, replaced, copied, restored — and the
groups a merge would change left apart, each with its reason."""

import copy

import pytest
import torch
import torch.nn as nn

import fuser
from tests.model.test_model import causal_lm, decode_inputs, logits

HEADS, DIM, HIDDEN = 4, 8, 32


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():  # as inference runs (a call autograd would record runs eager)
        yield


class Attention(nn.Module):
    """q, k and v of one input (k and v narrower, as with grouped heads), each viewed as heads."""

    def __init__(self, bias: bool = False):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS * DIM, bias=bias)
        self.k_proj = nn.Linear(HIDDEN, 2 * DIM, bias=bias)
        self.v_proj = nn.Linear(HIDDEN, 2 * DIM, bias=bias)
        self.o_proj = nn.Linear(HEADS * DIM, HIDDEN, bias=False)
        self.norm = nn.RMSNorm(HIDDEN)

    def forward(self, x):
        h = self.norm(x)
        q = self.q_proj(h).view(*h.shape[:-1], HEADS, DIM)
        k = self.k_proj(h).view(*h.shape[:-1], 2, DIM).repeat_interleave(2, dim=-2)
        v = self.v_proj(h).view(*h.shape[:-1], 2, DIM).repeat_interleave(2, dim=-2)
        scores = torch.sigmoid((q * k).sum(-1, keepdim=True))
        return x + self.o_proj((scores * v).flatten(-2))


def fused(module, x):
    report = fuser.apply(module, (x,))
    return module, report


def rows_of(merged: torch.Tensor, param: torch.Tensor) -> bool:
    return param.untyped_storage().data_ptr() == merged.untyped_storage().data_ptr()


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_q_k_v_are_one_gemm_and_the_parameters_view_its_weight(bias, dtype, tol):
    torch.manual_seed(0)
    module = Attention(bias).to(dtype)
    x = torch.randn(5, HIDDEN, dtype=dtype)
    eager = copy.deepcopy(module)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    _, report = fused(module, x)
    assert report.merged_projections == ["q_proj + k_proj + v_proj"], report.text()
    merged = module.__dict__["_fuser_merged_q_proj_weight"]
    assert merged.shape == (HEADS * DIM + 4 * DIM, HIDDEN)
    assert all(rows_of(merged, p.weight) for p in (module.q_proj, module.k_proj, module.v_proj))
    assert (module.__dict__.get("_fuser_merged_q_proj_bias") is not None) == bias
    after = module.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    for t in (1, 5, 7):
        x = torch.randn(t, HIDDEN, dtype=dtype)
        torch.testing.assert_close(module(x), eager(x), atol=tol, rtol=tol)
    assert fuser.stats(module)[""]["fused"] == 3


def test_loaded_and_replaced_weights_are_used():
    torch.manual_seed(0)
    module = Attention()
    x = torch.randn(3, HIDDEN)
    fused(module, x)
    other = Attention()
    module.load_state_dict(other.state_dict())  # copied into the views: the merged tensor itself
    torch.testing.assert_close(module(x), other(x), atol=1e-5, rtol=1e-5)
    module.k_proj.weight = nn.Parameter(torch.randn_like(module.k_proj.weight))  # no longer a view: merged again
    other.k_proj.weight = nn.Parameter(module.k_proj.weight.detach().clone())
    torch.testing.assert_close(module(x), other(x), atol=1e-5, rtol=1e-5)
    assert rows_of(module.__dict__["_fuser_merged_q_proj_weight"], module.k_proj.weight)
    assert fuser.stats(module)[""]["fused"] == 2 and not fuser.stats(module)[""]["declined"]


def test_a_copy_is_merged_apart_and_restore_keeps_the_values():
    torch.manual_seed(0)
    module = Attention()
    x = torch.randn(3, HIDDEN)
    expected = copy.deepcopy(module)(x)
    fused(module, x)
    twin = copy.deepcopy(module)
    with torch.no_grad():
        twin.q_proj.weight.mul_(2)
    torch.testing.assert_close(module(x), expected, atol=1e-5, rtol=1e-5)  # the original is not the copy
    assert not torch.allclose(twin(x), expected, atol=1e-3)
    fuser.restore(module)
    assert not any(k.startswith("_fuser_merged") for k in module.__dict__)
    torch.testing.assert_close(module(x), expected, atol=1e-5, rtol=1e-5)


class Tied(Attention):
    def __init__(self):
        super().__init__()
        self.v_proj = nn.Linear(HIDDEN, 2 * DIM, bias=False)
        self.v_proj.weight = self.k_proj.weight  # k and v share one weight


class Flattened(Attention):
    """k's output viewed as one row per call: a column slice of the merged output cannot be."""

    def forward(self, x):
        h = self.norm(x)
        q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        return x + self.o_proj(q * torch.sigmoid(k.view(-1).sum()) + v.repeat(1, 2))


class Quantised(nn.Linear):
    """A subclass of nn.Linear (as quantised linears are): its own forward, never merged."""

    def forward(self, x):
        return super().forward(x) * 0.5


class WithSubclass(Attention):
    def __init__(self):
        super().__init__()
        self.k_proj = Quantised(HIDDEN, 2 * DIM, bias=False)


@pytest.mark.parametrize(
    "make, merged, why",
    [
        (Tied, [], "tied to another parameter"),
        (Flattened, [], "cannot take a column slice"),
        (WithSubclass, ["q_proj + v_proj"], None),
    ],
    ids=["tied", "flattened", "subclass"],
)
def test_groups_a_merge_would_change_are_left_apart_with_their_reason(make, merged, why):
    torch.manual_seed(0)
    module = make()
    x = torch.randn(3, HIDDEN)
    eager = copy.deepcopy(module)
    _, report = fused(module, x)
    assert report.merged_projections == merged, report.text()
    if why:
        assert any(why in reason for reason in report.projections_apart.values()), report.projections_apart
    torch.testing.assert_close(module(x), eager(x), atol=1e-5, rtol=1e-5)


def test_the_pass_can_be_switched_off():
    module = Attention()
    report = fuser.apply(module, (torch.randn(3, HIDDEN),), disable_passes=("merge_projections",))
    assert not report.merged_projections and "_fuser_merged_q_proj_weight" not in module.__dict__


def test_each_layer_of_a_model_merges_its_own_weights():
    model = causal_lm("qwen3", layers=2)
    inputs = decode_inputs()
    expected = logits(model, inputs)
    fuser.apply(model, (), example_kwargs=inputs)
    merged = [layer.__dict__["_fuser_merged_self_attn_q_proj_weight"] for layer in model.model.layers]
    assert merged[0].data_ptr() != merged[1].data_ptr()
    for layer, m in zip(model.model.layers, merged):
        assert rows_of(m, layer.self_attn.v_proj.weight) and rows_of(layer.__dict__["_fuser_merged_mlp_gate_proj_weight"], layer.mlp.up_proj.weight)
    torch.testing.assert_close(logits(model, inputs), expected, atol=1e-4, rtol=1e-4)


def test_a_hook_put_on_a_merged_layer_after_apply_runs_the_call_eager():
    torch.manual_seed(0)
    module = Attention()
    x = torch.randn(5, HIDDEN)
    eager = copy.deepcopy(module)
    fuser.apply(module, (x,))
    for m in (module, eager):
        m.k_proj.register_forward_hook(lambda mod, args, out: out * 0.5)
    with pytest.warns(UserWarning, match="forward hook"):
        got = module(x)
    torch.testing.assert_close(got, eager(x), atol=1e-5, rtol=1e-5)
    assert module.__dict__["_fuser_state"].calls.fused == 0


def test_a_layer_with_a_forward_of_its_own_is_not_merged():
    """A forward set on the instance (an offloading wrapper's) runs only when the layer is called."""
    torch.manual_seed(0)
    module = Attention()
    inner = module.k_proj.forward
    module.k_proj.forward = lambda h: inner(h) * 0.5
    result = fuser.check(module, (torch.randn(5, HIDDEN),))
    assert result.ok, result.text()
    assert all("k_proj" not in group for group in result.report.merged_projections), result.report.text()
