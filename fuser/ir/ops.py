"""ops: the one table of the canonical ops fuser knows, and how each lowers.

Every canonical op (a :class:`fuser.canon.canonicalize.COp`'s ``op``) that a row program can compute has one
:class:`Op` entry in :data:`TABLE`: its name, the spellings that canonicalise to it, how many
operands it takes, what kind of op it is, how it treats axes, and how it lowers:

* a ``pointwise`` op lowers to a Triton expression over its operands' fp32 values, given as a
  format string (``"tl.exp({a})"``) or as a function that composes other entries of the table
  (:func:`expr`): a decomposition, as Inductor's decomposition table and tinygrad's
  ``code_for_op`` do. Functions written once for the whole kernel (``expm1_f32``) are named in
  ``helpers`` and defined in templates/_row_program.py.jinja.
* any other op names the lowering that writes it (``lowering``): a function registered under
  that name with ``@lowering(name)`` in its family's module under fuser/lower/ (layout,
  reductions, normalizations, row_gathers), which takes the lowerer explicitly.
* a pointwise op that PyTorch also computes on integer tensors (index arithmetic such as
  ``perm // top_k``) gives its expression over the integer operands too (``integer``).

canon reads the spellings, parameter names and kinds; regions asks :func:`lowers`; lower reads
the expressions, the axis behaviour and the lowering. Adding an op is one entry here (plus a
golden test in tests/kernels/test_ops_golden.py), and, if it is not pointwise and no existing
lowering fits, one ``@lowering`` function beside its family's others.

    Op("log1p", POINTWISE, 1, _log1p)                     # an expression (here a function)
    Op("argmax", REDUCTION, 1, lowering="argmax", result=INDEX_RESULT, params=("dim", "keepdim"))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

# --- kinds --------------------------------------------------------------------------------------
POINTWISE = "pointwise"  # one result element per element of its (broadcast) operands
REDUCTION = "reduction"  # combines values along ``dim`` (dropped unless ``keepdim``)
NORMALIZATION = "normalization"  # combines values along ``dim``; the result keeps the input's shape
LAYOUT = "layout"  # moves values without arithmetic: reshapes, slices, concatenation, stacking
INDEX = "index"  # reads values at positions it computes: gathers, top-k
CONSTANT = "constant"  # a value every element of which is the same literal

# --- result dtypes (besides the one eager promotes to) ------------------------------------------
SAME = "same"
BOOL_RESULT = "bool"
INDEX_RESULT = "index"  # int64 positions, only stored (a row program does no integer math)

SQRT1_2 = 0.7071067811865476  # 1/sqrt(2): exact gelu is x * Phi(x) = x/2 * (1 + erf(x/sqrt(2)))
SQRT_2_OVER_PI = 0.7978845608028654  # the tanh approximation's sqrt(2/pi)


@dataclass(frozen=True)
class Op:
    name: str
    kind: str
    arity: int | None  # operands in the canonical form (tensors and scalars); None: a list
    triton: str | Callable[..., str] | None = None  # pointwise: the expression over {a}, {b}, {c}
    lowering: str | None = None  # otherwise: the name of its lowering (fuser.lower.registry)
    spellings: tuple[str, ...] = ()  # other method / function names of the same op
    params: tuple[str, ...] = ()  # positional parameter names after the input (method and torch.*)
    commutative: bool = False
    result: str = SAME
    whole_block: bool = False  # needs the whole last axis in one program (it is never tiled)
    helpers: tuple[str, ...] = ()  # jit functions its expression calls
    integer: str | Callable[..., str] | None = None  # pointwise on integer tensors: the integer expression

    def render(self, *operands: str | None) -> str:
        """The Triton expression for operand expressions ``operands`` (pointwise ops only)."""
        return render(self.triton, *operands)


def render(triton: str | Callable[..., str], *operands: str | None) -> str:
    """A pointwise expression (a format string over {a}, {b}, {c}, or a function) applied to
    operand expressions (None for an operand left out, as clamp's missing bound)."""
    if isinstance(triton, str):
        return triton.format(**dict(zip("abc", operands)))
    return triton(*operands)


def number(operand: str | None) -> float | None:
    """The value of a literal operand expression (``"2.0"``, ``"float('inf')"``), else None."""
    if operand is None:
        return None
    try:
        return float(operand.replace("float(", "").replace(")", "").strip("'"))
    except ValueError:
        return None


# --- decompositions -----------------------------------------------------------------------------
def expr(name: str, *operands: str) -> str:
    """Op ``name`` of the table applied to ``operands``: how one entry is written in others."""
    return TABLE[name].render(*operands)


def _gelu(a: str) -> str:
    return f"0.5 * {a} * (1.0 + {expr('erf', f'{a} * {SQRT1_2!r}')})"


def _round(a: str) -> str:
    """Round half to even, as ``torch.round``: floor(x + 0.5), one less at an odd tie; x itself
    from 2^23 on (every fp32 there is an integer, and x + 0.5 would round); a zero keeps x's sign."""
    nearest = f"tl.floor({a} + 0.5)"
    odd_tie = f"(({nearest}) - ({a}) == 0.5) & (({nearest}) - 2.0 * tl.floor(({nearest}) * 0.5) == 1.0)"
    rounded = f"tl.where({odd_tie}, {nearest} - 1.0, {nearest})"
    signed = f"tl.where({rounded} == 0.0, ({a}) * 0.0, {rounded})"
    return f"tl.where(tl.abs({a}) >= 8388608.0, {a}, {signed})"


#: selu's constants, as PyTorch's kernel has them (its negative branch scales by their product).
SELU_ALPHA, SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946


def _elu(a: str, alpha: str, input_scale: str) -> str:
    """ELU (and CELU, ``input_scale`` 1 / alpha): x above 0, else alpha * expm1(x * input_scale)."""
    return f"tl.where({a} > 0.0, {a}, expm1_f32({a} * {input_scale}) * {alpha})"


def _selu(a: str) -> str:
    return f"tl.where({a} > 0.0, {a} * {SELU_SCALE!r}, expm1_f32({a}) * {SELU_ALPHA * SELU_SCALE!r})"


def _mish(a: str) -> str:
    """``x * tanh(log1p(exp(x)))``, as PyTorch's kernel (no softplus threshold)."""
    return f"{a} * {expr('tanh', expr('log1p', f'tl.exp({a})'))}"


def _log_sigmoid(a: str) -> str:
    """``min(x, 0) - log1p(exp(-|x|))``: log(sigmoid(x)) without overflow, as PyTorch's kernel."""
    return f"tl.minimum({a}, 0.0) - {expr('log1p', f'tl.exp(-tl.abs({a}))')}"


def _gelu_tanh(a: str) -> str:
    inner = f"{SQRT_2_OVER_PI!r} * ({a} + 0.044715 * {a} * {a} * {a})"  # as PyTorch: x + k * x^3
    return f"0.5 * {a} * (1.0 + {expr('tanh', inner)})"


def _log1p(a: str) -> str:
    # log(1 + a) loses a's low bits in the rounding of 1 + a; the second term puts them back
    # (u - 1 - a is that rounding error, exactly): accurate near 0, and exact where 1 + a == 1.
    u = f"(1.0 + {a})"
    return f"tl.log({u}) - (({u} - 1.0) - {a}) / {u}"


def _clamp(a: str, low: str | None, high: str | None) -> str:
    if low is not None:
        a = f"tl.maximum({a}, {low}, propagate_nan=tl.PropagateNan.ALL)"
    if high is not None:
        a = f"tl.minimum({a}, {high}, propagate_nan=tl.PropagateNan.ALL)"
    return a


def _softplus(a: str, beta: str, threshold: str) -> str:
    beta, threshold = float(number(beta)), float(number(threshold))
    scaled = f"({a} * {beta!r})"
    soft = f"tl.log(1.0 + tl.exp({scaled})) / {beta!r}"
    return f"tl.where({scaled} > {threshold!r}, {a}, {soft})"


# Integer powers up to this are products, as PyTorch computes x**2 and x**3 (and exactly so).
def _lerp(a: str, b: str, w: str) -> str:
    """``a + w * (b - a)`` for |w| < 0.5, else ``b - (b - a) * (1 - w)``: PyTorch's two forms,
    each exact at its end."""
    return f"tl.where(tl.abs({w}) < 0.5, {a} + {w} * ({b} - {a}), {b} - ({b} - {a}) * (1.0 - {w}))"


def _addcmul(x: str, a: str, b: str, value: str) -> str:
    return f"{x} + {value} * {a} * {b}"


def _addcdiv(x: str, a: str, b: str, value: str) -> str:
    return f"{x} + {value} * ({a} / {b})"


_POWER_BY_PRODUCT = 4


def _pow(a: str, b: str) -> str:
    """``a ** b``: a product for small integer exponents, else exp2(b * log2|a|) with the sign
    of a negative base (NaN for a non-integer exponent, as in PyTorch)."""
    exponent, base = number(b), number(a)
    if exponent is not None and exponent == int(exponent) and 0 < abs(exponent) <= _POWER_BY_PRODUCT:
        product = " * ".join([a] * int(abs(exponent)))
        return f"({product})" if exponent > 0 else f"1.0 / ({product})"
    if exponent == 0:
        return f"tl.where({a} == {a}, 1.0, 1.0)"  # x ** 0 is 1, NaN included
    if base is not None and base > 0:
        return f"tl.exp2({b} * {math.log2(base)!r})"  # a positive scalar base
    magnitude = f"tl.exp2({b} * tl.log2(tl.abs({a})))"
    if exponent is not None:  # a scalar exponent: its parity is known here
        if exponent != int(exponent):
            return f"tl.where({a} < 0.0, float('nan'), {magnitude})"
        return f"tl.where({a} < 0.0, -{magnitude}, {magnitude})" if int(exponent) % 2 else magnitude
    odd = f"({b} - 2.0 * tl.floor({b} * 0.5) == 1.0)"
    signed = f"tl.where(tl.floor({b}) == {b}, tl.where({odd}, -{magnitude}, {magnitude}), float('nan'))"
    return f"tl.where(({b} == 0.0) | ({a} == 1.0), 1.0, tl.where({a} < 0.0, {signed}, {magnitude}))"


def _floordiv(a: str, b: str) -> str:
    """``a // b`` of integers by a positive literal, rounding toward minus infinity as PyTorch
    does. Only non-negative numerators meet ``//`` here, where every convention agrees."""
    return f"tl.where({a} >= 0, {a} // {b}, -((-{a} + ({b} - 1)) // {b}))"


def integer_divisor(b) -> bool:
    """Can ``_floordiv`` divide by ``b`` (a positive integer literal)?"""
    return isinstance(b, int) and not isinstance(b, bool) and b > 0


_REDUCE = ("dim", "keepdim")

# --- the table ----------------------------------------------------------------------------------
_ENTRIES = [
    # unary pointwise
    Op("neg", POINTWISE, 1, "{a} * -1.0", spellings=("negative",), integer="-{a}"),  # -0.0 for 0.0 (Triton's -x is 0 - x)
    Op("abs", POINTWISE, 1, "tl.abs({a})", spellings=("absolute",)),
    Op("exp", POINTWISE, 1, "tl.exp({a})"),
    Op("exp2", POINTWISE, 1, "tl.exp2({a})"),
    Op("expm1", POINTWISE, 1, "expm1_f32({a})", helpers=("expm1_f32",)),
    Op("log", POINTWISE, 1, "tl.log({a})"),
    Op("log2", POINTWISE, 1, "tl.log2({a})"),
    Op("log1p", POINTWISE, 1, _log1p),
    Op("sqrt", POINTWISE, 1, "tl.sqrt_rn({a})"),
    Op("rsqrt", POINTWISE, 1, "tl.rsqrt({a})"),
    Op("reciprocal", POINTWISE, 1, "1.0 / {a}"),
    Op("sigmoid", POINTWISE, 1, "tl.sigmoid({a})"),
    Op("tanh", POINTWISE, 1, "tanh_f32({a})", helpers=("expm1_f32", "tanh_f32")),
    Op("silu", POINTWISE, 1, "{a} * tl.sigmoid({a})"),
    Op("relu", POINTWISE, 1, "tl.maximum({a}, 0.0)"),
    Op("gelu", POINTWISE, 1, _gelu, params=("approximate",)),
    Op("gelu_tanh", POINTWISE, 1, _gelu_tanh, helpers=("expm1_f32", "tanh_f32")),
    Op("erf", POINTWISE, 1, "tl.erf({a})"),
    Op("leaky_relu", POINTWISE, 2, "tl.where({a} > 0.0, {a}, {a} * {b})", params=("negative_slope",)),
    Op("elu", POINTWISE, 3, _elu, helpers=("expm1_f32",), params=("alpha",)),  # (x, alpha, input scale)
    Op("selu", POINTWISE, 1, _selu, helpers=("expm1_f32",)),
    Op("hardsigmoid", POINTWISE, 1, "tl.minimum(tl.maximum({a} + 3.0, 0.0), 6.0) / 6.0"),
    Op("hardswish", POINTWISE, 1, "{a} * tl.minimum(tl.maximum({a} + 3.0, 0.0), 6.0) / 6.0"),
    Op("mish", POINTWISE, 1, _mish, helpers=("expm1_f32", "tanh_f32")),
    Op("log_sigmoid", POINTWISE, 1, _log_sigmoid),
    Op("sin", POINTWISE, 1, "tl.sin({a})"),
    Op("cos", POINTWISE, 1, "tl.cos({a})"),
    Op("square", POINTWISE, 1, "{a} * {a}"),
    Op("floor", POINTWISE, 1, "tl.floor({a})"),
    Op("ceil", POINTWISE, 1, "tl.ceil({a})"),
    Op("round", POINTWISE, 1, _round, params=("decimals",)),  # decimals=0 only
    Op("trunc", POINTWISE, 1, "tl.where({a} >= 0.0, tl.floor({a}), tl.ceil({a}))", spellings=("fix",)),
    Op("sign", POINTWISE, 1, "tl.where({a} > 0.0, 1.0, tl.where({a} < 0.0, -1.0, 0.0))"),  # NaN: 0, as PyTorch
    Op("softsign", POINTWISE, 1, "{a} / (tl.abs({a}) + 1.0)"),
    Op("tanhshrink", POINTWISE, 1, "{a} - tanh_f32({a})", helpers=("expm1_f32", "tanh_f32")),
    Op("sinh", POINTWISE, 1, "0.5 * (expm1_f32({a}) - expm1_f32(-{a}))", helpers=("expm1_f32",)),
    Op("cosh", POINTWISE, 1, "0.5 * (tl.exp({a}) + tl.exp(-{a}))"),
    Op("copy", POINTWISE, 1, "{a}"),
    Op("logical_not", POINTWISE, 1, "{a} == 0", spellings=("invert", "bitwise_not"), result=BOOL_RESULT),
    # binary pointwise
    Op("add", POINTWISE, 2, "{a} + {b}", commutative=True, integer="{a} + {b}"),
    Op("sub", POINTWISE, 2, "{a} - {b}", spellings=("subtract",), integer="{a} - {b}"),
    Op("mul", POINTWISE, 2, "{a} * {b}", spellings=("multiply",), commutative=True, integer="{a} * {b}"),
    Op("floordiv", POINTWISE, 2, spellings=("floor_divide",), integer=_floordiv),  # integers only
    Op("div", POINTWISE, 2, "{a} / {b}", spellings=("true_divide",)),
    # a number over a tensor, ``c / x``: PyTorch's ``Tensor.__rtruediv__`` is ``x.reciprocal() * c``,
    # the reciprocal rounded to x's dtype first (attribute ``numerator``)
    Op("rdiv", POINTWISE, 1, lowering="rdiv"),
    Op("pow", POINTWISE, 2, _pow),
    # the sign of b's bits (-0.0 and a negative NaN included), on |a|
    Op("copysign", POINTWISE, 2, "tl.where({b}.to(tl.int32, bitcast=True) < 0, tl.abs({a}) * -1.0, tl.abs({a}))"),
    Op("heaviside", POINTWISE, 2, "tl.where({a} == 0.0, {b}, tl.where({a} > 0.0, 1.0, 0.0))"),
    Op("xlogy", POINTWISE, 2, "tl.where({b} != {b}, {b}, tl.where({a} == 0.0, 0.0, {a} * tl.log({b})))"),
    Op("hardshrink", POINTWISE, 2, "tl.where(tl.abs({a}) > {b}, {a}, 0.0)", params=("lambd",)),
    Op("softshrink", POINTWISE, 2, "tl.where({a} > {b}, {a} - {b}, tl.where({a} < -{b}, {a} + {b}, 0.0))",
       params=("lambd",)),  # fmt: skip
    Op("maximum", POINTWISE, 2, "tl.maximum({a}, {b}, propagate_nan=tl.PropagateNan.ALL)",
       spellings=("max_elementwise",), commutative=True),  # fmt: skip
    Op("minimum", POINTWISE, 2, "tl.minimum({a}, {b}, propagate_nan=tl.PropagateNan.ALL)", commutative=True),
    Op("eq", POINTWISE, 2, "{a} == {b}", commutative=True, result=BOOL_RESULT, integer="{a} == {b}"),
    Op("ne", POINTWISE, 2, "{a} != {b}", commutative=True, result=BOOL_RESULT, integer="{a} != {b}"),
    Op("lt", POINTWISE, 2, "{a} < {b}", result=BOOL_RESULT, integer="{a} < {b}"),
    Op("le", POINTWISE, 2, "{a} <= {b}", result=BOOL_RESULT, integer="{a} <= {b}"),
    Op("gt", POINTWISE, 2, "{a} > {b}", result=BOOL_RESULT, integer="{a} > {b}"),
    Op("ge", POINTWISE, 2, "{a} >= {b}", result=BOOL_RESULT, integer="{a} >= {b}"),
    Op("logical_and", POINTWISE, 2, "({a} != 0) & ({b} != 0)", spellings=("and_", "bitwise_and"),
       commutative=True, result=BOOL_RESULT),  # fmt: skip
    Op("logical_or", POINTWISE, 2, "({a} != 0) | ({b} != 0)", spellings=("or_", "bitwise_or"),
       commutative=True, result=BOOL_RESULT),  # fmt: skip
    # ternary pointwise: where(condition, a, b), clamp(x, low, high), softplus(x, beta, threshold)
    Op("where", POINTWISE, 3, "tl.where({a}, {b}, {c})"),
    Op("clamp", POINTWISE, 3, _clamp, spellings=("clip", "clamp_min", "clamp_max"), params=("min", "max")),
    Op("softplus", POINTWISE, 3, _softplus, params=("beta", "threshold")),
    Op("threshold", POINTWISE, 3, "tl.where({a} > {b}, {a}, {c})"),  # F.threshold(x, threshold, value)
    Op("lerp", POINTWISE, 3, _lerp),  # torch.lerp(start, end, weight)
    Op("addcmul", POINTWISE, 4, _addcmul),  # torch.addcmul(x, a, b, value=v): x + v * a * b
    Op("addcdiv", POINTWISE, 4, _addcdiv),  # torch.addcdiv(x, a, b, value=v): x + v * a / b
    Op("cast", POINTWISE, 1, lowering="cast"),  # to the dtype of the result (attribute ``dtype``)
    # reductions and normalizations over non-token axes
    Op("sum", REDUCTION, 1, lowering="reduce", params=_REDUCE),
    Op("mean", REDUCTION, 1, lowering="reduce", params=_REDUCE),
    Op("amax", REDUCTION, 1, lowering="reduce", params=_REDUCE),
    Op("amin", REDUCTION, 1, lowering="reduce", params=_REDUCE),
    Op("logsumexp", REDUCTION, 1, lowering="logsumexp", params=_REDUCE),
    Op("argmax", REDUCTION, 1, lowering="argmax", params=_REDUCE, result=INDEX_RESULT),
    Op("argmin", REDUCTION, 1, lowering="argmax", params=_REDUCE, result=INDEX_RESULT),
    Op("softmax", NORMALIZATION, 1, lowering="softmax", params=("dim",)),
    Op("log_softmax", NORMALIZATION, 1, lowering="softmax", params=("dim",)),
    Op("layer_norm", NORMALIZATION, 3, lowering="layer_norm", params=("normalized_shape", "weight", "bias", "eps")),
    Op("rms_norm", NORMALIZATION, 2, lowering="rms_norm", params=("normalized_shape", "weight", "eps")),  # F.rms_norm
    Op("cumsum", NORMALIZATION, 1, lowering="cumsum", params=("dim",)),  # a running sum along a short axis
    Op("vector_norm", REDUCTION, 1, lowering="vector_norm", params=_REDUCE),  # attribute ``ord``: 1, 2, inf, p
    Op("var", REDUCTION, 1, lowering="moments", params=_REDUCE),  # attribute ``correction``
    Op("std", REDUCTION, 1, lowering="moments", params=_REDUCE),
    Op("normalize", NORMALIZATION, 1, lowering="normalize"),  # F.normalize: x / max(p-norm, eps)
    # layout
    Op("reshape", LAYOUT, 1, lowering="layout"),
    Op("expand", LAYOUT, 1, lowering="layout"),
    Op("slice", LAYOUT, 1, lowering="pairs_and_parts", whole_block=True),
    Op("cat", LAYOUT, None, lowering="pairs_and_parts", whole_block=True),
    Op("stack", LAYOUT, None, lowering="stack", whole_block=True),
    Op("cat_units", LAYOUT, None, lowering="cat_units", whole_block=True),  # cat along a middle axis, parts one wide
    Op("repeat_interleave", LAYOUT, 1, lowering="repeat_interleave", params=("repeats", "dim"), whole_block=True),
    Op("repeat", LAYOUT, 1, lowering="repeat", whole_block=True),  # x.repeat(...) along non-token axes
    Op("pad", LAYOUT, 1, lowering="pad", whole_block=True),  # F.pad(x, (left, right), value=v) on the last axis
    Op("view_as_complex", LAYOUT, 1, lowering="pairs_and_parts", whole_block=True),
    Op("view_as_real", LAYOUT, 1, lowering="pairs_and_parts", whole_block=True),
    Op("conj", LAYOUT, 1, lowering="pairs_and_parts", whole_block=True),
    # indexing
    Op("gather_rows", INDEX, 2, lowering="pairs_and_parts", whole_block=True),
    Op("gather_last", INDEX, 2, lowering="pairs_and_parts", whole_block=True),
    # torch.gather of a table spread over the tokens, one position per token: the table's row there
    Op("gather_table", INDEX, 2, lowering="gather_table", whole_block=True),
    Op("scatter_last", INDEX, 3, lowering="scatter_last", whole_block=True),  # x.scatter(-1, index, value)
    Op("scatter_src_last", INDEX, 3, lowering="scatter_src_last", whole_block=True),  # x.scatter(-1, index, src)
    Op("index_add_last", INDEX, 3, lowering="index_add_last", whole_block=True),  # x.index_add(-1, index, source)
    Op("group_rows", INDEX, 1, lowering="group_rows", whole_block=True),  # a row gather's rows, k per token
    Op("topk", INDEX, 1, lowering="topk", whole_block=True),
    Op("topk_values", INDEX, 1, lowering="pairs_and_parts", whole_block=True),
    Op("topk_indices", INDEX, 1, lowering="pairs_and_parts", whole_block=True, result=INDEX_RESULT),
    # constants: zeros_like(x), torch.full((T, n), v), x.new_ones(...), ... (attribute ``value``)
    Op("full", CONSTANT, 0, lowering="full"),
]

TABLE: dict[str, Op] = {op.name: op for op in _ENTRIES}
#: another spelling -> its canonical name
SPELLINGS: dict[str, str] = {s: op.name for op in _ENTRIES for s in op.spellings}

#: every op that combines values along an axis (a row program with one is a row reduction)
REDUCING = frozenset(n for n, op in TABLE.items() if op.kind in (REDUCTION, NORMALIZATION))
#: ops that need the whole last axis in one program
WHOLE_BLOCK = frozenset(n for n, op in TABLE.items() if op.whole_block)
#: ops whose operands' order does not matter
COMMUTATIVE = frozenset(n for n, op in TABLE.items() if op.commutative)


def pointwise(arity: int) -> frozenset[str]:
    """The pointwise ops of ``arity`` operands that canon reads as ``op(*args)``."""
    return frozenset(n for n, op in TABLE.items() if op.kind == POINTWISE and op.arity == arity and (op.triton or op.integer))


def integer_expression(name: str):
    """The integer expression of pointwise op ``name``, or None when it has none."""
    op = TABLE.get(name)
    return op.integer if op else None


def lowers(name: str) -> bool:
    """Can a row program compute op ``name``?"""
    return name in TABLE


def kind(name: str) -> str | None:
    op = TABLE.get(name)
    return op.kind if op else None
