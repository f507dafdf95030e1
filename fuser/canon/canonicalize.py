"""canon: a canonical view of a traced graph, so that spellings of the same math compare equal.

Every fx node gets one :class:`COp`: a canonical op name, its tensor/scalar arguments (with
transparent nodes such as no-op casts and ``contiguous()`` looked through), normalised static
attributes (non-negative dims, output shapes with the batch dim as -1, dtypes) and the fx nodes
it stands for. Rewrites fold spelling variants into one form:

    x*x, x**2, x.pow(2), x.square(), torch.square(x)   -> square(x)
    1/sqrt(x), sqrt(x).reciprocal(), x.pow(-0.5)       -> rsqrt(x)
    sum(x, d) / n, sum(x, d) * (1/n)   (n = the size)  -> mean(x, d)
    x * sigmoid(x)                                     -> silu(x)
    clamp_min / clamp_max / clip                       -> clamp
    F.gelu(x, approximate="tanh"), nn.GELU("tanh")     -> gelu_tanh(x)
    x.masked_fill(mask, v)                             -> where(mask, v, x)
    torch.max(x, d).values / .indices                  -> amax(x, d) / argmax(x, d)
    zeros_like, ones_like, full, x.new_full, ...       -> full (attribute value)
    method vs function, view vs reshape, args vs kwargs -> the same op and attributes

Both the model graph and every pattern's reference graph go through this module, so matching
is a plain structural comparison of COps. Which ops exist, their other spellings and their
positional parameters come from the op table (fuser/ir/ops.py).
"""

from __future__ import annotations

import builtins
import math
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from fuser.ir import ops
from fuser.canon.ops import constant
from fuser.canon.registry import ANY_DTYPE, SEVERAL, TENSOR
from fuser.canon.views import aliases, cast_or_copy, index_arithmetic, literal_size, view
from fuser.ir.canonical_op import (  # noqa: F401 (the kinds and COp are read from here across fuser)
    COMPUTE, CONSTANTS, FOLDED_LAUNCHES, GLUE_KINDS, HEAVY, INPUT, KERNEL_DTYPES, META, MUTATION, UNIT_VIEW,
    UNSUPPORTED, VIEW, COp, op_name, tensor_args, through_identities,
)
from fuser.trace.leaves import LEAF
from fuser.ir.opaque import is_opaque
from fuser.trace.tracing import Traced

# What each op is comes from the op table (fuser/ir/ops.py).
UNARY = ops.pointwise(1)  # op(x)
BINARY = ops.pointwise(2)  # op(a, b)
COMMUTATIVE = ops.COMMUTATIVE
REDUCTIONS = frozenset(n for n, op in ops.TABLE.items() if op.kind == ops.REDUCTION)  # dim, keepdim
REDUCING = ops.REDUCING  # ops that combine values along an axis
ELEMENTWISE = frozenset(n for n, op in ops.TABLE.items() if op.kind == ops.POINTWISE)

# (F.embedding and the convolutions: what an ``nn.Embedding`` or a conv module computes, met
# where the trace goes into one whose class has a forward of its own: fuser.trace.leaves.is_default_leaf)
HEAVY_FUNCTIONS = {
    F.linear, torch.matmul, operator.matmul, torch.mm, torch.bmm, torch.einsum, torch.addmm,
    torch.baddbmm, F.scaled_dot_product_attention, F.embedding, F.conv1d, F.conv2d, F.conv3d,
}  # fmt: skip
if hasattr(torch, "_grouped_mm"):
    HEAVY_FUNCTIONS.add(torch._grouped_mm)
HEAVY_METHODS = {"matmul", "mm", "bmm", "__matmul__"}

_ALIASES = dict(ops.SPELLINGS)
_VIEW_METHODS = {
    "view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "expand", "expand_as",
    "permute", "transpose", "t", "narrow", "view_as", "reshape_as", "movedim", "select",
}  # fmt: skip
# Attributes that are views (``weight.T``: FalconLinear's ``input @ self.weight.T``).
_VIEW_ATTRIBUTES = {"T", "mT"}
# Reinterpretations that launch nothing in eager (they return views); in a kernel they split a
# trailing pair of floats into a complex value's (re, im), join it back, or negate im.
_PAIR_VIEWS = {"view_as_complex", "view_as_real", "conj"}
# What a kernel computes on complex64 values (RoPE needs no more).
_COMPLEX_OPS = {"mul", "add", "sub", "neg", "cat"}
_TOPK_PARTS = {"values": "topk_values", 0: "topk_values", "indices": "topk_indices", 1: "topk_indices"}
_DROPOUTS = {"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout"}
_CAST_METHODS = {"to", "type", "type_as", "float", "half", "bfloat16", "double", "bool"}
_TRANSPARENT_METHODS = {"contiguous", "detach", "clone"} | _CAST_METHODS

# Positional parameter names after the input, per canonical op (method and torch.* agree).
_POSITIONAL = {name: op.params for name, op in ops.TABLE.items() if op.params}
_POSITIONAL["masked_fill"] = ("mask", "value")  # canonicalised to where(mask, value, x)
# Allocations: undefined contents until written (often through a view, `k[..., :d].copy_(...)`).
_EMPTIES = {"empty", "empty_like", "new_empty"}
# The result of ``torch.max(x, dim)`` / ``torch.min(x, dim)`` (a (values, indices) pair) that a part picks.
_MAX_PARTS = {
    "max": {"values": "amax", 0: "amax", "indices": "argmax", 1: "argmax"},
    "min": {"values": "amin", 0: "amin", "indices": "argmin", 1: "argmin"},
}


class Canonicalizer:
    """Builds the COp of every node of a traced graph: this class classifies each node and
    rewrites spelling variants; an op with a rule of its own is canonicalised by the function
    registered under its name (:mod:`fuser.canon.registry`), views and indexing by
    :mod:`fuser.canon.views`, ops with several spellings by :mod:`fuser.canon.ops`."""

    def __init__(self, traced: Traced):
        self.traced = traced
        self.cops: dict[fx.Node, COp] = {}
        for node in traced.graph.nodes:
            if node.op != "output":
                self.cops[node] = self._rewrite(self._canonical(node))

    def value(self, node):
        return self.traced.value(node) if isinstance(node, fx.Node) else node

    def batch_dims(self, node) -> tuple[int, ...]:
        return self.traced.batch_dims(node) if isinstance(node, fx.Node) else ()

    def resolve(self, arg):
        """Look through transparent nodes (no-op casts, contiguous(), detach())."""
        return through_identities(self.cops, arg)

    def static_shape(self, node) -> tuple[int, ...]:
        """The node's shape with batch dims written as -1."""
        value = self.value(node)
        batch = self.batch_dims(node)
        return tuple(-1 if i in batch else int(s) for i, s in enumerate(value.shape))

    def make(self, node, op, kind, args=(), attrs=None, covers=()):
        args = tuple(self.resolve(a) for a in args)
        attrs = tuple(sorted((attrs or {}).items()))
        return COp(op, kind, args, attrs, (node,) + tuple(covers))

    def _sole_user(self, node, user) -> bool:
        return isinstance(node, fx.Node) and list(node.users) == [user]

    def _fp32(self, node) -> bool:
        """Folding two ops into one is exact only where the intermediate is not rounded."""
        return isinstance(node, fx.Node) and self.value(node).dtype in (torch.float32, torch.float64)

    def _canonical(self, node: fx.Node) -> COp:
        value = self.value(node)
        if node.op in ("placeholder", "get_attr"):
            return self.make(node, "input", INPUT)
        if node.op == "call_module":
            return self.make(node, node.target, HEAVY, node.args)
        target = node.target
        if node.meta.get(LEAF) or node.op == "call_function" and (
            target in HEAVY_FUNCTIONS
            or is_opaque(target)
            or isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
        ):
            return self.make(node, op_name(node), HEAVY, tensor_args(node))  # whatever it returns
        if not isinstance(value, torch.Tensor):
            if node.target is operator.setitem:
                return self.make(node, "setitem", MUTATION, node.args[:1])
            if op_name(node) in SEVERAL and _holds_tensors(value):  # topk, max / min along a dim, sort
                return SEVERAL[op_name(node)](self, node)
            if _holds_tensors(value) and op_name(node) not in ("chunk", "split", "unbind", "getattr", "getitem"):
                # topk, sort, max(dim): one kernel returning several tensors; no template yet
                return self.make(node, op_name(node), UNSUPPORTED, tensor_args(node))
            return self.make(node, op_name(node), META)
        if node.op == "call_method" and target in HEAVY_METHODS:
            return self.make(node, target, HEAVY, tensor_args(node))
        name = op_name(node)
        source = node.args[0] if node.args else None
        if (
            target in (builtins.getattr, operator.getitem)
            and isinstance(source, fx.Node)
            and _holds_tensors(self.value(source))
            and op_name(source) not in ("chunk", "split", "unbind")  # those are slices: see _view
        ):
            which = node.args[1] if len(node.args) > 1 else None
            part = _TOPK_PARTS.get(which) if isinstance(which, (str, int)) else None
            producer = self.cops.get(source)
            if part and producer and producer.op == "topk" and producer.kind == COMPUTE:
                return self.make(node, part, UNIT_VIEW, (source,))  # free: picks one of its results
            if producer and producer.op in ("max_along", "min_along") and which in _MAX_PARTS[op_name(source)]:
                # max(x, dim).values is amax(x, dim), .indices argmax(x, dim): one op each
                return self.make(node, _MAX_PARTS[op_name(source)][which], COMPUTE, producer.args, dict(producer.attrs))
            # no kernel of its own; which result it picks (sort(x)[0] or .values: part 0)
            return self.make(node, "element", VIEW, (source,), {"part": _part_index(self.value(source), which)})
        if name in _PAIR_VIEWS and aliases(self, node):
            return self.make(node, name, UNIT_VIEW, tensor_args(node))
        if name in _EMPTIES:
            return self.make(node, "empty", META)  # an allocation, of any dtype: no kernel, no launch
        if name in ANY_DTYPE:  # histc, cumsum
            return ANY_DTYPE[name](self, node)
        if name == "inverse_permutation":  # fuser.trace.in_place_idioms: no template lowers it by itself
            return self.make(node, name, UNSUPPORTED, node.args[:1])
        if node.op == "call_method" and name in _CAST_METHODS and _returns_itself(value, self.value(source)):
            return self.make(node, "identity", COMPUTE, (source,))  # x.to(its own device), of any dtype
        if _integer_cast(node, value, self.value(source)):
            # a cast like any other, so that the spellings of one chain that cast to different
            # dtypes per device compare (x.float() / x.int()); kernels compute it between int32
            # and int64 (positions, expert ids), exact both ways as PyTorch's wraps, and to int8
            # or int32 from a value clamped into that range (a quantised activation)
            exact = {value.dtype, self.value(source).dtype} <= {torch.int32, torch.int64} or self._in_range(source, value.dtype)
            return self.make(node, "cast", COMPUTE if exact else UNSUPPORTED, (source,), {"dtype": value.dtype})
        transposed = target is builtins.getattr and len(node.args) > 1 and node.args[1] in _VIEW_ATTRIBUTES
        is_view = name in _VIEW_METHODS or (node.op == "call_function" and target is operator.getitem) or transposed
        complex_ok = value.dtype == torch.complex64 and (name in _COMPLEX_OPS or is_view)
        index_ok = value.dtype == torch.int64 and ops.TABLE.get(name, None) and ops.TABLE[name].result == ops.INDEX_RESULT
        index_ok = index_ok or index_arithmetic(self, node, _ALIASES.get(name, name), value)
        if (value.dtype not in KERNEL_DTYPES or (value.dtype.is_complex and not complex_ok)) and not index_ok:
            if not is_view:
                return self.make(node, f"{name}[{str(value.dtype).replace('torch.', '')}]", UNSUPPORTED, tensor_args(node))
        if name.endswith("_") and not name.startswith("_") or node.kwargs.get("out") is not None:
            return self.make(node, name, MUTATION, tensor_args(node))
        name = _ALIASES.get(name, name)
        if name in ("max", "min") and len(node.args) > 1 and isinstance(node.args[1], fx.Node):
            name = {"max": "maximum", "min": "minimum"}[name]  # torch.max(a, b): elementwise
        if name in _DROPOUTS and not _training(node):
            return self.make(node, "identity", COMPUTE, (source,))  # dropout in eval mode
        if node.op == "call_method" and name in _TRANSPARENT_METHODS or name in ("contiguous", "clone"):
            return cast_or_copy(self, node)
        if name in _VIEW_METHODS or target is operator.getitem or name in ("chunk", "split") or transposed:
            return view(self, node)
        if name in TENSOR:  # cat, gather, scatter, stack, repeat_interleave, masked_fill, layer_norm, gelu
            return TENSOR[name](self, node)
        if name in CONSTANTS:
            return constant(self, node, name)
        if ops.kind(name) == ops.POINTWISE and not ops.TABLE[name].triton and not index_ok:  # integers only
            return self.make(node, f"{name}[{str(value.dtype).replace('torch.', '')}]", UNSUPPORTED, tensor_args(node))
        if ops.kind(name) in (ops.POINTWISE, ops.REDUCTION, ops.NORMALIZATION):
            return self._compute(node, name)
        return self.make(node, name, UNSUPPORTED, tensor_args(node))

    def _in_range(self, source, dtype: torch.dtype) -> bool:
        """Is ``source`` a floating-point value clamped by literals into ``dtype``'s range (int8,
        int32), so that a cast to it truncates toward zero on every device, as a kernel's does?
        (Out of range, PyTorch's own cast differs between CPU and GPU.)"""
        cop = self.cops.get(source)
        if dtype not in (torch.int8, torch.int32) or cop is None or cop.op != "clamp" or len(cop.args) != 3:
            return False
        low, high = cop.args[1:]
        info = torch.iinfo(dtype)
        numbers = all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in (low, high))
        return numbers and self.value(source).is_floating_point() and info.min <= low <= high <= info.max

    def _compute(self, node, name):
        tensors = [a for a in node.args if isinstance(a, fx.Node)]
        if name in BINARY:
            a, b = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("other", node.kwargs.get("exponent"))
            a, b = literal_size(self, a), literal_size(self, b)  # (a size no call changes: its int)
            alpha = node.kwargs.get("alpha", 1)
            if alpha != 1:
                return self.make(node, name + "_alpha", UNSUPPORTED, tuple(tensors))
            return self.make(node, name, COMPUTE, (a, b))
        if name in UNARY:
            return self.make(node, name, COMPUTE, (node.args[0],))
        if name == "where":
            return self.make(node, "where", COMPUTE, tuple(node.args[:3]))
        params = self.params(node, name)
        rank = self.value(node.args[0]).dim()
        if name == "clamp":
            low = params.get("min")
            high = params.get("max")
            if op_name(node) == "clamp_max":
                low, high = None, params.get("min", params.get("max"))
            if isinstance(low, fx.Node) or isinstance(high, fx.Node):
                return self.make(node, "clamp_tensor", UNSUPPORTED, tuple(tensors))
            return self.make(node, "clamp", COMPUTE, (node.args[0], low, high))
        if name == "softplus":
            return self.make(node, "softplus", COMPUTE, (node.args[0], params.get("beta", 1.0), params.get("threshold", 20.0)))
        dtype = params.get("dtype")
        if dtype is not None and not (
            dtype == torch.float32 and name in ("sum", "mean")
            or dtype in (torch.float32, torch.bfloat16, torch.float16) and name in ("softmax", "log_softmax")
        ):
            return self.make(node, name + "_dtype", UNSUPPORTED, tuple(tensors))
        # sum / mean with dtype=float32: computed in fp32, as a kernel computes anyway; softmax
        # with a dtype: of the input cast to it.
        dims = _normalize_dims(params.get("dim"), rank)
        if set(dims) & set(self.batch_dims(node.args[0])):
            return self.make(node, f"{name} over tokens", UNSUPPORTED, tuple(tensors))
        attrs = {"dim": dims}
        if dtype is not None:
            attrs["dtype"] = dtype
        if name in REDUCTIONS:
            attrs["keepdim"] = bool(params.get("keepdim", False))
        elif len(dims) != 1:
            return self.make(node, name, UNSUPPORTED, tuple(tensors))
        return self.make(node, name, COMPUTE, (node.args[0],), attrs)

    def params(self, node, name) -> dict:
        """The call's parameters after the input, by name (positional ones named per the table)."""
        params = dict(zip(_POSITIONAL.get(name, ()), node.args[1:]))
        params.update(node.kwargs)
        return params

    def _rewrite(self, cop: COp) -> COp:
        if cop.kind != COMPUTE:
            return cop
        op, args, node = cop.op, cop.args, cop.node
        if op == "mul" and len(args) == 2 and args[0] is args[1]:
            return COp("square", COMPUTE, (args[0],), (), cop.covers)
        if op == "mul" and len(args) == 2:
            for x, s in (args, args[::-1]):
                inner = self.cops.get(s) if isinstance(s, fx.Node) else None
                if inner and inner.op == "sigmoid" and inner.args[0] is x and self._sole_user(s, node) and self._fp32(s):
                    return COp("silu", COMPUTE, (x,), (), cop.covers + inner.covers)
        if op == "pow" and not isinstance(args[1], fx.Node):
            exponent = args[1]
            unary = {2: "square", 0.5: "sqrt", -0.5: "rsqrt", -1: "reciprocal", 1: "identity"}.get(exponent)
            if unary:
                return self._rewrite(COp(unary, COMPUTE, (args[0],), (), cop.covers))
        if op == "div" and not isinstance(args[0], fx.Node) and args[0] == 1:
            return self._rewrite(COp("reciprocal", COMPUTE, (args[1],), (), cop.covers))
        if op == "div" and not isinstance(args[0], fx.Node) and isinstance(args[1], fx.Node):
            return COp("rdiv", COMPUTE, (args[1],), (("numerator", args[0]),), cop.covers)  # c / x
        if op == "reciprocal" and isinstance(args[0], fx.Node):
            inner = self.cops[args[0]]
            if inner.op == "sqrt" and self._sole_user(args[0], node) and self._fp32(args[0]):
                return COp("rsqrt", COMPUTE, inner.args, (), cop.covers + inner.covers)
        if op in ("div", "mul") and isinstance(args[0], fx.Node) and not isinstance(args[1], fx.Node):
            inner = self.cops[args[0]]
            if inner.op == "sum" and self._sole_user(args[0], node) and self._fp32(args[0]):
                n = math.prod(self.value(inner.args[0]).shape[d] for d in inner.attr("dim"))
                factor = args[1] if op == "div" else (1 / args[1] if args[1] else 0)
                if n and abs(factor - n) <= 1e-9 * n and not set(inner.attr("dim")) & set(self.batch_dims(inner.args[0])):
                    return COp("mean", COMPUTE, inner.args, inner.attrs, cop.covers + inner.covers)
        return cop


def _training(node: fx.Node) -> bool:
    """A dropout call's ``training`` flag (``F.dropout(x, p, training, inplace)``; default True)."""
    if "training" in node.kwargs:
        return bool(node.kwargs["training"])
    if "train" in node.kwargs:  # torch.dropout(input, p, train)
        return bool(node.kwargs["train"])
    return bool(node.args[2]) if len(node.args) > 2 else node.op == "call_function" and node.target is not torch.dropout


_INTEGER_CASTS = {"int", "long", "short", "char", "byte", "to", "type"}


def _integer_cast(node: fx.Node, value, source) -> bool:
    """Is the node a method cast of a tensor to another integer dtype on the same device?"""
    return (
        node.op == "call_method" and node.target in _INTEGER_CASTS and isinstance(source, torch.Tensor)
        and isinstance(value, torch.Tensor) and not value.dtype.is_floating_point and not value.dtype.is_complex
        and value.dtype != torch.bool and value.dtype != source.dtype and value.device == source.device
    )  # fmt: skip


def _returns_itself(value, source) -> bool:
    return isinstance(value, torch.Tensor) and value is source


def _part_index(result, which):
    """The position of the part ``which`` (an index or a field name) of a tuple result."""
    if isinstance(which, str):
        field = getattr(result, which, None)
        return next((i for i, v in enumerate(result) if v is field), which)
    return which if isinstance(which, int) else None


def _holds_tensors(value) -> bool:
    return isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value)


def _normalize_dims(dim: Any, rank: int) -> tuple[int, ...]:
    if dim is None:
        return tuple(range(rank))
    if isinstance(dim, int):
        dim = (dim,)
    return tuple(sorted(d % rank if rank else 0 for d in dim))


def canonicalize(traced: Traced) -> dict[fx.Node, COp]:
    return Canonicalizer(traced).cops


def is_glue(cop: COp) -> bool:
    return cop.kind in GLUE_KINDS and cop.op != "identity"


def launches(cop: COp) -> int:
    """Kernel launches this node costs when it runs as PyTorch's (views and no-ops cost none)."""
    if cop.kind in (COMPUTE, MUTATION, UNSUPPORTED) and cop.op != "identity":
        return _EAGER_LAUNCHES.get(cop.op, 1)
    return 0


def eager_launches(cop: COp) -> int:
    """Kernel launches this node stands for in the module's own forward: its own, and those of
    the nodes a trace rewrite folded into it (a buffer's fill and its whole writes)."""
    return launches(cop) + (cop.node.meta.get(FOLDED_LAUNCHES, 0) if launches(cop) else 0)

#: Ops that launch more than one kernel eagerly: fuser.trace.in_place_idioms' arange and index write.
_EAGER_LAUNCHES = {"inverse_permutation": 2}


