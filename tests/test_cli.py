"""The ``fuser`` command (``python -m fuser``): explain and check a ``FILE.py:FACTORY``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def fuser_cli(*args: str, cwd: Path = ROOT, timeout: float = 240, **extra_env: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1", **extra_env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "fuser", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_explain_json(tmp_path):
    kernels = tmp_path / "kernels"
    result = fuser_cli("explain", "examples/dsv4/layer.py:tiny", "--json", FUSER_KERNEL_DIR=str(kernels))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    for key in ("chains", "rejected", "unfused", "launches_before", "launches_after"):
        assert key in report, key
    assert report["launches_after"] < report["launches_before"]
    assert report["module"] == "DeepseekV4DecoderLayer"
    patterns = {part for c in report["chains"] for part in c["pattern"].split("+")}  # merged: "a+b"
    # The shared expert's SwiGLU is inside its side-stream leaf: dsv4.fuse_layer fuses it, not the CLI.
    assert {"mhc_sinkhorn_rms", "mhc_post", "rmsnorm", "rmsnorm_weightless"} <= patterns
    for chain in report["chains"]:
        assert (kernels / f"{chain['kernel']}.py").is_file(), chain["kernel"]


def test_check_passes_on_the_tiny_layer():
    result = fuser_cli("check", "examples/dsv4/layer.py:tiny")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "check passed" in result.stdout


UNFUSABLE = """\
import torch
import torch.nn as nn


class BranchOnTokens(nn.Module):
    def forward(self, x):
        if x.shape[0] > 2:  # HERE
            x = x * 2
        return torch.sigmoid(x.float()).to(x.dtype)


def factory():
    return BranchOnTokens(), (torch.randn(5, 16).to(torch.bfloat16),)
"""


@pytest.fixture(scope="module")
def unfusable_check(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "unfusable.py"
    path.write_text(UNFUSABLE)
    line = next(i for i, s in enumerate(UNFUSABLE.splitlines(), 1) if s.endswith("# HERE"))
    return line, fuser_cli("check", f"{path}:factory")


def test_check_on_a_module_fuser_cannot_fuse_fails_naming_file_and_line(unfusable_check):
    line, result = unfusable_check
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert f"unfusable.py:{line}" in output, output
    assert "control flow" in output


def test_check_on_a_module_fuser_cannot_fuse_prints_no_traceback(unfusable_check):
    _, result = unfusable_check
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize(
    "target, expected",
    [
        pytest.param("nofile.py:x", "nofile.py: no such file", id="missing-file"),
        pytest.param("examples/dsv4/layer.py", "expected FILE.py:FACTORY", id="no-colon"),
        pytest.param("examples/dsv4/layer.py:no_such_factory", "has no function 'no_such_factory'", id="missing-factory"),
    ],
)
def test_bad_target_exits_non_zero_with_a_clear_message(target, expected):
    result = fuser_cli("check", target)
    assert result.returncode != 0
    assert expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_no_command_is_a_usage_error():
    result = fuser_cli()
    assert result.returncode == 2
    assert "usage: fuser" in result.stderr
