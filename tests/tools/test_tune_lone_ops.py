"""fuser.tools.tune_lone_ops and benchmarks/tune_lone_ops.py: every op of the standard set makes one
fuser kernel that runs on its rows; the table written (here on the CPU, with a stand-in for the
CUDA-graph timer, which needs a GPU) is the one fuser.regions.lone_ops reads back; ``fuser tune
--lone-ops`` refuses what it cannot do."""

import importlib.util
import json

import pytest
import torch

from fuser.regions import lone_ops
from fuser.tools import tune_lone_ops as lone
from tests.helpers import ROOT


def stand_in_timer(launches: list):
    """Runs what it is given once (so the kernel really runs on the rows) and says PyTorch's op
    takes 5 µs per launch and fuser's kernel 2 µs."""

    def timer(launch, args):
        outs = launch(*args)
        launches.append((launch.__name__, [a.shape[0] for a in args if a.dim() == 2], outs))
        return 5.0 if launch.__name__ == "torch_op" else 2.0

    return timer


@pytest.mark.parametrize("kind", list(lone.STANDARD_OPS))
def test_each_standard_op_makes_one_kernel_that_runs_at_each_token_count(kind):
    launches = []
    dtype = lone.STANDARD_OPS[kind][0]
    entry = lone.measure(kind, 64, dtype, tokens=(1, 3), device="cpu", timer=stand_in_timer(launches))
    assert (entry["op"], entry["width"], entry["dtype"]) == (kind, 64, dtype)
    assert entry["torch_us"] == {"1": 5.0, "3": 5.0} and entry["fuser_us"] == {"1": 2.0, "3": 2.0}
    assert entry["fused"] is True
    fuser_runs = [rows for name, rows, _ in launches if name != "torch_op"]
    assert fuser_runs == [[1], [3]]  # the kernel's rows input cut to each token count
    # the kernel's output at 3 rows is PyTorch's op on the same rows
    module_out = [outs for name, rows, outs in launches if name != "torch_op"][-1]
    torch_out = [outs for name, rows, outs in launches if name == "torch_op"][-1]
    got = module_out[0] if isinstance(module_out, (tuple, list)) else module_out
    assert got.dtype == torch_out.dtype
    torch.testing.assert_close(got.float(), torch_out.float(), rtol=2**-7, atol=2e-2)


def test_an_unknown_op_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="no lone op 'tanh'; the ops are: layer_norm"):
        lone.measure_all(["tanh"], device="cpu")


def test_the_script_writes_the_table_fuser_reads(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("tune_lone_ops_script", ROOT / "benchmarks" / "tune_lone_ops.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    argv = ["--ops", "layer_norm,gelu", "--widths", "64,96", "--dtypes", "float32", "--tokens", "1,2", "--out", str(tmp_path)]
    path = script.main(argv, timer=stand_in_timer([]), device="cpu", gpu="TEST_GPU")
    assert path == tmp_path / "TEST_GPU-lone_ops.json"
    table = json.loads(path.read_text())
    assert [(e["op"], e["width"]) for e in table["entries"]] == [("gelu", 64), ("gelu", 96), ("layer_norm", 64), ("layer_norm", 96)]
    assert table["tokens"] == [1, 2]
    # a second run merges: a new width joins, the same key is replaced, nothing is lost
    script.main(argv[:3] + ["96,128"] + argv[4:], timer=stand_in_timer([]), device="cpu", gpu="TEST_GPU")
    table = json.loads(path.read_text())
    assert len(table["entries"]) == 6

    monkeypatch.delenv(lone_ops.TABLE_ENV, raising=False)
    monkeypatch.setenv("FUSER_LAUNCH_CONFIGS", str(tmp_path))
    monkeypatch.setattr(lone_ops, "current_gpu", lambda: "TEST_GPU")
    read, found = lone_ops.current_table()
    assert found == path
    assert {w["width"] for w in read[("gelu", "float32")]} == {64, 96, 128}
    assert all(e["fuser_mean_us"] == 2.0 and e["torch_mean_us"] == 5.0 for e in read[("layer_norm", "float32")])


def test_the_script_without_a_gpu_says_so(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")  # the refusal is for machines without one
    spec = importlib.util.spec_from_file_location("tune_lone_ops_script", ROOT / "benchmarks" / "tune_lone_ops.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with pytest.raises(SystemExit, match="no CUDA GPU|there is none here"):
        script.main(["--out", str(tmp_path)])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
@pytest.mark.parametrize("argv", [["tune", "--lone-ops"], ["tune", "--lone-ops", "--ops", "gelu", "--widths", "64", "--json"]])
def test_fuser_tune_lone_ops_takes_no_target_and_needs_a_gpu(argv, capsys):
    from fuser.tools.cli import main

    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and "CUDA GPU" in err  # the options parse; the GPU is what is missing


@pytest.mark.gpu
def test_on_a_gpu_each_side_is_timed_in_a_cuda_graph():
    entry = lone.measure("layer_norm", 2048, "bfloat16", tokens=(1, 16), device="cuda")
    for side in ("torch_us", "fuser_us"):
        assert set(entry[side]) == {"1", "16"} and all(0 < t < 1000 for t in entry[side].values())
