"""Host time of one Triton launch, by the route it takes: ``kernel[grid](...)`` (Triton's
dispatch: binding, specialization key, cache lookup) against the compiled kernel's own
launcher called directly, and a PyTorch elementwise op for scale. The kernel does next to
nothing, so each figure is the host's time per launch (CPU-bound: the GPU keeps up).

    PYTHONPATH=. python benchmarks/probe_launch_overhead.py
"""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.runtime import driver


@triton.jit
def _row_kernel(a_ptr, a_s0, a_s1, b_ptr, b_s0, b_s1, c_ptr, c_s0, c_s1, d_ptr, d_s0, d_s1, n_rows, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    a = tl.load(a_ptr + row * a_s0 + cols * a_s1)
    b = tl.load(b_ptr + row * b_s0 + cols * b_s1)
    c = tl.load(c_ptr + row * c_s0 + cols * c_s1)
    tl.store(d_ptr + row * d_s0 + cols * d_s1, a * b + c)


def per_launch_us(fn, n: int = 3000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    a, b, c, d = (torch.randn(1, 128, device="cuda") for _ in range(4))
    args = (a, *a.stride(), b, *b.stride(), c, *c.stride(), d, *d.stride(), 1)

    def jit_launch():
        _row_kernel[(1,)](a, a.stride(0), a.stride(1), b, b.stride(0), b.stride(1), c, c.stride(0), c.stride(1),
                          d, d.stride(0), d.stride(1), 1, BLOCK=128, num_warps=1)  # fmt: skip

    compiled = _row_kernel[(1,)](*args, BLOCK=128, num_warps=1)
    values = (*args, 128)

    def direct():
        stream = driver.active.get_current_stream(driver.active.get_current_device())
        compiled.run(1, 1, 1, stream, compiled.function, compiled.packed_metadata, None,
                     knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *values)  # fmt: skip

    def direct_with_strides():
        stream = torch.cuda.current_stream().cuda_stream
        compiled.run(1, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
                     a, a.stride(0), a.stride(1), b, b.stride(0), b.stride(1), c, c.stride(0), c.stride(1),
                     d, d.stride(0), d.stride(1), 1, 128)  # fmt: skip

    results = {
        "triton kernel[grid](...)": per_launch_us(jit_launch),
        "compiled.run, arguments ready": per_launch_us(direct),
        "compiled.run, strides read per call": per_launch_us(direct_with_strides),
    }
    assert torch.allclose(d, a * b + c), "the direct launch computed something else"
    results |= {
        "torch.add (PyTorch's dispatch)": per_launch_us(lambda: torch.add(a, b, out=d)),
        "tensor.stride(0) x 8": per_launch_us(lambda: [a.stride(0) for _ in range(8)]),
        "torch.cuda.current_stream()": per_launch_us(lambda: torch.cuda.current_stream().cuda_stream),
    }
    for name, us in results.items():
        print(f"{name:40s} {us:7.2f} µs")


if __name__ == "__main__":
    main()
