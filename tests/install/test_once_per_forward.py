"""A kernel a layer computes from its inputs alone (the mask it gives attention, made from the
model's one mask) runs once per forward of the model, not once a layer; a new mask, or the same
one written in place, is computed again; outside the model's forward every call runs it."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import fuser
import fuser.install.once_per_forward
from fuser.validate.tolerance import LAYER, mismatch

B, S, E = 3, 7, 16


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(E, E)
        self.o = nn.Linear(E, E)

    def forward(self, x, memory, mask):
        bias = torch.where(mask, 0.0, -1e4).mul(0.5)  # the same for every layer
        attended = F.scaled_dot_product_attention(self.q(x), memory, memory, attn_mask=bias)
        return x + self.o(attended)


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Layer() for _ in range(3)])

    def forward(self, x, memory, mask):
        for layer in self.layers:
            x = layer(x, memory, mask)
        return x


def inputs(seed: int):
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, 1, S, generator=generator) > 0.3
    mask[:, :, 0] = True
    return torch.randn(B, 1, E, generator=generator), torch.randn(B, S, E, generator=generator), mask


def eager(model, x, memory, mask):
    with torch.no_grad():
        for layer in model.layers:
            x = Layer.forward(layer, x, memory, mask)
    return x


def test_a_kernel_of_the_layers_inputs_alone_runs_once_per_forward_of_the_model(monkeypatch):
    model = Stack()
    report = fuser.apply(model, inputs(0))
    launches = []
    run = fuser.install.once_per_forward._run
    monkeypatch.setattr(fuser.install.once_per_forward, "_run", lambda launch, args: launches.append(launch) or run(launch, args))
    try:
        (group,) = report.groups
        assert len(group.report.shared) == 1, report.text()
        assert report.launches_after == 3 * group.report.launches_after - 2  # the shared kernel once
        assert "run once per forward of the model" in report.text()
        x, memory, mask = inputs(1)
        with torch.no_grad():
            got = model(x, memory, mask)
        assert len(launches) == 1  # three layers, one launch
        assert mismatch(got, eager(model, x, memory, mask), "output", LAYER) is None
        other = inputs(2)[2]  # another mask: computed again
        with torch.no_grad():
            got = model(x, memory, other)
        assert len(launches) == 2
        assert mismatch(got, eager(model, x, memory, other), "output", LAYER) is None
        other[:, :, 1:] = ~other[:, :, 1:]  # the same mask written in place: computed again
        with torch.no_grad():
            got = model(x, memory, other)
        assert len(launches) == 3
        assert mismatch(got, eager(model, x, memory, other), "output", LAYER) is None
        with torch.no_grad():
            for layer in model.layers:  # a layer called on its own: no model forward to share in
                layer(x, memory, mask)
        assert len(launches) == 6
    finally:
        fuser.restore(model)
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_a_kernel_whose_output_a_leaf_or_the_caller_gets_is_not_shared():
    class Returned(Layer):
        def forward(self, x, memory, mask):
            bias = torch.where(mask, 0.0, -1e4).mul(0.5)
            return x + self.o(F.scaled_dot_product_attention(self.q(x), memory, memory, attn_mask=bias)), bias

    x, memory, mask = inputs(0)
    p = fuser.plan(Returned(), (x, memory, mask))
    assert p.report.chains and not p.report.shared, p.report.text()


def test_transformers_qwen3_makes_its_additive_mask_once_a_step(monkeypatch):
    """transformers' Qwen3 in bf16, a static-cache decode step: each layer's sdpa call gets the
    boolean mask made additive (fuser.trace.attention_calls), from the one mask the model passes every
    layer: one launch a step for the three layers, and the logits still eager's."""
    import copy

    from tests.model.test_decode import PROMPT, prefilled, step
    from tests.model.test_model import causal_lm

    model = causal_lm("qwen3", layers=3).to(torch.bfloat16)
    cache, tokens = prefilled(model)
    eager_model, eager_cache = copy.deepcopy(model), copy.deepcopy(cache)
    report = fuser.apply(model, (), example_kwargs=step(tokens, PROMPT, copy.deepcopy(cache)))
    launches = []
    run = fuser.install.once_per_forward._run
    monkeypatch.setattr(fuser.install.once_per_forward, "_run", lambda launch, args: launches.append(launch) or run(launch, args))
    try:
        (group,) = report.groups
        assert len(group.layers) == 3 and len(group.report.shared) == 1, report.text()
        for i in range(2):
            with torch.no_grad():
                got = model(**step(tokens, PROMPT + i, cache)).logits
                want = eager_model(**step(tokens, PROMPT + i, eager_cache)).logits
            assert len(launches) == i + 1
            assert mismatch(got, want, "logits", LAYER) is None
            tokens = want[:, -1:].argmax(-1)
    finally:
        fuser.restore(model)
