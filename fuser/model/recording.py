"""recording: one real forward of a model, with the first call of each watched submodule
recorded — its arguments (tensors cloned, state objects as they were before the forward) and
the first tensor it returned — which is what each layer is fused and checked on."""

from __future__ import annotations

import copy
from typing import Any

import torch

from fuser.pipeline.fuse_module import tensors_of
from fuser.trace.call_spec import is_state, with_state_copied
from fuser.trace.tracing import preserved_state


def record_calls(model, args, kwargs, modules) -> dict[int, tuple[tuple, dict]]:
    """The first call of each of ``modules`` in one forward of the model: (args, kwargs), its
    tensors cloned, and the first tensor it returned (under key ``"out"``)."""
    calls: dict[int, Any] = {}
    handles = []
    # The forward runs on a copy of the call's state (a KV cache); each recorded call holds the
    # state as it was before the forward (a layer's slot of a cache is written by that layer only).
    args, kwargs = with_state_copied(args, kwargs)
    before_forward = {id(v): copy.deepcopy(v) for v in torch.utils._pytree.tree_leaves((args, kwargs)) if is_state(v)}

    def before(module, a, k):
        if id(module) not in calls:
            calls[id(module)] = [cloned(a, before_forward), cloned(k, before_forward), None]

    def after(module, a, k, out):
        record = calls.get(id(module))
        if record is not None and record[2] is None:
            first = tensors_of((out,))
            record[2] = first[0].detach().clone() if first else None

    for m in modules:
        handles.append(m.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(m.register_forward_hook(after, with_kwargs=True))
    try:
        with preserved_state(model, tensors_of(args, kwargs)), torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return {key: tuple(value) for key, value in calls.items()}


def cloned(value, states: dict):
    def clone(x):
        if isinstance(x, torch.Tensor):
            return x.detach().clone()
        return states.get(id(x), x)

    return torch.utils._pytree.tree_map(clone, value)


def is_layer_call(call) -> bool:
    """Called, with hidden states as its first argument, returning a tensor of their shape."""
    if call is None or not call[0] or not isinstance(call[0][0], torch.Tensor) or call[2] is None:
        return False
    return call[2].shape == call[0][0].shape
