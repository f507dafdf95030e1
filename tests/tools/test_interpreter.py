"""On a machine without CUDA, fused kernels run in Triton's interpreter, which Triton reads once,
when it is imported: every entry point (``import fuser``, the ``fuser`` command, ``fuser.testing``)
chooses it before triton is imported, and a triton imported before in the wrong mode is an
error naming ``TRITON_INTERPRET``, never a partial fusion (issue 28, item 1).

Each test runs a fresh Python without ``TRITON_INTERPRET`` in its environment."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is chosen on a machine without CUDA")


def python(code: str, *args: str, timeout: float = 240, **extra_env: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python, with TRITON_INTERPRET only if ``extra_env`` sets it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(extra_env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


SIGMOID_PATTERN = '''\
"""Sigmoid in fp32: its kernel calls tl.sigmoid, one of triton's own @jit helpers."""
import torch

from fuser.pattern import tensor


def reference(x):
    return torch.sigmoid(x.float()).to(x.dtype)


PATTERN = dict(template="pointwise", inputs=dict(x=tensor("T, N", "float32")))
'''

INTERPRETED = """\
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction
    print(type(standard.sigmoid) is InterpretedFunction)  # triton's own @jit helpers, built at its import
"""


def test_importing_fuser_chooses_the_interpreter_before_triton():
    result = python("import os, fuser\nprint(os.environ.get('TRITON_INTERPRET'))\n" + textwrap.dedent(INTERPRETED))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "True"], result.stdout + result.stderr
    assert "RuntimeWarning" not in result.stderr, result.stderr


def test_the_cli_without_the_variable_runs_every_kernel(tmp_path):
    """`fuser test-pattern` said `0 of N cases pass on cpu` for a pattern that passes."""
    pattern = tmp_path / "sigmoid.py"
    pattern.write_text(SIGMOID_PATTERN)
    code = "import sys\nfrom fuser.tools.cli import main\nsys.exit(main(sys.argv[1:]))"
    result = python(code, "test-pattern", str(pattern), "--json", FUSER_KERNEL_DIR=str(tmp_path / "kernels"))
    assert result.returncode == 0, result.stdout + result.stderr
    cases = json.loads(result.stdout)
    assert cases["passed"] == len(cases["cases"]) > 0 and cases["failed"] == 0, cases


@pytest.mark.parametrize("setting", ["unset", "set-after-import"])
def test_triton_imported_compiled_before_fuser_is_reported(setting):
    code = f"""\
        import os, warnings
        import triton  # as transformers may, before fuser: compiled
        {"os.environ['TRITON_INTERPRET'] = '1'  # too late for triton" if setting == "set-after-import" else ""}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import fuser
        print(fuser.interpreter_problem())
        print("WARNED", *[str(w.message) for w in caught])
    """
    result = python(code)
    assert result.returncode == 0, result.stderr
    problem, warned = result.stdout.strip().splitlines()
    assert "TRITON_INTERPRET=1" in problem and "no CUDA GPU" in problem, problem
    if setting == "set-after-import":
        assert "set after triton was imported" in problem, problem
    assert warned.startswith("WARNED fuser: triton runs compiled"), warned


def test_the_cli_with_triton_compiled_is_an_error_naming_the_variable(tmp_path):
    code = "import sys\nfrom fuser.tools.cli import main\nsys.exit(main(sys.argv[1:]))"
    result = python(code, "explain", "examples/dsv4/layer.py:tiny", TRITON_INTERPRET="0")
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("fuser: triton runs compiled here (TRITON_INTERPRET=0)") and "TRITON_INTERPRET=1" in line
    assert result.stdout == ""


def test_golden_tests_with_triton_compiled_is_an_error_naming_the_variable():
    code = """\
        import triton, fuser.testing
        try:
            fuser.testing.golden_tests("patterns/rmsnorm.py")
        except RuntimeError as e:
            print(e)
    """
    result = python(code)
    assert result.returncode == 0, result.stderr
    assert "TRITON_INTERPRET=1" in result.stdout, result.stdout + result.stderr
    result = python("import sys, triton, fuser.testing\nsys.exit(fuser.testing.run_pattern_file('patterns/rmsnorm.py'))")
    assert result.returncode == 2 and "TRITON_INTERPRET=1" in result.stderr, result.stdout + result.stderr


# As the CLI was before it looked at triton's mode: triton compiled, the variable set too late.
CHECK_WITH_TRITON_COMPILED = """\
    import os, sys
    import triton  # compiled: its own @jit helpers (tl.sum) cannot run in an interpreted kernel
    os.environ["TRITON_INTERPRET"] = "1"
    import fuser.pipeline.fuse_module
    import fuser.tools.cli as cli
    cli.interpreter_problem = lambda: None  # do not refuse up front: see what check makes of it
    fuser.pipeline.fuse_module.interpreter_problem = lambda: None
    sys.exit(cli.main(sys.argv[1:]))
"""

APPLY_WITH_TRITON_COMPILED = """\
    import os, sys, warnings
    import triton  # compiled
    os.environ["TRITON_INTERPRET"] = "1"  # too late
    warnings.simplefilter("ignore")
    import torch, fuser
    sys.path.insert(0, os.path.dirname(sys.argv[1]))
    from norm import norm
    module, inputs = norm()
    try:
        fuser.apply(module, inputs)
    except fuser.FuserError as e:
        print(e)
        sys.exit(0 if not fuser.is_fused(module) else 1)
    sys.exit(1)
"""


NORM = """\
import torch
import torch.nn as nn


class Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(16))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (xf * self.weight).to(x.dtype)  # the rmsnorm pattern: its kernel sums with tl.sum


def norm():
    return Norm().to(torch.bfloat16), (torch.randn(5, 16).to(torch.bfloat16),)
"""


@pytest.fixture(scope="module")
def norm_module(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("interpreter") / "norm.py"
    path.write_text(NORM)
    return path


def test_check_fails_when_a_candidate_kernel_could_not_run(norm_module, tmp_path):
    """`check passed` having compared none of the kernels it could not run."""
    target = f"{norm_module}:norm"
    result = python(CHECK_WITH_TRITON_COMPILED, "check", target, FUSER_KERNEL_DIR=str(tmp_path))
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.startswith("check FAILED") and "0 fused kernels ran" in result.stdout, result.stdout
    assert "could not run at validation" in result.stdout and "rmsnorm" in result.stdout, result.stdout

    result = python(CHECK_WITH_TRITON_COMPILED, "check", target, "--json", FUSER_KERNEL_DIR=str(tmp_path))
    assert result.returncode == 1, result.stdout + result.stderr
    checked = json.loads(result.stdout)
    assert checked["ok"] is False and checked["kernels"] == 0, checked
    assert checked["kernels_not_run"] and "failed: " in checked["kernels_not_run"][0], checked
    assert checked["report"]["module"] == "Norm"


def test_apply_refuses_when_triton_runs_compiled_on_a_machine_without_cuda(norm_module, tmp_path):
    """The library, not only the command: a triton imported compiled is an error at apply,
    never a model with some of its kernels silently left out."""
    result = python(APPLY_WITH_TRITON_COMPILED, str(norm_module), FUSER_KERNEL_DIR=str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "triton runs compiled here" in result.stdout and "TRITON_INTERPRET=1" in result.stdout, result.stdout
