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


def _attention_reference(keys, window, q, k, positions, req_pool_indices, attn_sink):
    """Loop per token over the window positions max(0, pos-window+1)..pos; V == K. ``keys`` is
    the dequantised cache [requests, window, head_dim] fp32, ``k`` the new keys, dequantised."""
    keys = keys.clone()
    for t in range(q.shape[0]):
        keys[req_pool_indices[t], positions[t] % window] = k[t]
    scale = q.shape[-1] ** -0.5
    out = torch.empty(q.shape, dtype=torch.float32)
    for t in range(q.shape[0]):
        pos, req = positions[t].item(), req_pool_indices[t].item()
        window_keys = torch.stack([keys[req, p % window] for p in range(max(0, pos - window + 1), pos + 1)])
        s = q[t].float() @ window_keys.T * scale  # [heads, n_valid]
        e = torch.exp(s)
        p = e / (e.sum(-1, keepdim=True) + torch.exp(attn_sink).unsqueeze(-1))
        out[t] = p @ window_keys
    return out.to(torch.bfloat16), keys


def _new_keys(cfg, T, gen):
    """Random keys as the layer hands them to the cache: (fp8 no-RoPE part, its scales, bf16 RoPE
    part), and the same keys dequantised."""
    k = torch.randn(T, cfg.head_dim, generator=gen)
    k_nope, k_scale = dsv4.quantize_fp8(k[:, : cfg.nope_dim], cfg.kv_quant_block)
    k_rope = k[:, cfg.nope_dim :].to(torch.bfloat16)
    dequantised = torch.cat(
        [(k_nope.float().unflatten(-1, (-1, cfg.kv_quant_block)) * k_scale.unsqueeze(-1)).flatten(-2), k_rope.float()], -1
    )
    return (k_nope, k_scale, k_rope), dequantised


@pytest.mark.parametrize("T", [1, 3, 16])
def test_attention_leaf_matches_window_loop(T):
    layer, (_, positions, req_pool_indices, _) = dsv4.tiny(T=T)
    attn, cfg = layer.self_attn.attn, layer.cfg
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(T, cfg.n_heads, cfg.head_dim, generator=gen).to(torch.bfloat16)
    parts, k = _new_keys(cfg, T, gen)
    sink = layer.self_attn.attn_sink

    ref, ref_keys = _attention_reference(attn.keys(), cfg.window_size, q, k, positions, req_pool_indices, sink)
    out = attn(q, *parts, positions, req_pool_indices, sink)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert torch.equal(attn.keys(), ref_keys)
    torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2, msg=lambda m: f"{m}\nmax diff {_max_diff(out, ref)}")


def test_fp8_cache_quantisation_round_trips_within_one_fp8_step():
    """Each block's scale is a power of two with amax / scale in (224, 448]: dequantised, every
    value is within half an e4m3 step (2^-4 relative) of the original, or the subnormal step."""
    cfg = dsv4.FLASH
    rows = torch.tensor([1e-5, 1e-3, 1.0, 50.0, 1e4])[:, None]  # the first below the 1e-4 floor
    x = torch.randn(5, cfg.nope_dim, generator=torch.Generator().manual_seed(4)) * rows
    q, scale = dsv4.quantize_fp8(x, cfg.kv_quant_block)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.shape == (5, cfg.nope_dim // 64)
    assert torch.equal(scale, torch.exp2(torch.log2(scale).round())), "scales are powers of two"
    amax = x.unflatten(-1, (-1, 64)).abs().amax(-1).clamp_min(1e-4)
    assert ((amax / scale <= dsv4.FP8_MAX) & (amax / scale > dsv4.FP8_MAX / 2)).all()
    back = (q.float().unflatten(-1, (-1, 64)) * scale.unsqueeze(-1)).flatten(-2)
    step = scale.repeat_interleave(64, -1) * 2.0**-9
    assert ((back - x).abs() <= torch.maximum(x.abs() * 2.0**-4, step)).all()


def test_attention_leaf_masks_slots_before_position_zero():
    """A request at position p < window - 1 must not see the slots it has not written yet."""
    layer, _ = dsv4.tiny(T=1)
    attn, cfg = layer.self_attn.attn, layer.cfg
    q = torch.randn(1, cfg.n_heads, cfg.head_dim).to(torch.bfloat16)
    parts, _ = _new_keys(cfg, 1, torch.Generator().manual_seed(3))
    positions, req = torch.tensor([1]), torch.tensor([0])
    sink = layer.self_attn.attn_sink
    before = attn(q, *parts, positions, req, sink)
    attn.k_scale[0, 2:] = 1e3  # slots 2.. would hold positions < 0: invisible
    attn.k_rope[0, 2:] = 1e3
    after = attn(q, *parts, positions, req, sink)
    assert torch.equal(before, after)


@pytest.mark.parametrize("hash_layer", [False, True], ids=["biased", "hash"])
def test_forward_writes_current_k_and_nothing_else(hash_layer):
    layer, inputs = dsv4.tiny(T=6, hash_layer=hash_layer)
    _, positions, req_pool_indices, _ = inputs
    attn = layer.self_attn.attn
    cache_before = attn.keys()
    params_before = {n: p.clone() for n, p in layer.named_parameters()}
    inputs_before = [t.clone() for t in inputs]
    seen = {}
    attn.register_forward_hook(lambda mod, args, out: seen.update(k_nope=args[1], k_scale=args[2], k_rope=args[3]))

    layer(*inputs)

    slots = positions % layer.cfg.window_size
    assert torch.equal(attn.k_nope[req_pool_indices, slots].view(torch.uint8), seen["k_nope"].view(torch.uint8))
    assert torch.equal(attn.k_scale[req_pool_indices, slots], seen["k_scale"])
    assert torch.equal(attn.k_rope[req_pool_indices, slots], seen["k_rope"])
    cache = attn.keys()
    assert not torch.equal(cache_before[req_pool_indices, slots], cache[req_pool_indices, slots])
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
