"""joins: ``torch.cat`` along an axis that is neither the last nor the tokens', of parts one
wide along it (StableLM's per-head LayerNorm: ``cat([norm_h(x_h) for x_h in x.split(1, dim=1)],
dim=1)``, each head its own weights): part i is the result's slice i there, ``cat_units``. A
function of :func:`fuser.canon.views.cat`'s, taking the canonicaliser
(:class:`fuser.canon.canonicalize.Canonicalizer`) explicitly."""

from __future__ import annotations

import torch
import torch.fx as fx

from fuser.ir.canonical_op import COMPUTE, COp

#: Most parts a row program selects among (one select each).
MOST_PARTS = 64


def cat_of_units(cz, node: fx.Node, parts, dim) -> COp | None:
    """``cat_units(*parts, dim=d)`` when every part is one wide along ``d`` (not the last axis,
    not the tokens') and as the result elsewhere; None otherwise."""
    out = cz.value(node)
    if not isinstance(dim, int) or not out.dim() or not all(isinstance(p, fx.Node) for p in parts):
        return None
    d = dim % out.dim()
    if d == out.dim() - 1 or d in cz.batch_dims(node) or not 1 < len(parts) <= MOST_PARTS:
        return None
    for part in parts:
        value = cz.value(part)
        if not isinstance(value, torch.Tensor) or value.dim() != out.dim() or value.shape[d] != 1:
            return None
        if value.dtype != out.dtype or cz.batch_dims(part) != cz.batch_dims(node):
            return None
        if tuple(value.shape[:d]) + tuple(value.shape[d + 1 :]) != tuple(out.shape[:d]) + tuple(out.shape[d + 1 :]):
            return None
    return cz.make(node, "cat_units", COMPUTE, tuple(parts), {"dim": d})
