"""sglang_plugin: fuser inside an sglang server, turned on with ``FUSER_ENABLE=1``.

    FUSER_ENABLE=1 python -m sglang.launch_server --model-path ...

sglang runs the plugins of the ``sglang.srt.plugins`` entry-point group in every scheduler
process (they are spawned: a patch made in the launcher would never reach the model).
:func:`register` adds an AFTER hook on ``ModelRunner.initialize``: the model is loaded,
quantised and post-processed there, and no KV sizing, warm-up or capture has run yet
(SGLANG.md §3). The hook skips draft workers and ``--enable-torch-compile`` servers, then
puts every decoder layer of a known class under a *decode splice*:

* The layer's ``forward`` is wrapped (``functools.wraps``: sglang reads its signature). A call
  whose ``forward_batch.forward_mode.is_decode()`` runs with "decode" set; any other mode
  (extend, mixed, idle, target-verify, ...) runs exactly the original code.
* Inside the layer, fuser fuses the *tensor-level* modules: the topmost submodules whose
  forward takes no ``forward_batch`` (a module that does take one threads Python state
  through its forward and is searched, not traced). Each is fused at its first decode call,
  with that call's real inputs as the example — sglang's decode warm-ups, which run before
  any capture, are that first call. The fused forward is guarded on "decode", so a prefill
  through the same module stays eager.
* A module that cannot be fused stays eager and is logged once with the reason
  (``FUSER_STRICT=1`` raises instead). A first decode call that arrives while a CUDA graph is
  being captured raises: fuser never traces or compiles inside a capture.
* Values fuser computes from weights at fuse time are declared to sglang through
  ``model._derived_weight_cache_error``: a weight update must re-run fuser.

Configuration (environment, inherited by the scheduler processes):

    FUSER_ENABLE=1              turn the plugin on (off by default)
    FUSER_LAYERS=A,B            decoder-layer class names (default: sglang's DeepseekV4 layers)
    FUSER_PATTERNS=a.py:b.py    extra pattern files (os.pathsep-separated)
    FUSER_LEAVES=x,y            extra opaque leaves (module paths, class or function names)
    FUSER_DRAFT=1               also fuse speculative-decoding draft models
    FUSER_STRICT=1              raise instead of leaving an unfusable module eager
    FUSER_PRECOMPUTE=0          read every weight live at each step (automatic with
                                --startup-weight-load-mode overlap, whose real weights arrive
                                after capture); by default parameter-only glue (a weight's
                                cast) is computed once at fuse time and declared to sglang
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import threading
from dataclasses import dataclass, replace

import torch

log = logging.getLogger("fuser")

INITIALIZE = "sglang.srt.model_executor.model_runner.ModelRunner.initialize"
# sglang's DSv4 layer classes: the CUDA one, and the alias that names the platform class on CPU.
DEFAULT_LAYERS = ("DeepseekV4CudaDecoderLayer", "DeepseekV4DecoderLayer")
DERIVED_CACHE_ATTR = "_derived_weight_cache_error"
SPLICE_ATTR = "_fuser_decode_splice"


def _flag(environ, name: str) -> bool:
    return environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def _names(environ, name: str, separator: str = ",") -> tuple[str, ...]:
    return tuple(x.strip() for x in environ.get(name, "").split(separator) if x.strip())


@dataclass(frozen=True)
class Options:
    enable: bool = False
    layers: tuple[str, ...] = DEFAULT_LAYERS
    patterns: tuple[str, ...] = ()
    leaves: tuple[str, ...] = ()
    draft: bool = False
    strict: bool = False
    precompute: bool = True  # parameter-only glue computed once at fuse time

    @classmethod
    def from_env(cls, environ=None) -> "Options":
        environ = os.environ if environ is None else environ
        return cls(
            enable=_flag(environ, "FUSER_ENABLE"),
            layers=_names(environ, "FUSER_LAYERS") or DEFAULT_LAYERS,
            patterns=_names(environ, "FUSER_PATTERNS", os.pathsep),
            leaves=_names(environ, "FUSER_LEAVES"),
            draft=_flag(environ, "FUSER_DRAFT"),
            strict=_flag(environ, "FUSER_STRICT"),
            precompute=environ.get("FUSER_PRECOMPUTE", "1").strip().lower() not in ("0", "false", "no", "off"),
        )

    def apply_options(self) -> dict:
        options = {} if self.precompute else {"precompute": False}
        if self.patterns:
            options["patterns"] = list(self.patterns)
        if self.leaves:
            options["leaves"] = list(self.leaves)
        return options


# ------------------------------------------------------------------------------------------
# sglang entry points
# ------------------------------------------------------------------------------------------


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: hook ``ModelRunner.initialize`` if enabled."""
    if not Options.from_env().enable:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(INITIALIZE, after_initialize, HookType.AFTER)


def after_initialize(result, runner, *args, **kwargs):
    """AFTER hook on ``ModelRunner.initialize(self)``; returns None to keep its result."""
    options = Options.from_env()
    if getattr(runner, "is_draft_worker", False) and not options.draft:
        log.info("fuser: draft worker left as it is (FUSER_DRAFT=1 fuses it too)")
        return None
    server_args = getattr(runner, "server_args", None)
    if getattr(server_args, "enable_torch_compile", False):
        log.warning("fuser: skipped: --enable-torch-compile is on and would re-trace the fused forward")
        return None
    if getattr(server_args, "startup_weight_load_mode", "serial") == "overlap":
        # The real weights are copied in after capture: nothing may be computed from them now.
        options = replace(options, precompute=False)
    splices = install(runner.model, options)
    log.info("fuser: %d decoder layers under the decode splice", len(splices))
    return None


# ------------------------------------------------------------------------------------------
# The decode splice
# ------------------------------------------------------------------------------------------

_DECODE = threading.local()


def decode_active() -> bool:
    """True while a spliced layer runs a decode forward (in this thread)."""
    return getattr(_DECODE, "depth", 0) > 0


def is_decode(forward_batch) -> bool:
    mode = getattr(forward_batch, "forward_mode", None)
    return mode is not None and bool(mode.is_decode())


def install(model: torch.nn.Module, options: Options) -> list["DecodeSplice"]:
    """Put every decoder layer of ``model`` whose class is in ``options.layers`` under a
    decode splice. Nothing is traced here: each tensor-level module is fused at its first
    decode call."""
    splices = []
    for name, module in model.named_modules():
        if type(module).__name__ not in options.layers or SPLICE_ATTR in module.__dict__:
            continue
        if any(name.startswith(s.name + ".") for s in splices):
            continue  # inside a layer already spliced
        if "forward_batch" not in inspect.signature(module.forward).parameters:
            log.warning("fuser: %s (%s) takes no forward_batch: decode and prefill cannot be told "
                        "apart, left eager", name, type(module).__name__)
            continue
        splices.append(DecodeSplice(model, name, module, options))
    return splices


def uninstall(model: torch.nn.Module) -> None:
    """Undo :func:`install` and every fusion it made."""
    for module in model.modules():
        splice = module.__dict__.get(SPLICE_ATTR)
        if splice is not None:
            splice.remove()


class DecodeSplice:
    """One decoder layer: its forward wrapped with the decode switch, its tensor-level
    submodules wrapped to fuse themselves at their first decode call."""

    def __init__(self, model, name: str, layer: torch.nn.Module, options: Options):
        self.model, self.name, self.layer, self.options = model, name, layer, options
        self.original = layer.__dict__.get("forward")
        eager = layer.forward
        binder = inspect.signature(eager)

        @functools.wraps(eager)
        def forward(*args, **kwargs):
            bound = binder.bind_partial(*args, **kwargs)
            if not is_decode(bound.arguments.get("forward_batch")):
                return eager(*args, **kwargs)
            _DECODE.depth = getattr(_DECODE, "depth", 0) + 1
            try:
                return eager(*args, **kwargs)
            finally:
                _DECODE.depth -= 1

        layer.forward = forward
        object.__setattr__(layer, SPLICE_ATTR, self)
        self.targets = [LazyFusion(self, f"{name}.{path}" if name else path, m)
                        for path, m in tensor_level_modules(layer)]

    def remove(self) -> None:
        for target in self.targets:
            target.remove()
        if self.original is None:
            del self.layer.forward
        else:
            self.layer.forward = self.original
        del self.layer.__dict__[SPLICE_ATTR]


def tensor_level_modules(layer: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The topmost submodules of ``layer`` whose forward takes no ``forward_batch``."""
    from fuser.trace import DEFAULT_LEAF_TYPES
    from fuser.opaque import is_opaque

    found = []

    def visit(prefix: str, module: torch.nn.Module):
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, DEFAULT_LEAF_TYPES) or is_opaque(type(child)):
                continue  # GEMMs, embeddings and marked leaves are never fused
            if "forward_batch" in inspect.signature(child.forward).parameters:
                visit(path, child)
            else:
                found.append((path, child))

    visit("", layer)
    return found


class LazyFusion:
    """Fuses one tensor-level module at its first decode call (outside any capture)."""

    def __init__(self, splice: DecodeSplice, name: str, module: torch.nn.Module):
        self.splice, self.name, self.module = splice, name, module
        self.original = module.__dict__.get("forward")
        self.state = "waiting"  # -> "fused" | "eager"
        eager = module.forward

        @functools.wraps(eager)
        def forward(*args, **kwargs):
            if self.state == "waiting" and decode_active():
                self.fuse(args, kwargs)
            return self.module_forward(*args, **kwargs)

        self.module_forward = eager
        module.forward = forward

    def fuse(self, args, kwargs) -> None:
        import fuser

        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise fuser.FuserError(
                f"fuser: the first decode call of {self.name} ({type(self.module).__name__}) came "
                "during CUDA-graph capture; fuser traces and compiles before capture only, so run "
                "a decode warm-up first (sglang's capture runs two per batch size)"
            )
        bound = inspect.signature(self.module_forward).bind(*args, **kwargs)
        if bound.kwargs:
            self._give_up(f"keyword-only arguments {sorted(bound.kwargs)} cannot be traced")
            return
        wrapper = self.module.forward
        del self.module.forward  # fuse the module's own forward, not this wrapper
        if self.original is not None:
            self.module.forward = self.original
        try:
            report = fuser.apply(self.module, bound.args, guard=lambda *a, **k: decode_active(),
                                 **self.splice.options.apply_options())
        except fuser.FuserError as e:
            self._give_up(str(e))
            return
        finally:
            self.module_forward = self.module.forward
            self.module.forward = wrapper
        self.state = "fused"
        log.info("fuser: %s fused: %d glue launches -> %d", self.name, report.launches_before,
                 report.launches_after)
        self._declare_weight_caches()

    def _give_up(self, reason: str) -> None:
        import fuser

        self.state = "eager"
        if self.splice.options.strict:
            raise fuser.FuserError(f"fuser: {self.name} cannot be fused: {reason}")
        log.warning("fuser: %s left eager: %s", self.name, reason)

    def _declare_weight_caches(self) -> None:
        from fuser.splice import STATE_ATTR

        state = self.module.__dict__.get(STATE_ATTR)
        if state is not None and state.constants:
            object.__setattr__(
                self.splice.model, DERIVED_CACHE_ATTR,
                "fuser holds values computed from the weights at fuse time (e.g. "
                f"{self.name}: {', '.join(state.constants)}); CUDA graphs and fused kernels would "
                "not see updated weights: restart the server (or re-run fuser) after a weight update",
            )

    def remove(self) -> None:
        from fuser.splice import is_fused, restore

        if is_fused(self.module):
            self.module.forward = self.module_forward  # the guarded forward fuser installed
            restore(self.module)
        if self.original is None:
            self.module.__dict__.pop("forward", None)
        else:
            self.module.forward = self.original


__all__ = ["register", "after_initialize", "install", "uninstall", "Options", "decode_active", "is_decode"]
