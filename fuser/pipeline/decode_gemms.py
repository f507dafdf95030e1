"""decode_gemms: the linear layers of a fused graph whose weight shape the decode-GEMM table holds
run on fuser's decode GEMM kernel at decode sizes (:mod:`fuser.install.decode_gemm`), PyTorch's
GEMM otherwise (more rows than the table's ``up_to``, another dtype at run time).

Taken: exactly ``torch.nn.Linear`` without a bias or hooks; a merged projection's GEMM
(:mod:`fuser.pipeline.merged_projections`); a GEMM that adds the residual
(:mod:`fuser.pipeline.residual_in_gemm`), which the kernel adds in its epilogue. Every weight is
read from the module at each call, as before. With no table for the GPU (the default, and any
CPU) nothing changes.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.fx as fx
import torch.nn as nn

from fuser.install import decode_gemm
from fuser.install.decode_gemm import Config
from fuser.install.merged_weights import MergedWeights
from fuser.pipeline import residual_in_gemm
from fuser.pipeline.residual_in_gemm import plain_linear


@functools.lru_cache(maxsize=None)
def accumulate_with(config: Config):
    """:func:`fuser.pipeline.residual_in_gemm.accumulate`, by the kernel where it takes the call."""

    def accumulate_by_kernel(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if decode_gemm.takes(x, weight, config):
            return decode_gemm.linear(x, weight, config, residual)
        return residual_in_gemm.accumulate(residual, x, weight)

    accumulate_by_kernel.decode_gemm_launch = (config, accumulate_with)
    return accumulate_by_kernel


def decode_gemms(graph: fx.Graph, module: nn.Module, merged: MergedWeights | None, pdl: bool = False) -> tuple[list[tuple[str, str]], list[str], list[str]]:
    """Rewrite each GEMM of ``graph`` the table holds (in place), its kernel launched with
    programmatic dependent launch at one row where ``pdl``; returns (what, the shape and the
    token counts) per GEMM rewritten, the linear layers no longer called as modules, and the
    shapes (``NxK dtype``) of the GEMMs on a CUDA GPU the table does not hold."""
    widths = {g.weight: sum(module.get_submodule(layer).weight.shape[0] for layer in g.layers) for g in (merged.groups if merged else ())}
    firsts = {g.weight: module.get_submodule(g.layers[0]).weight for g in (merged.groups if merged else ())}
    done, uncalled, untimed = [], [], []

    def config(n: int, k: int, weight: torch.Tensor) -> Config | None:
        found = _config(n, k, weight, pdl)
        shape = f"{n}x{k} {str(weight.dtype).removeprefix('torch.')}"
        if found is None and on_gpu(weight) and shape not in untimed:
            untimed.append(shape)
        return found

    for node in list(graph.nodes):
        if node.op == "call_module" and plain_linear(node, module):
            weight = module.get_submodule(node.target).weight
            found = config(weight.shape[0], weight.shape[1], weight)
            if found is not None:
                with graph.inserting_before(node):
                    w = graph.get_attr(f"{node.target}.weight")
                    call = graph.call_function(decode_gemm.launcher(found), (node.args[0], w))
                node.replace_all_uses_with(call)
                graph.erase_node(node)
                done.append((node.target, _said(weight.shape[0], weight.shape[1], weight.dtype, found)))
                uncalled.append(node.target)
        elif _merged_gemm(node, widths):
            first = firsts[node.args[1].target]
            found = config(widths[node.args[1].target], first.shape[1], first)
            if found is not None:
                node.target, node.args = decode_gemm.launcher(found), node.args[:2]
                done.append((node.name, _said(widths[node.args[1].target], first.shape[1], first.dtype, found)))
        elif node.op == "call_function" and node.target is residual_in_gemm.accumulate:
            weight = module.get_submodule(node.args[2].target.rpartition(".")[0]).weight
            found = config(weight.shape[0], weight.shape[1], weight)
            if found is not None:
                node.target = accumulate_with(found)
                done.append((f"{node.args[2].target.rpartition('.')[0]} (adding the residual)", _said(weight.shape[0], weight.shape[1], weight.dtype, found)))
    graph.lint()
    return done, uncalled, untimed


def _merged_gemm(node: fx.Node, widths: dict) -> bool:
    if node.op != "call_function" or node.target is not torch.nn.functional.linear or len(node.args) < 2:
        return False
    weight, bias = node.args[1], (node.args[2] if len(node.args) > 2 else None)
    return isinstance(weight, fx.Node) and weight.op == "get_attr" and weight.target in widths and bias is None and not node.kwargs


def on_gpu(weight: torch.Tensor) -> bool:
    """Is ``weight`` where a decode-GEMM table could say fuser's kernel is the faster?"""
    return weight.device.type == "cuda"


def _config(n: int, k: int, weight: torch.Tensor, pdl: bool) -> Config | None:
    if weight.device.type == "meta":
        return None
    config = decode_gemm.config_for(n, k, weight.dtype)
    return None if config is None else dataclasses.replace(config, pdl=pdl)


def _said(n: int, k: int, dtype: torch.dtype, config: Config) -> str:
    pdl = ", launched with PDL at 1" if config.pdl else ""
    return f"{n}×{k} {str(dtype).removeprefix('torch.')}: fuser's kernel up to {config.up_to} tokens{pdl}"
