"""upcast_in_gemm: a matmul of two half-precision tensors, each cast to fp32 for it, runs as the
half GEMM with an fp32 output.

GPT-J's eager attention casts its query and its whole key cache to fp32 before the scores'
matmul (``torch.matmul(query.to(torch.float32), key.to(torch.float32).transpose(-1, -2))``): at
32 sequences of a 352-token static cache that cast writes [32, 16, 352, 256] fp32 elements a
layer, and PyTorch's copy kernel takes 561.7 µs of a 4-layer decode step on an H100
(``benchmarks/results/README.md``). A product of two bf16 (or two fp16) numbers is exact in
fp32, so the half GEMM that accumulates in fp32 and writes fp32 (cuBLAS, ``torch.bmm(...,
out_dtype=torch.float32)``) computes what the fp32 GEMM of the cast operands does, up to the
order of its sums: no cast, no fp32 copy, the half operands read once.

Only where each cast's output is read by the matmul alone (through views, which are made of the
half tensor instead: a cast and a view commute), both casts from one half dtype to fp32 on one
device — an operand whose cast a kernel computes with other glue (GPT-J's query, cast at the end
of its rotary kernel) holds half values exactly, and is cast back to the half dtype, a tiny
launch where the key cache's copy was a large one — and on CUDA only where this PyTorch's ``bmm`` takes ``out_dtype`` (tried once per device,
at apply). On the CPU, where ``out_dtype`` has no kernel, :func:`matmul_upcast` casts as eager
does: the rewrite is checked there, its gain is the GPU's.
"""

from __future__ import annotations

import functools
import operator

import torch
import torch.fx as fx

from fuser.install.fused_graph import REGION_META
from fuser.trace.tracing import Traced

_HALF = (torch.float16, torch.bfloat16)
_VIEWS = ("transpose", "permute", "unsqueeze", "view", "reshape", "expand")


def matmul_upcast(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.matmul(a.float(), b.float())`` for ``a`` and ``b`` of one half dtype: on CUDA one
    half GEMM with an fp32 output, batched over the broadcast leading dims."""
    if a.device.type != "cuda" or a.dim() < 2 or b.dim() < 2:
        return torch.matmul(a.float(), b.float())
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = a.expand(*batch, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b3 = b.expand(*batch, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    return torch.bmm(a3, b3, out_dtype=torch.float32).view(*batch, a.shape[-2], b.shape[-1])


@functools.cache
def takes_out_dtype(device: torch.device) -> bool:
    """Does this PyTorch's ``bmm`` on ``device`` take a bf16 pair with an fp32 output?"""
    try:
        x = torch.ones(1, 2, 2, dtype=torch.bfloat16, device=device)
        return torch.bmm(x, x, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def upcasts_in_gemm(graph: fx.Graph, traced: Traced) -> tuple[list[str], dict[str, str], int]:
    """Rewrite every such matmul of the fused ``graph`` in place; returns the matmuls rewritten
    (``"matmul (getitem_16, getitem_18: bfloat16)"``), those of fp32 casts left as they are with
    why, and how many kernel outputs are cast back (a launch each)."""
    traced_nodes = {n.name: n for n in traced.graph.nodes}

    def traced_node(node: fx.Node) -> fx.Node | None:
        """The traced node the fused graph's ``node`` is a copy of (same name, same op)."""
        found = traced_nodes.get(node.name)
        return found if found is not None and (found.op, found.target) == (node.op, node.target) else None

    done, apart, casts_back = [], {}, 0
    for mm in list(graph.nodes):
        if not (mm.op == "call_function" and mm.target in (torch.matmul, torch.bmm) and len(mm.args) == 2 and not mm.kwargs):
            continue
        operands = [_upcast(arg, traced_node, traced) for arg in mm.args]
        if not any(o is not None and o.cast is not None for o in operands):
            continue  # no cast to fp32 of its own: nothing to save
        why = _why_not(operands)
        if why:
            apart[mm.name] = why
            continue
        with graph.inserting_before(mm):
            halves = [o.replayed(graph) for o in operands]
            fused = graph.call_function(matmul_upcast, tuple(halves))
        mm.replace_all_uses_with(fused)
        graph.erase_node(mm)
        for o in operands:
            o.erase(graph)
        back = [o.source.name for o in operands if o.cast is None]
        casts_back += len(back)
        done.append(f"{mm.name} ({', '.join(o.source.name for o in operands)}: {str(operands[0].dtype).removeprefix('torch.')}"
                    + (f"; {', '.join(back)} cast back to it, exactly: a launch" if back else "") + ")")
    graph.lint()
    return done, apart, casts_back


class _Upcast:
    """An fp32 operand that is a half tensor exactly: ``cast`` of ``source`` (a cast to fp32 in
    the fused graph), or a kernel's output that the traced graph computed as such a cast
    (``cast`` None: its values are half values, cast back exactly), through ``views``."""

    def __init__(self, source: fx.Node, cast: fx.Node | None, views: list[fx.Node], value: torch.Tensor):
        self.source, self.cast, self.views = source, cast, views
        self.dtype, self.device, self.numel = value.dtype, value.device, value.numel()

    def replayed(self, graph: fx.Graph) -> fx.Node:
        """The half tensor, viewed as the matmul read it."""
        node = self.source if self.cast is not None else graph.call_method("to", (self.source, self.dtype))
        for view in self.views:
            node = graph.call_method(view.target, (node, *view.args[1:]), dict(view.kwargs))
        return node

    def erase(self, graph: fx.Graph) -> None:
        for node in [*reversed(self.views), *([self.cast] if self.cast is not None else [])]:
            graph.erase_node(node)


def _upcast(node, traced_node, traced: Traced) -> _Upcast | None:
    """``node`` (a matmul operand) as an :class:`_Upcast`, each node between it and the half
    value read by the next alone; None otherwise."""
    views = []
    while isinstance(node, fx.Node) and node.op == "call_method" and node.target in _VIEWS:
        views.append(node)
        node = node.args[0]
    views.reverse()
    if not isinstance(node, fx.Node) or any(len(n.users) != 1 for n in views):
        return None
    cast = traced_node(node)
    if cast is not None and _is_fp32_cast(cast, traced) and len(node.users) == 1:
        return _Upcast(node.args[0], node, views, traced.value(cast.args[0]))
    cast = _kernel_output(node)
    if cast is not None and _is_fp32_cast(cast, traced):
        return _Upcast(node, None, views, traced.value(cast.args[0]))
    return None


def _kernel_output(node: fx.Node) -> fx.Node | None:
    """The traced node a fused kernel's output in the fused graph stands for."""
    if node.op != "call_function" or node.target is not operator.getitem or not isinstance(node.args[0], fx.Node):
        return None
    region = node.args[0].meta.get(REGION_META)
    index = node.args[1]
    return region.outputs[index] if region is not None and isinstance(index, int) and index < len(region.outputs) else None


def _is_fp32_cast(node: fx.Node, traced: Traced) -> bool:
    """Is the traced ``node`` a cast of a tensor to fp32 on its device?"""
    if node.op != "call_method" or not isinstance(node.args[0], fx.Node) or node.kwargs:
        return False
    spelled = node.target == "float" and len(node.args) == 1 or node.target == "to" and node.args[1:] == (torch.float32,)
    if not spelled:
        return False
    out, src = traced.value(node), traced.value(node.args[0])
    return (isinstance(out, torch.Tensor) and isinstance(src, torch.Tensor) and out.dtype == torch.float32
            and src.dtype != torch.float32 and out.device == src.device)  # fmt: skip


def _why_not(operands: list[_Upcast | None]) -> str | None:
    if not all(operands):
        return "one operand is not a half tensor cast to fp32 for the matmul alone"
    dtypes = {o.dtype for o in operands}
    if len(dtypes) != 1 or next(iter(dtypes)) not in _HALF:
        return f"the casts are from {sorted(str(d).removeprefix('torch.') for d in dtypes)}, not one half dtype"
    back = sum(o.numel for o in operands if o.cast is None)
    if back > sum(o.numel for o in operands if o.cast is not None):
        return "casting a kernel's fp32 output back to half would copy more than the casts it saves"
    device = operands[0].device
    if device.type == "cuda" and not takes_out_dtype(device):
        return "this PyTorch's bmm takes no out_dtype on this GPU"
    return None
