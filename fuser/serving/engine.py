"""engine: the adapter interface (:class:`Engine`), what one serving engine's adapter supplies,
and what fuser does with it over a loaded model (:func:`install`).

An adapter is one file in ``fuser/serving/engines/`` (``sglang.py`` is one). It holds only what
is its engine's and describes it in one :class:`Engine`:

* ``call_state`` and ``is_decode``: the per-call argument of a decoder layer's ``forward``
  that says what kind of call it is (sglang: ``forward_batch``), and whether a call with that
  value is a decode call (sglang: ``forward_batch.forward_mode.is_decode()``). Only decode
  calls take the fused path; every other call runs the layer's own code;
* ``is_leaf``: the engine's own modules that are never fused nor looked into (its GEMM layers,
  attention, experts, its own kernels); fuser's own leaves (``@fuser.opaque`` classes,
  ``torch.nn.Linear``, ``torch.nn.Embedding``) are added by :attr:`Engine.facts`;
* ``called_method`` (optional): the method the engine's call of a module runs, when that is
  not ``forward`` (a ``forward(*args, **kwargs)`` that dispatches per platform);
* ``global_reads``, ``always_guarded`` (optional): the engine-wide flag functions traced code
  may call, read as guarded values (:class:`fuser.serving.global_reads.GlobalReads`);
* ``declare_weight_caches`` (optional): how to tell the engine that fuser holds values computed
  from its weights at fuse time (sglang: ``model._derived_weight_cache_error``);
* ``no_targets`` (optional): why a layer of this engine may have nothing to fuse, for its log line;
* ``traced_through`` (optional): dotted paths of the classes of objects the per-call state
  holds that a layer's code changes through their methods (sglang's residual stream), traced
  as Python objects (:mod:`fuser.trace.state_objects`) when a layer is fused whole.

A layer is fused whole at its first decode call (its searched modules, attention, kept opaque
with the engine's leaves); its targets are the fallback where it cannot be, or a call its
guard declines (``FUSER_WHOLE_LAYER=0``: the targets alone).

The adapter then calls :func:`install` from the hook its engine runs once the model is loaded
(sglang: after ``ModelRunner.initialize``, before any warm-up or capture), with its
:class:`~fuser.serving.options.Options` (``layers``: the decoder-layer class names). Everything
else is engine-neutral: which submodules are fused (:mod:`fuser.serving.targets`), the mode
splice and lazy fusion at the first decode call, never inside a capture
(:mod:`fuser.serving.lazy_fusion`), and what is logged.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fuser.install.splice import STATE_ATTR
from fuser.serving.lazy_fusion import SPLICE_ATTR, LazyFusion, ModeSplice
from fuser.serving.options import Options
from fuser.serving.targets import (
    EngineFacts,
    decisions_text,
    fusion_targets,
    is_fusers_leaf,
    passes_state_to_leaves,
    target_decisions,
)
from fuser.trace.state_objects import trace_through

log = logging.getLogger("fuser")


def _forward_of(module: torch.nn.Module) -> Callable:
    return module.forward


@dataclass(frozen=True)
class Engine:
    """One serving engine, as its adapter describes it (see the module's docstring)."""

    call_state: str
    is_decode: Callable[[Any], bool]
    is_leaf: Callable[[torch.nn.Module], bool]
    called_method: Callable[[torch.nn.Module], Callable] = _forward_of
    global_reads: tuple[str, ...] = ()
    always_guarded: tuple[str, ...] = ()
    declare_weight_caches: Callable[[torch.nn.Module, str], None] | None = None
    no_targets: str = ""
    traced_through: tuple[str, ...] = ()

    def is_any_leaf(self, module: torch.nn.Module) -> bool:
        """A leaf of this engine or one of fuser's own."""
        return is_fusers_leaf(module) or self.is_leaf(module)

    def searched(self, module: torch.nn.Module) -> bool:
        """Does ``module`` pass the per-call state into a leaf that requires it (searched for
        targets, not traced)?"""
        return passes_state_to_leaves(module, self.call_state, self.is_any_leaf, self.called_method)

    def declare_traced_through(self) -> None:
        """Mark the classes of :attr:`traced_through` that are importable (:func:`fuser.trace_through`)."""
        for dotted in self.traced_through:
            module_name, _, class_name = dotted.rpartition(".")
            try:
                cls = getattr(importlib.import_module(module_name), class_name)
            except (ImportError, AttributeError) as e:
                log.debug("fuser: %s not importable (%s)", dotted, e)
                continue
            trace_through(cls)

    def decode_call(self, arguments: dict) -> bool:
        """Does a layer call (its bound arguments) run in decode mode?"""
        return self.is_decode(arguments.get(self.call_state))

    @functools.cached_property
    def facts(self) -> EngineFacts:
        """What target selection and lazy fusion read (:class:`EngineFacts`)."""
        return EngineFacts(is_leaf=self.is_any_leaf, searched=self.searched, called_method=self.called_method,
                           global_reads=self.global_reads, always_guarded=self.always_guarded, call_state=self.call_state)


def layer_class_matches(cls: type, names: tuple[str, ...]) -> bool:
    """Is ``cls`` named in ``names``, by its own name or by an alias in its module (sglang's
    ``DeepseekV4DecoderLayer`` is the platform class off CUDA)?"""
    if cls.__name__ in names:
        return True
    home = sys.modules.get(cls.__module__)
    return home is not None and any(getattr(home, name, None) is cls for name in names)


def install(model: torch.nn.Module, engine: Engine, options: Options) -> list[ModeSplice]:
    """Put every decoder layer of ``model`` whose class is in ``options.layers`` under a decode
    splice (:class:`ModeSplice`). Nothing is traced here: each target is fused at its first
    decode call. A layer whose ``forward`` does not take ``engine.call_state``, or that has no
    target, is left as it is, with a log line saying why."""
    splices, explained = [], set()
    if options.whole_layer:
        engine.declare_traced_through()
    for name, module in model.named_modules():
        if not layer_class_matches(type(module), options.layers) or SPLICE_ATTR in module.__dict__:
            continue
        if any(name.startswith(s.name + ".") for s in splices):
            continue  # inside a layer already spliced
        if engine.call_state not in inspect.signature(module.forward).parameters:
            log.warning("fuser: %s (%s) takes no %s: decode and prefill cannot be told apart, left eager",
                        name, type(module).__name__, engine.call_state)
            continue
        decided = target_decisions(module, engine.facts)
        targets = fusion_targets(module, decided)
        if not targets:
            why = engine.no_targets or f"(each submodule is a leaf or passes {engine.call_state} to one)"
            log.info("fuser: %s (%s): no submodule to fuse %s", name, type(module).__name__, why)
            continue
        if options.explain:  # once for each layer class and structure
            if (type(module), tuple(decided)) not in explained:
                explained.add((type(module), tuple(decided)))
                log.info("%s", decisions_text(name, module, decided))
        on_fused = None
        if engine.declare_weight_caches is not None:
            on_fused = functools.partial(_declare_weight_caches, engine.declare_weight_caches, model)
        whole = searched_paths(decided) if options.whole_layer else None
        splices.append(ModeSplice(name, module, engine.decode_call, targets, options, engine.facts, on_fused, whole))
    return splices


def searched_paths(decisions: list[tuple[str, str, str]]) -> tuple[str, ...]:
    """The topmost searched modules of a layer's decisions: what its whole trace keeps opaque
    besides the leaves (they pass the per-call state into leaves that consume it)."""
    searched = [path for path, _, decision in decisions if decision == "searched"]
    return tuple(p for p in searched if not any(p.startswith(q + ".") for q in searched))


def decisions(layer: torch.nn.Module, engine: Engine) -> list[tuple[str, str, str]]:
    """What :func:`install` decides for each submodule of a decoder layer: leaf, searched or target."""
    return target_decisions(layer, engine.facts)


def weight_derived_values(target: LazyFusion) -> tuple[str, ...]:
    """The attributes of a fused target that hold values fuser computed from weights at fuse
    time (empty when it is not fused or holds none)."""
    state = target.fused_module.__dict__.get(STATE_ATTR)
    return tuple(state.constants) if state is not None else ()


def weight_cache_message(target: LazyFusion, values: tuple[str, ...]) -> str:
    """What an engine's weight updater is told when ``target`` holds ``values``."""
    return ("fuser holds values computed from the weights at fuse time (e.g. "
            f"{target.name}: {', '.join(values)}); CUDA graphs and fused kernels would "
            "not see updated weights: restart the server (or re-run fuser) after a weight update")


def _declare_weight_caches(declare: Callable[[torch.nn.Module, str], None], model: torch.nn.Module,
                           target: LazyFusion) -> None:
    values = weight_derived_values(target)
    if values:
        declare(model, weight_cache_message(target, values))
