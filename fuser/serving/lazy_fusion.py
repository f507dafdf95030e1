"""lazy_fusion: fuse inside a serving engine, lazily and never inside a CUDA-graph capture.

Engine-neutral; an engine adapter (one :class:`fuser.serving.engine.Engine`, in
``fuser/serving/engines/``) supplies its engine's facts (its leaf classes, how a call says
"decode"), and :func:`fuser.serving.engine.install` puts the model's layers under a splice.
This module holds the mode splice and lazy fusion; the other parts have their own modules.

* :class:`ModeSplice` wraps a layer's ``forward``: a call the adapter's predicate accepts
  (sglang: ``forward_batch.forward_mode.is_decode()``) runs with the mode set
  (:func:`mode_active`), through the layer fused whole where it can be; any other call runs
  exactly the original code.
* :func:`fuser.serving.targets.fusion_targets` picks the submodules of a layer to fuse: the
  topmost ones that are not leaves and do not pass the engine's per-call state into leaves
  that consume it (attention), as the adapter's :class:`~fuser.serving.targets.EngineFacts`
  say. A target that takes the state is traced with it as state (:mod:`fuser.trace.call_spec`):
  the values it reads off it are guarded at every call.
* :class:`fuser.serving.global_reads.GlobalReads` reads the engine-wide flags traced code calls
  (sglang's ``get_is_capture_mode()``) as guarded values: a call where one differs from what
  the trace saw runs the module's own code.
* :class:`LazyFusion` fuses one module at its first call while the mode is set, with that
  call's real inputs as the example (an engine's warm-ups, which run before any capture,
  are that call). Its fused forward is guarded on the mode.
* :class:`fuser.serving.closures.ClosureSeam` is a decorator for nested helper functions
  (closures) that an engine would hand to ``torch.compile``: each is fused at its first call
  on a stream that is not capturing, keyed by its code object and the contents of its
  closure cells.

Under all of them, :mod:`fuser.serving.fuse_on_call` fuses one module on one real call's inputs and
logs what stays eager, and :mod:`fuser.serving.options` reads the ``FUSER_*`` variables
(:class:`~fuser.serving.options.Options`).

Whatever cannot be fused stays eager and is logged once with the reason; ``strict`` raises
instead. A first call that arrives while the current stream is capturing runs eager (and is
logged): nothing is ever traced, compiled or validated inside a capture.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Iterable

import torch

from fuser.serving.fuse_on_call import Unfusable, fuse_now, give_up, log_fused, postponed_by_capture
from fuser.serving.global_reads import GlobalReads
from fuser.serving.options import Options
from fuser.serving.targets import EngineFacts, leaf_paths
from fuser.trace.call_spec import declare_state


_MODE = threading.local()
SPLICE_ATTR = "_fuser_mode_splice"


def mode_active() -> bool:
    """True while a spliced layer runs a call its adapter accepted (in this thread)."""
    return getattr(_MODE, "depth", 0) > 0


class ModeSplice:
    """One layer: its forward wrapped so that a call ``accepts(bound_arguments)`` takes runs
    with :func:`mode_active` set, and its fusion targets wrapped to fuse themselves at their
    first such call. ``functools.wraps`` keeps the signature (engines read it).

    With ``whole`` (the modules the layer's own trace keeps opaque besides the engine's
    leaves: its searched ones, attention), the layer itself is the first target
    (:attr:`whole`): fused at its first such call with those leaves, it runs fused from then
    on while its guard holds. The inner targets are its fallback: where the layer cannot be
    fused (logged once with the reason), or a call its guard declines, the layer's own code
    runs, and they fuse at their first call."""

    def __init__(self, name: str, layer: torch.nn.Module, accepts: Callable[[dict], bool],
                 targets: Iterable[tuple[str, torch.nn.Module]], options: Options, facts: EngineFacts,
                 on_fused: Callable[[LazyFusion], None] | None = None, whole: tuple[str, ...] | None = None):
        self.name, self.layer, self.options = name, layer, options
        self.original = layer.__dict__.get("forward")
        eager = layer.forward
        binder = inspect.signature(eager)
        self.whole = None if whole is None else LazyFusion(name, layer, options, facts, on_fused, wrap=False, leaves=whole)

        @functools.wraps(eager)
        def forward(*args, **kwargs):
            if not accepts(binder.bind_partial(*args, **kwargs).arguments):
                return eager(*args, **kwargs)
            _MODE.depth = getattr(_MODE, "depth", 0) + 1
            try:
                if self.whole is not None:
                    return self.whole.call(eager, args, kwargs)
                return eager(*args, **kwargs)
            finally:
                _MODE.depth -= 1

        layer.forward = forward
        object.__setattr__(layer, SPLICE_ATTR, self)
        self.targets = [LazyFusion(f"{name}.{path}" if name else path, module, options, facts, on_fused)
                        for path, module in targets]

    def remove(self) -> None:
        """Undo the splice and every fusion it made."""
        for target in self.targets:
            target.remove()
        if self.whole is not None:
            self.whole.remove()
        if self.original is None:
            self.layer.__dict__.pop("forward", None)
        else:
            self.layer.forward = self.original
        del self.layer.__dict__[SPLICE_ATTR]


def uninstall(model: torch.nn.Module) -> None:
    """Undo every :class:`ModeSplice` in ``model``."""
    for module in model.modules():
        splice = module.__dict__.get(SPLICE_ATTR)
        if splice is not None:
            splice.remove()


class LazyFusion:
    """One module, fused at its first call while the mode is set, outside any capture.

    What is traced is the method the engine's call runs (``facts.called_method``), with the
    engine's leaves kept opaque by name. Once fused, a call runs the fused forward only while
    the mode is set and every engine-wide flag the trace read still has its value
    (:class:`GlobalReads`); any other call runs the module's own forward."""

    def __init__(self, name: str, module: torch.nn.Module, options: Options, facts: EngineFacts,
                 on_fused: Callable[[LazyFusion], None] | None = None, wrap: bool = True,
                 leaves: tuple[str, ...] = ()):
        self.name, self.module, self.options, self.facts = name, module, options, facts
        self.on_fused = on_fused
        self.leaves = leaves  # submodules kept opaque besides the engine's leaves (paths)
        self.fallback = "" if wrap else "; its fusion targets fuse one by one instead"
        self.original = module.__dict__.get("forward")
        self.state = "waiting"  # -> "fused" | "eager"
        self.report = None
        self.globals = GlobalReads(facts.global_reads, facts.always_guarded)
        self.fused_module = module  # or the method the module's forward dispatches to, as a module
        self.warned_capture = False
        eager = module.forward

        @functools.wraps(eager)
        def forward(*args, **kwargs):
            return self.call(eager, args, kwargs)

        self.module_forward = eager
        if wrap:
            module.forward = forward

    def call(self, eager: Callable, args: tuple, kwargs: dict):
        """One call: fused at the first in the mode, then the fused forward while its guard
        holds, else ``eager``. A call with traced values is part of a bigger module being
        traced (the whole layer): the trace goes through the module's own code."""
        if _has_proxy(args) or _has_proxy(kwargs.values()):
            return eager(*args, **kwargs)
        if self.state == "waiting" and mode_active():
            self.fuse(args, kwargs)
        if self.state == "fused" and self.takes_fused_path():
            return self.module_forward(*args, **kwargs)
        return eager(*args, **kwargs)

    @property
    def label(self) -> str:
        return f"{self.name} ({type(self.module).__name__})"

    def takes_fused_path(self) -> bool:
        return mode_active() and self.globals.unchanged()

    def fuse(self, args, kwargs) -> None:
        if postponed_by_capture(self, self.label, self.options):
            return  # stays waiting
        wrapper = self.module.forward
        del self.module.forward  # fuse the module's own forward, not this wrapper
        if self.original is not None:
            self.module.forward = self.original
        method = self.facts.called_method(self.module)
        if getattr(method, "__func__", method) is not getattr(self.module.forward, "__func__", None):
            self.fused_module = method_module(self.module, method.__name__)  # a forward(*args) dispatching
        leaves = leaf_paths(self.fused_module, self.facts.is_leaf) + list(self.leaves)
        self.declare_call_state(method, args, kwargs)
        try:
            self.globals.snapshot_always()
            with self.globals.recording():
                self.report = fuse_now(self.fused_module, args, kwargs, self.options, leaves,
                                       guard=lambda *a, **k: self.takes_fused_path())
            self.globals_guardable()
        except Unfusable as e:
            self.state = "eager"  # and unwrapped: nothing of fuser's stays on the module
            give_up(self.name, str(e) + self.fallback, self.options)
            return
        except BaseException:
            self.module.forward = wrapper
            raise
        self.module_forward = self.fused_module.forward
        self.module.forward = wrapper
        self.state = "fused"
        read = self.globals.read()
        log_fused(self.name, self.report, self.options, f" (guarded on {read})" if read else "")
        if self.on_fused is not None:
            self.on_fused(self)

    def declare_call_state(self, method: Callable, args: tuple, kwargs: dict) -> None:
        """The engine's per-call object, where the call hands it, is state whatever it holds."""
        if not self.facts.call_state:
            return
        try:
            value = inspect.signature(method).bind_partial(*args, **kwargs).arguments.get(self.facts.call_state)
        except TypeError:
            return
        if value is not None:
            declare_state(type(value))

    def globals_guardable(self) -> None:
        """Raise :class:`Unfusable`, leaving the module unfused, when a global read cannot be guarded."""
        from fuser.install.splice import restore

        try:
            self.globals.check()
        except Unfusable:
            restore(self.fused_module)
            raise

    def remove(self) -> None:
        from fuser.install.splice import is_fused, restore

        if is_fused(self.fused_module):
            if self.fused_module is self.module:
                self.module.forward = self.module_forward  # the guarded forward fuser installed
            restore(self.fused_module)
        if self.original is None:
            self.module.__dict__.pop("forward", None)
        else:
            self.module.forward = self.original


def _has_proxy(values) -> bool:
    return any(isinstance(v, torch.fx.Proxy) for v in values)


class MethodModule(torch.nn.Module):
    """One method of a module as a module fuser can apply to: ``forward`` calls
    ``self.owner.<method>`` with the method's signature. The owner is a submodule, so its
    parameters stay parameters (read live, as the owner's)."""

    def __init__(self, owner: torch.nn.Module, method: str):
        super().__init__()
        self.owner, self.method = owner, method

    def extra_repr(self) -> str:
        return f"{type(self.owner).__name__}.{self.method}"


def method_module(owner: torch.nn.Module, method: str) -> MethodModule:
    """A :class:`MethodModule` for ``owner.<method>``, of a class named after the owner's (the report's name)."""
    signature = inspect.signature(getattr(owner, method))

    def forward(self, *args, **kwargs):
        return getattr(self.owner, self.method)(*args, **kwargs)

    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    forward.__signature__ = signature.replace(parameters=[self_parameter, *signature.parameters.values()])
    cls = type(f"{type(owner).__name__}.{method}", (MethodModule,), {"forward": forward, "__module__": type(owner).__module__})
    return cls(owner, method)
