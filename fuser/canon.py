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
positional parameters come from the op table (fuser/ops.py).
"""

from __future__ import annotations

import builtins
import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from fuser import ops
from fuser.idioms import writes_into
from fuser.leaves import LEAF
from fuser.opaque import is_opaque
from fuser.trace import Traced

# What a node is, for grouping and for counting kernel launches.
COMPUTE = "compute"  # elementwise / reduction / cast: fusible, one launch in eager
UNIT_VIEW = "unit_view"  # inserts or drops size-1 dims, broadcasts, slices a computed value: fusible, free
VIEW = "view"  # any other view or slice: free, never inside a fused kernel
META = "meta"  # size arithmetic on Python ints: free
INPUT = "input"  # placeholders and parameters/buffers
HEAVY = "heavy"  # GEMMs, attention, experts, opaque leaves: kept as they are
MUTATION = "mutation"  # in-place writes: kept, ordered, never fused across
UNSUPPORTED = "unsupported"  # glue no template can lower yet: kept, reported with the op name

GLUE_KINDS = (COMPUTE, UNIT_VIEW, VIEW, MUTATION, UNSUPPORTED)

# What each op is comes from the op table (fuser/ops.py).
UNARY = ops.pointwise(1)  # op(x)
BINARY = ops.pointwise(2)  # op(a, b)
COMMUTATIVE = ops.COMMUTATIVE
REDUCTIONS = frozenset(n for n, op in ops.TABLE.items() if op.kind == ops.REDUCTION)  # dim, keepdim
REDUCING = ops.REDUCING  # ops that combine values along an axis
ELEMENTWISE = frozenset(n for n, op in ops.TABLE.items() if op.kind == ops.POINTWISE)

HEAVY_FUNCTIONS = {
    F.linear, torch.matmul, operator.matmul, torch.mm, torch.bmm, torch.einsum, torch.addmm,
    torch.baddbmm, F.scaled_dot_product_attention,
}  # fmt: skip
if hasattr(torch, "_grouped_mm"):
    HEAVY_FUNCTIONS.add(torch._grouped_mm)
HEAVY_METHODS = {"matmul", "mm", "bmm", "__matmul__"}

_OPERATOR_NAMES = {
    operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "div",
    operator.neg: "neg", operator.pow: "pow", operator.eq: "eq", operator.ne: "ne",
    operator.lt: "lt", operator.le: "le", operator.gt: "gt", operator.ge: "ge",
    operator.and_: "bitwise_and", operator.or_: "bitwise_or", operator.invert: "invert",
}  # fmt: skip
_ALIASES = dict(ops.SPELLINGS)
_VIEW_METHODS = {
    "view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "expand", "expand_as",
    "permute", "transpose", "t", "narrow", "view_as", "reshape_as", "movedim", "select",
}  # fmt: skip
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.bool, torch.complex64)
# Reinterpretations that launch nothing in eager (they return views); in a kernel they split a
# trailing pair of floats into a complex value's (re, im), join it back, or negate im.
_PAIR_VIEWS = {"view_as_complex", "view_as_real", "conj"}
# What a kernel computes on complex64 values (RoPE needs no more).
_COMPLEX_OPS = {"mul", "add", "sub", "neg", "cat"}
_MAY_COPY = {"reshape", "flatten", "reshape_as"}  # views when the layout allows, else copies
# Views that keep the elements in their row-major order (a transpose or permute does not).
_REORDER_FREE = {"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as"}
_TOPK_PARTS = {"values": "topk_values", 0: "topk_values", "indices": "topk_indices", 1: "topk_indices"}
_DROPOUTS = {"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout"}
_CAST_METHODS = {"to", "type", "type_as", "float", "half", "bfloat16", "double", "bool"}
_TRANSPARENT_METHODS = {"contiguous", "detach", "clone"} | _CAST_METHODS

# Positional parameter names after the input, per canonical op (method and torch.* agree).
_POSITIONAL = {name: op.params for name, op in ops.TABLE.items() if op.params}
_POSITIONAL["masked_fill"] = ("mask", "value")  # canonicalised to where(mask, value, x)
# Functions that make a constant: the value every element gets (None: the fill_value argument).
# Allocations: undefined contents until written (often through a view, `k[..., :d].copy_(...)`).
_EMPTIES = {"empty", "empty_like", "new_empty"}
_CONSTANTS = {
    "zeros": 0.0, "zeros_like": 0.0, "new_zeros": 0.0, "ones": 1.0, "ones_like": 1.0, "new_ones": 1.0,
    "full": None, "full_like": None, "new_full": None,
}  # fmt: skip
# The result of ``torch.max(x, dim)`` / ``torch.min(x, dim)`` (a (values, indices) pair) that a part picks.
_MAX_PARTS = {
    "max": {"values": "amax", 0: "amax", "indices": "argmax", 1: "argmax"},
    "min": {"values": "amin", 0: "amin", "indices": "argmin", 1: "argmin"},
}


@dataclass(frozen=True)
class COp:
    op: str
    kind: str
    args: tuple  # fx.Node or Python scalars
    attrs: tuple  # sorted (name, value) pairs
    covers: tuple  # the fx nodes this op stands for; covers[0] is the node itself

    @property
    def node(self) -> fx.Node:
        return self.covers[0]

    def attr(self, name: str, default=None):
        return dict(self.attrs).get(name, default)


def op_name(node: fx.Node) -> str:
    """A readable name for an fx node's target: 'mul', 'rsqrt', 'mlp.experts', ..."""
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        if node.target in _OPERATOR_NAMES:
            return _OPERATOR_NAMES[node.target]
        return getattr(node.target, "__name__", str(node.target))
    return str(node.target)


class Canonicalizer:
    """Builds the COp of every node of a traced graph."""

    def __init__(self, traced: Traced):
        self.traced = traced
        self.cops: dict[fx.Node, COp] = {}
        for node in traced.graph.nodes:
            if node.op != "output":
                self.cops[node] = self._rewrite(self._canonical(node))

    # --- helpers -----------------------------------------------------------------------------
    def value(self, node):
        return self.traced.value(node) if isinstance(node, fx.Node) else node

    def batch_dims(self, node) -> tuple[int, ...]:
        return self.traced.batch_dims(node) if isinstance(node, fx.Node) else ()

    def resolve(self, arg):
        """Look through transparent nodes (no-op casts, contiguous(), detach())."""
        while isinstance(arg, fx.Node) and arg in self.cops and self.cops[arg].op == "identity":
            arg = self.cops[arg].args[0]
        return arg

    def static_shape(self, node) -> tuple[int, ...]:
        """The node's shape with batch dims written as -1."""
        value = self.value(node)
        batch = self.batch_dims(node)
        return tuple(-1 if i in batch else int(s) for i, s in enumerate(value.shape))

    def _make(self, node, op, kind, args=(), attrs=None, covers=()):
        args = tuple(self.resolve(a) for a in args)
        attrs = tuple(sorted((attrs or {}).items()))
        return COp(op, kind, args, attrs, (node,) + tuple(covers))

    def _sole_user(self, node, user) -> bool:
        return isinstance(node, fx.Node) and list(node.users) == [user]

    def _fp32(self, node) -> bool:
        """Folding two ops into one is exact only where the intermediate is not rounded."""
        return isinstance(node, fx.Node) and self.value(node).dtype in (torch.float32, torch.float64)

    # --- classification ----------------------------------------------------------------------
    def _canonical(self, node: fx.Node) -> COp:
        value = self.value(node)
        if node.op in ("placeholder", "get_attr"):
            return self._make(node, "input", INPUT)
        if node.op == "call_module":
            return self._make(node, node.target, HEAVY, node.args)
        target = node.target
        if node.meta.get(LEAF) or node.op == "call_function" and (
            target in HEAVY_FUNCTIONS
            or is_opaque(target)
            or isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
        ):
            return self._make(node, op_name(node), HEAVY, _tensor_args(node))  # whatever it returns
        if not isinstance(value, torch.Tensor):
            if node.target is operator.setitem:
                return self._make(node, "setitem", MUTATION, node.args[:1])
            if op_name(node) == "topk" and _holds_tensors(value):
                return self._topk(node)
            if op_name(node) in _MAX_PARTS and _holds_tensors(value):
                return self._max_along(node)
            if op_name(node) == "sort" and _holds_tensors(value):
                return self._sort(node)
            if _holds_tensors(value) and op_name(node) not in ("chunk", "split", "unbind", "getattr", "getitem"):
                # topk, sort, max(dim): one kernel returning several tensors; no template yet
                return self._make(node, op_name(node), UNSUPPORTED, _tensor_args(node))
            return self._make(node, op_name(node), META)
        if node.op == "call_method" and target in HEAVY_METHODS:
            return self._make(node, target, HEAVY, _tensor_args(node))
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
                return self._make(node, part, UNIT_VIEW, (source,))  # free: picks one of its results
            if producer and producer.op in ("max_along", "min_along") and which in _MAX_PARTS[op_name(source)]:
                # max(x, dim).values is amax(x, dim), .indices argmax(x, dim): one op each
                return self._make(node, _MAX_PARTS[op_name(source)][which], COMPUTE, producer.args, dict(producer.attrs))
            # no kernel of its own; which result it picks (sort(x)[0] or .values: part 0)
            return self._make(node, "element", VIEW, (source,), {"part": _part_index(self.value(source), which)})
        if name in _PAIR_VIEWS and self._aliases(node):
            return self._make(node, name, UNIT_VIEW, _tensor_args(node))
        if name in _EMPTIES:
            return self._make(node, "empty", META)  # an allocation, of any dtype: no kernel, no launch
        if name in ("histc", "cumsum"):
            return getattr(self, f"_{name}")(node)
        if name == "inverse_permutation":  # fuser.idioms: no template lowers it by itself
            return self._make(node, name, UNSUPPORTED, node.args[:1])
        if _integer_cast(node, value, self.value(source)):
            # no kernel computes integers yet; a cast like any other, so that the spellings of
            # one chain that cast to different dtypes per device compare (x.float() / x.int())
            return self._make(node, "cast", UNSUPPORTED, (source,), {"dtype": value.dtype})
        is_view = name in _VIEW_METHODS or (node.op == "call_function" and target is operator.getitem)
        complex_ok = value.dtype == torch.complex64 and (name in _COMPLEX_OPS or is_view)
        index_ok = value.dtype == torch.int64 and ops.TABLE.get(name, None) and ops.TABLE[name].result == ops.INDEX_RESULT
        index_ok = index_ok or self._index_arithmetic(node, _ALIASES.get(name, name), value)
        if (value.dtype not in _KERNEL_DTYPES or (value.dtype.is_complex and not complex_ok)) and not index_ok:
            if not is_view:
                return self._make(node, f"{name}[{str(value.dtype).replace('torch.', '')}]", UNSUPPORTED, _tensor_args(node))
        if name.endswith("_") and not name.startswith("_") or node.kwargs.get("out") is not None:
            return self._make(node, name, MUTATION, _tensor_args(node))
        name = _ALIASES.get(name, name)
        if name in ("max", "min") and len(node.args) > 1 and isinstance(node.args[1], fx.Node):
            name = {"max": "maximum", "min": "minimum"}[name]  # torch.max(a, b): elementwise
        if name in _DROPOUTS and not _training(node):
            return self._make(node, "identity", COMPUTE, (source,))  # dropout in eval mode
        if node.op == "call_method" and name in _TRANSPARENT_METHODS or name in ("contiguous", "clone"):
            return self._cast_or_copy(node)
        if name in _VIEW_METHODS or target is operator.getitem or name in ("chunk", "split"):
            return self._view(node)
        if name == "cat":
            return self._cat(node)
        if name == "gather":
            return self._gather(node)
        if name == "scatter":
            return self._scatter(node)
        special = {
            "stack": self._stack, "repeat_interleave": self._repeat_interleave, "masked_fill": self._masked_fill,
            "layer_norm": self._layer_norm, "gelu": self._gelu,
        }  # fmt: skip
        if name in special:
            return special[name](node)
        if name in _CONSTANTS:
            return self._constant(node, name)
        if ops.kind(name) == ops.POINTWISE and not ops.TABLE[name].triton and not index_ok:  # integers only
            return self._make(node, f"{name}[{str(value.dtype).replace('torch.', '')}]", UNSUPPORTED, _tensor_args(node))
        if ops.kind(name) in (ops.POINTWISE, ops.REDUCTION, ops.NORMALIZATION):
            return self._compute(node, name)
        return self._make(node, name, UNSUPPORTED, _tensor_args(node))

    def _aliases(self, node) -> bool:
        """Does the node's value share storage with its first argument's?"""
        src = node.args[0] if node.args else None
        if not isinstance(src, fx.Node) or not isinstance(self.value(src), torch.Tensor):
            return False
        return self.value(node).untyped_storage().data_ptr() == self.value(src).untyped_storage().data_ptr()

    def _cast_or_copy(self, node):
        src = node.args[0]
        out, inp = self.value(node), self.value(src)
        if isinstance(inp, torch.Tensor) and out.dtype == inp.dtype and out.device == inp.device:
            if out.data_ptr() == inp.data_ptr() and out.shape == inp.shape:
                return self._make(node, "identity", COMPUTE, (src,))
            return self._make(node, "copy", COMPUTE, (src,))
        if isinstance(inp, torch.Tensor) and out.device != inp.device:
            return self._make(node, "to_device", UNSUPPORTED, (src,))
        return self._make(node, "cast", COMPUTE, (src,), {"dtype": out.dtype})

    def _view(self, node):
        src = node.args[0]
        if (
            node.target is operator.getitem
            and isinstance(src, fx.Node)
            and op_name(src) in ("chunk", "split", "unbind")
            and isinstance(self.value(src.args[0]), torch.Tensor)
        ):
            return self._view_of(node, src.args[0], covers=(src,))  # x.chunk(2)[i] is a slice of x
        if not isinstance(src, fx.Node) or not isinstance(self.value(src), torch.Tensor):
            return self._make(node, op_name(node), META)
        if node.target is operator.getitem and isinstance(self.value(src), torch.Tensor):
            index = node.args[1]
            index = index if isinstance(index, tuple) else (index,)
            if len(index) == 1 and self._row_gather(src, index[0]):
                return self._make(node, "gather_rows", COMPUTE, (src, index[0]))
            if any(isinstance(i, fx.Node) or isinstance(i, torch.Tensor) for i in index):
                return self._make(node, "index", UNSUPPORTED, (src,) + tuple(i for i in index if isinstance(i, fx.Node)))
        return self._view_of(node, src)

    def _index_arithmetic(self, node, name: str, value) -> bool:
        """Integer pointwise math a kernel computes exactly (``perm // top_k``): an op with an
        integer expression, on tensors of the result's integer dtype and integer literals."""
        if value.dtype not in (torch.int64, torch.int32) or not ops.integer_expression(name) or node.kwargs:
            return False
        for arg in node.args:
            if isinstance(arg, fx.Node):
                operand = self.value(arg)
                if not (isinstance(operand, torch.Tensor) and operand.dtype == value.dtype):
                    return False
            elif not isinstance(arg, int) or isinstance(arg, bool):
                return False
        return name != "floordiv" or (len(node.args) == 2 and ops.integer_divisor(node.args[1]))

    def _row_gather(self, table, index) -> bool:
        """``table[index]``: one row of a table per index, the table token-independent (an
        embedding lookup) or not (MoE's ``hidden[perm // top_k]``, rows of another count)."""
        if not isinstance(index, fx.Node) or self.batch_dims(table) not in ((), (0,)) or self.value(table).dtype not in _KERNEL_DTYPES:
            return False
        idx = self.value(index)
        return (
            isinstance(idx, torch.Tensor)
            and idx.dim() == 1
            and not idx.is_floating_point()
            and self.batch_dims(index) == (0,)
        )

    def _view_of(self, node, src, covers=()):
        if op_name(node) in _MAY_COPY and self._copies(node, src) and not self._reshaped_in_registers(node, src):
            return self._make(node, "reshape_copy", UNSUPPORTED, (src,))
        out, inp = self.value(node), self.value(src)
        if out.data_ptr() == inp.data_ptr() and out.shape == inp.shape and out.stride() == inp.stride():
            return self._make(node, "identity", COMPUTE, (src,))
        shape = self.static_shape(node)
        same_dims = [s for s in shape if s != 1] == [s for s in self.static_shape(src) if s != 1]
        if same_dims and out.numel() == inp.numel() and _same_order(out, inp):
            return self._make(node, "reshape", UNIT_VIEW, (src,), {"shape": shape})
        if op_name(node) in ("expand", "expand_as"):
            return self._make(node, "expand", UNIT_VIEW, (src,), {"shape": shape})
        reshapes = op_name(node) in _REORDER_FREE  # a transpose of the same sizes is no reshape
        if reshapes and out.numel() == inp.numel() and _register_reshape(self.static_shape(src), shape):
            return self._make(node, "reshape", UNIT_VIEW, (src,), {"shape": shape})
        group = self._row_group(src, node)
        if group:  # gathered rows regrouped per token: out[t, j] = src[t * group + j]
            return self._make(node, "group_rows", UNIT_VIEW, (src,), {"group": group})
        columns = self._last_axis_slice(src, out, inp)
        if columns is not None and self._computed(src):
            # A slice of a value a kernel computes: taken in registers when both share a kernel.
            start, stop, step = columns
            attrs = {"start": start, "stop": stop, **({"step": step} if step != 1 else {})}
            return self._make(node, "slice", UNIT_VIEW, (src,), attrs)
        return self._make(
            node, "view", VIEW, (src,),
            {"shape": shape, "stride": tuple(out.stride()), "offset": out.storage_offset() - inp.storage_offset()},
            covers,
        )  # fmt: skip

    def _reshaped_in_registers(self, node, src) -> bool:
        """A reshape that copies in eager (of an expanded or permuted view) but that a kernel
        computing its source does in registers (DeepSeek-V3's group mask spread over experts)."""
        if not self._computed(src) or self.batch_dims(src) != (0,) or self.batch_dims(node) != (0,):
            return False
        return _register_reshape(self.static_shape(src)[1:], self.static_shape(node)[1:])

    def _row_group(self, src, node) -> int | None:
        """``k`` when ``node`` views the rows of a row gather ``src`` as [tokens, k, ...] (MoE's
        ``out[inv_perm].view(T, k, H)``): a kernel over the tokens gathers k rows each."""
        if self.cops.get(src) is None or self.cops[src].op != "gather_rows":
            return None
        if self.batch_dims(src) != (0,) or self.batch_dims(node) != (0,):
            return None
        shapes = [(o.shape, i.shape) for o, i in zip(self.traced.shadows[node.name], self.traced.shadows[src.name])]
        group = shapes[0][0][1] if len(shapes[0][0]) > 1 else None
        for out, inp in shapes:
            if len(out) < 2 or out[1] != group or out[0] * group != inp[0] or tuple(out[2:]) != tuple(inp[1:]):
                return None
        return group

    def _copies(self, node, src) -> bool:
        """Did the reshape copy at either traced size (no view fits its input's layout, as after
        a permute)? Then it is a kernel of its own, not a free view."""
        return any(
            out.numel() and out.untyped_storage().data_ptr() != inp.untyped_storage().data_ptr()
            for out, inp in zip(self.traced.shadows[node.name], self.traced.shadows[src.name])
            if isinstance(out, torch.Tensor) and isinstance(inp, torch.Tensor)
        )

    def _last_axis_slice(self, src, out, inp) -> tuple[int, int, int] | None:
        """(start, stop, step) when ``out`` is ``inp[..., start:stop:step]`` along a non-token
        last axis: a range of columns (step 1), or every other column (``x[..., ::2]``,
        ``x[..., 1::2]``: GPT-OSS's interleaved gate and up)."""
        rank = inp.dim()
        if not rank or out.dim() != rank or out.shape[:-1] != inp.shape[:-1] or out.stride()[:-1] != inp.stride()[:-1]:
            return None
        if (rank - 1) in self.batch_dims(src) or inp.shape[-1] <= 1:
            return None
        column = inp.stride(-1)
        offset = out.storage_offset() - inp.storage_offset()
        if column <= 0 or offset < 0 or offset % column:
            return None
        start = offset // column
        if out.stride(-1) == 2 * column:  # every other column, to the end
            every_other = start in (0, 1) and inp.shape[-1] % 2 == 0 and out.shape[-1] == inp.shape[-1] // 2
            return (start, inp.shape[-1], 2) if every_other else None
        stop = start + out.shape[-1]
        whole = (start, stop) == (0, inp.shape[-1])
        return (start, stop, 1) if out.stride(-1) == column and stop <= inp.shape[-1] and not whole else None

    def _computed(self, node) -> bool:
        """Is ``node`` a value glue computes (not an input or a heavy op's result, or a view of one)?"""
        cop = self.cops.get(node)
        if cop is None or cop.kind not in (COMPUTE, UNIT_VIEW):
            return False
        if cop.op == "identity" or cop.kind == UNIT_VIEW:
            return isinstance(cop.args[0], fx.Node) and self._computed(cop.args[0])
        return True

    def _topk(self, node):
        """``torch.topk`` along a (non-token) last axis, k a constant: one kernel in eager, a
        k-step selection in a row program. ``.values`` and ``.indices`` are free picks of it."""
        params = _bound(node, ("input", "k", "dim", "largest", "sorted"))
        x, k, dim = params.get("input"), params.get("k"), params.get("dim", -1)
        src = self.value(x) if isinstance(x, fx.Node) else None
        if (
            not isinstance(src, torch.Tensor) or not src.dim() or not isinstance(k, int) or not isinstance(dim, int)
            or src.dtype not in (torch.float32, torch.bfloat16, torch.float16)
            or dim % src.dim() != src.dim() - 1 or src.dim() - 1 in self.batch_dims(x)
        ):  # fmt: skip
            return self._make(node, "topk", UNSUPPORTED, _tensor_args(node))
        attrs = {"k": k, "largest": bool(params.get("largest", True)), "sorted": bool(params.get("sorted", True))}
        return self._make(node, "topk", COMPUTE, (x,), attrs)

    def _gather(self, node):
        """``x.gather(-1, index)`` with index shaped like x but for the last axis."""
        params = _bound(node, ("input", "dim", "index"))
        x, dim, index = params.get("input"), params.get("dim"), params.get("index")
        if isinstance(x, fx.Node) and isinstance(index, fx.Node) and isinstance(dim, int) and not params.get("sparse_grad"):
            src, idx = self.value(x), self.value(index)
            rank = src.dim()
            if (
                rank and dim % rank == rank - 1 and idx.dim() == rank and src.shape[:-1] == idx.shape[:-1]
                and rank - 1 not in self.batch_dims(x)
            ):  # fmt: skip
                return self._make(node, "gather_last", COMPUTE, (x, index))
        return self._make(node, "gather", UNSUPPORTED, _tensor_args(node))

    def _scatter(self, node):
        """``x.scatter(-1, index, value)`` with a scalar value and index shaped like x but for
        the last axis: each listed column set to the value (a group or expert mask)."""
        params = _bound(node, ("input", "dim", "index", "value"))
        x, dim, index = params.get("input"), params.get("dim"), params.get("index")
        value = params.get("value", params.get("src"))
        if isinstance(x, fx.Node) and isinstance(index, fx.Node) and isinstance(dim, int) and isinstance(value, (int, float)):
            src, idx = self.value(x), self.value(index)
            rank = src.dim()
            if (
                rank and dim % rank == rank - 1 and idx.dim() == rank and src.shape[:-1] == idx.shape[:-1]
                and rank - 1 not in self.batch_dims(x) and src.is_floating_point() and idx.dtype == torch.int64
                and not params.get("reduce")
            ):  # fmt: skip
                return self._make(node, "scatter_last", COMPUTE, (x, index, float(value)))
        return self._make(node, "scatter", UNSUPPORTED, _tensor_args(node))

    def _cat(self, node):
        parts = node.args[0] if node.args else node.kwargs.get("tensors")
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        rank = self.value(node).dim()
        if not all(isinstance(p, fx.Node) for p in parts) or dim % rank != rank - 1:
            return self._make(node, "cat", UNSUPPORTED, tuple(p for p in parts if isinstance(p, fx.Node)))
        return self._make(node, "cat", COMPUTE, tuple(parts), {"dim": rank - 1})

    def _compute(self, node, name):
        tensors = [a for a in node.args if isinstance(a, fx.Node)]
        if name in BINARY:
            a, b = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("other", node.kwargs.get("exponent"))
            alpha = node.kwargs.get("alpha", 1)
            if alpha != 1:
                return self._make(node, name + "_alpha", UNSUPPORTED, tuple(tensors))
            return self._make(node, name, COMPUTE, (a, b))
        if name in UNARY:
            return self._make(node, name, COMPUTE, (node.args[0],))
        if name == "where":
            return self._make(node, "where", COMPUTE, tuple(node.args[:3]))
        params = self._params(node, name)
        rank = self.value(node.args[0]).dim()
        if name == "clamp":
            low = params.get("min")
            high = params.get("max")
            if op_name(node) == "clamp_max":
                low, high = None, params.get("min", params.get("max"))
            if isinstance(low, fx.Node) or isinstance(high, fx.Node):
                return self._make(node, "clamp_tensor", UNSUPPORTED, tuple(tensors))
            return self._make(node, "clamp", COMPUTE, (node.args[0], low, high))
        if name == "softplus":
            return self._make(node, "softplus", COMPUTE, (node.args[0], params.get("beta", 1.0), params.get("threshold", 20.0)))
        dtype = params.get("dtype")
        if dtype is not None and not (
            dtype == torch.float32 and name in ("sum", "mean")
            or dtype in (torch.float32, torch.bfloat16, torch.float16) and name in ("softmax", "log_softmax")
        ):
            return self._make(node, name + "_dtype", UNSUPPORTED, tuple(tensors))
        # sum / mean with dtype=float32: computed in fp32, as a kernel computes anyway; softmax
        # with a dtype: of the input cast to it.
        dims = _normalize_dims(params.get("dim"), rank)
        if set(dims) & set(self.batch_dims(node.args[0])):
            return self._make(node, f"{name} over tokens", UNSUPPORTED, tuple(tensors))
        attrs = {"dim": dims}
        if dtype is not None:
            attrs["dtype"] = dtype
        if name in REDUCTIONS:
            attrs["keepdim"] = bool(params.get("keepdim", False))
        elif len(dims) != 1:
            return self._make(node, name, UNSUPPORTED, tuple(tensors))
        return self._make(node, name, COMPUTE, (node.args[0],), attrs)

    def _params(self, node, name) -> dict:
        """The call's parameters after the input, by name (positional ones named per the table)."""
        params = dict(zip(_POSITIONAL.get(name, ()), node.args[1:]))
        params.update(node.kwargs)
        return params

    def _gelu(self, node):
        approximate = self._params(node, "gelu").get("approximate", "none")
        op = {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate)
        if op is None:
            return self._make(node, f"gelu[{approximate}]", UNSUPPORTED, _tensor_args(node))
        return self._make(node, op, COMPUTE, (node.args[0],))

    def _masked_fill(self, node):
        """``x.masked_fill(mask, value)`` is ``where(mask, value, x)``."""
        params = self._params(node, "masked_fill")
        mask, value = params.get("mask"), params.get("value")
        if not isinstance(mask, fx.Node) or not isinstance(value, (int, float, bool)):
            return self._make(node, "masked_fill", UNSUPPORTED, _tensor_args(node))
        return self._make(node, "where", COMPUTE, (mask, value, node.args[0]))

    def _layer_norm(self, node):
        """``F.layer_norm(x, (n,), weight, bias, eps)`` over the last (non-token) axis."""
        params = self._params(node, "layer_norm")
        x, shape = node.args[0], params.get("normalized_shape")
        weight, bias, eps = params.get("weight"), params.get("bias"), params.get("eps", 1e-5)
        rank = self.value(x).dim()
        if (
            not isinstance(shape, (tuple, list, torch.Size)) or len(shape) != 1 or rank - 1 in self.batch_dims(x)
            or not all(w is None or isinstance(w, fx.Node) for w in (weight, bias)) or not isinstance(eps, (int, float))
        ):  # fmt: skip
            return self._make(node, "layer_norm", UNSUPPORTED, _tensor_args(node))
        return self._make(node, "layer_norm", COMPUTE, (x, weight, bias), {"dim": (rank - 1,), "eps": float(eps)})

    def _max_along(self, node):
        """``torch.max(x, dim)`` / ``min``: a (values, indices) pair, read through its parts."""
        name = op_name(node)
        params = _bound(node, ("input", "dim", "keepdim"))
        x, dim = params.get("input"), params.get("dim")
        src = self.value(x) if isinstance(x, fx.Node) else None
        if (
            not isinstance(src, torch.Tensor) or not src.dim() or not isinstance(dim, int)
            or src.dtype not in (torch.float32, torch.bfloat16, torch.float16) or dim % src.dim() in self.batch_dims(x)
        ):  # fmt: skip
            return self._make(node, name, UNSUPPORTED, _tensor_args(node))
        attrs = {"dim": (dim % src.dim(),), "keepdim": bool(params.get("keepdim", False))}
        return self._make(node, f"{name}_along", META, (x,), attrs)  # no kernel: its parts are the ops

    def _sort(self, node):
        """``torch.sort(x, dim, descending, stable=)``: a (values, indices) pair, read through
        its parts (``element`` nodes naming the part). No template lowers a sort by itself."""
        params = _bound(node, ("input", "dim", "descending"))
        x = params.get("input")
        rank = self.value(x).dim() if isinstance(x, fx.Node) else 0
        dim = params.get("dim", -1)
        attrs = {
            "dim": dim % rank if isinstance(dim, int) and rank else dim,
            "descending": bool(params.get("descending", False)),
            "stable": bool(params.get("stable", False)),
        }
        return self._make(node, "sort", UNSUPPORTED, (x,), attrs)

    def _histc(self, node):
        """``torch.histc(x, bins, min, max)``: bins, min and max are literal arguments (a
        pattern may capture them as parameters)."""
        params = _bound(node, ("input", "bins", "min", "max"))
        args = (params.get("input"), params.get("bins", 100), params.get("min", 0), params.get("max", 0))
        return self._make(node, "histc", UNSUPPORTED, args)

    def _cumsum(self, node):
        """``torch.cumsum(x, dim, dtype=)``: the dim and the dtype of the result (with or
        without ``dtype=``) are attributes."""
        params = _bound(node, ("input", "dim"))
        x, dim = params.get("input"), params.get("dim")
        rank = self.value(node).dim()
        attrs = {"dim": dim % rank if isinstance(dim, int) and rank else dim, "dtype": self.value(node).dtype}
        return self._make(node, "cumsum", UNSUPPORTED, (x,), attrs)

    def _stack(self, node):
        parts = node.args[0] if node.args else node.kwargs.get("tensors")
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        rank = self.value(node).dim()
        tokens = self.batch_dims(node)
        if not all(isinstance(p, fx.Node) for p in parts) or not isinstance(dim, int) or (tokens and dim % rank <= max(tokens)):
            return self._make(node, "stack", UNSUPPORTED, tuple(p for p in parts if isinstance(p, fx.Node)))
        return self._make(node, "stack", COMPUTE, tuple(parts), {"dim": dim % rank})

    def _repeat_interleave(self, node):
        params = self._params(node, "repeat_interleave")
        x, repeats, dim = node.args[0], params.get("repeats"), params.get("dim")
        rank = self.value(node).dim()
        if not isinstance(repeats, int) or isinstance(repeats, bool) or not isinstance(dim, int) or dim % rank in self.batch_dims(x):
            return self._make(node, "repeat_interleave", UNSUPPORTED, _tensor_args(node))
        return self._make(node, "repeat_interleave", COMPUTE, (x,), {"repeats": repeats, "dim": dim % rank})

    def _constant(self, node, name):
        if any(writes_into(u, node) for u in node.users):
            # A buffer written in place (``mask = zeros_like(s); mask.scatter_(...)``): its value
            # changes after it is made, so no kernel may compute it and read it later.
            return self._make(node, f"{name} written in place", UNSUPPORTED)
        value = _CONSTANTS[name]
        if value is None:  # full(size, v), full_like(x, v), x.new_full(size, v)
            at = 2 if name == "new_full" else 1
            value = node.args[at] if len(node.args) > at else node.kwargs.get("fill_value")
        if not isinstance(value, (int, float, bool)):
            return self._make(node, name, UNSUPPORTED, _tensor_args(node))
        return self._make(node, "full", COMPUTE, (), {"value": value})

    # --- rewrites of spelling variants -------------------------------------------------------
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


def _same_order(out: torch.Tensor, inp: torch.Tensor) -> bool:
    """Does the view keep its input's elements in order (it only inserts or drops size-1
    dims)? A transpose of a square matrix has the same sizes but not the same order."""
    return [(s, t) for s, t in zip(out.shape, out.stride()) if s != 1] == [
        (s, t) for s, t in zip(inp.shape, inp.stride()) if s != 1
    ]


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


def _part_index(result, which):
    """The position of the part ``which`` (an index or a field name) of a tuple result."""
    if isinstance(which, str):
        field = getattr(result, which, None)
        return next((i for i, v in enumerate(result) if v is field), which)
    return which if isinstance(which, int) else None


def _bound(node: fx.Node, names: tuple[str, ...]) -> dict:
    """The call's arguments by name: the positional ones named by ``names``, and the keywords."""
    return {**dict(zip(names, node.args)), **node.kwargs}


def _holds_tensors(value) -> bool:
    return isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value)


def _register_reshape(src: tuple, dst: tuple) -> bool:
    """A reshape a kernel can do in registers: equal leading dims, then powers of two only; or
    the last axis split into (a, b) or merged back from it, b a power of two (padding a block's
    dims to powers of two then keeps every element where the reshape puts it: [448] padded to
    [512] is [7, 64] padded to [8, 64])."""
    p = 0
    while p < min(len(src), len(dst)) and src[p] == dst[p]:
        p += 1
    tail_src, tail_dst = src[p:], dst[p:]
    if not (tail_src or tail_dst) or math.prod(tail_src) != math.prod(tail_dst):
        return False
    if all(s > 0 and s & (s - 1) == 0 for s in tail_src + tail_dst):
        return True
    split, merged = sorted((tail_src, tail_dst), key=len, reverse=True)
    inner = split[-1] if len(split) == 2 else 0
    return len(split) == 2 and len(merged) == 1 and inner > 0 and inner & (inner - 1) == 0


def _tensor_args(node: fx.Node) -> tuple:
    found = []
    fx.node.map_arg((node.args, node.kwargs), found.append)
    return tuple(found)


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


def eager_launches(cop: COp) -> int:
    """Kernel launches this node costs when run eagerly (views and no-ops cost none)."""
    if cop.kind in (COMPUTE, MUTATION, UNSUPPORTED) and cop.op != "identity":
        return _EAGER_LAUNCHES.get(cop.op, 1)
    return 0


#: Ops that launch more than one kernel eagerly: fuser.idioms' arange and index write.
_EAGER_LAUNCHES = {"inverse_permutation": 2}


