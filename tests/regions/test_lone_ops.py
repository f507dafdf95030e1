"""fuser.regions.lone_ops: one op alone between two GEMMs (a LayerNorm, a GELU, a softmax) gets a
kernel of its own by the lone-op table of the device, else by the default (a normalization is
fused, an elementwise op left to PyTorch); the fused result matches eager in each dtype, and the
report names the decision."""

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fuser
from fuser.regions import lone_ops
from fuser.regions.lone_ops import LoneOpTableError, TABLE_ENV, nearest
from tests.helpers import fused_call, gen, randn

D_IN, WIDTH, D_OUT, T = 32, 48, 16, 5
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: dtype -> (rtol, atol): the lone op's own output (one kernel against PyTorch's op) and the
#: output of the GEMM after it (a one-ulp difference summed over WIDTH products)
OP_TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2**-7, 1e-2), torch.float16: (2e-3, 1e-3)}
GEMM_TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2**-6, 5e-2), torch.float16: (4e-3, 5e-3)}


class Lone(nn.Module):
    """``down(op(up(x)))``: the op reads a GEMM's result and feeds another, so nothing can share
    its kernel; its own result is returned too."""

    def __init__(self, op: str, dtype: torch.dtype):
        super().__init__()
        torch.manual_seed(0)
        self.op = op
        self.up = nn.Linear(D_IN, WIDTH, dtype=dtype)
        self.norm = nn.LayerNorm(WIDTH, dtype=dtype)
        with torch.no_grad():
            self.norm.weight.copy_(1.0 + 0.1 * torch.randn(WIDTH))
            self.norm.bias.copy_(0.1 * torch.randn(WIDTH))
        self.down = nn.Linear(WIDTH, D_OUT, dtype=dtype)

    def forward(self, x):
        h = self.up(x)
        if self.op == "layer_norm":
            y = self.norm(h)
        elif self.op == "gelu":
            y = F.gelu(h)
        else:
            y = torch.softmax(h, dim=-1)
        return y, self.down(y)


def fused(op: str, dtype: torch.dtype):
    """(report, the fused outputs, eager's) of :class:`Lone` on one example."""
    module = Lone(op, dtype)
    x = randn(gen(1), T, D_IN, dtype=dtype, scale=2.0)
    with torch.no_grad():
        expected = module(x)
    report = fuser.apply(module, (x,))
    try:
        got = fused_call(module, x)
    finally:
        fuser.restore(module)
    return report, got, expected


def decision(report, op: str) -> tuple[bool, str]:
    """(whether ``op``'s node is in a kernel, the reason the report gives)."""
    for chain in report.chains:
        if op in chain.nodes:
            return True, chain.note
    for u in report.unfused:
        if u.node == op:
            return False, u.reason
    raise AssertionError(f"{op} is neither fused nor left eager in the report:\n{report.text()}")


def assert_matches(got, expected, dtype):
    for (a, e), tol in zip(zip(got, expected), (OP_TOLERANCE[dtype], GEMM_TOLERANCE[dtype])):
        assert a.dtype == e.dtype and a.shape == e.shape
        rtol, atol = tol
        torch.testing.assert_close(a.float(), e.float(), rtol=rtol, atol=atol)


def write_table(path, entries):
    path.write_text(json.dumps({"gpu": "test", "entries": entries}))
    return path


def entry(op, dtype, width, torch_us, fuser_us):
    return {"op": op, "dtype": dtype, "width": width,
            "torch_us": {"1": torch_us, "16": torch_us}, "fuser_us": {"1": fuser_us, "16": fuser_us}}  # fmt: skip


@pytest.fixture(autouse=True)
def no_table(monkeypatch):
    """No table unless a test names one (this machine's GPU, if any, has its own)."""
    monkeypatch.delenv(TABLE_ENV, raising=False)
    monkeypatch.setattr(lone_ops, "current_gpu", lambda: None)


# --- the default --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["layer_norm", "softmax"])
def test_a_lone_normalization_is_fused_by_default_and_matches_eager(op, dtype):
    report, got, expected = fused(op, dtype)
    in_kernel, why = decision(report, op)
    assert in_kernel, report.text()
    assert why.startswith("alone: fused by default") and "no entry" in why
    assert why in report.text()
    assert_matches(got, expected, dtype)


def test_a_lone_gelu_is_left_to_pytorch_by_default():
    report, got, expected = fused("gelu", torch.float32)
    in_kernel, why = decision(report, "gelu")
    assert not in_kernel
    assert why.startswith("alone: left to PyTorch by default (gelu, width 48, float32")
    assert why in report.text()
    assert report.launches_after == report.launches_before  # 2 bias adds are in the GEMMs: the gelu alone
    assert_matches(got, expected, torch.float32)


# --- a table ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_table_that_says_faster_fuses_a_lone_gelu(tmp_path, monkeypatch, dtype):
    name = str(dtype).removeprefix("torch.")
    table = write_table(tmp_path / "lone.json", [entry("gelu", name, 64, 6.0, 2.5)])
    monkeypatch.setenv(TABLE_ENV, str(table))
    report, got, expected = fused("gelu", dtype)
    in_kernel, why = decision(report, "gelu")
    assert in_kernel, report.text()
    assert why == (f"alone: fused, the table says 2.5 µs vs PyTorch's 6.0 µs (gelu, width 48, {name}; "
                   "measured at width 64, lone.json)")  # fmt: skip
    assert why in report.text()
    assert_matches(got, expected, dtype)


def test_a_table_that_says_slower_leaves_a_lone_layer_norm_to_pytorch(tmp_path, monkeypatch):
    table = write_table(tmp_path / "lone.json", [entry("layer_norm", "float32", 32, 3.0, 4.0)])
    monkeypatch.setenv(TABLE_ENV, str(table))
    report, got, expected = fused("layer_norm", torch.float32)
    in_kernel, why = decision(report, "layer_norm")
    assert not in_kernel
    assert why.startswith("alone: left to PyTorch, the table says 4.0 µs vs PyTorch's 3.0 µs (layer_norm, width 48")
    assert_matches(got, expected, torch.float32)


def test_an_op_the_table_does_not_hold_follows_the_default(tmp_path, monkeypatch):
    # entries of another dtype and of a width more than twice away: neither applies
    table = write_table(tmp_path / "lone.json", [entry("softmax", "bfloat16", 48, 1.0, 9.0),
                                                 entry("softmax", "float32", 4096, 1.0, 9.0)])  # fmt: skip
    monkeypatch.setenv(TABLE_ENV, str(table))
    report, _, _ = fused("softmax", torch.float32)
    in_kernel, why = decision(report, "softmax")
    assert in_kernel and why.startswith("alone: fused by default (softmax, width 48, float32: no entry in lone.json)")


class CacheCast(nn.Module):
    """GPT-J's attention: the whole key cache ``[batch, heads, cached, head_dim]`` cast to fp32
    alone between the cache write and the scores' matmul (one token per sequence)."""

    def forward(self, q, keys):
        return torch.matmul(q.float(), keys.float().transpose(-1, -2))


def test_a_lone_op_is_judged_at_the_width_of_one_token_s_row_not_its_last_axis(tmp_path, monkeypatch):
    """The table's kernels run one program a token over a row of its width; a cast of a key
    cache is heads × cached × head_dim a token, far beyond the 16-wide entry that its last axis
    would read (on an H100 that entry's kernel took 3.3x PyTorch's time on GPT-J's cache). With
    ``upcast_in_gemm`` off: on, it drops both casts (tests/pipeline/test_upcast_in_gemm.py)."""
    table = write_table(tmp_path / "lone.json", [entry("cast_to_float32", "bfloat16", 16, 6.0, 1.0),
                                                 entry("cast_to_float32", "bfloat16", 48, 6.0, 1.0)])  # fmt: skip
    monkeypatch.setenv(TABLE_ENV, str(table))
    q = randn(gen(2), 3, 4, 1, 16, dtype=torch.bfloat16)
    keys = randn(gen(3), 3, 4, 24, 16, dtype=torch.bfloat16)
    report = fuser.explain(CacheCast(), (q, keys), disable_passes=("upcast_in_gemm",))
    notes = {u.node: u.reason for u in report.unfused} | {n: c.note for c in report.chains for n in c.nodes}
    assert notes["float_2"].startswith("alone: left to PyTorch by default (cast_to_float32, width 1536, bfloat16"), report.text()
    assert notes["float_1"].startswith("alone: fused, the table says 1.0 µs vs PyTorch's 6.0 µs (cast_to_float32, width 64"), report.text()


def test_the_gpu_s_table_is_read_from_the_launch_table_directories(tmp_path, monkeypatch):
    write_table(tmp_path / "TEST_GPU-lone_ops.json", [entry("gelu", "float32", 48, 6.0, 2.0)])
    monkeypatch.setenv("FUSER_LAUNCH_CONFIGS", str(tmp_path))
    monkeypatch.setattr(lone_ops, "current_gpu", lambda: "TEST_GPU")
    assert lone_ops.table_path() == tmp_path / "TEST_GPU-lone_ops.json"
    table, _ = lone_ops.current_table()
    (found,) = table[("gelu", "float32")]
    assert (found["torch_mean_us"], found["fuser_mean_us"]) == (6.0, 2.0)


def test_the_nearest_width_within_a_factor_of_two_applies():
    entries = [{"width": w} for w in (64, 128, 4096)]
    assert nearest(entries, 96)["width"] == 128  # nearer on a log scale (4/3 against 3/2)
    assert nearest(entries, 70)["width"] == 64
    assert nearest(entries, 2048)["width"] == 4096
    assert nearest(entries, 1024) is None  # 4x from 4096, 8x from 128
    assert nearest([], 64) is None


@pytest.mark.parametrize(
    "text, says",
    [
        ("not json", "lone.json"),
        ('{"no": "entries"}', 'no "entries" list'),
        ('{"entries": [{"op": "gelu", "dtype": "float32", "width": 0, "torch_us": {"1": 1}, "fuser_us": {"1": 1}}]}', "entry 0"),
        ('{"entries": [{"op": "gelu", "dtype": "float32", "width": 64, "torch_us": {}, "fuser_us": {"1": 1}}]}', "entry 0"),
    ],
)
def test_a_bad_table_is_an_error_naming_the_file(tmp_path, monkeypatch, text, says):
    path = tmp_path / "lone.json"
    path.write_text(text)
    monkeypatch.setenv(TABLE_ENV, str(path))
    with pytest.raises(LoneOpTableError, match=says) as error:
        lone_ops.current_table()
    assert str(path) in str(error.value)


def test_a_table_variable_naming_no_file_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv(TABLE_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(LoneOpTableError, match="missing.json, which is not a file"):
        lone_ops.table_path()


# --- a model's final norm -----------------------------------------------------------------------
def test_a_model_s_final_layer_norm_is_fused_alone():
    """GPT-NeoX's final LayerNorm is one op (its kernel saves no launch, only time): fused by
    the same decision as a lone op inside a layer, and the logits match eager."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(hidden_size=48, num_attention_heads=4, intermediate_size=96, num_hidden_layers=2,
                           use_parallel_residual=True, vocab_size=64)  # fmt: skip
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(config).eval()
    call = dict(input_ids=torch.randint(0, 64, (3, 1), generator=gen(4)), use_cache=False)
    with torch.no_grad():
        expected = model(**call).logits
    report = fuser.apply(model, (), example_kwargs=call)
    try:
        final = report.others["gpt_neox.final_layer_norm"]
        (chain,) = final.chains
        assert chain.note.startswith("alone: fused by default (layer_norm, width 48, float32")
        with torch.no_grad():
            got = model(**call).logits
    finally:
        fuser.restore(model)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
