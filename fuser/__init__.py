"""fuser: fuse the glue of LLM decode layers into Triton kernels, without torch.compile.

    report = fuser.apply(module, example_inputs)   # trace, match, emit, validate, splice
    fuser.restore(module)                          # undo
"""

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

__all__ = [
    "__version__", "apply", "restore", "explain", "check", "plan", "opaque", "is_opaque", "is_fused",
    "Param", "tensor", "Report", "ModelReport", "CheckResult", "FuserError", "PatternError", "TraceRefused", "CaptureCompileError",
]  # fmt: skip
