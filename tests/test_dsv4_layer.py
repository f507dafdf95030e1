"""The plain-PyTorch DeepSeek-V4 decoder layer (examples/dsv4/layer.py) on the TINY config, CPU."""

import pytest
import torch
import torch.nn.functional as F

from examples.dsv4 import layer as dsv4


def _max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("hash_layer", [False, True], ids=["biased", "hash"])
@pytest.mark.parametrize("T", [1, 3, 16])
def test_forward_shape_dtype_finite(T, hash_layer):
    layer, inputs = dsv4.tiny(T=T, hash_layer=hash_layer)
    out = layer(*inputs)
    assert out.shape == (T, dsv4.TINY.hc_mult, dsv4.TINY.hidden_size)
    assert out.dtype == torch.bfloat16
    assert torch.isfinite(out.float()).all()


def test_tiny_hash_factory_is_a_hash_layer():
    layer, _ = dsv4.tiny_hash()
    assert layer.cfg.hash_layer
    assert layer.mlp.gate.e_score_correction_bias is None
    assert layer.mlp.topk.tid2eid.shape == (dsv4.TINY.vocab_size, dsv4.TINY.num_experts_per_tok)


def test_sinkhorn_comb_columns_sum_to_one():
    layer, (R, *_) = dsv4.tiny(T=16)
    cfg = layer.cfg
    y, post, comb = dsv4.mhc_pre(
        R, layer.hc_attn_fn, layer.hc_attn_scale, layer.hc_attn_base,
        cfg.hc_mult, cfg.hc_eps, cfg.rms_norm_eps, cfg.hc_sinkhorn_iters,
    )
    assert y.shape == (16, cfg.hidden_size) and y.dtype == torch.bfloat16
    assert post.shape == (16, cfg.hc_mult) and post.dtype == torch.float32
    assert comb.shape == (16, cfg.hc_mult, cfg.hc_mult) and comb.dtype == torch.float32
    col_sums = comb.sum(dim=1)  # sum over j of comb[t, j, i]
    torch.testing.assert_close(col_sums, torch.ones_like(col_sums), atol=1e-5, rtol=0)
    # 20 rounds bring the rows close to 1 as well: the matrix is (nearly) doubly stochastic.
    row_sums = comb.sum(dim=2)
    torch.testing.assert_close(row_sums, torch.ones_like(row_sums), atol=1e-3, rtol=0)


def _experts_reference(experts, x, weights, ids):
    """Per token, per chosen expert: E_e(x) = swiglu_clamp(x W13_e^T) W2_e^T, weighted sum."""
    limit, inter = experts.limit, experts.inter
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = ids[t, k].item()
            gate_up = x[t] @ experts.w13_weight[e].T
            g = torch.clamp(gate_up[:inter], max=limit)
            u = torch.clamp(gate_up[inter:], -limit, limit)
            h = (F.silu(g.float()) * u.float()).to(torch.bfloat16)
            out[t] += weights[t, k] * (h @ experts.w2_weight[e].T).float()
    return (experts.routed_scaling_factor * out).to(torch.bfloat16)


@pytest.mark.parametrize("T", [1, 3, 16])
def test_experts_leaf_matches_per_token_loop(T):
    layer, _ = dsv4.tiny()
    experts, cfg = layer.mlp.experts, layer.cfg
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(T, cfg.hidden_size, generator=gen).to(torch.bfloat16)
    ids = torch.rand(T, cfg.n_routed_experts, generator=gen).argsort(-1)[:, : cfg.num_experts_per_tok]
    weights = torch.rand(T, cfg.num_experts_per_tok, generator=gen)
    weights = weights / weights.sum(-1, keepdim=True)

    out = experts(x, weights, ids)
    ref = _experts_reference(experts, x, weights, ids)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2, msg=lambda m: f"{m}\nmax diff {_max_diff(out, ref)}")


def _attention_reference(cache, window, q, kv, positions, req_pool_indices, attn_sink):
    """Loop per token over the window positions max(0, pos-window+1)..pos; V == K."""
    cache = cache.clone()
    for t in range(q.shape[0]):
        cache[req_pool_indices[t], positions[t] % window] = kv[t]
    scale = q.shape[-1] ** -0.5
    out = torch.empty(q.shape, dtype=torch.float32)
    for t in range(q.shape[0]):
        pos, req = positions[t].item(), req_pool_indices[t].item()
        keys = torch.stack([cache[req, p % window].float() for p in range(max(0, pos - window + 1), pos + 1)])
        s = q[t].float() @ keys.T * scale  # [heads, n_valid]
        e = torch.exp(s)
        p = e / (e.sum(-1, keepdim=True) + torch.exp(attn_sink).unsqueeze(-1))
        out[t] = p @ keys
    return out.to(torch.bfloat16), cache


@pytest.mark.parametrize("T", [1, 3, 16])
def test_attention_leaf_matches_window_loop(T):
    layer, (_, positions, req_pool_indices, _) = dsv4.tiny(T=T)
    attn, cfg = layer.self_attn.attn, layer.cfg
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(T, cfg.n_heads, cfg.head_dim, generator=gen).to(torch.bfloat16)
    kv = torch.randn(T, cfg.head_dim, generator=gen).to(torch.bfloat16)
    sink = layer.self_attn.attn_sink

    ref, ref_cache = _attention_reference(attn.kv_cache, cfg.window_size, q, kv, positions, req_pool_indices, sink)
    out = attn(q, kv, positions, req_pool_indices, sink)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert torch.equal(attn.kv_cache, ref_cache)
    torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2, msg=lambda m: f"{m}\nmax diff {_max_diff(out, ref)}")


def test_attention_leaf_masks_slots_before_position_zero():
    """A request at position p < window - 1 must not see the slots it has not written yet."""
    layer, _ = dsv4.tiny(T=1)
    attn, cfg = layer.self_attn.attn, layer.cfg
    q = torch.randn(1, cfg.n_heads, cfg.head_dim).to(torch.bfloat16)
    kv = torch.randn(1, cfg.head_dim).to(torch.bfloat16)
    positions, req = torch.tensor([1]), torch.tensor([0])
    sink = layer.self_attn.attn_sink
    before = attn(q, kv, positions, req, sink)
    attn.kv_cache[0, 2:] = 1e3  # slots 2.. would hold positions < 0: invisible
    after = attn(q, kv, positions, req, sink)
    assert torch.equal(before, after)


@pytest.mark.parametrize("hash_layer", [False, True], ids=["biased", "hash"])
def test_forward_writes_current_k_and_nothing_else(hash_layer):
    layer, inputs = dsv4.tiny(T=6, hash_layer=hash_layer)
    _, positions, req_pool_indices, _ = inputs
    cache = layer.self_attn.attn.kv_cache
    cache_before = cache.clone()
    params_before = {n: p.clone() for n, p in layer.named_parameters()}
    inputs_before = [t.clone() for t in inputs]
    seen = {}
    layer.self_attn.attn.register_forward_hook(lambda mod, args, out: seen.update(kv=args[1]))

    layer(*inputs)

    slots = positions % layer.cfg.window_size
    assert torch.equal(cache[req_pool_indices, slots], seen["kv"])
    assert not torch.equal(cache_before[req_pool_indices, slots], seen["kv"])
    untouched = torch.ones(cache.shape[:2], dtype=torch.bool)
    untouched[req_pool_indices, slots] = False
    assert torch.equal(cache[untouched], cache_before[untouched])
    for n, p in layer.named_parameters():
        assert torch.equal(p, params_before[n]), n
    for a, b in zip(inputs, inputs_before):
        assert torch.equal(a, b)


def test_hash_layer_routes_by_token_id():
    layer, inputs = dsv4.tiny_hash(T=4)
    seen = {}
    layer.mlp.experts.register_forward_hook(lambda mod, args, out: seen.update(ids=args[2], w=args[1]))
    layer(*inputs)
    input_ids = inputs[3]
    assert torch.equal(seen["ids"], layer.mlp.topk.tid2eid[input_ids].long())
    torch.testing.assert_close(seen["w"].sum(-1), torch.ones(4))


def test_biased_topk_ranks_by_bias_but_weights_by_scores():
    layer, inputs = dsv4.tiny(T=4)
    gate = layer.mlp.gate
    gate.e_score_correction_bias.zero_()
    gate.e_score_correction_bias[3] = 100.0  # expert 3 wins every ranking ...
    seen = {}
    layer.mlp.experts.register_forward_hook(lambda mod, args, out: seen.update(ids=args[2], w=args[1]))
    layer(*inputs)
    assert (seen["ids"] == 3).any(-1).all()
    assert seen["w"].max() < 0.9  # ... but its weight is its un-biased score, not a dominant one


def test_inverse_rope_undoes_rope():
    freqs = dsv4.rope_freqs(16, 64, 10000.0)[torch.tensor([0, 5, 63])]
    x = torch.randn(3, 16)
    back = dsv4.apply_rope(dsv4.apply_rope(x, freqs), freqs.conj())
    torch.testing.assert_close(back, x, atol=1e-5, rtol=1e-5)
    # position 0 is the identity
    torch.testing.assert_close(dsv4.apply_rope(x[:1], freqs[:1]), x[:1])


def test_same_seed_same_output():
    a_layer, a_inputs = dsv4.tiny(T=5, seed=3)
    b_layer, b_inputs = dsv4.tiny(T=5, seed=3)
    assert torch.equal(a_layer(*a_inputs), b_layer(*b_inputs))
    c_layer, c_inputs = dsv4.tiny(T=5, seed=4)
    assert not torch.equal(a_layer(*a_inputs), c_layer(*c_inputs))
