"""fuse_on_call: fusing one module (a layer's fusion target, a closure's module) on one real
call's inputs, outside any CUDA-graph capture (:func:`fuse_now`), and what is logged, or
raised when strict, when it is fused, cannot be fused (:class:`Unfusable`) or is first
called inside a capture."""

from __future__ import annotations

import logging

import torch

from fuser.codegen.capture_guard import capturing
from fuser.serving.options import Options

log = logging.getLogger("fuser")


class Unfusable(Exception):
    """A module or closure fuser leaves eager; the message says which and why."""


def fuse_now(module: torch.nn.Module, args: tuple, kwargs: dict, options: Options, leaves=(), **apply_options):
    """``fuser.apply`` on one real call's inputs (``leaves``: more opaque leaves, the engine's
    classes); the report. Raises :class:`Unfusable` when nothing can be fused (the module is
    then exactly as it was)."""
    import fuser

    apply_options = {**options.apply_options(), **apply_options}
    leaves = [*apply_options.pop("leaves", []), *leaves]
    if leaves:
        apply_options["leaves"] = leaves
    try:
        report = fuser.apply(module, args, example_kwargs=kwargs, **apply_options)
    except fuser.FuserError as e:
        raise Unfusable(str(e)) from e
    if not report.chains:
        fuser.restore(module)
        raise Unfusable(f"no glue to fuse ({report.launches_before} glue launches, none fusible)")
    return report


def give_up(name: str, reason: str, options: Options) -> None:
    """Log that ``name`` stays eager, or raise :class:`fuser.FuserError` when strict."""
    import fuser

    if options.strict:
        raise fuser.FuserError(f"fuser: {name} cannot be fused: {reason}")
    log.warning("fuser: %s left eager: %s", name, reason)


def log_fused(what: str, report, options: Options, note: str = "") -> None:
    """Log that ``what`` was fused (its glue launches, eager -> fused); with ``options.explain``,
    its whole report too, as ``fuser explain`` prints it."""
    log.info("fuser: %s fused: %d glue launches -> %d%s", what, report.launches_before, report.launches_after, note)
    if options.explain:
        log.info("%s", report.text())


def postponed_by_capture(waiting, name: str, options: Options) -> bool:
    """Is the current stream capturing? Then the first call of ``name`` runs eager, logged once
    per ``waiting`` (a :class:`LazyFusion` or :class:`FusedClosure`; raises when strict), and a
    later call outside the capture fuses it."""
    import fuser

    if not capturing():
        return False
    if not waiting.warned_capture:
        waiting.warned_capture = True
        message = (f"fuser: the first call of {name} came during CUDA-graph capture; it runs eager there "
                   "(fuser traces and compiles only outside a capture: a warm-up call fuses it)")
        if options.strict:
            raise fuser.FuserError(message)
        log.warning("%s", message)
    return True
