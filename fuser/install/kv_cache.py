"""kv_cache: transformers' static KV cache written by one kernel.

A decode step of a transformers model with a ``StaticCache`` calls
``past_key_values.update(key_states, value_states, layer_idx)`` in every attention layer. The
call takes state, so the trace keeps it as a leaf; as transformers writes it
(``StaticLayer.update``) it is four launches besides the length's in-place add: the ``arange``
of the positions, its add to the cache's length, and an ``index_copy_`` for the keys and one
for the values. :func:`update` takes the leaf's place in a fused graph: for a
``StaticCache`` layer that is a plain ``StaticLayer`` (not sliding, not offloaded,
initialised, the new states of its dtype and sizes) it writes the keys and values at the
cache's length in one kernel, reading the length on the device, and the same kernel adds to
the length as transformers does: the last of its programs to finish (an atomic count of the
programs done, kept beside the length and back at zero after each call) stores it, when every
other program has read it. It returns the layer's tensors.

A sliding-window layer (``StaticSlidingWindowLayer``) is written the same way while the window
is not full after the step; once it is full, a one-token step moves its rows up by one and
writes the new one last, as transformers' roll does but with no index made on the host (which
no CUDA graph could capture). Either way its Python count of tokens moves on as transformers'
does. A step in which the window fills up (transformers concatenates) runs transformers' update.
Any other cache, layer or call runs ``past_key_values.update`` itself.

As in transformers, the length is not checked against the cache's size on the host (that
would be a device sync in every step). transformers' own write past the end fails on the
device; this kernel's writes past the end are dropped.
"""

from __future__ import annotations

import functools
import os
import weakref
from pathlib import Path

import torch
import torch.fx as fx
import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from fuser.codegen.emit import forbid_compile_during_capture
from fuser.codegen.fast_launch import fast

CACHE_MODULE = "transformers.cache_utils"
STATIC_LAYERS = ("StaticLayer", "StaticSlidingWindowLayer")  # of CACHE_MODULE: the layers the kernel writes


@triton.jit
def _write_at_length(
    k_ptr, v_ptr, keys_ptr, values_ptr, length_ptr, done_ptr, heads, steps, slots,
    k_b, k_h, k_s, v_b, v_h, v_s, c_b, c_h, c_s,
    DIM: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One program per (batch, head, new position): the key and value rows written at slot
    ``length + position`` of their cache rows (the caches' last dimension is contiguous). The
    batch is only the grid: no integer argument depends on it, so one compiled
    kernel serves them all. The last program to finish moves the length on by ``steps``."""
    if PDL:
        gdc_wait()  # launched early: wait until the kernel before has finished and its writes are seen
        gdc_launch_dependents()
    row = tl.program_id(0)
    b = row // (heads * steps)
    h = (row // steps) % heads
    s = row % steps
    length = tl.load(length_ptr)
    slot = length + s
    d = tl.arange(0, BLOCK)
    mask = (d < DIM) & (slot < slots)
    key = tl.load(k_ptr + b * k_b + h * k_h + s * k_s + d, mask=mask)
    value = tl.load(v_ptr + b * v_b + h * v_h + s * v_s + d, mask=mask)
    at = b * c_b + h * c_h + slot * c_s + d
    tl.store(keys_ptr + at, key, mask=mask)
    tl.store(values_ptr + at, value, mask=mask)
    move_length_on(length_ptr, done_ptr, length, steps, tl.num_programs(0))


@triton.jit
def move_length_on(length_ptr, done_ptr, length, steps, programs):
    """The end of each of a kernel's ``programs`` that wrote a cache at ``length`` (which each
    read): the last to finish stores ``length + steps`` and sets the count ``done_ptr`` (kept
    zeroed between calls, :func:`done_count`) back to zero."""
    # Every program read the length before it counts itself done (acq_rel): the last one
    # stores the new length and sets the count back to zero for the next call.
    if tl.atomic_add(done_ptr, 1) == programs - 1:
        tl.store(length_ptr, length + steps)
        tl.store(done_ptr, 0)


forbid_compile_during_capture(_write_at_length, Path(__file__))
_write_at_length = fast(_write_at_length)


def _plain_layer(cache, layer_idx):
    """Layer ``layer_idx`` of ``cache`` when ``cache`` is transformers' ``StaticCache`` and the
    layer a ``StaticLayer`` or a ``StaticSlidingWindowLayer`` of transformers' own (not a
    subclass, not offloaded), else None."""
    if type(cache).__name__ != "StaticCache" or type(cache).__module__ != CACHE_MODULE or not isinstance(layer_idx, int):
        return None
    layers = getattr(cache, "layers", ())
    if not 0 <= layer_idx < len(layers):
        return None
    layer = layers[layer_idx]
    return layer if type(layer).__name__ in STATIC_LAYERS and type(layer).__module__ == CACHE_MODULE else None


def static_layer(cache, layer_idx, key_states: torch.Tensor, value_states: torch.Tensor):
    """The cache's layer ``layer_idx`` when the kernel can write it, else None."""
    layer = _plain_layer(cache, layer_idx)
    if layer is None or getattr(cache, "offloading", False) or not layer.is_initialized:
        return None
    if type(cache).update.__qualname__ != "Cache.update":  # the base class's, which calls the layer's
        return None
    keys, values, length = layer.keys, layer.values, layer.cumulative_length
    device = keys.device
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return None
    tensors = (key_states, value_states, values, length)
    if any(not isinstance(t, torch.Tensor) or t.device != device for t in tensors):
        return None
    if key_states.dim() != 4 or key_states.shape != value_states.shape or key_states.requires_grad or value_states.requires_grad:
        return None
    batch, heads, _, dim = key_states.shape
    if keys.shape != values.shape or (keys.shape[0], keys.shape[1], keys.shape[3]) != (batch, heads, dim):
        return None
    if not (key_states.dtype == value_states.dtype == keys.dtype == values.dtype) or length.numel() != 1:
        return None
    if keys.stride(3) != 1 or values.stride() != keys.stride() or key_states.stride(3) != 1 or value_states.stride(3) != 1:
        return None
    return layer


_COUNTS: dict[tuple[int, int], torch.Tensor] = {}  # (id(tensor), n) -> its n zeroed counts


def counts_beside(tensor: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` zeroed int32 counts kept beside ``tensor`` (on its device) while it lives: kernels
    that count their programs done set them back to zero before they end."""
    key = (id(tensor), n)
    counts = _COUNTS.get(key)
    if counts is None:
        counts = _COUNTS[key] = torch.zeros(n, dtype=torch.int32, device=tensor.device)
        weakref.finalize(tensor, _COUNTS.pop, key, None)
    return counts


def done_count(length: torch.Tensor) -> torch.Tensor:
    """The zeroed int32 count of a kernel's programs done kept beside a layer's length."""
    return counts_beside(length, 1)


def update(cache, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx, *args, pdl: bool = False, **kwargs):
    """``cache.update(key_states, value_states, layer_idx, ...)``, in one kernel and the
    length's add in it, where the layer is a static one the kernel can write (module docstring);
    the kernel launched with programmatic dependent launch where ``pdl``."""
    layer = static_layer(cache, layer_idx, key_states, value_states)
    if layer is None:
        return cache.update(key_states, value_states, layer_idx, *args, **kwargs)
    if type(layer).__name__ == "StaticLayer":
        _write_at_the_length(layer, key_states, value_states, pdl)
        return layer.keys, layer.values
    steps, filled, window = key_states.shape[2], layer.cumulative_length_int, layer.max_cache_len
    if steps and filled + steps <= window:  # not full after the step: as a plain layer
        _write_at_the_length(layer, key_states, value_states, pdl)
    elif filled >= window and steps == 1:  # full: the oldest row out, the new one last
        for cached, new in ((layer.keys, key_states), (layer.values, value_states)):
            cached.copy_(torch.cat((cached[:, :, 1:], new), dim=2))
    else:  # the window fills up in this step: transformers concatenates
        return cache.update(key_states, value_states, layer_idx, *args, **kwargs)
    layer.cumulative_length_int += steps
    return layer.keys, layer.values


def _write_at_the_length(layer, key_states: torch.Tensor, value_states: torch.Tensor, pdl: bool) -> None:
    """The new states written at the layer's device length, which moves on, in one kernel."""
    keys, values = layer.keys, layer.values
    batch, heads, steps, dim = key_states.shape
    rows = batch * heads * steps
    if rows:
        _write_at_length[(rows,)](
            key_states, value_states, keys, values, layer.cumulative_length, done_count(layer.cumulative_length),
            heads, steps, keys.shape[2],
            key_states.stride(0), key_states.stride(1), key_states.stride(2),
            value_states.stride(0), value_states.stride(1), value_states.stride(2),
            keys.stride(0), keys.stride(1), keys.stride(2),
            DIM=dim, BLOCK=triton.next_power_of_2(dim), PDL=pdl, launch_pdl=pdl,
        )  # fmt: skip
    else:
        layer.cumulative_length.add_(steps)


def write_in_one_kernel(graph: fx.Graph, traced, pdl: bool = False) -> list[str]:
    """Make each leaf call ``<state>.update(...)`` of ``graph`` that wrote a layer of a
    ``StaticCache`` the kernel can write in the trace a call of :func:`update` (the node keeps its name and
    arguments), launched with programmatic dependent launch where ``pdl``; the calls changed, as
    the report names them (``past_key_values.update``)."""
    changed = []
    for node in graph.nodes:
        if node.op != "call_method" or node.target != "update" or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        shadows = traced.shadows.get(node.args[0].name)
        if shadows is not None and len(node.args) >= 4 and _plain_layer(shadows[0], node.args[3]) is not None:
            node.op, node.target = "call_function", updater(pdl)
            changed.append(f"{node.args[0].target if node.args[0].op == 'placeholder' else node.args[0].name}.update")
    return changed


@functools.lru_cache(maxsize=None)
def updater(pdl: bool):
    """:func:`update`, its kernel launched with PDL where ``pdl``: what a fused graph calls."""
    if not pdl:
        return update

    def update_with_pdl(*args, **kwargs):
        return update(*args, pdl=True, **kwargs)

    return update_with_pdl
