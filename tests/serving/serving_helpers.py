"""Helpers for the tests of fuser.serving.lazy_fusion's lazy fusion (plain and in the sglang scenarios,
which put this folder on sys.path)."""

from __future__ import annotations

import contextlib

from fuser.serving import lazy_fusion as serving
from fuser.install.splice import STATE_ATTR


@contextlib.contextmanager
def decode_mode():
    """Inside the block the serving mode is set, as a layer's splice sets it for a call it
    accepts (sglang: ``forward_batch.forward_mode.is_decode()``)."""
    serving._MODE.depth = getattr(serving._MODE, "depth", 0) + 1
    try:
        yield
    finally:
        serving._MODE.depth -= 1


class FusedGraphRuns:
    """Counts the runs of a fused target's fused graph (``count``), not of its guarded forward,
    which may still run the module's own code."""

    def __init__(self, target: serving.LazyFusion):
        self.count = 0
        state = target.fused_module.__dict__[STATE_ATTR]
        graph = state.fused

        def fused(module, *args):
            self.count += 1
            return graph(module, *args)

        state.fused = fused
