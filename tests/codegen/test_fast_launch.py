"""fuser.codegen.fast_launch: the first launch of a key takes Triton's dispatch and keeps the
binary; a later launch of the same key calls the binary's launcher with the same arguments and
the constexprs in order; anything that could change Triton's specialization is a new key. On the
CPU with stand-ins for the kernel and its binary (the GPU tests launch every fused kernel
through it)."""

import pytest
import torch

from fuser.codegen import fast_launch
from fuser.codegen.fast_launch import FastLaunch


class Binary:
    """A compiled kernel's stand-in: records each direct launch."""

    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.launches = []

    def run(self, g0, g1, g2, stream, function, metadata, launch_metadata, enter, exit_, *args):
        self.launches.append(((g0, g1, g2), stream, args))


class Kernel:
    """A @triton.jit kernel's stand-in: ``kernel[grid](...)`` is Triton's dispatch, counted;
    each new specialization (dtype, alignment, ==1, %16) gets a binary of its own."""

    arg_names = ["x_ptr", "x_stride", "n", "BLOCK", "EVEN"]

    def __init__(self):
        self.dispatched, self.binaries = [], {}

    def __getitem__(self, grid):
        def dispatch(*args, **kwargs):
            self.dispatched.append((grid, args, kwargs))
            spec = tuple((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor)
                         else (a == 1, a % 16 == 0) if isinstance(a, int) else type(a) for a in args)  # fmt: skip
            return self.binaries.setdefault((spec, tuple(kwargs.items())), Binary())

        return dispatch


@pytest.fixture
def on_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)


def test_a_key_seen_before_launches_its_binary_directly(on_a_gpu):
    kernel = Kernel()
    launch = FastLaunch(kernel)
    x = torch.zeros(64)
    first = launch[(3,)](x, 32, 5, BLOCK=16, EVEN=True)
    second = launch[(4, 2)](x, 32, 7, BLOCK=16, EVEN=True)
    assert len(kernel.dispatched) == 1 and second is first
    assert first.launches == [((4, 2, 1), 7, (x, 32, 7, 16, True))]


@pytest.mark.parametrize(
    "change",
    [
        lambda x: ((x[1:], 32, 5), {}),  # a pointer no longer 16-byte aligned
        lambda x: ((x.double(), 32, 5), {}),  # another dtype
        lambda x: ((x, 1, 5), {}),  # an integer equal to 1
        lambda x: ((x, 33, 5), {}),  # an integer no longer divisible by 16
        lambda x: ((x, 32, 2**40), {}),  # a 64-bit integer
        lambda x: ((x, 32, 5), {"BLOCK": 32}),  # another constexpr
    ],
    ids=["alignment", "dtype", "equal-to-1", "divisibility", "width", "constexpr"],
)
def test_a_change_triton_could_specialize_on_takes_its_dispatch(on_a_gpu, change):
    kernel = Kernel()
    launch = FastLaunch(kernel)
    x = torch.zeros(64)
    launch[(1,)](x, 32, 5, BLOCK=16, EVEN=True)
    args, constexprs = change(x)
    launch[(1,)](*args, **{"BLOCK": 16, "EVEN": True, **constexprs})
    assert len(kernel.dispatched) == 2


def test_a_launch_hook_or_an_unknown_argument_always_takes_the_dispatch(on_a_gpu, monkeypatch):
    kernel = Kernel()
    launch = FastLaunch(kernel)
    x = torch.zeros(64)
    for _ in range(2):
        launch[(1,)](x, 32, object(), BLOCK=16, EVEN=True)
    assert len(kernel.dispatched) == 2
    launch[(1,)](x, 32, 5, BLOCK=16, EVEN=True)
    monkeypatch.setattr(fast_launch.knobs.runtime.launch_enter_hook, "calls", [lambda *a: None])  # a profiler's
    launch[(1,)](x, 32, 5, BLOCK=16, EVEN=True)
    assert len(kernel.dispatched) == 4


def test_a_constexpr_left_to_its_default_always_takes_the_dispatch(on_a_gpu):
    kernel = Kernel()
    launch = FastLaunch(kernel)
    x = torch.zeros(64)
    for _ in range(2):
        launch[(1,)](x, 32, 5, BLOCK=16)  # EVEN: the kernel's default, not known here
    assert len(kernel.dispatched) == 2


def test_only_compiled_kernels_are_wrapped():
    """A JITFunction is wrapped; a kernel of Triton's CPU interpreter, or anything else, is not."""
    import triton
    from triton.runtime.jit import JITFunction

    def body(x_ptr):
        pass

    assert isinstance(fast_launch.fast(JITFunction(body)), FastLaunch)
    interpreted = triton.jit(body)
    assert not isinstance(interpreted, JITFunction) and fast_launch.fast(interpreted) is interpreted
    assert fast_launch.fast(len) is len


@pytest.mark.gpu
def test_on_the_gpu_a_fused_kernel_launches_directly_and_a_misaligned_input_gets_its_own_binary():
    import fuser
    from fuser.codegen.emit import _LOADED

    class Block(torch.nn.Module):
        def forward(self, x):
            h = x.float()
            return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * 2).to(x.dtype) + x

    block = Block().cuda()
    x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    fuser.apply(block, (x,))
    launchers = {id(v): v for launch in _LOADED.values() for v in launch.__globals__.values() if isinstance(v, FastLaunch)}
    assert launchers, "the fused kernels are launched through FastLaunch"
    buffer = torch.randn(8 * 256 + 1, device="cuda", dtype=torch.bfloat16)
    misaligned = buffer[1:].view(8, 256)  # 2 bytes past a 16-byte boundary
    for inputs in (x, x + 1, misaligned, misaligned * 3, x):
        expected = Block.forward(block, inputs)
        assert torch.equal(block(inputs), expected)
    assert any(len(launcher.binaries) >= 2 for launcher in launchers.values())
