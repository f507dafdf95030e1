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
from fuser.codegen.interpreter import interpreter_problem
from fuser.install.splice import call_counts as stats
from fuser.install.splice import is_fused
from fuser.ir.opaque import is_opaque, opaque
from fuser.ir.report import Report
from fuser.model.fuse_model import ModelReport
from fuser.model.lazy_model import restore
from fuser.pattern import Param, PatternError, tensor
from fuser.trace.refusal import TraceRefused
from fuser.trace.state_objects import trace_through


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


if _TRITON_BEFORE_FUSER and interpreter_problem():  # (an explicit TRITON_INTERPRET=0 is the user's choice)
    import warnings

    warnings.warn(f"fuser: {interpreter_problem()}", RuntimeWarning, stacklevel=2)

__all__ = [
    "__version__", "interpreter_problem", "apply", "restore", "explain", "check", "plan", "stats", "opaque", "is_opaque", "is_fused", "trace_through",
    "Param", "tensor", "Report", "ModelReport", "CheckResult", "FuserError", "PatternError", "TraceRefused", "CaptureCompileError",
]  # fmt: skip
