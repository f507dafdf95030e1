"""once_per_forward: a kernel of a layer that reads only the layer's inputs, run once per forward of the
model for every layer that gets the same inputs.

A model passes every decoder layer the same causal mask, and each layer makes the same value of
it (transformers' sdpa path: the boolean mask made additive, :mod:`fuser.trace.attention_calls`):
one launch a layer, all alike. Where a kernel's every input is an input of the layer's call and
what it makes is only read (by other kernels and by PyTorch's own functions: no leaf, no
in-place op, not returned), its launcher is wrapped (:func:`once_per_forward`): inside a
forward of the model's module that holds the layers (:func:`share_within`), a launch on the
very same tensors (the same memory, sizes and strides, not written since: their version
counters unchanged) and the same other arguments gives the outputs of the first. The memo holds
the tensors it was keyed on, so no other tensor takes their memory while it lives, and it is
dropped when that forward returns. Outside such a forward every launch runs.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Callable

import torch
import torch.fx as fx
import torch.nn as nn

from fuser.ir.canonical_op import COMPUTE, UNIT_VIEW, VIEW, COp, viewed

_MEMO: contextvars.ContextVar[dict | None] = contextvars.ContextVar("fuser_shared_memo", default=None)
_PLAIN = (int, float, bool, str, type(None))
_HOOKS_ATTR = "_fuser_shared_hooks"


def once_per_forward(launch: Callable) -> Callable:
    """``launch``, giving its first outputs again for the same arguments within one forward of
    a module :func:`share_within` was given."""

    @functools.wraps(launch)
    def shared(*args):
        memo = _MEMO.get()
        key = _key(launch, args) if memo is not None else None
        if key is None:
            return _run(launch, args)
        found = memo.get(key)
        if found is None:
            found = memo[key] = (args, _run(launch, args))  # the args held: their memory stays theirs
        return found[1]

    return shared


def _run(launch: Callable, args: tuple):
    return launch(*args)


#: A memo key's mark for results handed over by another kernel (taken once, then dropped).
_HANDED = "handed over"


def hand_over(launch: Callable, args: tuple, results: tuple) -> None:
    """Leave ``results`` as what ``launch(*args)`` gives within this forward, once: computed by
    another kernel (:mod:`fuser.pipeline.next_layer_entry`). Outside a shared forward, nothing."""
    memo = _MEMO.get()
    key = _key(launch, args) if memo is not None else None
    if key is not None:
        memo[(_HANDED, key)] = (args, results)  # the args held: their memory stays theirs


def take_handed_over(launch: Callable) -> Callable:
    """``launch``, giving the results another kernel handed over for the same arguments
    (:func:`hand_over`) instead of running; each is taken once, so that the memo holds no
    activation longer than the next layer needs it."""

    @functools.wraps(launch)
    def taken(*args):
        found = take(launch, args)
        return found if found is not None else _run(launch, args)

    return taken


def take(launch: Callable, args: tuple) -> tuple | None:
    """The results another kernel handed over for ``launch(*args)`` in this forward, taken (each
    once); None where there are none."""
    memo = _MEMO.get()
    key = _key(launch, args) if memo else None
    found = memo.pop((_HANDED, key), None) if key is not None else None
    return found[1] if found is not None else None


def _key(launch: Callable, args: tuple) -> tuple | None:
    """What a launch is known by: each tensor by its memory (address, sizes, strides, dtype,
    device) and its version counter, which every view of the memory shares and every write
    moves on (a layer's own view of the mask is a new object each time, at the same memory);
    the memo holds the tensors, so no other memory takes their addresses while it lives."""
    parts = []
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append((a.data_ptr(), tuple(a.shape), a.stride(), a.dtype, a.device, a._version))
        elif isinstance(a, _PLAIN):
            parts.append(a)
        else:
            return None  # nothing to key it on: it runs
    return (launch, *parts)


def share_within(module: nn.Module) -> None:
    """Each forward of ``module`` (a model's module that holds its layers) keeps one memo for
    the shared launches its layers make. The memo is the context's (each thread has its own):
    the hooks are plain functions of this module, so that a copy of the module shares nothing
    with it and a pickled one leaves them out (:func:`fuser.install.splice.add_copy_hooks`)."""
    if _HOOKS_ATTR in module.__dict__:
        return
    module.__dict__[_HOOKS_ATTR] = (
        module.register_forward_pre_hook(_memo_opened, with_kwargs=True),
        module.register_forward_hook(_memo_closed, with_kwargs=True, always_call=True),
    )


#: The memos of the forwards this context is inside, outermost first (the innermost is _MEMO).
_OUTER: contextvars.ContextVar[tuple] = contextvars.ContextVar("fuser_shared_outer", default=())


def _memo_opened(_module, _args, _kwargs=None):
    # (_kwargs may be missing: a hook removed while its module's pre-hooks run, as a model fused
    # again from its own pre-hook does, is still called, and torch no longer finds its flag)
    _OUTER.set((*_OUTER.get(), _MEMO.get()))
    _MEMO.set({})


def _memo_closed(_module, _args, _kwargs, _out):
    outer = _OUTER.get()
    if outer:
        _MEMO.set(outer[-1])
        _OUTER.set(outer[:-1])


def unshare(module: nn.Module) -> None:
    for handle in module.__dict__.pop(_HOOKS_ATTR, ()):
        handle.remove()


def shareable(region, cops: dict[fx.Node, COp]) -> bool:
    """Does the region's kernel read only inputs of the call (or views of them), and is what it
    makes only read: by other kernels' regions (they never write their inputs) and by PyTorch's
    own out-of-place functions (``F.scaled_dot_product_attention``), through views or not;
    never written, never handed to a leaf, never returned?"""
    if region.stores:
        return False  # it writes into a caller's tensor
    return all(_input_or_view(n, cops) for n in region.inputs) and all(_only_read(n, cops) for n in region.outputs)


def _input_or_view(node: fx.Node, cops) -> bool:
    while node.op != "placeholder":
        cop = cops.get(node)
        if cop is None or cop.kind not in (VIEW, UNIT_VIEW) or not cop.args or not isinstance(cop.args[0], fx.Node):
            return False
        node = cop.args[0]
    return True


def _only_read(node: fx.Node, cops) -> bool:
    for user in node.users:
        cop = cops.get(user)
        if viewed(cop) is not None:
            if not _only_read(user, cops):
                return False
            continue
        if cop is not None and cop.kind == COMPUTE:
            continue  # an out-of-place op (a kernel's, or PyTorch's)
        target = user.target
        torch_function = user.op == "call_function" and getattr(target, "__module__", "").startswith("torch")
        if not torch_function or getattr(target, "__name__", "").endswith("_") or "out" in user.kwargs:
            return False
    return True
