"""fuser.tools.tune_decode_gemm on the CPU, with a stand-in timer: the configuration kept is the
fastest that agrees with F.linear, up_to is where the kernel stops being the faster, the table
is merged and read back by fuser.install.decode_gemm. (Times are the GPU's: `fuser tune
--decode-gemm` runs there.)"""

import pytest
import torch

from fuser.install import decode_gemm
from fuser.install.decode_gemm import Config
from fuser.tools import tune_decode_gemm as gemm


def test_up_to_is_the_last_count_of_an_unbroken_lead():
    assert gemm.up_to({1: 5.0, 2: 5.0, 4: 5.0}, {1: 4.0, 2: 4.9, 4: 6.0}) == 2
    assert gemm.up_to({1: 5.0, 2: 5.0, 4: 5.0}, {1: 5.0, 2: 1.0, 4: 1.0}) == 0  # a tie at one token: never
    assert gemm.up_to({1: 5.0, 2: 5.0}, {1: 1.0, 2: 1.0}) == 2


def fake_timer(fn, arg_sets):
    """PyTorch 10 µs; the kernel 2 µs a token at block_n 32, 20 µs otherwise."""
    if fn is torch.nn.functional.linear:
        return 10.0
    x, _, config = arg_sets[0]
    return (2.0 if config.block_n == 32 else 20.0) * x.shape[0]


def test_the_fastest_agreeing_config_is_kept_and_the_table_is_read_back(tmp_path, monkeypatch):
    configs = (Config(16, 32, 2, 16), Config(32, 32, 2, 16), Config(64, 64, 4, 16))
    entry = gemm.measure(40, 96, torch.float32, tokens=(1, 2, 4, 8), device="cpu", timer=fake_timer, configs=configs)
    assert entry["config"] == dict(block_n=32, block_k=32, warps=2) and entry["disagreed"] == 0
    assert entry["up_to"] == 4  # 2, 4, 8 µs against 10; 16 at eight tokens
    path = gemm.write_table([entry], tmp_path, "TEST_GPU", {"commit": "x"})
    again = dict(entry, n=48)
    gemm.write_table([again, dict(entry, up_to=1)], tmp_path, "TEST_GPU", {})  # replaces (40, 96), adds (48, 96)
    monkeypatch.setenv(decode_gemm.TABLE_ENV, str(path))
    assert decode_gemm.config_for(40, 96, torch.float32) == Config(32, 32, 2, 1)
    assert decode_gemm.config_for(48, 96, torch.float32) == Config(32, 32, 2, 4)


def test_the_fastest_up_to_core_rows_and_the_fastest_past_them_are_kept_each(tmp_path, monkeypatch):
    def timer(fn, arg_sets):  # block_n 4 the fastest up to CORE_ROWS (2) tokens, 16 at more
        if fn is torch.nn.functional.linear:
            return 10.0
        x, _, config = arg_sets[0]
        return {4: 1.0, 16: 3.0}[config.block_n] if x.shape[0] <= 2 else {4: 30.0, 16: 5.0}[config.block_n]

    configs = (Config(4, 64, 4, 16), Config(16, 32, 8, 16))
    entry = gemm.measure(40, 96, torch.float32, tokens=(1, 2, 4), device="cpu", timer=timer, configs=configs)
    assert entry["config"] == dict(block_n=4, block_k=64, warps=4) and entry["config_rows"] == dict(block_n=16, block_k=32, warps=8)
    assert entry["fuser_us"] == {"1": 1.0, "2": 1.0, "4": 5.0} and entry["up_to"] == 4
    monkeypatch.setenv(decode_gemm.TABLE_ENV, str(gemm.write_table([entry], tmp_path, "TEST_GPU", {})))
    assert decode_gemm.config_for(40, 96, torch.float32) == Config(4, 64, 4, 4, rows=(16, 32, 8))


def test_a_config_that_disagrees_is_not_timed(monkeypatch):
    real = decode_gemm.linear
    monkeypatch.setattr(decode_gemm, "linear", lambda x, w, config, r=None: real(x, w, config, r) * (2 if config.block_n == 32 else 1))
    configs = (Config(16, 32, 2, 16), Config(32, 32, 2, 16))
    entry = gemm.measure(40, 96, torch.float32, tokens=(1, 2), device="cpu", timer=fake_timer, configs=configs)
    assert entry["config"]["block_n"] == 16 and entry["disagreed"] == 1 and entry["up_to"] == 0


def test_the_weight_is_timed_over_copies_past_twice_the_l2_cache():
    weight = torch.randn(40, 96)  # 15360 bytes
    copies = gemm.cold_copies(weight, cache=50_000)
    assert len(copies) == 8 and sum(w.numel() * w.element_size() for w in copies) > 2 * 50_000  # 1 + ceil(100000 / 15360)
    assert copies[0] is weight and all(torch.equal(w, weight) and w.data_ptr() != weight.data_ptr() for w in copies[1:])
    assert gemm.cold_copies(weight) == [weight]  # the CPU: no cache to flush
    timed = []
    gemm.measure(40, 96, torch.float32, tokens=(1,), device="cpu", configs=(Config(16, 32, 2, 16),),
                 timer=lambda fn, arg_sets: timed.append(arg_sets) or 1.0)  # fmt: skip
    assert [len(sets) for sets in timed] == [1, 1]  # PyTorch's and the kernel's, over the same weights


def test_shapes_are_read_and_bad_ones_named():
    assert gemm.shapes_of("2048x8192, 3072X2048") == ((2048, 8192), (3072, 2048))
    with pytest.raises(ValueError, match="NxK pairs"):
        gemm.shapes_of("2048-8192")
