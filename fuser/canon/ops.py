"""canon_ops: the canonical form of ops with more than one spelling or a result in parts
(methods of :class:`fuser.canon.canonicalize.Canonicalizer`): top-k, GELU, masked_fill, layer_norm,
max/min along a dim, sort, histc, cumsum, stack, repeat_interleave, and constants."""

from __future__ import annotations

import torch
import torch.fx as fx

from fuser.ir.canonical_op import COMPUTE, CONSTANTS, META, UNSUPPORTED, bound_args, op_name, tensor_args, writes_into


class OpCanonicals:
    """Methods of :class:`fuser.canon.canonicalize.Canonicalizer` for ops with several spellings."""

    def _topk(self, node):
        """``torch.topk`` along a (non-token) last axis, k a constant: one kernel in eager, a
        k-step selection in a row program. ``.values`` and ``.indices`` are free picks of it."""
        params = bound_args(node, ("input", "k", "dim", "largest", "sorted"))
        x, k, dim = params.get("input"), params.get("k"), params.get("dim", -1)
        src = self.value(x) if isinstance(x, fx.Node) else None
        if (
            not isinstance(src, torch.Tensor) or not src.dim() or not isinstance(k, int) or not isinstance(dim, int)
            or src.dtype not in (torch.float32, torch.bfloat16, torch.float16)
            or dim % src.dim() != src.dim() - 1 or src.dim() - 1 in self.batch_dims(x)
        ):  # fmt: skip
            return self._make(node, "topk", UNSUPPORTED, tensor_args(node))
        attrs = {"k": k, "largest": bool(params.get("largest", True)), "sorted": bool(params.get("sorted", True))}
        return self._make(node, "topk", COMPUTE, (x,), attrs)

    def _gelu(self, node):
        approximate = self._params(node, "gelu").get("approximate", "none")
        op = {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate)
        if op is None:
            return self._make(node, f"gelu[{approximate}]", UNSUPPORTED, tensor_args(node))
        return self._make(node, op, COMPUTE, (node.args[0],))

    def _masked_fill(self, node):
        """``x.masked_fill(mask, value)`` is ``where(mask, value, x)``."""
        params = self._params(node, "masked_fill")
        mask, value = params.get("mask"), params.get("value")
        if not isinstance(mask, fx.Node) or not isinstance(value, (int, float, bool)):
            return self._make(node, "masked_fill", UNSUPPORTED, tensor_args(node))
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
            return self._make(node, "layer_norm", UNSUPPORTED, tensor_args(node))
        return self._make(node, "layer_norm", COMPUTE, (x, weight, bias), {"dim": (rank - 1,), "eps": float(eps)})

    def _max_along(self, node):
        """``torch.max(x, dim)`` / ``min``: a (values, indices) pair, read through its parts."""
        name = op_name(node)
        params = bound_args(node, ("input", "dim", "keepdim"))
        x, dim = params.get("input"), params.get("dim")
        src = self.value(x) if isinstance(x, fx.Node) else None
        if (
            not isinstance(src, torch.Tensor) or not src.dim() or not isinstance(dim, int)
            or src.dtype not in (torch.float32, torch.bfloat16, torch.float16) or dim % src.dim() in self.batch_dims(x)
        ):  # fmt: skip
            return self._make(node, name, UNSUPPORTED, tensor_args(node))
        attrs = {"dim": (dim % src.dim(),), "keepdim": bool(params.get("keepdim", False))}
        return self._make(node, f"{name}_along", META, (x,), attrs)  # no kernel: its parts are the ops

    def _sort(self, node):
        """``torch.sort(x, dim, descending, stable=)``: a (values, indices) pair, read through
        its parts (``element`` nodes naming the part). No template lowers a sort by itself."""
        params = bound_args(node, ("input", "dim", "descending"))
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
        params = bound_args(node, ("input", "bins", "min", "max"))
        args = (params.get("input"), params.get("bins", 100), params.get("min", 0), params.get("max", 0))
        return self._make(node, "histc", UNSUPPORTED, args)

    def _cumsum(self, node):
        """``torch.cumsum(x, dim, dtype=)``: the dim and the dtype of the result (with or
        without ``dtype=``) are attributes."""
        params = bound_args(node, ("input", "dim"))
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
            return self._make(node, "repeat_interleave", UNSUPPORTED, tensor_args(node))
        return self._make(node, "repeat_interleave", COMPUTE, (x,), {"repeats": repeats, "dim": dim % rank})

    def _constant(self, node, name):
        if any(writes_into(u, node) for u in node.users):
            # A buffer written in place (``mask = zeros_like(s); mask.scatter_(...)``): its value
            # changes after it is made, so no kernel may compute it and read it later.
            return self._make(node, f"{name} written in place", UNSUPPORTED)
        value = CONSTANTS[name]
        if value is None:  # full(size, v), full_like(x, v), x.new_full(size, v)
            at = 2 if name == "new_full" else 1
            value = node.args[at] if len(node.args) > at else node.kwargs.get("fill_value")
        if not isinstance(value, (int, float, bool)):
            return self._make(node, name, UNSUPPORTED, tensor_args(node))
        return self._make(node, "full", COMPUTE, (), {"value": value})
