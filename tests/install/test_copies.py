"""Copies PyTorch must make (a reshape of a view no view fits) run as fuser's copy kernel
(fuser.install.copies): bit for bit PyTorch's copy, over odd shapes and every dtype, at every T."""

import pytest
import torch
import torch.nn as nn
from transformers.integrations.sdpa_attention import repeat_kv

import fuser


class RepeatKV(nn.Module):
    """transformers' GQA before attention: the key heads repeated, as a copy."""

    def __init__(self, n_rep: int):
        super().__init__()
        self.n_rep = n_rep

    def forward(self, keys):
        return repeat_kv(keys, self.n_rep)


class Flattened(nn.Module):
    """A permuted result flattened: ``z.transpose(1, 2).reshape(T, -1)`` (DSv4's einsum output)."""

    def forward(self, z):
        return z.transpose(1, 2).reshape(z.shape[0], -1)


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool]


def _make(shape, dtype):
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, shape)
    return torch.randn(shape).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, n_rep, slots, dim", [(2, 3, 7, 8), (5, 2, 5, 24), (3, 4, 33, 16)])
def test_a_repeated_kv_copy_is_the_copy_kernel_and_bit_exact(dtype, heads, n_rep, slots, dim):
    module = RepeatKV(n_rep)
    keys = _make((5, heads, slots, dim), dtype)
    report = fuser.apply(module, (keys,))
    assert [c.pattern for c in report.chains] == ["copy"], report.text()
    assert report.launches_after == report.launches_before and not report.unfused
    for T in (1, 2, 9):
        keys = _make((T, heads, slots, dim), dtype)
        with torch.no_grad():
            assert torch.equal(module(keys), repeat_kv(keys, n_rep))
    fuser.restore(module)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("a, b", [(3, 5), (8, 64), (1, 7)])
def test_a_permuted_view_flattened_is_copied_bit_exact(dtype, a, b):
    module = Flattened()
    z = _make((4, a, b), dtype)
    report = fuser.apply(module, (z,))
    assert [c.pattern for c in report.chains] == (["copy"] if a > 1 and b > 1 else []), report.text()
    for T in (1, 6):
        z = _make((T, a, b), dtype)
        with torch.no_grad():
            assert torch.equal(module(z), z.transpose(1, 2).reshape(T, -1))
    fuser.restore(module)


def test_the_copy_kernel_is_a_view_where_one_fits_as_reshape_is():
    """At a shape where the view fits (here a contiguous source), reshape makes no copy, and
    neither does the kernel's launcher: it returns the view, sharing the source's memory."""
    import importlib.util

    module = Flattened()
    report = fuser.apply(module, (torch.randn(4, 3, 5),))
    (chain,) = report.chains
    fuser.restore(module)
    spec = importlib.util.spec_from_file_location("copy_under_test", chain.path)
    kernel = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernel)
    strided = torch.randn(6, 3, 5).transpose(1, 2)
    contiguous = strided.contiguous()
    for x in (strided, contiguous):
        (got,) = kernel.launch(x)
        assert torch.equal(got, x.reshape(6, 15))
        assert (got.data_ptr() == x.data_ptr()) == (x is contiguous)
