"""`pip install .` ships the patterns and templates inside the wheel, and an installed fuser
finds them there (not in a checkout); the wheel declares what a CPU-only machine needs to run
the `fuser` command (numpy for Triton's interpreter, the triton versions tested)."""

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """The wheel, and the directory it is installed into (``--target``, without dependencies)."""
    tmp = tmp_path_factory.mktemp("wheel")
    wheels, target = tmp / "wheels", tmp / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(wheels)],
        check=True,
    )
    wheel = next(wheels.glob("fuser-*.whl"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)], check=True
    )
    return wheel, target


def test_wheel_ships_patterns_and_templates(installed, tmp_path):
    _, target = installed
    probe = (
        "import fuser, fuser.codegen.emit, fuser.pattern as p, fuser.match.pattern_files as files;"
        "print(p.patterns_dir()); print(sorted(x.name for x in files.load_patterns()));"
        "print(sorted(fuser.codegen.emit.template_names()))"
    )
    env = dict(os.environ, PYTHONPATH=str(target))
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[0].startswith(str(target)), out[0]
    assert eval(out[1]) == sorted(p.stem for p in (ROOT / "patterns").glob("*.py") if not p.name.startswith("_"))
    shipped = sorted(t.name.removesuffix(".py.jinja") for t in (ROOT / "templates").glob("*.py.jinja") if not t.name.startswith("_"))
    assert eval(out[2]) == shipped and "strided_copy" in shipped


def test_wheel_requires_numpy_and_the_triton_versions_tested(installed):
    wheel, _ = installed
    with zipfile.ZipFile(wheel) as z:
        metadata = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    requires = {
        re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower(): r
        for r in re.findall(r"^Requires-Dist: (.+)$", metadata, re.M)
        if "extra ==" not in r
    }
    assert "numpy" in requires, requires  # Triton's CPU interpreter imports it
    assert re.search(r"<\s*3\.7", requires["triton"]) and re.search(r">=\s*3\.6", requires["triton"]), requires["triton"]
    assert "<" in requires["torch"], requires["torch"]


def test_installed_command_explains_the_demo_outside_the_checkout(installed, tmp_path):
    _, target = installed
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the command turns it on
    env.update(PYTHONPATH=str(target), FUSER_KERNEL_DIR=str(tmp_path / "kernels"))
    result = subprocess.run(
        [str(target / "bin" / "fuser"), "explain", str(ROOT / "examples" / "dsv4" / "layer.py") + ":tiny"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert re.search(r"glue kernel launches per call: \d+ eager -> \d+ fused", result.stdout), result.stdout
