"""Snapshots of the kernel source fuser renders for the tiny DSv4 layer (and, nested, its shared
expert), and for the hand-written templates it does not use.

A snapshot is ``tests/codegen/snapshots/<pattern>__<n>.py``: the n-th distinct kernel file of that
pattern, in the order of the graph nodes the kernels compute; a hand-written template's is
``tests/codegen/snapshots/templates/<template>__<case>.py``, the kernel of a pattern that lowers
to it fused at the pattern's example sizes (or of a repeat_kv copy). After an intended change to a template, the
lowering or a pattern, regenerate them and review the diff:

    FUSER_UPDATE_SNAPSHOTS=1 TRITON_INTERPRET=1 python -m pytest -q tests/codegen/test_snapshots.py
"""

import difflib
import os
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fuser
import fuser.pipeline.passes
import fuser.codegen.emit
from examples.dsv4 import layer as dsv4
from fuser.canon.canonicalize import canonicalize
from fuser.match.pattern_files import load_pattern
from fuser.pattern import example_tensors, is_hand_written, patterns_dir
from fuser.testing import reference_module

SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"
UPDATE_ENV = "FUSER_UPDATE_SNAPSHOTS"
HOW_TO_UPDATE = f"{UPDATE_ENV}=1 TRITON_INTERPRET=1 python -m pytest -q tests/codegen/test_snapshots.py"


def updating() -> bool:
    return os.environ.get(UPDATE_ENV) == "1"


def snapshot_names(kernels) -> dict[str, Path]:
    """snapshot file name -> kernel file, for every distinct kernel file of a plan, numbered in
    the order of the graph nodes each computes (not of the file names: a file's name carries a
    hash of its source, so any template change would renumber the snapshots)."""
    by_pattern: dict[str, dict[Path, tuple]] = defaultdict(dict)
    for k in kernels:
        nodes = tuple(n.name for n in k.region.nodes)
        paths = by_pattern[k.region.pattern]
        paths[Path(k.path)] = min(paths.get(Path(k.path), nodes), nodes)
    names = {}
    for pattern, paths in sorted(by_pattern.items()):
        for n, path in enumerate(sorted(paths, key=lambda p: (paths[p], p.name))):
            names[f"{pattern}__{n}.py"] = path
    return names


def check_snapshot(directory: Path, name: str, source: str, update: bool) -> None:
    """Compare ``source`` with the snapshot ``directory/name``; with ``update``, write it first."""
    path = directory / name
    if update:
        directory.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != source:
            path.write_text(source)
    if not path.exists():
        raise AssertionError(f"snapshot {path} is missing; create it with:\n    {HOW_TO_UPDATE}")
    expected = path.read_text()
    if expected != source:
        diff = "".join(
            difflib.unified_diff(
                expected.splitlines(keepends=True), source.splitlines(keepends=True), str(path), "rendered"
            )
        )
        raise AssertionError(
            f"kernel source differs from snapshot {path}; if intended, regenerate with:\n"
            f"    {HOW_TO_UPDATE}\n{diff[:4000]}"
        )


def tiny_kernels(plans):
    return [k for plan in plans for k in plan.kernels]


@pytest.fixture(scope="module")
def tiny_plans():
    """The layer's plan and the nested one of its shared expert (inside its side-stream leaf)."""
    layer, inputs = dsv4.tiny(T=5)
    return list(dsv4.fuse_layer(layer, inputs).values())


def test_kernel_sources_match_their_snapshots(tiny_plans):
    names = snapshot_names(tiny_kernels(tiny_plans))
    assert names, "the plan fused nothing"
    failures = []
    for name, kernel_file in names.items():
        try:
            check_snapshot(SNAPSHOTS, name, kernel_file.read_text(), updating())
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, "\n\n".join(failures)
    for name in names:
        assert (SNAPSHOTS / name).is_file()


def test_no_stale_snapshots(tiny_plans):
    names = snapshot_names(tiny_kernels(tiny_plans))
    stale = sorted(p.name for p in SNAPSHOTS.glob("*.py") if p.name not in names)
    if updating():
        for name in stale:
            (SNAPSHOTS / name).unlink()
        stale = sorted(p.name for p in SNAPSHOTS.glob("*.py") if p.name not in names)
    assert not stale, f"snapshots no kernel renders any more: {stale}; remove them with:\n    {HOW_TO_UPDATE}"


def test_snapshots_cover_the_expected_patterns(tiny_plans):
    names = snapshot_names(tiny_kernels(tiny_plans))
    patterns = {part for name in names for part in name.split("__")[0].split("+")}  # merged: "a+b"
    assert {"mhc_sinkhorn_rms", "mhc_post", "rmsnorm", "rmsnorm_weightless", "swiglu_clamp"} <= patterns


def test_missing_snapshot_says_how_to_create_it(tmp_path):
    with pytest.raises(AssertionError) as excinfo:
        check_snapshot(tmp_path, "rmsnorm__0.py", "# source\n", update=False)
    message = str(excinfo.value)
    assert str(tmp_path / "rmsnorm__0.py") in message
    assert f"{UPDATE_ENV}=1" in message and "tests/codegen/test_snapshots.py" in message


def test_changed_snapshot_shows_a_diff(tmp_path):
    (tmp_path / "x__0.py").write_text("a = 1\n")
    with pytest.raises(AssertionError) as excinfo:
        check_snapshot(tmp_path, "x__0.py", "a = 2\n", update=False)
    message = str(excinfo.value)
    assert "-a = 1" in message and "+a = 2" in message and f"{UPDATE_ENV}=1" in message


def test_update_mode_writes_the_snapshot(tmp_path):
    check_snapshot(tmp_path / "snaps", "x__0.py", "a = 2\n", update=True)
    assert (tmp_path / "snaps" / "x__0.py").read_text() == "a = 2\n"
    check_snapshot(tmp_path / "snaps", "x__0.py", "a = 2\n", update=False)


def test_rendering_the_same_plan_twice_is_identical(tiny_plans):
    for plan in tiny_plans:
        cops = canonicalize(plan.traced)
        for k in plan.kernels:
            first = fuser.codegen.emit.kernel_source(fuser.pipeline.passes.kernel_spec(k.region, plan.traced, cops))
            second = fuser.codegen.emit.kernel_source(fuser.pipeline.passes.kernel_spec(k.region, plan.traced, cops))
            assert first == second
            stem, source = first
            assert stem == Path(k.path).stem
            assert source == Path(k.path).read_text()


def test_a_second_plan_renders_the_same_files(tiny_plans):
    layer, inputs = dsv4.tiny(T=5)
    again = tiny_kernels(dsv4.fuse_layer(layer, inputs).values())
    assert [Path(k.path).name for k in again] == [Path(k.path).name for k in tiny_kernels(tiny_plans)]
    for a, b in zip(again, tiny_kernels(tiny_plans)):
        assert Path(a.path).read_text() == Path(b.path).read_text()


def test_every_kernel_file_starts_with_a_header(tiny_plans):
    for k in tiny_kernels(tiny_plans):
        region = k.region
        lines = Path(k.path).read_text().splitlines()
        assert lines[0].startswith(f"# Generated by fuser from templates/{region.template}.py.jinja"), lines[0]
        assert lines[1] == f"# pattern: {region.pattern}", lines[1]
        assert lines[2].startswith("# params:")
        for name, value in region.params.items():
            assert f"{name}={value!r}" in lines[2], (name, lines[2])
        assert Path(k.path).stem.startswith(f"{region.pattern.replace('+', '_')}_")


class Doubled(nn.Module):
    def forward(self, x):
        return (torch.tanh(x.float()) * 3 - 1).to(x.dtype)


def test_kernel_paths_exist_in_the_current_kernel_directory(tmp_path, monkeypatch):
    x = torch.randn(4, 32).to(torch.bfloat16)
    for sub in ("a", "b"):
        monkeypatch.setenv("FUSER_KERNEL_DIR", str(tmp_path / sub))
        plan = fuser.plan(Doubled(), (x,))
        assert plan.kernels
        for k in plan.kernels:
            assert Path(k.path).parent == tmp_path / sub
            assert Path(k.path).is_file(), f"{k.path} does not exist"


# --- the hand-written templates (no DSv4 kernel uses them) -------------------------------------
HAND_WRITTEN_SNAPSHOTS = SNAPSHOTS / "templates"


class RepeatKV(nn.Module):
    """transformers' repeat_kv: the key heads repeated, a reshape of a view no view fits."""

    def forward(self, keys):
        T, heads, slots, dim = keys.shape
        return keys[:, :, None].expand(T, heads, 2, slots, dim).reshape(T, heads * 2, slots, dim)


def hand_written_cases() -> dict[str, tuple[nn.Module, tuple, dict]]:
    """A module, its inputs and fuser's options per case: each pattern that lowers to a
    hand-written template, fused at its example sizes as fuser.testing fuses it, and a
    repeat_kv copy (fuser.install.copies)."""
    cases = {}
    for name in ("mhc_sinkhorn", "mhc_sinkhorn_rms", "expert_sort", "expert_sort_rows"):
        pattern = load_pattern(patterns_dir() / f"{name}.py")
        inputs = example_tensors(pattern, dict(pattern.example), {}, T=3)
        batch = {n: 0 for n, spec in pattern.inputs.items() if spec.dims[:1] == ("T",)}
        cases[name] = (reference_module(pattern), inputs, dict(patterns=[pattern.path], batch_inputs=batch))
    cases["copy"] = (RepeatKV(), (torch.randn(3, 2, 5, 8),), {})
    return cases


@pytest.fixture(scope="module")
def hand_written_kernels() -> dict[str, Path]:
    """snapshot file name (``<template>__<case>.py``) -> kernel file."""
    names = {}
    for case, (module, inputs, options) in hand_written_cases().items():
        report = fuser.explain(module, inputs, validate=False, **options)
        for chain in report.chains:
            if is_hand_written(chain.template):
                names[f"{chain.template}__{case}.py"] = Path(chain.path)
    return names


def test_hand_written_kernel_sources_match_their_snapshots(hand_written_kernels):
    failures = []
    for name, kernel_file in hand_written_kernels.items():
        try:
            check_snapshot(HAND_WRITTEN_SNAPSHOTS, name, kernel_file.read_text(), updating())
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, "\n\n".join(failures)
    stale = sorted(p.name for p in HAND_WRITTEN_SNAPSHOTS.glob("*.py") if p.name not in hand_written_kernels)
    if updating():
        for name in stale:
            (HAND_WRITTEN_SNAPSHOTS / name).unlink()
        stale = []
    assert not stale, f"snapshots no kernel renders any more: {stale}; remove them with:\n    {HOW_TO_UPDATE}"


def test_every_hand_written_template_has_a_snapshot(hand_written_kernels):
    templates = {name.split("__")[0] for name in hand_written_kernels}
    assert templates == {t for t in fuser.codegen.emit.template_names() if is_hand_written(t)}
