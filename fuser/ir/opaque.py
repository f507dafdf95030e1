"""Marking code that fuser must keep as an opaque call (a *leaf*).

A leaf is traced as one node that calls the original code at run time: its inside is
never looked at, matched or rewritten. GEMMs, attention, experts, collectives and any
kernel the model launches itself belong here.
"""

_MARK = "__fuser_opaque__"


def opaque(obj):
    """Mark an ``nn.Module`` subclass or a function as an opaque leaf.

    Use it as a decorator::

        @fuser.opaque
        class Experts(nn.Module): ...

        @fuser.opaque
        def paged_attention(q, cache, loc): ...
    """
    setattr(obj, _MARK, True)
    return obj


def is_opaque(obj) -> bool:
    return bool(getattr(obj, _MARK, False))
