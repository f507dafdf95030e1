"""refusal: the user's line behind a trace step (or a warning), and the refusal that names it.

Tracing runs the user's code, torch's and fuser's own; a message names the innermost line of
the first kind (the model's file, a helper of its library), never a line of torch or fuser.
Wording a refusal imports nothing and runs none of the user's objects' code beyond the
error's own message; whatever fails while describing falls back to a plainer description.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import sys
import traceback

import torch
import torch.fx as fx

UNKNOWN_LOCATION = "<unknown location>"

_FUSER_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the fuser package
_FUSER_PATTERNS = os.path.join(_FUSER_DIR, "patterns")
_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) for m in (torch, inspect, fx) if getattr(m, "__file__", None)
)


class TraceRefused(Exception):
    """The module does something the tracer will not guess about. Names the user's line."""

    location = UNKNOWN_LOCATION  # file:line of that code, when known


@functools.lru_cache(maxsize=65536)  # asked of every loaded module at every trace
def is_library_file(filename: str) -> bool:
    """Code of torch, Triton, the standard library or fuser itself (its pattern files aside)."""
    path = os.path.abspath(filename)
    if path.startswith(_FUSER_DIR) and not path.startswith(_FUSER_PATTERNS):
        return True
    return path.startswith(_LIBRARY_DIRS) or "/triton/" in path or filename.startswith("<frozen")


def innermost_user_frame(frames) -> traceback.FrameSummary | None:
    """The innermost of ``frames`` outside fuser, torch and the stdlib."""
    return next((f for f in reversed(frames) if not is_library_file(f.filename)), None)


def describe(frame: traceback.FrameSummary | None, code: bool = False) -> str:
    """``file:line`` of ``frame`` (and ``: `code``` with ``code``)."""
    if frame is None:
        return UNKNOWN_LOCATION
    line = (frame.line or "").strip() if code else ""
    return f"{frame.filename}:{frame.lineno}" + (f": `{line}`" if line else "")


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning raised by the caller name the user's line: the
    innermost frame outside fuser, torch and the stdlib that led to the call."""
    frame, level = sys._getframe(1), 1
    while frame is not None and is_library_file(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def module_path(node: fx.Node) -> str:
    """The path of the submodule whose forward traced ``node`` ("" for the traced module's own)."""
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else ""


def source_of(node: fx.Node) -> str:
    """Where a traced node comes from, as a person finds it: the submodule that computed it
    and the user's line (``self_attn.q_norm (transformers/models/qwen3/modeling_qwen3.py:58)``);
    "" when the trace kept neither."""
    module = module_path(node)
    frames = _FRAME.findall(node.stack_trace or "")
    user = next(((f, line) for f, line in reversed(frames) if not is_library_file(f)), None)
    where = f"{_short(user[0])}:{user[1]}" if user else ""
    return f"{module} ({where})" if module and where else module or where


def _short(path: str) -> str:
    """A file's path from its package (``transformers/models/...``) or from the working directory."""
    if "site-packages/" in path:
        return path.rsplit("site-packages/", 1)[1]
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def calling_line() -> str:
    """``file:line`` of the user's code running now."""
    return describe(innermost_user_frame(traceback.extract_stack()))


def error_location(error: Exception) -> str:
    """``file:line`` where ``error`` was raised, outside fuser, torch and the stdlib."""
    if isinstance(error, TraceRefused):
        return error.location
    try:
        return describe(innermost_user_frame(traceback.extract_tb(error.__traceback__)))
    except Exception:  # noqa: BLE001 - a refusal is worded whatever its frames hold
        return UNKNOWN_LOCATION


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message, "" when it has none. Wording a refusal runs no
    more of the user's code than this ``str()``: where that raises (a message built from an
    object that misbehaves), the error's type name stands for it."""
    try:
        text = str(error).strip()
    except Exception:  # noqa: BLE001 - a refusal is worded whatever the error's message does
        return f"{type(error).__name__} (its message could not be read)"
    return text.splitlines()[0] if text else ""


def refuse(what: str, fix: str) -> TraceRefused:
    frame = innermost_user_frame(traceback.extract_stack())
    error = TraceRefused(f"{describe(frame, code=True)}: {what}. {fix}")
    error.location = describe(frame)
    return error
