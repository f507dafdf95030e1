"""serving_targets: what an engine adapter says about its modules (:class:`EngineFacts`) and
which submodules of a layer are fused (:func:`fusion_targets`): the topmost ones that are not
leaves and do not pass the engine's per-call state into leaves that consume it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


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
    every target, read or not (a setting the adapter's own decisions depend on)."""

    is_leaf: Callable[[torch.nn.Module], bool]
    searched: Callable[[torch.nn.Module], bool]
    called_method: Callable[[torch.nn.Module], Callable] = _forward_of
    global_reads: tuple[str, ...] = ()
    always_guarded: tuple[str, ...] = ()


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


def fusion_targets(layer: torch.nn.Module, facts: EngineFacts) -> list[tuple[str, torch.nn.Module]]:
    """The submodules of ``layer`` to fuse (see :func:`target_decisions`)."""
    return [(path, layer.get_submodule(path)) for path, _, decision in target_decisions(layer, facts)
            if decision == "target"]
