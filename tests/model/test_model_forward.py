"""A model's own forward, around its layers: the positions and the causal mask it computes from
its cache. A getter of the cache that returns sizes (``get_mask_sizes``) is read as a value and
called by the guard; one whose value the forward moves on (a length kept as a Python int) stays
a call. The index arithmetic, where no value follows the tokens, runs as one program, exactly in
integers."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

import fuser
from fuser.install.splice import STATE_ATTR, is_fused
from fuser.trace.tracing import trace

H = 8
WINDOW = 3


class Cache:
    """A cache as transformers' are asked: sizes by a getter, its length as a tensor, and a
    count of the steps written as a Python int that the forward moves on."""

    def __init__(self, size: int, length: int):
        self.keys = torch.zeros(size, H)
        self.length = torch.tensor(length)
        self.size = size
        self.steps = 0

    def get_mask_sizes(self):
        return self.size, 1 << 24  # (positions, offset of the first): positions past 2^24

    def get_length(self):
        return self.length

    def get_steps(self):
        return self.steps


@fuser.opaque
def write(x: torch.Tensor, cache: Cache) -> None:
    cache.keys[0] += x.sum(0)
    cache.length.add_(1)
    cache.steps += 1


@fuser.opaque
def attend(x: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Stands in for attention reading the mask: each row times the positions it sees."""
    return x * visible.sum(-1, keepdim=True).to(x.dtype)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(H, H)

    def forward(self, x, cache):
        size, offset = cache.get_mask_sizes()
        steps = cache.get_steps()
        torch.arange(x.shape[0])[:, None]  # made, never read
        positions = torch.arange(size, device=x.device)[None, :] + offset
        length = cache.get_length().to(x.device)
        visible = (positions <= length) & (positions > length - WINDOW)  # [1, size]: no token rows
        write(x, cache)
        return self.proj(x) * steps + attend(x, visible)


def eager(model, x, cache):
    return Model.forward(model, x, cache)


def test_a_getter_is_read_as_a_value_and_one_the_forward_moves_on_stays_a_call():
    model, cache = Model(), Cache(size=8, length=(1 << 24) + 3)
    traced = trace(model, (torch.randn(5, H), cache))
    labels = {r.label(): r.value for r in traced.state_reads}
    assert labels == {"cache.get_mask_sizes()": (8, 1 << 24)}, labels
    targets = [n.target for n in traced.graph.nodes]
    assert "get_steps" in targets and "get_length" in targets, traced.graph
    assert torch.arange not in targets, traced.graph  # the sizes made the positions constants; the unused range is gone
    assert cache.steps == 0 and int(cache.length) == (1 << 24) + 3  # traced on copies


def test_the_fused_forward_runs_at_every_step_and_a_cache_of_another_size_runs_eager():
    model, cache = Model(), Cache(size=8, length=(1 << 24) + 3)
    report = fuser.apply(model, (torch.randn(5, H), cache))
    try:
        (mask,) = [c for c in report.chains if "le" in c.nodes]
        assert mask.outputs == ["and_"], report.text()
        assert "n_rows = 1\n" in open(mask.path).read()  # one program: no value follows the tokens
        assert "cache.get_mask_sizes()=(8, 16777216)" in report.text()
        mirror = copy.deepcopy(cache)
        for step in range(3):
            x = torch.randn(4, H)
            assert model.__dict__[STATE_ATTR].guard.why_not((x, cache), {}) is None
            length = int(cache.length)
            # positions 2^24 .. 2^24 + 7 seen from a length of 2^24 + 3 + step (in fp32 the odd
            # ones round to their even neighbours, and the count is off)
            seen = sum(1 for p in range(1 << 24, (1 << 24) + 8) if length - WINDOW < p <= length)
            with torch.no_grad():
                got, expected = model(x, cache), eager(model, x, mirror)
                torch.testing.assert_close(got, model.proj(x) * step + x * seen)
            torch.testing.assert_close(got, expected)
        assert cache.steps == 3 and int(cache.length) == (1 << 24) + 6
        other = Cache(size=12, length=5)
        x = torch.randn(2, H)
        why = model.__dict__[STATE_ATTR].guard.why_not((x, other), {})
        assert why == "cache.get_mask_sizes() is (12, 16777216), traced with (8, 16777216)"
        with torch.no_grad():
            torch.testing.assert_close(model(x, other), eager(model, x, copy.deepcopy(Cache(size=12, length=5))))
    finally:
        fuser.restore(model)


def test_a_causal_lm_s_own_forward_is_fused_around_its_layers():
    """transformers' Qwen3: its Qwen3Model.forward makes the causal mask from the static cache
    (``get_mask_sizes``, the cache's length); fused, with the layers and the norm as leaves, it
    keeps running fused step after step, and restore gives the model back."""
    from tests.model.test_decode import PROMPT, prefilled, step
    from tests.model.test_model import causal_lm

    model = causal_lm("qwen3", layers=2)
    expected_model = copy.deepcopy(model)
    cache, tokens = prefilled(model)
    report = fuser.apply(model, (), example_kwargs=step(tokens, PROMPT, copy.deepcopy(cache)))
    try:
        own = report.others["model.forward"]
        (mask,) = [c for c in own.chains if "le" in c.nodes]
        assert own.launches_after < own.launches_before, report.text()
        assert "model.forward:" in report.text()
        guard = model.model.__dict__[STATE_ATTR].guard
        refusals, check = [], guard.check

        def recorded(args, kwargs):
            inputs, why = check(args, kwargs)
            refusals.append(why)
            return inputs, why

        guard.check = recorded
        expected_cache = copy.deepcopy(cache)
        for i in range(3):
            kwargs = step(tokens, PROMPT + i, cache)
            with torch.no_grad():
                got = model(**kwargs).logits
                expected = expected_model(**step(tokens, PROMPT + i, expected_cache)).logits
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
            tokens = expected[:, -1:].argmax(-1)
        assert refusals == [None, None, None]  # the model's own fused forward ran at every step
    finally:
        fuser.restore(model)
    assert not any(is_fused(m) for m in model.modules())


class SizedAfterWrite(nn.Module):
    """Asks the cache's sizes after writing it: the write may have changed them."""

    def forward(self, x, cache):
        length = cache.length  # an attribute read changes nothing
        write(x, cache)
        size, _ = cache.get_mask_sizes()
        return x * size + length


def test_a_getter_after_a_call_that_may_change_the_state_stays_a_call():
    traced = trace(SizedAfterWrite(), (torch.randn(5, H), Cache(size=8, length=3)))
    assert not [r for r in traced.state_reads if r.call is not None], traced.state_reads
    assert "get_mask_sizes" in [n.target for n in traced.graph.nodes], traced.graph
    traced = trace(Model(), (torch.randn(5, H), Cache(size=8, length=3)))  # read before: a value
    assert [r.label() for r in traced.state_reads if r.call is not None] == ["cache.get_mask_sizes()"]


def test_the_lm_head_s_glue_in_the_causal_lm_s_own_forward_is_fused():
    """transformers' Gemma2ForCausalLM soft-caps its logits in its own forward (``logits /
    cap``, ``tanh``, ``* cap``): that forward is planned too, with its model and LM head as
    leaves, and the logits stay eager's."""
    import transformers
    from transformers import StaticCache

    from tests.model.test_decode import step

    config = transformers.Gemma2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64, final_logit_softcapping=30.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(config).eval()
    expected_model = copy.deepcopy(model)
    ids = torch.randint(0, 128, (3, 5), generator=torch.Generator().manual_seed(1))
    cache = StaticCache(config=config, max_cache_len=12)
    with torch.no_grad():
        tokens = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    report = fuser.apply(model, (), example_kwargs=step(tokens, 5, copy.deepcopy(cache)))
    try:
        top = report.others["Gemma2ForCausalLM.forward"]
        assert [c for c in top.chains if {"tanh", "mul"} <= {n.rstrip("_0123456789") for n in c.nodes}], report.text()
        assert is_fused(model)
        expected_cache = copy.deepcopy(cache)
        for i in range(2):
            with torch.no_grad():
                got = model(**step(tokens, 5 + i, cache)).logits
                expected = expected_model(**step(tokens, 5 + i, expected_cache)).logits
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
            tokens = expected[:, -1:].argmax(-1)
    finally:
        fuser.restore(model)
    assert not any(is_fused(m) for m in model.modules())
