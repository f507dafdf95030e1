"""fuser.pipeline.norm_in_gemm: where a GEMM on the decode GEMM kernel reads an RMSNorm's output
(the merged q/k/v projection the input norm's, the merged gate/up the post-attention norm's, of
the residual add), the kernel computes the norm as its prologue and the norm's launch goes;
past the table's token counts the norm's kernel and PyTorch's GEMM run; greedy decode gives
eager's logits either way. (Each norm form the kernel computes, Gemma's 1 + weight too, is
checked against its eager ops in tests/kernels/test_decode_gemm.py; Gemma2's and Gemma3's
layers compute their pre-MLP norm in one kernel with the norm and add before it, and their
input norm the layer before computes: both stay as they are.)"""

import copy

import pytest
import torch

import fuser
from fuser.install import decode_gemm
from fuser.validate.tolerance import LAYER, mismatch
from tests.model.test_decode import BATCH, PROMPT, greedy, prefilled, step
from tests.model.test_model import causal_lm
from tests.pipeline.test_decode_gemms import shapes, write_table


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


def prologues(monkeypatch) -> list:
    """The norm forms the kernel's launches compute, as they run."""
    calls = []
    real = decode_gemm._run
    monkeypatch.setattr(decode_gemm, "_run", lambda *a, norm=None, **k: calls.append(norm and norm.form) or real(*a, norm=norm, **k))
    return calls


@pytest.mark.parametrize("model_name,form", [("llama", "weight_after_cast"), ("qwen3", "weight_after_cast")])
@pytest.mark.parametrize("up_to", [16, 1], ids=["kernel", "past the table"])
def test_the_decode_gemm_computes_the_norms_and_decode_is_eager_s(tmp_path, monkeypatch, model_name, form, up_to):
    model = causal_lm(model_name, layers=2)
    cache, tokens = prefilled(model)
    eager_model = copy.deepcopy(model)
    monkeypatch.setenv(decode_gemm.TABLE_ENV, write_table(tmp_path, shapes(model.model.layers[0]), up_to=up_to))
    report = fuser.apply(model, (), example_kwargs=step(tokens, PROMPT, copy.deepcopy(cache)))
    said = report.groups[0].report.norm_in_gemm
    assert len(said) == 2 and all(form in s for s in said) and sum("of an add" in s for s in said) == 1, report.text()
    assert "RMSNorms computed by the decode GEMM kernel" in report.text()

    calls = prologues(monkeypatch)
    eager = greedy(eager_model, copy.deepcopy(cache), tokens)
    fused = greedy(model, copy.deepcopy(cache), tokens)
    # BATCH rows a step: the two norms of each layer by the kernel where the table takes them
    assert calls.count(form) == (2 * 2 * len(fused) if BATCH <= up_to else 0), calls
    for i, (got, expected) in enumerate(zip(fused, eager)):
        problem = mismatch(got, expected, f"logits at step {i}", LAYER)
        assert problem is None, problem


def test_switched_off_the_norms_keep_their_kernels(tmp_path, monkeypatch):
    model = causal_lm("llama", layers=1)
    cache, tokens = prefilled(model)
    monkeypatch.setenv(decode_gemm.TABLE_ENV, write_table(tmp_path, shapes(model.model.layers[0])))
    kwargs = step(tokens, PROMPT, copy.deepcopy(cache))
    off = fuser.apply(model, (), example_kwargs=kwargs, disable_passes=("norm_in_gemm",)).groups[0].report
    assert off.norm_in_gemm == []
    calls = prologues(monkeypatch)
    greedy(model, copy.deepcopy(cache), tokens)
    assert calls and not any(calls)


def test_without_a_table_nothing_is_said_or_changed(monkeypatch):
    monkeypatch.delenv(decode_gemm.TABLE_ENV, raising=False)
    model = causal_lm("llama", layers=1)
    cache, tokens = prefilled(model)
    report = fuser.apply(model, (), example_kwargs=step(tokens, PROMPT, copy.deepcopy(cache))).groups[0].report
    assert report.norm_in_gemm == [] and report.norms_apart == {}


def test_a_norm_whose_kernel_reads_its_inputs_through_other_ops_is_left_apart_with_its_reason(tmp_path, monkeypatch):
    # Phi-3 adds the attention's output through an identity dropout before its post-attention
    # norm: that norm's kernel reads the dropout's input, the add's operand is another node.
    model = causal_lm("phi3", layers=1)
    cache, tokens = prefilled(model)
    layer = model.model.layers[0]
    found = {tuple(m.weight.shape) for m in layer.modules() if isinstance(m, torch.nn.Linear)}
    monkeypatch.setenv(decode_gemm.TABLE_ENV, write_table(tmp_path, found))
    report = fuser.apply(model, (), example_kwargs=step(tokens, PROMPT, copy.deepcopy(cache))).groups[0].report
    assert report is not None
    assert any("through ops of its own" in why for why in report.norms_apart.values()), report.text()
    assert len(report.norm_in_gemm) == 1 and "of an add" not in report.norm_in_gemm[0], report.text()
