"""kernel: a fused kernel as the planning passes (:mod:`fuser.pipeline.passes`) make it and
:mod:`fuser.validate.against_eager` checks it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from fuser.codegen.emit import KernelSpec
from fuser.regions.builder import Region


@dataclass
class Kernel:
    """A fused kernel: the region it computes, its file, its launcher, its spec, and the
    kernels it replaced (so that a merged one that fails validation can fall back to them)."""

    region: Region
    path: Any
    launch: Callable
    spec: KernelSpec | None = None
    parts: list["Kernel"] = field(default_factory=list)  # the kernels it replaced (merged, or stored in place)
