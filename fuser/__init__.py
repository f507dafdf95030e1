"""fuser: fuse the glue of LLM decode layers into Triton kernels, without torch.compile.

    report = fuser.apply(module, example_inputs)   # trace, match, emit, validate, splice
    fuser.restore(module)                          # undo

On a machine without CUDA, fused kernels run in Triton's CPU interpreter, and Triton reads
``TRITON_INTERPRET`` once, when it is imported: importing fuser first turns the interpreter on
(unless ``TRITON_INTERPRET`` says otherwise). :func:`interpreter_problem` says when triton was
imported before that with the interpreter off — nothing fused can run then.
"""

import os
import sys


_TRITON_BEFORE_FUSER = "triton" in sys.modules  # imported by the user's code (transformers, say), not ours


def _choose_the_interpreter() -> None:
    """Before anything below imports triton: on a machine without CUDA, its interpreter."""
    if _TRITON_BEFORE_FUSER:
        return  # too late to choose: interpreter_problem() says whether it is wrong
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_choose_the_interpreter()

from fuser.api import CheckResult, FuserError, apply, check, explain, plan
from fuser.codegen.emit import CaptureCompileError
from fuser.install.splice import is_fused
from fuser.ir.opaque import is_opaque, opaque
from fuser.ir.report import Report
from fuser.model.fuse_model import ModelReport, restore
from fuser.pattern import Param, PatternError, tensor
from fuser.trace.refusal import TraceRefused


def _version() -> str:
    """The installed distribution's version; in a checkout without one, pyproject.toml's."""
    import importlib.metadata
    import re
    from pathlib import Path

    try:
        return importlib.metadata.version("fuser")
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        found = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M) if pyproject.is_file() else None
        return found.group(1) if found else "unknown"


__version__ = _version()


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


if _TRITON_BEFORE_FUSER and interpreter_problem():  # (an explicit TRITON_INTERPRET=0 is the user's choice)
    import warnings

    warnings.warn(f"fuser: {interpreter_problem()}", RuntimeWarning, stacklevel=2)

__all__ = [
    "__version__", "interpreter_problem", "apply", "restore", "explain", "check", "plan", "opaque", "is_opaque", "is_fused",
    "Param", "tensor", "Report", "ModelReport", "CheckResult", "FuserError", "PatternError", "TraceRefused", "CaptureCompileError",
]  # fmt: skip
