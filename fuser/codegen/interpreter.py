"""interpreter: whether fused kernels can run in this process on a machine without CUDA —
in Triton's CPU interpreter, which Triton chooses once, when it is imported."""

from __future__ import annotations

import os
import sys


def interpreter_problem() -> str | None:
    """Why no fused kernel can run in this process, or None: on a machine without CUDA, triton
    was imported with its interpreter off. Triton builds its own ``@jit`` helpers (``tl.sigmoid``
    and the like) when it is imported, interpreted or compiled as ``TRITON_INTERPRET`` said then;
    compiled ones fail inside an interpreted kernel (``Cannot call @triton.jit'd outside of the
    scope of a kernel``), whatever the variable says now."""
    triton = sys.modules.get("triton")
    if triton is None:
        return None
    import torch

    if torch.cuda.is_available():
        return None
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(standard.sigmoid, InterpretedFunction):
        return None
    now = os.environ.get("TRITON_INTERPRET")
    said = "TRITON_INTERPRET=1 was set after triton was imported" if now == "1" else (
        f"TRITON_INTERPRET={now}" if now is not None else "TRITON_INTERPRET was not set"
    )
    return (
        f"triton runs compiled here ({said}) and this machine has no CUDA GPU, so no fused kernel can run: "
        "set TRITON_INTERPRET=1 in the environment before Python starts (`TRITON_INTERPRET=1 python ...`), "
        "or in os.environ before anything imports triton (import fuser first: it sets it; transformers and "
        "torch's own ops may import triton)"
    )
