"""Stacks of decoder layers are found by what they do: a module list whose modules each take
hidden states and pass their output to the next. Per-head norms (StableLM's qk_layernorm, a
``ModuleList`` of ``LayerNorm`` inside each attention) and a list of experts are not stacks."""

import torch
import torch.nn as nn
from transformers import StableLmConfig, StableLmForCausalLM

import fuser
from fuser.model.layer_stacks import decoder_stacks, layer_stacks
from fuser.model.recording import record_calls
from fuser.validate.tolerance import LAYER, mismatch


def stablelm():
    cfg = StableLmConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, qk_layernorm=True)  # fmt: skip
    torch.manual_seed(0)
    return StableLmForCausalLM(cfg).eval()


def test_per_head_norm_lists_are_not_taken_for_layers_and_the_layer_is_fused_whole():
    model = stablelm()
    inputs = dict(input_ids=torch.randint(0, 128, (2, 1), generator=torch.Generator().manual_seed(1)), use_cache=False)
    candidates = [name for name, _ in layer_stacks(model)]
    assert "model.layers.0.self_attn.q_layernorm.norms" in candidates, candidates
    stacks = layer_stacks(model)
    calls = record_calls(model, (), inputs, [m for _, stack in stacks for m in stack])
    assert [name for name, _ in decoder_stacks(stacks, calls)] == ["model.layers"]
    with torch.no_grad():
        expected = model(**inputs).logits
    report = fuser.apply(model, (), example_kwargs=inputs)
    assert [g.layers for g in report.groups] == [["model.layers.0", "model.layers.1"]], report.text()
    assert report.groups[0].report is not None and report.groups[0].report.chains, report.text()
    with torch.no_grad():
        got = model(**inputs).logits
    assert mismatch(got, expected, "logits", LAYER) is None


class Experts(nn.Module):
    """Two experts, each given its own half of the tokens: a list of one class, not chained."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        half = x.shape[0] // 2
        return torch.cat([self.experts[0](x[:half]).relu(), self.experts[1](x[half:]).relu()]) * 2


def test_a_list_whose_modules_do_not_pass_their_output_on_is_no_stack():
    model = Experts()
    x = torch.randn(4, 8)
    assert [name for name, _ in layer_stacks(model)] == ["experts"]
    stacks = layer_stacks(model)
    assert decoder_stacks(stacks, record_calls(model, (x,), {}, list(model.experts))) == []
    report = fuser.apply(model, (x,))
    assert not hasattr(report, "groups"), "fused whole, as one module"
