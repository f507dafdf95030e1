"""fuser.pipeline.decode_attentions: on a GPU, a model's attention calls run on fuser's decode
attention kernel at one query row of up to MAX_BATCH sequences, and greedy decode gives eager's
logits; more sequences, switched off, or on the CPU, the calls are PyTorch's. The static cache's
write before such a call is made by the same kernel."""

import copy
import operator

import pytest
import torch
import torch.fx as fx

import fuser
from fuser.install import cache_in_attention, decode_attention, kv_cache
from fuser.pipeline import decode_attentions
from fuser.validate.tolerance import LAYER, mismatch
from tests.kernels.test_decode_attention import spy_combines
from tests.model.test_decode import BATCH, PROMPT, greedy, prefilled, step
from tests.model.test_model import causal_lm


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


def kernel_calls(monkeypatch) -> list:
    """Each launch of the attention kernel, as the query's shape and whether it wrote the cache."""
    calls = []
    real = decode_attention._attend_launch

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                calls.append((args[0].shape, kwargs["WRITE"]))
                return real[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(decode_attention, "_attend_launch", Spy())
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
    assert len(calls) == 2 * len(fused) and all(shape[0] == BATCH and shape[2] == 1 for shape, _ in calls), calls
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


@pytest.mark.parametrize("model_name,how", [(name, how) for name in ("llama", "qwen3") for how in ("merged", "switched off")]
                         + [("llama", "merged, combined apart")])  # fmt: skip
def test_the_cache_write_runs_in_the_attention_kernel_and_decode_is_eager_s(monkeypatch, model_name, how):
    # The static cache's write and the attention after it as one kernel at decode: the cache
    # holds eager's rows after each step, the logits are eager's; more sequences than the kernel
    # is called for, the write and PyTorch's attention run apart as before. Merged, the slices of
    # the keys are combined in that kernel too, unless that pass is off.
    model = causal_lm(model_name, layers=2)
    cache, tokens = prefilled(model)
    eager_model = copy.deepcopy(model)
    monkeypatch.setattr(decode_attentions, "on_gpu", lambda inputs: True)  # as on a GPU
    off = {"merged": (), "merged, combined apart": ("combine_in_attention",), "switched off": ("cache_write_in_attention",)}[how]
    report = fuser.apply(model, (), example_kwargs=step(tokens, PROMPT, copy.deepcopy(cache)), disable_passes=off)
    (line,) = report.groups[0].report.decode_attention
    assert ("writing the cache before it (past_key_values.update)" in line) == how.startswith("merged"), line
    assert ("combining its slices of keys itself" in line) == (how == "merged"), line

    monkeypatch.setattr(decode_attention, "BLOCK_S", 8)  # the tiny cache (11 keys) in two slices
    monkeypatch.setattr(decode_attention, "slices", lambda *shape: 2)
    combines = spy_combines(monkeypatch)
    calls = kernel_calls(monkeypatch)
    eager_cache = copy.deepcopy(cache)
    eager = greedy(eager_model, eager_cache, tokens)
    for max_batch in (1, BATCH):
        monkeypatch.setattr(decode_attention, "MAX_BATCH", max_batch)
        calls.clear()
        fused_cache = copy.deepcopy(cache)
        fused = greedy(model, fused_cache, tokens)
        expected = [how.startswith("merged")] * 2 * len(fused) if max_batch == BATCH else []  # a call a layer a step, or none
        assert [wrote for _, wrote in calls] == expected, calls
        for i, (got, expected) in enumerate(zip(fused, eager)):
            problem = mismatch(got, expected, f"logits at step {i}, up to {max_batch} sequences", LAYER)
            assert problem is None, problem
        for i, (got, expected) in enumerate(zip(fused_cache.layers, eager_cache.layers)):
            assert torch.equal(got.cumulative_length, expected.cumulative_length), i
            for name in ("keys", "values"):
                problem = mismatch(getattr(got, name), getattr(expected, name), f"layer {i}'s cached {name}", LAYER)
                assert problem is None, problem
    assert len(combines) == (0 if how == "merged" else 2 * len(fused)), combines  # (none at one sequence: PyTorch's attention)


def test_a_cache_read_between_the_write_and_the_attention_keeps_them_apart():
    # Rewritten by hand: the update, then a read of the cache object, then the attention: the
    # attention's write would come after that read, so the two stay apart. Without the read, merged.
    def graph(read_between: bool) -> fx.Graph:
        g = fx.Graph()
        cache, q, k, v = (g.placeholder(n) for n in ("past_key_values", "q", "k", "v"))
        update = g.call_function(kv_cache.updater(False), (cache, k, v, 0))
        keys, values = (g.call_function(operator.getitem, (update, i)) for i in (0, 1))
        if read_between:
            g.call_method("get_seq_length", (cache,))
        g.output(g.call_function(decode_attention.launcher(False), (q, keys, values), {"enable_gqa": True}))
        return g

    assert decode_attentions.cache_writes_in_attention(graph(True)) == []
    merged = graph(False)
    assert decode_attentions.cache_writes_in_attention(merged) == [("decode_attention", "past_key_values.update")]
    assert [n.target for n in merged.nodes if n.op == "call_function"] == [cache_in_attention.writer(False)]
