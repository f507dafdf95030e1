"""fuser.pipeline.pass_list: the one list of named steps from traced graph to fused forward; each
pass that a fused forward can do without is switched off by name (``disable_passes=``, or
``FUSER_DISABLE_PASSES``) and the module still fuses right; a required or unknown name is an
error naming it; the report says what was off."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fuser
from fuser.pipeline.pass_list import DISABLE_PASSES_ENV, PASS_LIST, describe, switchable
from fuser.trace import tracing

NAMES = [
    "trace",
    "in_place_idioms",
    "attention_calls",
    "per_slice_norms",
    "repeated_rows",
    "next_layer_entry",
    "canonicalize",
    "growing_state",
    "fuse_patterns",
    "fuse_generic",
    "widen",
    "merge",
    "store_in_place",
    "pdl",
    "validate",
    "place",
    "precompute",
    "copy_kernels",
    "once_per_forward",
    "glue_across_layers",
    "rewrite_graph",
    "install_copies",
    "static_cache_write",
    "merge_projections",
    "activation_in_gemm",
    "upcast_in_gemm",
    "residual_in_gemm",
    "decode_gemm",
    "gated_in_gemm",
    "norm_in_gemm",
    "decode_attention",
    "cache_write_in_attention",
    "combine_in_attention",
    "early_weights",
    "compile_forward",
]
REQUIRED = ["trace", "canonicalize", "place", "rewrite_graph", "compile_forward"]
D, H, KV_HEADS, GROUP, KEYS = 64, 96, 2, 2, 7


class Block(nn.Module):
    """A residual add and a Gemma-style RMSNorm (the ``add_rmsnorm`` pattern, merged with
    the glue after it), SiLU(gate) * up with the gate scaled in place, a bf16 weight cast for a matmul (precomputed), sdpa
    over repeated key heads (the attention rewrite), a permuted output flattened (a copy
    kernel) and two writes into slices of one buffer (one by the kernel that computes it)."""

    def __init__(self):
        super().__init__()
        self.norm_weight = nn.Parameter(torch.randn(D) * 0.1)
        self.gate = nn.Linear(D, H, bias=False)
        self.up = nn.Linear(D, H, bias=False)
        self.down_weight = nn.Parameter((torch.randn(D, H) * 0.1).to(torch.bfloat16))

    def forward(self, x, residual, k, v):
        h = x + residual
        hf = h.float()
        normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + self.norm_weight.float())
        normed = normed.to(x.dtype)
        gate = self.gate(normed)
        gate.mul_(0.5)  # an in-place spelling of gate * 0.5 (fuser.trace.in_place_idioms)
        y = F.linear(F.silu(gate) * self.up(normed), self.down_weight.float())
        T = normed.shape[0]
        q = normed.view(T, KV_HEADS * GROUP, 1, D // (KV_HEADS * GROUP)) * 0.25
        attended = F.scaled_dot_product_attention(q, k.repeat_interleave(GROUP, dim=1), v.repeat_interleave(GROUP, dim=1))
        flat = attended.view(T, KV_HEADS * GROUP, D // (KV_HEADS * GROUP)).transpose(1, 2).reshape(T, -1)
        both = h.new_empty(T, 2, D)
        both[:, 0] = (h + y) * 2.0  # a kernel that writes its output into the slice
        both[:, 1] = flat
        return y, both, torch.sigmoid(h * 3.0)  # merged into the norm's kernel


def example(T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = (T, KV_HEADS, KEYS, D // (KV_HEADS * GROUP))
    return (torch.randn(T, D, generator=g), torch.randn(T, D, generator=g), torch.randn(*kv, generator=g), torch.randn(*kv, generator=g))


@pytest.fixture(scope="module")
def block():
    torch.manual_seed(0)
    return Block()


@pytest.fixture(scope="module")
def all_on(block):
    return fuser.explain(block, example())


def test_the_list_names_every_step_in_order():
    assert [p.name for p in PASS_LIST] == NAMES
    assert [p.name for p in PASS_LIST if p.required] == REQUIRED
    assert switchable() == [n for n in NAMES if n not in REQUIRED and n not in ("install_copies", "next_layer_entry")]
    assert [p.name for p in PASS_LIST if p.inside == "trace"] == ["in_place_idioms", "attention_calls", "per_slice_norms", "repeated_rows"]
    # trace() by itself runs the rewrites the list gives it, in the list's order
    assert tracing.REWRITES == tuple(p.run for p in PASS_LIST if p.inside == "trace")
    text = describe()
    assert [line.split()[0] for line in text.splitlines()] == NAMES


def test_the_block_exercises_the_passes(all_on):
    patterns = [c.pattern for c in all_on.chains]
    assert any("add_rmsnorm+" in p for p in patterns), patterns  # a pattern, merged with glue
    assert "copy" in patterns and all_on.precomputed and all_on.attention_calls
    assert "mul_" not in [u.op for u in all_on.unfused]  # gate.mul_(0.5) as gate * 0.5
    assert "setitem" not in [u.node for u in all_on.unfused]  # both[:, 0] = ...: stored in place by its kernel
    assert all_on.disabled_passes == [] and "switched off" not in all_on.text()


def test_merge_switched_off_gives_more_kernels_and_the_same_result(block, all_on):
    result = fuser.check(block, example(), disable_passes=("merge",))
    assert result.ok, result.text()
    report = result.report
    assert len(report.chains) > len(all_on.chains)
    assert not any("+" in c.pattern for c in report.chains), [c.pattern for c in report.chains]
    assert report.disabled_passes == ["merge"]
    assert "passes switched off (disable_passes, FUSER_DISABLE_PASSES): merge" in report.text()


def test_the_environment_variable_switches_passes_off(block, all_on, monkeypatch):
    monkeypatch.setenv(DISABLE_PASSES_ENV, " store_in_place, merge ")
    result = fuser.check(block, example())
    assert result.ok, result.text()
    assert result.report.disabled_passes == ["merge", "store_in_place"]  # in the list's order
    assert len(result.report.chains) > len(all_on.chains)


@pytest.mark.parametrize("name", [n for n in NAMES if n not in REQUIRED and n not in ("install_copies", "next_layer_entry")])
def test_each_pass_switched_off_alone_still_fuses_right(block, name):
    result = fuser.check(block, example(), disable_passes=(name,))
    assert result.ok, f"{name} off: {result.text()}"
    report = result.report
    assert report.disabled_passes == [name] and report.chains
    patterns = [c.pattern for c in report.chains]
    if name == "fuse_patterns":
        assert not any("add_rmsnorm" in p for p in patterns), patterns
    if name == "fuse_generic":
        assert "generic" not in " ".join(patterns), patterns
    if name == "precompute":
        assert report.precomputed == []
    if name == "attention_calls":
        assert report.attention_calls == []
    if name == "in_place_idioms":
        assert "mul_" in [u.op for u in report.unfused]  # gate.mul_(0.5) stays a write
    if name == "copy_kernels":
        assert "copy" not in patterns
    if name == "store_in_place":
        assert "setitem" in [u.node for u in report.unfused]


@pytest.mark.parametrize("name", REQUIRED + ["install_copies", "no_such_pass"])
def test_a_required_or_unknown_name_is_an_error_naming_it(block, name):
    with pytest.raises(fuser.FuserError) as e:
        fuser.apply(block, example(), disable_passes=(name,))
    message = str(e.value)
    assert repr(name) in message and ", ".join(switchable()) in message
    assert not fuser.is_fused(block)
    with pytest.raises(fuser.FuserError, match=repr(name)):
        fuser.explain(block, example(), disable_passes=name)  # a comma-separated string too
    with pytest.raises(fuser.FuserError, match=repr(name)):
        fuser.check(block, example(), disable_passes=[name])


def test_an_unknown_name_in_the_environment_is_an_error_naming_it(block, monkeypatch):
    monkeypatch.setenv(DISABLE_PASSES_ENV, "merge,mrege")
    with pytest.raises(fuser.FuserError, match=f"'mrege' \\(in {DISABLE_PASSES_ENV}\\)"):
        fuser.apply(block, example())
    assert not fuser.is_fused(block)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D) * 0.1)
        self.up = nn.Linear(D, D, bias=False)

    def forward(self, x):
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + self.weight)).to(x.dtype)
        return x + F.silu(normed) * self.up(normed)


class Stack(nn.Module):
    """A model of repeated layers: fused layer by layer (fuser.model.fuse_model)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Layer() for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_model_of_layers_takes_the_option_too():
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(5, D)
    result = fuser.check(model, (x,), disable_passes=("merge",))
    assert result.ok, result.text()
    (group,) = result.report.groups
    assert group.report.disabled_passes == ["merge"] and len(group.layers) == 2
    with pytest.raises(fuser.FuserError, match="'mrege'"):  # refused up front, not each layer left eager
        fuser.apply(model, (x,), disable_passes=("mrege",))
