"""cop: the canonical op (:class:`COp`) that :mod:`fuser.canon.canonicalize` gives every node of a traced
graph, the kinds a node can be, and the small readers of fx nodes canon's parts share."""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

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

# dtypes a kernel reads and writes.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.bool, torch.complex64)
# Functions that make a constant: the value every element gets (None: the fill_value argument).
CONSTANTS = {
    "zeros": 0.0, "zeros_like": 0.0, "new_zeros": 0.0, "ones": 1.0, "ones_like": 1.0, "new_ones": 1.0,
    "full": None, "full_like": None, "new_full": None,
}  # fmt: skip

_OPERATOR_NAMES = {
    operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "div",
    operator.neg: "neg", operator.pow: "pow", operator.eq: "eq", operator.ne: "ne",
    operator.lt: "lt", operator.le: "le", operator.gt: "gt", operator.ge: "ge",
    operator.and_: "bitwise_and", operator.or_: "bitwise_or", operator.invert: "invert",
}  # fmt: skip


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


def through_identities(cops: dict, node):
    """``node`` with no-op nodes looked through (a cast to its own dtype, ``contiguous()``,
    ``detach()``: op ``identity``); anything that is not such a node as it is."""
    while isinstance(node, fx.Node) and node in cops and cops[node].op == "identity":
        node = cops[node].args[0]
    return node


def viewed(cop: "COp | None") -> fx.Node | None:
    """The node ``cop``'s value is a view of (or is: an ``identity``), else None."""
    if cop is None or not (cop.kind in (VIEW, UNIT_VIEW) or cop.op == "identity") or not cop.args:
        return None
    return cop.args[0] if isinstance(cop.args[0], fx.Node) else None


def op_name(node: fx.Node) -> str:
    """A readable name for an fx node's target: 'mul', 'rsqrt', 'mlp.experts', ..."""
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        if node.target in _OPERATOR_NAMES:
            return _OPERATOR_NAMES[node.target]
        return getattr(node.target, "__name__", str(node.target))
    return str(node.target)


def bound_args(node: fx.Node, names: tuple[str, ...]) -> dict:
    """The call's arguments by name: the positional ones named by ``names``, and the keywords."""
    return {**dict(zip(names, node.args)), **node.kwargs}


def tensor_args(node: fx.Node) -> tuple:
    found = []
    fx.node.map_arg((node.args, node.kwargs), found.append)
    return tuple(found)


#: Node meta: the eager launches of nodes a trace rewrite folded into this one (a buffer's fill
#: and its whole writes, :func:`fuser.trace.in_place_idioms.rewrite`); the report counts them.
FOLDED_LAUNCHES = "fuser_folded_launches"


def writes_into(user: fx.Node, buffer: fx.Node) -> bool:
    """Does ``user`` write into ``buffer`` (an index write, an in-place method, an ``out=``)?"""
    if user.target is operator.setitem:
        return user.args[0] is buffer
    if user.op == "call_method" and str(user.target).endswith("_") and user.args and user.args[0] is buffer:
        return True
    return user.kwargs.get("out") is buffer
