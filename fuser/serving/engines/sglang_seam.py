"""sglang_seam: fuser in place of sglang's ``compile_in_capture_mode``.

sglang 0.5.23 wraps two DeepSeek-V4 glue closures in ``compile_in_capture_mode``
(``model_executor/runner_utils/capture_mode.py``): ``hc_pre_torch_impl``
(``models/deepseek_v4.py``) and ``post_torch_impl`` (``models/deepseek_v4_mhc.py``). The
decorator runs at every call of the enclosing function and, while capture mode is on,
returns ``torch.compile(func)``: Dynamo and Inductor then run inside sglang's capture
warm-ups, on the capture stream, and the compiled code is captured (SGLANG.md §1.6).

:func:`register` replaces it through sglang's ``HookRegistry`` (a REPLACE hook, which also
rebinds every ``from ... import compile_in_capture_mode`` copy already loaded; modules loaded
later import the replacement) with :func:`compile_in_capture_mode` below: while capture mode
is on, the closure goes to a :class:`fuser.serving.closures.ClosureSeam`, which fuses it at its
first call on a stream that is not capturing (sglang's warm-ups) and runs the fused forward at
every later call, inside the capture too. A decode call of a layer under fuser's splice
(:mod:`fuser.serving.lazy_fusion`) outside capture mode, an eager decode step with a batch
larger than any captured, goes to the seam as well (sglang's decorator would run the closure
as written there), so that step runs the fused closures, guarded as in capture mode.
``torch.compile`` is never called.
``FUSER_COMPILE_SEAM=0`` leaves sglang's decorator as it is.
"""

from __future__ import annotations

import logging
import sys

import torch

from fuser.serving.closures import ClosureSeam
from fuser.serving.lazy_fusion import mode_active
from fuser.serving.options import Options

log = logging.getLogger("fuser")

CAPTURE_MODE = "sglang.srt.model_executor.runner_utils.capture_mode"
SEAM_TARGET = f"{CAPTURE_MODE}.compile_in_capture_mode"

_SEAM: ClosureSeam | None = None


def _capture_mode_on() -> bool:
    """sglang's own flag: on for the warm-ups and the capture of every graph."""
    return bool(sys.modules[CAPTURE_MODE].is_capture_mode)


def _seam_on() -> bool:
    """Capture mode (sglang's warm-ups and graphs), or a decode call of a spliced layer outside
    it (an eager decode step: a batch larger than any captured one)."""
    return _capture_mode_on() or mode_active()


def seam() -> ClosureSeam:
    """This process's closure seam (made at first use, with the options of that moment)."""
    global _SEAM
    if _SEAM is None:
        _SEAM = ClosureSeam(Options.from_env(), _seam_on)
    return _SEAM


def compile_in_capture_mode(func):
    """fuser's ``compile_in_capture_mode``: the closure, fused instead of compiled while capture
    mode is on or a spliced layer runs a decode call; the closure itself otherwise (as sglang's
    decorator leaves it outside capture mode)."""
    if torch.compiler.is_compiling():
        return func  # inside sglang's --enable-torch-compile model: Dynamo sees the code
    return seam().decorate(func)


def register() -> None:
    """Register the REPLACE hook (``HookRegistry.apply_hooks`` applies it)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(SEAM_TARGET, compile_in_capture_mode, HookType.REPLACE)


def is_fusers(value) -> bool:
    """Is ``value`` fuser's decorator, or sglang's REPLACE wrapper around it?"""
    if value is compile_in_capture_mode:
        return True
    for cell in getattr(value, "__closure__", None) or ():
        try:
            if cell.cell_contents is compile_in_capture_mode:
                return True
        except ValueError:  # an empty cell
            continue
    return False


def bindings() -> dict[str, bool]:
    """Every loaded sglang module holding a ``compile_in_capture_mode``: is it fuser's?"""
    return {name: is_fusers(module.__dict__["compile_in_capture_mode"])
            for name, module in list(sys.modules.items())
            if name.startswith("sglang") and "compile_in_capture_mode" in getattr(module, "__dict__", {})}


def rebind_stale_copies() -> list[str]:
    """Rebind any sglang module that still holds sglang's own decorator (one imported in an
    unusual way after the hook was applied); the names of those rebound."""
    capture_mode = sys.modules.get(CAPTURE_MODE)
    current = getattr(capture_mode, "compile_in_capture_mode", None)
    if current is None or not is_fusers(current):
        return []
    original = getattr(current, "__wrapped__", None)
    rebound = []
    for name, module in list(sys.modules.items()):
        if name.startswith("sglang") and original is not None and getattr(module, "compile_in_capture_mode", None) is original:
            module.compile_in_capture_mode = current
            rebound.append(name)
    return rebound


__all__ = ["bindings", "compile_in_capture_mode", "is_fusers", "rebind_stale_copies", "register", "seam"]
