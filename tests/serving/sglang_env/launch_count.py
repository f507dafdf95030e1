"""The kernels a call launches, counted as it runs (CPU, for the sglang layer scenarios).

:class:`Launches` counts, inside its block, every ATen op that launches a kernel (views, shape
reads and allocations launch none) and every Triton kernel launch (sglang's own, as
``mhc_combine``, and fuser's, each one launch whatever it does inside), sorted into:

* ``glue``: everything besides what follows (the number the plugin is about);
* ``gemm``: the GEMMs (``mm``, ``addmm``, ``bmm``, ``baddbmm``), whoever calls them;
* ``apart``: a named module's whole call, one entry per call (the attention, the routed
  experts: their internals are theirs, not the layer's glue, and on a GPU they are sglang's
  own kernels).

No fused graph and no report is consulted: the counts are what ran.
"""

from __future__ import annotations

import collections
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: ATen ops that launch no kernel: views, aliases, metadata, uninitialised allocations.
NO_LAUNCH = {
    "view", "_unsafe_view", "reshape", "expand", "t", "transpose", "permute", "slice", "select", "unsqueeze",
    "squeeze", "as_strided", "alias", "detach", "empty", "empty_strided", "new_empty", "new_empty_strided",
    "empty_like", "unbind", "split", "split_with_sizes", "chunk", "narrow", "lift_fresh", "_reshape_alias",
    "view_as", "expand_as", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
    "_local_scalar_dense", "item", "set_", "resize_", "_has_compatible_shallow_copy_type", "diagonal",
    "movedim", "unflatten", "flatten", "_to_copy_noop", "record_stream",
}
GEMMS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_mm"}


_ACTIVE: Launches | None = None  # the one counting now


def one_launch(function, name: str):
    """``function`` (a kernel of the engine's that runs its torch reference here, as sglang's
    TileLang Sinkhorn) counted as one glue launch named ``kernel:<name>`` where it is called
    inside :func:`counting`, whatever it runs."""

    def kernel(*args, **kwargs):
        launches = _ACTIVE
        if launches is None:
            return function(*args, **kwargs)
        if not launches.quiet:
            launches.count_glue(f"kernel:{name}")
        with launches.silent():
            return function(*args, **kwargs)

    return kernel


def op_name(func) -> str:
    """``aten.add.Tensor`` -> ``add``; ``aten.add_.Tensor`` -> ``add_``."""
    return func.__name__.split(".")[0] if hasattr(func, "__name__") else str(func)


class Launches(TorchDispatchMode):
    """Inside the block: ``glue``, ``gemm`` (Counters of op names) and ``apart`` (a Counter of
    the names given to :meth:`apart`)."""

    def __init__(self):
        super().__init__()
        self.glue = collections.Counter()
        self.gemm = collections.Counter()
        self.apart = collections.Counter()
        self.sections = collections.Counter()  # glue launched inside each named section
        self.quiet = 0
        self.inside: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.quiet:
            name = op_name(func)
            if func.namespace == "aten" and name in GEMMS:
                self.gemm[name] += 1
            elif func.namespace != "aten" or name not in NO_LAUNCH:
                self.count_glue(name)
        return func(*args, **(kwargs or {}))

    def count_glue(self, name: str) -> None:
        self.glue[name] += 1
        if self.inside:
            self.sections[self.inside[-1]] += 1

    @property
    def glue_launches(self) -> int:
        return sum(self.glue.values())

    @contextlib.contextmanager
    def silent(self):
        self.quiet += 1
        try:
            yield
        finally:
            self.quiet -= 1

    def summary(self) -> dict:
        return {"glue": self.glue_launches, "glue_ops": dict(sorted(self.glue.items())),
                "gemm": sum(self.gemm.values()), "apart": dict(self.apart), "sections": dict(self.sections)}


@contextlib.contextmanager
def counting(apart: dict[str, list[torch.nn.Module]], sections: dict[str, torch.nn.Module] = None):
    """A :class:`Launches` counting inside the block; each Triton kernel launch counts as one
    glue launch named ``triton:<kernel>``; the modules of ``apart[name]`` count as ``name``;
    the glue launched inside ``sections[name]`` is also counted as that section's; a function
    made by :func:`one_launch` counts as one glue launch."""
    from triton.runtime.interpreter import InterpretedFunction

    global _ACTIVE
    launches = _ACTIVE = Launches()
    run = InterpretedFunction.run

    def counted_run(self, *args, grid, warmup, **kwargs):
        if not warmup and not launches.quiet:
            launches.count_glue(f"triton:{self.fn.__name__}")
        with launches.silent():
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    saved = []
    for name, modules in apart.items():
        for module in modules:
            saved.append((module, module.__dict__.get("forward")))
            original = module.forward

            def forward(*args, _original=original, _name=name, **kwargs):
                if not launches.quiet:
                    launches.apart[_name] += 1
                with launches.silent():
                    return _original(*args, **kwargs)

            module.forward = forward
    for name, module in (sections or {}).items():
        saved.append((module, module.__dict__.get("forward")))
        original = module.forward

        def forward(*args, _original=original, _name=name, **kwargs):
            launches.inside.append(_name)
            try:
                return _original(*args, **kwargs)
            finally:
                launches.inside.pop()

        module.forward = forward
    InterpretedFunction.run = counted_run
    try:
        with launches:
            yield launches
    finally:
        _ACTIVE = None
        InterpretedFunction.run = run
        for module, forward in saved:
            if forward is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = forward
