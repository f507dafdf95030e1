"""token_dims: which dim of each input of a call follows the tokens, and the call at one token more.

The trace runs the forward at two token counts, T (the example's) and T+1
(:mod:`fuser.trace.tracing`); every input that follows the tokens is given one token more
for the second run. Which inputs follow, and along which dim, is what a caller declares
(``batch_inputs``: a forward parameter, for all its tensors, or one graph input, to the dim that
follows the tokens) or else what the example says:

* the token count is dim 0 of the first tensor input (the hidden states);
* an input whose dim 0 has that size follows the tokens along it;
* an input whose dim 0 is a multiple of it, ``k·T`` with ``T > 1``, follows them ``k`` rows per
  token (an ALiBi bias ``[batch·heads, 1, kv]`` where the token count is the batch: Bloom,
  MPT, Falcon), its rows token-major;
* any other input is held at its size (the guard pins it).

A declared dim grows by as many rows per token as its size is a multiple of the smallest
declared input's (one, where it is no multiple). At one token (``T == 1``) a multiple cannot be
told from a size of its own: such an input is held, and a trace that fails on it names it
(:func:`held_inputs_hint`) so that the caller can declare it.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from fuser.trace.call_spec import CallSpec


def infer_batch_inputs(names: Sequence[str], inputs: Sequence[Any], tokens: int | None = None) -> dict[str, int]:
    """Graph input name -> the dim that follows the tokens, read off the example (above).
    ``tokens``: the token count, where the caller knows it (a model's layers' batch, for a
    module above them); by default dim 0 of the first tensor input."""
    tensors = [(n, v) for n, v in zip(names, inputs) if isinstance(v, torch.Tensor) and v.dim() >= 1]
    if not tensors:
        return {}
    tokens = tensors[0][1].shape[0] if tokens is None else tokens
    found = {}
    for name, value in tensors:
        first = value.shape[0]
        if first == tokens or (tokens > 1 and first % tokens == 0):
            found[name] = 0
    return found


def batch_dims_of(call: CallSpec, tensors: list, batch_inputs: dict[str, int] | None) -> dict[str, int]:
    """Graph input name -> its batch dim. A forward parameter's name stands for all its tensors."""
    if batch_inputs is None:
        return infer_batch_inputs(call.names, tensors)
    by_parameter = call.tensor_names_by_parameter()
    values = dict(zip(call.names, tensors))
    batch = {}
    for name, dim in batch_inputs.items():
        if name in call.names:
            named = [name]
        elif name in by_parameter:
            named = by_parameter[name]
        else:
            raise ValueError(f"batch_inputs names {name!r}, which is no tensor input of forward {tuple(call.names)}")
        for n in named:
            value = values[n]
            if not isinstance(dim, int) or isinstance(dim, bool):
                raise ValueError(f"batch_inputs gives {name!r} the dim {dim!r}: a dim is an int")
            if isinstance(value, torch.Tensor) and not -value.dim() <= dim < value.dim():
                raise ValueError(f"batch_inputs gives {n!r} dim {dim}, but it is a tensor of {value.dim()} dims {list(value.shape)}")
            batch[n] = dim % value.dim() if isinstance(value, torch.Tensor) else dim
    return batch


def rows_per_token(names: Sequence[str], inputs: Sequence[Any], batch: dict[str, int]) -> dict[str, int]:
    """Graph input name -> the rows of its batch dim per token, for each input that has more
    than one (its size a multiple ``k > 1`` of the smallest batch input's)."""
    sizes = {n: v.shape[batch[n]] for n, v in zip(names, inputs) if n in batch and isinstance(v, torch.Tensor) and v.dim()}
    tokens = min(sizes.values(), default=0)
    if tokens == 0:
        return {}
    return {n: s // tokens for n, s in sizes.items() if s > tokens and s % tokens == 0}


def grown(names: Sequence[str], inputs: Sequence[Any], batch: dict[str, int], rows: dict[str, int]) -> tuple:
    """The call's inputs at one token more: each batch input with its first token's rows (one,
    or its ``rows`` per token) repeated once more along its batch dim."""
    return tuple(grow(v, batch[n], rows.get(n, 1)) if n in batch else v for n, v in zip(names, inputs))


def grow(value: Any, dim: int, rows: int = 1) -> Any:
    """``value`` with its first ``rows`` rows along ``dim`` repeated once more at the end."""
    index = torch.arange(rows, device=value.device)
    return torch.cat([value, value.index_select(dim, index)], dim=dim)


def held_inputs_hint(names: Sequence[str], inputs: Sequence[Any], batch: dict[str, int]) -> str:
    """For a trace that failed: the tensor inputs it held at their sizes whose dim 0 could
    follow the tokens at a multiple (``"; inputs held at their sizes: ..."``), or ""."""
    sizes = [v.shape[batch[n]] for n, v in zip(names, inputs) if n in batch and isinstance(v, torch.Tensor) and v.dim()]
    tokens = min(sizes, default=0)
    held = [
        f"{n} {list(v.shape)}"
        for n, v in zip(names, inputs)
        if n not in batch and isinstance(v, torch.Tensor) and v.dim() and tokens and v.shape[0] % tokens == 0
    ]
    if not held:
        return ""
    return (
        f"; inputs held at their sizes, as they follow no token count the example shows: {', '.join(held)} "
        "(one that follows the tokens is declared with batch_inputs={name: dim}, or --batch-input NAME=DIM)"
    )
