"""causal_lms: the transformers CausalLMs the end-to-end benchmarks run (bench_decode,
bench_generate), at their real dims with random weights and a few layers where memory needs
it, and the weight bytes one decode step of each reads.

Weight bytes of a decode step (:func:`weight_bytes`): every parameter once (a matrix tied to
another, the input embedding and the lm_head, is one parameter: counted once, read whole by the
lm_head), except

* an input embedding the lm_head does not share: the step looks up one row per sequence, so
  ``min(batch, vocab)`` rows are counted, not the matrix;
* routed experts (the parameters under a module named ``experts``: the stacked
  ``[experts, ...]`` tensors of transformers' MoE blocks, or a list of expert modules): each
  token is routed to ``top_k`` of ``E`` experts; the step is counted as reading
  ``min(E, top_k x batch)`` of them (:func:`experts_read`), the tokens' choices assumed all
  distinct. That is the most a step can read, so at batch > 1 a MoE model's roofline share is
  an upper bound (uniform routing reads ``E (1 - (1 - top_k/E)^batch)`` on average: 35 of 64
  where 6 x 8 = 48 are counted). Shared experts and the router are read whole.

Buffers (rotary frequencies, a router's bias) are not counted: they are not weights, and small.
"""

from __future__ import annotations

import torch

from examples.zoo import layers as zoo

# name -> (zoo model, decoder layers, config overrides)
MODELS = {
    "llama_1b": ("llama", 16, dict(  # Llama-3.2-1B (all 16 layers)
        hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        vocab_size=128256, tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),  # (rope_theta= alone is not read once made)
    "qwen3_8b": ("qwen3", 4, {}),
    "qwen3_30b_a3b": ("qwen3_moe", 4, {}),  # 128 experts, 8 a token: the experts' combine, then the next norm
    # 64 of the 256 routed experts, so that the weights of 2 layers fit beside three caches
    "deepseek_v4_flash": ("deepseek_v4", 2, {"n_routed_experts": 64}),
    # LayerNorm models (issue 30's whole-model rows), 4 layers each at real dims
    "gptj_6b": ("gptj", 4, {}),  # parallel residual, gelu_new, rotary over 64 of 256 dims, eager attention
    "starcoder2_7b": ("starcoder2", 4, {}),  # biases everywhere, gelu_tanh MLP
    "gpt_neox_20b": ("gpt_neox", 4, {}),  # head dim 96, a quarter of it rotary, exact GELU
    "phi_2": ("phi", 4, {}),  # one LayerNorm for the parallel attention and MLP, partial rotary, gelu_new
    # GPT-2 XL: Conv1D projections (addmm of [in, out] weights), learned positions, tanh GELU
    "gpt2_xl": ("gpt2", 4, dict(n_embd=1600, n_head=25, n_inner=6400, n_positions=1024, vocab_size=50257)),
}
# Models of no zoo layer: their module, config and CausalLM classes
LM_ONLY = {"gpt2": dict(module="gpt2", config="GPT2Config", lm="GPT2LMHeadModel")}

EXPERT_COUNT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk")
ROUTED_MODULE = "experts"


def config(name: str, layers: int | None = None, **overrides):
    """The config of benchmark model ``name``: its real dims, ``layers`` decoder layers (the
    model's count by default), each like the first."""
    model, count, changes = MODELS[name]
    if model in LM_ONLY:
        spec = LM_ONLY[model]
        cfg = getattr(__import__(f"transformers.models.{spec['module']}", fromlist=["_"]), spec["config"])()
        cfg._attn_implementation = "sdpa"
        cfg.num_hidden_layers = layers or count
        cfg._experts_implementation = None
        for key, value in {**changes, **overrides}.items():
            setattr(cfg, key, value)
        return cfg
    # (a model of UNSEEN: its real dims are among its changes)
    return zoo.causal_lm_config(model, layers or count, "cuda" if model in zoo.MODELS else "cpu", **changes, **overrides)


def causal_lm(name: str, layers: int | None = None, device="cuda", **overrides):
    """The CausalLM ``name`` (random weights, seed 0), bf16, in eval mode, on ``device`` (the
    meta device makes one with no memory, for counting)."""
    model = MODELS[name][0]
    spec = LM_ONLY.get(model) or zoo.MODELS.get(model) or zoo.UNSEEN[model]
    code = __import__(f"transformers.models.{spec['module']}", fromlist=["_"])
    torch.manual_seed(0)
    with torch.device(device):
        lm = getattr(code, spec.get("lm") or spec["prefix"] + "ForCausalLM")(config(name, layers, **overrides))
    return lm.to(torch.bfloat16).eval()


def experts_read(config, batch: int) -> tuple[int, int] | None:
    """(routed experts a decode step of ``batch`` tokens reads, routed experts) per MoE layer:
    ``min(E, top_k x batch)``; None for a model without routed experts."""
    experts = next((getattr(config, k) for k in EXPERT_COUNT_KEYS if getattr(config, k, None)), None)
    top_k = next((getattr(config, k) for k in TOP_K_KEYS if getattr(config, k, None)), None)
    if not experts or not top_k:
        return None
    return min(experts, top_k * batch), experts


def is_routed(name: str) -> bool:
    """Is parameter ``name`` a routed expert's (under a module named ``experts``)?"""
    return ROUTED_MODULE in name.split(".")[:-1]


def weight_bytes(model: torch.nn.Module, batch: int) -> int:
    """Bytes of the weights one decode step of ``batch`` sequences (one token each) reads."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embedding
    routed = experts_read(model.config, batch)
    total = 0
    for name, p in model.named_parameters():  # each parameter once: a tied matrix once
        size = p.numel() * p.element_size()
        if p is embedding and not tied:
            size = min(batch, p.shape[0]) * (size // p.shape[0])
        elif routed and is_routed(name):
            size = size * routed[0] // routed[1]
        total += size
    return total


def roofline_us(weight_bytes: int, copy_gbps: float) -> float:
    """The fastest a step can read ``weight_bytes``: at the bandwidth of a device-to-device copy
    (bytes read + written per second, GB/s)."""
    return weight_bytes / (copy_gbps * 1e9) * 1e6


def roofline_share(weight_bytes: int, copy_gbps: float, step_us: float) -> float:
    """How near a step of ``step_us`` comes to the weight-bandwidth roofline (1 = at it)."""
    return roofline_us(weight_bytes, copy_gbps) / step_us
