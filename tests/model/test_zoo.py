"""transformers' own decoder layers (examples/zoo), as transformers ships them: fused vs eager
within the layer tolerance, with no hand-given leaves, and a bound on the glue launches left.

Each bound is the layer's chain structure, read off its modeling code: one kernel per stretch
of glue between two heavy ops (GEMMs, attention, grouped GEMMs), plus one launch for each op
listed under ``EAGER`` below, which no template lowers yet. The report must not leave any other
op unfused.
"""

import pytest
import torch

import fuser
from examples.zoo import layers as zoo

# transformers' grouped_mm experts (integrations/moe.py): the sort by expert, the expert
# offsets (histc of the sorted ids, cast first, + cumsum) and the inverse permutation
# (``inv[perm] = arange``) are one kernel that also copies the hidden rows of the sorted pairs
# (hidden[perm // k]: EXPERT_SORT below); the routing weights' gather by the permutation, the weighting,
# the gather back by the inverse permutation and the sum over the k experts join the kernel
# after the down GEMM. Nothing of the routing is left eager.
ROUTING: dict = {}

# The layer's last residual add: one op alone between the last GEMM and the output, it runs
# as itself (a kernel of its own would be one launch too).
LAST_ADD = {"add": 1}

# Stretches of glue between heavy ops, each one kernel:
DENSE_PROJ = [
    "input_layernorm",
    "residual add + post_attention_layernorm (one kernel, both written)",
    "act(gate) * up",
]
QK_NORM_ROPE = ["q_norm and k_norm with their RoPE (one kernel: both read the same cos/sin)"]
ROPE = ["RoPE of q and k (one kernel)"]
# The expert sort of every grouped_mm MoE layer (patterns/expert_sort_rows.py): sort, the
# histc input's cast, histc, cumsum, the inverse permutation and the gathered hidden rows in one
# launch.
EXPERT_SORT = [
    "experts: sorted ids, permutation, offsets, inverse permutation and hidden[perm // k] (one kernel)",
]
MOE_PROJ = [
    "input_layernorm",
    "residual add + post_attention_layernorm",
    "router: softmax (or top-k then softmax), top-k, renormalisation",
    *EXPERT_SORT,
    "experts' act(gate) * up",
    "routing weights, the rows put back in token order, sum over the k experts + residual add",
]
GEMMA_PROJ = [
    "input_layernorm",
    "post_attention_layernorm + residual add + pre_feedforward_layernorm",
    "gelu_tanh(gate) * up",
    "post_feedforward_layernorm + residual add",
]
DEEPSEEK_V3_PROJ = [
    "input_layernorm",
    "residual add + post_attention_layernorm (+ the gate's fp32 cast)",
    "gate: sigmoid + correction bias, per-group top-2 sums, group top-k, group mask, masked scores, top-k, gather, renormalisation, scaling",
    *EXPERT_SORT,
    "routed experts' act(gate) * up",
    "shared expert's act(gate) * up",
    "routing weights, the rows put back in token order, sum over the k experts + shared expert + residual add",
]
DEEPSEEK_V3_MLA = [
    "q_a_layernorm",
    "kv_a_layernorm (before kv_b_proj)",
    "RoPE of q_pe and k_pe, the query's concatenation, the key's (k_nope comes from kv_b_proj)",
]
DEEPSEEK_V4_PROJ = [
    "attention mHC pre: mix statistics (cast, sum of squares) before the mix GEMM",
    "attention mHC pre: split, 20-iteration Sinkhorn, stream combine, input_layernorm",
    "attention mHC post merged with the FFN pre's mix statistics",
    "FFN mHC pre: split, Sinkhorn, combine, post_attention_layernorm",
    "router: sqrt-softplus, biased top-k, gather, renormalisation",
    *EXPERT_SORT,
    "routed experts' clamped SwiGLU",
    "shared expert's clamped SwiGLU",
    "FFN mHC post: routed rows weighted, put back in token order and summed, + shared, stream expand and mix",
]
DEEPSEEK_V4_ATTENTION = [
    "q_a norm",
    "q head norm",
    "kv norm",
    "RoPE of q and of the kv (one kernel)",
    "inverse RoPE of the attention output",
    "the output projection's input: a reshape of a permuted einsum result, which must copy (fuser's copy kernel)",
]
# transformers' GPT-OSS experts have biases: gathered per sorted slot and added in place
# (`out.add_(bias)`) after each grouped GEMM. The GEMM's output is fresh, so the add is read as
# `out.add(bias)` (fuser.trace.in_place_idioms) and joins the kernel after each GEMM: the interleaved gate and
# up (`gate_up[..., ::2]`, `[..., 1::2]`) are taken in registers. Nothing is left eager.
EXPERT_BIASES: dict = {}
# DeepSeek-V3's group-limited gate builds its group mask in place (zeros_like + scatter_), read
# as zeros_like(...).scatter(...) (fuser.trace.in_place_idioms) and spread over the experts by a reshape of an
# expanded view (a copy in eager, a register reshape in the gate's kernel): one kernel.
GROUP_MASK: dict = {}
# MLA builds its key in a new buffer filled by two copy_ writes (k_nope, then k_pe over the
# heads), read as their concatenation (fuser.trace.in_place_idioms): it joins the kernel that computes k_pe.
MLA_WRITES: dict = {}
# In fp32, two of DeepSeek-V4's interleaved rotary tables (`cos.repeat_interleave(2, -1)`) are
# read by the merged RoPE kernel rather than recomputed in it (in bf16 every kernel recomputes them).
DEEPSEEK_V4_TABLES = {"repeat_interleave": 2}


def _plus(*counts: dict) -> dict:
    total: dict = {}
    for c in counts:
        for op, n in c.items():
            total[op] = total.get(op, 0) + n
    return total


# layer -> (stretches of glue, ops left eager: op -> launches)
BOUNDS = {
    "qwen3_proj": (DENSE_PROJ, LAST_ADD),
    "qwen3": (DENSE_PROJ + QK_NORM_ROPE, LAST_ADD),
    "qwen3_moe_proj": (MOE_PROJ, ROUTING),
    "qwen3_moe": (MOE_PROJ + QK_NORM_ROPE, ROUTING),
    "mixtral_proj": (MOE_PROJ, ROUTING),
    "mixtral": (MOE_PROJ + ROPE, ROUTING),
    "gpt_oss_proj": (MOE_PROJ, _plus(ROUTING, EXPERT_BIASES)),
    "gpt_oss": (MOE_PROJ + ROPE, _plus(ROUTING, EXPERT_BIASES)),
    "gemma3_proj": (GEMMA_PROJ, {}),
    "gemma3": (GEMMA_PROJ + QK_NORM_ROPE, {}),
    "deepseek_v3_proj": (DEEPSEEK_V3_PROJ, _plus(ROUTING, GROUP_MASK)),
    "deepseek_v3": (DEEPSEEK_V3_PROJ + DEEPSEEK_V3_MLA, _plus(ROUTING, GROUP_MASK, MLA_WRITES)),
    "deepseek_v4_proj": (DEEPSEEK_V4_PROJ, ROUTING),
    "deepseek_v4": (DEEPSEEK_V4_PROJ + DEEPSEEK_V4_ATTENTION, _plus(ROUTING, DEEPSEEK_V4_TABLES)),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", list(BOUNDS))
def test_zoo_layer_fuses_within_its_bound(name, dtype):
    layer, args, kwargs = zoo.FACTORIES[name](T=3, dtype=dtype)
    result = fuser.check(layer, args, example_kwargs=kwargs)
    assert result.ok, result.problems
    report = result.report
    assert not report.automatic_leaves, report.automatic_leaves  # every part of the layer traced
    stretches, eager = BOUNDS[name]
    unfused: dict[str, int] = {}
    for u in report.unfused:
        unfused[u.op] = unfused.get(u.op, 0) + u.launches
    extra = {op: n for op, n in unfused.items() if n > eager.get(op, 0)}
    assert not extra, f"left eager beyond the bound: {extra}\n{report.text()}"
    bound = len(stretches) + sum(eager.values())
    assert report.launches_after <= bound, report.text()
    assert report.launches_after < report.launches_before


@pytest.mark.parametrize("projection", [False, True], ids=["whole", "proj"])
@pytest.mark.parametrize("name", list(zoo.UNSEEN))
def test_more_of_transformers_layers_fuse_with_only_the_last_residual_add_left(name, projection):
    """Layers nobody here looked at to pick (examples/zoo's UNSEEN), in bf16: they match eager,
    trace without leaves, and leave nothing eager but (in some) the last residual add, which
    sits alone between the last GEMM and the output."""
    layer, args, kwargs = zoo.build(name, T=3, projection=projection)
    result = fuser.check(layer, args, example_kwargs=kwargs)
    assert result.ok, result.problems
    report = result.report
    assert not report.automatic_leaves, report.automatic_leaves
    assert {(u.op, u.launches) for u in report.unfused} <= {("add", 1)}, report.text()
    assert report.launches_after * 4 <= report.launches_before, report.text()


def test_the_residual_add_and_the_norm_after_it_are_one_kernel():
    """Llama-style: `h = residual + attn; norm(h)` and `h` read again by the next residual."""
    layer, args, kwargs = zoo.FACTORIES["qwen3_proj"](T=3)
    report = fuser.explain(layer, args, example_kwargs=kwargs)
    (add_norm,) = [c for c in report.chains if "add_1" in c.nodes]
    assert "add_1" in add_norm.outputs and len(add_norm.outputs) == 2  # the sum and the norm
    first = next(c for c in report.chains if "add_1" not in c.nodes and "mul_1" in c.nodes)
    assert first.outputs == ["mul_1"]  # the pre-weight value nobody reads is not written
