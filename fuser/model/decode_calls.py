"""decode_calls: which calls of a model are decode steps — one new token per sequence."""

from __future__ import annotations

import torch


def new_tokens_per_sequence(args: tuple, kwargs: dict) -> int | None:
    """Dim 1 of the call's token input (``input_ids``, ``inputs_embeds`` or the first tensor
    argument), or None when it has none of two or more dims."""
    tokens = next((kwargs[k] for k in ("input_ids", "inputs_embeds") if isinstance(kwargs.get(k), torch.Tensor)), None)
    if tokens is None:
        tokens = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return tokens.shape[1] if tokens is not None and tokens.dim() >= 2 else None


def is_decode_call(args: tuple, kwargs: dict) -> bool:
    return new_tokens_per_sequence(args, kwargs) == 1
