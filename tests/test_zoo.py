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

# transformers' grouped_mm experts (integrations/moe.py): sorting the token-expert pairs by
# expert, the expert offsets (histc + cumsum), the gathers by the sort's permutation and the
# scatter that inverts it, and the routing-weight multiply left alone between the down GEMM
# and a gather: 12 launches.
ROUTING = {"sort": 1, "floordiv[int64]": 1, "index": 3, "cast": 1, "histc": 1, "cumsum[int32]": 1,
           "mul": 1, "empty_like[int64]": 1, "arange[int64]": 1, "setitem": 1}  # fmt: skip

# The layer's last residual add: one op alone between the last GEMM and the output, it runs
# as itself (a kernel of its own would be one launch too).
LAST_ADD = {"add": 1}

# Stretches of glue between heavy ops, each one kernel:
DENSE_PROJ = [
    "input_layernorm",
    "residual add + post_attention_layernorm (one kernel, both written)",
    "act(gate) * up",
]
ATTENTION = ["q_norm and k_norm with their RoPE (one kernel: both read the same cos/sin)"]
MOE_PROJ = [
    "input_layernorm",
    "residual add + post_attention_layernorm",
    "router: softmax, top-k, renormalisation",
    "experts' act(gate) * up",
    "sum over the k experts + residual add",
]

# layer -> (stretches of glue, ops left eager: op -> launches)
BOUNDS = {
    "qwen3_proj": (DENSE_PROJ, LAST_ADD),
    "qwen3": (DENSE_PROJ + ATTENTION, LAST_ADD),
    "qwen3_moe_proj": (MOE_PROJ, ROUTING),
    "qwen3_moe": (MOE_PROJ + ATTENTION, ROUTING),
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


def test_the_residual_add_and_the_norm_after_it_are_one_kernel():
    """Llama-style: `h = residual + attn; norm(h)` and `h` read again by the next residual."""
    layer, args, kwargs = zoo.FACTORIES["qwen3_proj"](T=3)
    report = fuser.explain(layer, args, example_kwargs=kwargs)
    (add_norm,) = [c for c in report.chains if "add_1" in c.nodes]
    assert "add_1" in add_norm.outputs and len(add_norm.outputs) == 2  # the sum and the norm
    first = next(c for c in report.chains if "add_1" not in c.nodes and "mul_1" in c.nodes)
    assert first.outputs == ["mul_1"]  # the pre-weight value nobody reads is not written
