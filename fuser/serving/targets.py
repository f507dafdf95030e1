"""targets: what fuser knows about an engine's modules (:class:`EngineFacts`) and which
submodules of a layer are fused (:func:`fusion_targets`): the topmost ones that are not leaves
and do not pass the engine's per-call state into leaves that consume it.

The engine-neutral halves of those facts are here too: the leaves of every engine
(:func:`is_fusers_leaf`: ``@fuser.opaque`` classes and the tracer's default leaves) and whether
a module's called method takes or requires the per-call state (:func:`takes_state`,
:func:`requires_state`, :func:`passes_state_to_leaves`); :class:`fuser.serving.engine.Engine`
builds its :class:`EngineFacts` from them and the adapter's own callbacks."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fuser.ir.opaque import is_opaque
from fuser.trace.leaves import is_default_leaf


def _forward_of(module: torch.nn.Module) -> Callable:
    return module.forward


@dataclass(frozen=True)
class EngineFacts:
    """An engine adapter's facts about its modules, for target selection and tracing.

    ``is_leaf``: a module never fused nor looked into (GEMMs, attention, experts, the
    engine's own kernels). ``searched``: a module that passes the engine's per-call state
    into a leaf that consumes it (attention, a KV-cache writer): it is searched for targets,
    not traced. ``called_method``: the method the engine's call of a module runs (its
    ``forward``, or what a ``forward(*args, **kwargs)`` dispatches to); that is what is traced.
    ``global_reads``: dotted paths of engine-wide flag functions that traced code may call
    (``get_is_capture_mode``); each one read is a guarded value (:class:`GlobalReads`).
    ``always_guarded``: dotted paths of zero-argument functions compared at every call of
    every target, read or not (a setting the adapter's own decisions depend on).
    ``call_state``: the name of the per-call argument (a layer fused whole takes it as state)."""

    is_leaf: Callable[[torch.nn.Module], bool]
    searched: Callable[[torch.nn.Module], bool]
    called_method: Callable[[torch.nn.Module], Callable] = _forward_of
    global_reads: tuple[str, ...] = ()
    always_guarded: tuple[str, ...] = ()
    call_state: str = ""  # the layer's argument that is the engine's per-call state (sglang: forward_batch)


def leaf_paths(module: torch.nn.Module, is_leaf: Callable[[torch.nn.Module], bool]) -> list[str]:
    """The qualified names of ``module``'s topmost submodules that are leaves (what the trace
    keeps opaque, by name: a class may be a leaf in one configuration and glue in another)."""
    paths = []

    def visit(prefix: str, parent: torch.nn.Module):
        for name, child in parent.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if is_leaf(child):
                paths.append(path)
            else:
                visit(path, child)

    visit("", module)
    return paths


def target_decisions(layer: torch.nn.Module, facts: EngineFacts) -> list[tuple[str, str, str]]:
    """What :func:`fusion_targets` decides for each submodule it looks at, top down:
    ``(path, class name, "leaf" | "searched" | "target")``. A leaf (``facts.is_leaf``: GEMMs,
    attention, experts, the engine's own kernels) is never fused nor looked into; a module
    that passes the engine's per-call state into a leaf that consumes it (``facts.searched``:
    attention) is searched, not traced; the topmost others are the targets, whether their
    called method takes the engine's state or not (it is traced as state)."""
    decisions = []

    def visit(prefix: str, module: torch.nn.Module):
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if facts.is_leaf(child):
                decisions.append((path, type(child).__name__, "leaf"))
            elif facts.searched(child):
                decisions.append((path, type(child).__name__, "searched"))
                visit(path, child)
            else:
                decisions.append((path, type(child).__name__, "target"))

    visit("", layer)
    return decisions


def decisions_text(name: str, layer: torch.nn.Module, decisions: list[tuple[str, str, str]]) -> str:
    """``decisions`` (:func:`target_decisions` of ``layer``) as an indented table, under a line
    naming the layer."""
    width = max(len(path) + 2 * path.count(".") for path, _, _ in decisions)
    lines = [f"fuser: {name} ({type(layer).__name__}): leaves, searched modules and fusion targets"]
    for path, cls, decision in decisions:
        indented = "  " * path.count(".") + path
        lines.append(f"  {indented:<{width}}  {cls:<36} {decision}")
    return "\n".join(lines)


def fusion_targets(layer: torch.nn.Module, decisions: list[tuple[str, str, str]]) -> list[tuple[str, torch.nn.Module]]:
    """The submodules of ``layer`` to fuse, by its :func:`target_decisions`."""
    return [(path, layer.get_submodule(path)) for path, _, decision in decisions if decision == "target"]


# ------------------------------------------------------------------------------------------
# The engine-neutral facts: fuser's own leaves, and who takes the per-call state
# ------------------------------------------------------------------------------------------


def is_fusers_leaf(module: torch.nn.Module) -> bool:
    """A leaf in every engine: a class marked ``@fuser.opaque``, or one the tracer always keeps
    opaque (``torch.nn.Linear``, ``torch.nn.Embedding`` running their own forward: a subclass
    with a forward of its own is traced into, :func:`fuser.trace.leaves.is_default_leaf`)."""
    return is_opaque(type(module)) or is_default_leaf(module)


def takes_anything(function: Callable) -> bool:
    """Does ``function`` take ``*args`` or ``**kwargs`` (so that what it takes cannot be told
    from its signature)?"""
    kinds = {p.kind for p in inspect.signature(function).parameters.values()}
    return inspect.Parameter.VAR_POSITIONAL in kinds or inspect.Parameter.VAR_KEYWORD in kinds


def takes_state(module: torch.nn.Module, state: str, called_method: Callable = _forward_of) -> bool:
    """Does the method the engine calls on ``module`` take the per-call argument ``state``
    (sglang: ``forward_batch``), or take anything at all, so that it cannot be told?"""
    method = called_method(module)
    return takes_anything(method) or state in inspect.signature(method).parameters


def requires_state(module: torch.nn.Module, state: str, called_method: Callable = _forward_of) -> bool:
    """Does the method the engine calls on ``module`` require ``state`` (a parameter with no
    default: attention, a KV-cache writer), rather than take it optionally (a row-parallel GEMM)?"""
    parameter = inspect.signature(called_method(module)).parameters.get(state)
    return parameter is not None and parameter.default is inspect.Parameter.empty


def passes_state_to_leaves(module: torch.nn.Module, state: str, is_leaf: Callable[[torch.nn.Module], bool],
                           called_method: Callable = _forward_of) -> bool:
    """Does ``module`` take ``state`` and hold a leaf that requires it (attention, a KV-cache
    writer: they read the attention backend's per-batch metadata and write the cache)? Such a
    module is searched for targets, not traced: its own control flow may read the engine's
    forward context (sglang's ``get_attn_backend()``), engine state that no guard compares."""
    if not takes_state(module, state, called_method):
        return False
    return any(requires_state(module.get_submodule(path), state, called_method)
               for path in leaf_paths(module, is_leaf))
