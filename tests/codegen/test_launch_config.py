"""Launch configurations come from a per-GPU table chosen offline, never from a benchmark at
apply time: the entry of the kernel itself, else the heuristic (never another kernel's entry)."""

import json
from dataclasses import replace

import pytest
import torch
from helpers import BF16RMSNorm

import fuser
from fuser.codegen import launch_config
from fuser.ir import device_tables
from fuser.codegen.emit import kernel_source


def spec_for(n):
    (kernel,) = fuser.plan(BF16RMSNorm(n), (torch.randn(3, n, dtype=torch.bfloat16),), validate=False).kernels
    return kernel.spec


@pytest.fixture
def table(tmp_path, monkeypatch):
    """Write a table for a made-up GPU and point the lookup at it."""
    monkeypatch.setattr(device_tables, "TABLE_DIR", tmp_path)
    monkeypatch.delenv(launch_config.USER_TABLES, raising=False)
    launch_config.load_table.cache_clear()
    yield lambda entries: (tmp_path / "Test_GPU.json").write_text(json.dumps({"entries": entries}))
    launch_config.load_table.cache_clear()


def entry(spec, num_warps, **changes):
    return {**launch_config.entry_key(spec), "num_warps": num_warps, **changes}


def test_the_kernel_itself_wins(table):
    spec = spec_for(1024)
    table([entry(spec, 2, kernel="0" * 12, size=1024), entry(spec, 16)])
    assert launch_config.lookup(spec, "Test_GPU") == 16


def test_another_kernels_entry_never_applies(table):
    """A kernel of the same template, pattern, dtype and size is still another kernel."""
    spec = spec_for(1024)
    table([entry(spec, 1, kernel="a" * 12), entry(spec, 16, kernel="b" * 12, size=2048)])
    assert launch_config.lookup(spec, "Test_GPU") is None


def test_the_heuristic_gives_a_wide_norm_enough_warps():
    """4096-wide RMSNorm: 8 warps (on the H200, 1 warp took 5.1 us, 8 warps 1.96 us)."""
    assert spec_for(4096).program.num_warps == 8


def test_the_heuristic_holds_on_the_measured_zoo_kernels():
    """Against every zoo kernel timed at 1-16 warps on an H200 (benchmarks/tune_zoo.py): the
    heuristic's pick is within 10% of the best warps on all but a few (kernel, T) pairs, and
    never far off. The times are the GPU's; only the pick is computed here."""
    from pathlib import Path

    from fuser.codegen.launch_config import heuristic_warps

    recorded = json.loads((Path(__file__).resolve().parents[2] / "benchmarks/results/launch_heuristic.json").read_text())
    ratios = []
    for rows in recorded["layers"].values():
        for row in rows:
            f = row["features"]
            pick = str(heuristic_warps(f["numel"], f["reducing"], f["tiled"], f["leading"], set(f["ops"])))
            ratios.append(row["us"][pick] / min(row["us"].values()))
    assert len(ratios) >= 200
    assert sum(r > 1.10 for r in ratios) <= len(ratios) // 50
    assert max(ratios) < 1.25


def test_a_user_table_is_searched_first(table, tmp_path, monkeypatch):
    spec = spec_for(1024)
    table([entry(spec, 16)])
    user = tmp_path / "user"
    user.mkdir()
    (user / "Test_GPU.json").write_text(json.dumps({"entries": [entry(spec, 2)]}))
    monkeypatch.setenv(launch_config.USER_TABLES, str(user))
    launch_config.load_table.cache_clear()
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
    monkeypatch.setattr("fuser.codegen.emit.current_gpu", lambda: "Test_GPU")
    assert spec.num_warps == 16 and "num_warps=16" in kernel_source(spec)[1]
    assert replace(spec, warps=1).num_warps == 1  # the tuner's explicit choice wins


def test_entry_key_ignores_the_warps():
    spec = spec_for(256)
    assert launch_config.entry_key(spec) == launch_config.entry_key(replace(spec, warps=8))
    assert launch_config.entry_key(spec)["kernel"] != launch_config.entry_key(spec_for(512))["kernel"]


def test_an_entry_is_found_without_rendering_the_kernel(table, monkeypatch):
    """The key is a hash of what the kernel is made of, not of its source: a lookup renders
    nothing (and so the table is consulted before the one render that uses its warps)."""
    spec = spec_for(1024)
    table([entry(spec, 16)])

    def render(*args, **kwargs):
        raise AssertionError("rendered")

    monkeypatch.setattr("fuser.codegen.emit.render", render)
    assert launch_config.lookup(spec, "Test_GPU") == 16


def test_a_template_change_is_another_kernel(monkeypatch):
    """An entry is for the kernel as its templates write it: edit one, and the key changes."""
    spec = spec_for(256)
    before = launch_config.entry_key(spec)["kernel"]
    monkeypatch.setattr(launch_config, "_template_sources", lambda template: ("edited",))
    assert launch_config.entry_key(spec)["kernel"] != before


def test_every_entry_of_the_h200_table_is_a_kernel_of_the_dsv4_example():
    """fuser's own table holds the DeepSeek-V4 example's kernels at flash dims, tuned on an
    H200 (benchmarks/tune_launch.py). An entry whose kernel the example no longer makes (the
    lowering or a template changed it) applies to nothing, and the example loses its tuned
    warps without a word: re-tune on the GPU, or re-key an entry whose kernel changed in
    nothing that runs."""
    from examples.dsv4 import layer as dsv4

    layer, inputs = dsv4.flash(T=8, device="cpu")
    plans = dsv4.fuse_layer(layer, inputs, validate=False)
    made = {launch_config.entry_key(k.spec)["kernel"]: k.path.name for plan in plans.values() for k in plan.kernels
            if k.spec is not None and k.spec.program is not None}  # fmt: skip
    fuser.restore(layer)
    table = json.loads((launch_config.TABLE_DIR / "NVIDIA_H200.json").read_text())
    stale = [(e["kernel"], e["pattern"], e["features"]["ops"]) for e in table["entries"] if e["kernel"] not in made]
    assert not stale, f"entries of no kernel of the example: {stale}; its kernels: {made}"


def test_gpu_key_is_a_file_name():
    assert launch_config.gpu_key("NVIDIA H200") == "NVIDIA_H200"
    assert launch_config.gpu_key("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3"


@pytest.mark.parametrize("text, problem", [
    ("{not json", "Expecting property name"),
    ('{"tables": []}', 'no "entries" list'),
    ('{"entries": [{"kernel": "abc", "num_warps": 3}]}', "entry 0 needs"),
    ('{"entries": [{"num_warps": 4}]}', "entry 0 needs"),
])  # fmt: skip
def test_a_malformed_table_is_an_error_naming_its_file(tmp_path, monkeypatch, text, problem):
    (tmp_path / "Test_GPU.json").write_text(text)
    monkeypatch.setenv(launch_config.USER_TABLES, str(tmp_path))
    launch_config.load_table.cache_clear()
    try:
        with pytest.raises(launch_config.LaunchTableError, match=problem) as error:
            launch_config.load_table("Test_GPU")
    finally:
        launch_config.load_table.cache_clear()
    assert str(tmp_path / "Test_GPU.json") in str(error.value) and launch_config.USER_TABLES in str(error.value)


def test_a_missing_table_directory_is_an_error(tmp_path, monkeypatch):
    missing = tmp_path / "nowhere"
    monkeypatch.setenv(launch_config.USER_TABLES, str(missing))
    launch_config.load_table.cache_clear()
    try:
        with pytest.raises(launch_config.LaunchTableError, match=f"{launch_config.USER_TABLES} names {missing}"):
            launch_config.load_table("Test_GPU")
    finally:
        launch_config.load_table.cache_clear()
