"""ops: the canonical form of ops with more than one spelling or a result in parts: top-k,
GELU, hardtanh and the activations with a slope, the shrinks, threshold, lerp, addcmul / addcdiv, masked_fill, layer_norm, rms_norm, max/min along a dim, sort, histc, cumsum, stack,
repeat_interleave, repeat, pad, p-norms and F.normalize, index_add, and constants. Each function takes the canonicaliser
(:class:`fuser.canon.canonicalize.Canonicalizer`) explicitly and is registered under the op
name it canonicalises (:mod:`fuser.canon.registry`)."""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from fuser.canon.registry import canonical
from fuser.ir.canonical_op import COMPUTE, CONSTANTS, KERNEL_DTYPES, META, UNSUPPORTED, bound_args, op_name, tensor_args, writes_into


@canonical("topk", several=True)
def topk(cz, node):
    """``torch.topk`` along a (non-token) last axis, k a constant: one kernel in eager, a
    k-step selection in a row program. ``.values`` and ``.indices`` are free picks of it."""
    params = bound_args(node, ("input", "k", "dim", "largest", "sorted"))
    x, k, dim = params.get("input"), params.get("k"), params.get("dim", -1)
    src = cz.value(x) if isinstance(x, fx.Node) else None
    if (
        not isinstance(src, torch.Tensor) or not src.dim() or not isinstance(k, int) or not isinstance(dim, int)
        or src.dtype not in (torch.float32, torch.bfloat16, torch.float16)
        or dim % src.dim() != src.dim() - 1 or src.dim() - 1 in cz.batch_dims(x)
    ):  # fmt: skip
        return cz.make(node, "topk", UNSUPPORTED, tensor_args(node))
    attrs = {"k": k, "largest": bool(params.get("largest", True)), "sorted": bool(params.get("sorted", True))}
    return cz.make(node, "topk", COMPUTE, (x,), attrs)


@canonical("gelu")
def gelu(cz, node):
    approximate = cz.params(node, "gelu").get("approximate", "none")
    op = {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate)
    if op is None:
        return cz.make(node, f"gelu[{approximate}]", UNSUPPORTED, tensor_args(node))
    return cz.make(node, op, COMPUTE, (node.args[0],))


@canonical("hardtanh", "relu6")
def hardtanh(cz, node):
    """``F.hardtanh(x, min_val, max_val)`` and ``F.relu6`` (its 0 and 6): a clamp."""
    params = bound_args(node, ("input", "min_val", "max_val", "inplace"))
    low, high = (0.0, 6.0) if op_name(node) == "relu6" else (params.get("min_val", -1.0), params.get("max_val", 1.0))
    if params.get("inplace") or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in (low, high)):
        return cz.make(node, op_name(node), UNSUPPORTED, tensor_args(node))
    return cz.make(node, "clamp", COMPUTE, (node.args[0], float(low), float(high)))


@canonical("leaky_relu", "elu", "celu", "selu")
def with_slope(cz, node):
    """``F.leaky_relu(x, slope)``, ``F.elu(x, alpha)``, ``F.celu(x, alpha)`` (ELU of x / alpha),
    ``F.selu(x)``; in place, they stay eager."""
    name = op_name(node)
    second = {"leaky_relu": "negative_slope", "elu": "alpha", "celu": "alpha", "selu": "inplace"}[name]
    params = bound_args(node, ("input", second, "inplace"))
    if params.get("inplace"):
        return cz.make(node, name, UNSUPPORTED, tensor_args(node))
    if name == "selu":
        return cz.make(node, "selu", COMPUTE, (node.args[0],))
    value = params.get(second, 0.01 if name == "leaky_relu" else 1.0)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or (name == "celu" and value == 0):
        return cz.make(node, name, UNSUPPORTED, tensor_args(node))
    if name == "leaky_relu":
        return cz.make(node, "leaky_relu", COMPUTE, (node.args[0], float(value)))
    return cz.make(node, "elu", COMPUTE, (node.args[0], float(value), 1.0 / value if name == "celu" else 1.0))


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@canonical("hardshrink", "softshrink")
def shrink(cz, node):
    """``F.hardshrink(x, lambd)`` and ``F.softshrink(x, lambd)`` (lambd 0.5 by default)."""
    name = op_name(node)
    lambd = bound_args(node, ("input", "lambd")).get("lambd", 0.5)
    if not _number(lambd):
        return cz.make(node, name, UNSUPPORTED, tensor_args(node))
    return cz.make(node, name, COMPUTE, (node.args[0], float(lambd)))


@canonical("threshold", "_threshold")
def threshold(cz, node):
    """``F.threshold(x, threshold, value)``: x where above the threshold, else the value."""
    params = bound_args(node, ("input", "threshold", "value", "inplace"))
    bound, value = params.get("threshold"), params.get("value")
    if params.get("inplace") or not _number(bound) or not _number(value):
        return cz.make(node, "threshold", UNSUPPORTED, tensor_args(node))
    return cz.make(node, "threshold", COMPUTE, (node.args[0], float(bound), float(value)))


@canonical("lerp")
def lerp(cz, node):
    """``torch.lerp(start, end, weight)``, the weight a number or a tensor."""
    params = bound_args(node, ("input", "end", "weight"))
    start, end, weight = params.get("input"), params.get("end"), params.get("weight")
    if not isinstance(start, fx.Node) or not isinstance(end, fx.Node) or not (isinstance(weight, fx.Node) or _number(weight)):
        return cz.make(node, "lerp", UNSUPPORTED, tensor_args(node))
    return cz.make(node, "lerp", COMPUTE, (start, end, weight if isinstance(weight, fx.Node) else float(weight)))


@canonical("addcmul", "addcdiv")
def add_product(cz, node):
    """``torch.addcmul(x, a, b, value=v)`` (x + v·a·b) and ``addcdiv`` (x + v·a/b)."""
    name = op_name(node)
    params = bound_args(node, ("input", "tensor1", "tensor2"))
    x, a, b, value = params.get("input"), params.get("tensor1"), params.get("tensor2"), params.get("value", 1)
    if not all(isinstance(t, fx.Node) for t in (x, a, b)) or not _number(value):
        return cz.make(node, name, UNSUPPORTED, tensor_args(node))
    return cz.make(node, name, COMPUTE, (x, a, b, float(value)))


@canonical("round")
def round_(cz, node):
    """``torch.round(x)``: half to even; with ``decimals`` other than 0 it stays eager."""
    decimals = cz.params(node, "round").get("decimals", 0)
    if decimals != 0:
        return cz.make(node, "round[decimals]", UNSUPPORTED, tensor_args(node))
    return cz.make(node, "round", COMPUTE, (node.args[0],))


@canonical("masked_fill")
def masked_fill(cz, node):
    """``x.masked_fill(mask, value)`` is ``where(mask, value, x)``."""
    params = cz.params(node, "masked_fill")
    mask, value = params.get("mask"), params.get("value")
    if not isinstance(mask, fx.Node) or not isinstance(value, (int, float, bool)):
        return cz.make(node, "masked_fill", UNSUPPORTED, tensor_args(node))
    return cz.make(node, "where", COMPUTE, (mask, value, node.args[0]))


@canonical("layer_norm")
def layer_norm(cz, node):
    """``F.layer_norm(x, (n,), weight, bias, eps)`` over the last (non-token) axis."""
    params = cz.params(node, "layer_norm")
    x, shape = node.args[0], params.get("normalized_shape")
    weight, bias, eps = params.get("weight"), params.get("bias"), params.get("eps", 1e-5)
    rank = cz.value(x).dim()
    if (
        not isinstance(shape, (tuple, list, torch.Size)) or len(shape) != 1 or rank - 1 in cz.batch_dims(x)
        or not all(w is None or isinstance(w, fx.Node) for w in (weight, bias)) or not isinstance(eps, (int, float))
    ):  # fmt: skip
        return cz.make(node, "layer_norm", UNSUPPORTED, tensor_args(node))
    return cz.make(node, "layer_norm", COMPUTE, (x, weight, bias), {"dim": (rank - 1,), "eps": float(eps)})


@canonical("rms_norm")
def rms_norm(cz, node):
    """``F.rms_norm(x, (n,), weight, eps)`` (``nn.RMSNorm``) over the last (non-token) axis, as
    PyTorch's fused path computes it: in fp32, times the weight, rounded once; eps None is
    fp32's machine epsilon. A weight of another dtype takes PyTorch's other path: not fused."""
    params = cz.params(node, "rms_norm")
    x, shape = node.args[0], params.get("normalized_shape")
    weight, eps = params.get("weight"), params.get("eps")
    rank = cz.value(x).dim()
    if eps is None:
        eps = torch.finfo(torch.float32).eps
    if (
        not isinstance(shape, (tuple, list, torch.Size)) or len(shape) != 1 or rank - 1 in cz.batch_dims(x)
        or not (weight is None or isinstance(weight, fx.Node)) or not isinstance(eps, (int, float))
        or (weight is not None and cz.value(weight).dtype != cz.value(x).dtype)
    ):  # fmt: skip
        return cz.make(node, "rms_norm", UNSUPPORTED, tensor_args(node))
    return cz.make(node, "rms_norm", COMPUTE, (x, weight), {"dim": (rank - 1,), "eps": float(eps)})


@canonical("max", "min", several=True)
def max_along(cz, node):
    """``torch.max(x, dim)`` / ``min``: a (values, indices) pair, read through its parts."""
    name = op_name(node)
    params = bound_args(node, ("input", "dim", "keepdim"))
    x, dim = params.get("input"), params.get("dim")
    src = cz.value(x) if isinstance(x, fx.Node) else None
    if (
        not isinstance(src, torch.Tensor) or not src.dim() or not isinstance(dim, int)
        or src.dtype not in (torch.float32, torch.bfloat16, torch.float16) or dim % src.dim() in cz.batch_dims(x)
    ):  # fmt: skip
        return cz.make(node, name, UNSUPPORTED, tensor_args(node))
    attrs = {"dim": (dim % src.dim(),), "keepdim": bool(params.get("keepdim", False))}
    return cz.make(node, f"{name}_along", META, (x,), attrs)  # no kernel: its parts are the ops


@canonical("sort", several=True)
def sort(cz, node):
    """``torch.sort(x, dim, descending, stable=)``: a (values, indices) pair, read through
    its parts (``element`` nodes naming the part). No template lowers a sort by itself."""
    params = bound_args(node, ("input", "dim", "descending"))
    x = params.get("input")
    rank = cz.value(x).dim() if isinstance(x, fx.Node) else 0
    dim = params.get("dim", -1)
    attrs = {
        "dim": dim % rank if isinstance(dim, int) and rank else dim,
        "descending": bool(params.get("descending", False)),
        "stable": bool(params.get("stable", False)),
    }
    return cz.make(node, "sort", UNSUPPORTED, (x,), attrs)


@canonical("histc", any_dtype=True)
def histc(cz, node):
    """``torch.histc(x, bins, min, max)``: bins, min and max are literal arguments (a
    pattern may capture them as parameters)."""
    params = bound_args(node, ("input", "bins", "min", "max"))
    args = (params.get("input"), params.get("bins", 100), params.get("min", 0), params.get("max", 0))
    return cz.make(node, "histc", UNSUPPORTED, args)


@canonical("cumsum", any_dtype=True)
def cumsum(cz, node):
    """``torch.cumsum(x, dim, dtype=)``: the dim and the dtype of the result (with or
    without ``dtype=``) are attributes. A float running sum along a non-token axis of a float
    value is computed in a row program (a scan over the block's axis); integer counts
    (expert offsets) are read only by a hand-written template."""
    params = bound_args(node, ("input", "dim"))
    x, dim = params.get("input"), params.get("dim")
    rank = cz.value(node).dim()
    attrs = {"dim": dim % rank if isinstance(dim, int) and rank else dim, "dtype": cz.value(node).dtype}
    src = cz.value(x) if isinstance(x, fx.Node) else None
    if (
        isinstance(src, torch.Tensor) and isinstance(dim, int) and rank and src.dtype in _FLOATS
        and attrs["dtype"] in _FLOATS and dim % rank not in cz.batch_dims(x)
    ):  # fmt: skip
        return cz.make(node, "cumsum", COMPUTE, (x,), {"dim": (dim % rank,)})
    return cz.make(node, "cumsum", UNSUPPORTED, (x,), attrs)


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@canonical("norm", "linalg_vector_norm")
def vector_norm(cz, node):
    """``torch.norm(x, p, dim)``, ``x.norm(p, dim)``, ``torch.linalg.vector_norm(x, ord, dim)``:
    a p-norm (p any number, inf or -inf; ``"fro"`` is 2) along non-token axes, as
    ``vector_norm`` with attribute ``ord``. A matrix norm (``"nuc"``), a norm over every dim
    (the tokens among them) or one with ``dtype=`` stays eager."""
    names = ("input", "ord", "dim", "keepdim") if op_name(node) == "linalg_vector_norm" else ("input", "p", "dim", "keepdim")
    params = bound_args(node, names)
    x, p = params.get("input"), params.get("ord", params.get("p", 2))
    dim, keepdim = params.get("dim"), params.get("keepdim", False)
    p = 2 if p == "fro" else p
    rank = cz.value(x).dim() if isinstance(x, fx.Node) else 0
    dims = (dim,) if isinstance(dim, int) else tuple(dim) if isinstance(dim, (tuple, list)) else None
    if (
        not rank or dims is None or not dims or not all(isinstance(d, int) for d in dims)
        or isinstance(p, bool) or not isinstance(p, (int, float)) or math.isnan(p)
        or params.get("dtype") is not None or params.get("out") is not None
        or {d % rank for d in dims} & set(cz.batch_dims(x)) or not isinstance(keepdim, bool)
    ):  # fmt: skip
        return cz.make(node, "vector_norm", UNSUPPORTED, tensor_args(node))
    attrs = {"dim": tuple(sorted({d % rank for d in dims})), "keepdim": keepdim, "ord": float(p)}
    return cz.make(node, "vector_norm", COMPUTE, (x,), attrs)


@canonical("var", "std")
def moments(cz, node):
    """``x.var(dim, unbiased, keepdim)`` / ``std``, ``correction=`` too, along non-token axes:
    ``var`` or ``std`` with attribute ``correction`` (1 unless ``unbiased=False``). Over every
    dim (the tokens among them), or with no more elements than the correction, stays eager."""
    params = bound_args(node, ("input", "dim", "unbiased", "keepdim"))
    x, dim, keepdim = params.get("input"), params.get("dim"), params.get("keepdim", False)
    unbiased, correction = params.get("unbiased"), params.get("correction")
    if correction is None:
        correction = 1 if unbiased is None or unbiased is True else 0 if unbiased is False else None
    rank = cz.value(x).dim() if isinstance(x, fx.Node) else 0
    dims = (dim,) if isinstance(dim, int) else tuple(dim) if isinstance(dim, (tuple, list)) else None
    if (
        not rank or dims is None or not dims or not all(isinstance(d, int) for d in dims)
        or isinstance(correction, bool) or not isinstance(correction, (int, float)) or not isinstance(keepdim, bool)
        or params.get("out") is not None or {d % rank for d in dims} & set(cz.batch_dims(x))
        or math.prod(cz.value(x).shape[d] for d in dims) <= correction
    ):  # fmt: skip
        return cz.make(node, op_name(node), UNSUPPORTED, tensor_args(node))
    attrs = {"dim": tuple(sorted({d % rank for d in dims})), "keepdim": keepdim, "correction": float(correction)}
    return cz.make(node, op_name(node), COMPUTE, (x,), attrs)


@canonical("normalize")
def normalize(cz, node):
    """``F.normalize(x, p, dim, eps)``: x over its p-norm along one non-token axis (at least eps)."""
    params = bound_args(node, ("input", "p", "dim", "eps"))
    x, p, dim, eps = params.get("input"), params.get("p", 2.0), params.get("dim", 1), params.get("eps", 1e-12)
    rank = cz.value(x).dim() if isinstance(x, fx.Node) else 0
    if (
        not rank or not isinstance(dim, int) or isinstance(p, bool) or not isinstance(p, (int, float)) or math.isnan(p)
        or not isinstance(eps, (int, float)) or params.get("out") is not None or dim % rank in cz.batch_dims(x)
    ):  # fmt: skip
        return cz.make(node, "normalize", UNSUPPORTED, tensor_args(node))
    return cz.make(node, "normalize", COMPUTE, (x,), {"dim": (dim % rank,), "ord": float(p), "eps": float(eps)})


@canonical("repeat", any_dtype=True)
def repeat(cz, node):
    """``x.repeat(r0, r1, ...)`` with constant repeats, one per dim, the tokens' 1: along the
    last axis alone it is a concatenation of ``x`` with itself (``cat((x,) * r, -1)``);
    along others a ``repeat`` (element j of a repeated axis of n is the source's j % n).

    A repeat that only spreads unit axes (and axes it adds in front) is a broadcast: attribute
    ``broadcast``, exact at any dtype (GPT-J's positions per table column, int64). Repeated
    along the tokens, it is a table that does not follow them, the same at every token (GPT-J's
    sin/cos table repeated per sequence: ``table.repeat(T, 1, 1)``, T read off the tokens)."""
    repeats = node.args[1:] if len(node.args) > 1 else node.kwargs.get("repeats", ())
    if len(repeats) == 1 and isinstance(repeats[0], (tuple, list, torch.Size)):
        repeats = tuple(repeats[0])
    x = node.args[0]
    src = cz.value(x) if isinstance(x, fx.Node) else None
    out = cz.value(node)
    rank = src.dim() if isinstance(src, torch.Tensor) else -1
    broadcast = _broadcast_repeat(cz, node, x, repeats)
    if broadcast:
        return cz.make(node, "repeat", COMPUTE, (x,), {"repeats": broadcast, "broadcast": True})
    if (
        out.dtype not in KERNEL_DTYPES or len(repeats) != rank
        or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in repeats)
        or any(repeats[d] != 1 for d in cz.batch_dims(x))
    ):  # fmt: skip
        dtype = "" if out.dtype in KERNEL_DTYPES else f"[{str(out.dtype).replace('torch.', '')}]"
        return cz.make(node, f"repeat{dtype}", UNSUPPORTED, tensor_args(node))
    if all(r == 1 for r in repeats[:-1]):
        return cz.make(node, "cat", COMPUTE, (x,) * repeats[-1], {"dim": rank - 1})
    return cz.make(node, "repeat", COMPUTE, (x,), {"repeats": tuple(repeats)})


def _broadcast_repeat(cz, node, x, repeats) -> tuple | None:
    """The repeats (the tokens' as -1) when ``x.repeat(*repeats)`` only spreads axes of size 1
    of ``x`` (those it adds in front included): then every element is the source's one. A
    repeat given by a size (``position_ids.shape[0]``) must be the tokens' count, of a source
    that does not follow the tokens. Repeats of 1 only are a copy of the source, one as well.
    None otherwise."""
    src, out = cz.value(x) if isinstance(x, fx.Node) else None, cz.value(node)
    if not isinstance(src, torch.Tensor) or not repeats or len(repeats) < src.dim():
        return None
    if out.dtype not in KERNEL_DTYPES and out.dtype not in (torch.int64, torch.int32):
        return None
    aligned = (1,) * (len(repeats) - src.dim()) + tuple(src.shape)
    tokens, found = cz.batch_dims(node), []
    for axis, (r, size) in enumerate(zip(repeats, aligned)):
        if isinstance(r, fx.Node):  # a size read off the example: must be the tokens'
            if axis not in tokens or cz.batch_dims(x) or size != 1:
                return None
            found.append(-1)
        elif not isinstance(r, int) or isinstance(r, bool) or r < 1 or (r > 1 and size != 1):
            return None
        else:
            found.append(r)
    offset = len(repeats) - src.dim()  # the source's dims, aligned at the end
    if any(found[d + offset] != 1 for d in cz.batch_dims(x)):
        return None
    return tuple(found)


@canonical("pad")
def pad(cz, node):
    """``F.pad(x, (left, right), value=v)`` (mode "constant"; pairs for earlier dims all
    zero): the last axis widened by ``left`` and ``right`` columns of ``v``. A negative pad
    (a crop), another mode or a padded token dim stays eager."""
    params = bound_args(node, ("input", "pad", "mode", "value"))
    x, widths = params.get("input"), params.get("pad")
    mode, value = params.get("mode", "constant"), params.get("value")
    value = 0.0 if value is None else value
    rank = cz.value(x).dim() if isinstance(x, fx.Node) else 0
    if (
        not rank or not isinstance(widths, (tuple, list)) or len(widths) < 2 or len(widths) % 2
        or not all(isinstance(w, int) and not isinstance(w, bool) for w in widths) or any(widths[2:])
        or min(widths[:2]) < 0 or mode != "constant" or isinstance(value, bool)
        or not isinstance(value, (int, float)) or rank - 1 in cz.batch_dims(x)
    ):  # fmt: skip
        return cz.make(node, "pad", UNSUPPORTED, tensor_args(node))
    return cz.make(node, "pad", COMPUTE, (x,), {"left": widths[0], "right": widths[1], "value": float(value)})


@canonical("index_add")
def index_add(cz, node):
    """``x.index_add(dim, index, source, alpha=a)`` along the last axis (not the tokens), the
    index a 1-D integer tensor that does not follow the tokens: each column of ``x`` plus the
    columns of ``source`` the index sends there (repeats summed), as ``index_add_last``. Along
    the tokens it writes rows that other programs own, and stays eager."""
    params = bound_args(node, ("input", "dim", "index", "source"))
    x, dim, index, source = (params.get(k) for k in ("input", "dim", "index", "source"))
    alpha = params.get("alpha", 1)
    if not all(isinstance(a, fx.Node) for a in (x, index, source)) or not isinstance(dim, int):
        return cz.make(node, "index_add", UNSUPPORTED, tensor_args(node))
    src, idx, rows = cz.value(x), cz.value(index), cz.value(source)
    rank = src.dim()
    if rank and dim % rank in cz.batch_dims(x):
        return cz.make(node, "index_add over tokens", UNSUPPORTED, tensor_args(node))
    if (
        not rank or dim % rank != rank - 1 or idx.dim() != 1 or idx.dtype not in (torch.int64, torch.int32)
        or cz.batch_dims(index) or rows.dim() != rank or rows.shape[:-1] != src.shape[:-1]
        or isinstance(alpha, bool) or not isinstance(alpha, (int, float))
    ):  # fmt: skip
        return cz.make(node, "index_add", UNSUPPORTED, tensor_args(node))
    return cz.make(node, "index_add_last", COMPUTE, (x, index, source, float(alpha)))


@canonical("stack")
def stack(cz, node):
    parts = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    rank = cz.value(node).dim()
    tokens = cz.batch_dims(node)
    if not all(isinstance(p, fx.Node) for p in parts) or not isinstance(dim, int) or (tokens and dim % rank <= max(tokens)):
        return cz.make(node, "stack", UNSUPPORTED, tuple(p for p in parts if isinstance(p, fx.Node)))
    return cz.make(node, "stack", COMPUTE, tuple(parts), {"dim": dim % rank})


@canonical("repeat_interleave")
def repeat_interleave(cz, node):
    params = cz.params(node, "repeat_interleave")
    x, repeats, dim = node.args[0], params.get("repeats"), params.get("dim")
    rank = cz.value(node).dim()
    if not isinstance(repeats, int) or isinstance(repeats, bool) or not isinstance(dim, int) or dim % rank in cz.batch_dims(x):
        return cz.make(node, "repeat_interleave", UNSUPPORTED, tensor_args(node))
    return cz.make(node, "repeat_interleave", COMPUTE, (x,), {"repeats": repeats, "dim": dim % rank})


def constant(cz, node, name):
    if any(writes_into(u, node) for u in node.users):
        # A buffer written in place (``mask = zeros_like(s); mask.scatter_(...)``): its value
        # changes after it is made, so no kernel may compute it and read it later.
        return cz.make(node, f"{name} written in place", UNSUPPORTED)
    value = CONSTANTS[name]
    if value is None:  # full(size, v), full_like(x, v), x.new_full(size, v)
        at = 2 if name == "new_full" else 1
        value = node.args[at] if len(node.args) > at else node.kwargs.get("fill_value")
    if not isinstance(value, (int, float, bool)):
        return cz.make(node, name, UNSUPPORTED, tensor_args(node))
    return cz.make(node, "full", COMPUTE, (), {"value": value})
