"""validation: each kernel against eager, on the values of one eager run of the module.

:func:`record_values` runs the traced graph once and keeps every node's value (and what
in-place writes left); :func:`validate` launches a kernel on its region's recorded inputs and
compares its outputs with the recorded ones, within the tolerance of the least precise dtype
involved (:mod:`fuser.validate.tolerance`). Where eager's own choice is arbitrary, the comparison
follows it rather than failing: the order of an unsorted top-k, ties an unstable sort puts in
either order, rows whose top-k picks between near-equal scores.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.fx as fx

from fuser.canon.canonicalize import COMPUTE, HEAVY, MUTATION, UNIT_VIEW
from fuser.codegen.kernel import Kernel
from fuser.regions.builder import Region
from fuser.validate.tolerance import least_precise, mismatch, near_tie_rows, rows_besides_ties
from fuser.trace.tracing import Traced, preserved_state


class Recorded(dict):
    """Every node's eager value (``record_values``), and what in-place writes left in the
    tensors they wrote: ``written[target]`` lists (graph position, value after the write)."""

    def __init__(self, order: dict[fx.Node, int]):
        super().__init__()
        self.order = order  # node -> its position in the graph
        self.written: dict[fx.Node, list[tuple[int, torch.Tensor]]] = {}

    def inputs_of(self, region: Region) -> list:
        """The region's inputs as its kernel reads them: after the in-place writes that run
        before it (``inv[perm] = arange(n)`` fills the ``empty_like`` a later gather reads).
        A region with no place in the program yet reads them as recorded."""
        at = self.order.get(region.position, -1)
        return [next((v for i, v in reversed(self.written.get(n, [])) if i < at), self[n]) for n in region.inputs]


def record_values(module: torch.nn.Module, traced: Traced, cops: dict) -> Recorded:
    """Every node's eager value on the example inputs, cloned when produced (before any write);
    parameters as they are (the forward never writes them, and experts' weights are large)."""
    values = Recorded({n: i for i, n in enumerate(traced.graph.nodes)})

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            cop = cops.get(n)
            # A leaf may write what it is given (a custom op's out, a kernel launch's output):
            # its tensor operands as they were, to tell what it wrote.
            given = _leaf_operands(n, self.env) if cop is not None and cop.kind == HEAVY else {}
            before = {a: t.clone() for a, t in given.items()}
            result = super().run_node(n)
            fresh = isinstance(result, torch.Tensor) and not isinstance(result, torch.nn.Parameter)
            values[n] = result.clone() if fresh else result
            target = cop.args[0] if cop is not None and cop.kind == MUTATION and cop.args else None
            if isinstance(self.env.get(target), torch.Tensor):  # an in-place write to its first operand
                values.written.setdefault(target, []).append((values.order[n], self.env[target].clone()))
            for a, t in given.items():
                if not torch.equal(t, before[a]):
                    values.written.setdefault(a, []).append((values.order[n], t.clone()))
            return result

    gm = traced.graph_module(module)
    with preserved_state(module, traced.example_inputs), torch.no_grad():
        Recorder(gm).run(*traced.fresh_inputs())
    return values


def _leaf_operands(node: fx.Node, env: dict) -> dict[fx.Node, torch.Tensor]:
    """A leaf's tensor operands that it could write: not parameters (a forward never writes
    its weights)."""
    return {
        a: env[a]
        for a in node.all_input_nodes
        if isinstance(env.get(a), torch.Tensor) and not isinstance(env[a], torch.nn.Parameter)
    }


def store_targets(region: Region, values) -> list:
    """Where a kernel's in-place outputs go, given every node's recorded value: a copy of each
    target as it was before the write, indexed as the write indexes it."""
    return [values[s.args[0]].clone()[s.args[1]] for s in region.stores.values()]


def _unordered_topk(kernel: Kernel, cops, got: list, expected: list) -> tuple[list, list]:
    """``torch.topk(..., sorted=False)`` leaves the order of its k picks unspecified, so the
    kernel and eager may list the same picks in different orders. When the chain has such a
    top-k, its [..., k] outputs are compared in a canonical order (:func:`_topk_order`)."""
    region = kernel.region
    ks = _unsorted_topk_sizes(cops[n] for n in region.nodes)
    index = next((i for i, n in enumerate(region.outputs) if cops[n].op == "topk_indices"), None)
    return _topk_order(got, ks, index), _topk_order(expected, ks, index)


def _unsorted_topk_sizes(cops) -> set[int]:
    """The k of every lowered ``topk(sorted=False)`` among ``cops``."""
    return {c.attr("k") for c in cops if c.op == "topk" and c.kind == COMPUTE and not c.attr("sorted")}


def _topk_order(values: list, ks: set, index: int | None) -> list:
    """Each [..., k] tensor (k in ``ks``) of ``values`` in a canonical order per row: the order
    that sorts ``values[index]`` (the top-k indices) when given, else its own sorted order."""
    if not ks:
        return values
    order = values[index].argsort(-1) if index is not None else None
    result = []
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[-1] in ks:
            same = order is not None and order.shape == value.shape
            value = value.take_along_dim(order, -1) if same else value.sort(-1).values
        result.append(value)
    return result


def unordered_outputs(traced: Traced, cops, got, expected):
    """The module's outputs with the picks of a ``topk(sorted=False)`` in a canonical order
    (see :func:`_unordered_topk`): the fused forward may list them in another valid order."""
    ks = _unsorted_topk_sizes(cops.values())
    if not ks:
        return got, expected
    output = next(n for n in traced.graph.nodes if n.op == "output").args[0]
    nodes = list(output) if isinstance(output, (tuple, list)) else [output]

    def source(n):
        while isinstance(n, fx.Node) and cops.get(n) is not None and (cops[n].op == "identity" or cops[n].kind == UNIT_VIEW):
            if cops[n].op == "topk_indices":
                return n
            n = cops[n].args[0]
        return n

    index = next((i for i, n in enumerate(nodes) if cops.get(source(n)) and cops[source(n)].op == "topk_indices"), None)
    single = not isinstance(got, (tuple, list))
    got, expected = ([got], [expected]) if single else (list(got), list(expected))
    got, expected = _topk_order(got, ks, index), _topk_order(expected, ks, index)
    return (got[0], expected[0]) if single else (got, expected)


def _unstable_sort_ties(region: Region, cops, values, got: list, expected: list) -> tuple[list, list]:
    """``torch.sort(stable=False)`` may order equal keys either way, so the kernel and eager may
    give different permutations for the same sort. A permutation output of such a sort is
    compared with each run of equal sorted keys in ascending order (:func:`_tie_order`); the
    inverse of one (:func:`fuser.trace.in_place_idioms.inverse_permutation`) as the inverse of that; rows
    gathered through one (``hidden[perm // k]``) in the order its entries were put in."""
    got, expected = list(got), list(expected)
    orders: dict[fx.Node, list] = {}  # a permutation node -> the reorder of (got, expected)
    for i, node in enumerate(region.outputs):
        cop = cops[node]
        inverse = cop.op == "inverse_permutation"
        sort = _unstable_sort(cops[cop.args[0]] if inverse else cop, cops)
        if sort is None or not isinstance(got[i], torch.Tensor):
            continue
        if inverse and (_inverted(got[i]) is None or _inverted(expected[i]) is None):
            continue  # not a permutation: compared as it is
        pair = [_inverted(got[i]), _inverted(expected[i])] if inverse else [got[i], expected[i]]
        dim = sort.attr("dim")
        keys = values[sort.args[0]].take_along_dim(pair[1], dim)  # the sorted keys, as eager has them
        order = [_tie_order(p, keys, dim) for p in pair]
        pair = [p.take_along_dim(o, dim) for p, o in zip(pair, order)]
        got[i], expected[i] = [_inverted(p) for p in pair] if inverse else pair
        if not inverse and pair[0].dim() == 1:
            orders[node] = order
    for i, node in enumerate(region.outputs):
        perm = _gathered_through(cops[node], cops)
        if perm in orders and isinstance(got[i], torch.Tensor):
            got[i], expected[i] = (v[o] for v, o in zip((got[i], expected[i]), orders[perm]))
    return got, expected


def _gathered_through(cop, cops) -> fx.Node | None:
    """The permutation whose entries (or their quotients, ``perm // k``) pick the rows that
    ``cop`` gathers, or None."""
    if cop.op != "gather_rows":
        return None
    index = cop.args[1]
    while isinstance(index, fx.Node) and cops[index].op == "floordiv" and not isinstance(cops[index].args[1], fx.Node):
        index = cops[index].args[0]
    return index if isinstance(index, fx.Node) else None


def _unstable_sort(cop, cops):
    """The ``torch.sort(stable=False)`` whose permutation ``cop`` picks, or None."""
    sort = cops.get(cop.args[0]) if cop.op == "element" and cop.attr("part") == 1 else None
    return sort if sort is not None and sort.op == "sort" and not sort.attr("stable") else None


def _inverted(perm: torch.Tensor) -> torch.Tensor | None:
    """The inverse of a 1-D permutation of 0 .. n-1, or None when ``perm`` is not one."""
    if perm.dim() != 1 or not torch.equal(perm.sort().values, torch.arange(perm.shape[0], device=perm.device)):
        return None
    return torch.argsort(perm)


def _tie_order(perm: torch.Tensor, keys: torch.Tensor, dim: int) -> torch.Tensor:
    """The reorder along ``dim`` that sorts the entries of ``perm`` under each run of equal
    ``keys``: it makes every permutation that sorts the keys the stable one; any other stays
    different from it."""
    if perm.shape != keys.shape or perm.dtype != torch.int64 or perm.shape[dim] < 2:
        shape = [1] * perm.dim()
        shape[dim] = -1
        return torch.arange(perm.shape[dim], device=perm.device).view(shape).expand_as(perm)  # as it is
    p, k = perm.movedim(dim, -1), keys.movedim(dim, -1)
    run = torch.cat([torch.zeros_like(p[..., :1]), (k[..., 1:] != k[..., :-1]).long().cumsum(-1)], -1)
    return torch.argsort(run * p.shape[-1] + p, dim=-1, stable=True).movedim(-1, dim)


# Triton's CPU interpreter swaps triton.language functions in and out around every launch,
# so two threads must not run interpreted kernels at once (compiled GPU kernels may). Reentrant:
# a fused forward may run inside another's (a model's, whose layers are fused) or inside validation.
INTERPRETER_LOCK = threading.RLock()

#: Kernels validated at once on a GPU (:func:`validate_all`).
COMPILE_THREADS = max(1, min(16, os.cpu_count() or 1))


def validate_all(kernels: list[Kernel], values, cops) -> list[str | None]:
    """:func:`validate` of each kernel, side by side on a GPU: most of a Triton compile (LLVM,
    ptxas) runs outside the GIL, and a model's first fuse is mostly compiles. Each thread launches
    on the caller's device and stream, with its inference mode."""
    if len(kernels) < 2 or os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_initialized():
        return [validate(kernel, values, cops) for kernel in kernels]
    device, stream, inference = torch.cuda.current_device(), torch.cuda.current_stream(), torch.is_inference_mode_enabled()

    def one(kernel: Kernel) -> str | None:
        with torch.cuda.device(device), torch.cuda.stream(stream), torch.inference_mode(inference):
            return validate(kernel, values, cops)

    with ThreadPoolExecutor(min(len(kernels), COMPILE_THREADS)) as pool:
        return list(pool.map(one, kernels))


def validate(kernel: Kernel, values, cops) -> str | None:
    """What is wrong with the kernel's outputs on the recorded values, or None. A kernel that
    chooses its tile width at launch is run at every width it may choose."""
    spec = kernel.spec
    widths = spec.program.widths if spec is not None and spec.tile_at_launch else (None,)
    for width in widths:
        problem = _validate_launch(kernel, values, cops, {} if width is None else {"block_tile": width})
        if problem:
            return problem if width is None else f"{problem} (at a tile of {width})"
    return None


def _validate_launch(kernel: Kernel, values, cops, launch_options: dict) -> str | None:
    region = kernel.region
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    targets = store_targets(region, values)
    try:
        with torch.no_grad(), INTERPRETER_LOCK if interpreted else contextlib.nullcontext():
            got = kernel.launch(*values.inputs_of(region), *targets, **launch_options)
    except Exception as e:  # noqa: BLE001 - a kernel that fails to compile or run stays unspliced
        first = str(e).strip().splitlines()[-1] if str(e).strip() else ""
        return f"kernel {kernel.path.name} failed: {type(e).__name__}: {first}"
    precision = least_precise(
        v.dtype for v in (values[n] for n in list(region.inputs) + list(region.nodes)) if isinstance(v, torch.Tensor)
    )
    expected_values = [values[n] for n in region.outputs]
    got, expected_values = _unordered_topk(kernel, cops, list(got), expected_values)
    got, expected_values = _unstable_sort_ties(region, cops, values, got, expected_values)
    tied, rows = _tied_rows(region, values, cops)
    kept = rows_besides_ties(tied, rows)  # either pick of a near tie is right
    for node, actual, expected in zip(region.outputs, got, expected_values):
        coarsest = least_precise([precision, expected.dtype]) if isinstance(expected, torch.Tensor) else None
        problem = mismatch(actual, expected, f"`{node.name}`", tol_dtype=coarsest)
        if problem and kept and isinstance(expected, torch.Tensor) and expected.dim() and expected.shape[0] == rows:
            problem = mismatch(actual[kept], expected[kept], f"`{node.name}` without rows {sorted(tied)}", tol_dtype=coarsest)
        if problem and not _near_tie(node, actual, expected, values, cops, coarsest):
            return problem
    return None


def _tied_rows(region: Region, values, cops) -> tuple[set[int], int]:
    """The rows where a top-k of the chain picks between near-equal scores
    (:func:`fuser.validate.tolerance.near_tie_rows`), and the row count (none when the chain's top-k
    have different row counts)."""
    tied, rows = set(), set()
    for node in region.nodes:
        cop = cops[node]
        scores = values[cop.args[0]] if cop.op == "topk" and cop.kind == COMPUTE else None
        if isinstance(scores, torch.Tensor) and scores.dim() >= 2:
            rows.add(scores.shape[0])
            tied |= near_tie_rows(scores, cop.attr("k"), cop.attr("largest"))
    return (tied, rows.pop()) if len(rows) == 1 else (set(), 0)


def _near_tie(node: fx.Node, actual, expected, values, cops, dtype) -> bool:
    """Top-k indices that differ only where the scores they pick are equal within tolerance:
    the kernel rounds the scores in another order than eager, so of two near-equal scores it
    may pick the other one — as any other kernel for the same math would. Their values (and
    what is computed from them) are still compared as usual."""
    cop = cops.get(node)
    if cop is None or cop.op != "topk_indices" or not isinstance(actual, torch.Tensor):
        return False
    scores = values[cops[cop.args[0]].args[0]]
    picked = scores.gather(-1, actual.long()).sort(-1).values
    wanted = scores.gather(-1, expected.long()).sort(-1).values
    return mismatch(picked, wanted, f"`{node.name}` scores", tol_dtype=dtype) is None
