"""Launch configurations come from a per-GPU table chosen offline, never from a benchmark at
apply time: exact kernel first, then the nearest feature size, then the heuristic."""

import json
from dataclasses import replace

import pytest
import torch
from helpers import BF16RMSNorm

import fuser
from fuser import launch_config
from fuser.emit import kernel_source


def spec_for(n):
    (kernel,) = fuser.plan(BF16RMSNorm(n), (torch.randn(3, n, dtype=torch.bfloat16),), validate=False).kernels
    return kernel.spec


@pytest.fixture
def table(tmp_path, monkeypatch):
    """Write a table for a made-up GPU and point the lookup at it."""
    monkeypatch.setattr(launch_config, "TABLE_DIR", tmp_path)
    launch_config.load_table.cache_clear()
    yield lambda entries: (tmp_path / "Test_GPU.json").write_text(json.dumps({"entries": entries}))
    launch_config.load_table.cache_clear()


def entry(spec, num_warps, **changes):
    return {**launch_config.entry_key(spec), "num_warps": num_warps, **changes}


def test_the_kernel_itself_wins(table):
    spec = spec_for(1024)
    table([entry(spec, 2, kernel="0" * 12, size=1024), entry(spec, 16)])
    assert launch_config.lookup(spec, "Test_GPU") == 16


def test_else_the_nearest_feature_size(table):
    spec = spec_for(1024)
    table([entry(spec, 1, kernel="a" * 12, size=64), entry(spec, 8, kernel="b" * 12, size=2048),
           entry(spec, 4, kernel="c" * 12, size=16384)])
    assert launch_config.lookup(spec, "Test_GPU") == 8


def test_else_the_same_template_and_dtype(table):
    spec = spec_for(1024)
    table([entry(spec, 2, kernel="a" * 12, pattern="other", size=512),
           entry(spec, 16, kernel="b" * 12, pattern="other", dtype="float32", size=1024)])
    assert launch_config.lookup(spec, "Test_GPU") == 2


def test_no_table_or_no_gpu_means_the_heuristic(table):
    spec = spec_for(1024)
    assert launch_config.lookup(spec, "Unknown_GPU") is None
    table([entry(spec, 16)])
    assert launch_config.lookup(spec, None) is None


def test_the_table_sets_the_rendered_warps(table, monkeypatch):
    spec = spec_for(1024)
    table([entry(spec, 16)])
    monkeypatch.setattr(launch_config, "current_gpu", lambda: "Test_GPU")
    monkeypatch.setattr("fuser.emit.current_gpu", lambda: "Test_GPU")
    assert spec.num_warps == 16 and "num_warps=16" in kernel_source(spec)[1]
    assert replace(spec, warps=1).num_warps == 1  # the tuner's explicit choice wins


def test_entry_key_ignores_the_warps():
    spec = spec_for(256)
    assert launch_config.entry_key(spec) == launch_config.entry_key(replace(spec, warps=8))
    assert launch_config.entry_key(spec)["kernel"] != launch_config.entry_key(spec_for(512))["kernel"]


def test_gpu_key_is_a_file_name():
    assert launch_config.gpu_key("NVIDIA H200") == "NVIDIA_H200"
    assert launch_config.gpu_key("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3"
