"""rounding: ``to_dtype(x, dtype)`` for the hand-written kernels (decode GEMM, decode attention):
an fp32 value rounded to ``dtype`` as PyTorch rounds it, to nearest even; and
:func:`exact_products`, where their ``tl.dot`` multiplies in fp32.

On the GPU that is Triton's own cast. Triton's CPU interpreter truncates fp32 -> bf16 instead,
so there a bf16 result is rounded in integer arithmetic, as the generated kernels' ``to_bf16``
does (``templates/_kernel_base.py.jinja``); NaN stays NaN.
"""

import os

import torch
import triton
import triton.language as tl

if os.environ.get("TRITON_INTERPRET") == "1":

    @triton.jit
    def to_dtype(x, dtype: tl.constexpr):
        if dtype == tl.bfloat16:
            x = x.to(tl.float32)
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return tl.where(x != x, x, bits.to(tl.float32, bitcast=True)).to(tl.bfloat16)
        return x.to(dtype)

else:

    @triton.jit
    def to_dtype(x, dtype: tl.constexpr):
        return x.to(dtype)


def exact_products(dtype: torch.dtype) -> bool:
    """Does a ``tl.dot`` of ``dtype`` operands multiply them as fp32 (``input_precision="ieee"``)?
    fp32 operands (no tf32 rounding), and bf16 ones in Triton's interpreter (whose bf16 ``tl.dot``
    is wrong; a bf16 product is exact in fp32, as the tensor cores compute it)."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1")
