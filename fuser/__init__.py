"""fuser: fuse the glue of LLM decode layers into Triton kernels, without torch.compile.

    report = fuser.apply(module, example_inputs)   # trace, match, emit, validate, splice
    fuser.restore(module)                          # undo
"""

from fuser.api import CheckResult, FuserError, apply, check, explain, plan
from fuser.emit import CaptureCompileError
from fuser.opaque import is_opaque, opaque
from fuser.pattern import Param, PatternError, tensor
from fuser.report import Report
from fuser.splice import is_fused, restore
from fuser.trace import TraceRefused, trace

__all__ = [
    "apply", "restore", "explain", "check", "plan", "trace", "opaque", "is_opaque", "is_fused",
    "Param", "tensor", "Report", "CheckResult", "FuserError", "PatternError", "TraceRefused", "CaptureCompileError",
]  # fmt: skip
