"""copies: the copies PyTorch must make, run as fuser's copy kernel.

A reshape of a view that no view fits copies (a permuted einsum result flattened;
transformers' ``repeat_kv``, ``k[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)``,
where the attention that reads it cannot take the un-repeated heads: see
:mod:`fuser.trace.attention_calls`). No other glue shares its kernel. Eager runs it as PyTorch's generic strided copy; fuser
runs its own (``templates/strided_copy.py.jinja``), which knows the view's sizes, checked
bit for bit against the eager copy at apply time. The launch count stays the same.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.fx as fx

from fuser.codegen.emit import KernelSpec, emit
from fuser.lower.row_program import operand
from fuser.ir.report import FusedChain, Report
from fuser.trace.tracing import Traced

TEMPLATE = "strided_copy"


@dataclass
class Copy:
    node: fx.Node  # the reshape that copies
    source: fx.Node  # the view it copies
    path: Path
    launch: Callable


def copy_kernels(traced: Traced, cops: dict, left: set[fx.Node]) -> tuple[list[Copy], dict[fx.Node, str]]:
    """A copy kernel for each reshape of ``left`` (the glue left eager) that must copy a
    view with the token rows first; and why the others keep PyTorch's copy."""
    found, kept = [], {}
    for node in traced.graph.nodes:
        cop = cops.get(node)
        if cop is None or cop.op != "reshape_copy" or node not in left:
            continue
        source = cop.args[0]
        x, y = traced.value(source), traced.value(node)
        if traced.batch_dims(source) != (0,) or traced.batch_dims(node) != (0,) or x.dim() < 2 or x.is_complex():
            continue  # rows elsewhere or none: PyTorch's copy
        spec = KernelSpec(TEMPLATE, "copy", [operand(traced, source, "x")], [operand(traced, node, "out")])
        path, launch = emit(spec)
        try:
            (got,) = launch(x)
            same = got.shape == y.shape and torch.equal(got, y)
        except Exception as e:  # noqa: BLE001 - reported; PyTorch's copy stays
            kept[node] = f"the copy kernel failed ({type(e).__name__}: {e}): runs as PyTorch's copy"
            continue
        if not same:
            kept[node] = "the copy kernel disagreed with PyTorch's copy: runs as that copy"
            continue
        found.append(Copy(node, source, path, launch))
    return found, kept


def install_copies(graph: fx.Graph, copies: list[Copy]) -> None:
    """Make each copying reshape of ``graph`` (the fused graph, where it kept its name) a call
    of its copy kernel."""
    by_name = {c.node.name: c for c in copies}
    for node in list(graph.nodes):
        found = by_name.get(node.name)
        if found is None or node.op != found.node.op or node.target != found.node.target:
            continue
        with graph.inserting_before(node):
            out = graph.call_function(operator.getitem, (graph.call_function(found.launch, (node.args[0],)), 0))
        node.replace_all_uses_with(out)
        graph.erase_node(node)


def report_copies(report: Report, copies: list[Copy]) -> None:
    """List each copy kernel among the chains (one launch for one: the copy PyTorch made)."""
    names = {c.node.name for c in copies}
    report.unfused = [u for u in report.unfused if u.node not in names]
    for c in copies:
        report.chains.append(
            FusedChain(kernel=c.path.stem, path=str(c.path), template=TEMPLATE, pattern="copy", params={},
                       nodes=[c.node.name], inputs=[c.source.name], outputs=[c.node.name], launches_replaced=1)
        )  # fmt: skip
