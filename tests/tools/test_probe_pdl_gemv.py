"""benchmarks/probe_pdl_gemv.py's kernels, in the interpreter (without PDL, which needs a Hopper
GPU): its GEMV equals ``F.linear`` and its glue an RMS norm of the row's first K values."""

import pytest
import torch
import torch.nn.functional as F

from benchmarks import probe_pdl_gemv as probe
from fuser.validate.tolerance import KERNEL, mismatch


@pytest.mark.parametrize("n, k, config", [(32, 64, (8, 32, 4)), (16, 128, (4, 128, 4)), (48, 256, (16, 64, 4))])
def test_the_gemv_is_f_linear(n, k, config):
    torch.manual_seed(0)
    w, x = torch.randn(n, k, dtype=torch.bfloat16), torch.randn(1, k, dtype=torch.bfloat16)
    y = torch.empty(1, n, dtype=torch.bfloat16)
    probe._gemv[(n // config[0],)](x, w, y, K=k, BLOCK_N=config[0], BLOCK_K=config[1], PDL=False, EARLY=False, num_warps=4)
    problem = mismatch(y, F.linear(x, w), "gemv", KERNEL)
    assert problem is None, problem


def test_the_glue_norms_the_first_k_values():
    torch.manual_seed(0)
    x, y = torch.randn(1, 96, dtype=torch.bfloat16), torch.empty(1, 64, dtype=torch.bfloat16)
    probe._glue[(1,)](x, y, K=64, BLOCK=64, PDL=False, num_warps=8)
    first = x[:, :64].float()
    problem = mismatch(y, (first * torch.rsqrt(first.pow(2).mean() + 1e-6)).to(torch.bfloat16), "glue", KERNEL)
    assert problem is None, problem
