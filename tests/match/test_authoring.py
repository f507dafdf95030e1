"""docs/authoring.md, step by step: profile, suggest, the edited pattern, its golden check."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fuser
from examples.authoring.quick_gelu import block
from fuser.match.pattern_files import load_pattern
from fuser.validate.tolerance import KERNEL, mismatch

ROOT = Path(__file__).resolve().parents[2]
PATTERN = ROOT / "examples/authoring/quick_gelu_pattern.py"


def run_fuser(*args):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "fuser", *args], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    ).stdout


def test_profile_lists_the_chain_as_generic():
    out = run_fuser("profile", "examples/authoring/quick_gelu.py:block")
    assert "5 launches" in out and "fused by: generic" in out


def test_suggest_drafts_a_pattern_that_claims_the_chain(tmp_path):
    draft = tmp_path / "quick_gelu.py"
    run_fuser("suggest", "examples/authoring/quick_gelu.py:block", "-o", str(draft))
    source = draft.read_text()
    assert "def reference(up):" in source and "torch.sigmoid" in source and "template='pointwise'" in source
    module, inputs = block()
    report = fuser.explain(module, inputs, patterns=[draft])
    assert [c.pattern for c in report.chains] == ["quick_gelu"], report.text()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("width", [7, 64, 123])
def test_the_edited_pattern_is_general_and_golden(dtype, width):
    reference = load_pattern(PATTERN).reference

    class Chain(torch.nn.Module):
        def forward(self, x):
            xf = x.float()
            return (xf * torch.sigmoid(1.702 * xf)).to(x.dtype)

    module = Chain()
    report = fuser.apply(module, (torch.randn(3, width).to(dtype),), patterns=[PATTERN])
    assert [c.pattern for c in report.chains] == ["quick_gelu_pattern"], report.text()
    assert report.chains[0].params == {"alpha": 1.702}
    for T in (1, 3, 16):
        x = torch.randn(T, width).to(dtype)
        assert mismatch(module(x), reference(x), f"T={T}", KERNEL) is None
