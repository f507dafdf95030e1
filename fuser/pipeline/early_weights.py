"""early_weights: a GEMM on the decode GEMM kernel, launched with programmatic dependent launch,
reads its first chunk of the weight before it waits for the kernel before it, where that kernel
is one of the same forward (:mod:`fuser.install.decode_gemm`, ``Config.early``).

At one token row a decode GEMM's time is its weight's read, and with PDL the kernel is resident
while the kernel before it ends: reading its weight then, not after the wait, overlaps that end.
A GPU launches a kernel early only once the kernel before has passed its own wait, so every
earlier kernel has finished and its writes are seen: only the kernel just before can still be
writing. The read is early where that kernel surely launches and is the same forward's (one of
fuser's kernels, a GEMM, an attention call), and no op of the forward writes a module attribute
in place. A GEMM whose kernel comes first in the forward is left waiting: the kernel before it
is the caller's, which may have just written the weight (``weight.copy_(...)``, a merged weight
re-derived).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fuser.install import decode_gemm
from fuser.install.fused_graph import REGION_META
from fuser.pipeline import residual_in_gemm

#: ``x += y`` and the like, as traced.
IN_PLACE_OPERATORS = (operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ipow, operator.iand, operator.ior)
#: Call targets that always launch a kernel (never a view or a no-op).
ALWAYS_LAUNCH = (F.linear, F.scaled_dot_product_attention, residual_in_gemm.accumulate)


def early_weights(graph: fx.Graph, module: nn.Module, unsure: tuple = ()) -> tuple[list[str], dict[str, str]]:
    """Rewrite each GEMM of ``graph`` on the decode GEMM kernel with PDL whose kernel follows one
    of the same forward to read its first chunk of weight early (in place); returns the GEMMs
    rewritten, and those left waiting -> why. ``unsure``: the regions of fuser's kernels that a
    call may not launch (run once per model forward, or handed over by the layer before)."""
    gemms = [n for n in graph.nodes if n.op == "call_function" and (launch := decode_gemm.launch_of(n.target)) and launch[0].pdl]
    written = [n.name for n in graph.nodes if writes_an_attribute(n)]
    if written:
        return [], {weight_name(n): f"the forward writes a module attribute in place ({', '.join(written)})" for n in gemms}
    done, waiting, launched = [], {}, False
    for node in graph.nodes:
        if node in gemms:
            if launched:
                config, remake = decode_gemm.launch_of(node.target)
                node.target = remake(dataclasses.replace(config, early=True))
                done.append(weight_name(node))
            else:
                waiting[weight_name(node)] = "the forward's first kernel (the one before it is the caller's)"
        launched = launched or launches(node, module, unsure)
    graph.lint()
    return done, waiting


def weight_name(gemm: fx.Node) -> str:
    """The GEMM named by its weight (every launcher's last argument): ``self_attn.o_proj``,
    ``merged_mlp_gate_proj``."""
    weight = gemm.args[-1]
    if not (isinstance(weight, fx.Node) and weight.op == "get_attr"):
        return gemm.name
    return weight.target.removesuffix(".weight").removeprefix("_fuser_").removesuffix("_weight")


def launches(node: fx.Node, module: nn.Module, unsure: tuple = ()) -> bool:
    """Does ``node`` surely launch a kernel on the GPU (a view, a no-op cast, a Python value, an
    unknown module or a kernel of ``unsure`` never counts)?"""
    if REGION_META in node.meta:  # one of fuser's kernels
        return not any(node.meta[REGION_META] is region for region in unsure)
    if node.op == "call_module":
        return type(module.get_submodule(node.target)) is nn.Linear
    if node.op != "call_function":
        return False
    target = node.target
    return decode_gemm.launch_of(target) is not None or hasattr(target, "decode_attention_pdl") or target in ALWAYS_LAUNCH


def writes_an_attribute(node: fx.Node) -> bool:
    """Is ``node`` an in-place op (``x.add_(...)``, ``torch.ops.aten.copy_``) on a module attribute?"""
    if node.op not in ("call_method", "call_function") or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if isinstance(node.target, torch._ops.OpOverload):
        name = node.target._schema.name.rpartition("::")[2]
    in_place = (name.endswith("_") and not name.endswith("__")) or node.target in IN_PLACE_OPERATORS
    return in_place and node.args[0].op == "get_attr"
