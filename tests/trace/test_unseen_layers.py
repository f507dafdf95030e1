"""transformers' decoder layers that examples/zoo does not hold, as transformers ships them, at
tiny dims on the CPU: each layer is called as its model calls it (the inputs a forward pre-hook
records on layer 0 of the real tiny CausalLM during a decode step, a DynamicCache included) and
given to ``fuser.apply``. Whatever the layer does, the answer is a fused layer that matches
eager within the layer tolerance, or a ``FuserError`` that names the reason and the line, with
the layer left as it was: never an error of fuser's own."""

from __future__ import annotations

import re

import pytest
import torch

import fuser
from fuser.model.recording import record_calls
from fuser.pipeline.fuse_module import FuserError, tensors_of
from fuser.trace.call_spec import with_state_copied
from fuser.validate.tolerance import LAYER, mismatch

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=16, intermediate_size=96,
            num_hidden_layers=1, vocab_size=128, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
NO_HEAD_DIM = ("head_dim",)  # configs where it is a property
#: architecture -> (model_type, config overrides, config keys left out)
ARCHITECTURES = {
    "gpt_neox": ("gpt_neox", {}, ()),
    "phi": ("phi", {}, ()),
    "stablelm": ("stablelm", {}, ()),
    "falcon_alibi": ("falcon", dict(alibi=True), NO_HEAD_DIM),
    "falcon_rotary": ("falcon", dict(alibi=False), NO_HEAD_DIM),
    "falcon_new_decoder": ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2), NO_HEAD_DIM),
    "bloom": ("bloom", {}, ()),
    "mpt": ("mpt", {}, ()),
    "gptj": ("gptj", dict(rotary_dim=8), ()),
    "starcoder2": ("starcoder2", {}, ()),
    "persimmon": ("persimmon", {}, ()),
    "codegen": ("codegen", dict(rotary_dim=8), ()),
    "gpt2": ("gpt2", {}, ()),
    "opt": ("opt", dict(ffn_dim=96, word_embed_proj_dim=64), ()),
    "biogpt": ("biogpt", {}, ()),
    "dbrx": ("dbrx", dict(d_model=64, n_heads=4, attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                          ffn_config=dict(hidden_size=64, ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2)), ()),
    "jetmoe": ("jetmoe", {}, ()),
    "nemotron": ("nemotron", {}, ()),
    "olmo": ("olmo", {}, ()),
    "exaone4": ("exaone4", {}, ()),
    "gpt_bigcode": ("gpt_bigcode", {}, ()),
    "gpt_neo": ("gpt_neo", dict(attention_types=[[["global"], 1]]), ()),
    "xglm": ("xglm", {}, ()),
    "bitnet": ("bitnet", {}, ()),
    "cohere2": ("cohere2", {}, ()),
    "smollm3": ("smollm3", {}, ()),
}  # fmt: skip

BATCH, PROMPT = 3, 4  # a decode step of three sequences: the token count is the batch


def decode_call(architecture: str):
    """(layer 0, args, kwargs): the tiny CausalLM's first layer and the call its model makes
    of it at the first decode step after a prompt."""
    model_type, overrides, left_out = ARCHITECTURES[architecture]
    config_class = type(transformers.AutoConfig.for_model(model_type))
    config = config_class(**{k: v for k, v in {**TINY, **overrides}.items() if k not in left_out})
    torch.manual_seed(0)
    try:
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    except ValueError:  # no sdpa: the model's eager attention
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model = model.float().eval()
    layer = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))[0]
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        cache = model(torch.randint(3, 128, (BATCH, PROMPT), generator=g), use_cache=True).past_key_values
    step = torch.randint(3, 128, (BATCH, 1), generator=g)
    args, kwargs, _ = record_calls(model, (step,), dict(past_key_values=cache, use_cache=True), [layer])[id(layer)]
    return layer, args, kwargs


def run(layer, args, kwargs):
    args, kwargs = with_state_copied(args, kwargs)
    with torch.no_grad():
        return tensors_of((layer(*args, **kwargs),))


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_an_unseen_layer_fuses_or_is_refused_with_its_reason(architecture):
    layer, args, kwargs = decode_call(architecture)
    expected = run(layer, args, kwargs)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    try:
        report = fuser.apply(layer, args, example_kwargs=kwargs)
    except FuserError as e:
        assert re.search(r"\.py:\d+", str(e)), f"the refusal names no line: {e}"
        assert not fuser.is_fused(layer) and "forward" not in layer.__dict__
        assert all(torch.equal(state[k], v) for k, v in layer.state_dict().items())
        assert mismatch(run(layer, args, kwargs), expected, "output after the refusal", LAYER) is None
        return
    try:
        assert report.launches_after < report.launches_before, report.text()
        got = run(layer, args, kwargs)
        assert fuser.stats(layer)[""]["fused"] == 1, fuser.stats(layer)
        assert mismatch(got, expected, "output", LAYER) is None, mismatch(got, expected, "output", LAYER)
        # The attention keeps its tables of one position (transformers' [1, 1, d]) as inputs:
        # it is no leaf because of them.
        assert not [a for a in report.automatic_leaves if "must match the size" in a["reason"]], report.automatic_leaves
    finally:
        fuser.restore(layer)
