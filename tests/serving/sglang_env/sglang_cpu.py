"""Running pieces of the real sglang 0.5.23 on the CPU, for the plugin tests.

* :func:`init_single_process_dist`: world size 1 on gloo and sglang's model-parallel groups,
  as ``sglang.test.layer_ut_utils.init_single_process_dist`` does (that module imports
  sglang's benchmark datasets, which need packages the tests do not install).
* :func:`use_torch_fallbacks`: sglang's own switches for its torch paths of the mHC
  (``SGLANG_OPT_USE_TILELANG_MHC_PRE=0`` and friends) and of its fused ops
  (``SGLANG_FORCE_FUSED_OP_BACKEND=torch``: RMSNorm, TopK, SiluAndMul run ``forward_native``);
  set before sglang reads them.
* :func:`decode_batch`: sglang's own ``ForwardBatch`` for a call of ``tokens`` tokens.
* :func:`sinkhorn_on_cpu`: the TileLang Sinkhorn has no CPU path; sglang's own torch
  reference (``sglang.test.kernels.mhc``) takes its place.
* :class:`captured_log`, :func:`fail_on_torch_compile`: what the scenarios observe.
"""

from __future__ import annotations

import logging
import os

import torch

TORCH_FALLBACKS = {
    "SGLANG_OPT_USE_TILELANG_MHC_PRE": "0",
    "SGLANG_OPT_USE_TILELANG_MHC_POST": "0",
    "SGLANG_OPT_DEEPGEMM_HC_PRENORM": "0",
    "SGLANG_OPT_USE_FLASHINFER_MHC": "0",
    "SGLANG_OPT_USE_FUSED_HASH_TOPK": "0",
    "SGLANG_FORCE_FUSED_OP_BACKEND": "torch",
}


def use_torch_fallbacks() -> None:
    os.environ.update(TORCH_FALLBACKS)


def decode_batch(tokens: int, mode_name: str = "DECODE"):
    """sglang's ``ForwardBatch`` for ``tokens`` requests of one token each, in ``mode_name``
    (a ``ForwardMode``): the fields a layer's MoE reads; no attention metadata (the DSv4
    attention backend has no CPU path)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    ids = torch.arange(tokens) % 97
    return ForwardBatch(forward_mode=ForwardMode[mode_name], batch_size=tokens, input_ids=ids,
                        req_pool_indices=torch.arange(tokens), seq_lens=torch.full((tokens,), 7),
                        out_cache_loc=torch.arange(tokens), seq_lens_sum=7 * tokens)


def init_single_process_dist(port: int = 29632) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from sglang.srt.runtime_context import (
        SpawnRanks,
        get_parallel,
        publish,
        reset_context,
    )
    from sglang.srt.server_args import ServerArgs

    if not torch.distributed.is_initialized():
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    if not model_parallel_is_initialized():
        reset_context()
        publish(ServerArgs(model_path="dummy", tp_size=1, ep_size=1, pp_size=1), role="test",
                ranks=SpawnRanks(world_rank=0))
        if parallel_state._WORLD is not None:
            get_parallel().override_permanently(world_group=parallel_state._WORLD)
        initialize_model_parallel(backend="gloo")


def sinkhorn_on_cpu() -> None:
    """sglang's TileLang Sinkhorn has no CPU path: its torch reference takes its place, as a
    torch custom op, so that, like the kernel it stands for, it is one call a trace keeps
    opaque (a layer traced whole would otherwise fuse the reference's ops)."""
    import sglang.kernels.ops.layernorm.mhc as kernels
    from sglang.test.kernels.mhc import hc_split_sinkhorn_torch

    if not hasattr(torch.ops.fuser_tests, "hc_split_sinkhorn"):
        @torch.library.custom_op("fuser_tests::hc_split_sinkhorn", mutates_args=())
        def kernel(mixes: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor, hc_mult: int,
                   sinkhorn_iters: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return tuple(t.clone() for t in hc_split_sinkhorn_torch(mixes, hc_scale, hc_base, hc_mult, sinkhorn_iters, eps))

    def hc_split_sinkhorn(mixes, hc_scale, hc_base, hc_mult=4, sinkhorn_iters=20, eps=1e-6):
        return torch.ops.fuser_tests.hc_split_sinkhorn(mixes, hc_scale, hc_base, hc_mult, sinkhorn_iters, eps)

    kernels.hc_split_sinkhorn = hc_split_sinkhorn


class captured_log:
    """The messages the ``fuser`` logger emits inside the block."""

    def __enter__(self):
        self.messages = []
        self.handler = logging.Handler()
        self.handler.emit = lambda record: self.messages.append(record.getMessage())
        logger = logging.getLogger("fuser")
        self.level = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(self.handler)
        return self.messages

    def __exit__(self, *exc):
        logger = logging.getLogger("fuser")
        logger.removeHandler(self.handler)
        logger.setLevel(self.level)
        return False


class TorchCompileCalled(AssertionError):
    pass


def fail_on_torch_compile() -> list[str]:
    """Replace ``torch.compile`` by a function that raises; the list of what it was asked to compile."""
    calls = []

    def compile_(model=None, *args, **kwargs):
        calls.append(getattr(model, "__qualname__", repr(model)))
        raise TorchCompileCalled(f"torch.compile({calls[-1]}) was called")

    torch.compile = compile_
    return calls


class pretend_capturing:
    """Inside the block the current stream reads as capturing a CUDA graph."""

    def __enter__(self):
        self.saved = torch.cuda.is_available, torch.cuda.is_current_stream_capturing
        torch.cuda.is_available = lambda: True
        torch.cuda.is_current_stream_capturing = lambda: True

    def __exit__(self, *exc):
        torch.cuda.is_available, torch.cuda.is_current_stream_capturing = self.saved
        return False


# ------------------------------------------------------------------------------------------
# sglang's real DeepSeek-V4 decoder layers, tiny, on the CPU
# ------------------------------------------------------------------------------------------

#: A tiny DeepSeek-V4: every dimension small, the structure of the real one (MQA with one KV
#: head, grouped output projection, mHC with 4 streams, YaRN RoPE for the compressed layers,
#: the first ``num_hash_layers`` layers with hash routing, the rest top-k).
TINY_DSV4 = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=1, q_lora_rank=32, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32, head_dim=32, o_lora_rank=32, o_groups=2,
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, n_group=1,
    topk_group=1, scoring_func="sqrtsoftplus", topk_method="noaux_tc", index_n_heads=2, index_head_dim=16,
    index_topk=8, window_size=8, vocab_size=100, num_hash_layers=1, hc_mult=4, hc_sinkhorn_iters=20,
    hc_eps=1e-6, rms_norm_eps=1e-6, compress_rope_theta=40000, max_position_embeddings=1024,
    rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                  "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0},
)


def tiny_dsv4_config(compress_ratios, num_hash_layers=None):
    """The config sglang itself makes for a ``deepseek_v4`` checkpoint (its registry's class);
    the first ``num_hash_layers`` layers route by hash (the tiny model's one by default)."""
    from sglang.srt.utils.hf_transformers.common import _CONFIG_REGISTRY

    values = dict(TINY_DSV4)
    if num_hash_layers is not None:
        values["num_hash_layers"] = num_hash_layers
    return _CONFIG_REGISTRY["deepseek_v4"](architectures=["DeepseekV4ForCausalLM"],
                                           num_hidden_layers=len(compress_ratios),
                                           compress_ratios=list(compress_ratios), **values)


def _no_vllm_kernel(*args, **kwargs):
    raise RuntimeError("vllm's rotary_embedding is not installed here (sglang's CPU-less fallback)")


class building_on_cpu:
    """What sglang's layer constructors need on a machine with no accelerator, for the block:
    its platform answers "cpu" for the device, and the ``vllm._custom_ops.rotary_embedding``
    that its RoPE takes off CUDA is a function that raises if it is ever called."""

    def __enter__(self):
        import sys
        import types

        from sglang.srt.utils import common

        self.platform = common.current_platform
        self.saved_device = self.platform.__dict__.get("get_device")
        self.saved_modules = {n: sys.modules.get(n) for n in ("vllm", "vllm._custom_ops")}
        vllm, ops = types.ModuleType("vllm"), types.ModuleType("vllm._custom_ops")
        ops.rotary_embedding, vllm._custom_ops = _no_vllm_kernel, ops
        sys.modules.update({"vllm": vllm, "vllm._custom_ops": ops})
        self.platform.get_device = lambda device_id=None: "cpu"
        return self

    def __exit__(self, *exc):
        import sys

        if self.saved_device is None:
            del self.platform.get_device
        else:
            self.platform.get_device = self.saved_device
        for name, module in self.saved_modules.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        return False


def build_dsv4_layers(layer_class, compress_ratios=(0, 4, 128), num_hash_layers=None):
    """sglang's ``layer_class`` for each layer of a tiny DeepSeek-V4, built in one
    ``layer_stack`` as ``DeepseekV4Model`` builds them (bf16 parameters, on the CPU)."""
    from sglang.srt.layers.layer_boundary.factories import layer_stack

    config = tiny_dsv4_config(compress_ratios, num_hash_layers)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with building_on_cpu(), layer_stack():
            layers = [layer_class(config=config, layer_id=i, prefix=f"model.layers.{i}")
                      for i in range(len(compress_ratios))]
    finally:
        torch.set_default_dtype(default)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in layers:
            for parameter in layer.parameters():
                if parameter.is_floating_point():
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return config, layers
