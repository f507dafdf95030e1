"""The ``fuser`` command's ``--batch-input NAME=DIM``: the inputs that follow the tokens, read as
``fuser.apply(batch_inputs=...)`` reads them. At one token an ALiBi bias of ``[heads, 1, kv]``
cannot be told from a size of its own: without the flag it is held, and the refusal names it
and the flag (exit 2, never an internal error); with it, the layer fuses and checks."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FACTORY = """
import sys
sys.path.insert(0, {tests!r})
import torch
from test_token_dims import AlibiScores, alibi_inputs

def one_token():
    torch.manual_seed(0)
    return AlibiScores().eval(), alibi_inputs(1)
"""


def fuser_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "fuser", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


def test_batch_input_declares_the_dims_that_follow_the_tokens(tmp_path):
    (tmp_path / "alibi.py").write_text(FACTORY.format(tests=str(ROOT / "tests" / "trace")))
    held = fuser_cli("check", "alibi.py:one_token", cwd=tmp_path)
    assert held.returncode == 2, held.stderr
    assert "alibi [4, 1, 7]" in held.stderr and "--batch-input NAME=DIM" in held.stderr
    assert "internal error" not in held.stderr
    declared = fuser_cli("check", "alibi.py:one_token", "--batch-input", "hidden=0", "--batch-input", "keys=0",
                         "--batch-input", "alibi=0", cwd=tmp_path)  # fmt: skip
    assert declared.returncode == 0, declared.stderr
    assert "check passed" in declared.stdout
    bad = fuser_cli("check", "alibi.py:one_token", "--batch-input", "alibi", cwd=tmp_path)
    assert bad.returncode == 2 and "--batch-input 'alibi': give NAME=DIM" in bad.stderr, bad.stderr
    out_of_range = fuser_cli("check", "alibi.py:one_token", "--batch-input", "alibi=5", cwd=tmp_path)
    assert out_of_range.returncode == 2 and "batch_inputs gives 'alibi' dim 5" in out_of_range.stderr, out_of_range.stderr
