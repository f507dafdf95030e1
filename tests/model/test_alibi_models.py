"""Models whose layers take an ALiBi bias, fused whole with ``fuser.apply(model)``: each layer's
inputs follow the batch as a single module's do (fuser.trace.token_dims.infer_batch_inputs),
so Bloom's bias ``[batch·heads, 1, kv]`` grows ``heads`` rows per sequence; decode steps at
other batch sizes than the example's run the fused layers and match eager."""

import pytest
import torch
from transformers import BloomConfig, BloomForCausalLM

import fuser
from fuser.validate.tolerance import LAYER, mismatch
from tests.model.test_model import causal_lm, decode_inputs, logits


def bloom():
    torch.manual_seed(0)
    return BloomForCausalLM(BloomConfig(vocab_size=128, hidden_size=64, n_layer=3, n_head=4)).eval()


def falcon_alibi():
    return causal_lm("falcon", alibi=True)  # its bias [batch, heads, 1, kv]


def _layer_calls(model) -> dict[str, int]:
    return {name: counts["fused"] for name, counts in fuser.stats(model).items() if ".h." in name}


@pytest.mark.parametrize("build", [bloom, falcon_alibi], ids=lambda f: f.__name__)
def test_an_alibi_model_fused_whole_runs_its_fused_layers_at_other_batch_sizes(build):
    model = build()
    expected = {b: logits(model, decode_inputs(b)) for b in (3, 8)}
    report = fuser.apply(model, (), example_kwargs=decode_inputs(5))
    try:
        assert isinstance(report, fuser.ModelReport)
        (group,) = report.groups
        assert len(group.layers) == 3 and group.report is not None, report.text()
        for batch in (3, 8):
            before = _layer_calls(model)
            got = logits(model, decode_inputs(batch))
            after = _layer_calls(model)
            assert len(after) == 3 and all(after[n] == before.get(n, 0) + 1 for n in after), (before, after)
            problem = mismatch(got, expected[batch], "logits", LAYER)
            assert problem is None, problem
    finally:
        fuser.restore(model)
