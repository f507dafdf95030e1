"""transformers' own decoder layers, as transformers ships them, for fuser to fuse.

Every model has two factories, each taking the token count ``T``, ``device`` and ``dtype``, and
returning ``(layer, args, kwargs)``: tiny dims on the CPU, the real model's dims on a GPU.

* ``<model>`` — the whole decoder layer with its real attention module (RoPE, q/k norms, GQA,
  sinks, MLA), called the way the model calls it in a decode step: ``T`` sequences, one new
  token each (hidden states ``[T, 1, hidden]``), no KV cache;
* ``<model>_proj`` — the same layer with attention replaced by one projection, so what is left
  is the layer's glue around its norms, MLP or experts.

Experts run through transformers' ``grouped_mm`` path (``config._experts_implementation``).
Nothing here is edited to suit fuser: only configs are chosen and inputs made.

    fuser check examples/zoo/layers.py:qwen3
    fuser bench examples/zoo/layers.py:qwen3_moe_proj --tokens 1,8,128,512
"""

from __future__ import annotations

import copy
import importlib

import torch
import torch.nn as nn

# model -> (transformers module, config class, decoder layer class, rotary class, real dims, tiny dims);
# where the model's names differ: ``layer`` (GPT-NeoX's GPTNeoXLayer), ``attn`` (the layer's attention
# attribute, which ``_proj`` replaces), ``rotary=None`` (GPT-J's attention makes its own sin/cos),
# ``attn_implementation`` (GPT-J ships no SDPA class), ``call`` (more arguments the model's own
# forward passes the layer: Falcon's ``alibi=None``), ``lm`` (the CausalLM class: Llama-4's text model).
REAL, TINY = "real", "tiny"
MODELS = {
    "qwen3": dict(  # Qwen3-8B
        module="qwen3", prefix="Qwen3",
        real=dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8, head_dim=128),
        tiny=dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    ),
    "qwen3_moe": dict(  # Qwen3-30B-A3B
        module="qwen3_moe", prefix="Qwen3Moe",
        real=dict(hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144, num_experts=128,
                  num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128),
        tiny=dict(hidden_size=64, moe_intermediate_size=32, intermediate_size=96, num_experts=8,
                  num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    ),
    "mixtral": dict(  # Mixtral-8x7B
        module="mixtral", prefix="Mixtral",
        real=dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=128),
        tiny=dict(hidden_size=64, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    ),
    "gpt_oss": dict(  # gpt-oss-20b
        module="gpt_oss", prefix="GptOss",
        real=dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                  num_attention_heads=64, num_key_value_heads=8, head_dim=64),
        tiny=dict(hidden_size=64, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    ),
    "gemma3": dict(  # Gemma-3-12B
        module="gemma3", prefix="Gemma3", config="Gemma3TextConfig", layer="Gemma3DecoderLayer", rotary="Gemma3RotaryEmbedding",
        real=dict(hidden_size=3840, intermediate_size=15360, num_attention_heads=16, num_key_value_heads=8, head_dim=256),
        tiny=dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    ),
    "deepseek_v3": dict(  # DeepSeek-V3 (a MoE layer; 64 of its 256 routed experts, so that the
        # benchmark's three copies of the layer fit on one GPU: 256 take 22.5 GB each)
        module="deepseek_v3", prefix="DeepseekV3",
        real=dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=64,
                  num_experts_per_tok=8, n_group=8, topk_group=4, num_attention_heads=128, num_key_value_heads=128,
                  q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                  first_k_dense_replace=0),
        tiny=dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                  num_experts_per_tok=2, n_group=4, topk_group=2, num_attention_heads=4, num_key_value_heads=4,
                  q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                  first_k_dense_replace=0),
    ),
    "deepseek_v4": dict(  # DeepSeek-V4-Flash (a sliding-window MoE layer)
        module="deepseek_v4", prefix="DeepseekV4",
        real=dict(hidden_size=4096, moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=6,
                  num_attention_heads=64, num_key_value_heads=1, head_dim=512, q_lora_rank=1024,
                  o_groups=8, o_lora_rank=1024, layer_types=["sliding_attention"], mlp_layer_types=["moe"]),
        tiny=dict(hidden_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=32, q_lora_rank=32,
                  o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=8,
                  layer_types=["sliding_attention"], mlp_layer_types=["moe"]),
    ),
    "gpt_neox": dict(  # GPT-NeoX-20B: parallel residual, LayerNorms with bias, head dim 96, a quarter of it rotary
        module="gpt_neox", prefix="GPTNeoX", layer="GPTNeoXLayer", attn="attention",
        real=dict(hidden_size=6144, intermediate_size=24576, num_attention_heads=64, rotary_pct=0.25),
        tiny=dict(hidden_size=96, intermediate_size=128, num_attention_heads=4, rotary_pct=0.25),
    ),
    "phi": dict(  # Phi-2: parallel attention and MLP on one LayerNorm, head dim 80, 0.4 of it rotary
        module="phi", prefix="Phi",
        real=dict(hidden_size=2560, intermediate_size=10240, num_attention_heads=32, partial_rotary_factor=0.4),
        tiny=dict(hidden_size=80, intermediate_size=128, num_attention_heads=4, partial_rotary_factor=0.4),
    ),
    "gptj": dict(  # GPT-J-6B: parallel residual, interleaved rotary over 64 of 256 dims from a sin/cos table
        # gathered by position inside attention (no rotary module; only an eager attention class)
        module="gptj", prefix="GPTJ", layer="GPTJBlock", attn="attn", rotary=None, attn_implementation="eager",
        real=dict(n_embd=4096, n_head=16, rotary_dim=64),
        tiny=dict(n_embd=64, n_head=4, rotary_dim=4, n_inner=128),
    ),
    "falcon": dict(  # Falcon-7B: multi-query, parallel attention, 71 heads of 64
        module="falcon", prefix="Falcon", attn="self_attention", call=dict(alibi=None),
        real=dict(hidden_size=4544, num_attention_heads=71, multi_query=True, parallel_attn=True, bias=False),
        tiny=dict(hidden_size=80, num_attention_heads=5, multi_query=True, parallel_attn=True, bias=False,
                  ffn_hidden_size=128),
    ),
    "stablelm": dict(  # StableLM-2-12B: parallel residual, per-head q/k LayerNorms, head dim 160, a quarter rotary
        module="stablelm", prefix="StableLm",
        real=dict(hidden_size=5120, intermediate_size=13824, num_attention_heads=32, num_key_value_heads=8,
                  partial_rotary_factor=0.25, qk_layernorm=True, use_parallel_residual=True),
        tiny=dict(hidden_size=96, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  partial_rotary_factor=0.25, qk_layernorm=True, use_parallel_residual=True),
    ),
    "starcoder2": dict(  # StarCoder2-7B: LayerNorms and projections with bias, gelu_tanh MLP
        module="starcoder2", prefix="Starcoder2",
        real=dict(hidden_size=4608, intermediate_size=18432, num_attention_heads=36, num_key_value_heads=4,
                  sliding_window=4096, bos_token_id=0, eos_token_id=0),
        tiny=dict(hidden_size=96, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  sliding_window=4096, bos_token_id=0, eos_token_id=0),
    ),
    "persimmon": dict(  # Persimmon-8B: relu² MLP, q/k LayerNorms, half of each head rotary
        module="persimmon", prefix="Persimmon",
        real=dict(hidden_size=4096, intermediate_size=16384, num_attention_heads=64, partial_rotary_factor=0.5),
        tiny=dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, partial_rotary_factor=0.5),
    ),
    "nemotron": dict(  # Minitron-8B: LayerNorm1P (weight + 1), relu² MLP, half of each head rotary
        module="nemotron", prefix="Nemotron",
        real=dict(hidden_size=4096, intermediate_size=16384, num_attention_heads=48, num_key_value_heads=8,
                  head_dim=128, partial_rotary_factor=0.5),
        tiny=dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=24, partial_rotary_factor=0.5),
    ),
    "llama4": dict(  # Llama-4-Scout's text layer: complex RoPE, L2 q/k norm, a bmm MoE over every expert
        module="llama4", prefix="Llama4Text", lm="Llama4ForCausalLM",
        real=dict(hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384, num_local_experts=16,
                  num_experts_per_tok=1, num_attention_heads=40, num_key_value_heads=8, head_dim=128),
        tiny=dict(hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_local_experts=4,
                  num_experts_per_tok=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    ),
}  # fmt: skip


#: More of transformers' layers, at tiny dims only: checked on the CPU in CI (tests/model/test_zoo.py),
#: not benchmarked. Nothing was looked at to pick them but that transformers ships them.
_DENSE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
_MOE = dict(_DENSE, moe_intermediate_size=32, num_experts=8, num_local_experts=8, num_experts_per_tok=2)
UNSEEN = {
    "llama": dict(module="llama", prefix="Llama", tiny=_DENSE),
    "mistral": dict(module="mistral", prefix="Mistral", tiny=_DENSE),
    "phi3": dict(module="phi3", prefix="Phi3", tiny=_DENSE),
    "olmo2": dict(module="olmo2", prefix="Olmo2", tiny=_DENSE),
    "granite": dict(module="granite", prefix="Granite", tiny=_DENSE),
    "glm4": dict(module="glm4", prefix="Glm4", tiny=_DENSE),
    "olmoe": dict(module="olmoe", prefix="Olmoe", tiny=_MOE),
    "granitemoe": dict(module="granitemoe", prefix="GraniteMoe", tiny=_MOE),
    "hunyuan_v1_moe": dict(module="hunyuan_v1_moe", prefix="HunYuanMoEV1", tiny=_MOE),
    "qwen2_moe": dict(module="qwen2_moe", prefix="Qwen2Moe", tiny=dict(_MOE, shared_expert_intermediate_size=48)),
    "cohere": dict(module="cohere", prefix="Cohere", tiny=_DENSE),
    "gemma2": dict(module="gemma2", prefix="Gemma2", tiny=_DENSE),
    "minimax": dict(module="minimax", prefix="MiniMax", tiny=_MOE),
    "glm4_moe": dict(module="glm4_moe", prefix="Glm4Moe", tiny=_MOE),
    "ernie4_5_moe": dict(module="ernie4_5_moe", prefix="Ernie4_5_Moe", tiny=_MOE),
    "granitemoeshared": dict(module="granitemoeshared", prefix="GraniteMoeShared", tiny=dict(_MOE, shared_intermediate_size=48)),
    "flex_olmo": dict(module="flex_olmo", prefix="FlexOlmo", tiny=_MOE),
}


def _spec(model: str) -> dict:
    return MODELS[model] if model in MODELS else UNSEEN[model]


def _classes(model: str):
    spec = _spec(model)
    code = importlib.import_module(f"transformers.models.{spec['module']}.modeling_{spec['module']}")
    config_code = importlib.import_module(f"transformers.models.{spec['module']}.configuration_{spec['module']}")
    prefix = spec["prefix"]
    config_class = getattr(config_code, spec.get("config", f"{prefix}Config"))
    layer_class = getattr(code, spec.get("layer", f"{prefix}DecoderLayer"))
    rotary = spec.get("rotary", f"{prefix}RotaryEmbedding")
    rotary_class = getattr(code, rotary) if rotary else None  # GPT-J's attention makes its own
    return config_class, layer_class, rotary_class


def config(model: str, device) -> object:
    """The model's config at real dims on a GPU, tiny dims elsewhere: one layer, eval mode."""
    config_class, _, _ = _classes(model)
    dims = _spec(model)[REAL if torch.device(device).type == "cuda" else TINY]
    cfg = config_class(num_hidden_layers=1, **dims)
    cfg._attn_implementation = _spec(model).get("attn_implementation", "sdpa")
    cfg._experts_implementation = "grouped_mm"
    return cfg


def causal_lm_config(model: str, layers: int, device="cpu", **overrides) -> object:
    """The config of the model's whole CausalLM: the zoo's dims for ``device`` (:func:`config`),
    ``layers`` decoder layers each like the first, then ``overrides`` (a tiny ``vocab_size``, real
    dims of an ``UNSEEN`` model)."""
    cfg = config(model, device)
    cfg.num_hidden_layers = layers
    for key in ("layer_types", "mlp_layer_types", "no_rope_layers"):  # a value per layer
        if getattr(cfg, key, None):
            setattr(cfg, key, getattr(cfg, key)[:1] * layers)
    if getattr(cfg, "moe_layers", None) == [0]:  # the indices of the MoE layers (Llama-4's)
        cfg.moe_layers = list(range(layers))
    for key, value in overrides.items():
        setattr(cfg, key, value)
    if getattr(cfg, "pad_token_id", None) is not None and cfg.pad_token_id >= cfg.vocab_size:
        cfg.pad_token_id = None  # (a real vocabulary's padding id, beyond a tiny one)
    if model == "deepseek_v4":
        cfg._attn_implementation = "eager"  # transformers' DeepseekV4ForCausalLM takes no sdpa
    if "moe" not in model and "deepseek" not in model:
        cfg._experts_implementation = None  # a dense model takes no experts implementation
    return cfg


def causal_lm(model: str, layers: int, device="cpu", **overrides) -> nn.Module:
    """The model's ``<Prefix>ForCausalLM`` (or its spec's ``lm``) of :func:`causal_lm_config`,
    random weights (seed 0), on ``device``, in eval mode, in the config's dtype (fp32)."""
    cfg = causal_lm_config(model, layers, device, **overrides)
    code = importlib.import_module(f"transformers.models.{_spec(model)['module']}")
    torch.manual_seed(0)
    with torch.device(device):
        return getattr(code, _spec(model).get("lm", _spec(model)["prefix"] + "ForCausalLM"))(cfg).eval()


def static_cache(config, max_cache_len: int):
    """transformers' ``StaticCache`` for a decode step captured in a CUDA graph: its plain layers
    in place of sliding-window ones. A ``StaticSlidingWindowLayer`` (every DeepSeek-V4 layer's)
    keeps its length as a Python int, which a replayed graph does not advance, and once its
    window is full indexes with ``torch.tensor([-1], device=...)`` (transformers 5.19,
    ``cache_utils.py:569``), a copy from host memory that no capture takes. A plain layer sized
    for the whole sequence holds every key instead, and the model's own sliding-window mask
    still keeps each token to its window: the same logits (``tests/model/test_decode.py``)."""
    from transformers import StaticCache

    types = getattr(config, "layer_types", None)
    if types and "sliding_attention" in types:
        config = copy.deepcopy(config)
        config.layer_types = ["full_attention" if t == "sliding_attention" else t for t in types]
    return StaticCache(config=config, max_cache_len=max_cache_len)


class Projection(nn.Module):
    """Stands in for a layer's attention: one projection, called as transformers calls attention."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, hidden_states, **kwargs):
        return self.proj(hidden_states), None


def build(model: str, T: int = 3, device="cpu", dtype=torch.bfloat16, projection: bool = False):
    """``(layer, args, kwargs)``: the decoder layer and the inputs of one decode step."""
    torch.manual_seed(0)
    cfg = config(model, device)
    _, layer_class, rotary_class = _classes(model)
    with torch.device(device):
        layer = layer_class(cfg, layer_idx=0)
        _init(layer)
        if projection:
            setattr(layer, _spec(model).get("attn", "self_attn"), Projection(cfg.hidden_size))
        layer = layer.to(dtype).eval()
        hidden = torch.randn(T, 1, cfg.hidden_size, dtype=dtype)
        position_ids = torch.arange(T).view(T, 1) + 7
        kwargs = dict(attention_mask=None, position_ids=position_ids, **_spec(model).get("call", {}))
        if rotary_class is not None:
            kwargs["position_embeddings"] = _rotary(model, rotary_class(cfg), hidden, position_ids)
    args = (hidden,)
    if model == "deepseek_v4":  # hc_mult residual streams, as DeepseekV4Model makes them
        args = (hidden.unsqueeze(2).expand(-1, -1, cfg.hc_mult, -1).contiguous(),)
        kwargs["input_ids"] = torch.randint(0, cfg.vocab_size, (T, 1), device=device)
    return layer, args, kwargs


def _rotary(model, rotary, hidden, position_ids):
    if model == "deepseek_v4":
        return {kind: rotary(hidden, position_ids=position_ids, layer_type=kind) for kind in ("main", "compress")}
    if model == "gemma3":
        return rotary(hidden, position_ids, layer_type="sliding_attention")
    return rotary(hidden, position_ids)


def _init(layer: nn.Module) -> None:
    """Random weights at a scale that keeps activations O(1) (weights are created empty)."""
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)
            elif "norm" in name or name.endswith("weight"):
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.1)
        for name, b in layer.named_buffers():
            if b.is_floating_point() and not torch.isfinite(b).all():
                b.zero_()


def _factories():
    def make(model, projection):
        def factory(T: int = 3, device="cpu", dtype=torch.bfloat16):
            return build(model, T, device, dtype, projection)

        factory.__name__ = model + ("_proj" if projection else "")
        factory.__doc__ = f"transformers' {model} decoder layer" + (", attention replaced by one projection" if projection else "")
        return factory

    return {f.__name__: f for model in MODELS for f in (make(model, False), make(model, True))}


FACTORIES = _factories()
globals().update(FACTORIES)
