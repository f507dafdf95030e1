"""fuser.pipeline.activation_in_gemm: a ReLU or tanh GELU of a linear layer's output, alone
between two GEMMs, is applied by the GEMM with its bias (``torch._addmm_activation`` on CUDA);
the activation launches nothing. The activations are transformers' own classes and PyTorch's
functions; every case where the epilogue would compute something else keeps the activation."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.activations import ACT2FN

import fuser
from fuser.install.splice import STATE_ATTR
from fuser.pipeline.activation_in_gemm import addmm_activation, linear_activation
from fuser.tools.bench import launched_kernels
from fuser.validate.tolerance import LAYER, mismatch
from tests.model.test_decode import PROMPT, STEPS, greedy, prefilled, step
from tests.model.test_model import causal_lm

D, H = 48, 72


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


class MLP(nn.Module):
    """``x + down(act(up(norm(x))))``: the activation alone between the two GEMMs."""

    def __init__(self, act, bias=True, up=nn.Linear):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = up(D, H, bias=bias)
        self.act = act
        self.down = nn.Linear(H, D)

    def forward(self, x):
        return x + self.down(self.act(self.up(self.norm(x))))


class ReadTwice(MLP):
    """The GEMM's output is read by more than the activation."""

    def forward(self, x):
        h = self.up(self.norm(x))
        return x + self.down(self.act(h)) + h.sum(-1, keepdim=True)


class Squared(MLP):
    """relu²: the ReLU shares its kernel with the square."""

    def forward(self, x):
        return x + self.down(torch.square(F.relu(self.up(self.norm(x)))))


class Subclass(nn.Linear):
    pass


class AddmmMLP(nn.Module):
    """The up projection as ``torch.addmm`` of a ``[in, out]`` weight, its rows viewed back
    (GPT-2's ``Conv1D``); ``beta`` and a matrix ``bias`` break the epilogue's form."""

    def __init__(self, act, beta=None, matrix_bias=False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D, H) / D**0.5)
        self.bias = nn.Parameter(torch.randn(1, H) if matrix_bias else torch.randn(H))
        self.act, self.beta = act, beta
        self.down = nn.Linear(H, D)

    def forward(self, x):
        kwargs = {} if self.beta is None else dict(beta=self.beta)
        h = torch.addmm(self.bias, x.view(-1, D), self.weight, **kwargs).view(*x.shape[:-1], H)
        return x + self.down(self.act(h))


def inputs(T=5, dtype=torch.float32, seed=0):
    return (torch.randn(T, D, generator=torch.Generator().manual_seed(seed)).to(dtype),)


ACTIVATIONS = {
    "relu": (nn.ReLU(), "relu"),
    "gelu_pytorch_tanh": (ACT2FN["gelu_pytorch_tanh"], "gelu_tanh"),
    "gelu_new": (ACT2FN["gelu_new"], "gelu_new"),
    "gelu_fast": (ACT2FN["gelu_fast"], "gelu_fast"),
    "F.gelu tanh": (lambda x: F.gelu(x, approximate="tanh"), "gelu_tanh"),
}


def applied_by_the_gemm(block, dtype, tokens) -> str:
    """``block`` checked against eager with its one activation applied by the GEMM (one launch
    fewer than with the pass off), then fused and called at other token counts, each eager's;
    returns the report's entry."""
    result = fuser.check(block, inputs(dtype=dtype))
    assert result.ok, result.text()
    (entry,) = result.report.activations_in_gemm
    assert "activations applied by the GEMM" in result.report.text()

    off = fuser.explain(block, inputs(dtype=dtype), disable_passes=("activation_in_gemm",))
    assert off.activations_in_gemm == []
    assert off.launches_after == result.report.launches_after + 1, (off.text(), result.report.text())

    eager = copy.deepcopy(block)
    fuser.apply(block, inputs(dtype=dtype))
    for seed, T in enumerate(tokens, start=1):
        (x,) = inputs(T, dtype, seed)
        problem = mismatch(block(x), eager(x), f"T={T}", LAYER)
        assert problem is None, problem
    assert block.__dict__[STATE_ATTR].calls.fused == len(tokens)
    return entry


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_the_activation_is_done_by_the_gemm_and_the_result_is_eager_s(name, dtype):
    torch.manual_seed(0)
    act, kind = ACTIVATIONS[name]
    entry = applied_by_the_gemm(MLP(act).to(dtype), dtype, (1, 7, 16))
    assert entry.endswith(f"({kind}) of up"), entry


@pytest.mark.parametrize(
    "make, why",
    [
        pytest.param(lambda: MLP(nn.GELU()), "the exact (erf) GELU", id="the exact GELU"),
        pytest.param(lambda: MLP(nn.ReLU(), bias=False), "with a bias", id="no bias"),
        pytest.param(lambda: MLP(nn.ReLU(), up=Subclass), "not exactly torch.nn.Linear", id="a subclass"),
        pytest.param(lambda: ReadTwice(ACT2FN["gelu_new"]), "read by", id="the output read again"),
        pytest.param(lambda: Squared(nn.ReLU()), "shares a kernel", id="relu squared"),
        pytest.param(lambda: AddmmMLP(nn.ReLU(), beta=0.5), "beta, alpha", id="an addmm with a beta"),
        pytest.param(lambda: AddmmMLP(nn.ReLU(), matrix_bias=True), "adding a matrix", id="an addmm adding a matrix"),
    ],
)
def test_where_the_epilogue_would_compute_something_else_the_activation_stays_with_its_reason(make, why):
    torch.manual_seed(0)
    block = make()
    result = fuser.check(block, inputs())
    assert result.ok, result.text()
    assert result.report.activations_in_gemm == [], result.report.text()
    (reason,) = result.report.activations_apart.values()
    assert why in reason, reason
    assert "left apart from it:" in result.report.text()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["relu", "gelu_new"])
def test_an_addmm_s_activation_is_done_by_the_addmm(name, dtype):
    torch.manual_seed(0)
    act, kind = ACTIVATIONS[name]
    entry = applied_by_the_gemm(AddmmMLP(act).to(dtype), dtype, (1, 7))
    assert entry.endswith(f"({kind}) of addmm (torch.addmm)"), entry  # (its weight is the module's own: no owner to name)


def test_gpt_2_s_mlp_gelu_is_done_by_its_conv1d_addmm(monkeypatch):
    """transformers' GPT2Block as shipped: its MLP's ``Conv1D`` is ``torch.addmm`` of the
    weight, its ``gelu_new`` written out."""
    from examples.zoo import layers as zoo
    from examples.zoo.sweep import spec_of

    monkeypatch.setitem(zoo.UNSEEN, "gpt2", spec_of("gpt2"))
    layer, args, kwargs = zoo.build("gpt2", T=3)
    result = fuser.check(layer, args, example_kwargs=kwargs)
    assert result.ok, result.problems
    assert result.report.activations_in_gemm == ["mul_3 (gelu_new) of mlp.c_fc (torch.addmm)"], result.report.text()
    assert {u.op for u in result.report.unfused} == {"add"}, result.report.text()


def test_a_weight_changed_after_apply_is_used():
    torch.manual_seed(0)
    block = MLP(ACT2FN["gelu_new"])
    fuser.apply(block, inputs())
    block.up.weight.mul_(-2.0)
    block.up.bias.add_(0.5)
    eager = copy.deepcopy(block)
    fuser.restore(eager)
    (x,) = inputs(seed=4)
    assert mismatch(block(x), eager(x), "after the update", LAYER) is None
    block.up.bias = nn.Parameter(torch.randn(H))  # replaced
    eager.up.bias = nn.Parameter(block.up.bias.detach().clone())
    assert mismatch(block(x), eager(x), "after the replacement", LAYER) is None


def test_a_hook_put_on_the_linear_after_apply_runs_the_call_eager():
    torch.manual_seed(0)
    block = MLP(nn.ReLU())
    fuser.apply(block, inputs())
    assert block.__dict__[STATE_ATTR].report.activations_in_gemm
    eager = copy.deepcopy(block)
    fuser.restore(eager)
    for m in (block, eager):
        m.up.register_forward_hook(lambda module, args, out: out - 1.0)
    (x,) = inputs(seed=5)
    with pytest.warns(UserWarning):
        got = block(x)
    assert mismatch(got, eager(x), "with the hook", LAYER) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gelu", [True, False], ids=["gelu_tanh", "relu"])
def test_linear_activation_is_the_activation_of_the_linear_layer(gelu, dtype):
    """The call the pass puts in, at odd widths and token counts (CPU: PyTorch's ops)."""
    g = torch.Generator().manual_seed(0)
    for rows, k, n in ((1, 40, 24), (3, 33, 65), (17, 128, 200)):
        x = torch.randn(2, rows, k, generator=g).to(dtype)
        w, b = torch.randn(n, k, generator=g).to(dtype) / k**0.5, torch.randn(n, generator=g).to(dtype)
        expected = F.linear(x.float(), w.float(), b.float())
        expected = F.gelu(expected, approximate="tanh") if gelu else F.relu(expected)
        got = linear_activation(x, w, b, gelu)
        assert got.shape == (2, rows, n) and got.dtype == dtype
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
        torch.testing.assert_close(got.float(), expected, **tol)


@pytest.mark.parametrize("name", ["gptj", "starcoder2"])
def test_a_causal_lm_s_mlp_activation_is_done_by_its_up_projection(name):
    """transformers' GPT-J (gelu_new written out) and StarCoder2 (F.gelu tanh) as shipped,
    greedy decode from a static cache: the logits of every step are eager's, and again after a
    weight update of one layer's up projection."""
    model = causal_lm(name, layers=2)
    cache, tokens = prefilled(model)
    eager_model = copy.deepcopy(model)
    report = fuser.apply(model, (), example_kwargs=step(tokens, PROMPT, copy.deepcopy(cache)))
    (group,) = report.groups
    assert len(group.report.activations_in_gemm) == 1, group.report.text()
    assert "activations applied by the GEMM" in report.text()

    layers = [m for m in model.modules() if fuser.is_fused(m)]
    up = {"gptj": lambda m: m.transformer.h[1].mlp.fc_in, "starcoder2": lambda m: m.model.layers[1].mlp.c_fc}[name]
    for update in (False, True):
        if update:
            for m in (model, eager_model):
                up(m).weight.mul_(1.5)
        eager = greedy(eager_model, copy.deepcopy(cache), tokens)
        calls = [layer.__dict__[STATE_ATTR].calls.fused for layer in layers]
        fused = greedy(model, copy.deepcopy(cache), tokens)
        assert [layer.__dict__[STATE_ATTR].calls.fused - c for layer, c in zip(layers, calls)] == [STEPS] * len(layers)
        for i, (got, expected) in enumerate(zip(fused, eager)):
            problem = mismatch(got, expected, f"logits at step {i}{' after the update' if update else ''}", LAYER)
            assert problem is None, problem


# Against the fp32 reference computed from the rounded inputs: one rounding of the result (bf16
# 2^-8, fp16 2^-11 relative), plus the accumulation order of a K-long sum.
GPU_TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
                 torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("gelu", [True, False], ids=["gelu_tanh", "relu"])
def test_on_the_gpu_the_gemm_applies_the_activation_in_one_kernel(gelu, dtype):
    """cuBLASLt's epilogue, at decode and odd sizes: the tanh GELU (not the exact one: in fp32
    the two differ by far more than the tolerance, which this checks too) or ReLU of the linear
    layer's output, in one kernel (in fp32 at times two)."""
    g = torch.Generator().manual_seed(0)
    for rows, k, n in ((1, 4096, 16384), (3, 72, 200), (8, 2560, 10240), (33, 1000, 3000), (128, 4608, 18432)):
        x = torch.randn(rows, k, generator=g).to(dtype).cuda()
        w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).cuda()
        b = torch.randn(n, generator=g).to(dtype).cuda()
        linear = F.linear(x.double(), w.double(), b.double())
        expected = F.gelu(linear, approximate="tanh") if gelu else F.relu(linear)
        got = linear_activation(x, w, b, gelu)
        assert got.dtype == dtype and got.shape == (rows, n)
        torch.testing.assert_close(got.double(), expected, **GPU_TOLERANCE[dtype], msg=f"{rows}x{k}x{n}")
        if gelu and dtype == torch.float32:
            assert (got.double() - F.gelu(linear)).abs().max() > 1e-4  # not the exact GELU
        kernels = launched_kernels(lambda: linear_activation(x, w, b, gelu))
        # fp32: at small sizes cuBLAS runs a GEMV or small GEMM, then at times a kernel of its
        # own for the bias and activation (as many launches as PyTorch's linear and activation:
        # why the pass leaves fp32 on CUDA alone); in half precision one kernel.
        assert 1 <= len(kernels) <= (2 if dtype == torch.float32 else 1), kernels


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_on_the_gpu_an_addmm_of_an_in_out_weight_applies_the_activation_in_one_kernel(dtype):
    """GPT-2's layout: the weight ``[in, out]`` as it is (a linear layer's is transposed)."""
    g = torch.Generator().manual_seed(1)
    for rows, k, n in ((1, 768, 3072), (5, 1600, 6400), (64, 1024, 4096)):
        x = torch.randn(rows, k, generator=g).to(dtype).cuda()
        w = (torch.randn(k, n, generator=g) / k**0.5).to(dtype).cuda()
        b = torch.randn(n, generator=g).to(dtype).cuda()
        expected = F.gelu(torch.addmm(b.double(), x.double(), w.double()), approximate="tanh")
        got = addmm_activation(b, x, w, True)
        torch.testing.assert_close(got.double(), expected, **GPU_TOLERANCE[dtype], msg=f"{rows}x{k}x{n}")
        kernels = launched_kernels(lambda: addmm_activation(b, x, w, True))
        assert len(kernels) == 1, kernels


@pytest.mark.gpu
def test_on_the_gpu_gpt_j_s_layer_runs_its_gelu_in_the_gemm():
    from examples.zoo import layers as zoo

    layer, args, kwargs = zoo.FACTORIES["gptj"](T=8, device="cuda", dtype=torch.bfloat16)
    result = fuser.check(layer, args, example_kwargs=kwargs)
    assert result.ok, result.problems
    assert len(result.report.activations_in_gemm) == 1, result.report.text()


@pytest.mark.gpu
def test_on_the_gpu_an_fp32_layer_keeps_its_activation_with_the_reason():
    torch.manual_seed(0)
    block = MLP(ACT2FN["gelu_new"]).cuda()
    result = fuser.check(block, tuple(x.cuda() for x in inputs()))
    assert result.ok, result.problems
    assert result.report.activations_in_gemm == []
    (reason,) = result.report.activations_apart.values()
    assert "fp32 on CUDA" in reason, reason


def test_a_copy_kernel_beside_the_activation_still_counts_its_launch():
    """The pass drops from the report only the ops it erased: a reshape made a copy kernel (its
    node renamed in the fused graph) is still a launch."""

    class WithCopy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.out = nn.Linear(D, H), nn.Linear(H, D)

        def forward(self, x, z):
            return self.out(F.relu(self.fc(x))), z.transpose(1, 2).reshape(z.shape[0], -1)

    report = fuser.explain(WithCopy(), (torch.randn(5, D), torch.randn(5, 3, 4)))
    assert report.activations_in_gemm and [c.pattern for c in report.chains] == ["copy"], report.text()
    assert report.launches_after == 1  # the copy kernel's
