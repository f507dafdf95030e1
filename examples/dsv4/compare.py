"""Comparing a DSv4 layer's output with a reference's when routing may differ by a near-tie.

A token whose top-k expert set differs between the two runs (a near-tie in the router flipped
by a one-ulp difference upstream: a fused kernel, another all-reduce order) legitimately gets
another output; every other token must match within the whole-layer tolerance
(``fuser.validate.tolerance.LAYER``). Used by ``benchmarks/capture_dsv4.py``, ``benchmarks/tp_dsv4.py``
and ``tests/serving/test_tp.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fuser.validate.tolerance import LAYER, mismatch


def run_with_expert_ids(module, inputs):
    """The module's output and the top-k expert ids its experts leaf received (eager call)."""
    seen = {}

    def record(_, args):
        seen["ids"] = args[2].clone()  # (x, topk_weights, topk_ids); returns None: args unchanged

    hook = module.mlp.experts.register_forward_pre_hook(record)
    try:
        with torch.no_grad():
            out = module(*inputs)
    finally:
        hook.remove()
    return out, seen["ids"]


def layer_errors(actual: torch.Tensor, expected: torch.Tensor) -> dict:
    """The two quantities ``LAYER`` bounds: |a - e| / |e| and max |a - e| / max |e|."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if e.numel() == 0:
        return {"normwise": 0.0, "max": 0.0}
    diff = a - e
    return {
        "normwise": (diff.norm() / e.norm().clamp_min(1e-30)).item(),
        "max": (diff.abs().max() / e.abs().max().clamp_min(1e-30)).item(),
    }


@dataclass
class Comparison:
    ok: bool
    #: what a results file records: "matches <reference>", or the flipped tokens and both verdicts
    entry: str | dict
    #: layer_errors over the tokens whose expert set agrees (all tokens when the output matches)
    errors: dict


def compare_routed(
    output: torch.Tensor,
    expected: torch.Tensor,
    expected_ids: torch.Tensor,
    output_ids: torch.Tensor | Callable[[], torch.Tensor],
    what: str,
    reference: str = "eager",
) -> Comparison:
    """``output`` against ``expected`` within ``LAYER``, forgiving tokens routed elsewhere.

    ``output_ids`` (the expert ids the output's run chose, or a function that computes them) is
    only looked at when the whole output does not match.
    """
    problem = mismatch(output, expected, what, LAYER)
    if problem is None:
        return Comparison(True, f"matches {reference}", layer_errors(output, expected))
    ids = output_ids() if callable(output_ids) else output_ids
    tokens = range(output.shape[0])
    flipped = [t for t in tokens if set(ids[t].tolist()) != set(expected_ids[t].tolist())]
    keep = [t for t in tokens if t not in flipped]
    rest = mismatch(output[keep], expected[keep], f"{what} without flipped tokens", LAYER)
    entry = {"tokens_with_another_expert_set": flipped, "other_tokens": rest or f"match {reference}", "all": problem}
    return Comparison(rest is None, entry, layer_errors(output[keep], expected[keep]))
