"""fuser.pipeline.decode_attentions: on a GPU, a model's attention calls run on fuser's decode
attention kernel at one query row of up to MAX_BATCH sequences, and greedy decode gives eager's
logits; more sequences, switched off, or on the CPU, the calls are PyTorch's."""

import copy

import pytest
import torch

import fuser
from fuser.install import decode_attention
from fuser.pipeline import decode_attentions
from fuser.validate.tolerance import LAYER, mismatch
from tests.model.test_decode import BATCH, PROMPT, greedy, prefilled, step
from tests.model.test_model import causal_lm


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


def kernel_calls(monkeypatch) -> list:
    calls = []
    real = decode_attention.takes
    monkeypatch.setattr(decode_attention, "takes", lambda *a, **k: (calls.append(a[0].shape) or True) and real(*a, **k))
    return calls


@pytest.mark.parametrize("model_name", ["llama", "qwen3"])
def test_a_model_s_attention_runs_on_the_kernel_and_decode_is_eager_s(monkeypatch, model_name):
    model = causal_lm(model_name, layers=2)
    cache, tokens = prefilled(model)
    eager_model = copy.deepcopy(model)
    monkeypatch.setattr(decode_attentions, "on_gpu", lambda inputs: True)  # as on a GPU
    report = fuser.apply(model, (), example_kwargs=step(tokens, PROMPT, copy.deepcopy(cache)))
    (group,) = report.groups
    assert len(group.report.decode_attention) == 1, group.report.text()
    assert "attention calls on fuser's decode attention kernel" in report.text()

    calls = kernel_calls(monkeypatch)
    eager = greedy(eager_model, copy.deepcopy(cache), tokens)
    fused = greedy(model, copy.deepcopy(cache), tokens)
    assert calls == [], calls  # BATCH sequences: more than the kernel is called for, PyTorch's
    monkeypatch.setattr(decode_attention, "MAX_BATCH", BATCH)
    fused = greedy(model, copy.deepcopy(cache), tokens)
    assert len(calls) == 2 * len(fused) and all(shape[0] == BATCH and shape[2] == 1 for shape in calls), calls
    for i, (got, expected) in enumerate(zip(fused, eager)):
        problem = mismatch(got, expected, f"logits at step {i}", LAYER)
        assert problem is None, problem


@pytest.mark.parametrize("how", ["switched off", "on the CPU"])
def test_switched_off_or_on_the_cpu_the_calls_are_pytorch_s(monkeypatch, how):
    model = causal_lm("llama", layers=1)
    cache, tokens = prefilled(model)
    if how == "switched off":
        monkeypatch.setattr(decode_attentions, "on_gpu", lambda inputs: True)
    off = ("decode_attention",) if how == "switched off" else ()
    report = fuser.apply(model, (), example_kwargs=step(tokens, PROMPT, copy.deepcopy(cache)), disable_passes=off)
    assert report.groups[0].report.decode_attention == []
    calls = kernel_calls(monkeypatch)
    monkeypatch.setattr(decode_attention, "MAX_BATCH", BATCH)
    greedy(model, copy.deepcopy(cache), tokens)
    assert calls == []
