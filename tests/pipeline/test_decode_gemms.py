"""fuser.pipeline.decode_gemms: with a decode-GEMM table that holds a model's weight shapes, its
layers' GEMMs (merged projections, and the one that adds the residual) run on fuser's decode
GEMM kernel, and greedy decode gives eager's logits; without a table nothing changes."""

import copy
import dataclasses
import json

import pytest
import torch

import fuser
from fuser.install import decode_gemm, kv_cache
from fuser.install.splice import STATE_ATTR
from fuser.pipeline import decode_gemms, passes
from fuser.validate.tolerance import LAYER, mismatch
from tests.model.test_decode import PROMPT, greedy, prefilled, step
from tests.model.test_model import causal_lm


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


def shapes(layer) -> set[tuple[int, int]]:
    linears = [m for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    found = {tuple(m.weight.shape) for m in linears}
    attn, mlp = layer.self_attn, layer.mlp
    found.add((attn.q_proj.out_features + attn.k_proj.out_features + attn.v_proj.out_features, attn.q_proj.in_features))
    found.add((mlp.gate_proj.out_features + mlp.up_proj.out_features, mlp.gate_proj.in_features))
    return found


def write_table(tmp_path, found, up_to=16, dtype="float32", config=None) -> str:
    config = config or dict(block_n=16, block_k=32, warps=2)
    entries = [dict(n=n, k=k, dtype=dtype, up_to=up_to, config=config) for n, k in sorted(found)]
    path = tmp_path / "decode_gemm.json"
    path.write_text(json.dumps({"gpu": "test", "entries": entries}))
    return str(path)


def test_a_model_s_gemms_run_on_the_kernel_and_decode_as_eager(tmp_path, monkeypatch):
    model = causal_lm("llama", layers=2)
    cache, tokens = prefilled(model)
    eager_model = copy.deepcopy(model)
    monkeypatch.setenv(decode_gemm.TABLE_ENV, write_table(tmp_path, shapes(model.model.layers[0])))
    launches, gated = [], []
    real, real_gated = decode_gemm.linear, decode_gemm.gated
    monkeypatch.setattr(decode_gemm, "linear", lambda *a, **k: launches.append(a[2]) or real(*a, **k))
    monkeypatch.setattr(decode_gemm, "gated", lambda *a, **k: gated.append(a[2]) or real_gated(*a, **k))

    report = fuser.apply(model, (), example_kwargs=step(tokens, PROMPT, copy.deepcopy(cache)))
    (group,) = report.groups
    said = group.report.decode_gemms
    assert [s.split(":")[0] for s in said] == ["merged_self_attn_q_proj", "self_attn.o_proj", "merged_mlp_gate_proj",
                                               "mlp.down_proj (adding the residual)"], group.report.text()  # fmt: skip
    assert "GEMMs on fuser's decode GEMM kernel" in report.text()

    launches.clear(), gated.clear()
    eager = greedy(eager_model, copy.deepcopy(cache), tokens)
    fused = greedy(model, copy.deepcopy(cache), tokens)
    # four GEMMs a layer, two layers, each step: gate/up with its gated activation (gated_in_gemm),
    # q/k/v with the input norm (norm_in_gemm); and the LM head, its 128×64 weight of a shape the
    # table holds (the merged q/k/v's)
    assert (len(launches), len(gated)) == ((2 * 2 + 1) * len(fused), 2 * len(fused))
    for i, (got, expected) in enumerate(zip(fused, eager)):
        problem = mismatch(got, expected, f"logits at step {i}", LAYER)
        assert problem is None, problem

    model.model.layers[0].self_attn.o_proj.register_forward_hook(lambda m, a, out: out)
    greedy(model, copy.deepcopy(cache), tokens)
    declined = model.model.layers[0].__dict__[STATE_ATTR].calls.declined
    assert any("forward hook" in reason for reason in declined), declined


def test_without_a_table_or_with_none_faster_nothing_changes(tmp_path, monkeypatch):
    model = causal_lm("llama", layers=2)
    cache, tokens = prefilled(model)
    monkeypatch.delenv(decode_gemm.TABLE_ENV, raising=False)
    first = fuser.apply(copy.deepcopy(model), (), example_kwargs=step(tokens, PROMPT, copy.deepcopy(cache)))
    assert first.groups[0].report.decode_gemms == []
    monkeypatch.setenv(decode_gemm.TABLE_ENV, write_table(tmp_path, shapes(model.model.layers[0]), up_to=0))
    second = fuser.apply(copy.deepcopy(model), (), example_kwargs=step(tokens, PROMPT, copy.deepcopy(cache)))
    assert second.groups[0].report.decode_gemms == []


@pytest.mark.parametrize("off", [(), ("pdl",)], ids=["pdl", "pdl off"])
def test_the_kernel_is_launched_with_pdl_where_the_pdl_pass_is_on_and_the_gpu_has_it(tmp_path, monkeypatch, off):
    model = causal_lm("llama", layers=1)
    cache, tokens = prefilled(model)
    monkeypatch.setenv(decode_gemm.TABLE_ENV, write_table(tmp_path, shapes(model.model.layers[0])))
    monkeypatch.setattr(passes, "has_pdl", lambda traced: True)  # as on an H100: the interpreter has no PDL
    monkeypatch.setattr(kv_cache, "updater", lambda pdl: kv_cache.update)  # (the cache's write: its own PDL test is on the GPU)
    configs = []
    real = decode_gemm.linear
    monkeypatch.setattr(decode_gemm, "linear", lambda x, w, config, *a: configs.append(config) or real(x, w, dataclasses.replace(config, pdl=False), *a))

    report = fuser.apply(model, (), example_kwargs=step(tokens, PROMPT, copy.deepcopy(cache)), disable_passes=off)
    configs.clear()
    greedy(model, copy.deepcopy(cache), tokens)
    assert len(configs) >= 4 and {c.pdl for c in configs} == {not off}
    said = report.groups[0].report.decode_gemms
    assert all(("launched with PDL at 1" in s) == (not off) for s in said), said


def test_the_report_names_the_shapes_the_table_lacks_and_the_command_that_times_them(tmp_path, monkeypatch):
    model = causal_lm("llama", layers=1)
    cache, tokens = prefilled(model)
    layer = model.model.layers[0]
    held = {(layer.self_attn.o_proj.out_features, layer.self_attn.o_proj.in_features)}
    monkeypatch.setenv(decode_gemm.TABLE_ENV, write_table(tmp_path, held))
    kwargs = step(tokens, PROMPT, copy.deepcopy(cache))
    on_cpu = fuser.apply(copy.deepcopy(model), (), example_kwargs=kwargs).groups[0].report
    assert on_cpu.decode_gemms_untimed == []  # no table is ever for the CPU: nothing to say
    monkeypatch.setattr(decode_gemms, "on_gpu", lambda weight: True)
    report = fuser.apply(model, (), example_kwargs=kwargs).groups[0].report
    attn, mlp = layer.self_attn, layer.mlp
    qkv = f"{attn.q_proj.out_features + attn.k_proj.out_features + attn.v_proj.out_features}x{attn.q_proj.in_features}"
    gate_up = f"{mlp.gate_proj.out_features + mlp.up_proj.out_features}x{mlp.gate_proj.in_features}"
    down = f"{mlp.down_proj.out_features}x{mlp.down_proj.in_features}"
    assert report.decode_gemms_untimed == [f"{qkv} float32", f"{gate_up} float32", f"{down} float32"]
    assert [s.split(":")[0] for s in report.decode_gemms] == ["self_attn.o_proj"]
    assert f"fuser tune --decode-gemm --shapes {qkv},{gate_up},{down} --dtypes float32" in report.text()


def test_an_lm_head_the_table_holds_runs_on_the_kernel_and_decode_is_eager_s(tmp_path, monkeypatch):
    # The model's own forward saves no glue launch: it is fused for its LM head's GEMM alone.
    model = causal_lm("llama", layers=2)
    cache, tokens = prefilled(model)
    eager_model = copy.deepcopy(model)
    head = tuple(model.lm_head.weight.shape)
    kwargs = step(tokens, PROMPT, copy.deepcopy(cache))
    monkeypatch.setattr(decode_gemms, "on_gpu", lambda weight: True)  # the untimed shapes are said on a GPU
    monkeypatch.setenv(decode_gemm.TABLE_ENV, write_table(tmp_path, shapes(model.model.layers[0]) - {head}))
    without = fuser.apply(copy.deepcopy(model), (), example_kwargs=kwargs)
    assert "LlamaForCausalLM.forward" in without.skipped, without.text()
    said = without.skipped["LlamaForCausalLM.forward"]
    assert f"{head[0]}x{head[1]} float32" in said and f"--shapes {head[0]}x{head[1]}" in said, said

    monkeypatch.setenv(decode_gemm.TABLE_ENV, write_table(tmp_path, shapes(model.model.layers[0]) | {head}))
    report = fuser.apply(model, (), example_kwargs=kwargs)
    forward = report.others["LlamaForCausalLM.forward"]
    assert [s.split(":")[0] for s in forward.decode_gemms] == ["lm_head"], forward.text()
    heads = []
    real = decode_gemm.linear
    monkeypatch.setattr(decode_gemm, "linear", lambda x, w, *a, **k: (w is model.lm_head.weight and heads.append(x.shape)) or real(x, w, *a, **k))
    eager = greedy(eager_model, copy.deepcopy(cache), tokens)
    fused = greedy(model, copy.deepcopy(cache), tokens)
    assert len(heads) == len(fused), heads  # once a step
    for i, (got, expected) in enumerate(zip(fused, eager)):
        problem = mismatch(got, expected, f"logits at step {i}", LAYER)
        assert problem is None, problem
