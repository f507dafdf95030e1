"""cache_in_attention: a decode step's write into a static KV cache and its attention in one kernel.

At decode a transformers attention layer writes the step's keys and values into its cache
(``past_key_values.update``: one kernel, :mod:`fuser.install.kv_cache`) and then attends over
the cache (``F.scaled_dot_product_attention``: :mod:`fuser.install.decode_attention`), two
launches a layer, the second waiting for the first. Where the update's outputs are read by that
attention call alone, :func:`attend_writing` takes both calls' place: the attention kernel
writes the new rows at the cache's length itself (the program whose slice of the keys holds
that slot) and moves the length on, as the cache's kernel does. With ``combine`` (the
``combine_in_attention`` pass) a call of several slices of keys is one launch too: the program
that finishes a key head's slices last combines them (a count of each key head's slices done,
kept beside the layer's keys and set back by that program), not a second kernel.

Checked at every call: a plain ``StaticLayer`` the cache's kernel would write
(:func:`fuser.install.kv_cache.static_layer`), one new row a sequence, and an attention call the
kernel takes for up to :data:`~fuser.install.decode_attention.MAX_BATCH` sequences. Any other
call runs the two as before: the cache's update, then the attention.
"""

from __future__ import annotations

import functools

import torch

from fuser.install import decode_attention, kv_cache


def attend_writing(cache, key_states, value_states, layer_idx, q, attn_mask=None, dropout_p=0.0, is_causal=False,
                   scale=None, enable_gqa=False, *, pdl: bool = False, combine: bool = False):  # fmt: skip
    """``F.scaled_dot_product_attention(q, *cache.update(key_states, value_states, layer_idx), ...)``,
    in one kernel where the module docstring's checks hold (the update's arguments first, at
    their places in its call); with ``combine`` the slices of the keys combined in that kernel
    too (by a count of each key head's slices done, kept beside the layer's keys)."""
    layer = kv_cache.static_layer(cache, layer_idx, key_states, value_states)
    if layer is not None and type(layer).__name__ == "StaticLayer" and isinstance(q, torch.Tensor) and q.dim() == 4:
        keys, values, length = layer.keys, layer.values, layer.cumulative_length
        if q.shape[0] <= decode_attention.MAX_BATCH and decode_attention.takes(
            q, keys, values, attn_mask, dropout_p, is_causal, scale, enable_gqa
        ):
            write = (key_states, value_states, length, kv_cache.done_count(length))
            if decode_attention.takes_write(keys, values, *write):
                counts = kv_cache.counts_beside(keys, keys.shape[0] * keys.shape[1]) if combine else None
                return decode_attention.attention(q, keys, values, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                                  pdl=pdl, write=write, counts=counts)  # fmt: skip
    keys, values = kv_cache.update(cache, key_states, value_states, layer_idx, pdl=pdl)
    return decode_attention.launcher(pdl)(q, keys, values, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                          scale=scale, enable_gqa=enable_gqa)  # fmt: skip


@functools.lru_cache(maxsize=None)
def writer(pdl: bool, combine: bool = False):
    """:func:`attend_writing`, its kernels launched with PDL where ``pdl``, the slices combined in
    its kernel where ``combine``: what a fused graph calls."""

    def attend_writing_the_cache(*args, **kwargs):
        return attend_writing(*args, **kwargs, pdl=pdl, combine=combine)

    attend_writing_the_cache.decode_attention_pdl = pdl
    attend_writing_the_cache.combines = combine
    return attend_writing_the_cache
