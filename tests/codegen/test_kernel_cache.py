"""The kernel cache runs only the source fuser rendered (fuser/codegen/kernel_cache.py): never a
``.pyc`` planted beside a kernel file, never a file swapped after it was written; its files are
as readable as the umask allows; every error about the directory names it and
$FUSER_KERNEL_DIR; without a checkout it honours $XDG_CACHE_HOME; processes may emit the same
kernel at once."""

import contextlib
import errno
import importlib.util
import inspect
import marshal
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fuser.codegen import kernel_cache
from fuser.codegen.emit import KernelSpec, emit, kernel_source
from fuser.lower.row_program import Operand

ROOT = Path(__file__).resolve().parents[2]

#: What a planted or swapped kernel runs: it leaves this file where the test looks for it.
PLANTED = "open({marker!r}, 'w').write('ran')\ndef launch(*args):\n    raise AssertionError('planted kernel ran')\n"


def copy_spec(tag: str) -> KernelSpec:
    """A strided-copy kernel of its own (the tag is a parameter, so it is in the header and the
    hash): no other test, and no earlier call in this process, has loaded it."""
    x = Operand("in0", "x", (4, 8), torch.float32, True)
    y = Operand("out0", "y", (32,), torch.float32, True)
    return KernelSpec("strided_copy", "strided_copy", [x], [y], {"tag": tag})


def check_runs(launch) -> None:
    """The kernel copies a transposed view (no view fits it: the Triton kernel runs)."""
    x = torch.randn(3, 8, 4).transpose(1, 2)
    (y,) = launch(x)
    torch.testing.assert_close(y, x.reshape(3, 32))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    directory = tmp_path / "kernels"
    monkeypatch.setenv("FUSER_KERNEL_DIR", str(directory))
    return directory


def test_a_planted_pyc_beside_a_verified_kernel_never_runs(cache, tmp_path, request):
    """A .pyc carrying the kernel file's own mtime and size, which Python's file loader would
    accept in place of the source: the next emit runs the rendered text instead."""
    spec = copy_spec(request.node.name)
    stem, source = kernel_source(spec)
    cache.mkdir()
    path = cache / f"{stem}.py"
    path.write_text(source)
    marker = tmp_path / "planted_ran"
    code = compile(PLANTED.format(marker=str(marker)), str(path), "exec")
    info = path.stat()
    pyc = Path(importlib.util.cache_from_source(str(path)))
    pyc.parent.mkdir(parents=True, exist_ok=True)
    header = importlib.util.MAGIC_NUMBER + (0).to_bytes(4, "little")
    header += int(info.st_mtime).to_bytes(4, "little") + (info.st_size & 0xFFFFFFFF).to_bytes(4, "little")
    pyc.write_bytes(header + marshal.dumps(code))

    path_emitted, launch = emit(spec)
    assert path_emitted == path and path.read_text() == source
    assert not marker.exists(), "the planted .pyc ran"
    check_runs(launch)


def test_a_kernel_file_swapped_after_it_was_written_never_runs(cache, tmp_path, monkeypatch, request):
    """Another writer replaces the file right after ours lands: what runs is still the rendered
    text, and the next emit puts the rendered text back in the file."""
    spec = copy_spec(request.node.name)
    stem, source = kernel_source(spec)
    marker = tmp_path / "swapped_ran"
    replace = os.replace

    def replace_then_swap(src, dst, *args, **kwargs):
        replace(src, dst, *args, **kwargs)
        if Path(dst).name == f"{stem}.py":
            Path(dst).write_text(PLANTED.format(marker=str(marker)))

    monkeypatch.setattr(os, "replace", replace_then_swap)
    path, launch = emit(spec)
    monkeypatch.setattr(os, "replace", replace)
    assert not marker.exists(), "the swapped file ran"
    check_runs(launch)
    assert path.read_text() != source
    emit(spec)
    assert path.read_text() == source


def test_the_interpreter_and_inspect_see_the_rendered_text(cache, request):
    """Triton's @jit reads the kernel function's source through inspect: it is the rendered
    text, under the file's path, even when the file on disk says something else."""
    spec = copy_spec(request.node.name)
    stem, source = kernel_source(spec)
    path, launch = emit(spec)
    path.write_text("# edited\n")
    kernel = launch.__globals__[f"{stem}_kernel"]
    function = getattr(kernel, "fn", kernel)
    assert inspect.getsourcefile(function) == str(path)
    assert inspect.getsource(function) in source
    check_runs(launch)


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_kernel_files_are_as_readable_as_the_umask_allows(cache, umask, request):
    old = os.umask(umask)
    try:
        path, _ = emit(copy_spec(f"{request.node.name}"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask


@contextlib.contextmanager
def read_only(directory: Path):
    """``directory`` read-only; for root, whom its mode does not stop, creating anything in it
    refused as well."""
    directory.chmod(0o555)
    real_open, real_mkdir = os.open, os.mkdir

    def refused(path) -> bool:
        if os.geteuid() == 0 and Path(path).parent == directory:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return False

    os.open = lambda path, *args, **kwargs: refused(path) or real_open(path, *args, **kwargs)
    os.mkdir = lambda path, *args, **kwargs: refused(path) or real_mkdir(path, *args, **kwargs)
    try:
        yield
    finally:
        os.open, os.mkdir = real_open, real_mkdir
        directory.chmod(0o755)


def test_a_read_only_directory_names_fuser_kernel_dir(cache, request):
    cache.mkdir()
    with read_only(cache), pytest.raises(OSError, match="FUSER_KERNEL_DIR") as excinfo:
        emit(copy_spec(request.node.name))
    assert str(cache) in str(excinfo.value)
    assert list(cache.iterdir()) == []  # no temporary file left behind


def test_a_read_only_directory_that_holds_the_kernel_serves_it(cache, request):
    spec = copy_spec(request.node.name)
    emit(spec)
    with read_only(cache):
        path, launch = emit(spec)
    check_runs(launch)


def test_an_uncreatable_directory_names_fuser_kernel_dir(tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    monkeypatch.setenv("FUSER_KERNEL_DIR", str(locked / "kernels"))
    with read_only(locked), pytest.raises(OSError, match="FUSER_KERNEL_DIR") as excinfo:
        kernel_cache.kernel_dir()
    assert str(locked / "kernels") in str(excinfo.value)


def test_xdg_cache_home_holds_the_cache_outside_a_checkout(tmp_path, monkeypatch):
    monkeypatch.delenv("FUSER_KERNEL_DIR", raising=False)
    monkeypatch.setattr(kernel_cache, "PACKAGE_DIR", tmp_path / "site-packages" / "fuser")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernel_cache.kernel_dir() == tmp_path / "xdg" / "fuser" / "kernels"
    assert (tmp_path / "xdg" / "fuser" / "kernels").is_dir()
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # the XDG spec: ignore a relative one
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert kernel_cache.kernel_dir() == tmp_path / "home" / ".cache" / "fuser" / "kernels"


EMIT_MANY = """
import sys
import torch
from fuser.codegen.emit import emit
sys.path.insert(0, {tests!r})
from test_kernel_cache import check_runs, copy_spec
for n in range(12):
    path, launch = emit(copy_spec(f"concurrent{{n}}"))
    check_runs(launch)
print("ok")
"""


def test_two_processes_emitting_the_same_kernels_both_succeed(cache):
    env = {**os.environ, "FUSER_KERNEL_DIR": str(cache), "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    script = EMIT_MANY.format(tests=str(Path(__file__).parent))
    command = [sys.executable, "-c", script]
    processes = [
        subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    for process in processes:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0 and out.strip() == "ok", err[-3000:]
    assert sorted(p.suffix for p in cache.iterdir()) == [".py"] * 12  # no temporary file left behind


def test_a_kernel_merged_from_many_regions_has_a_short_file_name(cache, request):
    """A kernel merged from 65 regions (one LayerNorm per head of 65) is named by its runs of
    patterns, not by each, and runs from its file: no name past the file system's limit."""
    spec = copy_spec(request.node.name)
    spec.pattern = "+".join(["generic"] * 65 + ["rms_norm", "rms_norm"] + [f"p{i}" for i in range(40)])
    stem, _ = kernel_source(spec)
    assert stem.startswith("generic_x65_rms_norm_x2_p0_p1_") and len(stem) <= 64 + 13, stem
    path, launch = emit(spec)
    assert path.name == f"{stem}.py" and path.exists()
    check_runs(launch)
