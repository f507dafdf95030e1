"""Decode steps with a KV cache on whole transformers CausalLMs (tiny random configs): the
cache is state the fused layers pass through to its update, an automatic leaf (a plain static
layer is written by fuser.install.kv_cache's kernel); the q/k norms and RoPE around it stay fused. Greedy decode, fused against eager, from the same cache."""

import copy

import pytest
import torch
from transformers import StaticCache

import fuser
from fuser.install.splice import STATE_ATTR
from fuser.validate.tolerance import LAYER, mismatch
from examples.zoo import layers as zoo
from tests.install.test_kv_cache import Taken
from tests.model.test_model import causal_lm

BATCH, PROMPT, STEPS = 3, 6, 3


def prefilled(model):
    """A static cache holding a prompt of PROMPT tokens per sequence, and the next tokens."""
    ids = torch.randint(0, 128, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))
    cache = StaticCache(config=model.config, max_cache_len=PROMPT + STEPS + 2)
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    return cache, out.logits[:, -1:].argmax(-1)


def step(tokens, position: int, cache) -> dict:
    return dict(input_ids=tokens, past_key_values=cache, use_cache=True, cache_position=torch.tensor([position]))


def greedy(model, cache, tokens) -> list[torch.Tensor]:
    logits = []
    for i in range(STEPS):
        with torch.no_grad():
            out = model(**step(tokens, PROMPT + i, cache)).logits
        logits.append(out)
        tokens = out[:, -1:].argmax(-1)
    return logits


def assert_same_logits(fused: list[torch.Tensor], eager: list[torch.Tensor], when: str = "") -> None:
    """Each step's logits within the layer tolerance of eager's (``when``: said after the step)."""
    assert len(fused) == len(eager) == STEPS
    for i, (got, expected) in enumerate(zip(fused, eager)):
        problem = mismatch(got, expected, f"logits at step {i}{when}", LAYER)
        assert problem is None, problem


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "deepseek_v4", "ernie4_5_moe"])
def test_greedy_decode_with_a_static_cache_matches_eager(name, monkeypatch):
    model = causal_lm(name, layers=2)
    cache, tokens = prefilled(model)
    eager_cache, fused_cache, example = (copy.deepcopy(cache) for _ in range(3))
    eager = greedy(copy.deepcopy(model), eager_cache, tokens)

    report = fuser.apply(model, (), example_kwargs=step(tokens, PROMPT, example))
    (group,) = report.groups  # one structure: the layer index the cache update takes is read at run time
    assert len(group.layers) == 2 and group.report is not None, report.text()
    assert len({layer.__dict__[STATE_ATTR].fused for layer in model.model.layers}) == 1
    leaves = group.report.automatic_leaves
    assert [leaf["name"] for leaf in leaves] == ["past_key_values.update"], leaves
    assert "modeling_" in leaves[0]["where"]
    assert report.launches_after < report.launches_before / 3, report.text()
    assert torch.equal(example.layers[0].cumulative_length, cache.layers[0].cumulative_length), "apply wrote the example's cache"
    assert torch.equal(example.layers[0].keys, cache.layers[0].keys)

    # A plain StaticLayer (Qwen3's) and a sliding-window one (DeepSeek-V4's) are written by
    # fuser.install.kv_cache's kernel, in every layer and step.
    assert "fuser.install.kv_cache" in leaves[0]["reason"], leaves
    taken = Taken(monkeypatch)
    fused = greedy(model, fused_cache, tokens)
    assert taken.kernel == 2 * STEPS
    assert_same_logits(fused, eager)
    for layer in range(2):  # each layer wrote its own slot of the cache, at the same positions
        got, expected = fused_cache.layers[layer], eager_cache.layers[layer]
        assert torch.equal(got.cumulative_length, expected.cumulative_length)
        assert getattr(got, "cumulative_length_int", None) == getattr(expected, "cumulative_length_int", None)
        problem = mismatch(got.keys, expected.keys, f"layer {layer} keys", LAYER)
        assert problem is None, problem

    fuser.restore(model)
    restored_cache = copy.deepcopy(cache)
    for got, expected in zip(greedy(model, restored_cache, tokens), eager):
        assert torch.equal(got, expected)


def test_check_takes_a_decode_step_and_leaves_the_cache_alone():
    model = causal_lm("qwen3", layers=2)
    cache, tokens = prefilled(model)
    before = copy.deepcopy(cache)
    result = fuser.check(model, (), example_kwargs=step(tokens, PROMPT, cache))
    assert result.ok, result.text()
    for layer in range(2):
        assert torch.equal(cache.layers[layer].keys, before.layers[layer].keys)
        assert torch.equal(cache.layers[layer].cumulative_length, before.layers[layer].cumulative_length)


def test_a_step_without_the_cache_runs_the_eager_layers():
    """The layers were fused for calls with a static cache: a call without one is not it, so
    each layer's guard sends it to the layer's own forward."""
    model = causal_lm("qwen3", layers=2)
    cache, tokens = prefilled(model)
    with torch.no_grad():
        expected = model(input_ids=tokens, use_cache=False).logits
    fuser.apply(model, (), example_kwargs=step(tokens, PROMPT, copy.deepcopy(cache)))
    refused = []
    guard = model.model.layers[0].__dict__[STATE_ATTR].guard
    hook = model.model.layers[0].register_forward_pre_hook(
        lambda m, a, k: refused.append(guard.why_not(a, k)), with_kwargs=True
    )
    with torch.no_grad():
        got = model(input_ids=tokens, use_cache=False).logits
    hook.remove()
    assert refused and refused[0], refused  # (a call without a cache has no mask either)
    problem = mismatch(got, expected, "logits", LAYER)  # the final norm and rotary tables are fused
    assert problem is None, problem


def test_the_q_and_k_paths_of_a_decode_step_run_as_one_kernel():
    """A decode step's RoPE cos and sin are one row for the whole batch (the batch shares its
    positions), broadcast over the tokens: the q norm + RoPE and the k norm + RoPE both read
    them, so they run as one kernel, as they do where each token has its own position."""
    model = causal_lm("qwen3", layers=2)
    cache, tokens = prefilled(model)
    report = fuser.apply(model, (), example_kwargs=step(tokens, PROMPT, copy.deepcopy(cache)))
    (group,) = report.groups
    reads = [set(chain.inputs) for chain in group.report.chains]
    both = [r for r in reads if {"self_attn_q_norm_weight", "self_attn_k_norm_weight"} <= r]
    assert len(both) == 1, group.report.text()


def test_gpt_j_s_sin_cos_row_at_the_shared_position_is_gathered_by_a_kernel():
    """GPT-J gathers its sin/cos row from a table repeated per sequence at the position ids; in
    a decode step those are one position for the whole batch ([1, 1]). The gather is a load of
    the table's row in a kernel (with the sin/cos split and interleave: a chain of no token
    rows, one program), nothing of it left eager, and as the position moves on at every step
    the kernel reads it at run time: greedy decode gives eager's logits. At GPT-J-6B's rotary
    width (64, of a head of 64 here) the table, 2048 positions of 64, is more than one program
    holds: it is read a row at a time, never whole."""
    model = causal_lm("gptj", layers=2, n_embd=128, n_head=2, rotary_dim=64)
    assert model.transformer.h[0].attn.embed_positions.numel() > 1 << 16
    cache, tokens = prefilled(model)
    eager = greedy(copy.deepcopy(model), copy.deepcopy(cache), tokens)
    report = fuser.apply(model, (), example_kwargs=step(tokens, PROMPT, copy.deepcopy(cache)))
    (group,) = report.groups
    assert not group.report.unfused, group.report.text()
    (gathering,) = [c for c in group.report.chains if "gather" in c.nodes]
    assert "embed_positions_stride_0" in open(gathering.path).read()  # the table's row read where it is
    assert_same_logits(greedy(model, copy.deepcopy(cache), tokens), eager)


@pytest.mark.parametrize("name", ["glm4", "ernie4_5_moe"])
def test_an_interleaved_rope_of_a_slice_of_the_shared_sin_cos_leaves_nothing_eager(name):
    """GLM-4 and Ernie 4.5 interleave the first half of the sin/cos row
    (``cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)``). The row is the model's
    input to the layer and the slice a view of it: the RoPE kernel computes the interleave
    itself, reading the row through the slice's strides, so no ``repeat_interleave`` is left to
    PyTorch (Ernie's is in fp32 in a bf16 model); greedy decode gives eager's logits."""
    model = causal_lm(name, layers=2).to(torch.bfloat16)
    cache, tokens = prefilled(model)
    eager = greedy(copy.deepcopy(model), copy.deepcopy(cache), tokens)
    report = fuser.apply(model, (), example_kwargs=step(tokens, PROMPT, copy.deepcopy(cache)))
    (group,) = report.groups
    assert not group.report.unfused, group.report.text()
    (rope,) = [c for c in group.report.chains if any(n.startswith("neg") for n in c.nodes)]
    assert not [i for i in rope.inputs if i.startswith("repeat_interleave")], rope.inputs
    assert_same_logits(greedy(model, copy.deepcopy(cache), tokens), eager)


@pytest.mark.parametrize("name", ["llama4", "hunyuan_v1_moe"])
def test_layers_holding_their_index_twice_share_one_plan_and_write_their_own_cache_layer(name):
    """Llama-4's decoder layer keeps ``layer_idx`` beside its attention's (HunYuan's gate keeps
    one too); only the attention's reaches a call (the cache's update). The layers still share
    one plan, whose update reads the attention's index at run time: each layer writes its own
    cache layer, and greedy decode gives eager's logits and caches."""
    model = causal_lm(name, layers=3).to(torch.bfloat16)
    cache, tokens = prefilled(model)
    eager_cache = copy.deepcopy(cache)
    eager = greedy(copy.deepcopy(model), eager_cache, tokens)
    report = fuser.apply(model, (), example_kwargs=step(tokens, PROMPT, copy.deepcopy(cache)))
    (group,) = report.groups
    assert len(group.layers) == 3, report.text()
    fused_cache = copy.deepcopy(cache)
    assert_same_logits(greedy(model, fused_cache, tokens), eager)
    for layer in range(3):
        problem = mismatch(fused_cache.layers[layer].keys, eager_cache.layers[layer].keys, f"layer {layer} keys", LAYER)
        assert problem is None, problem


@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen3_moe", "deepseek_v4"])
def test_merged_projections_decode_eager_s_logits_before_and_after_a_weight_update(name):
    """Every step-level pass on (merged projections, the residual add in the GEMM, glue across
    layers where it saves a launch): greedy decode from a static cache gives eager's logits at
    every step; then one source weight of each merged group in the second layer is changed in
    place, in both models, and the fused model's steps follow it."""
    model = causal_lm(name, layers=2).to(torch.bfloat16)
    cache, tokens = prefilled(model)
    eager_model = copy.deepcopy(model)
    report = fuser.apply(model, (), example_kwargs=step(tokens, PROMPT, copy.deepcopy(cache)))
    (group,) = report.groups
    merged = group.report.merged_projections
    assert merged, group.report.text()
    second = model.model.layers[1], eager_model.model.layers[1]
    for update in (False, True):
        if update:
            for names in merged:
                last = names.split(" + ")[-1]
                for layer in second:
                    layer.get_submodule(last).weight.data.mul_(1.5)
        expected = greedy(eager_model, copy.deepcopy(cache), tokens)
        assert_same_logits(greedy(model, copy.deepcopy(cache), tokens), expected, " after the update" if update else "")
        assert model.model.layers[1].__dict__[STATE_ATTR].calls.fused >= STEPS, "the fused forward did not run"


def test_a_moe_s_experts_dispatch_leaves_no_glue_eager():
    """transformers' MoE experts (``integrations/moe.py``) gather each pick's hidden row at
    ``perm // top_k_index.size(-1)``, a size read after the cache's update (so a value of the
    call in the trace) that is the router's literal k: the division and the gather run in the
    sort's kernel, nothing of the layer's glue is left to PyTorch."""
    model = causal_lm("qwen3_moe", layers=2).to(torch.bfloat16)
    cache, tokens = prefilled(model)
    report = fuser.apply(model, (), example_kwargs=step(tokens, PROMPT, copy.deepcopy(cache)))
    (group,) = report.groups
    assert not group.report.unfused, group.report.text()
    (sort,) = [c for c in group.report.chains if c.pattern == "expert_sort_rows"]
    assert any(n.startswith("floordiv") for n in sort.nodes), sort.nodes


def test_olmo2_s_residual_add_after_its_post_feedforward_norm_joins_that_norm():
    """Olmo2 adds each sublayer's output normed to the residual: the first sum joins the
    post-attention norm's kernel, and the second add, reading that sum, joins the
    post-feedforward norm's once the first has taken it (the kernels widened again while one
    grows). Nothing of the layer's glue is left to PyTorch; greedy decode gives eager's logits."""
    model = causal_lm("olmo2", layers=2).to(torch.bfloat16)
    cache, tokens = prefilled(model)
    eager = greedy(copy.deepcopy(model), copy.deepcopy(cache), tokens)
    report = fuser.apply(model, (), example_kwargs=step(tokens, PROMPT, copy.deepcopy(cache)))
    (group,) = report.groups
    assert not group.report.unfused, group.report.text()
    norms = [c for c in group.report.chains if c.pattern == "rmsnorm" and any(n.startswith("add") for n in c.nodes)]
    assert len(norms) == 2, group.report.text()
    assert_same_logits(greedy(model, copy.deepcopy(cache), tokens), eager)


def test_a_model_of_one_layer_is_fused_layer_by_layer_and_decodes_as_eager():
    """One decoder layer in its list (a draft model's) is a stack too: the layer, the glue around
    it (the model's own forward, the final norm, the rotary embedding) each fused."""
    model = causal_lm("qwen3", layers=1)
    cache, tokens = prefilled(model)
    eager_cache, fused_cache, example = (copy.deepcopy(cache) for _ in range(3))
    eager = greedy(copy.deepcopy(model), eager_cache, tokens)

    report = fuser.apply(model, (), example_kwargs=step(tokens, PROMPT, example))
    assert [g.layers for g in report.groups] == [["model.layers.0"]] and report.groups[0].report is not None, report.text()
    assert {"model.norm", "model.forward"} <= set(report.others), report.text()
    assert report.launches_after < report.launches_before / 2, report.text()

    fused = greedy(model, fused_cache, tokens)
    assert_same_logits(fused, eager)


def test_deepseek_v4_decodes_alike_from_plain_static_layers_and_the_kernel_writes_them(monkeypatch):
    """``zoo.static_cache`` (the decode benchmark's cache) gives DeepSeek-V4 plain static
    layers in place of its sliding-window ones, which no CUDA graph can capture: the model's own
    sliding-window mask keeps each token to its window, so the logits are transformers' own
    with its sliding cache (a window of 4, shorter than the sequence, so that it matters). Fused,
    fuser.install.kv_cache's kernel writes those layers, and greedy decode matches eager."""
    model = causal_lm("deepseek_v4", layers=2, sliding_window=4)
    ids = torch.randint(0, 128, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))

    def prefilled_from(cache):
        with torch.no_grad():
            return cache, model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)

    sliding, tokens = prefilled_from(StaticCache(config=model.config, max_cache_len=PROMPT + STEPS + 2))
    expected = greedy(model, sliding, tokens)
    plain, tokens = prefilled_from(zoo.static_cache(model.config, PROMPT + STEPS + 2))
    got = greedy(model, plain, tokens)
    assert {type(layer).__name__ for layer in sliding.layers} == {"StaticSlidingWindowLayer"}
    assert {type(layer).__name__ for layer in plain.layers} == {"StaticLayer"}
    wide = causal_lm("deepseek_v4", layers=2, sliding_window=128)  # the window decides the logits
    wide.load_state_dict(model.state_dict())
    with torch.no_grad():
        first_wide = wide(input_ids=ids, use_cache=False).logits
        first = model(input_ids=ids, use_cache=False).logits
    assert mismatch(first, first_wide, "window 4 against 128", LAYER) is not None
    for i, (a, b) in enumerate(zip(got, expected)):
        assert mismatch(a, b, f"plain against sliding layers, step {i}", LAYER) is None

    cache, tokens = prefilled_from(zoo.static_cache(model.config, PROMPT + STEPS + 2))
    eager_model = copy.deepcopy(model)
    eager = greedy(eager_model, copy.deepcopy(cache), tokens)
    fuser.apply(model, (), example_kwargs=step(tokens, PROMPT, copy.deepcopy(cache)))
    taken = Taken(monkeypatch)
    fused = greedy(model, cache, tokens)
    assert taken.kernel == 2 * STEPS
    for i, (a, b) in enumerate(zip(fused, eager)):
        assert mismatch(a, b, f"fused logits at step {i}", LAYER) is None
