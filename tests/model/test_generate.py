"""``fuser.apply(model)`` with no example call, then ``model.generate()``: transformers CausalLMs
at tiny dims in fp32 (so that greedy tokens compare exactly), with generate's dynamic cache and
a static one, batch 1 and batch 2 with left padding. The model fuses itself at its first decode
step (fuser.model.lazy_model); a second generate then takes the fused path at every decode step
of every layer, and gives eager's tokens."""

import copy
import gc
import pickle
import warnings

import pytest
import torch

import fuser
from fuser.model import cuda_graphs
from fuser.model.lazy_model import LAZY_ATTR
from tests.model.test_model import causal_lm

PROMPT, NEW = 5, 4


def prompt(batch: int, length: int = PROMPT):
    """Token ids and their attention mask; with batch > 1 the first sequence is left-padded."""
    ids = torch.randint(1, 128, (batch, length), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[0, :2] = 0
    return ids, mask


def generate(model, ids, mask, cache: str, new: int = NEW):
    """Greedy, with transformers' own compile of a static-cache step off (on a GPU it would
    compile the eager reference too)."""
    kwargs = dict(cache_implementation="static", disable_compile=True) if cache == "static" else {}
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              pad_token_id=0, **kwargs)  # fmt: skip


def layer_calls(model) -> dict[str, dict]:
    """fuser.stats of the decoder layers (``model.layers.i``, GPT-J's and Falcon's ``transformer.h.i``)."""
    return {name: counts for name, counts in fuser.stats(model).items() if ".layers." in name or ".h." in name}


def fuser_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("fuser")]


CASES = [
    ("qwen3", "dynamic", 1),
    ("qwen3", "static", 2),
    ("llama", "dynamic", 2),  # the 4-D padding mask grows a key a step: a size no kernel holds
    ("llama", "static", 2),
    ("gemma2", "dynamic", 1),  # sliding-window layers, logit soft-capping
    ("gemma2", "dynamic", 2),
    ("gemma2", "static", 2),
    ("qwen3_moe", "dynamic", 1),
    ("qwen3_moe", "static", 2),
    ("deepseek_v4", "static", 2),
    ("deepseek_v3", "dynamic", 1),  # MLA views the keys by the cache's length, which grows each step
    ("gpt_neox", "static", 2),  # each layer's two LayerNorms computed by the layer before (glue across layers)
    ("glm4", "dynamic", 2),  # its interleaved RoPE of a slice of the sin/cos row, computed in the RoPE kernel
    ("llama4", "dynamic", 1),  # layers holding their index twice, one plan
]


#: A prompt of LONG_PROMPT keeps the key lengths of its decode steps clear of the tiny dims'
#: literals (a MoE router's histc max of 7, say), next to which a padding mask's length would be
#: held until a later decode call fuses again (fuser.model.lazy_model).
LONG_PROMPT = 21
LONG_CASES = [
    # bf16, a padding mask and a dynamic cache: the additive mask is a kernel (in fp32 its one op
    # stays PyTorch's), and its key length grows each step (fuser.install.any_size)
    ("llama", "dynamic", 2, torch.bfloat16),
    ("qwen3_moe", "dynamic", 2, torch.bfloat16),
    ("gemma2", "dynamic", 2, torch.bfloat16),
    # the model's forward makes the causal mask at the dynamic cache's length from the padding
    # mask, which grows a key a step: that glue stays eager, the rest of it fused (no decline)
    ("gptj", "dynamic", 2, torch.float32),
    ("falcon", "dynamic", 2, torch.float32),
    ("deepseek_v4", "dynamic", 2, torch.float32),
]
ALL_CASES = [(*case, torch.float32, PROMPT) for case in CASES] + [(*case, LONG_PROMPT) for case in LONG_CASES]


@pytest.mark.parametrize("name,cache,batch,dtype,length", ALL_CASES,
                         ids=[f"{n}-{c}-batch{b}{'-bf16' if d == torch.bfloat16 else ''}{'-long' if p == LONG_PROMPT else ''}"
                              for n, c, b, d, p in ALL_CASES])  # fmt: skip
def test_generate_takes_the_fused_path_at_every_decode_step(name, cache, batch, dtype, length):
    model = causal_lm(name, layers=2).to(dtype)
    ids, mask = prompt(batch, length)
    eager = generate(model, ids, mask, cache)

    report = fuser.apply(model)
    assert report.pending and not fuser.stats(model), "nothing is fused before the first decode call"
    first = generate(model, ids, mask, cache)  # fuses at its first decode step
    assert report.pending is None, report.text()
    assert all(group.report is not None for group in report.groups), report.text()
    if name == "gpt_neox":
        assert report.groups[0].handed_to == 1, report.text()
    assert torch.equal(first, eager)

    before, everything_before = layer_calls(model), fuser.stats(model)
    assert len(before) == 2, before
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = generate(model, ids, mask, cache)
    assert torch.equal(again, eager)
    after = layer_calls(model)
    for layer, counts in after.items():
        # every decode step fused; the prefill (``length`` tokens per sequence) declined, counted
        assert counts["fused"] - before[layer]["fused"] == NEW - 1, (layer, before[layer], counts)
        declined = {r: n - before[layer]["declined"].get(r, 0) for r, n in counts["declined"].items()}
        assert sum(declined.values()) == 1 and f" is {length}, traced with 1" in next(r for r, n in declined.items() if n), declined
    for module, counts in fuser.stats(model).items():  # the rest of the model's fused modules: no decode step declined
        declined = {r: n - everything_before[module]["declined"].get(r, 0) for r, n in counts["declined"].items()}
        assert all(f" is {length}, traced with 1" in r for r, n in declined.items() if n), (module, declined)
    assert fuser_warnings(caught) == [], "a prefill is declined by design, without a warning"


TWO_LAYER_TYPES = [  # (the model, its config's changes, the rotary's two layer types; Gemma3 asks them in a set's order)
    ("deepseek_v4", {}, ("main", "compress")),
    ("gemma3", dict(layer_types=["sliding_attention", "full_attention"]), ("sliding_attention", "full_attention")),
]  # fmt: skip


@pytest.mark.parametrize("name,overrides,types", TWO_LAYER_TYPES, ids=[c[0] for c in TWO_LAYER_TYPES])
def test_a_module_called_twice_a_forward_unlike_itself_is_traced_into_its_parent(name, overrides, types):
    """DeepSeek-V4's and Gemma3's models ask their rotary embedding for two layer types each
    forward; a plan of the rotary's own would decline one of the two calls every step (and
    warn): it is traced into the model's forward instead, whose plan fuses both calls."""
    model = causal_lm(name, layers=2, **overrides)
    ids, mask = prompt(2)
    eager = generate(model, ids, mask, "static")
    report = fuser.apply(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(generate(model, ids, mask, "static"), eager)
        assert torch.equal(generate(model, ids, mask, "static"), eager)
    assert fuser_warnings(caught) == []
    stats = fuser.stats(model)
    assert "model.rotary_emb" not in stats, stats
    skipped = report.skipped["model.rotary_emb"]
    assert "layer_type is '" in skipped and all(f"'{t}'" in skipped for t in types), skipped
    assert "traced into its parent's forward" in skipped
    parent = report.others["model.forward"]
    assert parent.launches_after < parent.launches_before and "rotary_emb" in parent.text(), parent.text()
    assert stats["model"]["fused"] and stats["model"]["declined"] == {f"input_ids dim 1 is {PROMPT}, traced with 1": 1}, stats["model"]  # the second prefill


@pytest.mark.parametrize("batch", [1, 2])
def test_a_dynamic_cache_whose_scores_are_glue_takes_the_fused_path_at_every_decode_step(batch):
    """DeepSeek-V4 attends with transformers' eager attention: the mask add, the sink's logit
    and the softmax over the keys are glue at the cache's length, which grows by one each step
    of a dynamic cache. They stay eager (with the max read through ``max(...).values``), the
    rest of the layer is fused, and every decode step takes the fused path with eager's tokens.
    The prompt is 9 tokens: at the suite's 5 the first decode step's mask (6 keys) lies next to
    a literal of the tiny config's router (``histc``'s max of 7 over 8 experts), and the model is
    fused again from a later step (the next test)."""
    model = causal_lm("deepseek_v4", layers=2)
    ids = torch.randint(1, 128, (batch, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[0, :2] = 0  # left padding
    eager = generate(model, ids, mask, "dynamic")
    fuser.apply(model)
    first = generate(model, ids, mask, "dynamic")  # fused on its first decode step
    before = layer_calls(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = generate(model, ids, mask, "dynamic")
    assert torch.equal(first, eager) and torch.equal(again, eager)
    for layer, counts in layer_calls(model).items():
        # every decode step fused; the prefill (9 tokens) declined, counted
        assert counts["fused"] - before[layer]["fused"] == NEW - 1, (layer, before[layer], counts)
        declined = {r: n - before[layer]["declined"].get(r, 0) for r, n in counts["declined"].items()}
        assert {r: n for r, n in declined.items() if n} == {"hidden_states dim 1 is 9, traced with 1": 1}, declined
    assert not [w for w in fuser_warnings(caught) if "DecoderLayer" in w], fuser_warnings(caught)


NEAR_LITERALS = [
    ("deepseek_v4", 1, PROMPT),  # a mask of 6 keys at the first decode step; the router's histc has a max of 7 (8 experts)
    ("llama", 2, 15),  # left padding: a 4-D mask of 16 keys; the head dim is 16
]


@pytest.mark.parametrize("name,batch,length", NEAR_LITERALS, ids=[n for n, _, _ in NEAR_LITERALS])
def test_a_mask_length_next_to_a_literal_is_fused_again_from_a_later_decode_step(name, batch, length):
    """Where the mask's length at the first decode call, or one more or less, is a literal of the
    graph, the literal could have been read off the length: the guard holds it, and the next
    steps decline (counted, warned once, said to be held by a literal). Once a step's next
    length is clear of the literal, the model is fused again from that step, the mask's length
    is free, and every decode step of the next generate takes the fused path, with eager's tokens."""
    model = causal_lm(name, layers=2)
    ids = torch.randint(1, 128, (batch, length), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[0, :2] = 0
    new = NEW + 3  # the decode steps: fused, two declined, fused again
    eager = generate(model, ids, mask, "dynamic", new)
    report = fuser.apply(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = generate(model, ids, mask, "dynamic", new)
    assert torch.equal(first, eager)
    held = [w for w in fuser_warnings(caught) if "DecoderLayer runs its own forward" in w]
    assert held and "(held: a literal of the graph lies next to" in held[0], fuser_warnings(caught)
    assert report.fused_again and "attention_mask dims [3]" in report.fused_again[0], report.fused_again
    assert "fused again from a later decode call" in report.text()
    assert not any(g.report.sizes_near_literals for g in report.groups), [g.report.sizes_near_literals for g in report.groups]

    before = layer_calls(model)
    again = generate(model, ids, mask, "dynamic", new)
    assert torch.equal(again, eager)
    for layer, counts in layer_calls(model).items():
        assert counts["fused"] - before[layer]["fused"] == new - 1, (layer, before[layer], counts)
        declined = {r: n - before[layer]["declined"].get(r, 0) for r, n in counts["declined"].items()}
        assert {r: n for r, n in declined.items() if n} == {f"hidden_states dim 1 is {length}, traced with 1": 1}, declined


def test_a_model_that_cannot_be_fused_runs_eager_with_one_warning(monkeypatch):
    import fuser.model.fuse_model as fuse_model

    def fails(*args, **kwargs):
        raise fuser.FuserError("nothing to fuse here")

    monkeypatch.setattr(fuse_model, "apply_model", fails)
    model = causal_lm("qwen3", layers=2)
    ids, mask = prompt(1)
    eager = generate(model, ids, mask, "dynamic")
    report = fuser.apply(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = generate(model, ids, mask, "dynamic")
        generate(model, ids, mask, "dynamic")
    assert torch.equal(got, eager)
    assert fuser_warnings(caught) == ["fuser: Qwen3ForCausalLM runs eager: FuserError: nothing to fuse here"]
    assert report.pending == "left eager: FuserError: nothing to fuse here"
    assert "nothing fused: left eager" in report.text()


def test_restore_takes_the_hooks_off_and_puts_transformers_compile_setting_back():
    model = causal_lm("qwen3", layers=2)
    hooks = (dict(model._forward_pre_hooks), dict(model._forward_hooks))
    setting = model.generation_config.disable_compile
    assert not setting
    fuser.apply(model)
    assert model.generation_config.disable_compile is True, "generate's own compile would bypass the kernels"
    with pytest.raises(fuser.FuserError, match="already fused"):
        fuser.apply(model)
    fuser.restore(model)
    assert (dict(model._forward_pre_hooks), dict(model._forward_hooks)) == hooks
    assert LAZY_ATTR not in model.__dict__ and model.generation_config.disable_compile is setting


def test_a_copy_fuses_itself_and_a_pickle_is_the_eager_model():
    model = causal_lm("qwen3", layers=2)
    ids, mask = prompt(1)
    eager = generate(model, ids, mask, "dynamic")
    fuser.apply(model)
    twin = copy.deepcopy(model)
    assert torch.equal(generate(twin, ids, mask, "dynamic"), eager)
    assert layer_calls(twin) and not layer_calls(model), "the copy fused itself, not the original"
    plain = pickle.loads(pickle.dumps(model))
    assert not plain._forward_pre_hooks and LAZY_ATTR not in plain.__dict__


def test_apply_with_no_example_needs_a_stack_of_layers():
    with pytest.raises(fuser.FuserError, match="no stack of repeated layers"):
        fuser.apply(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(fuser.FuserError, match="no stack of repeated layers"):  # a list of one norm is no stack
        fuser.apply(torch.nn.ModuleList([torch.nn.RMSNorm(4)]))


@pytest.mark.parametrize("name,cache", [("llama", "dynamic"), ("qwen3", "static")])
def test_a_model_of_one_decoder_layer_is_fused_at_its_first_decode_call(name, cache):
    """A draft model, a multi-token-prediction head: one layer in its list is a stack too."""
    model = causal_lm(name, layers=1)
    ids, mask = prompt(2)
    eager = generate(model, ids, mask, cache)
    report = fuser.apply(model)
    assert torch.equal(generate(model, ids, mask, cache), eager)
    ((group_layers,),) = [g.layers for g in report.groups]
    assert group_layers == "model.layers.0" and report.groups[0].report is not None, report.text()
    before = layer_calls(model)
    assert torch.equal(generate(model, ids, mask, cache), eager)
    (counts,) = layer_calls(model).values()
    assert counts["fused"] - before["model.layers.0"]["fused"] == NEW - 1, counts


def test_a_fused_model_runs_under_torch_compile():
    """Under Dynamo a fused module runs its own code (fuser.install.splice): the model compiles
    and gives eager's logits."""
    model = causal_lm("qwen3", layers=2)
    ids = torch.randint(1, 128, (2, 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
    fuser.apply(model, (), example_kwargs=dict(input_ids=ids, use_cache=False))
    layer = model.model.layers[0]
    hidden = torch.randn(2, 1, model.config.hidden_size)
    position = model.model.rotary_emb(hidden, torch.zeros(2, 1, dtype=torch.long))
    with torch.no_grad():
        layer_expected = type(layer).forward(layer, hidden, position_embeddings=position)
        for backend in ("eager", "aot_eager"):
            torch._dynamo.reset()
            compiled = torch.compile(model, backend=backend)
            assert torch.allclose(compiled(input_ids=ids, use_cache=False).logits, expected, atol=1e-5), backend
            got = torch.compile(layer, backend=backend)(hidden, position_embeddings=position)
            assert torch.allclose(got, layer_expected, atol=1e-5), backend
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_cuda_graphs_replay_the_decode_steps_of_generate(name):
    """``cuda_graphs=True``: after the decode step that fuses and one that runs on the capture
    stream, each decode step of a static cache is replayed from a graph per batch size and
    cache; the next generate replays from its first decode step where it reuses the cache, and
    after one step on the capture stream where it makes a new one (the old one's graph is
    dropped with it)."""
    model = causal_lm(name, layers=2).cuda()
    ids, mask = (t.cuda() for t in prompt(2))
    eager = generate(model, ids, mask, "static")
    fuser.apply(model, cuda_graphs=True)
    caches = []
    model.register_forward_pre_hook(lambda m, a, k: caches.append(id(k["past_key_values"])), with_kwargs=True)
    first = generate(model, ids, mask, "static")
    graphed = model.__dict__["_fuser_graphed"]
    assert graphed.replays == NEW - 3, (graphed.replays, graphed.not_captured)  # fuse, warm up, then capture
    again = generate(model, ids, mask, "static")
    same_cache = caches[0] == caches[-1]
    assert graphed.replays == NEW - 3 + (NEW - 1 if same_cache else NEW - 2), (graphed.replays, same_cache)
    assert torch.equal(first, eager) and torch.equal(again, eager)
    gc.collect()
    assert len(graphed.graphs) == (1 if same_cache else 0), "a graph goes with its cache"
    assert not graphed.not_captured
    fuser.restore(model)
    assert "forward" not in model.__dict__


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gemma2", "deepseek_v4"])
def test_cuda_graphs_replay_a_sliding_window_cache_while_it_fills_and_once_it_is_full(name):
    """A window of 8 slots, a prompt of 5 and 10 new tokens (batch 2, left padding): decode
    calls 1-3 fill the window (fuse, warm up, capture and replay), call 4 finds it full (warm
    up under that key), call 5 captures and replays it and calls 6-9 replay; each replay moves the window's
    Python count on, so that the masks generate builds and the updates' branches stay eager's."""
    model = causal_lm(name, layers=2, sliding_window=8).cuda()
    ids, mask = (t.cuda() for t in prompt(2))

    def run(m):
        with torch.no_grad():
            return m.generate(ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                              pad_token_id=0, cache_implementation="static", disable_compile=True)  # fmt: skip

    eager = run(model)
    fuser.apply(model, cuda_graphs=True)
    got = run(model)
    graphed = model.__dict__[cuda_graphs.GRAPHED_ATTR]
    assert torch.equal(got, eager)
    assert not graphed.not_captured and graphed.replays == 1 + 5, (graphed.replays, graphed.not_captured)


def test_generate_s_own_compile_of_a_fused_model_runs_and_gives_eager_s_tokens():
    """transformers compiles the forward of a static-cache generate itself (here forced on the
    CPU, with Dynamo's eager backend): apply turned it off, and a user who turns it back on gets
    the model's own code compiled — no crash, eager's tokens."""
    from transformers import CompileConfig

    model = causal_lm("qwen3", layers=2)
    ids, mask = prompt(2)
    expected = generate(model, ids, mask, "static")
    config = CompileConfig(backend="eager", mode=None)
    config._compile_all_devices = True
    fuser.apply(model)
    assert torch.equal(generate(model, ids, mask, "static"), expected)  # fused at its first decode step
    assert layer_calls(model), "the layers are fused"
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                 pad_token_id=0, cache_implementation="static", compile_config=config,
                                 disable_compile=False)  # fmt: skip
    finally:
        torch._dynamo.reset()
    assert torch.equal(got, expected)
    assert "_compiled_call" in vars(model), "generate compiled the forward"


def test_a_model_with_cuda_graphs_copies_and_pickles():
    """``cuda_graphs=True`` wraps the fused model's forward (here on the CPU, where nothing is
    captured and each decode step is counted as such): a deep copy gets a wrapper of its own,
    a pickle is the eager model."""
    model = causal_lm("qwen3", layers=2)
    ids, mask = prompt(1)
    expected = generate(model, ids, mask, "static")
    with pytest.warns(UserWarning, match="without CUDA"):
        fuser.apply(model, cuda_graphs=True)
    assert torch.equal(generate(model, ids, mask, "static"), expected)
    graphed = model.__dict__[cuda_graphs.GRAPHED_ATTR]
    twin = copy.deepcopy(model)
    assert twin.__dict__[cuda_graphs.GRAPHED_ATTR] is not graphed and twin.forward.model is twin
    assert torch.equal(generate(twin, ids, mask, "static"), expected)
    assert twin.forward.not_captured == {cuda_graphs.NOT_CUDA: NEW - 1}, twin.forward.not_captured
    plain = pickle.loads(pickle.dumps(model))
    assert "forward" not in plain.__dict__ and cuda_graphs.GRAPHED_ATTR not in plain.__dict__
    assert torch.equal(generate(plain, ids, mask, "static"), expected)
