"""fast_launch: a fused kernel launched through its compiled binary's own launcher.

``kernel[grid](*args, **constexprs)`` goes through Triton's dispatch at every launch: it binds
the arguments, asks Triton's specialization of each one, builds the cache key and looks the
binary up — about 27 µs of host time per launch on an H200's host against 10 µs for the
binary's launcher alone (``benchmarks/probe_launch_overhead.py``). A decode step that is not
replayed from a CUDA graph launches tens of fused kernels, and that time is the step's.

:class:`FastLaunch` stands in for the kernel in a generated module: the first launch of each
*key* goes through Triton's dispatch (which compiles, or finds the binary, and launches it) and
keeps the binary; later launches of the key call the binary's launcher directly. The key is at
least as fine as Triton's specialization, so that a binary is never launched on arguments it
was not built for: each tensor's dtype, device and 16-byte alignment; each integer's equality
to 1, divisibility by 16 and width (32 or 64 bits); each float, bool or None as such; the
constexprs and launch options by value. An argument of any other kind, a launch hook (a
profiler's) or a constexpr left to its default, or a grid given as a function, takes Triton's dispatch every time. In
Triton's CPU interpreter kernels are not wrapped.
"""

from __future__ import annotations

import torch
from triton import knobs
from triton.runtime.jit import JITFunction

_SLOW = object()  # a key whose launches always take Triton's dispatch


def _spec(value):
    """What Triton's specialization may distinguish of one argument; ``_SLOW`` for a kind not known here."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.get_device(), value.data_ptr() % 16 == 0)
    if isinstance(value, bool) or value is None:
        return (type(value), value)
    if isinstance(value, int):
        width = 32 if -(2**31) <= value < 2**31 else 64 if -(2**63) <= value < 2**63 else 65
        return (value == 1, value % 16 == 0, width)
    if isinstance(value, float):
        return float
    return _SLOW


def _hooked() -> bool:
    """Is a launch hook set (a profiler's)? Triton's hooks are chains, empty unless one is added."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(hook is not None and getattr(hook, "calls", True) for hook in hooks)


class FastLaunch:
    """``kernel[grid](*args, **constexprs)`` with Triton's dispatch run once per key (module docstring)."""

    def __init__(self, kernel: JITFunction):
        self.kernel = kernel
        self.params = list(kernel.arg_names)
        self.binaries: dict = {}  # key -> (compiled kernel, the constexprs' values in order) or _SLOW

    def __getattr__(self, name):  # what else is asked of the kernel (its cache, its name) is the kernel's
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict):
        specs = tuple(map(_spec, args))
        key = (specs, tuple(kwargs.items()), torch.cuda.current_device())
        entry = self.binaries.get(key) if _SLOW not in specs and not callable(grid) else _SLOW
        if entry is None or entry is _SLOW or _hooked():
            compiled = self.kernel[grid](*args, **kwargs)
            if entry is None:
                self.binaries[key] = self._entry(compiled, args, kwargs)
            return compiled
        compiled, constexprs = entry
        stream = torch._C._cuda_getCurrentRawStream(key[2])
        compiled.run(
            grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
            compiled.function, compiled.packed_metadata, None, None, None, *args, *constexprs,
        )  # fmt: skip
        return compiled

    def _entry(self, compiled, args: tuple, kwargs: dict):
        """What later launches of this key need: the binary and the constexprs after ``args``."""
        rest = self.params[len(args) :]
        if compiled is None or hasattr(compiled, "result") or any(name not in kwargs for name in rest):
            return _SLOW
        return compiled, tuple(kwargs[name] for name in rest)


def fast(kernel):
    """``kernel`` behind a :class:`FastLaunch` where it is a compiled Triton kernel, else itself."""
    return FastLaunch(kernel) if isinstance(kernel, JITFunction) else kernel
