"""sglang: fuser inside an sglang server, turned on with ``FUSER_ENABLE=1``.

    FUSER_ENABLE=1 python -m sglang.launch_server --model-path ...

This is sglang's adapter: it describes sglang in one :class:`fuser.serving.engine.Engine`
(:data:`SGLANG`) and holds only what is sglang's: its hooks, its class names, ``forward_batch``,
its fused ops and flags, its options and ``model._derived_weight_cache_error``. The rest (the
mode splice over the layers, lazy fusion at the first decode call, target selection, the
capture checks, what is logged) is :mod:`fuser.serving`.

sglang runs the plugins of the ``sglang.srt.plugins`` entry-point group in every scheduler
process (they are spawned: a patch made in the launcher would never reach the model).
:func:`register` does two things there:

* **The compile seam** (:mod:`fuser.serving.engines.sglang_seam`): sglang's ``compile_in_capture_mode``,
  which ``torch.compile``s two DeepSeek-V4 glue closures while capture mode is on, is
  replaced by fuser's, in ``capture_mode`` and in every module that imported it. Each
  closure is fused at its first call outside a capture and runs fused from then on; it is
  never compiled. ``FUSER_COMPILE_SEAM=0`` leaves sglang's decorator alone.
* **The decode splice**: an AFTER hook on ``ModelRunner.initialize``, where the model is
  loaded, quantised and post-processed and no KV sizing, warm-up or capture has run yet
  (SGLANG.md §3). It skips draft workers and ``--enable-torch-compile`` servers, then puts
  every decoder layer of a known class (also by the name of an alias: sglang's
  ``DeepseekV4DecoderLayer`` is the CUDA class on CUDA and the platform class elsewhere)
  under a :class:`fuser.serving.lazy_fusion.ModeSplice` (:func:`fuser.serving.engine.install`)
  that only ``forward_batch.forward_mode.is_decode()`` calls take. Each layer is fused whole
  at its first decode call, its attention kept opaque, ``forward_batch`` as state and the
  ``ResidualStream`` its boundaries hand on through it traced as a Python object
  (:data:`SGLANG`'s ``traced_through``, :mod:`fuser.trace.state_objects`); where it cannot
  be, its fusion targets are the fallback. Inside a layer, the fusion targets are the topmost submodules that are not
  sglang leaves (:func:`is_sglang_leaf`: ``LinearBase`` GEMMs, ``FusedMoE``, ``RadixAttention``,
  and every ``BaseFusedOp`` that runs a kernel; one that runs its torch reference is glue) and
  that do not pass ``forward_batch`` into a leaf that requires it (attention: those are
  searched). A target that takes ``forward_batch`` (DeepSeek-V4's MoE block) is traced with
  it as state. Each target is fused at its first decode call (sglang's warm-ups), with that
  call's inputs as the example; the engine-wide flags its trace reads
  (:data:`GLOBAL_READS`: capture and piecewise-graph modes, the fused-op backend) are guarded
  at every call. Values fuser computes from weights at fuse time are declared through
  ``model._derived_weight_cache_error``: a weight update must re-run fuser.

Configuration (environment, inherited by the scheduler processes):

    FUSER_ENABLE=1              turn the plugin on (off by default)
    FUSER_COMPILE_SEAM=0        keep sglang's compile_in_capture_mode (default: fuser's)
    FUSER_LAYERS=A,B            decoder-layer class names (default: sglang's DeepseekV4 layers)
    FUSER_PATTERNS=a.py:b.py    extra pattern files (os.pathsep-separated)
    FUSER_LEAVES=x,y            extra opaque leaves (module paths, class or function names)
    FUSER_DRAFT=1               also fuse speculative-decoding draft models
    FUSER_STRICT=1              raise instead of leaving an unfusable module eager
    FUSER_WHOLE_LAYER=0         fuse each layer's targets one by one, never the layer whole
    FUSER_EXPLAIN=1             log what the splice selects in each layer class (leaves,
                                searched modules, targets) and each fused module's and
                                closure's whole report, as `fuser explain` prints it
    FUSER_PRECOMPUTE=0          read every weight live at each step (automatic with
                                --startup-weight-load-mode overlap, whose real weights arrive
                                after capture); by default parameter-only glue (a weight's
                                cast) is computed once at fuse time and declared to sglang
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace

import torch

from fuser.serving import engine
from fuser.serving import options as serving_options
from fuser.serving.engine import Engine, layer_class_matches
from fuser.serving.lazy_fusion import SPLICE_ATTR, ModeSplice, mode_active, uninstall
from fuser.serving.options import env_flag
from fuser.serving.targets import takes_anything, takes_state

log = logging.getLogger("fuser")

INITIALIZE = "sglang.srt.model_executor.model_runner.ModelRunner.initialize"
# sglang's DSv4 layer classes: the CUDA one, and the alias that names the platform class off CUDA.
DEFAULT_LAYERS = ("DeepseekV4CudaDecoderLayer", "DeepseekV4DecoderLayer")
DERIVED_CACHE_ATTR = "_derived_weight_cache_error"
CALL_STATE = "forward_batch"

#: sglang's module classes that are leaves, never fusion targets: (module, class name).
LEAF_CLASSES = (
    ("sglang.srt.layers.linear", "LinearBase"),  # every GEMM layer (not torch.nn.Linear)
    ("sglang.srt.layers.moe.fused_moe_triton.layer", "FusedMoE"),  # the routed experts
    ("sglang.srt.layers.radix_attention", "RadixAttention"),
    ("sglang.kernels.fused_op", "BaseFusedOp"),  # RMSNorm, TopK, ...: sglang's own kernels
)
FUSED_OP_BACKEND = "sglang.kernels.fused_op.get_fused_op_backend"

#: sglang's engine-wide flags that model code branches on (``DeepseekV2MoE.forward`` takes its
#: dual-stream path on ``get_is_capture_mode()``): each one a trace reads is a guarded value.
GLOBAL_READS = (
    "sglang.srt.model_executor.runner_utils.capture_mode.get_is_capture_mode",
    "sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.context.is_in_breakable_cuda_graph",
    "sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph.context_manager.is_in_tc_piecewise_cuda_graph",
    FUSED_OP_BACKEND,
)


@dataclass(frozen=True)
class Options(serving_options.Options):
    layers: tuple[str, ...] = DEFAULT_LAYERS
    compile_seam: bool = True  # FUSER_COMPILE_SEAM: fuser's compile_in_capture_mode in place of sglang's

    @classmethod
    def env_fields(cls, environ) -> dict:
        return {**super().env_fields(environ), "compile_seam": env_flag(environ, "FUSER_COMPILE_SEAM", True)}


# ------------------------------------------------------------------------------------------
# sglang entry points
# ------------------------------------------------------------------------------------------


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: if enabled, replace the compile seam and hook
    ``ModelRunner.initialize`` (``HookRegistry.apply_hooks``, run by sglang's plugin loader
    right after, applies both)."""
    options = Options.from_env()
    if not options.enable:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if options.compile_seam:
        from fuser.serving.engines import sglang_seam

        sglang_seam.register()
    HookRegistry.register(INITIALIZE, after_initialize, HookType.AFTER)


def after_initialize(result, runner, *args, **kwargs):
    """AFTER hook on ``ModelRunner.initialize(self)``; returns None to keep its result."""
    options = Options.from_env()
    if options.compile_seam:
        from fuser.serving.engines import sglang_seam

        rebound = sglang_seam.rebind_stale_copies()
        if rebound:
            log.info("fuser: compile seam rebound in %s", ", ".join(rebound))
    if getattr(runner, "is_draft_worker", False) and not options.draft:
        log.info("fuser: draft worker left as it is (FUSER_DRAFT=1 fuses it too)")
        return
    server_args = getattr(runner, "server_args", None)
    if getattr(server_args, "enable_torch_compile", False):
        log.warning("fuser: skipped: --enable-torch-compile is on and would re-trace the fused forward")
        return
    if getattr(server_args, "startup_weight_load_mode", "serial") == "overlap":
        # The real weights are copied in after capture: nothing may be computed from them now.
        options = replace(options, precompute=False)
    splices = install(runner.model, options)
    log.info("fuser: %d decoder layers under the decode splice", len(splices))
    return


def install(model: torch.nn.Module, options: Options) -> list[ModeSplice]:
    """Put every sglang decoder layer of ``model`` named in ``options.layers`` under the decode
    splice (:func:`fuser.serving.engine.install`)."""
    return engine.install(model, SGLANG, options)


def decisions(layer: torch.nn.Module) -> list[tuple[str, str, str]]:
    """What the plugin decides for each submodule of a decoder layer: leaf, searched or target."""
    return engine.decisions(layer, SGLANG)


# ------------------------------------------------------------------------------------------
# What sglang's classes mean to fuser
# ------------------------------------------------------------------------------------------


def is_decode(forward_batch) -> bool:
    mode = getattr(forward_batch, "forward_mode", None)
    return mode is not None and bool(mode.is_decode())


decode_active = mode_active


@functools.lru_cache(maxsize=None)
def leaf_types() -> tuple[type, ...]:
    """The leaf classes of :data:`LEAF_CLASSES` that the installed sglang has (looked up once:
    :func:`is_sglang_leaf` asks for every submodule of every layer)."""
    found = []
    for module_name, class_name in LEAF_CLASSES:
        try:
            module = __import__(module_name, fromlist=[class_name])
        except ImportError as e:
            log.debug("fuser: %s.%s not importable (%s)", module_name, class_name, e)
            continue
        cls = getattr(module, class_name, None)
        if isinstance(cls, type):
            found.append(cls)
    return tuple(found)


def is_sglang_leaf(module: torch.nn.Module) -> bool:
    """One of sglang's modules that fuser keeps opaque and never fuses: a GEMM, attention, the
    experts or one of sglang's own kernels. A fused op that runs its torch reference
    (:func:`runs_torch_reference`: ``SGLANG_FORCE_FUSED_OP_BACKEND=torch``) is glue, unless it
    takes ``forward_batch`` (the DSv4 compressor writes the KV cache)."""
    kernels = tuple(c for c in leaf_types() if not _is_fused_op_base(c))  # GEMMs, experts, attention
    if isinstance(module, kernels):
        return True
    if not is_fused_op(module):
        return False
    return not (runs_torch_reference(module) and not takes_forward_batch(module))


def _is_fused_op_base(cls: type) -> bool:
    return cls.__name__ == "BaseFusedOp" and cls.__module__ == "sglang.kernels.fused_op"


def is_fused_op(module: torch.nn.Module) -> bool:
    """Is ``module`` one of sglang's fused ops (``BaseFusedOp``: RMSNorm, TopK, SiluAndMul, RoPE, ...)?"""
    return any(_is_fused_op_base(c) for c in type(module).__mro__)


def runs_torch_reference(op: torch.nn.Module) -> bool:
    """Does a call of sglang's fused op ``op`` run its pure-torch ``forward_native``: the
    backend forced to torch (``SGLANG_FORCE_FUSED_OP_BACKEND=torch``), or its dispatch
    resolving to it (no kernel for this platform)?"""
    from sglang.kernels.fused_op import KernelBackend, get_fused_op_backend

    forced = get_fused_op_backend()
    if forced is not None:
        return forced == KernelBackend.TORCH
    method = op._forward_method or op._resolve_forward_method()
    return getattr(method, "__func__", None) is getattr(type(op).forward_native, "__func__", type(op).forward_native)


def called_method(module: torch.nn.Module):
    """The method sglang's call of ``module`` runs: ``forward``; a fused op's
    ``forward_native`` when it runs its torch reference; for another ``forward(*args,
    **kwargs)`` that dispatches (sglang's multi-platform ops) the method it resolved to."""
    forward = module.forward
    if not takes_anything(forward):
        return forward
    if is_fused_op(module) and runs_torch_reference(module):
        return module.forward_native
    for name in ("_forward_method", "forward_native"):
        method = getattr(module, name, None)
        if callable(method) and not takes_anything(method):
            return method
    return forward


def takes_forward_batch(module: torch.nn.Module) -> bool:
    """Does the method sglang calls take ``forward_batch`` (or take anything at all, so that it
    cannot be told)?"""
    return takes_state(module, CALL_STATE, called_method)


def declare_weight_caches(model: torch.nn.Module, message: str) -> None:
    """Tell sglang's weight updater that fuser holds values computed from weights."""
    object.__setattr__(model, DERIVED_CACHE_ATTR, message)


#: sglang, as fuser's serving core sees it.
SGLANG = Engine(
    call_state=CALL_STATE,
    is_decode=is_decode,
    is_leaf=is_sglang_leaf,
    called_method=called_method,
    global_reads=GLOBAL_READS,
    always_guarded=(FUSED_OP_BACKEND,),  # the leaf decisions depend on it
    declare_weight_caches=declare_weight_caches,
    no_targets="(GEMMs, experts, attention and sglang's own kernels are leaves; the rest passes "
               "forward_batch to attention); its mHC glue is fused through the compile seam",
    # DeepSeek-V4's boundaries hand the residual on through forward_batch.residual_stream
    traced_through=("sglang.srt.layers.layer_boundary.residual.stream.ResidualStream",),
)

#: A module fuser keeps opaque in sglang: one of sglang's (:func:`is_sglang_leaf`) or one of
#: fuser's own (``@fuser.opaque`` classes, ``torch.nn.Linear``, ``torch.nn.Embedding``).
is_leaf = SGLANG.is_any_leaf

#: Does a module take ``forward_batch`` and hold a leaf that requires it (searched, not traced)?
passes_forward_batch_to_leaves = SGLANG.searched


__all__ = [
    "SGLANG",
    "SPLICE_ATTR",
    "Options",
    "after_initialize",
    "decisions",
    "decode_active",
    "install",
    "is_decode",
    "is_leaf",
    "is_sglang_leaf",
    "layer_class_matches",
    "register",
    "passes_forward_batch_to_leaves",
    "runs_torch_reference",
    "takes_forward_batch",
    "uninstall",
]
