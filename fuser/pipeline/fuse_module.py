"""pipeline: fusing one module end to end — the steps of :data:`fuser.pipeline.pass_list.PASS_LIST`
in order (trace, canonicalize, the planning passes of :mod:`fuser.pipeline.passes`, the fused
graph) — into a :class:`Plan` (the fused forward, its guard, the report), and
:func:`apply_plan`, which splices it into the module.

:mod:`fuser.api` (``fuser.apply``, ``explain``, ``check``) calls it, directly for one module
and through :mod:`fuser.model.fuse_model` for a model of repeated layers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.fx as fx

from fuser.canon.canonicalize import COMPUTE, INPUT, MUTATION, UNSUPPORTED, eager_launches, is_glue, launches
from fuser.codegen.emit import template_names
from fuser.codegen.kernel import Kernel
from fuser.install.copies import report_copies
from fuser.codegen.interpreter import interpreter_problem
from fuser.install.fixed_at_apply import Precomputed, precomputation
from fuser.install.merged_weights import MergedWeights
from fuser.install.splice import AlreadyFused, Guard, install, is_fused, module_lock
from fuser.ir.report import FusedChain, Report, Unfused
from fuser.match.pattern_files import load_patterns
from fuser.pipeline.pass_list import Fusing, run_pass_list, switched_off
from fuser.regions.builder import fusible, token_free
from fuser.trace.call_spec import CallSpec
from fuser.trace.refusal import module_path, source_of
from fuser.trace.tracing import Traced, batch_dims_of, preserved_state


class FuserError(Exception):
    """fuser could not fuse the module; the module is left exactly as it was."""


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
    # module at run time rather than as the literal traced (fuser.model.fuse_model: a layer's index)
    read_at_run_time: list = field(default_factory=list)
    precomputed: Precomputed | None = None  # how to recompute ``constants`` when their parameters change
    literals: dict = field(default_factory=dict)  # module scalar attribute (dotted path) -> value fused in
    merged: MergedWeights | None = None  # linear layers run as one GEMM on their weights merged at install
    bypassed: tuple[str, ...] = ()  # submodules the fused graph runs the work of without calling them
    hand_overs: list = field(default_factory=list)  # the next layer's entries it computes (fuser.pipeline.next_layer_entry)
    shared_kernels: list = field(default_factory=list)  # its kernels run once per model forward
    next_of: dict = field(default_factory=dict)  # id(layer) -> the NextLayer it hands over to (fuser.model.fuse_model)
    layer_graph: fx.Graph | None = None  # with hand-overs: the layer's trace without them, as other layers trace

    @property
    def traced_graph(self) -> fx.Graph:
        """The layer's traced graph as a trace of another layer of its structure gives it."""
        return self.layer_graph if self.layer_graph is not None else self.traced.graph


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
    disable_passes: Iterable[str] | str = (),
    next_entries: list | None = None,
) -> Plan:
    """Everything :func:`apply` does except installing the fused forward: the steps of
    :data:`~fuser.pipeline.pass_list.PASS_LIST` in order, but those ``disable_passes`` (and
    ``FUSER_DISABLE_PASSES``) name; then the report."""
    disabled = switched_off(disable_passes)
    _check_example_inputs(module, example_inputs, example_kwargs, batch_inputs)
    on_cpu = any(x.device.type == "cpu" for x in tensors_of(example_inputs, example_kwargs))
    if on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise FuserError("the example inputs are on the CPU: fused kernels run there only in Triton's interpreter; set TRITON_INTERPRET=1")
    if on_cpu and interpreter_problem():
        raise FuserError(interpreter_problem())
    # precompute=False: every value is read from the live parameters at each call (weights that
    # are loaded or updated after fusing are seen); parameter-only glue then runs every step.
    off = {*disabled, *(() if validate else ("validate",)), *(() if precompute else ("precompute",))}
    all_patterns = load_patterns(list(patterns), template_names())
    f = run_pass_list(Fusing(module, tuple(example_inputs), example_kwargs, leaves, all_patterns, batch_inputs, frozenset(off),
                             list(next_entries or ())))  # fmt: skip
    traced, cops, kernels, constants = f.traced, f.cops, f.kernels, f.constants
    report = _report(module, traced, cops, kernels, f.planning.rejected, f.planning.failed, f.survivors)
    report_copies(report, f.copies)
    report.disabled_passes = list(disabled)
    report.precomputed = [n.name for n in constants]
    report.literals = captured_literals(module, traced)
    report.state_reads = {r.label(): r.shown() for r in traced.state_reads}
    report.token_ranges = [f"{r.where}: for {r.shown()}" for r in traced.token_ranges]
    report.automatic_leaves = [dict(name=a.name, where=a.where, reason=a.reason) for a in traced.automatic_leaves]
    report.attention_calls = [r.line() for r in traced.attention_calls]
    report.shared = [k.path.stem for k in f.shared]
    report.launches_before += sum(r.copies_removed for r in traced.attention_calls)  # eager still makes them
    for leaf in report.automatic_leaves:
        if leaf["name"] in f.cache_writes:
            leaf["reason"] += "; a layer of transformers' StaticCache (plain or sliding-window) is written by one kernel (fuser.install.kv_cache)"
    report.free_sizes = {name: list(dims) for name, dims in f.free.items()}
    report.sizes_near_literals = {name: sorted(dims) for name, dims in f.near_literals.items()}
    report.merged_projections, report.projections_apart = list(f.merges), dict(f.merges_refused)
    report.residuals_in_gemm = [f"{add} + {linear}" for add, linear in f.residuals_in_gemm]
    report.activations_in_gemm = [f"{out} ({kind}) of {gemm}" for out, kind, gemm, _ in f.activations_in_gemm]
    report.activations_apart = dict(f.activations_apart)
    report.upcasts_in_gemm, report.upcasts_apart = list(f.upcasts_in_gemm), dict(f.upcasts_apart)
    report.launches_after += f.casts_back  # a launch each, new in the fused graph
    report.decode_gemms = [f"{what}: {how}" for what, how in f.decode_gemms]
    report.decode_gemms_untimed = list(f.decode_gemms_untimed)
    report.gated_in_gemm, report.gated_apart = list(f.gated_in_gemm), dict(f.gated_apart)
    report.decode_attention = list(f.decode_attention)
    report.norm_in_gemm, report.norms_apart = list(f.norm_in_gemm), dict(f.norms_apart)
    report.early_weights, report.early_waiting = list(f.early_weights), dict(f.early_waiting)
    p = Plan(traced, kernels, f.graph, f.forward, Guard.from_trace(module, traced, guard, f.free, f.near_literals), report)
    p.constants = {**traced.constants, **{attr: value for attr, value in constants.values()}}
    p.precomputed = precomputation(traced.graph, {n: a for n, (a, _) in constants.items()}) if constants else None
    p.literals = dict(report.literals)
    p.cops = cops
    p.merged = f.merged
    p.hand_overs, p.shared_kernels = f.hand_overs, f.shared
    p.bypassed = tuple(name for g in (f.merged.groups if f.merged else ()) for name in g.layers) + tuple(
        linear for _, linear in f.residuals_in_gemm
    ) + tuple(gemm for _, _, gemm, layer in f.activations_in_gemm if layer) + tuple(f.uncalled)
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
    try:
        batch = batch_dims_of(call, values, batch_inputs)
    except ValueError as e:
        raise FuserError(str(e)) from None
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
        _literals_in((node.args, node.kwargs), literals.setdefault(module_path(node), set()))
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
                where=source_of(r.outputs[0]) if r.outputs else "",
                note=r.note,
            )
        )
    for node in glue:
        if node in covered:
            continue
        cop = cops[node]
        count = launches(cop)
        if count == 0:
            continue  # views and no-ops cost nothing; they stay as they are
        reason = failed.get(node) or _reason(node, cops, covered)
        if token_free(node) and cop.kind != MUTATION:
            reason = "depends only on parameters, but is not computed from them alone here; " + reason
        report.unfused.append(Unfused(node.name, cop.op, reason, count, source_of(node)))
    report.glue_nodes_after = len([n for n in glue if n not in covered]) + len(kernels)
    report.launches_after = len(kernels) + sum(u.launches for u in report.unfused)
    return report


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
            install(module, p.forward, p.guard, p.report, p.constants, p.precomputed, p.literals, p.merged, p.bypassed)
        except AlreadyFused as e:
            raise FuserError(str(e)) from e
    return p




def tensors_of(args, kwargs=None) -> list[torch.Tensor]:
    """Every tensor of a call, nested in tuples, lists and dicts too."""
    leaves = torch.utils._pytree.tree_leaves((tuple(args), dict(kwargs or {})))
    return [x for x in leaves if isinstance(x, torch.Tensor)]


