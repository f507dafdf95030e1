"""A plain-PyTorch DeepSeek-V4 decoder layer, decode path only.

The math follows docs/DSV4.md section 2 step by step (letters A-H, C1-C11, G1-G5 in the comments
refer to it). fp32 where sglang computes in fp32, bf16 rounding exactly where sglang rounds. One
simplification: the layer is SWA-only (compress ratio 0: no compressor, no indexer). Its KV cache
is the production one: the no-RoPE part of each key in FP8 e4m3 with one UE8M0 (power-of-two)
scale per 64 values, the RoPE part in bf16.

Layout of one layer (R is the mHC residual stream, [T, hc_mult, H] bf16):

    y, post, comb = mhc_pre(R, hc_attn_*)      # A  mix stats, split, sinkhorn, stream combine
    x = input_layernorm(y)                     # B
    R = mhc_post(self_attn(x), R, post, comb)  # C, D
    y, post, comb = mhc_pre(R, hc_ffn_*)       # E
    x = post_attention_layernorm(y)            # F
    R = mhc_post(mlp(x), R, post, comb)        # G, H

Everything outside the ``@fuser.opaque`` leaves (the sliding-window attention core, the routed
experts, and the side-stream fork and join around the shared expert) is glue: it is traceable with a
symbolic token count (no Python branch on tensor values or on T, no host syncs), so a tracer can see
every elementwise op and the whole layer can be captured in a CUDA graph.

In capture mode (:func:`capture_mode`, sglang's warm-ups and capture) the shared expert runs on an
alternate CUDA stream, as in sglang's DeepseekV2MoE. That fork is a leaf, so the shared expert's own
glue is fused by a second, nested ``fuser.apply``: :func:`fuse_layer` does both.
"""

import contextlib
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

import fuser
from fuser.pipeline.fuse_module import Plan, apply_plan
from fuser.trace.tracing import preserved_state


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DSV4Config:
    hidden_size: int
    n_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    window_size: int
    max_requests: int
    max_position: int
    vocab_size: int
    hash_layer: bool = False
    kv_quant_block: int = 64  # values per UE8M0 scale in the FP8 key cache
    rms_norm_eps: float = 1e-6
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    rope_theta: float = 10000.0

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim


# DSv4-Flash dimensions (DSV4.md section 1); cache and vocab sizes kept modest.
FLASH = DSV4Config(
    hidden_size=4096,
    n_heads=64,
    head_dim=512,
    rope_dim=64,
    q_lora_rank=1024,
    o_groups=8,
    o_lora_rank=1024,
    n_routed_experts=256,
    num_experts_per_tok=6,
    moe_intermediate_size=2048,
    window_size=128,
    max_requests=512,
    max_position=4096,
    vocab_size=4096,
)

# Same structure, small enough for a CPU test. Every dim is a multiple of 8 so that the bf16
# strides meet torch._grouped_mm's 16-byte alignment.
TINY = DSV4Config(
    hidden_size=64,
    n_heads=4,
    head_dim=32,
    rope_dim=8,
    q_lora_rank=48,
    o_groups=2,
    o_lora_rank=32,
    n_routed_experts=16,
    num_experts_per_tok=6,
    moe_intermediate_size=32,
    window_size=8,
    max_requests=256,
    max_position=64,
    vocab_size=256,
    kv_quant_block=8,  # 3 scales per key, as flash has 7: not a power of two
)


# ---------------------------------------------------------------------------------------------
# Capture mode
# ---------------------------------------------------------------------------------------------

_capture_mode = False


@contextlib.contextmanager
def capture_mode():
    """Stand-in for sglang's ``model_capture_mode()``: set around the decode CUDA-graph warm-ups
    and captures (SGLANG.md section 1.4). Model code asks :func:`is_capture_mode`."""
    global _capture_mode
    previous, _capture_mode = _capture_mode, True
    try:
        yield
    finally:
        _capture_mode = previous


def is_capture_mode() -> bool:
    """Stand-in for sglang's ``get_is_capture_mode()``: a static flag, never a tensor value."""
    return _capture_mode


# ---------------------------------------------------------------------------------------------
# Glue functions (traced through)
# ---------------------------------------------------------------------------------------------


def rms_scale(xf, eps):
    """1 / RMS over the last dim, fp32 in, fp32 out."""
    return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def rmsnorm(x, weight, eps):
    """RMSNorm.forward_native (B, C2, F): fp32 math, the fp32 x bf16 weight product promotes to
    fp32, one rounding to x's dtype at the end."""
    xf = x.float()
    xf = xf * rms_scale(xf, eps)
    return (xf * weight).to(x.dtype)


def sinkhorn(c, eps, iters):
    """A5: row softmax (+eps after it), column normalise, then iters-1 row/column rounds.

    c is [T, n, n] fp32 indexed [t, j, k]; the last op is a column normalisation, so
    sum_j c[t, j, i] ~= 1.
    """
    c = c.softmax(-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def mhc_pre(R, fn, scale, base, hc_mult, hc_eps, rms_eps, iters):
    """A (and E): [T, n, H] bf16 stream -> (y [T, H] bf16, post [T, n] fp32, comb [T, n, n] fp32).

    hc_mult is passed as a static int so the slicing below never depends on a traced shape.
    """
    n = hc_mult
    xf = R.flatten(1).float()  # A1 [T, n*H]
    mixes = torch.matmul(xf, fn.t()) * rms_scale(xf, rms_eps)  # A2, A3 fp32 GEMV, [T, (2+n)*n]
    # A4: split into the three mixing coefficient sets.
    pre = torch.sigmoid(mixes[:, :n] * scale[0] + base[:n]) + hc_eps
    post = 2.0 * torch.sigmoid(mixes[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    c = (mixes[:, 2 * n :] * scale[2] + base[2 * n :]).unflatten(-1, (n, n))
    comb = sinkhorn(c, hc_eps, iters)  # A5
    # A6: weighted sum over streams, fp32 accumulate, one bf16 rounding.
    y = (pre.unsqueeze(-1) * xf.unflatten(1, (n, -1))).sum(1).to(R.dtype)
    return y, post, comb


def mhc_post(out, R, post, comb):
    """D (and H): R'[t, i] = post[t, i] * out[t] + sum_j comb[t, j, i] * R[t, j], fp32, then bf16."""
    mixed = (comb.unsqueeze(-1) * R.unsqueeze(2)).sum(1)  # contracts the first (row) index j
    return (post.unsqueeze(-1) * out.unsqueeze(1) + mixed).to(out.dtype)


def rope_freqs(rope_dim, max_position, theta):
    """freqs_cis[p, j] = exp(i * p * theta^(-2j / rope_dim)), complex64 [max_position, rope_dim/2]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x, freqs):
    """Interleaved (GPT-J) RoPE on the whole last dim of x, fp32 math, result in x's dtype.

    freqs must broadcast against x's complex view [..., d/2] (pass conj(freqs) for the inverse).
    """
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(xc * freqs).flatten(-2).to(x.dtype)


def rope_tail(x, freqs, nope_dim):
    """RoPE on the last rope_dim dims only (DSv4 puts the rotary part at the end of each head)."""
    return torch.cat([x[..., :nope_dim], apply_rope(x[..., nope_dim:], freqs)], dim=-1)


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def ue8m0(y):
    """The smallest power of two >= y (y > 0): a UE8M0 scale is an exponent alone. exp2(ceil(log2
    y)), then corrected by one step either way, so that log2's last-place error never shows."""
    s = torch.exp2(torch.ceil(torch.log2(y)))
    s = torch.where(s * 0.5 >= y, s * 0.5, s)
    return torch.where(s < y, s * 2.0, s)


def quantize_fp8(x, block):
    """C5 cache store: FP8 e4m3 with one UE8M0 scale per ``block`` values along the last dim,
    s = ue8m0(max(1e-4, amax) / 448), q = fp8(x / s). Returns (q [..., n] fp8, s [..., n/block])."""
    blocks = x.unflatten(-1, (-1, block))
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = ue8m0(torch.clamp(amax, min=1e-4) / FP8_MAX)
    return (blocks / scale).to(torch.float8_e4m3fn).flatten(-2), scale.squeeze(-1)


def swiglu_clamp(gate_up, inter, limit):
    """silu(min(g, limit)) * clamp(u, -limit, limit): clamps in the input dtype (bf16), the
    product in fp32, rounded back (G3/G4, silu_and_mul_clamp)."""
    g = torch.clamp(gate_up[..., :inter], max=limit)
    u = torch.clamp(gate_up[..., inter:], -limit, limit)
    return (F.silu(g.float()) * u.float()).to(gate_up.dtype)


def renormalize(scores, ids):
    """G2 tail: gather the un-biased scores of the chosen experts and renormalise them."""
    w = scores.gather(1, ids)
    return w / (w.sum(-1, keepdim=True) + 1e-20)


# ---------------------------------------------------------------------------------------------
# Opaque leaves
# ---------------------------------------------------------------------------------------------


@fuser.opaque
class SlidingWindowAttention(nn.Module):
    """C5 cache store + C8 attention over the sliding window, with a per-head sink.

    The cache is a ring buffer per request: slot s of request r holds the latest position p' with
    p' % window == s. Each key is stored as sglang's FlashMLA cache holds it: the no-RoPE dims in
    FP8 e4m3 (``k_nope``) with one UE8M0 scale per block (``k_scale``), the RoPE dims in bf16
    (``k_rope``). V == K (all head_dim dims, rope part included).
    """

    def __init__(self, cfg: DSV4Config):
        super().__init__()
        self.window = cfg.window_size
        self.scale = cfg.head_dim**-0.5
        self.block = cfg.kv_quant_block
        assert cfg.nope_dim % self.block == 0, f"nope dim {cfg.nope_dim} is not whole blocks of {self.block}"
        slots = (cfg.max_requests, cfg.window_size)
        self.register_buffer("k_nope", torch.zeros(*slots, cfg.nope_dim, dtype=torch.float8_e4m3fn))
        self.register_buffer("k_scale", torch.ones(*slots, cfg.nope_dim // self.block, dtype=torch.float32))
        self.register_buffer("k_rope", torch.zeros(*slots, cfg.rope_dim, dtype=torch.bfloat16))

    def keys(self, index=slice(None)) -> torch.Tensor:
        """The cached keys of the requests ``index``, dequantised: fp32 [..., window, head_dim]."""
        nope = self.k_nope[index].float().unflatten(-1, (-1, self.block)) * self.k_scale[index].unsqueeze(-1)
        return torch.cat([nope.flatten(-2), self.k_rope[index].float()], dim=-1)

    def store(self, req_pool_indices, slots, k_nope, k_scale, k_rope):
        # index_put_ has no float8 kernel: the FP8 bytes are written as uint8.
        self.k_nope.view(torch.uint8).index_put_((req_pool_indices, slots), k_nope.view(torch.uint8))
        self.k_scale.index_put_((req_pool_indices, slots), k_scale)
        self.k_rope.index_put_((req_pool_indices, slots), k_rope)

    def forward(self, q, k_nope, k_scale, k_rope, positions, req_pool_indices, attn_sink):
        slots = positions % self.window
        self.store(req_pool_indices, slots, k_nope, k_scale, k_rope)

        k = self.keys(req_pool_indices)  # [T, W, D] fp32
        # Absolute position held by each slot: the latest p' <= pos with p' % W == slot. It is in
        # (pos - W, pos] by construction, so a slot is valid iff that position is not negative.
        slot_ids = torch.arange(self.window, device=positions.device)
        pos = positions.unsqueeze(1)
        valid = (pos - (pos - slot_ids) % self.window) >= 0  # [T, W]

        s = torch.einsum("thd,twd->thw", q.float(), k) * self.scale
        s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
        # Any m gives the same p; including the sink keeps exp() bounded for large sinks.
        m = torch.maximum(s.amax(-1), attn_sink)  # [T, h]
        p = torch.exp(s - m.unsqueeze(-1))
        denom = p.sum(-1) + torch.exp(attn_sink - m)
        o = torch.einsum("thw,twd->thd", p / denom.unsqueeze(-1), k)
        return o.to(q.dtype)


@fuser.opaque
class GroupedExperts(nn.Module):
    """G3: routed = rsf * sum_k w[:, k] * E_{ids[:, k]}(x), E_e(x) = swiglu_clamp(x W13_e^T) W2_e^T.

    Dispatch is done on device without host syncs: the (token, k) pairs are sorted by expert,
    per-expert end offsets come from a search in the sorted ids, and both projections are one
    grouped GEMM each.
    """

    def __init__(self, cfg: DSV4Config):
        super().__init__()
        E, H, inter = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        # torch._grouped_mm wants 16-byte aligned strides, i.e. bf16 dims that are multiples of 8.
        assert H % 8 == 0 and inter % 8 == 0, f"hidden {H} and moe inter {inter} must be multiples of 8"
        self.n_experts = E
        self.inter = inter
        self.limit = cfg.swiglu_limit
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.w13_weight = nn.Parameter(torch.empty(E, 2 * inter, H, dtype=torch.bfloat16))
        self.w2_weight = nn.Parameter(torch.empty(E, H, inter, dtype=torch.bfloat16))

    def forward(self, x, topk_weights, topk_ids):
        top_k = topk_ids.shape[1]
        flat_ids = topk_ids.flatten()
        sorted_ids, order = torch.sort(flat_ids, stable=True)
        token_of = order // top_k  # row of x feeding each sorted (token, k) pair
        # End offset of expert e = number of pairs routed to experts <= e. (torch.bincount would
        # read the max id back to the host on CUDA, which breaks graph capture.)
        experts = torch.arange(self.n_experts, device=flat_ids.device, dtype=sorted_ids.dtype)
        offs = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)

        x_sorted = x[token_of]
        gate_up = torch._grouped_mm(x_sorted, self.w13_weight.transpose(-2, -1), offs=offs)
        h = swiglu_clamp(gate_up, self.inter, self.limit)
        y = torch._grouped_mm(h, self.w2_weight.transpose(-2, -1), offs=offs)  # [T*k, H] bf16

        w_sorted = topk_weights.flatten()[order].unsqueeze(-1)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        out.index_add_(0, token_of, y.float() * w_sorted)
        return (out * self.routed_scaling_factor).to(x.dtype)


class _Fork:
    """What a :class:`SideStream` and its :class:`JoinStream` share: a plain object, not a Module,
    so the wrapped module's parameters are registered once."""

    def __init__(self):
        self.streams: dict[torch.device, torch.cuda.Stream] = {}  # made on first use, per device
        self.pending: torch.cuda.Stream | None = None  # forked onto, not joined yet


@fuser.opaque
class SideStream(nn.Module):
    """Runs ``module`` on an alternate CUDA stream in capture mode, as sglang's DeepseekV2MoE runs
    its shared expert (SGLANG.md section 2, rule 7): ``alt.wait_stream(cur)``, the work under
    ``torch.cuda.stream(alt)``, and the join left to :class:`JoinStream`. Otherwise, and on the
    CPU, it just calls ``module``.

    A leaf: fuser keeps the stream switches as they are (it refuses them in traced code). The
    glue inside ``module`` is fused by a nested ``fuser.apply(side_stream.module, ...)``.
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.fork = _Fork()

    def forward(self, x):
        if not (is_capture_mode() and x.is_cuda):
            return self.module(x)
        # Created on first use, which is a warm-up: sglang warms up before it captures.
        alt = self.fork.streams.get(x.device)
        if alt is None:
            alt = self.fork.streams[x.device] = torch.cuda.Stream(x.device)
        alt.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(alt):
            out = self.module(x)
        self.fork.pending = alt
        return out


@fuser.opaque
class JoinStream(nn.Module):
    """Joins a :class:`SideStream`'s fork: the current stream waits for the alternate one. Pass the
    side stream's output through it before reading it; it returns its input unchanged."""

    def __init__(self, fork: _Fork):
        super().__init__()
        self.fork = fork

    def forward(self, x):
        alt, self.fork.pending = self.fork.pending, None
        if alt is not None:
            torch.cuda.current_stream(x.device).wait_stream(alt)
        return x


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------


def _linear(fan_in, fan_out):
    return nn.Linear(fan_in, fan_out, bias=False, dtype=torch.bfloat16)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.bfloat16))

    def forward(self, x):
        return rmsnorm(x, self.weight, self.eps)


class MQALayer(nn.Module):
    """C: the SWA-only attention sublayer (compress ratio 0: no compressor, no indexer)."""

    def __init__(self, cfg: DSV4Config):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.nope_dim = cfg.nope_dim
        self.kv_quant_block = cfg.kv_quant_block
        self.q_lora_rank = cfg.q_lora_rank
        self.o_groups = cfg.o_groups
        self.o_lora_rank = cfg.o_lora_rank
        self.eps = cfg.rms_norm_eps
        group_dim = cfg.n_heads * cfg.head_dim // cfg.o_groups

        self.wqkv_a = _linear(cfg.hidden_size, cfg.q_lora_rank + cfg.head_dim)  # cat([wq_a, wkv])
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = _linear(cfg.q_lora_rank, cfg.n_heads * cfg.head_dim)
        self.kv_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.attn_sink = nn.Parameter(torch.zeros(cfg.n_heads, dtype=torch.float32))
        self.wo_a = _linear(group_dim, cfg.o_groups * cfg.o_lora_rank)
        self.wo_b = _linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size)
        self.attn = SlidingWindowAttention(cfg)
        self.register_buffer(
            "freqs_cis", rope_freqs(cfg.rope_dim, cfg.max_position, cfg.rope_theta), persistent=False
        )

    def forward(self, x, positions, req_pool_indices):
        T = x.shape[0]
        freqs = self.freqs_cis[positions]  # [T, rope_dim/2] complex64

        qkv = self.wqkv_a(x)  # C1
        q_lora = qkv[:, : self.q_lora_rank]
        kv = qkv[:, self.q_lora_rank :]

        q = self.wq_b(self.q_norm(q_lora)).view(T, self.n_heads, self.head_dim)  # C2, C3
        # C4: weight-free per-head RMSNorm, rounded to bf16 BEFORE the RoPE.
        qf = q.float()
        q = (qf * rms_scale(qf, self.eps)).to(torch.bfloat16)
        q = rope_tail(q, freqs.unsqueeze(1), self.nope_dim)

        # C5: kv_norm stays fp32 (not rounded); the RoPE part is rounded to bf16 after its RoPE,
        # the rest quantised to FP8 with a UE8M0 scale per block, as the cache stores them.
        kf = kv.float()
        kn = kf * rms_scale(kf, self.eps) * self.kv_norm.weight
        k_rope = apply_rope(kn[..., self.nope_dim :], freqs).to(torch.bfloat16)
        k_nope, k_scale = quantize_fp8(kn[..., : self.nope_dim], self.kv_quant_block)

        o = self.attn(q, k_nope, k_scale, k_rope, positions, req_pool_indices, self.attn_sink)  # C5 store + C8

        # C9: inverse RoPE on the attention output, in place, bf16.
        o[..., self.nope_dim :] = apply_rope(o[..., self.nope_dim :], freqs.conj().unsqueeze(1))

        # C10: grouped wo_a, group g = heads [g*n_heads/o_groups, (g+1)*n_heads/o_groups).
        og = o.view(T, self.o_groups, -1)
        wo_a = self.wo_a.weight.view(self.o_groups, self.o_lora_rank, -1)
        z = torch.einsum("tgd,grd->tgr", og, wo_a)
        return self.wo_b(z.reshape(T, -1))  # C11


class MoEGate(nn.Module):
    """G1: router logits, bf16 weight, fp32 GEMM."""

    def __init__(self, cfg: DSV4Config):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.bfloat16))
        if cfg.hash_layer:
            self.register_parameter("e_score_correction_bias", None)
        else:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x):
        return F.linear(x.float(), self.weight.float())


class HashTopK(nn.Module):
    """G2': routing by token id, a fixed table instead of a learned choice."""

    def __init__(self, cfg: DSV4Config):
        super().__init__()
        self.register_buffer(
            "tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.int32)
        )

    def forward(self, input_ids):
        return self.tid2eid[input_ids].long()


class DeepseekV2MLP(nn.Module):
    """G4: the shared expert, clamped SwiGLU."""

    def __init__(self, cfg: DSV4Config):
        super().__init__()
        self.inter = cfg.moe_intermediate_size
        self.limit = cfg.swiglu_limit
        self.gate_up_proj = _linear(cfg.hidden_size, 2 * cfg.moe_intermediate_size)
        self.down_proj = _linear(cfg.moe_intermediate_size, cfg.hidden_size)

    def forward(self, x):
        return self.down_proj(swiglu_clamp(self.gate_up_proj(x), self.inter, self.limit))


class DeepseekV2MoE(nn.Module):
    """G: router, routed experts (opaque) and the shared expert (on a side stream in capture mode)."""

    def __init__(self, cfg: DSV4Config):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.hash_layer = cfg.hash_layer
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.gate = MoEGate(cfg)
        if cfg.hash_layer:
            self.topk = HashTopK(cfg)
        self.experts = GroupedExperts(cfg)
        self.shared_experts = SideStream(DeepseekV2MLP(cfg))
        self.join = JoinStream(self.shared_experts.fork)

    def forward(self, x, input_ids):
        logits = self.gate(x)  # G1 [T, E] fp32
        scores = torch.sqrt(F.softplus(logits))  # G2 sqrtsoftplus
        if self.hash_layer:  # static config, not a traced value
            ids = self.topk(input_ids)  # G2'
        else:
            # The correction bias only ranks; the weights are the un-biased scores.
            biased = scores + self.gate.e_score_correction_bias
            ids = torch.topk(biased, self.top_k, dim=-1, sorted=False).indices
        weights = renormalize(scores, ids)
        shared = self.shared_experts(x)  # G4, forked onto the side stream in capture mode
        routed = self.experts(x, weights, ids)  # G3 (rsf applied inside), meanwhile
        shared = self.join(shared)  # the current stream waits for the shared expert
        return routed + shared  # G5


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, cfg: DSV4Config):
        super().__init__()
        self.cfg = cfg
        H, n = cfg.hidden_size, cfg.hc_mult
        mix = (2 + n) * n
        self.hc_attn_fn = nn.Parameter(torch.empty(mix, n * H, dtype=torch.float32))
        self.hc_attn_base = nn.Parameter(torch.zeros(mix, dtype=torch.float32))
        self.hc_attn_scale = nn.Parameter(torch.ones(3, dtype=torch.float32))
        self.hc_ffn_fn = nn.Parameter(torch.empty(mix, n * H, dtype=torch.float32))
        self.hc_ffn_base = nn.Parameter(torch.zeros(mix, dtype=torch.float32))
        self.hc_ffn_scale = nn.Parameter(torch.ones(3, dtype=torch.float32))
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.self_attn = MQALayer(cfg)
        self.mlp = DeepseekV2MoE(cfg)

    def _mhc_pre(self, R, fn, scale, base):
        c = self.cfg
        return mhc_pre(R, fn, scale, base, c.hc_mult, c.hc_eps, c.rms_norm_eps, c.hc_sinkhorn_iters)

    def forward(self, hidden_states, positions, req_pool_indices, input_ids):
        R = hidden_states
        y, post, comb = self._mhc_pre(R, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base)  # A
        x = self.input_layernorm(y)  # B
        attn_out = self.self_attn(x, positions, req_pool_indices)  # C
        R = mhc_post(attn_out, R, post, comb)  # D

        y, post, comb = self._mhc_pre(R, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base)  # E
        x = self.post_attention_layernorm(y)  # F
        moe_out = self.mlp(x, input_ids)  # G
        return mhc_post(moe_out, R, post, comb)  # H


# ---------------------------------------------------------------------------------------------
# Factories
# ---------------------------------------------------------------------------------------------


def _init_parameters(layer: DeepseekV4DecoderLayer, gen: torch.Generator):
    """Deterministic init at scales that keep activations O(1) and away from every clamp.

    Matrices get std 1/sqrt(fan_in) (that includes hc_*_fn, so the mixes are O(1) before the sigmoids
    and the sinkhorn softmax).
    """
    for name, p in layer.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("hc_attn_base", "hc_ffn_base"):
            p.normal_(0.0, 0.5, generator=gen)
        elif leaf in ("hc_attn_scale", "hc_ffn_scale"):
            p.normal_(1.0, 0.1, generator=gen)
        elif name.endswith("norm.weight"):  # input/post_attention_layernorm, q_norm, kv_norm
            p.normal_(1.0, 0.1, generator=gen)
        elif leaf == "attn_sink":
            p.normal_(0.0, 1.0, generator=gen)
        elif leaf == "e_score_correction_bias":
            p.normal_(0.0, 0.1, generator=gen)
        else:
            assert p.dim() >= 2, f"no init rule for parameter {name} {tuple(p.shape)}"
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)


def _fill_state(layer: DeepseekV4DecoderLayer, gen: torch.Generator):
    """Random KV history (unit-RMS like real normed keys, stored as the cache stores them) and,
    on hash layers, a routing table with distinct experts per token."""
    cfg = layer.cfg
    attn = layer.self_attn.attn
    keys = torch.randn(*attn.k_nope.shape[:2], cfg.head_dim, generator=gen, device=attn.k_nope.device)
    k_nope, k_scale = quantize_fp8(keys[..., : cfg.nope_dim], cfg.kv_quant_block)
    attn.k_nope.view(torch.uint8).copy_(k_nope.view(torch.uint8))
    attn.k_scale.copy_(k_scale)
    attn.k_rope.copy_(keys[..., cfg.nope_dim :])
    if cfg.hash_layer:
        tid2eid = layer.mlp.topk.tid2eid
        noise = torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=gen, device=tid2eid.device)
        tid2eid.copy_(noise.argsort(-1)[:, : cfg.num_experts_per_tok])


def make_inputs(cfg: DSV4Config, T: int, gen: torch.Generator, device):
    """(hidden_states [T, hc, H] bf16, positions [T], req_pool_indices [T], input_ids [T])."""
    assert T <= cfg.max_requests, f"T={T} decode tokens need as many requests (max {cfg.max_requests})"
    hidden_states = torch.randn(
        T, cfg.hc_mult, cfg.hidden_size, generator=gen, device=device, dtype=torch.bfloat16
    )
    positions = torch.randint(0, 3 * cfg.window_size, (T,), generator=gen, device=device)
    req_pool_indices = torch.randperm(T, generator=gen, device=device)
    input_ids = torch.randint(0, cfg.vocab_size, (T,), generator=gen, device=device)
    return hidden_states, positions, req_pool_indices, input_ids


def build(cfg: DSV4Config, T: int, seed: int, device):
    """Build an initialised layer (eval, no grad) and example decode inputs on `device`."""
    device = torch.device(device)
    with torch.device(device):
        layer = DeepseekV4DecoderLayer(cfg)
    layer.eval().requires_grad_(False)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        _init_parameters(layer, gen)
        _fill_state(layer, gen)
    return layer, make_inputs(cfg, T, gen, device)


def tiny(T: int = 5, hash_layer: bool = False, seed: int = 0, device="cpu"):
    return build(replace(TINY, hash_layer=hash_layer), T, seed, device)


def tiny_hash(T: int = 5, seed: int = 0, device="cpu"):
    return tiny(T, hash_layer=True, seed=seed, device=device)


def flash(T: int = 8, seed: int = 0, device=None):
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return build(FLASH, T, seed, device)


# ---------------------------------------------------------------------------------------------
# Fusing
# ---------------------------------------------------------------------------------------------

#: The shared expert inside its SideStream leaf, by qualified name in the layer.
SHARED_EXPERT = "mlp.shared_experts.module"


def fuse_layer(layer: DeepseekV4DecoderLayer, inputs, **options) -> dict[str, Plan]:
    """``fuser.apply`` on the layer, and a nested one on the shared expert: a leaf's inside is
    never traced, so the glue inside the SideStream (the clamped SwiGLU) needs an apply of its
    own, on the [T, hidden] bf16 input it gets at these inputs (taken from one eager call, state
    restored). ``options`` go to both. Returns the plans (``.report`` says what was fused), by
    qualified name: ``""`` the layer, :data:`SHARED_EXPERT` the shared expert."""
    shared = layer.get_submodule(SHARED_EXPERT)
    seen = {}
    hook = shared.register_forward_pre_hook(lambda _, args: seen.update(x=args[0].clone()))
    try:
        with preserved_state(layer, inputs), torch.no_grad():
            layer(*inputs)
    finally:
        hook.remove()
    plans = {"": apply_plan(layer, inputs, **options)}
    try:
        plans[SHARED_EXPERT] = apply_plan(shared, (seen["x"],), **options)
    except Exception:
        fuser.restore(layer)  # all or nothing, as fuser.apply itself
        raise
    return plans
