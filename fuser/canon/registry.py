"""registry: the canonical form of each op that has its own rule, by op name.

Most calls canonicalise by what the op table says of them (a pointwise op, a reduction: their
operands and parameters bound by name). An op with more than one spelling, parameters that
decide what it is, or a result in parts has a function of its own, registered under the name
it is called by beside the others of its family (:mod:`fuser.canon.views`,
:mod:`fuser.canon.ops`)::

    @canonical("layer_norm")
    def layer_norm(cz, node):
        ...  # a COp, made with cz.make

A rule takes the canonicaliser (:class:`fuser.canon.canonicalize.Canonicalizer`: the traced
graph, the COps so far, ``make`` and ``params``) explicitly. The canonicaliser asks at three
points, one table each:

* ``several=True`` (:data:`SEVERAL`): a call that returns several tensors (``torch.topk``,
  ``torch.max(x, dim)``, ``torch.sort``), read through its parts;
* ``any_dtype=True`` (:data:`ANY_DTYPE`): an op read whatever its dtype (``histc``, ``cumsum``:
  integer counts that only a hand-written template reads), asked before the dtype is checked;
* otherwise (:data:`TENSOR`): a tensor of a dtype kernels compute, asked after views, casts and
  in-place calls are told apart, and under the table's name for the call (``torch.multiply`` is
  asked as ``mul``).
"""

from __future__ import annotations

from typing import Callable

#: op name -> its rule, for a call that returns several tensors
SEVERAL: dict[str, Callable] = {}
#: op name -> its rule, for a call read whatever its result's dtype
ANY_DTYPE: dict[str, Callable] = {}
#: op name -> its rule, for a call that returns one tensor of a dtype kernels compute
TENSOR: dict[str, Callable] = {}


def canonical(*names: str, several: bool = False, any_dtype: bool = False):
    """Register the decorated function as the canonical form of the calls named ``names``."""
    table = SEVERAL if several else ANY_DTYPE if any_dtype else TENSOR

    def register(fn: Callable) -> Callable:
        for name in names:
            if name in table:
                raise ValueError(f"two canonical forms of {name!r}: {table[name].__module__} and {fn.__module__}")
            table[name] = fn
        return fn

    return register
