"""layer_stacks: which module lists of a model are stacks of decoder layers — found by what they
do, not by their look. A candidate is a ``ModuleList`` of two or more modules of one class, or
of one module that holds a linear layer (a model of one decoder layer: a draft model, a
multi-token-prediction head; a per-head norm holds none) (:func:`layer_stacks`); it is a stack of layers when, in one real forward, each of its modules
is called with hidden states and returns a tensor of their shape, and each passes its output to
the next (:func:`decoder_stacks`). A list of experts (each given its own tokens) or of per-head
norms (each given its own head: StableLM's ``qk_layernorm``) is not; nor is a list inside a
module of a stack."""

from __future__ import annotations

import torch
import torch.nn as nn

from fuser.model.recording import is_layer_call


def layer_stacks(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """Module lists of two or more modules of one class, or of one holding a linear layer: the
    candidates."""
    return [
        (name, m) for name, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and (len(m) >= 2 and len({type(c) for c in m}) == 1 or len(m) == 1 and _has_linear(m[0]))
    ]  # fmt: skip


def _has_linear(module: nn.Module) -> bool:
    return any(isinstance(m, nn.Linear) for m in module.modules())


def decoder_stacks(candidates: list[tuple[str, nn.ModuleList]], calls: dict) -> list[tuple[str, nn.ModuleList]]:
    """The ``candidates`` that one forward's recorded ``calls`` (:func:`fuser.model.recording.record_calls`,
    watching their modules) show to be stacks of layers, outermost only."""
    chained = [(name, stack) for name, stack in candidates if _chained([calls.get(id(m)) for m in stack])]
    return [(name, stack) for name, stack in chained if not any(name.startswith(f"{outer}.") for outer, _ in chained)]


def _chained(calls: list) -> bool:
    """Every module called as a layer, each on the output of the one before."""
    if not all(is_layer_call(call) for call in calls):
        return False
    return all(_same(before[2], after[0][0]) for before, after in zip(calls, calls[1:]))


def _same(output: torch.Tensor, given: torch.Tensor) -> bool:
    return output.shape == given.shape and output.dtype == given.dtype and torch.equal(output, given)
