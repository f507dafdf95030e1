"""capture_guard: whether a CUDA graph is being captured on the current stream, which the
fused forward, the kernel cache and the serving integration ask before anything that must not
happen inside a capture (a Triton compile, fusing a module)."""

from __future__ import annotations

import torch


def capturing() -> bool:
    """Is the current CUDA stream capturing a graph?"""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
