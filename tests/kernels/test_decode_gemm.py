"""fuser.install.decode_gemm: the decode GEMM kernel against a float64 reference of
``F.linear`` (plus a residual) over odd and realistic shapes, token counts and each dtype, with
per-dtype tolerances; the table it is chosen by, and bad tables named."""

import json

import pytest
import torch
import torch.nn.functional as F

from fuser.install import decode_gemm
from fuser.install.decode_gemm import Config, DecodeGemmTableError, chunk, config_for, linear, takes

# atol, rtol: fp32 accumulation in another order, then one rounding to the dtype
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1e-2, 1.6e-2)}
SHAPES = [(37, 100), (64, 256), (130, 33), (96, 512)]  # (out features, in features)
# token rows: one; on the CUDA cores (2, CORE_ROWS); by tl.dot (3 padded to 16, and 16)
ROWS = [1, 2, 3, 16]


def reference(x, w, residual=None):
    out = x.double() @ w.double().T
    return (out if residual is None else out + residual.double()).to(x.dtype)


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_the_kernel_is_the_linear_layer(dtype, n, k, rows, residual):
    g = torch.Generator().manual_seed(n * 1000 + k + rows)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    r = torch.randn(rows, n, generator=g).to(dtype) if residual else None
    atol, rtol = TOLERANCES[dtype]
    for config in (Config(block_n=32, block_k=64, warps=4, up_to=16, early=True), Config(block_n=4, block_k=512, warps=4, up_to=16)):
        assert takes(x, w, config)
        got = linear(x, w, config, r)
        torch.testing.assert_close(got, reference(x, w, r), atol=atol, rtol=rtol)
        assert got.dtype == dtype and got.shape == (rows, n)


def rmsnorm(x, weight, eps, form):
    """Each form of the prologue's RMSNorm as eager computes it."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if form == "weight_after_cast":
        return weight * xf.to(x.dtype)
    if form == "weight_in_fp32":
        return (xf * weight).to(x.dtype)
    return (xf * (1.0 + weight.float())).to(x.dtype)


# every form at one row; 2 rows (the CUDA cores') and 3 (tl.dot's) each with one form: the
# interpreter is too slow for every form at each
NORM_ROWS = [(1, form) for form in decode_gemm.NORMS] + [(2, "weight_after_cast"), (3, "one_plus_weight")]


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("n,k", [(37, 100), (96, 512)])
@pytest.mark.parametrize("rows,form", NORM_ROWS)
@pytest.mark.parametrize("added", [False, True], ids=["norm", "add+norm"])
def test_the_kernel_with_the_norm_s_prologue_is_the_norm_then_the_linear_layer(dtype, n, k, rows, form, added):
    g = torch.Generator().manual_seed(n + k + rows)
    x = torch.randn(rows, k, generator=g).to(dtype)
    a = torch.randn(rows, k, generator=g).to(dtype) if added else None
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    h = x + a if added else x
    expected = reference(rmsnorm(h, nw, 1e-5, form), w)
    atol, rtol = TOLERANCES[dtype]
    for config in (Config(block_n=32, block_k=64, warps=4, up_to=16, early=True), Config(block_n=4, block_k=512, warps=4, up_to=16)):
        got = decode_gemm.normed(x, w, config, decode_gemm.Norm(form, nw, 1e-5, a))
        if added:
            got, got_h = got
            assert torch.equal(got_h, h)
        torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)
        gate = decode_gemm.gated(x, torch.cat([w, w.flip(0)]), config, "silu", decode_gemm.Norm(form, nw, 1e-5, a))
        gate = gate[0] if added else gate
        normed_h = rmsnorm(h, nw, 1e-5, form)
        expected_gate = (F.silu(reference(normed_h, w)) * reference(normed_h, w.flip(0))).to(dtype)
        torch.testing.assert_close(gate, expected_gate, atol=2 * atol, rtol=2 * rtol)


def test_the_chunk_narrows_with_the_rows_and_the_reduction():
    assert [chunk(2048, m, 8192) for m in (1, 2, 8, 16)] == [2048, 1024, 256, 128]
    assert chunk(2048, 1, 100) == 128  # never wider than the reduction (a power of 2)
    assert chunk(32, 16, 8192) == 16  # never below 16


def test_the_launch_at_more_rows_is_the_table_s_config_rows_where_it_has_one(monkeypatch):
    launches = []
    monkeypatch.setattr(decode_gemm, "_launch", type("Spy", (), {"__getitem__": lambda self, grid: lambda *a, **k: launches.append((grid, k))})())
    w = torch.randn(64, 32)
    for config in (Config(4, 32, 2, 16), Config(4, 32, 2, 16, rows=(32, 64, 8))):
        for rows in (1, 3):
            linear(torch.randn(rows, 32), w, config)
    said = [(grid[0], k["BLOCK_M"], k["BLOCK_N"], k["BLOCK_K"], k["num_warps"]) for grid, k in launches]
    # one row: the config's; more: its own or config_rows, the rows and columns padded to 16 and the chunk narrowed by 4 rows
    assert said == [(16, 1, 4, 32, 2), (4, 16, 16, 16, 2), (16, 1, 4, 32, 2), (2, 16, 32, 16, 8)]


def test_a_few_rows_keep_the_table_s_columns_and_more_take_tl_dot(monkeypatch):
    launches = []
    monkeypatch.setattr(decode_gemm, "_launch", type("Spy", (), {"__getitem__": lambda self, grid: lambda *a, **k: launches.append((grid, k))})())
    w = torch.randn(64, 256)
    for rows in (2, 3, 16):
        linear(torch.randn(rows, 256), w, Config(8, 256, 2, 16, rows=(4, 512, 4)))
    said = [(grid[0], k["BLOCK_M"], k["BLOCK_N"], k["BLOCK_K"]) for grid, k in launches]
    # up to CORE_ROWS (2): the one row's launch, 8 columns a program and the whole chunk; past it
    # config_rows' by tl.dot: the rows and columns padded to 16, the chunk narrowed by the rows (3 as 4)
    assert decode_gemm.CORE_ROWS == 2
    assert said == [(8, 2, 8, 256), (4, 16, 16, 128), (4, 16, 16, 32)]
    assert [k["num_warps"] for grid, k in launches] == [2, 4, 4]


def test_pdl_is_asked_for_at_one_row_only(monkeypatch):
    launches = []
    monkeypatch.setattr(decode_gemm, "_launch", type("Spy", (), {"__getitem__": lambda self, grid: lambda *a, **k: launches.append(k)})())
    w = torch.randn(16, 32)
    for config in (Config(16, 16, 2, 16, pdl=True), Config(16, 16, 2, 16)):
        for rows in (1, 2):
            linear(torch.randn(rows, 32), w, config)
    assert [(k["PDL"], k["launch_pdl"]) for k in launches] == [(True, True), (False, False), (False, False), (False, False)]


def test_the_early_weight_read_is_asked_for_at_every_row_count(monkeypatch):
    launches = []
    monkeypatch.setattr(decode_gemm, "_launch", type("Spy", (), {"__getitem__": lambda self, grid: lambda *a, **k: launches.append(k)})())
    w = torch.randn(16, 32)
    for config in (Config(16, 16, 2, 16, pdl=True, early=True), Config(16, 16, 2, 16, pdl=True)):
        for rows in (1, 2, 3):
            linear(torch.randn(rows, 32), w, config)
    assert [k["EARLY"] for k in launches] == [True] * 3 + [False] * 3


def test_leading_dims_and_a_strided_input_are_taken():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 1, 80, generator=g)[..., :48]  # rows of 80 elements, 48 read
    w = torch.randn(40, 48, generator=g)
    got = linear(x, w, Config(16, 16, 2, 16))
    assert got.shape == (2, 1, 40)
    torch.testing.assert_close(got, reference(x, w), atol=1e-5, rtol=1e-5)


def test_more_rows_than_the_table_allows_run_pytorch_s(monkeypatch):
    x, w = torch.randn(5, 32), torch.randn(16, 32)
    config = Config(16, 16, 2, up_to=4)
    assert not takes(x, w, config) and takes(x[:4], w, config)
    assert not takes(x.to(torch.float16), w, config) and not takes(x, w, None)
    launched = []
    monkeypatch.setattr(decode_gemm, "_launch", type("Spy", (), {"__getitem__": lambda self, grid: lambda *a, **k: launched.append(grid)})())
    torch.testing.assert_close(linear(x, w, config), F.linear(x, w))
    assert launched == []


def table(tmp_path, entries):
    path = tmp_path / "decode_gemm.json"
    path.write_text(json.dumps({"gpu": "test", "entries": entries}))
    return path


ENTRY = dict(n=64, k=256, dtype="bfloat16", up_to=8, config=dict(block_n=32, block_k=128, warps=4))


def test_the_table_gives_a_config_per_shape_and_dtype(tmp_path, monkeypatch):
    never = dict(ENTRY, n=128, up_to=0)  # measured, never the faster
    rows = dict(ENTRY, n=96, config_rows=dict(block_n=16, block_k=512, warps=8))
    monkeypatch.setenv(decode_gemm.TABLE_ENV, str(table(tmp_path, [ENTRY, never, rows])))
    assert config_for(64, 256, torch.bfloat16) == Config(32, 128, 4, 8)
    assert config_for(96, 256, torch.bfloat16) == Config(32, 128, 4, 8, rows=(16, 512, 8))
    assert config_for(64, 256, torch.float16) is None and config_for(128, 256, torch.bfloat16) is None
    monkeypatch.delenv(decode_gemm.TABLE_ENV)
    assert config_for(64, 256, torch.bfloat16) is None  # no GPU here: no table


@pytest.mark.parametrize(
    "entries,says",
    [
        ({"entries": 3}, "no \"entries\" list"),
        ([dict(ENTRY, config=dict(block_n=32))], "entry 0 needs"),
        ([dict(ENTRY, config=dict(block_n=12, block_k=128, warps=4))], "block_n and block_k powers of 2"),
        ([dict(ENTRY, config=dict(block_n=8, block_k=8, warps=4))], "block_k 16 or more"),
        ([dict(ENTRY, config_rows=dict(block_n=8, block_k=8, warps=4))], "block_k 16 or more"),
        ([dict(ENTRY, config_rows=dict(block_k=8))], "may have a \"config_rows\""),
    ],
)
def test_a_bad_table_is_named_with_what_is_wrong(tmp_path, monkeypatch, entries, says):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(entries if isinstance(entries, dict) else {"entries": entries}))
    monkeypatch.setenv(decode_gemm.TABLE_ENV, str(path))
    with pytest.raises(DecodeGemmTableError, match=str(path)) as e:
        config_for(64, 256, torch.bfloat16)
    assert says in str(e.value)
    monkeypatch.setenv(decode_gemm.TABLE_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(DecodeGemmTableError, match="not a file"):
        config_for(64, 256, torch.bfloat16)


# --- on the GPU: compiled Triton, its fast launcher, the models' shapes ------------------------------
GPU_SHAPES = [(3072, 2048), (2048, 8192), (4096, 4096), (1000, 1000)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("n,k", GPU_SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
def test_compiled_kernel_is_the_linear_layer(dtype, n, k, rows):
    g = torch.Generator("cuda").manual_seed(n + k + rows)
    x = torch.randn(rows, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(dtype)
    r = torch.randn(rows, n, device="cuda", generator=g).to(dtype)
    atol, rtol = TOLERANCES[dtype]
    for config in (Config(16, 128, 4, 16), Config(64, 256, 8, 16), Config(4, 2048, 4, 16, pdl=True, early=True), Config(8, 1024, 8, 16, pdl=True)):
        for _ in range(2):  # Triton's dispatch, then the binary's own launcher
            torch.testing.assert_close(linear(x, w, config), reference(x, w), atol=atol, rtol=rtol)
            torch.testing.assert_close(linear(x, w, config, r), reference(x, w, r), atol=atol, rtol=rtol)


# A half whose sum lands the other side of a rounding step than the float64 reference's (one ulp:
# 0.4 % in bf16) moves the activation by up to about four times that where SiLU's slope is steep
# against its value (gates near -4), before the activation's and the product's own roundings.
# In fp32 the product of two sums of 2048 terms of about 3 each, each sum summed in its own order
# (past CORE_ROWS rows each chunk's 128 products in sequence, by tl.dot): about 1e-5 of each half,
# times the other half (about 3).
GATED_TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float16: (4e-3, 1e-2), torch.bfloat16: (3e-2, 4e-2)}


def gated_reference(x, w, activation):
    """Eager's rounding: each half rounded to the dtype, the activation, then the product."""
    half = w.shape[0] // 2
    gate, up = reference(x, w[:half]), reference(x, w[half:])
    act = F.silu if activation == "silu" else lambda v: F.gelu(v, approximate="tanh")
    return act(gate) * up


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("n,k", [(74, 100), (128, 256), (260, 33)])  # n: both halves
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_the_gated_kernel_is_the_activated_gate_times_the_up(dtype, n, k, rows, activation):
    g = torch.Generator().manual_seed(n * 1000 + k + rows)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * 3 / k**0.5).to(dtype)  # gates of a few units: both arms of each activation
    atol, rtol = GATED_TOLERANCES[dtype]
    for config in (Config(block_n=16, block_k=64, warps=4, up_to=16, early=True), Config(block_n=4, block_k=512, warps=4, up_to=16)):
        got = decode_gemm.gated(x, w, config, activation)
        assert got.dtype == dtype and got.shape == (rows, n // 2)
        torch.testing.assert_close(got, gated_reference(x, w, activation), atol=atol, rtol=rtol)


def test_a_gated_weight_of_odd_rows_is_refused():
    with pytest.raises(ValueError, match="even number of rows"):
        decode_gemm.gated(torch.randn(1, 8), torch.randn(7, 8), Config(16, 16, 2, 16), "silu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("n,k", [(16384, 2048), (2 * 1000, 1000)])
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_compiled_gated_kernel_is_the_activated_gate_times_the_up(dtype, n, k, rows, activation):
    g = torch.Generator("cuda").manual_seed(n + k + rows)
    x = torch.randn(rows, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) * 3 / k**0.5).to(dtype)
    atol, rtol = GATED_TOLERANCES[dtype]
    for config in (Config(16, 128, 4, 16), Config(4, 2048, 4, 16, pdl=True, early=True)):
        for _ in range(2):  # Triton's dispatch, then the binary's own launcher
            torch.testing.assert_close(decode_gemm.gated(x, w, config, activation), gated_reference(x, w, activation), atol=atol, rtol=rtol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("n,k", [(3072, 2048), (6144, 4096)])
@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("added", [False, True], ids=["norm", "add+norm"])
def test_compiled_kernel_with_the_norm_s_prologue(dtype, n, k, rows, added):
    g = torch.Generator("cuda").manual_seed(n + rows)
    x = torch.randn(rows, k, device="cuda", generator=g).to(dtype)
    a = torch.randn(rows, k, device="cuda", generator=g).to(dtype) if added else None
    nw = (1 + 0.1 * torch.randn(k, device="cuda", generator=g)).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(dtype)
    h = x + a if added else x
    atol, rtol = TOLERANCES[dtype]
    for form in decode_gemm.NORMS:
        expected = reference(rmsnorm(h, nw, 1e-5, form), w)
        for config in (Config(8, 2048, 4, 16, pdl=True, early=True), Config(16, 512, 8, 16)):
            for _ in range(2):  # Triton's dispatch, then the binary's own launcher
                got = decode_gemm.normed(x, w, config, decode_gemm.Norm(form, nw, 1e-5, a))
                if added:
                    got, got_h = got
                    assert torch.equal(got_h, h)
                torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)
