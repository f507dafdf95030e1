"""fuser.trace.attention_calls: sdpa calls read grouped key/value heads in place of their repeats, and
take an additive mask made as glue in place of a boolean one; a multi-query call (one key head,
broadcast) takes a fused backend as a grouped one; eager attention's two products
read the un-repeated keys and values — in transformers' own attention as shipped, and in
hand-written spellings; a head order that is not a repeat in place, and a layout whose tokens
are not the first dim, are left alone. Fused against eager within the layer tolerance."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fuser
from fuser.validate.tolerance import LAYER, mismatch
from fuser.trace.tracing import trace
from tests.model.test_decode import PROMPT, prefilled, step
from tests.model.test_model import causal_lm

KV_HEADS, GROUP, DIM, KEYS = 2, 3, 16, 7


class Attention(nn.Module):
    """Queries of KV_HEADS * GROUP heads against KV_HEADS key heads, repeated as ``spell`` says."""

    def __init__(self, spell: str):
        super().__init__()
        self.spell = spell

    def repeat(self, x, n):
        b, h, s, d = x.shape
        if self.spell == "expand":  # transformers' repeat_kv
            return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)
        if self.spell == "repeat_interleave":
            return x.repeat_interleave(n, dim=1)
        if self.spell == "repeat":  # head h reads key head h % KV_HEADS: not grouped in place
            return x.repeat(1, n, 1, 1)
        raise ValueError(self.spell)

    def forward(self, q, k, v, mask):
        q = q * 2.0
        return F.scaled_dot_product_attention(q, self.repeat(k, GROUP), self.repeat(v, GROUP), attn_mask=mask)


def inputs(tokens=3, queries=2, mask_kind="bool", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, KV_HEADS * GROUP, queries, DIM, generator=g)
    k, v = (torch.randn(tokens, KV_HEADS, KEYS, DIM, generator=g) for _ in range(2))
    mask = torch.rand(tokens, 1, queries, KEYS, generator=g) > 0.3
    mask[0, 0, 0] = False  # a row that attends to nothing
    if mask_kind == "float":
        mask = torch.where(mask, 0.0, -1e4)
    return q, k, v, mask


def sdpa_call(graph):
    (node,) = [n for n in graph.nodes if n.target is F.scaled_dot_product_attention]
    return node


@pytest.mark.parametrize("spell", ["expand", "repeat_interleave"])
def test_repeated_heads_are_read_grouped_and_the_boolean_mask_made_additive(spell):
    module, example = Attention(spell), inputs()
    traced = trace(module, example)
    call = sdpa_call(traced.graph)
    assert call.kwargs["enable_gqa"] is True
    assert call.args[1].name == "k" and call.args[2].name == "v", call.args  # the inputs themselves
    assert call.kwargs["attn_mask"].op == "call_method" and call.kwargs["attn_mask"].target == "to"
    assert not [n for n in traced.graph.nodes if n.target in ("expand", "reshape", "repeat_interleave")]
    (record,) = traced.attention_calls
    assert record.grouped == GROUP and record.copies_removed == 2 and record.mask

    expected = module(*example)
    fuser.apply(module, example)
    for seed, tokens in ((0, 3), (1, 5)):
        got, want = module(*inputs(tokens, seed=seed)), Attention(spell)(*inputs(tokens, seed=seed))
        assert mismatch(got, want, f"{spell}, {tokens} tokens", LAYER) is None
    assert mismatch(module(*example), expected, "the example", LAYER) is None


def test_a_head_order_that_is_not_a_repeat_in_place_is_left_as_it_is():
    module, example = Attention("repeat"), inputs()
    traced = trace(module, example)
    call = sdpa_call(traced.graph)
    assert "enable_gqa" not in call.kwargs and call.args[1].target == "repeat"
    assert [r.grouped for r in traced.attention_calls] == [0]  # the mask alone
    expected = module(*example)
    fuser.apply(module, example)
    assert mismatch(module(*example), expected, "repeat", LAYER) is None


def test_a_float_mask_and_an_ungrouped_call_are_untouched():
    class Plain(nn.Module):
        def forward(self, q, k, v, mask):
            return F.scaled_dot_product_attention(q * 2.0, k, v, attn_mask=mask)

    q, k, v, mask = inputs(mask_kind="float")
    traced = trace(Plain(), (q, k.repeat_interleave(GROUP, 1), v.repeat_interleave(GROUP, 1), mask))
    assert traced.attention_calls == []
    assert sdpa_call(traced.graph).kwargs["attn_mask"].name == "mask"


def test_transformers_qwen3_attention_reads_its_cache_grouped():
    """transformers' sdpa attention as shipped: ``repeat_kv`` of the static cache's keys and
    values, and the boolean causal mask, in a decode step of a whole Qwen3 model."""
    model = causal_lm("qwen3", layers=2)
    cache, tokens = prefilled(model)
    eager_model, eager_cache, fused_cache = copy.deepcopy(model), copy.deepcopy(cache), copy.deepcopy(cache)
    report = fuser.apply(model, (), example_kwargs=step(tokens, PROMPT, copy.deepcopy(cache)))
    (group,) = report.groups
    (line,) = group.report.attention_calls
    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    assert f"enable_gqa, {groups} query heads a key head" in line and "2 copies" in line and "mask made additive" in line
    assert not [c for c in group.report.chains if c.pattern == "copy"]  # no copy kernel left for the repeats
    with torch.no_grad():
        got = model(**step(tokens, PROMPT, fused_cache)).logits
        want = eager_model(**step(tokens, PROMPT, eager_cache)).logits
    assert mismatch(got, want, "logits", LAYER) is None


def test_transformers_eager_attention_reads_its_cache_grouped():
    """transformers' eager attention as shipped (``eager_attention_forward``: ``repeat_kv``, then
    two ``torch.matmul``), in a decode step of a whole Qwen3 model: each product reads the
    un-repeated keys or values, a key head's query heads as its rows; the logits are eager's."""
    model = causal_lm("qwen3", layers=2)
    model.config._attn_implementation = "eager"
    cache, tokens = prefilled(model)
    eager_model, eager_cache, fused_cache = copy.deepcopy(model), copy.deepcopy(cache), copy.deepcopy(cache)
    report = fuser.apply(model, (), example_kwargs=step(tokens, PROMPT, copy.deepcopy(cache)))
    (group,) = report.groups
    lines = group.report.attention_calls
    assert len(lines) == 2 and all("un-repeated heads" in line and "1 copies" in line for line in lines), lines
    assert not [c for c in group.report.chains if c.pattern == "copy"]
    with torch.no_grad():
        got = model(**step(tokens, PROMPT, fused_cache)).logits
        want = eager_model(**step(tokens, PROMPT, eager_cache)).logits
    assert mismatch(got, want, "logits", LAYER) is None


class EagerAttention(nn.Module):
    num_key_value_groups = GROUP

    def forward(self, q, k, v):
        from transformers.models.llama.modeling_llama import eager_attention_forward

        return eager_attention_forward(self, q, k, v, None, scaling=0.25)[0]


def test_eager_attention_with_the_tokens_past_the_first_dim_keeps_its_repeats():
    """The regrouping reshapes fix every dim but the first: where the tokens are another dim
    (one sequence, its tokens as the query rows), the products are left as they are."""
    module = EagerAttention()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, KV_HEADS * GROUP, 5, DIM, generator=g)
    k, v = (torch.randn(1, KV_HEADS, 5, DIM, generator=g) for _ in range(2))
    traced = trace(module, (q, k, v), batch_inputs={"q": 2, "k": 2, "v": 2})
    assert traced.attention_calls == []
    grouped = trace(module, (q.transpose(0, 2).contiguous(), k.expand(5, -1, -1, -1).contiguous(), v.expand(5, -1, -1, -1).contiguous()))
    assert [r.grouped for r in grouped.attention_calls] == [GROUP, GROUP]  # tokens first: rewritten


class DecodeAttention(Attention):
    def forward(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q * 2.0, self.repeat(k, q.shape[1] // k.shape[1]),
                                              self.repeat(v, q.shape[1] // k.shape[1]), attn_mask=mask)  # fmt: skip


def decode_inputs(tokens, heads, kv_heads, dim, keys, dtype, seed=0):
    """One new token per sequence against a cache of ``keys`` slots, the last ones not yet
    written (masked), and one sequence with nothing to attend to."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, 1, dim, generator=g)
    k, v = (torch.randn(tokens, kv_heads, keys, dim, generator=g) for _ in range(2))
    mask = (torch.arange(keys) < keys - 5).expand(tokens, 1, 1, keys).clone()
    mask[0] = False
    return tuple(x.cuda().to(dtype) for x in (q, k, v)) + (mask.cuda(),)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tokens", [1, 8, 128])
def test_on_the_gpu_a_decode_call_is_grouped_and_matches_eager(dtype, tokens):
    """Qwen3-8B's attention shape (32 query heads, 8 key heads, 128 dims) against a cache of
    352 slots: on the H200 sdpa takes the grouped call with the backend of the call as made
    (cuDNN attention), and the sequence with nothing to attend to gets what eager gives it."""
    module, example = DecodeAttention("expand"), decode_inputs(tokens, 32, 8, 128, 352, dtype)
    traced = trace(module, example)
    assert sdpa_call(traced.graph).kwargs.get("enable_gqa") is True, traced.attention_calls
    expected = module(*example)
    fuser.apply(module, example)
    assert mismatch(module(*example), expected, f"{dtype}, {tokens} tokens", LAYER) is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("dim, keys", [(16, 7), (64, 33), (80, 100)])
def test_on_the_gpu_any_backend_gives_what_eager_gives(dtype, dim, keys):
    """Small and odd shapes, where sdpa may pick another backend for a grouped call (then the
    repeats stay) or fill a boolean mask its own way: the fused call gives eager's result,
    rows with nothing to attend to included."""
    module, example = DecodeAttention("expand"), decode_inputs(4, 6, 2, dim, keys, dtype, seed=dim)
    expected = module(*example)
    fuser.apply(module, example)
    assert mismatch(module(*example), expected, f"{dtype}, dim {dim}, {keys} keys", LAYER) is None


class MultiQuery(nn.Module):
    """Keys and values of one head, broadcast by sdpa over the query's heads (Falcon's)."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q * 2.0, k, v)


def multi_query_inputs(tokens=3, heads=6, keys=7, dim=DIM, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, 1, dim, generator=g)
    k, v = (torch.randn(tokens, 1, keys, dim, generator=g) for _ in range(2))
    return tuple(x.to(device, dtype) for x in (q, k, v))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_one_key_head_takes_a_fused_backend_as_grouped_and_matches_eager(dtype):
    example = multi_query_inputs(dtype=dtype)
    traced = trace(MultiQuery(), example)
    assert sdpa_call(traced.graph).kwargs.get("enable_gqa") is True
    (record,) = traced.attention_calls
    assert record.grouped == 6 and record.backend and record.backend != "math"
    assert "in place of its math one" in record.line()
    result = fuser.check(MultiQuery(), example)
    assert result.ok, result.problems
    module = MultiQuery()
    fuser.apply(module, example)
    for tokens in (1, 5):
        other = multi_query_inputs(tokens, dtype=dtype, seed=tokens)
        assert mismatch(module(*other), MultiQuery()(*other), f"{tokens} tokens", LAYER) is None


class OneQueryHead(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q[:, :1], k, v)


def test_one_head_on_both_sides_or_a_call_grouped_already_is_left_as_it_is():
    example = multi_query_inputs()
    assert trace(OneQueryHead(), example).attention_calls == []
    grouped = trace(Grouped(), example)
    assert grouped.attention_calls == [] and sdpa_call(grouped.graph).kwargs.get("enable_gqa") is True


class Grouped(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tokens", [1, 8, 128])
def test_on_the_gpu_one_key_head_takes_a_fused_backend_and_matches_eager(dtype, tokens):
    """Falcon-7B's attention shape (71 query heads, one key head of 64) against 300 keys."""
    example = multi_query_inputs(tokens, 71, 300, 64, dtype, seed=tokens, device="cuda")
    traced = trace(MultiQuery(), example)
    (record,) = traced.attention_calls
    assert record.backend and record.backend != "math", record.line()
    module = MultiQuery()
    expected = module(*example)
    fuser.apply(module, example)
    assert mismatch(module(*example), expected, f"{dtype}, {tokens} tokens", LAYER) is None


class MaskedEagerAttention(nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups

    def forward(self, q, k, v, mask):
        from transformers.models.llama.modeling_llama import eager_attention_forward

        return eager_attention_forward(self, q, k, v, mask, scaling=q.shape[-1] ** -0.5)[0]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tokens", [1, 8, 128])
def test_on_the_gpu_eager_attention_products_are_regrouped_and_match_eager(dtype, tokens):
    """DeepSeek-V4's attention shape (64 query heads over one key head of 512 dims) against a
    cache of 352 slots, in transformers' eager attention: both products read the one key head,
    and the result is eager's (an additive mask as transformers makes it, a row masked whole)."""
    q, k, v, mask = decode_inputs(tokens, 64, 1, 512, 352, dtype)
    additive = torch.where(mask, 0.0, torch.finfo(dtype).min).to(dtype)
    module, example = MaskedEagerAttention(64), (q, k, v, additive)
    traced = trace(module, example)
    assert [r.grouped for r in traced.attention_calls] == [64, 64]
    expected = module(*example)
    fuser.apply(module, example)
    assert mismatch(module(*example), expected, f"{dtype}, {tokens} tokens", LAYER) is None
