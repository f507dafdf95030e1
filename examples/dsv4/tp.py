"""The DSv4 decoder layer of ``layer.py`` under tensor parallelism, sharded the way sglang shards
DSv4 decode, plus :func:`launch` to run one process per rank.

What each rank holds and computes (``world`` ranks, rank ``r``):

* attention (C): its ``n_heads / world`` query heads, i.e. ``o_groups / world`` output groups
  (``wq_b`` rows, ``attn_sink``, ``wo_a`` rows split by head; ``wo_b`` columns split, so ``wo_b``
  gives a partial sum). The single MQA kv head, its cache and ``wqkv_a`` are replicated.
* routed experts (G3): experts ``[r * E/world, (r+1) * E/world)``. Routing (gate, top-k,
  renormalisation) runs identically on every rank; a rank adds the contributions of its own
  experts only (:class:`LocalExperts`).
* shared expert (G4): ``moe_intermediate_size / world`` of its intermediate dims
  (column-parallel ``gate_up_proj``, row-parallel ``down_proj``): another partial sum.
* the partial sums are summed over ranks by :func:`all_reduce`, an ``@fuser.opaque`` leaf
  (one after the attention, one after the MoE's ``routed + shared``, as sglang's
  ``tensor_model_parallel_all_reduce``). The mHC, norms, RoPE and routing glue run replicated.

``shard(layer, rank, world)`` builds rank ``r``'s layer from a full layer's weights, so its
output can be checked against the single-process layer built from the same seed.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import replace
from datetime import timedelta
from itertools import chain

import torch
import torch.distributed as dist
import torch.nn as nn

import fuser
from examples.dsv4 import layer as dsv4


@fuser.opaque
def all_reduce(x):
    """Sum ``x`` over the default process group, in place (NCCL on CUDA, gloo on the CPU)."""
    dist.all_reduce(x)
    return x


# ---------------------------------------------------------------------------------------------
# Rank-local modules
# ---------------------------------------------------------------------------------------------


def check_divisible(cfg: dsv4.DSV4Config, world: int) -> None:
    sizes = {
        "n_heads": cfg.n_heads,
        "o_groups": cfg.o_groups,
        "n_routed_experts": cfg.n_routed_experts,
        "moe_intermediate_size": cfg.moe_intermediate_size,
    }
    bad = {k: v for k, v in sizes.items() if v % world}
    if bad:
        raise ValueError(f"cannot shard over {world} ranks: {bad} not divisible by {world}")
    if (cfg.moe_intermediate_size // world) % 8:  # torch._grouped_mm's 16-byte aligned bf16 strides
        raise ValueError(f"the shared expert's {cfg.moe_intermediate_size // world} dims per rank are not a multiple of 8")


class TPAttention(dsv4.MQALayer):
    """C on one rank: the MQA layer with ``n_heads / world`` heads, output all-reduced."""

    def __init__(self, cfg: dsv4.DSV4Config, world: int):
        super().__init__(replace(cfg, n_heads=cfg.n_heads // world, o_groups=cfg.o_groups // world))

    def forward(self, x, positions, req_pool_indices):
        return all_reduce(super().forward(x, positions, req_pool_indices))


@fuser.opaque
class LocalExperts(dsv4.GroupedExperts):
    """G3 restricted to this rank's experts ``[first_expert, first_expert + n_experts)``.

    The dispatch of :class:`~examples.dsv4.layer.GroupedExperts`, with every (token, k) pair
    routed to another rank's expert sorted after all local ones: the grouped GEMMs stop at the
    last local expert's end offset and leave those rows unwritten, and they are dropped before
    the scatter (a select, not a multiply by zero: unwritten rows may hold NaN).
    """

    def __init__(self, cfg: dsv4.DSV4Config, rank: int, world: int):
        super().__init__(replace(cfg, n_routed_experts=cfg.n_routed_experts // world))
        self.first_expert = rank * self.n_experts

    def forward(self, x, topk_weights, topk_ids):
        top_k = topk_ids.shape[1]
        local_ids = topk_ids - self.first_expert
        is_local = (local_ids >= 0) & (local_ids < self.n_experts)
        flat_ids = torch.where(is_local, local_ids, self.n_experts).flatten()
        sorted_ids, order = torch.sort(flat_ids, stable=True)
        token_of = order // top_k
        experts = torch.arange(self.n_experts, device=flat_ids.device, dtype=sorted_ids.dtype)
        offs = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)

        x_sorted = x[token_of]
        gate_up = torch._grouped_mm(x_sorted, self.w13_weight.transpose(-2, -1), offs=offs)
        h = dsv4.swiglu_clamp(gate_up, self.inter, self.limit)
        y = torch._grouped_mm(h, self.w2_weight.transpose(-2, -1), offs=offs)

        w_sorted = topk_weights.flatten()[order].unsqueeze(-1)
        kept = (sorted_ids < self.n_experts).unsqueeze(-1)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        out.index_add_(0, token_of, torch.where(kept, y.float() * w_sorted, 0.0))
        return (out * self.routed_scaling_factor).to(x.dtype)


def shared_expert_name(moe: nn.Module) -> str:
    """Where the MoE holds its shared-expert MLP: directly, or inside a wrapper (the side-stream
    leaf)."""
    found = [name for name, m in moe.named_modules() if isinstance(m, dsv4.DeepseekV2MLP)]
    if len(found) != 1:
        raise TypeError(f"expected one DeepseekV2MLP (the shared expert) in {type(moe).__name__}, found {found}")
    return found[0]


class TPMoE(dsv4.DeepseekV2MoE):
    """G on one rank: full routing, local experts, a slice of the shared expert; the sum
    ``routed + shared`` all-reduced."""

    def __init__(self, cfg: dsv4.DSV4Config, rank: int, world: int):
        super().__init__(cfg)
        self.experts = LocalExperts(cfg, rank, world)
        parent, _, attr = shared_expert_name(self).rpartition(".")
        shared = dsv4.DeepseekV2MLP(replace(cfg, moe_intermediate_size=cfg.moe_intermediate_size // world))
        setattr(self.get_submodule(parent), attr, shared)

    def forward(self, x, input_ids):
        return all_reduce(super().forward(x, input_ids))


class TPDecoderLayer(dsv4.DeepseekV4DecoderLayer):
    """One rank's decoder layer: the same forward, with :class:`TPAttention` and :class:`TPMoE`."""

    def __init__(self, cfg: dsv4.DSV4Config, rank: int, world: int):
        check_divisible(cfg, world)
        super().__init__(cfg)
        self.rank, self.world = rank, world
        self.self_attn = TPAttention(cfg, world)
        self.mlp = TPMoE(cfg, rank, world)


# ---------------------------------------------------------------------------------------------
# Sharding a full layer
# ---------------------------------------------------------------------------------------------


def _shard_rules(layer: nn.Module, rank: int, world: int) -> dict:
    """Tensor name -> how rank ``rank``'s tensor is cut from the full one (others are copied)."""

    def part(dim):
        return lambda t: t.chunk(world, dim)[rank]

    def gate_up_rows(t):  # [gate; up] stacked: this rank's rows of each
        gate, up = t.chunk(2, 0)
        return torch.cat([part(0)(gate), part(0)(up)])

    shared = f"mlp.{shared_expert_name(layer.mlp)}"
    return {
        "self_attn.wq_b.weight": part(0),  # heads
        "self_attn.attn_sink": part(0),
        "self_attn.wo_a.weight": part(0),  # output groups, each a contiguous run of heads
        "self_attn.wo_b.weight": part(1),  # row-parallel: partial sums
        "mlp.experts.w13_weight": part(0),  # experts
        "mlp.experts.w2_weight": part(0),
        f"{shared}.gate_up_proj.weight": gate_up_rows,  # column-parallel
        f"{shared}.down_proj.weight": part(1),  # row-parallel: partial sums
    }


def shard(layer: dsv4.DeepseekV4DecoderLayer, rank: int, world: int) -> TPDecoderLayer:
    """Rank ``rank``'s layer (eval, no grad), on ``layer``'s device, cut from the full layer's
    parameters and buffers (the kv cache is replicated)."""
    device = next(layer.parameters()).device
    with torch.device("meta"):  # nothing allocated until to_empty
        rank_layer = TPDecoderLayer(layer.cfg, rank, world)
    rank_layer = rank_layer.to_empty(device=device).eval().requires_grad_(False)
    rules = _shard_rules(layer, rank, world)
    full = dict(chain(layer.named_parameters(), layer.named_buffers()))
    with torch.no_grad():
        for name, t in chain(rank_layer.named_parameters(), rank_layer.named_buffers()):
            source = rules.get(name, lambda x: x)(full[name])
            if source.shape != t.shape:
                raise ValueError(f"{name}: rank {rank} of {world} has {tuple(t.shape)}, cut {tuple(source.shape)}")
            t.copy_(source)
    return rank_layer


# ---------------------------------------------------------------------------------------------
# One process per rank
# ---------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_rank(rank, worker, world, backend, port, timeout_s, args):
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # no NVLink multicast (NVLS); NCCL's other defaults stay
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    worker(rank, world, *args)
    dist.destroy_process_group()  # not after a failure: NCCL may wait there for the other ranks


def launch(worker, world: int, args: tuple = (), *, backend: str | None = None, timeout_s: float = 600) -> None:
    """Run ``worker(rank, world, *args)`` in ``world`` spawned processes joined in one process
    group (NCCL with one GPU per rank when CUDA is there, else gloo).

    A failure in any rank is raised here with that rank's traceback (the other ranks are
    terminated); ranks still running after ``timeout_s`` are killed and TimeoutError raised.
    ``worker`` must be importable by name (a module-level function).
    """
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise RuntimeError(f"{world} ranks need {world} CUDA devices, found {torch.cuda.device_count()}")
    context = torch.multiprocessing.start_processes(
        _run_rank,
        args=(worker, world, backend, free_port(), timeout_s, args),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"{world} ranks of {getattr(worker, '__name__', worker)} still running after {timeout_s:.0f} s")
