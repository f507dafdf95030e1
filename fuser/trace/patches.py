"""patches: the process-wide hooks :class:`~fuser.trace.tracer.ShadowTracer` patches while it
traces, each a context manager that restores the original on exit. ``isinstance`` in traced code
sees through proxies (:class:`shadow_isinstance`); a CUDA stream switch
(:class:`refuse_stream_switches`) or a traced value assigned to a module attribute
(:class:`refuse_module_rebinding`) is refused, naming the user's line; a factory given its
sizes one by one takes traced sizes too (:class:`sizes_one_by_one`).
"""

from __future__ import annotations

import builtins
import sys
import threading

import torch
import torch.fx as fx

from fuser.trace.proxy import ShadowProxy
from fuser.trace.refusal import is_library_file, refuse


class refuse_stream_switches:
    """While tracing, a CUDA stream switch in traced code raises instead of running.

    The fused forward is one sequence of calls on the caller's stream: a fork onto another
    stream, or a wait between streams, would be run once here and lost from the graph. Leaves
    keep them: a leaf runs its own code at run time, and while tracing it runs eagerly (for the
    shadow values) with the tracer's eager depth set, which lets these calls through. Only
    calls from user code on the tracing thread are refused.
    """

    # (owner, attribute, what the message calls it)
    TARGETS = (
        (torch.cuda.StreamContext, "__enter__", "torch.cuda.stream(...)"),
        (torch.cuda, "set_stream", "torch.cuda.set_stream"),
        (torch.cuda.Stream, "wait_stream", "Stream.wait_stream"),
        (torch.cuda.Stream, "wait_event", "Stream.wait_event"),
        (torch.cuda.Stream, "record_event", "Stream.record_event"),
        (torch.cuda.Event, "record", "Event.record"),
        (torch.cuda.Event, "wait", "Event.wait"),
    )

    def __init__(self, tracer):
        self.tracer = tracer  # the ShadowTracer tracing: its eager depth lets a leaf's calls through

    def __enter__(self):
        self._patched = []
        tracer, thread = self.tracer, threading.get_ident()
        for owner, name, what in self.TARGETS:
            original = vars(owner).get(name)
            if original is None:
                continue

            def guarded(*args, __original=original, __what=what, **kwargs):
                caller = sys._getframe(1).f_code.co_filename
                if threading.get_ident() == thread and not tracer._eager_depth and not is_library_file(caller):
                    raise refuse(
                        f"a CUDA stream switch ({__what}) in traced code; the fused graph runs on one stream",
                        "Put the side-stream region (the fork, the work on the other stream and the join) "
                        "in an opaque leaf (@fuser.opaque).",
                    )
                return __original(*args, **kwargs)

            setattr(owner, name, guarded)
            self._patched.append((owner, name, original))
        return self

    def __exit__(self, *exc):
        for owner, name, original in self._patched:
            setattr(owner, name, original)
        return False


class shadow_isinstance:
    """While tracing, ``isinstance(proxy, T)`` in the traced code answers for the traced value.

    Only calls from outside torch, triton and fuser see through proxies; library code keeps
    the real answer (torch's C++ argument parser must never take a proxy for a tensor).
    """

    def __enter__(self):
        _settle_dynamo_builtin_tables()
        self.original = original = builtins.isinstance

        def shadow_isinstance(obj, classes):
            if type(obj) is ShadowProxy and "shadow" in obj.__dict__:
                caller = sys._getframe(1).f_code.co_filename
                if not is_library_file(caller):
                    return original(obj.shadow[0], classes)
            return original(obj, classes)

        builtins.isinstance = shadow_isinstance
        return self

    def __exit__(self, *exc):
        builtins.isinstance = self.original
        return False


def _settle_dynamo_builtin_tables() -> None:
    """Have Dynamo list the builtins before ``isinstance`` is shadowed.

    Dynamo builds its table of builtins by identity the first time it needs it, which may be
    while a trace runs (a traced library calls into ``torch._dynamo``). Built then, the table
    holds the shadow and not ``isinstance`` itself, and every later ``torch.compile`` in the
    process fails on code that calls ``isinstance``.
    """
    try:
        from torch._dynamo import trace_rules
    except ImportError:
        return
    for name in ("_builtin_function_ids", "_builtin_constant_ids"):
        table = getattr(trace_rules, name, None)
        if callable(table):
            table()


class refuse_module_rebinding:
    """While tracing, ``self.attr = <traced value>`` raises: the graph cannot rebind state."""

    def __enter__(self):
        self.original = original = torch.nn.Module.__setattr__

        def guarded(module, name, value):
            if isinstance(value, fx.Proxy):
                raise refuse(
                    f"assigning a traced value to module attribute {name!r} (the fused graph cannot rebind module state)",
                    f"Write it in place (self.{name}.copy_(...)), or make this module an opaque leaf (@fuser.opaque).",
                )
            original(module, name, value)

        torch.nn.Module.__setattr__ = guarded
        return self

    def __exit__(self, *exc):
        torch.nn.Module.__setattr__ = self.original
        return False


class sizes_one_by_one:
    """While tracing, ``torch.zeros(x.shape[0], 8)`` (a factory given its sizes one by one, one
    of them traced) is called as ``torch.zeros((x.shape[0], 8))``: PyTorch's argument parser
    takes a traced size only inside a tuple, as torch.fx's own tracing does."""

    FACTORIES = ("zeros", "ones", "empty", "rand", "randn")

    def __enter__(self):
        self._patched = []
        for name in self.FACTORIES:
            original = getattr(torch, name)

            def packed(*args, __original=original, **kwargs):
                if len(args) > 1 and any(isinstance(a, fx.Proxy) for a in args):
                    args = (args,)
                return __original(*args, **kwargs)

            setattr(torch, name, packed)
            self._patched.append((name, original))
        return self

    def __exit__(self, *exc):
        for name, original in self._patched:
            setattr(torch, name, original)
        return False
