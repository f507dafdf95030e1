"""The engine adapter interface (:class:`fuser.serving.engine.Engine`), proved with a toy engine.

The toy engine is what a serving engine looks like to fuser: a model with a stack of decoder
layers whose ``forward`` takes a per-call batch object saying whether the call is a decode
step; its own attention kernel (a leaf that requires the batch) inside an attention block that
passes the batch to it; its GEMMs as ``torch.nn.Linear``; glue around them. Its adapter
(:data:`TOY` and :func:`after_model_init`) is written against ``fuser.serving`` alone, as a
vLLM adapter would be: one :class:`Engine` and one call of :func:`fuser.serving.engine.install`
from the engine's after-model-init hook. It gets what the sglang adapter gets: each target is
fused at its first decode call, every other call runs the layer's own code, and nothing is
fused inside a (simulated) CUDA-graph capture.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
import fuser
import torch
import torch.nn as nn
import torch.nn.functional as F

from fuser.serving.engine import Engine, decisions, install
from fuser.serving.lazy_fusion import SPLICE_ATTR, ModeSplice, uninstall
from fuser.serving.options import Options
from serving_helpers import FusedGraphRuns

HIDDEN = 32


# ------------------------------------------------------------------------------------------
# The toy engine: its per-call batch, its attention kernel, its decoder layer
# ------------------------------------------------------------------------------------------


@dataclass
class Batch:
    """The engine's per-call state, handed to every layer: what kind of step this is."""

    decode: bool
    scale: float = 0.5


class ToyAttentionKernel(nn.Module):
    """The engine's attention: its own kernel, which reads the batch (a leaf of the engine)."""

    def forward(self, q, batch):
        return torch.flip(q, (-1,)) * batch.scale


class Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(HIDDEN) * 0.1)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + self.weight)


class Attention(nn.Module):
    """Passes the batch to the engine's kernel: searched for targets, not traced."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, HIDDEN)
        self.q_norm = Norm()
        self.kernel = ToyAttentionKernel()

    def forward(self, x, batch):
        return self.kernel(self.q_norm(self.qkv(x)), batch)


class Mlp(nn.Module):
    """Glue around two GEMMs; the second one's weight is computed from two parameters."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down_weight = nn.Parameter(torch.randn(HIDDEN, HIDDEN) * 0.1)
        self.down_scale = nn.Parameter(torch.full((HIDDEN, 1), 0.5))

    def forward(self, x):
        gate, up = self.up(x).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_weight * self.down_scale)


class ToyLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = Norm()
        self.attn = Attention()
        self.mlp_norm = Norm()
        self.mlp = Mlp()

    def forward(self, x, batch):
        h = x + self.attn(self.norm(x), batch)
        return h + self.mlp(self.mlp_norm(h))


class NoBatchLayer(nn.Module):
    """A layer that is not told what kind of call it is: it cannot be spliced."""

    def __init__(self):
        super().__init__()
        self.norm = Norm()

    def forward(self, x):
        return self.norm(x)


class ToyModel(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(ToyLayer() for _ in range(layers))

    def forward(self, x, batch):
        for layer in self.layers:
            x = layer(x, batch)
        return x


# ------------------------------------------------------------------------------------------
# The toy engine's adapter: only what is the engine's
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToyOptions(Options):
    layers: tuple[str, ...] = ("ToyLayer",)


def declare_weight_caches(model: nn.Module, message: str) -> None:
    model.derived_weights = message


TOY = Engine(
    call_state="batch",
    is_decode=lambda batch: batch is not None and batch.decode,
    is_leaf=lambda module: isinstance(module, ToyAttentionKernel),
    declare_weight_caches=declare_weight_caches,
)


def after_model_init(model: nn.Module, environ: dict | None = None) -> list[ModeSplice]:
    """The engine's hook after its model is loaded, before any warm-up or capture."""
    return install(model, TOY, ToyOptions.from_env(environ or {}))


#: The layers' targets alone, each fused on its own (no layer fused whole).
TARGETS_ONLY = {"FUSER_WHOLE_LAYER": "0"}


# ------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------


def close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)


@pytest.fixture
def model():
    torch.manual_seed(0)
    model = ToyModel()
    yield model
    uninstall(model)


def states(splices: list[ModeSplice]) -> dict[str, str]:
    return {t.name: t.state for s in splices for t in s.targets}


def test_the_core_decides_leaves_searched_modules_and_targets_from_the_adapters_facts():
    assert decisions(ToyLayer(), TOY) == [
        ("norm", "Norm", "target"),
        ("attn", "Attention", "searched"),  # passes the batch to the engine's kernel
        ("attn.qkv", "Linear", "leaf"),  # fuser's own leaf
        ("attn.q_norm", "Norm", "target"),
        ("attn.kernel", "ToyAttentionKernel", "leaf"),  # the engine's leaf
        ("mlp_norm", "Norm", "target"),
        ("mlp", "Mlp", "target"),
    ]


def test_every_layer_is_spliced_and_nothing_is_traced_at_install(model):
    splices = after_model_init(model)
    assert [s.name for s in splices] == ["layers.0", "layers.1"]
    assert all(SPLICE_ATTR in layer.__dict__ for layer in model.layers)
    assert [t.name for t in splices[0].targets] == [
        "layers.0.norm", "layers.0.attn.q_norm", "layers.0.mlp_norm", "layers.0.mlp"]
    assert set(states(splices).values()) == {"waiting"}


def test_a_call_that_is_not_decode_runs_the_layers_own_code_and_fuses_nothing(model):
    x = torch.randn(4, HIDDEN)
    with torch.no_grad():
        expected = model(x, Batch(decode=False))
        splices = after_model_init(model)
        out = model(x, Batch(decode=False))
    assert torch.equal(out, expected)
    assert set(states(splices).values()) == {"waiting"}


def test_each_target_is_fused_at_its_first_decode_call_and_runs_fused_after(model):
    with torch.no_grad():
        expected = {n: model(torch.full((n, HIDDEN), 0.1 * n).sin(), Batch(decode=True)) for n in (4, 1, 7)}
        splices = after_model_init(model, TARGETS_ONLY)
        close(model(torch.full((4, HIDDEN), 0.4).sin(), Batch(decode=True)), expected[4])
        assert set(states(splices).values()) == {"fused"}
        runs = [FusedGraphRuns(t) for s in splices for t in s.targets]
        for n in (1, 7):  # other batch sizes: the same fused graphs
            close(model(torch.full((n, HIDDEN), 0.1 * n).sin(), Batch(decode=True)), expected[n])
    assert [r.count for r in runs] == [2] * len(runs)


def test_after_fusion_a_call_that_is_not_decode_still_runs_the_layers_own_code(model):
    x = torch.randn(5, HIDDEN)
    with torch.no_grad():
        expected = model(x, Batch(decode=False))
        splices = after_model_init(model, TARGETS_ONLY)
        model(x, Batch(decode=True))
        runs = [FusedGraphRuns(t) for s in splices for t in s.targets]
        out = model(x, Batch(decode=False))
    assert torch.equal(out, expected)
    assert [r.count for r in runs] == [0] * len(runs)


def test_nothing_is_fused_inside_a_capture_and_a_later_call_outside_it_fuses(model, caplog, monkeypatch):
    x = torch.randn(3, HIDDEN)
    with torch.no_grad():
        expected = model(x, Batch(decode=True))
        splices = after_model_init(model, TARGETS_ONLY)
        with caplog.at_level(logging.WARNING, logger="fuser"), monkeypatch.context() as capture:
            capture.setattr(torch.cuda, "is_available", lambda: True)  # the stream reads as capturing
            capture.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
            out = model(x, Batch(decode=True))
        assert torch.equal(out, expected)  # eager: the first decode call came during capture
        assert set(states(splices).values()) == {"waiting"}
        captured = [r.getMessage() for r in caplog.records if "during CUDA-graph capture" in r.getMessage()]
        assert len(captured) == len(states(splices))  # once per target
        close(model(x, Batch(decode=True)), expected)  # the warm-up after: fused
    assert set(states(splices).values()) == {"fused"}


def test_a_layer_that_takes_no_batch_is_left_eager_with_a_warning(caplog):
    model = nn.Module()
    model.layers = nn.ModuleList([NoBatchLayer()])
    with caplog.at_level(logging.WARNING, logger="fuser"):
        splices = after_model_init(model, {"FUSER_LAYERS": "NoBatchLayer"})
    assert splices == [] and SPLICE_ATTR not in model.layers[0].__dict__
    assert any("takes no batch: decode and prefill cannot be told apart" in r.getMessage() for r in caplog.records)


def test_values_computed_from_weights_are_declared_through_the_adapter(model):
    with torch.no_grad():
        after_model_init(model, TARGETS_ONLY)
        model(torch.randn(2, HIDDEN), Batch(decode=True))
    # Mlp's down_weight * down_scale is parameter-only glue: computed once at fuse time, declared.
    assert model.derived_weights.startswith("fuser holds values computed from the weights at fuse time")
    assert "layers.1.mlp: _fuser_const_0" in model.derived_weights  # the last target fused


def test_uninstall_leaves_the_model_as_it_was(model):
    x = torch.randn(4, HIDDEN)
    with torch.no_grad():
        expected = model(x, Batch(decode=True))
        after_model_init(model)
        model(x, Batch(decode=True))
        uninstall(model)
        assert torch.equal(model(x, Batch(decode=True)), expected)
    for module in model.modules():
        assert SPLICE_ATTR not in module.__dict__ and "forward" not in module.__dict__


# ------------------------------------------------------------------------------------------
# Each layer fused whole (the default), its targets the fallback
# ------------------------------------------------------------------------------------------


class HostReadLayer(ToyLayer):
    """A layer whose own code reads a value to the host: it cannot be traced whole."""

    def forward(self, x, batch):
        if float(x.abs().max()) > 1e6:
            raise ValueError("overflow")
        return super().forward(x, batch)


def inputs(n: int) -> torch.Tensor:
    return torch.full((n, HIDDEN), 0.1 * n).sin() + torch.linspace(-1, 1, HIDDEN)


def wholes(splices: list[ModeSplice]) -> dict[str, str]:
    return {s.name: s.whole.state for s in splices}


def test_each_layer_is_fused_whole_at_its_first_decode_call_and_runs_fused_after(model):
    with torch.no_grad():
        expected = {n: model(inputs(n), Batch(decode=True)) for n in (4, 1, 7)}
        splices = after_model_init(model)
        close(model(inputs(4), Batch(decode=True)), expected[4])
        assert wholes(splices) == {"layers.0": "fused", "layers.1": "fused"}
        runs = [FusedGraphRuns(s.whole) for s in splices]
        for n in (1, 7):
            close(model(inputs(n), Batch(decode=True)), expected[n])
    assert [r.count for r in runs] == [2, 2]
    # The attention block passes the batch to the engine's kernel: opaque in the layer's graph,
    # its own target (q_norm) fuses at its first call inside it; the others are not needed.
    assert states(splices) == {"layers.0.norm": "waiting", "layers.0.attn.q_norm": "fused", "layers.0.mlp_norm": "waiting",
                               "layers.0.mlp": "waiting", "layers.1.norm": "waiting", "layers.1.attn.q_norm": "fused",
                               "layers.1.mlp_norm": "waiting", "layers.1.mlp": "waiting"}
    report = splices[0].whole.report
    assert report.launches_after < report.launches_before


def test_the_whole_layer_merges_glue_its_targets_fuse_apart(model):
    """``h = x + attn(...)`` and the MLP's norm of ``h`` are one kernel in the layer's graph;
    fused target by target, the add runs alone between them."""
    with torch.no_grad():
        whole = after_model_init(model)
        model(inputs(3), Batch(decode=True))
        uninstall(model)
        targets = after_model_init(model, TARGETS_ONLY)
        model(inputs(3), Batch(decode=True))
    fused_whole = whole[0].whole.report.launches_after
    # q_norm fuses on its own either way (inside the attention block); the two adds run eager apart
    fused_apart = sum(t.report.launches_after for t in targets[0].targets if ".attn." not in t.name) + 2
    assert fused_whole < fused_apart, (fused_whole, fused_apart)


def test_a_call_the_layers_guard_declines_runs_its_code_and_its_targets_fuse(model):
    with torch.no_grad():
        splices = after_model_init(model)
        model(inputs(4), Batch(decode=True))
        x = inputs(6).reshape(2, 3, HIDDEN)
        expected = model(x, Batch(decode=False))  # the layers' own code (not a decode call)
        out = model(x, Batch(decode=True))  # a 3-d input: the whole layer's guard declines
    close(out, expected)
    assert wholes(splices) == {"layers.0": "fused", "layers.1": "fused"}
    assert set(states(splices).values()) == {"fused"}  # the fallback fused each target at this call
    declined = fuser.stats(model.layers[0])[""]["declined"]
    assert list(declined.values()) == [1] and "(2, 3, 32)" in next(iter(declined))


def test_a_layer_that_cannot_be_fused_whole_falls_back_to_its_targets_logged_once(caplog):
    torch.manual_seed(0)
    model = nn.Module()
    model.layers = nn.ModuleList([HostReadLayer()])
    environ = {"FUSER_LAYERS": "HostReadLayer"}
    with torch.no_grad():
        expected = {n: model.layers[0](inputs(n), Batch(decode=True)) for n in (4, 2)}
        with caplog.at_level(logging.WARNING, logger="fuser"):
            splices = after_model_init(model, environ)
            for n in (4, 2):
                close(model.layers[0](inputs(n), Batch(decode=True)), expected[n])
    assert wholes(splices) == {"layers.0": "eager"}
    assert set(states(splices).values()) == {"fused"}
    (message,) = [r.getMessage() for r in caplog.records if "layers.0 left eager" in r.getMessage()]
    assert "a host read" in message and message.endswith("its fusion targets fuse one by one instead")
    uninstall(model)
    with torch.no_grad():
        after_model_init(model, {**environ, "FUSER_STRICT": "1"})
        with pytest.raises(fuser.FuserError, match="layers.0 cannot be fused: .*a host read"):
            model.layers[0](inputs(4), Batch(decode=True))
    uninstall(model)
