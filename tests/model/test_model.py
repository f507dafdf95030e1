"""fuser.apply on whole transformers CausalLMs (tiny random configs, as transformers ships the
models): the stack of decoder layers fused once per layer structure, every layer running the
shared kernels on its own weights; logits against eager; restore gives the eager model back;
a structure that cannot be fused stays eager while the rest is fused; a failure leaves the
model as it was."""

import json

import pytest
import torch

import fuser
import fuser.model.fuse_model
import fuser.model.recording
from examples.zoo import layers as zoo
from fuser.install.splice import STATE_ATTR
from fuser.validate.tolerance import LAYER, mismatch
from tests.tools.test_cli import fuser_cli


def causal_lm(model: str, layers: int = 3, **overrides):
    """The model's CausalLM at the zoo's tiny dims with ``layers`` decoder layers."""
    return zoo.causal_lm(model, layers, vocab_size=128, **overrides)


def decode_inputs(batch: int = 5):
    """One new token per sequence (a decode step's shape), no cache."""
    ids = torch.randint(0, 128, (batch, 1), generator=torch.Generator().manual_seed(1))
    return dict(input_ids=ids, use_cache=False)


def logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def fused_layers(model):
    return [m for m in model.modules() if fuser.is_fused(m)]


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "deepseek_v4"])
def test_a_causal_lm_is_fused_layer_by_layer_with_shared_kernels(name):
    """The layers have different random weights: had any run another's, the logits would differ."""
    model = causal_lm(name)
    inputs = decode_inputs()
    expected = logits(model, inputs)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    report = fuser.apply(model, (), example_kwargs=inputs)
    assert isinstance(report, fuser.ModelReport)
    (group,) = report.groups  # one structure, traced and fused once
    assert len(group.layers) == 3 and group.report is not None, report.text()
    stack = model.model.layers
    forwards = {layer.__dict__[STATE_ATTR].fused for layer in stack}
    assert len(forwards) == 1  # one fused forward (and one set of kernels) for every layer
    assert report.kernels == len(group.report.chains) + sum(len(r.chains) for r in report.others.values())
    assert report.launches_after < report.launches_before / 3, report.text()
    problem = mismatch(logits(model, inputs), expected, "logits", LAYER)
    assert problem is None, problem

    fuser.restore(model)
    assert not fused_layers(model)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert torch.equal(logits(model, inputs), expected)


def test_layers_of_another_structure_get_their_own_plan():
    model = causal_lm("qwen3", layer_types=["full_attention", "sliding_attention", "full_attention"],
                      use_sliding_window=True, sliding_window=4)  # fmt: skip
    inputs = decode_inputs()
    expected = logits(model, inputs)
    report = fuser.apply(model, (), example_kwargs=inputs)
    try:
        assert sorted(len(g.layers) for g in report.groups) == [1, 2], report.text()
        assert all(g.report is not None for g in report.groups)
        assert mismatch(logits(model, inputs), expected, "logits", LAYER) is None
    finally:
        fuser.restore(model)


def test_a_structure_that_cannot_be_fused_stays_eager_and_the_rest_is_fused(monkeypatch):
    model = causal_lm("qwen3", layer_types=["full_attention", "sliding_attention", "full_attention"],
                      use_sliding_window=True, sliding_window=4)  # fmt: skip
    inputs = decode_inputs()
    expected = logits(model, inputs)
    planned = fuser.model.fuse_model.plan

    def refusing(module, *args, **kwargs):
        if getattr(getattr(module, "self_attn", None), "sliding_window", None):
            raise fuser.TraceRefused("this structure cannot be traced")
        return planned(module, *args, **kwargs)

    monkeypatch.setattr(fuser.model.fuse_model, "plan", refusing)
    report = fuser.apply(model, (), example_kwargs=inputs)
    try:
        (eager,) = [g for g in report.groups if g.report is None]
        assert eager.layers == ["model.layers.1"] and "cannot be traced" in eager.eager, report.text()
        assert "left eager" in report.text()
        assert not fuser.is_fused(model.model.layers[1]) and fuser.is_fused(model.model.layers[0])
        assert mismatch(logits(model, inputs), expected, "logits", LAYER) is None
    finally:
        fuser.restore(model)


def test_a_layer_that_disagrees_with_its_eager_forward_stays_eager_and_its_structure_is_fused(monkeypatch):
    """The check of each layer against its own eager forward, the first layer's too, leaves
    only that layer eager (a router may pick another expert on one layer's data)."""
    model = causal_lm("qwen3_moe", layers=3)
    inputs = decode_inputs()
    expected = logits(model, inputs)
    checked = fuser.model.fuse_model._disagrees
    first = model.model.layers[0]

    def disagreeing(layer, call, p):
        problem, tied = checked(layer, call, p)
        return ("the layer's output: made up for the test", []) if layer is first else (problem, tied)

    monkeypatch.setattr(fuser.model.fuse_model, "_disagrees", disagreeing)
    report = fuser.apply(model, (), example_kwargs=inputs)
    try:
        shared, eager = report.groups
        assert shared.layers == ["model.layers.1", "model.layers.2"] and shared.report is not None, report.text()
        assert eager.layers == ["model.layers.0"] and "made up for the test" in eager.eager, report.text()
        assert [fuser.is_fused(layer) for layer in model.model.layers] == [False, True, True]
        assert mismatch(logits(model, inputs), expected, "logits", LAYER) is None
    finally:
        fuser.restore(model)
    assert not fused_layers(model)


def test_a_failure_while_installing_leaves_the_model_as_it_was(monkeypatch):
    model = causal_lm("qwen3")
    inputs = decode_inputs()
    installed = fuser.model.fuse_model.install
    calls = []

    def failing(module, *args, **kwargs):
        calls.append(module)
        if len(calls) == 3:
            raise RuntimeError("out of memory")
        return installed(module, *args, **kwargs)

    monkeypatch.setattr(fuser.model.fuse_model, "install", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        fuser.apply(model, (), example_kwargs=inputs)
    assert not fused_layers(model)


def test_a_fused_model_is_not_fused_again():
    model = causal_lm("qwen3", layers=2)
    inputs = decode_inputs()
    fuser.apply(model, (), example_kwargs=inputs)
    try:
        with pytest.raises(fuser.FuserError, match="already fused"):
            fuser.apply(model, (), example_kwargs=inputs)
    finally:
        fuser.restore(model)
    assert not fused_layers(model)


def test_a_call_with_a_kv_cache_runs_the_eager_layers():
    """The layers were traced without a cache: a call that passes one is not the traced call,
    so the guard runs each layer's own forward (and the cache is filled as eager fills it)."""
    model = causal_lm("qwen3", layers=2)
    inputs = decode_inputs()
    with torch.no_grad():
        expected = model(input_ids=inputs["input_ids"], use_cache=True)
    fuser.apply(model, (), example_kwargs=inputs)
    try:
        with torch.no_grad():
            got = model(input_ids=inputs["input_ids"], use_cache=True)
        assert mismatch(got.logits, expected.logits, "logits", LAYER) is None
        for layer in (0, 1):  # written by the layers' own attention, as in eager
            assert torch.equal(got.past_key_values.layers[layer].keys, expected.past_key_values.layers[layer].keys)
    finally:
        fuser.restore(model)


def test_check_and_explain_take_a_whole_model():
    model = causal_lm("qwen3_moe", layers=2)
    inputs = decode_inputs()
    result = fuser.check(model, (), example_kwargs=inputs)
    assert result.ok, result.text()
    assert isinstance(result.report, fuser.ModelReport) and result.report.groups[0].report is not None
    assert not fused_layers(model)  # check restores
    report = fuser.explain(model, (), example_kwargs=inputs)
    assert len(report.groups[0].layers) == 2 and not fused_layers(model)


MODEL_FACTORY = """
from tests.model.test_model import causal_lm, decode_inputs


def tiny_qwen3(T: int = 3, device="cpu", dtype=None):
    return causal_lm("qwen3", layers=2), (), decode_inputs(T)
"""


def test_the_cli_checks_and_explains_a_model_factory(tmp_path):
    path = tmp_path / "tiny_model.py"
    path.write_text(MODEL_FACTORY)
    checked = fuser_cli("check", f"{path}:tiny_qwen3")
    assert checked.returncode == 0 and "check passed" in checked.stdout, checked.stdout + checked.stderr
    explained = fuser_cli("explain", "--json", f"{path}:tiny_qwen3")
    assert explained.returncode == 0, explained.stderr
    data = json.loads(explained.stdout)
    assert data["model"] == "Qwen3ForCausalLM" and len(data["groups"][0]["layers"]) == 2


def test_near_ties_of_a_router_are_the_tokens_whose_kth_and_next_scores_meet():
    """A layer's check leaves out only tokens whose top-k choice is a near tie in eager's own
    scores (a last-bit difference may pick another expert there): with the random router, the
    tokens whose 2nd and 3rd router probabilities (read off the router's own forward) are that
    close; every token once all experts' router rows are made equal."""
    model = causal_lm("qwen3_moe", layers=2)
    inputs = decode_inputs(batch=16)
    layer = model.model.layers[0]
    args, kwargs, expected = fuser.model.recording.record_calls(model, (), inputs, [layer])[id(layer)]
    p = fuser.plan(layer, args, example_kwargs=kwargs, batch_inputs=fuser.model.fuse_model._batch_inputs(layer, args, kwargs))
    flat, _ = p.guard.check(args, kwargs)
    rows = expected.shape[0]
    seen = []
    hook = layer.mlp.gate.register_forward_hook(lambda m, a, out: seen.append(out[0]))
    with torch.no_grad():
        layer(*args, **kwargs)
    hook.remove()
    probs = torch.softmax(seen[0].float(), dim=-1).sort(dim=-1, descending=True).values
    k = layer.mlp.gate.top_k
    close = (probs[:, k - 1] - probs[:, k]).abs() <= fuser.validate.tolerance.NEAR_TIE * probs[:, k - 1]
    assert fuser.model.fuse_model._near_ties(layer, p, flat, rows) == set(close.nonzero().flatten().tolist())
    with torch.no_grad():
        router = layer.mlp.gate.weight
        router[:] = router[0]
    assert fuser.model.fuse_model._near_ties(layer, p, flat, rows) == set(range(rows))


class Switch(torch.nn.Module):
    """A choice inside a leaf (an attention's top-k of positions): a token whose hidden states
    average exactly 1 is scaled tenfold. Rounded otherwise, its input leaves that point."""

    def forward(self, h):
        return torch.where(h.float().mean(-1, keepdim=True) == 1.0, h * 10, h)


fuser.opaque(Switch)


class Switched(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(32, dtype=torch.bfloat16))
        self.switch = Switch()

    def forward(self, x):
        h = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * self.weight
        return self.switch(h) + x


class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Switched(), Switched()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def switched_inputs() -> torch.Tensor:
    """Six tokens; token 2's hidden states are all 1 (its norm keeps them 1: the switch's
    point), the others random."""
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    x[2] = 1.0
    return x


def test_tokens_where_eager_is_not_settled_by_its_input_are_those_a_rounding_moves():
    model = Stack()
    x = switched_inputs()
    layer = model.layers[0]
    call = fuser.model.recording.record_calls(model, (x,), {}, [layer])[id(layer)]
    assert fuser.model.fuse_model._unsettled(layer, call, call[2]) == {2}
    x[2] = x[3]  # off the switch's point: settled
    call = fuser.model.recording.record_calls(model, (x,), {}, [layer])[id(layer)]
    assert fuser.model.fuse_model._unsettled(layer, call, call[2]) == set()


@pytest.mark.parametrize("token, settled", [(2, False), (4, True)])
def test_a_disagreement_where_eager_is_not_settled_by_its_input_is_left_out_of_the_check(monkeypatch, token, settled):
    """The fused layer made to give, at one token, what eager gives with its input rounded
    otherwise (the switch not taken): at the unsettled token 2 the layer is checked without it
    and fused, reported; at a settled token it stays eager."""
    install = fuser.model.fuse_model._install

    def switching_otherwise(layer, *args, **kwargs):
        install(layer, *args, **kwargs)
        fused = layer.__dict__["forward"]

        def forward(x):
            out = fused(x).clone()
            out[token] = out[token] / 10 if token == 2 else out[token] * 10
            return out

        layer.__dict__["forward"] = forward

    monkeypatch.setattr(fuser.model.fuse_model, "_install", switching_otherwise)
    model = Stack()
    report = fuser.apply(model, (switched_inputs(),))
    try:
        (group,) = [g for g in report.groups if "layers.0" in g.layers]
        if settled:
            assert group.report is None and "disagreed with eager" in group.eager, report.text()
        else:
            # (token 2 leaves layer 0 as 11s, which layer 1's norm makes 1s again: its switch's point too)
            assert group.report is not None and group.near_ties == {"layers.0": [2], "layers.1": [2]}, report.text()
            assert "checked against eager without tokens [2] of layers.0" in report.text()
    finally:
        fuser.restore(model)
