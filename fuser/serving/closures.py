"""closures: the closure seam (:class:`ClosureSeam`), fuser in place of an engine's
``torch.compile`` on nested helper functions (closures): each is fused at its first call on a
stream that is not capturing, keyed by its code object and the contents of its closure cells."""

from __future__ import annotations

import functools
import inspect
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from fuser.serving.fuse_on_call import Unfusable, fuse_now, give_up, log_fused, postponed_by_capture
from fuser.serving.options import Options


class ClosureModule(torch.nn.Module):
    """A closure as a module fuser can apply to: ``forward`` calls it, with its signature."""

    def __init__(self, function: Callable):
        super().__init__()
        self.function = function

    def extra_repr(self) -> str:
        return where(self.function)


def closure_module(function: Callable) -> ClosureModule:
    """A :class:`ClosureModule` for ``function``, of a class named after it (the report's name)."""
    signature = inspect.signature(function)

    def forward(self, *args, **kwargs):
        return self.function(*args, **kwargs)

    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    forward.__signature__ = signature.replace(parameters=[self_parameter, *signature.parameters.values()])
    cls = type(function.__name__, (ClosureModule,), {"forward": forward, "__module__": function.__module__})
    return cls(function)


def where(function: Callable) -> str:
    """``file:line`` of a function's definition."""
    code = function.__code__
    return f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}"


def closure_key(function: Callable) -> tuple | None:
    """The code object and the identity of each closure cell's contents, or None when a cell
    is empty. The cells themselves are new at each call of the enclosing function; what
    they hold (``self``, a config) is what makes two closures the same computation."""
    contents = []
    for cell in function.__closure__ or ():
        try:
            contents.append(cell.cell_contents)
        except ValueError:
            return None
    return (function.__code__, tuple(id(c) for c in contents))


def _has_proxy(values) -> bool:
    return any(isinstance(v, torch.fx.Proxy) for v in values)


class FusedClosure:
    """One closure (code object + cell contents): its module, its state and its report."""

    def __init__(self, function: Callable):
        self.function = function  # holds the cell contents, so their ids stay theirs
        self.name = f"{function.__qualname__} ({where(function)})"
        self.module = closure_module(function)
        self.state = "waiting"  # -> "fused" | "eager"
        self.report = None
        self.warned_capture = False


class ClosureSeam:
    """``decorate(function)`` stands in for an engine's ``torch.compile`` decorator on nested
    helpers. While ``active()`` holds (sglang: capture mode, or a decode call of a layer under
    the splice) the decorated closure is fused at
    its first call on a stream that is not capturing, and every later call of the same code
    with the same cell contents, inside a capture too, runs the fused forward (its guard
    sends other dtypes, shapes or autograd to the closure itself). While ``active()`` does not
    hold, ``decorate`` returns the function as it is. Never calls ``torch.compile``."""

    #: Closures of one code object with different cell contents fused at most (a closure over
    #: a value made afresh at each call would otherwise fuse at every call).
    MAX_VARIANTS = 32

    def __init__(self, options: Options, active: Callable[[], bool]):
        self.options, self.active = options, active
        self.entries: dict[tuple, FusedClosure] = {}
        self.variants: dict[Any, int] = {}
        self.refused: set = set()  # code objects already logged as not keyable
        self.lock = threading.RLock()

    def decorate(self, function: Callable) -> Callable:
        if not self.active():
            return function

        @functools.wraps(function)
        def call(*args, **kwargs):
            return self.call(function, args, kwargs)

        return call

    def call(self, function: Callable, args: tuple, kwargs: dict):
        if _has_proxy(args) or _has_proxy(kwargs.values()):
            return function(*args, **kwargs)  # being traced itself: the trace sees the code
        entry = self.entry(function)
        if entry is None:
            return function(*args, **kwargs)
        if entry.state == "waiting":
            self.fuse(entry, args, kwargs)
        if entry.state == "fused":
            return entry.module(*args, **kwargs)
        return function(*args, **kwargs)

    def entry(self, function: Callable) -> FusedClosure | None:
        key = closure_key(function)
        code = function.__code__
        with self.lock:
            if key is None or (key not in self.entries and self.variants.get(code, 0) >= self.MAX_VARIANTS):
                if code not in self.refused:
                    self.refused.add(code)
                    why = ("a closure cell is empty" if key is None else
                           f"more than {self.MAX_VARIANTS} different closure cell contents")
                    give_up(f"{function.__qualname__} ({where(function)})", why, self.options)
                return None
            entry = self.entries.get(key)
            if entry is None:
                entry = self.entries[key] = FusedClosure(function)
                self.variants[code] = self.variants.get(code, 0) + 1
            return entry

    def fuse(self, entry: FusedClosure, args: tuple, kwargs: dict) -> None:
        with self.lock:
            if entry.state != "waiting":
                return
            if postponed_by_capture(entry, entry.name, self.options):
                return
            tensors = [(n, v) for n, v in inspect.signature(entry.function).bind(*args, **kwargs).arguments.items()
                       if isinstance(v, torch.Tensor)]
            try:
                entry.report = fuse_now(entry.module, args, kwargs, self.options,
                                        batch_inputs=token_major(tensors))
            except Unfusable as e:
                entry.state = "eager"
                give_up(entry.name, str(e), self.options)
                return
            entry.state = "fused"
            log_fused(f"compile seam: {entry.name}", entry.report, self.options)

    def summary(self) -> list[dict]:
        """Each closure seen: its name, state and launches (eager -> fused)."""
        return [{"name": e.name, "state": e.state,
                 "launches": None if e.report is None else [e.report.launches_before, e.report.launches_after]}
                for e in self.entries.values()]


def token_major(tensors: list[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """The batch dims of a closure's tensor arguments: dim 0 of every argument that is not
    a parameter (weights are passed in as arguments too) and has the first such argument's
    row count."""
    activations = [(n, v) for n, v in tensors if not isinstance(v, torch.nn.Parameter) and v.dim() >= 1]
    if not activations:
        return {}
    rows = activations[0][1].shape[0]
    return {n: 0 for n, v in activations if v.shape[0] == rows}
