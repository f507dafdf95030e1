"""api: the pipeline end to end — trace, match, emit, validate, splice — and check().

    fused = fuser.apply(module, example_inputs)   # in place; returns the report
    fuser.restore(module)                         # undo
    report = fuser.explain(module, example_inputs)  # what apply would do, nothing installed
    result = fuser.check(module, example_inputs)    # fused vs eager, outputs and buffers
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx

from fuser.canon import COMPUTE, HEAVY, INPUT, MUTATION, REDUCING, UNIT_VIEW, UNSUPPORTED, VIEW, canonicalize, eager_launches, is_glue
from fuser.copies import copy_kernels, install_copies, report_copies
from fuser.emit import KernelSpec, emit, template_names
from fuser.lower import LoweringError, lower_region, operand
from fuser.match import Rejection, match_all
from fuser.pattern import load_patterns
from fuser.regions import PARAM_TEMPLATES, Region, RegionBuilder, feeds, fusible, merged, siblings, stored_in_place, widened
from fuser.report import FusedChain, Rejected, Report, Unfused
from fuser.splice import (
    AlreadyFused, Guard, Precomputed, compile_forward, install, is_fused, module_lock, precomputation, restore, rewrite_graph,
)
from fuser.tolerance import LAYER, least_precise, mismatch, near_tie_rows, rows_besides_ties
from fuser.signature import CallSpec, state_tensors, with_state_copied
from fuser.trace import Traced, batch_dims_of, preserved_state, trace


class FuserError(Exception):
    """fuser could not fuse the module; the module is left exactly as it was."""


@dataclass
class Kernel:
    region: Region
    path: Any
    launch: Callable
    spec: KernelSpec | None = None
    parts: list["Kernel"] = field(default_factory=list)  # the kernels it replaced (merged, or stored in place)


@dataclass
class Plan:
    traced: Traced
    kernels: list[Kernel]
    graph: fx.Graph
    forward: Callable
    guard: Guard
    report: Report
    constants: dict = field(default_factory=dict)  # attribute name -> value computed from parameters
    cops: dict = field(default_factory=dict)  # node -> its canonical op
    # (node, argument position, attribute) of leaf-call arguments the fused graph reads from the
    # module at run time rather than as the literal traced (fuser.model: a layer's index)
    read_at_run_time: list = field(default_factory=list)
    precomputed: Precomputed | None = None  # how to recompute ``constants`` when their parameters change
    literals: dict = field(default_factory=dict)  # module scalar attribute (dotted path) -> value fused in


def kernel_spec(region: Region, traced: Traced, cops) -> KernelSpec:
    if region.template in PARAM_TEMPLATES:
        inputs = [operand(traced, n, f"in{i}") for i, n in enumerate(region.inputs)]
        names = region.match.output_names or [f"out{i}" for i in range(len(region.outputs))]
        outputs = [operand(traced, n, name) for n, name in zip(region.outputs, names)]
        return KernelSpec(region.template, region.pattern, inputs, outputs, region.params, region.match.sizes)
    program = lower_region(traced, cops, region.nodes, region.inputs, region.outputs)
    for op, node in zip(program.outputs, region.outputs):
        op.into = node in region.stores
    if region.template == "pointwise" and any(cops[n].op in REDUCING for n in region.nodes):
        raise LoweringError("the pointwise template takes no reductions")
    sizes = dict(region.match.sizes) if region.match else {}
    return KernelSpec(region.template, region.pattern, program.inputs, program.outputs, region.params, sizes, program)


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


def _unordered_outputs(traced: Traced, cops, got, expected):
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
    inverse of one (:func:`fuser.idioms.inverse_permutation`) as the inverse of that; rows
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
# so two threads must not run interpreted kernels at once (compiled GPU kernels may).
_INTERPRETER_LOCK = threading.Lock()


def _validate(kernel: Kernel, values, cops) -> str | None:
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
        with torch.no_grad(), _INTERPRETER_LOCK if interpreted else contextlib.nullcontext():
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
    (:func:`fuser.tolerance.near_tie_rows`), and the row count (none when the chain's top-k
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


def plan(
    module: torch.nn.Module,
    example_inputs,
    *,
    example_kwargs: dict | None = None,
    leaves: Iterable = (),
    patterns: Iterable = (),
    guard: Callable[..., bool] | None = None,
    batch_inputs: dict[str, int] | None = None,
    validate: bool = True,
    precompute: bool = True,
) -> Plan:
    """Everything :func:`apply` does except installing the fused forward."""
    _check_example_inputs(module, example_inputs, example_kwargs, batch_inputs)
    on_cpu = any(x.device.type == "cpu" for x in tensors_of(example_inputs, example_kwargs))
    if on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise FuserError("the example inputs are on the CPU: fused kernels run there only in Triton's interpreter; set TRITON_INTERPRET=1")
    traced = trace(module, example_inputs, example_kwargs=example_kwargs, leaves=leaves, batch_inputs=batch_inputs)
    cops = canonicalize(traced)
    all_patterns = load_patterns(list(patterns), template_names())
    matches, match_rejections = match_all(all_patterns, traced, cops)
    parameters = frozenset(
        n for n in traced.graph.nodes if n.op == "get_attr" and isinstance(traced.value(n), torch.nn.Parameter)
    )
    builder = RegionBuilder(traced.graph, cops, parameters)
    rejected = [Rejected(r.pattern, r.anchor, r.category, r.reason) for r in match_rejections]
    failed: dict[fx.Node, str] = {}
    kernels: list[Kernel] = []

    def build(region: Region) -> bool:
        try:
            spec = kernel_spec(region, traced, cops)
        except LoweringError as e:
            builder.uncommit(region)
            if region.match:
                rejected.append(Rejected(region.pattern, region.outputs[0].name, "lowering", str(e)))
                return False
            if e.node in region.covered:  # one op is the reason: it stays eager, the rest is fused around it
                failed[e.node] = f"no row-program lowering here: {e}"
                rest = [n for n in region.covered if n is not e.node and fusible(cops[n])]
                return any([build(part) for part in builder.regroup(rest)])
            failed.update({n: f"generic chain not lowered: {e}" for n in region.nodes})
            return False
        path, launch = emit(spec)
        kernels.append(Kernel(region, path, launch, spec))
        return True

    taken: set = set()
    for match in matches:
        region = builder.from_match(match)
        if isinstance(region, Rejection):
            rejected.append(Rejected(region.pattern, region.anchor, region.category, region.reason))
        elif build(region):
            taken |= region.covered
    for region in builder.generic(taken):
        build(region)
    _widen(kernels, builder, traced, cops)
    _merge(kernels, builder, traced, cops)
    _store_in_place(kernels, builder, traced, cops)

    if validate:
        values = record_values(module, traced, cops)
        pending, kernels = kernels, []
        while pending:
            kernel = pending.pop(0)
            problem = _validate(kernel, values, cops)
            if problem is None:
                kernels.append(kernel)
                continue
            region = kernel.region
            if kernel.parts:  # merged or stored in place: what it was made of may still be right
                rejected.append(Rejected(region.pattern, region.outputs[0].name, "validation", f"{problem}; run unmerged"))
                pending[:0] = kernel.parts
                continue
            rejected.append(Rejected(region.pattern, region.outputs[0].name, "validation", problem))
            failed.update({n: f"fused kernel disagreed with eager ({problem})" for n in region.nodes})

    # Place the surviving kernels again: a dropped one no longer produces its values early.
    placer = RegionBuilder(traced.graph, cops, parameters)
    kernels.sort(key=lambda k: placer.order[k.region.position])
    for kernel in list(kernels):
        if placer.replace(kernel.region) is None:
            kernels.remove(kernel)
            region = kernel.region
            failed.update({n: "no valid place to run it once other kernels were dropped" for n in region.nodes})
    regions = [k.region for k in kernels]
    # precompute=False: every value is read from the live parameters at each call (weights that
    # are loaded or updated after fusing are seen); parameter-only glue then runs every step.
    covered = set().union(*(r.covered for r in regions)) if regions else set()
    constants = _parameter_only(traced, cops, covered) if precompute else {}
    copies, kept = copy_kernels(traced, cops, {n for n in cops if n not in covered and n not in constants})
    failed.update(kept)
    graph, survivors = rewrite_graph(
        traced.graph, cops, regions, {i: k.launch for i, k in enumerate(kernels)}, {n: a for n, (a, _) in constants.items()}
    )
    install_copies(graph, copies)
    forward = compile_forward(graph, module)
    report = _report(module, traced, cops, kernels, rejected, failed, survivors)
    report_copies(report, copies)
    report.precomputed = [n.name for n in constants]
    report.literals = captured_literals(module, traced)
    report.state_reads = {r.label(): r.shown() for r in traced.state_reads}
    report.automatic_leaves = [dict(name=a.name, where=a.where, reason=a.reason) for a in traced.automatic_leaves]
    p = Plan(traced, kernels, graph, forward, Guard.from_trace(module, traced, guard), report)
    p.constants = {**traced.constants, **{attr: value for attr, value in constants.values()}}
    p.precomputed = precomputation(traced.graph, {n: a for n, (a, _) in constants.items()}) if constants else None
    p.literals = dict(report.literals)
    p.cops = cops
    return p


def _check_example_inputs(module: torch.nn.Module, example_inputs, example_kwargs, batch_inputs) -> None:
    """Refuse example inputs fuser cannot trace on, naming the input or parameter at fault:
    no tokens (the trace grows the batch from its first row), meta tensors (no data to run
    on), or inputs and parameters on different devices."""
    try:
        call = CallSpec.of(module.forward, tuple(example_inputs), example_kwargs or {})
    except TypeError as e:
        raise FuserError(f"the example inputs do not fit {type(module).__name__}.forward: {e}") from None
    values, _ = call.flatten(tuple(example_inputs), example_kwargs or {})
    names = call.names
    batch = batch_dims_of(call, values, batch_inputs)
    for name, value in zip(names, values):
        dim = batch.get(name)
        if dim is not None and dim < value.dim() and value.shape[dim] == 0:
            raise FuserError(f"example inputs need at least one token: input `{name}` has size 0 at dim {dim}")
    tensors = [(f"input `{n}`", v) for n, v in zip(names, values) if isinstance(v, torch.Tensor)]
    tensors += [(f"parameter `{n}`", p) for n, p in module.named_parameters()]
    for what, tensor in tensors:
        if tensor.device.type == "meta":
            raise FuserError(f"{what} is on the meta device: fuser runs the module on the example inputs, which needs real data")
    if not tensors:
        return
    first, device = tensors[0][0], tensors[0][1].device
    for what, tensor in tensors[1:]:
        if tensor.device != device:
            raise FuserError(
                f"{what} is on {tensor.device} but {first} is on {device}: the example inputs and the "
                "parameters must be on one device"
            )


def _literals_in(value, found: set) -> None:
    """Collect the int and float literals in a node's arguments (nested in tuples, lists, dicts, slices)."""
    if type(value) in (int, float):
        found.add((type(value), value))
    elif isinstance(value, (tuple, list)):
        for v in value:
            _literals_in(v, found)
    elif isinstance(value, dict):
        for v in value.values():
            _literals_in(v, found)
    elif isinstance(value, slice):
        _literals_in((value.start, value.stop, value.step), found)


def captured_literals(module: torch.nn.Module, traced: Traced) -> dict[str, int | float]:
    """The module's scalar attributes the fused graph holds as literals, by dotted path: each
    public int or float attribute of the module or a submodule whose value appears as a literal
    in the nodes traced inside that submodule (``self.eps`` of a norm, say). The trace read them
    once: the fused graph keeps the value they had at apply time."""
    literals: dict[str, set] = {}
    for node in traced.graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        owner = next(reversed(stack.values()))[0] if stack else ""
        _literals_in((node.args, node.kwargs), literals.setdefault(owner, set()))
    found = {}
    for owner, values in literals.items():
        try:
            submodule = module.get_submodule(owner)
        except AttributeError:
            continue
        for name, value in vars(submodule).items():
            scalar = type(value) in (int, float) and not name.startswith("_")
            if scalar and (type(value), value) in values:
                found[f"{owner}.{name}" if owner else name] = value
    return dict(sorted(found.items()))


CONSTANT_PREFIX = "_fuser_const_"


def _parameter_only(traced: Traced, cops, covered: set) -> dict[fx.Node, tuple[str, torch.Tensor]]:
    """Glue that reads parameters only (a weight's cast, say): computed once, here, and read
    from an attribute at every call instead. Returns node -> (attribute name, value)."""
    from_parameters: set[fx.Node] = set()
    for node in traced.graph.nodes:
        cop = cops.get(node)
        if cop is None:
            continue
        if node.op == "get_attr" and isinstance(traced.value(node), torch.nn.Parameter):
            from_parameters.add(node)
        elif cop.kind in (COMPUTE, UNIT_VIEW, VIEW) and node.all_input_nodes and all(
            a in from_parameters for a in node.all_input_nodes
        ):
            from_parameters.add(node)
    chosen = {}
    for node in traced.graph.nodes:
        cop = cops.get(node)
        if node in from_parameters and node not in covered and cop.kind == COMPUTE and cop.op != "identity":
            # The outermost such value only (what it is computed from is then unused), or one
            # a kernel reads (Gemma's `1.0 + weight.float()`: the add joins the norm's kernel).
            if any(u not in from_parameters or u in covered for u in node.users):
                chosen[node] = (f"{CONSTANT_PREFIX}{len(chosen)}", traced.value(node).detach().clone())
    return chosen


def _widen(kernels: list[Kernel], builder: RegionBuilder, traced: Traced, cops) -> None:
    """Pull single unfused ops into the kernel next to them (re-lowered; kept only if it lowers)."""
    covered = set().union(*(k.region.covered for k in kernels)) if kernels else set()
    leftovers = [n for n in traced.graph.nodes if n in cops and fusible(cops[n]) and n not in covered]
    for i, kernel in enumerate(kernels):
        region = widened(builder, kernel.region, [n for n in leftovers if n not in covered])
        wider = _lowered(region, traced, cops) if region else None
        if wider is not None:
            kernels[i] = wider
            covered |= region.covered


def _lowered(region: Region, traced: Traced, cops, parts: list | None = None) -> Kernel | None:
    """``region`` lowered, rendered and loaded as a kernel; None if it does not lower."""
    try:
        spec = kernel_spec(region, traced, cops)
    except LoweringError:
        return None
    path, launch = emit(spec)
    return Kernel(region, path, launch, spec, parts or [])


#: Largest register block (padded elements) a merge may create: beyond it a program spills.
MERGED_BLOCK_LIMIT = 1 << 15


def _merge(kernels: list[Kernel], builder: RegionBuilder, traced: Traced, cops) -> None:
    """Merge a kernel with a kernel that reads its outputs, and then kernels that read the same
    activation, while the union lowers as one row program and has a place in the program: one
    launch instead of two, and values passed between them never leave registers."""
    failed: set = set()
    for related in (feeds, lambda a, b: siblings(builder, a, b, traced)):
        again = True
        while again:
            again = _merge_one(kernels, builder, traced, cops, related, failed)


def _merge_one(kernels: list[Kernel], builder: RegionBuilder, traced: Traced, cops, related, failed: set) -> bool:
    """Merge the first pair of kernels ``related`` says belong together; False if none can be."""
    for a in kernels:
        for b in kernels:
            key = (id(a.region), id(b.region))
            if a is b or key in failed or not related(a.region, b.region):
                continue
            region = merged(builder, a.region, b.region)
            union = _lowered(region, traced, cops, [a, b]) if region else None
            if union is None or union.spec.program.numel > MERGED_BLOCK_LIMIT or _untiles(union, a, b):
                failed.add(key)
                continue
            builder.commit(region)
            kernels[kernels.index(a)] = union
            kernels.remove(b)
            return True
    return False


#: Largest block a merge may give one program where its parts split theirs across programs.
UNTILED_BLOCK_LIMIT = 1 << 14


def _untiles(union: Kernel, a: Kernel, b: Kernel) -> bool:
    """Does the merge put a tiled kernel's whole block in one program, and a large one? (The
    q head norm of 64 heads x 512 tiled by heads, merged with a kv path of one head, runs as
    one 32768-element program per token: 117 µs on an H200 where the parts took 8.)"""
    tiled = any(k.spec.program is not None and k.spec.program.tiled for k in (a, b))
    return tiled and not union.spec.program.tiled and union.spec.program.numel > UNTILED_BLOCK_LIMIT


def _store_in_place(kernels: list[Kernel], builder: RegionBuilder, traced: Traced, cops) -> None:
    """A kernel whose output is only copied into a slice of another tensor (``x[i] = out``)
    writes it there itself: the copy's launch goes."""
    for node in traced.graph.nodes:
        if cops.get(node) is None or cops[node].op != "setitem":
            continue
        for i, kernel in enumerate(kernels):
            region = stored_in_place(builder, kernel.region, node, traced)
            storing = _lowered(region, traced, cops, [kernel]) if region else None  # falls back to the copy
            if storing is not None:
                builder.commit(region)
                kernels[i] = storing
                break


def _report(module, traced, cops, kernels, rejected, failed, survivors) -> Report:
    glue = [n for n in traced.graph.nodes if n in cops and is_glue(cops[n])]
    # Fused: replaced by a kernel, or computed again inside the kernels that read it.
    covered = {n for n in glue if n not in survivors}
    report = Report(module=type(module).__name__, rejected=rejected)
    report.glue_nodes_before = len(glue)
    report.launches_before = sum(eager_launches(cops[n]) for n in glue)
    for k in kernels:
        r = k.region
        report.chains.append(
            FusedChain(
                kernel=k.path.stem,
                path=str(k.path),
                template=r.template,
                pattern=r.pattern,
                params=r.params,
                nodes=[n.name for n in sorted(r.covered, key=lambda n: n.name)],
                inputs=[n.name for n in r.inputs],
                outputs=[n.name for n in r.outputs],
                launches_replaced=sum(eager_launches(cops[n]) for n in r.covered),
            )
        )
    for node in glue:
        if node in covered:
            continue
        cop = cops[node]
        launches = eager_launches(cop)
        if launches == 0:
            continue  # views and no-ops cost nothing; they stay as they are
        reason = failed.get(node) or _reason(node, cops, covered)
        if _token_free(traced, node) and cop.kind != MUTATION:
            reason = "depends only on parameters, but is not computed from them alone here; " + reason
        report.unfused.append(Unfused(node.name, cop.op, reason, launches))
    report.glue_nodes_after = len([n for n in glue if n not in covered]) + len(kernels)
    report.launches_after = len(kernels) + sum(u.launches for u in report.unfused)
    return report


def _token_free(traced: Traced, node: fx.Node) -> bool:
    """Is the node computed from parameters alone (no graph input upstream)?"""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n.op == "placeholder":
            return False
        if n not in seen:
            seen.add(n)
            stack += n.all_input_nodes
    return True


def _reason(node: fx.Node, cops, covered: set) -> str:
    cop = cops[node]
    if cop.op == "reshape_copy":
        return "a reshape PyTorch must copy (no view fits its input's layout): runs as that copy"
    if cop.kind == UNSUPPORTED or (cop.kind == COMPUTE and not fusible(cop)):
        return f"no template lowers {cop.op}"
    if cop.kind == MUTATION:
        return "in-place write: kept in program order, never fused across"

    def describe(n):
        if n in covered:
            return f"{n.name} (fused elsewhere)"
        return f"{n.name} ({cops[n].kind if n in cops else n.op})"

    around = [describe(n) for n in node.all_input_nodes if cops.get(n) and cops[n].kind != INPUT]
    around += [describe(u) for u in node.users]
    return "alone: its neighbours " + ", ".join(around[:4]) + (" ..." if len(around) > 4 else "") + " cannot share its kernel"


def apply(module: torch.nn.Module, example_inputs, **options) -> Report:
    """Fuse ``module``'s glue in place. On any error the module is left exactly as it was.

    The example call is ``module(*example_inputs, **example_kwargs)`` (``example_kwargs=`` among
    the options): its tensors, nested in tuples, lists and dicts too, are the fused forward's
    inputs; every other value is baked in and checked at each call. A submodule whose forward
    cannot be traced is kept opaque by itself (``report.automatic_leaves``).

    The fused forward runs only when the guard takes the call; otherwise the module's own
    forward runs: other dtypes, devices or non-token sizes, no tokens, autograd (grad enabled
    and an input or parameter requiring grad: the kernels have no backward), the user's
    ``guard`` declining, or a changed literal (below).

    What is fixed at apply time:

    * glue computed from parameters alone (a weight's cast, ``w * scale``) is computed once and
      held in an attribute (``report.precomputed``); the parameters it reads are watched (their
      version counter and storage, so in-place writes under ``no_grad``, ``load_state_dict``
      and replaced storage are seen) and it is recomputed at the next call, or the eager
      forward runs if that call is inside a CUDA-graph capture. A write through ``p.data``
      bypasses the version counter and is not seen: pass ``precompute=False`` to read every
      weight live if weights are written that way;
    * scalar attributes read by the traced forward (``self.eps``) become literals
      (``report.literals``); a call after one of them changed runs the eager forward, with a
      warning.

    A model with a stack of repeated layers (a transformers CausalLM) is fused layer by layer
    (:mod:`fuser.model`): each distinct layer structure is traced once, with the inputs one real
    forward of the model gives its first layer, and its kernels serve every layer of that
    structure; the report is then a :class:`fuser.model.ModelReport`.

    A second apply on a fused module (also from another thread) raises :class:`FuserError`.
    ``copy.deepcopy`` gives a copy fused against its own parameters; pickling (``torch.save``)
    gives the eager module.
    """
    from fuser.model import apply_model  # the model path builds on this module's plan

    layered = apply_model(module, example_inputs, **options)
    return layered if layered is not None else apply_plan(module, example_inputs, **options).report


def apply_plan(module: torch.nn.Module, example_inputs, **options) -> Plan:
    """:func:`apply`, returning the whole plan (kernels, graph, report)."""
    name = type(module).__name__
    with module_lock(module):  # a concurrent apply of the same module waits, then is refused
        if is_fused(module):
            raise FuserError(f"{name} is already fused; call fuser.restore() first")
        with preserved_state(module, tensors_of(example_inputs, options.get("example_kwargs"))):
            try:
                p = plan(module, example_inputs, **options)
            except Exception as e:
                raise FuserError(f"fuser.apply left {name} unchanged: {e}") from e
        try:
            install(module, p.forward, p.guard, p.report, p.constants, p.precomputed, p.literals)
        except AlreadyFused as e:
            raise FuserError(str(e)) from e
    return p


def explain(module: torch.nn.Module, example_inputs, **options) -> Report:
    """What :func:`apply` would fuse, and why the rest is not; installs nothing (a model fused
    layer by layer is fused, reported and restored)."""
    from fuser.model import apply_model, restore as restore_model

    layered = apply_model(module, example_inputs, **options)
    if layered is not None:
        restore_model(module)
        return layered
    with preserved_state(module, tensors_of(example_inputs, options.get("example_kwargs"))):
        return plan(module, example_inputs, **options).report


@dataclass
class CheckResult:
    ok: bool
    problems: list[str]
    compared: list[str]
    report: Report | None = None

    def text(self) -> str:
        head = "check passed" if self.ok else "check FAILED"
        lines = [f"{head}: fused vs eager on the example inputs ({len(self.compared)} tensors compared)"]
        lines += [f"  {p}" for p in self.problems]
        return "\n".join(lines)


def _state_tensors(module: torch.nn.Module, inputs: list) -> dict[str, torch.Tensor]:
    tensors = {f"buffer {n}": b for n, b in module.named_buffers()}
    tensors.update({f"input {i}": x for i, x in enumerate(inputs)})
    return tensors


def _run(module, args, kwargs):
    """One call, on a copy of the call's state objects (a KV cache): its output, and every
    buffer, input and state tensor after it."""
    args, kwargs = with_state_copied(args, kwargs)
    with torch.no_grad():
        out = module(*args, **kwargs)
    tensors = {**_state_tensors(module, tensors_of(args, kwargs)), **state_tensors(args, kwargs)}
    return out, {k: v.detach().clone() for k, v in tensors.items()}


def check(module: torch.nn.Module, example_inputs, **options) -> CheckResult:
    """Run fused and eager from identical state; compare outputs and every buffer and input
    the forward writes in place. The module and inputs are left as they were."""
    args, kwargs = tuple(example_inputs), dict(options.get("example_kwargs") or {})
    tensors = tensors_of(args, kwargs)
    with preserved_state(module, tensors):
        eager_out, eager_state = _run(module, args, kwargs)
    layered = _check_layered(module, args, kwargs, eager_out, options)
    if layered is not None:
        return layered
    fused = apply_plan(module, args, **options)
    report = fused.report
    try:
        state = module.__dict__["_fuser_state"]
        reason = state.guard.why_not(args, kwargs)
        if reason:
            return CheckResult(False, [f"the guard refuses the example inputs: {reason}"], [], report)
        with preserved_state(module, tensors):
            fused_out, fused_state = _run(module, args, kwargs)
    finally:
        restore(module)
    problems, compared = [], ["output"] + list(eager_state)
    fused_out, eager_out = _unordered_outputs(fused.traced, fused.cops, fused_out, eager_out)
    problem = mismatch(fused_out, eager_out, "output", LAYER)
    if problem:
        problems.append(problem)
    for name, expected in eager_state.items():
        problem = mismatch(fused_state[name], expected, name, LAYER)
        if problem:
            problems.append(problem)
    return CheckResult(not problems, problems, compared, report)


def _check_layered(module, args, kwargs, eager_out, options) -> CheckResult | None:
    """:func:`check` on a model fused layer by layer (each layer was checked against its own
    eager forward while fusing): the model's outputs, fused against eager. None when the
    module is no such model."""
    from fuser.model import apply_model, restore as restore_model

    report = apply_model(module, args, **options)
    if report is None:
        return None
    try:
        with preserved_state(module, tensors_of(args, kwargs)):
            fused_out, _ = _run(module, args, kwargs)
    finally:
        restore_model(module)
    problem = mismatch(tensors_of((fused_out,)), tensors_of((eager_out,)), "output", LAYER)
    return CheckResult(problem is None, [problem] if problem else [], ["output"], report)


def tensors_of(args, kwargs=None) -> list[torch.Tensor]:
    """Every tensor of a call, nested in tuples, lists and dicts too."""
    leaves = torch.utils._pytree.tree_leaves((tuple(args), dict(kwargs or {})))
    return [x for x in leaves if isinstance(x, torch.Tensor)]


__all__ = ["apply", "restore", "explain", "check", "plan", "FuserError", "Report", "CheckResult"]
