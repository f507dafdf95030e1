"""`pip install .` ships the patterns and templates inside the wheel, and an installed fuser
finds them there (not in a checkout)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_ships_patterns_and_templates(tmp_path):
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(wheels)],
        check=True,
    )
    wheel = next(wheels.glob("fuser-*.whl"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)], check=True
    )
    probe = (
        "import fuser, fuser.emit, fuser.pattern as p;"
        "print(p.patterns_dir()); print(sorted(x.name for x in p.load_patterns()));"
        "print(sorted(fuser.emit.template_names()))"
    )
    env = dict(os.environ, PYTHONPATH=str(target))
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[0].startswith(str(target)), out[0]
    assert eval(out[1]) == sorted(p.stem for p in (ROOT / "patterns").glob("*.py") if not p.name.startswith("_"))
    assert eval(out[2]) == ["pointwise", "row_reduce", "sinkhorn"]
