"""shadow_proxy: :class:`ShadowProxy`, the fx proxy of :mod:`fuser.trace.tracer` that carries
the two real values a traced node takes (at batch sizes T and T+1; :mod:`fuser.trace.tracing`).
Metadata reads answer from them: a static size as an ``int``, one that follows the batch as a
node. What the graph cannot replay (a branch on a traced value, a host read) is refused.
"""

from __future__ import annotations

import builtins
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from fuser.trace.refusal import calling_line, refuse


class ShadowProxy(fx.Proxy):
    """A proxy that also carries the two real values the node takes."""

    shadow: tuple[Any, Any]

    # --- metadata reads: static answers where both shadows agree ---------------------------
    def _tensor(self) -> torch.Tensor:
        value = self.shadow[0]
        if not isinstance(value, torch.Tensor):
            raise refuse(f"tensor metadata asked of a {type(value).__name__}", "")
        return value

    def size(self, dim: int | None = None):
        """A dim's size: a literal where both shadows agree, unless a call given state made the
        value (a dynamic cache's keys, whose length grows from call to call): then, as where the
        shadows differ, read at run time."""
        a, b = self.shadow
        if dim is None:
            return tuple(self.size(i) for i in range(a.dim()))
        if a.shape[dim] == b.shape[dim] and self.node not in self.tracer.state_fed:
            return int(a.shape[dim])
        return self.tracer.create_proxy("call_method", "size", (self, dim), {})

    @property
    def shape(self):
        return self.size()

    def dim(self) -> int:
        return self._tensor().dim()

    ndimension = dim

    @property
    def ndim(self) -> int:
        return self._tensor().dim()

    @property
    def dtype(self):
        return self._tensor().dtype

    @property
    def device(self):
        return self._tensor().device

    @property
    def is_cuda(self) -> bool:
        return self._tensor().is_cuda

    def numel(self):
        a, b = self.shadow
        if a.numel() == b.numel() and self.node not in self.tracer.state_fed:
            return a.numel()
        return self.tracer.create_proxy("call_method", "numel", (self,), {})

    def is_contiguous(self, *args, **kwargs) -> bool:
        a, b = self.shadow
        answer = a.is_contiguous(*args, **kwargs)
        if answer != b.is_contiguous(*args, **kwargs):
            raise refuse("is_contiguous() depends on the batch size", "Make the layout static.")
        return answer

    # --- what cannot be traced ---------------------------------------------------------------
    def __bool__(self):
        answer = _decided_for_any_tokens(self.node, self.tracer.shadows)
        if answer is not None:
            # `if x.shape[0] == 0: return ...` (the guard runs no call without tokens), or
            # `assert ids.shape[0] == x.shape[0]` (two sizes that follow the tokens alike)
            return answer
        decided = decided_for_a_token_range(self.node, self.tracer.shadows, self.tracer.tokens)
        if decided is not None:
            # `if x.shape[0] >= 1024:` (sglang's DeepGEMM pre-norm): as traced, for the token
            # counts where the answer stays the same; the guard declines the others
            answer, low, high = decided
            self.tracer.token_ranges.append(TokenRange(low, high, calling_line()))
            return answer
        raise refuse(
            "Python control flow on a traced value (it depends on the batch size or on tensor data)",
            "Branch on static sizes only, or move this code into an opaque leaf (@fuser.opaque).",
        )

    def __len__(self):
        value = self.shadow[0]
        if isinstance(value, (tuple, list)):
            return len(value)
        size = self.size(0)
        if isinstance(size, int):
            return size
        raise refuse("len() of a tensor whose first dim is the batch", "Use x.shape[0] in tensor ops.")

    def __iter__(self):
        value = self.shadow[0]
        if isinstance(value, (tuple, list)):
            return iter([self[i] for i in range(len(value))])
        raise refuse("iteration over a traced tensor", "Index it explicitly or make it an opaque leaf.")

    def _host_sync(self, *args, **kwargs):
        if isinstance(self.shadow[0], int):
            raise refuse(
                "int() of a size that follows the batch (a Python int would fix it at the traced size)",
                "Use the size as it is (x.shape[0]) in the tensor ops that take it.",
            )
        raise refuse(
            "a host read of a traced tensor (.item()/.tolist()/data_ptr(); a sync the graph cannot replay)",
            "Keep it on the device, or move this code into an opaque leaf (@fuser.opaque).",
        )

    item = tolist = numpy = data_ptr = __int__ = __float__ = __index__ = _host_sync

    # --- augmented assignment: in place on a tensor, as PyTorch does it ----------------------
    def _in_place(method: str):
        """``x += y`` on a traced tensor is ``x.add_(y)``, as eager runs it: a write into x that
        its other holders see (the caller's input, a view's base) and that keeps x's dtype; on a
        size (an int), Python's ``x = x + y``. (fx's own proxy has no in-place operators, so the
        write would be traced as a new value.)"""

        def in_place(self, other):
            if not isinstance(self.shadow[0], torch.Tensor):
                return NotImplemented
            return self.tracer.create_proxy("call_method", method, (self, other), {})

        return in_place

    __iadd__, __isub__, __imul__ = _in_place("add_"), _in_place("sub_"), _in_place("mul_")
    __itruediv__, __ifloordiv__, __imod__ = _in_place("div_"), _in_place("floor_divide_"), _in_place("remainder_")
    __ipow__, __iand__, __ior__, __ixor__ = _in_place("pow_"), _in_place("bitwise_and_"), _in_place("bitwise_or_"), _in_place("bitwise_xor_")
    del _in_place

    def __setitem__(self, index, value):
        self.tracer.create_proxy("call_function", operator.setitem, (self, index, value), {})

    def __setattr__(self, name: str, value: Any):
        """``forward_batch.residual_stream = x`` on a state object: a write the graph records
        (:meth:`fuser.trace.tracer.ShadowTracer.write_state`); on any other proxy, the proxy's own
        attribute (``node``, ``tracer``, ``shadow``)."""
        tracer = self.__dict__.get("tracer")
        if name not in _OWN_ATTRIBUTES and tracer is not None and self.node in tracer.state_paths:
            tracer.write_state(self, name, value)
        else:
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)  # private probes (e.g. Parameter's _is_param)
        value = self.shadow[0] if "shadow" in self.__dict__ else None
        attr = getattr(value, name, None)
        if self.node in self.tracer.state_paths and hasattr(value, name) and not callable(attr):
            return self.tracer.read_state(self, name, attr)
        if callable(attr) or attr is None:
            return super().__getattr__(name)  # a method: an fx Attribute, called later
        return self.tracer.create_proxy("call_function", builtins.getattr, (self, name), {})


_OWN_ATTRIBUTES = frozenset({"node", "tracer", "shadow"})

_COMPARISONS = (operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge)


def _decided_for_any_tokens(node: fx.Node, shadows: dict) -> bool | None:
    """The answer of a comparison of sizes that is the same for every token count, else None:

    * a token count (``x.shape[0]``, ``x.numel()``) against an int constant, when the answer is
      the same from one token up (``x.shape[0] == 0``: False);
    * two sizes whose difference is the same in both shadows (``ids.shape[0] == x.shape[0]``,
      ``x.shape[0] + 1 == y.shape[0]``): sizes that follow the tokens grow by the same rows per
      token at every count (each batch input does: :mod:`fuser.trace.token_dims`), so the
      difference, and the answer, is that at every count.
    """
    if node.op != "call_function" or node.target not in _COMPARISONS or len(node.args) != 2:
        return None
    a, b = node.args
    if _follows_tokens(a) and _follows_tokens(b):
        (a0, a1), (b0, b1) = _shadows_of(a, shadows), _shadows_of(b, shadows)
        if a0 - b0 == a1 - b1:
            return bool(node.target(a0 - b0, 0))
    flipped = not isinstance(a, fx.Node)
    size, constant = (b, a) if flipped else (a, b)
    if not _is_size(size) or isinstance(constant, bool) or not isinstance(constant, int):
        return None
    answers = {node.target(constant, n) if flipped else node.target(n, constant) for n in (1, 1 << 40)}
    return answers.pop() if len(answers) == 1 and constant <= 1 else None


_ORDER = (operator.lt, operator.le, operator.gt, operator.ge)


@dataclass(frozen=True)
class TokenRange:
    """The token counts a branch of the trace holds for: ``low`` to ``high`` (None: no end)."""

    low: int
    high: int | None
    where: str  # the line of the branch

    def holds(self, tokens: int) -> bool:
        return self.low <= tokens and (self.high is None or tokens <= self.high)

    def shown(self) -> str:
        return f"{self.low} to {self.high} tokens" if self.high is not None else f"{self.low} tokens or more"


def decided_for_a_token_range(node: fx.Node, shadows: dict, tokens: int | None) -> tuple[bool, int, int | None] | None:
    """A size that follows the tokens (``k * tokens + b``) compared in order with an int
    constant, the same answer at T and T+1: (the answer, the token counts from ``low`` to
    ``high`` where it stays so), else None."""
    if tokens is None or node.op != "call_function" or node.target not in _ORDER or len(node.args) != 2:
        return None
    a, b = node.args
    flipped = not isinstance(a, fx.Node)
    size, constant = (b, a) if flipped else (a, b)
    if not _follows_tokens(size) or not isinstance(size, fx.Node) or isinstance(constant, bool) or not isinstance(constant, int):
        return None
    s0, s1 = _shadows_of(size, shadows)
    per_token = s1 - s0
    if per_token <= 0:
        return None
    base = s0 - per_token * tokens

    def answer(t: int) -> bool:
        s = per_token * t + base
        return bool(node.target(constant, s) if flipped else node.target(s, constant))

    traced, far = answer(tokens), 1 << 40
    if answer(tokens + 1) != traced:
        return None
    # The answer is monotone in the count: it changes once at most, above the traced count or below.
    if answer(1) == traced:
        if answer(far) == traced:
            return traced, 1, None
        kept, changed = tokens, far  # the last count that keeps it
    else:
        kept, changed = tokens, 1  # the first count that gives it
    while abs(kept - changed) > 1:
        middle = (kept + changed) // 2
        kept, changed = (middle, changed) if answer(middle) == traced else (kept, middle)
    return (traced, 1, kept) if changed > kept else (traced, kept, None)


_SUMS = (operator.add, operator.sub)


def _is_size(value) -> bool:
    return isinstance(value, fx.Node) and value.op == "call_method" and value.target in ("size", "numel")


def _follows_tokens(value) -> bool:
    """Is ``value`` an int constant or a size read off a traced tensor, or a sum or difference
    of them, or one times an int constant (a size affine in the token count)?"""
    if isinstance(value, int):
        return not isinstance(value, bool)
    if _is_size(value):
        return True
    if not isinstance(value, fx.Node) or value.op != "call_function" or len(value.args) != 2 or value.kwargs:
        return False
    x, y = value.args
    if value.target in _SUMS:
        return _follows_tokens(x) and _follows_tokens(y)
    if value.target is operator.mul:
        constant = [v for v in (x, y) if isinstance(v, int) and not isinstance(v, bool)]
        return bool(constant) and all(_follows_tokens(v) for v in (x, y))
    return False


def _shadows_of(value, shadows: dict) -> tuple[int, int]:
    return shadows[value.name] if isinstance(value, fx.Node) else (value, value)
