"""examples/zoo/generate_sweep.py: one model's line (fp32 and bf16), and a model transformers
cannot build listed as such, not as fuser's failure."""

import pytest
import torch

from examples.zoo import generate_sweep


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_s_line_says_its_tokens_and_fused_steps(dtype):
    line = generate_sweep.swept("llama", dtype)
    assert line == f"| llama | eager's | {generate_sweep.NEW - 1} | - | - |", line


def test_a_model_that_cannot_be_built_is_listed_with_the_reason(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("no such config")

    monkeypatch.setattr(generate_sweep.zoo, "causal_lm", refuse)
    assert generate_sweep.swept("llama") == "| llama | not built: RuntimeError: no such config | | | |"
