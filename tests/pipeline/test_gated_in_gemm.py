"""fuser.pipeline.gated_in_gemm: where the merged gate/up GEMM runs on the decode GEMM kernel, the
gated activation (Llama's SiLU, Gemma's tanh GELU) is computed by that kernel and its own launch
goes; past the table's token counts PyTorch's GEMM runs and the product's kernel after it; greedy
decode gives eager's logits either way."""

import copy

import pytest
import torch

import fuser
from fuser.install import decode_gemm
from fuser.pipeline import decode_gemms
from fuser.validate.tolerance import LAYER, mismatch
from tests.model.test_decode import BATCH, PROMPT, greedy, prefilled, step
from tests.model.test_model import causal_lm
from tests.pipeline.test_decode_gemms import shapes, write_table


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


def spy(monkeypatch, name):
    calls = []
    real = getattr(decode_gemm, name)
    monkeypatch.setattr(decode_gemm, name, lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    return calls


@pytest.mark.parametrize("model_name,activation", [("llama", "silu"), ("gemma2", "gelu_tanh")])
@pytest.mark.parametrize("up_to", [16, 1], ids=["kernel", "past the table"])
def test_the_decode_gemm_computes_the_gated_activation_and_decode_is_eager_s(tmp_path, monkeypatch, model_name, activation, up_to):
    model = causal_lm(model_name, layers=2)
    cache, tokens = prefilled(model)
    eager_model = copy.deepcopy(model)
    monkeypatch.setenv(decode_gemm.TABLE_ENV, write_table(tmp_path, shapes(model.model.layers[0]), up_to=up_to))
    gated = spy(monkeypatch, "gated")

    report = fuser.apply(model, (), example_kwargs=step(tokens, PROMPT, copy.deepcopy(cache)))
    said = report.groups[0].report.gated_in_gemm
    assert len(said) == 1 and f"{activation}(mlp.gate_proj) * mlp.up_proj" in said[0], report.text()
    assert "gated activations computed by the decode GEMM kernel" in report.text()

    gated.clear()
    eager = greedy(eager_model, copy.deepcopy(cache), tokens)
    fused = greedy(model, copy.deepcopy(cache), tokens)
    # BATCH token rows a step: on the kernel where the table's up_to takes them, else PyTorch's GEMM
    assert len(gated) == (2 * len(fused) if BATCH <= up_to else 0), gated
    for i, (got, expected) in enumerate(zip(fused, eager)):
        problem = mismatch(got, expected, f"logits at step {i}", LAYER)
        assert problem is None, problem


def test_switched_off_the_product_keeps_its_own_kernel(tmp_path, monkeypatch):
    model = causal_lm("llama", layers=1)
    cache, tokens = prefilled(model)
    monkeypatch.setenv(decode_gemm.TABLE_ENV, write_table(tmp_path, shapes(model.model.layers[0])))
    gated = spy(monkeypatch, "gated")
    kwargs = step(tokens, PROMPT, copy.deepcopy(cache))
    on = fuser.apply(copy.deepcopy(model), (), example_kwargs=kwargs).groups[0].report
    off = fuser.apply(model, (), example_kwargs=kwargs, disable_passes=("gated_in_gemm",)).groups[0].report
    assert off.gated_in_gemm == [] and len(on.gated_in_gemm) == 1
    gated.clear()
    greedy(model, copy.deepcopy(cache), tokens)
    assert gated == []


def test_without_a_table_nothing_is_said_or_changed(monkeypatch):
    monkeypatch.delenv(decode_gemm.TABLE_ENV, raising=False)
    model = causal_lm("llama", layers=1)
    cache, tokens = prefilled(model)
    report = fuser.apply(model, (), example_kwargs=step(tokens, PROMPT, copy.deepcopy(cache))).groups[0].report
    assert report.gated_in_gemm == [] and report.gated_apart == {}


def reports(report):
    return [g.report for g in report.groups if g.report is not None]


@pytest.mark.parametrize("model_name", ["qwen2_moe", "gemma2", "mixtral", "deepseek_v4", "glm4"])
def test_the_tune_command_the_report_gives_moves_every_gemm_and_decode_stays_eager_s(tmp_path, monkeypatch, model_name):
    """As a user on a GPU whose table lacks the model's shapes: the report names them, the table
    made for them moves every one to the kernel (shared experts, routers, fused gate/up
    projections, MoE layers alike) and greedy decode still gives eager's logits."""
    model = causal_lm(model_name, layers=2)
    cache, tokens = prefilled(model)
    eager_model = copy.deepcopy(model)
    monkeypatch.setattr(decode_gemms, "on_gpu", lambda weight: True)
    monkeypatch.delenv(decode_gemm.TABLE_ENV, raising=False)
    kwargs = step(tokens, PROMPT, copy.deepcopy(cache))
    first = reports(fuser.apply(copy.deepcopy(model), (), example_kwargs=kwargs))
    untimed = sorted({s for r in first for s in r.decode_gemms_untimed})
    assert untimed and all(s.endswith(" float32") for s in untimed), untimed
    timed = {tuple(int(v) for v in s.split()[0].split("x")) for s in untimed}
    monkeypatch.setenv(decode_gemm.TABLE_ENV, write_table(tmp_path, timed))

    again = reports(fuser.apply(model, (), example_kwargs=kwargs))
    assert [r.decode_gemms_untimed for r in again] == [[] for _ in again]
    assert sum(len(r.decode_gemms) for r in again) >= len(timed)
    eager = greedy(eager_model, copy.deepcopy(cache), tokens)
    fused = greedy(model, copy.deepcopy(cache), tokens)
    for i, (got, expected) in enumerate(zip(fused, eager)):
        problem = mismatch(got, expected, f"logits at step {i}", LAYER)
        assert problem is None, problem


@pytest.mark.parametrize("model_name", ["phi3", "glm4"])
def test_one_gate_up_layer_chunked_in_two_is_taken_too(tmp_path, monkeypatch, model_name):
    model = causal_lm(model_name, layers=2)
    cache, tokens = prefilled(model)
    eager_model = copy.deepcopy(model)
    layer = model.model.layers[0]
    found = {tuple(m.weight.shape) for m in layer.modules() if isinstance(m, torch.nn.Linear)}
    found.add((sum(layer.self_attn.get_submodule(n).out_features for n in ("q_proj", "k_proj", "v_proj")), layer.self_attn.q_proj.in_features)
              if hasattr(layer.self_attn, "q_proj") else tuple(layer.self_attn.qkv_proj.weight.shape))  # fmt: skip
    monkeypatch.setenv(decode_gemm.TABLE_ENV, write_table(tmp_path, found))
    gated = spy(monkeypatch, "gated")
    report = fuser.apply(model, (), example_kwargs=step(tokens, PROMPT, copy.deepcopy(cache))).groups[0].report
    assert len(report.gated_in_gemm) == 1 and "silu(mlp.gate_up_proj[..., :half]) * mlp.gate_up_proj[..., half:]" in report.gated_in_gemm[0], report.text()
    gated.clear()
    eager = greedy(eager_model, copy.deepcopy(cache), tokens)
    fused = greedy(model, copy.deepcopy(cache), tokens)
    assert len(gated) == 2 * len(fused)
    for i, (got, expected) in enumerate(zip(fused, eager)):
        problem = mismatch(got, expected, f"logits at step {i}", LAYER)
        assert problem is None, problem
