"""warps: how many warps a row program's block wants, by its size and what it does; the
launch tables (:mod:`fuser.codegen.launch_config`) override it per kernel where a GPU was tuned."""

from __future__ import annotations

from fuser.lower.tiling import pow2

# Ops that move values between lanes: pairs interleaved along the last axis.
_INTERLEAVING = {"stack", "repeat_interleave"}
_PAIRED = {"view_as_complex", "view_as_real"}


def elements_per_warp(reducing: bool, tiled: bool, leading: bool, op_names: set[str]) -> int:
    """Elements of a block one warp takes.

    Fitted to every kernel of the zoo and the DSv4 example timed at 1-16 warps on an H200
    (``benchmarks/tune_zoo.py``, ``fuser tune``; benchmarks/results/launch_heuristic.md has the
    check): a block wants about 8 elements a thread (2048 elements: 8 warps), reductions along
    the row included. Three kinds want one warp per 2048 elements, and lose up to 5x with 8:
    a reduction inside a column tile across a short axis (the sum over the top-k experts of
    ``[k, tile]``, the mHC streams); values interleaved along the last axis (``stack`` then
    flatten, ``repeat_interleave``: the DSv4 RoPE); a per-head reduction (a tile of heads)
    that also splits complex pairs.
    """
    slow = (reducing and tiled and not leading) or bool(op_names & _INTERLEAVING) or (reducing and leading and bool(op_names & _PAIRED))
    return 2048 if slow else 256


def warps_for(numel: int, per_warp: int) -> int:
    """``numel`` elements at ``per_warp`` a warp, in a power of two of warps. Never more than 8:
    no kernel measured wanted 16 by more than a few percent, and some lost a quarter with it."""
    return min(8, max(1, pow2(numel // per_warp)))
