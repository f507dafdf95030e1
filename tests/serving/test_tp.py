"""The DSv4 layer under tensor parallelism (examples/dsv4/tp.py), one process per rank.

On the CPU (CI): 2 processes, gloo, the tiny layer. Each rank shards the full layer built from the
same seed; its eager TP output must match the full single-process layer, and so must the output
of the TP layer fused by fuser, with ``all_reduce`` kept as a leaf. A failure inside a rank is
raised here with that rank's traceback (``tp.launch``).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

import fuser
from examples.dsv4 import layer as dsv4
from examples.dsv4 import tp
from examples.dsv4.compare import compare_routed, layer_errors, run_with_expert_ids
from fuser.install.splice import STATE_ATTR

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORLD = 2


def _matches_full(output, ids, expected, expected_ids, what):
    comparison = compare_routed(output, expected, expected_ids, ids, what, reference="full")
    assert comparison.ok, comparison.entry


def _tiny_tp_rank(rank, world):
    """One rank: eager TP and fused TP against the full layer, at the apply size and another."""
    full, inputs = dsv4.tiny(T=2)
    layer = tp.shard(full, rank, world)
    expected, expected_ids = run_with_expert_ids(full, inputs)
    got, ids = run_with_expert_ids(layer, inputs)
    _matches_full(got, ids, expected, expected_ids, f"rank {rank}: eager TP vs full")
    # The kv path is replicated, not sharded: the same keys land in the same slots.
    assert torch.equal(layer.self_attn.attn.keys(), full.self_attn.attn.keys()), f"rank {rank}: kv cache"

    plan = fuser.pipeline.fuse_module.apply_plan(layer, inputs)
    reductions = [n for n in plan.graph.nodes if n.op == "call_function" and n.target is tp.all_reduce]
    assert len(reductions) == 2, f"rank {rank}: expected all_reduce as 2 leaf calls, got\n{plan.graph}"
    assert plan.report.launches_after * 5 <= plan.report.launches_before, plan.report.text()
    assert not [r for r in plan.report.rejected if r.category == "validation"], plan.report.text()

    for T in (2, 5):  # one trace serves every token count
        full_T, inputs_T = dsv4.tiny(T=T)
        with torch.no_grad():  # earlier calls wrote other slots of the TP layer's cache
            layer.self_attn.attn.load_state_dict(full_T.self_attn.attn.state_dict())
        assert layer.__dict__[STATE_ATTR].guard.why_not(inputs_T, {}) is None, "the fused path must run"
        expected, expected_ids = run_with_expert_ids(full_T, inputs_T)
        got, ids = run_with_expert_ids(layer, inputs_T)
        _matches_full(got, ids, expected, expected_ids, f"rank {rank}: fused TP vs full at T={T}")


def test_tiny_tp_matches_full_layer_eager_and_fused():
    tp.launch(_tiny_tp_rank, WORLD, backend="gloo", timeout_s=300)


def test_shard_cuts_every_sharded_tensor():
    full, _ = dsv4.tiny(T=1)
    ranks = [tp.shard(full, r, WORLD) for r in range(WORLD)]
    full_params = dict(full.named_parameters())
    for name, p in ranks[0].named_parameters():
        if p.shape == full_params[name].shape:
            assert all(torch.equal(r.get_parameter(name), full_params[name]) for r in ranks), name
        else:  # the ranks' parts together hold exactly the full tensor's elements
            parts = torch.cat([r.get_parameter(name).flatten() for r in ranks])
            assert parts.numel() == full_params[name].numel(), name
            assert torch.equal(parts.sort().values, full_params[name].flatten().sort().values), name
    assert ranks[1].mlp.experts.first_expert == full.cfg.n_routed_experts // WORLD


@pytest.mark.parametrize("factory", [dsv4.tiny, dsv4.tiny_hash], ids=["tiny", "tiny_hash"])
def test_rank_partial_sums_add_up_to_the_full_blocks(factory):
    """Without the all-reduce (the parent class's forward), the ranks' attention and MoE outputs
    are partial sums of the full blocks': equal up to the bf16 rounding of each partial."""
    full, (_, positions, req_pool_indices, input_ids) = factory(T=5)
    ranks = [tp.shard(full, r, WORLD) for r in range(WORLD)]
    x = torch.randn(5, full.cfg.hidden_size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        blocks = {
            "attention": (
                full.self_attn(x, positions, req_pool_indices),
                [dsv4.MQALayer.forward(r.self_attn, x, positions, req_pool_indices) for r in ranks],
            ),
            "moe": (full.mlp(x, input_ids), [dsv4.DeepseekV2MoE.forward(r.mlp, x, input_ids) for r in ranks]),
        }
    for name, (expected, partials) in blocks.items():
        errors = layer_errors(sum(p.float() for p in partials), expected)
        assert errors["normwise"] < 2**-7 and errors["max"] < 2**-6, (name, errors)


@pytest.mark.gpu
def test_tp_benchmark_captures_and_replays_on_two_gpus(tmp_path):
    """Needs 2 CUDA GPUs on one host (run with ``pytest -m gpu tests/serving/test_tp.py`` there).

    Runs ``benchmarks/tp_dsv4.py --config tiny`` over sglang's batch sizes: NCCL, one process
    per GPU, each rank fuses its shard and captures it with fuser.tools.capture; every size must
    capture, with no Triton compile during capture, and every replay must match eager TP and
    the full layer.
    """
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} CUDA GPUs on one host, found {torch.cuda.device_count()}")
    out = tmp_path / "tp_dsv4_tiny.json"
    env = dict(os.environ, PYTHONPATH=ROOT)
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks/tp_dsv4.py"), "--config", "tiny", "--world", str(WORLD), "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-8000:]
    record = json.loads(out.read_text())
    assert record["capture"] and record["ok"], json.dumps(record, indent=2)[:8000]
    for rank in record["ranks"]:
        assert not rank["failed"] and rank["compiles_during_capture"] == 0, rank
