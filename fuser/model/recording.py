"""recording: one real forward of a model, with the first call of each watched submodule
recorded — its arguments (tensors cloned, state objects as they were before the forward) and
the first tensor it returned — which is what each layer is fused and checked on; and the
submodules called again in that forward unlike their first call (another structure or another
non-tensor value: a rotary embedding asked for two kinds of layer), which one plan of their own
could not serve."""

from __future__ import annotations

import copy
from typing import Any

import torch

from fuser.pipeline.fuse_module import tensors_of
from fuser.trace.call_spec import CallSpec, is_state, with_state_copied
from fuser.trace.tracing import forward_of, preserved_state


class RecordedCalls(dict):
    """Module id -> (args, kwargs, the first tensor it returned) of its first call; ``varied``:
    module id -> how a later call of the same forward differed from the first."""

    def __init__(self):
        super().__init__()
        self.varied: dict[int, str] = {}


def record_calls(model, args, kwargs, modules) -> RecordedCalls:
    """The first call of each of ``modules`` in one forward of the model: (args, kwargs), its
    tensors cloned, and the first tensor it returned; and which were called again unlike it."""
    calls: dict[int, Any] = {}
    specs: dict[int, CallSpec | None] = {}  # module id -> its first call's structure
    recorded = RecordedCalls()
    handles = []
    # The forward runs on a copy of the call's state (a KV cache); each recorded call holds the
    # state as it was before the forward (a layer's slot of a cache is written by that layer only).
    args, kwargs = with_state_copied(args, kwargs)
    before_forward = {id(v): copy.deepcopy(v) for v in torch.utils._pytree.tree_leaves((args, kwargs)) if is_state(v)}

    def before(module, a, k):
        if id(module) not in calls:
            calls[id(module)] = [cloned(a, before_forward), cloned(k, before_forward), None]
            specs[id(module)] = _spec(module, a, k)
        elif id(module) not in recorded.varied and specs[id(module)] is not None:
            _, why = specs[id(module)].flatten(a, k)
            if why is not None:
                recorded.varied[id(module)] = why

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
    recorded.update({key: tuple(value) for key, value in calls.items()})
    return recorded


def _spec(module, args, kwargs) -> CallSpec | None:
    try:
        return CallSpec.of(forward_of(module), args, kwargs)
    except Exception:  # noqa: BLE001 - a call its own signature does not bind: nothing to compare
        return None


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
