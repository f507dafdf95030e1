"""fuser.pipeline.next_layer_entry: a layer's last kernel also computes the next layer's entry
kernel (its input norm) from the next layer's weights, and hands the results over within a
forward of the model; the next layer's launch of that kernel takes them. The first layer, a
layer called on its own, and hidden states written between layers launch it themselves."""

import copy

import pytest
import torch
import torch.nn as nn

import fuser
import fuser.install.once_per_forward
import fuser.model.final_norm
from fuser.install.splice import STATE_ATTR
from fuser.pipeline.next_layer_entry import HandOver
from fuser.validate.tolerance import LAYER, mismatch
from tests.model.test_decode import PROMPT, STEPS, assert_same_logits, greedy, prefilled, step
from tests.model.test_model import causal_lm

E, LAYERS = 24, 3


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


class Layer(nn.Module):
    """A pre-norm layer: LayerNorm in, a residual add out (a sigmoid between, which no GEMM
    epilogue takes)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(E)
        self.up = nn.Linear(E, 2 * E)
        self.down = nn.Linear(2 * E, E)

    def forward(self, x):
        return x + self.down(torch.sigmoid(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, touch_between=False):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Layer() for _ in range(LAYERS)])
        for layer in self.layers:  # weights unlike each other's and the defaults'
            nn.init.normal_(layer.norm.weight, 1.0, 0.3)
            nn.init.normal_(layer.norm.bias, 0.0, 0.3)
        self.touch_between = touch_between

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
            if self.touch_between:
                x.mul_(1.5)  # written in place between two layers
        return x


def eager(model: Stack, x):
    for layer in model.layers:
        x = Layer.forward(layer, x)
        if model.touch_between:
            x.mul_(1.5)
    return x


def hand_over_of(layer: nn.Module) -> HandOver:
    """The hand-over node's target in a fused layer's forward."""
    (found,) = {v for v in layer.__dict__[STATE_ATTR].fused.__globals__.values() if isinstance(v, HandOver)}
    return found


@pytest.fixture
def entry_launches(monkeypatch):
    """The entry kernel's launches that ran (a hand-over taken runs none)."""
    ran = []
    run = fuser.install.once_per_forward._run
    monkeypatch.setattr(fuser.install.once_per_forward, "_run", lambda launch, args: ran.append(launch) or run(launch, args))
    return ran


def x_of(seed: int, tokens=5):
    return torch.randn(tokens, E, generator=torch.Generator().manual_seed(seed))


def test_the_next_layer_s_norm_is_computed_by_this_layer_s_add(entry_launches):
    model = Stack()
    report = fuser.apply(model, (x_of(0),))
    (group,) = report.groups
    r = group.report
    assert len(r.across_layers) == 1 and "of the next layer: computed by" in r.across_layers[0], r.text()
    assert group.handed_to == LAYERS - 1
    assert report.launches_after == LAYERS * r.launches_after - (LAYERS - 1)
    assert "given their first kernels' results by the layer before" in report.text()
    hand = hand_over_of(model.layers[0])
    for seed in (1, 2):  # and another batch size
        x = x_of(seed, tokens=5 + seed)
        entry_launches.clear()
        got = model(x.clone())
        assert mismatch(got, eager(model, x.clone()), "output", LAYER) is None
        assert entry_launches.count(hand.launch) == 1  # the first layer's; the others were handed theirs


def test_a_weight_of_the_next_layer_changed_after_apply_is_used():
    model = Stack()
    fuser.apply(model, (x_of(0),))
    model.layers[1].norm.weight.mul_(-2.0)
    model.layers[2].norm.bias.add_(1.0)
    x = x_of(3)
    assert mismatch(model(x.clone()), eager(model, x.clone()), "output", LAYER) is None


def test_a_layer_called_on_its_own_and_hidden_states_written_between_layers_launch_their_entry(entry_launches):
    model = Stack()
    fuser.apply(model, (x_of(0),))
    hand = hand_over_of(model.layers[0])
    x = x_of(4)
    entry_launches.clear()
    out = model.layers[0](x.clone())
    got = model.layers[1](out)  # no model forward: nothing handed over
    assert mismatch(got, Layer.forward(model.layers[1], Layer.forward(model.layers[0], x.clone())), "output", LAYER) is None
    assert entry_launches.count(hand.launch) == 2

    model.touch_between = True  # each layer's output written before the next reads it
    entry_launches.clear()
    got = model(x.clone())
    assert mismatch(got, eager(model, x.clone()), "output", LAYER) is None
    assert entry_launches.count(hand.launch) == LAYERS  # each hand-over stale: every layer launched its own


def test_a_deep_copy_hands_over_within_the_copy(entry_launches):
    model = Stack()
    fuser.apply(model, (x_of(0),))
    twin = copy.deepcopy(model)
    for layer in twin.layers:
        layer.norm.weight.mul_(0.5)  # the copy's own weights
    hand = hand_over_of(twin.layers[0])
    x = x_of(5)
    entry_launches.clear()
    assert mismatch(twin(x.clone()), eager(twin, x.clone()), "output", LAYER) is None
    assert entry_launches.count(hand.launch) == 1
    assert mismatch(model(x.clone()), eager(model, x.clone()), "output", LAYER) is None


def test_switched_off_every_layer_launches_its_entry():
    model = Stack()
    report = fuser.apply(model, (x_of(0),), disable_passes=("glue_across_layers",))
    (group,) = report.groups
    assert group.report.across_layers == [] and group.handed_to == 0
    assert report.launches_after == LAYERS * group.report.launches_after


def test_where_it_saves_no_launch_the_layer_keeps_its_plan_with_the_reason():
    """Llama's last add is done by the down projection's GEMM (residual_in_gemm): computing the
    next norm with the add instead would launch as many kernels."""
    model = causal_lm("qwen3", layers=2)
    cache, tokens = prefilled(model)
    report = fuser.apply(model, (), example_kwargs=step(tokens, PROMPT, copy.deepcopy(cache)))
    (group,) = report.groups
    assert group.report.across_layers == [] and group.report.residuals_in_gemm, group.report.text()
    assert "saves no launch" in group.report.across_layers_apart


@pytest.mark.parametrize("name", ["gpt_neox", "starcoder2", "qwen3_moe"])
def test_a_causal_lm_decodes_eager_s_logits_with_each_layer_s_norm_computed_by_the_layer_before(name, entry_launches,
                                                                                               norm_kernel_runs):  # fmt: skip
    """transformers' GPT-NeoX (parallel residual: both LayerNorms of the next layer), StarCoder2
    (LayerNorm with bias after a biased add) and Qwen3-MoE (the experts' combine and the
    residual, then the next RMSNorm) as shipped, greedy decode from a static
    cache: every step's logits are eager's, and again after a weight update of the second
    layer's input norm; in each step the entry kernel runs once, for the first layer. In
    StarCoder2 and Qwen3-MoE the last layer computes the final norm (``model.norm``, a norm as
    the layers' input norm), which then launches nothing in a step."""
    model = causal_lm(name, layers=LAYERS)
    cache, tokens = prefilled(model)
    eager_model = copy.deepcopy(model)
    report = fuser.apply(model, (), example_kwargs=step(tokens, PROMPT, copy.deepcopy(cache)))
    (group,) = report.groups
    assert len(group.report.across_layers) == 1 and group.handed_to == LAYERS - 1, group.report.text()
    stack = (lambda m: m.gpt_neox.layers) if name == "gpt_neox" else (lambda m: m.model.layers)
    hand = hand_over_of(stack(model)[0])
    if name in ("qwen3_moe", "starcoder2"):
        assert list(report.handed_over) == ["model.norm"], report.text()
    elif name == "gpt_neox":  # its entry is both LayerNorms of a layer, the final norm one
        assert "other ops" in report.handed_over_apart["gpt_neox.final_layer_norm"], report.text()
    for update in (False, True):
        if update:
            for m in (model, eager_model):
                stack(m)[1].input_layernorm.weight.mul_(1.5)
        eager_logits = greedy(eager_model, copy.deepcopy(cache), tokens)
        entry_launches.clear()
        norm_kernel_runs.clear()
        fused = greedy(model, copy.deepcopy(cache), tokens)
        assert entry_launches.count(hand.launch) == STEPS and norm_kernel_runs == []
        assert_same_logits(fused, eager_logits, " after the update" if update else "")


def test_a_kernel_whose_input_is_another_tensor_is_no_entry():
    """An entry reads only the hidden states and parameters: a norm of the sum of two inputs
    is computed where it is."""

    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(E)
            self.fc = nn.Linear(E, E)

        def forward(self, x, y):
            return x + self.fc(self.norm(x + y))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([TwoInputs() for _ in range(LAYERS)])

        def forward(self, x, y):
            for layer in self.layers:
                x = layer(x, y)
            return x

    model = Model()
    x, y = x_of(0), x_of(1)
    expected = model(x, y)
    report = fuser.apply(model, (x, y))
    (group,) = report.groups
    assert group.report.across_layers == [] and "no kernel reads only" in group.report.across_layers_apart
    assert mismatch(model(x, y), expected, "output", LAYER) is None



def assert_replays_as_eager(model, static, reference) -> None:
    """``model``'s forward on ``static`` (a CUDA tensor), warmed up on a side stream, captured in a
    CUDA graph and replayed on new inputs copied into ``static``: each replay's output is
    ``reference(model, x)``'s, within the layer tolerance."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            model(static.clone())
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model(static)
    for seed in (1, 2):
        static.copy_(x_of(seed, tokens=8).to(static))
        graph.replay()
        torch.cuda.synchronize()
        assert mismatch(out, reference(model, static.clone()), "replayed output", LAYER) is None


@pytest.mark.gpu
def test_on_the_gpu_a_captured_forward_replays_the_hand_overs():
    """The hand-over is Python-side: captured once in a CUDA graph, the replays read the kernel
    outputs the capture handed over, on new inputs copied into the graph's input buffer."""
    model = Stack().cuda().to(torch.bfloat16)
    static = x_of(0, tokens=8).cuda().to(torch.bfloat16)
    report = fuser.apply(model, (static.clone(),))
    assert report.groups[0].handed_to == LAYERS - 1, report.text()
    assert_replays_as_eager(model, static, eager)


@fuser.opaque
def scale_in_place(x):
    x.mul_(0.5)  # (a kernel of the model's own could write through a pointer, seen by no version counter)
    return x


def test_an_input_norm_after_a_leaf_given_the_hidden_states_is_no_entry():
    """A leaf that may write the hidden states runs before the norm: a result handed over
    before it could be stale, so the norm is computed where it is."""

    class LeafFirst(Layer):
        def forward(self, x):
            scale_in_place(x)  # the norm reads x itself, after the leaf was given it
            return x + self.down(torch.sigmoid(self.up(self.norm(x))))

    model = Stack()
    model.layers = nn.ModuleList([LeafFirst() for _ in range(LAYERS)])
    x = x_of(0)
    expected = model(x.clone())
    report = fuser.apply(model, (x.clone(),))
    (group,) = report.groups
    assert group.report.across_layers == [] and "before a leaf or an in-place op" in group.report.across_layers_apart
    assert mismatch(model(x.clone()), expected, "output", LAYER) is None


# --- the last layer computes the final norm (fuser.model.final_norm) ---------------------------
class RMSNorm(nn.Module):
    def __init__(self, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(E))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class RMSLayer(Layer):
    def __init__(self):
        super().__init__()
        self.norm = RMSNorm()


class NormedStack(nn.Module):
    """Layers, then a final norm (``final_eps``) of their output."""

    def __init__(self, final_eps=1e-6):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([RMSLayer() for _ in range(LAYERS)])
        self.norm = RMSNorm(final_eps)
        for norm in [layer.norm for layer in self.layers] + [self.norm]:
            nn.init.normal_(norm.weight, 1.0, 0.3)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def eager_normed(model: NormedStack, x):
    for layer in model.layers:
        x = Layer.forward(layer, x)
    return RMSNorm.forward(model.norm, x)


@pytest.fixture
def norm_kernel_runs():
    """Calls of the final norm's own fused forward (its kernel), by module: patched at each apply."""
    runs = []
    take = fuser.model.final_norm.TakesHandOver.__call__

    def counted(self, module, *args):
        fused = self.fused
        self.fused = lambda m, *a: runs.append(m) or fused(m, *a)
        try:
            return take(self, module, *args)
        finally:
            self.fused = fused

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fuser.model.final_norm.TakesHandOver, "__call__", counted)
        yield runs


def test_the_last_layer_computes_the_final_norm_within_a_forward_of_the_model(entry_launches, norm_kernel_runs):
    model = NormedStack()
    report = fuser.apply(model, (x_of(0),))
    assert "norm" in report.others and report.handed_over == {"norm": report.handed_over["norm"]}, report.text()
    assert report.handed_over["norm"].startswith(f"computed by layers.{LAYERS - 1}'s "), report.handed_over
    (group,) = report.groups
    assert report.launches_after == LAYERS * group.report.launches_after - (LAYERS - 1) + report.others["norm"].launches_after - 1
    assert "0 within a forward of the model: computed by layers.2's" in report.text()
    hand = hand_over_of(model.layers[0])
    for seed in (1, 2):  # and another batch size
        x = x_of(seed, tokens=4 + seed)
        entry_launches.clear()
        norm_kernel_runs.clear()
        assert mismatch(model(x.clone()), eager_normed(model, x.clone()), "output", LAYER) is None
        assert entry_launches.count(hand.launch) == 1 and norm_kernel_runs == []  # the last layer's kernel did it

    x = x_of(3)
    alone = model.norm(x.clone())  # called on its own: its own kernel
    assert norm_kernel_runs == [model.norm]
    assert mismatch(alone, RMSNorm.forward(model.norm, x.clone()), "the norm alone", LAYER) is None


def test_a_final_norm_weight_changed_after_apply_and_a_deep_copy_are_followed(norm_kernel_runs):
    model = NormedStack()
    fuser.apply(model, (x_of(0),))
    model.norm.weight.mul_(-2.0)
    x = x_of(4)
    assert mismatch(model(x.clone()), eager_normed(model, x.clone()), "output after the update", LAYER) is None
    twin = copy.deepcopy(model)
    twin.norm.weight.mul_(0.5)  # the copy's own final norm
    norm_kernel_runs.clear()
    assert mismatch(twin(x.clone()), eager_normed(twin, x.clone()), "the copy's output", LAYER) is None
    assert norm_kernel_runs == []  # the copy's last layer computed the copy's norm
    assert mismatch(model(x.clone()), eager_normed(model, x.clone()), "the original's output", LAYER) is None

    fuser.restore(model)
    assert fuser.model.final_norm.NEXT not in model.layers[LAYERS - 1].__dict__
    assert torch.equal(model(x.clone()), eager_normed(model, x.clone()))


def test_a_final_norm_of_other_ops_than_the_layers_entry_runs_its_own_kernel_with_the_reason(norm_kernel_runs):
    model = NormedStack(final_eps=1e-5)  # the layers' norms have eps 1e-6
    report = fuser.apply(model, (x_of(0),))
    assert report.handed_over == {} and "other ops than the layers' entry kernel" in report.handed_over_apart["norm"]
    assert "not computed by the last layer: its kernel computes other ops" in report.text()
    x = x_of(5)
    assert mismatch(model(x.clone()), eager_normed(model, x.clone()), "output", LAYER) is None
    assert norm_kernel_runs == []  # (not wrapped: the norm's fused forward is its own)


@pytest.mark.gpu
def test_on_the_gpu_a_captured_forward_replays_the_final_norm_the_last_layer_computed():
    model = NormedStack().cuda().to(torch.bfloat16)
    static = x_of(0, tokens=8).cuda().to(torch.bfloat16)
    report = fuser.apply(model, (static.clone(),))
    assert list(report.handed_over) == ["norm"], report.text()
    assert_replays_as_eager(model, static, eager_normed)
