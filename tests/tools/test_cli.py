"""The ``fuser`` command (``python -m fuser``): its commands on a ``FILE.py:FACTORY``, its exit codes
(0 ok, 1 mismatch, 2 usage or input error, 3 internal error) and its messages."""

import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[2]


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
        if x.shape[0] % 2 == 1:  # HERE
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
def test_bad_target_is_an_input_error_with_a_clear_message(target, expected):
    result = fuser_cli("check", target)
    assert result.returncode == 2, result.stderr  # 1 would read as a mismatch
    assert expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_no_command_is_a_usage_error():
    result = fuser_cli()
    assert result.returncode == 2
    assert "usage: fuser" in result.stderr


SMALL = """\
import torch
import torch.nn as nn
import torch.nn.functional as F


class Gate(nn.Module):
    def forward(self, x):
        return F.gelu(x.float()).to(x.dtype)


class GatedProj(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.gate = Gate()

    def forward(self, x):
        return self.gate(self.proj(x))


class NormThenCumprod(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(16))
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        h = (xf * self.weight).to(x.dtype)  # RMSNorm: the rmsnorm pattern
        return self.proj(torch.cumprod(h, -1))  # no template lowers cumprod


class Broken(nn.Module):
    def forward(self, x):
        return torch.sigmoid(x) @ torch.ones(3, 3)  # BROKEN


def gated():
    return GatedProj().to(torch.bfloat16), (torch.randn(5, 16).to(torch.bfloat16),)


def norm_then_cumprod():
    return NormThenCumprod().to(torch.bfloat16), (torch.randn(5, 16).to(torch.bfloat16),)


def broken():
    return Broken(), (torch.randn(5, 16),)


def raises():
    raise RuntimeError("no weights here")  # RAISES
"""


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "small.py"
    path.write_text(SMALL)
    return path


def line_of(marker: str) -> int:
    return next(i for i, s in enumerate(SMALL.splitlines(), 1) if s.endswith(f"# {marker}"))


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def test_a_factory_that_raises_is_an_input_error_naming_its_line(small):
    result = fuser_cli("explain", f"{small}:raises")
    assert result.returncode == 2
    message = one_line(result.stderr)
    assert f"small.py:{line_of('RAISES')}" in message
    assert "raises() raised RuntimeError: no weights here" in message


def test_an_error_in_the_modules_own_code_is_an_input_error_naming_its_line(small):
    result = fuser_cli("explain", f"{small}:broken")
    assert result.returncode == 2
    message = one_line(result.stderr)
    assert f"small.py:{line_of('BROKEN')}" in message and "RuntimeError" in message


FACTORIES = """\
import sys

import torch


def sigmoid(x):
    return torch.sigmoid(x.float()).to(x.dtype)


def plain_function():  # PLAIN
    return sigmoid, (torch.randn(4, 16),)


def noisy():
    print("building the module")  # a factory's own output
    return torch.nn.Sigmoid(), (torch.randn(4, 16),)


def exits():
    sys.exit(7)  # EXITS
"""


@pytest.fixture(scope="module")
def factories(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "factories.py"
    path.write_text(FACTORIES)
    return path


def factory_line(marker: str) -> int:
    return next(i for i, s in enumerate(FACTORIES.splitlines(), 1) if s.endswith(f"# {marker}"))


def test_a_factory_returning_a_plain_function_is_an_input_error(factories, capsys):
    from fuser.tools.cli import main

    assert main(["explain", f"{factories}:plain_function"]) == 2  # was 3, an internal error
    message = one_line(capsys.readouterr().err)
    assert f"factories.py:{factory_line('PLAIN')}" in message
    assert "returned function sigmoid as the module" in message and "torch.nn.Module" in message


def test_a_factory_that_exits_is_reported_as_its_error(factories, capsys):
    from fuser.tools.cli import main

    assert main(["check", f"{factories}:exits"]) == 2  # was: exit 7, nothing said
    message = one_line(capsys.readouterr().err)
    assert f"factories.py:{factory_line('EXITS')}" in message and "exits() called sys.exit(7)" in message


def test_a_factorys_output_stays_out_of_json(factories, capsys):
    from fuser.tools.cli import main

    assert main(["explain", f"{factories}:noisy", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["module"] == "Sigmoid"
    assert "building the module" in err


def test_every_command_has_json():
    import argparse

    from fuser.tools.cli import parser

    (commands,) = [a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)]
    for name, sub in commands.choices.items():
        assert any("--json" in a.option_strings for a in sub._actions), name


def test_check_json_holds_the_report(small, capsys):
    from fuser.tools.cli import main

    assert main(["check", f"{small}:norm_then_cumprod", "--json"]) == 0
    checked = json.loads(capsys.readouterr().out)
    assert checked["ok"] is True and checked["kernels"] == 1 and checked["kernels_not_run"] == []
    assert checked["report"]["module"] == "NormThenCumprod"
    assert [c["pattern"] for c in checked["report"]["chains"]] == ["rmsnorm"]


HELPER = """\
from pathlib import Path

Path(__file__).with_suffix(".ran").write_text("executed")  # a helper module, not a pattern file
"""


def test_patterns_dir_loads_only_its_pattern_files(small, tmp_path, capsys):
    from fuser.tools.cli import main

    (tmp_path / "sigmoid_chain.py").write_text(PASSING_PATTERN)
    (tmp_path / "helpers.py").write_text(HELPER)
    assert main(["explain", f"{small}:gated", "--patterns", str(tmp_path), "--json"]) == 0, capsys.readouterr().err
    json.loads(capsys.readouterr().out)
    assert not (tmp_path / "helpers.ran").exists()  # was run, then refused as no pattern file
    (tmp_path / "sigmoid_chain.py").unlink()
    assert main(["explain", f"{small}:gated", "--patterns", str(tmp_path)]) == 2
    assert "no pattern file there" in one_line(capsys.readouterr().err)


def test_a_leaf_naming_nothing_is_an_input_error_naming_the_leaf(small):
    result = fuser_cli("explain", f"{small}:gated", "--leaf", "nosuchmodule")
    assert result.returncode == 2
    message = one_line(result.stderr)
    assert "--leaf 'nosuchmodule'" in message and "GatedProj" in message


@pytest.mark.parametrize("leaf", ["gate", "Gate"], ids=["submodule-name", "class-name"])
def test_a_leaf_by_submodule_or_class_name_stays_opaque(small, leaf):
    result = fuser_cli("explain", f"{small}:gated", "--json", "--leaf", leaf)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["launches_before"] == 0 and report["chains"] == []  # the gelu is inside the leaf


def test_an_internal_error_is_one_line_and_exit_3(small, monkeypatch, capsys):
    import fuser
    from fuser.tools.cli import main

    monkeypatch.setattr(fuser, "explain", mock.Mock(side_effect=RuntimeError("boom")))
    monkeypatch.delenv("FUSER_DEBUG", raising=False)
    assert main(["explain", f"{small}:gated"]) == 3
    message = one_line(capsys.readouterr().err)
    assert "internal error: RuntimeError: boom" in message and "FUSER_DEBUG=1" in message
    monkeypatch.setenv("FUSER_DEBUG", "1")
    assert main(["explain", f"{small}:gated"]) == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and "internal error: RuntimeError: boom" in err
    assert "run with FUSER_DEBUG=1" not in err  # it was


def test_fuser_debug_prints_the_traceback_of_an_input_error_too(small, monkeypatch, capsys):
    from fuser.tools.cli import main

    monkeypatch.setenv("FUSER_DEBUG", "1")
    assert main(["explain", f"{small}:raises"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "no weights here" in err
    assert err.strip().splitlines()[-1].startswith("fuser: ")  # the one line still ends it


def test_output_into_a_closed_pipe_ends_quietly(small):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "fuser", "explain", f"{small}:gated"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    proc.stdout.close()  # as `| head` does once it has read enough
    stderr = proc.stderr.read()
    assert proc.wait(timeout=240) == 0, stderr
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr


def test_version():
    import fuser

    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'version = "{fuser.__version__}"' in pyproject
    result = fuser_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"fuser {fuser.__version__}"


def test_help_names_every_command_and_every_option_has_help():
    import argparse

    from fuser.tools.cli import parser

    top = parser()
    text = " ".join(top.format_help().split())
    (commands,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    helps = {a.dest: a.help for a in commands._choices_actions}
    assert set(helps) >= {"explain", "check", "profile", "suggest", "bench", "test-pattern"}
    for name, sub in commands.choices.items():
        assert helps[name] and f"{name} {helps[name]}" in text, name
        for action in sub._actions:
            assert action.help, f"fuser {name} {'/'.join(action.option_strings) or action.dest} has no help"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message without a GPU")
def test_bench_without_a_gpu_says_so():
    result = fuser_cli("bench", "examples/dsv4/layer.py:tiny")
    assert result.returncode == 2
    assert "needs a CUDA GPU" in one_line(result.stderr)


def test_suggest_drafts_the_unfused_op_next_to_a_pattern(small):
    result = fuser_cli("suggest", f"{small}:norm_then_cumprod")
    assert result.returncode == 0, result.stderr
    assert "torch.cumprod(" in result.stdout, result.stdout
    assert "rsqrt" not in result.stdout  # the rmsnorm pattern claims that part


def test_suggest_drafts_public_apis_and_symbolic_shapes(small, tmp_path):
    from fuser.codegen.emit import template_names
    from fuser.match.pattern_files import load_pattern

    out = tmp_path / "gelu_chain.py"
    result = fuser_cli("suggest", f"{small}:gated", "-o", str(out))
    assert result.returncode == 0, result.stderr
    source = out.read_text()
    assert "F.gelu(" in source and "torch._C" not in source, source
    assert "tensor('T, N', 'bfloat16')" in source and "example=dict(N=16)" in source, source
    pattern = load_pattern(out, set(template_names()))  # a valid pattern file as drafted
    assert list(pattern.inputs) and pattern.example == {"N": 16}


def test_suggest_does_not_overwrite_a_file_without_force(small, tmp_path):
    out = tmp_path / "mine.py"
    out.write_text("# my pattern\n")
    result = fuser_cli("suggest", f"{small}:gated", "-o", str(out))
    assert result.returncode == 2
    assert "exists" in one_line(result.stderr) and "--force" in result.stderr
    assert out.read_text() == "# my pattern\n"
    result = fuser_cli("suggest", f"{small}:gated", "-o", str(out), "--force")
    assert result.returncode == 0, result.stderr
    assert "def reference(" in out.read_text()


def test_profile_and_suggest_json(small):
    result = fuser_cli("profile", f"{small}:norm_then_cumprod", "--json")
    assert result.returncode == 0, result.stderr
    profile = json.loads(result.stdout)
    assert profile["module"] == "NormThenCumprod" and profile["cost"] == "launches"
    (chain,) = profile["chains"]
    assert chain["fused_by"] == ["rmsnorm"] and chain["unfused_launches"] == 1 and "cumprod" in chain["nodes"]
    result = fuser_cli("suggest", f"{small}:norm_then_cumprod", "--json")
    assert result.returncode == 0, result.stderr
    suggestion = json.loads(result.stdout)
    assert suggestion["chain"]["nodes"] == ["cumprod"] and suggestion["file"] is None
    assert "def reference(" in suggestion["source"]


PASSING_PATTERN = '''\
"""Sigmoid in fp32."""
import torch

from fuser.pattern import tensor


def reference(x):
    return torch.sigmoid(x.float()).to(x.dtype)


PATTERN = dict(template="pointwise", inputs=dict(x=tensor("T, N", "float32")))
'''


def test_test_pattern_runs_fuser_testing_on_the_file(tmp_path):
    good, bad = tmp_path / "sigmoid.py", tmp_path / "bad.py"
    good.write_text(PASSING_PATTERN)
    bad.write_text("x = (\n")
    result = fuser_cli("test-pattern", str(good))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "pass" in result.stdout
    result = fuser_cli("test-pattern", str(bad))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "bad.py:1" in one_line(result.stderr) and result.stdout == ""  # errors on stderr


def test_test_pattern_json(tmp_path, capsys):
    from fuser.tools.cli import main

    good = tmp_path / "sigmoid.py"
    good.write_text(PASSING_PATTERN)
    assert main(["test-pattern", str(good), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["pattern"] == "sigmoid" and result["failed"] == 0 and result["passed"] == len(result["cases"]) > 0
    assert all(case["ok"] and case["problem"] is None for case in result["cases"])


def test_test_pattern_on_a_directory_is_an_input_error(tmp_path, capsys):
    from fuser.tools.cli import main

    (tmp_path / "sigmoid.py").write_text(PASSING_PATTERN)
    assert main(["test-pattern", str(tmp_path)]) == 2  # was 3, an internal error
    out, err = capsys.readouterr()
    assert out == "" and "is a directory" in one_line(err) and "sigmoid.py" in err


def test_a_factory_may_return_keyword_arguments():
    """transformers' decoder layers take their rotary tables by keyword: (module, args, kwargs)."""
    result = fuser_cli("check", "examples/zoo/layers.py:qwen3_proj")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "check passed" in result.stdout


def test_tune_without_a_gpu_is_a_usage_error():
    result = fuser_cli("tune", "examples/zoo/layers.py:qwen3_proj")
    assert result.returncode == 2 and "CUDA GPU" in result.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message without a GPU")
@pytest.mark.parametrize("command", ["bench", "tune"])
def test_bench_and_tune_take_json(command, capsys):
    from fuser.tools.cli import main

    assert main([command, "examples/zoo/layers.py:qwen3_proj", "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "CUDA GPU" in one_line(err)  # not "unrecognized arguments: --json"
