"""decode_attentions: the attention calls of a fused graph (``F.scaled_dot_product_attention``)
run on fuser's decode attention kernel at one query row (:mod:`fuser.install.decode_attention`),
PyTorch's at any other call.

Taken where the module runs on a CUDA GPU: each call is checked at run time (one query row, the
dtypes, the mask's kind and shape, no dropout, not causal) and runs PyTorch's where the kernel
does not take it, so a prefill through the same fused graph is PyTorch's attention. On the CPU
nothing changes (the kernel runs there only in Triton's interpreter).
"""

from __future__ import annotations

import torch.fx as fx

from fuser.install import decode_attention
from fuser.trace.attention_calls import SDPA


def decode_attentions(graph: fx.Graph, on_gpu: bool, pdl: bool = False) -> list[str]:
    """Rewrite each attention call of ``graph`` (in place) where ``on_gpu``, its kernel launched
    with programmatic dependent launch where ``pdl``; returns the calls rewritten, named."""
    if not on_gpu:
        return []
    done = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target in SDPA:
            node.target = decode_attention.launcher(pdl)
            done.append(node.name + (" (launched with PDL)" if pdl else ""))
    return done


def on_gpu(example_inputs) -> bool:
    """Does the module run on a CUDA GPU (its example call's tensors there)?"""
    return any(getattr(v, "device", None) is not None and v.device.type == "cuda" for v in example_inputs)
