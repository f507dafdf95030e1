"""model: :func:`fuser.apply` on a whole model — a stack of repeated decoder layers.

One real forward of the model records what each layer is called with. Layers of one structure
(same class, same parameter shapes and dtypes, same flag and name attributes) are traced, fused
and validated once, on the first of them; every other layer of the structure gets the same
kernels and fused forward, bound to its own weights (the fused forward reads its parameters from
the module it runs on), with the values it computes from parameters alone recomputed from its
own, and is checked against its eager forward on its own recorded inputs. The model's other
submodules that the forward calls (the final norm, the rotary embedding) are fused each on its
own where that saves launches, and so is the forward of each module that holds a stack and
of each above it (the glue around the layers: the positions, the causal mask, the LM head's),
with its submodules as leaves — but a submodule called again in the forward unlike its first
call, which one plan of its own could not serve, is traced into its parent's forward. Within
each forward of those modules, a kernel of the layers' inputs alone runs once for all the
layers given the same inputs (:mod:`fuser.install.once_per_forward`).

A structure that cannot be fused stays eager and is reported; the others are fused. A failure
while installing restores every layer fused so far: the model is never left half-patched.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.nn as nn

from fuser.pipeline.fuse_module import FuserError, Plan, plan, tensors_of
from fuser.pipeline.next_layer_entry import NEXT, NextLayer, computing_kernels, entries_of
from fuser.model.final_norm import NotHanded, called_on_output, hand_to_final_norm
from fuser.pipeline.pass_list import switched_off
from fuser.regions.lone_ops import gave_a_kernel
from fuser.model.model_report import LayerGroup, ModelReport
from fuser.ir.report import tune_command
from fuser.model.layer_stacks import decoder_stacks, layer_stacks  # noqa: F401 - layer_stacks: the api asks
from fuser.model.progress import Progress
from fuser.model.recording import record_calls
from fuser.trace.call_spec import CallSpec, with_state_copied
from fuser.trace.token_dims import infer_batch_inputs
from fuser.model.layer_structure import attributes_read_by_leaves, graph_key, groups_of, read_argument_at_run_time
from fuser.install.fused_graph import compile_forward
from fuser.install.once_per_forward import share_within, unshare
from fuser.install.fixed_at_apply import read_attributes
from fuser.install.splice import STATE_ATTR, add_copy_hooks, install, is_fused, remove_copy_hooks
from fuser.install.splice import restore as restore_module
from fuser.validate.tolerance import LAYER, mismatch, near_tie_rows, rows_besides_ties
from fuser.trace.tracing import preserved_state, trace
from fuser.trace.leaves import is_default_leaf

MODEL_ATTR = "_fuser_model"  # on a model fused layer by layer: its ModelReport
#: Modules the model's other submodules are never fused as (one kernel each already).
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def _heavy(module: nn.Module) -> bool:
    """A GEMM or a lookup the trace keeps whole (:func:`fuser.trace.leaves.is_default_leaf`: a
    subclass with a forward of its own is glue to fuse), or a list of modules."""
    return is_default_leaf(module) or isinstance(module, _CONTAINERS)


def apply_model(model: nn.Module, example_inputs, example_kwargs=None, report: ModelReport | None = None,
                **options) -> ModelReport | None:
    """Fuse ``model`` layer by layer (see the module's docstring); None when it has no stack
    of repeated layers, each called once per forward with hidden states in and out. ``report``:
    the one to fill in (a lazily fused model's, :mod:`fuser.model.lazy_model`)."""
    candidates = layer_stacks(model)
    if not candidates:
        return None
    if model.__dict__.get(MODEL_ATTR, report) is not report:
        raise FuserError(f"{type(model).__name__} is already fused; call fuser.restore() first")
    options.pop("batch_inputs", None)  # the model's; each layer's follow the batch of its hidden states
    args, kwargs = tuple(example_inputs), dict(example_kwargs or {})
    calls = record_calls(model, args, kwargs, _watched(model, candidates))
    stacks = decoder_stacks(candidates, calls)
    if not stacks:
        return None  # lists of experts or per-head norms, no stack of layers: the module is fused whole
    if stacks != candidates:  # the modules around the stacks are others: a forward that watches them
        calls = record_calls(model, args, kwargs, _watched(model, stacks))
    layers = [(f"{name}.{i}", layer) for name, stack in stacks for i, layer in enumerate(stack)]
    # each layer's next in its stack (the last layer's: itself), which its kernels may compute the entry of
    following = {id(layer): NextLayer(stack, min(i + 1, len(stack) - 1)) for _, stack in stacks for i, layer in enumerate(stack)}
    others = _other_submodules(model, {n for n, _ in stacks})
    parents = _stack_parents(model, [n for n, _ in stacks])
    if any(is_fused(m) for m in model.modules()):
        raise FuserError(f"{type(model).__name__} has fused submodules; call fuser.restore() on them first")
    report = report if report is not None else ModelReport(type(model).__name__)
    fused = Installed()
    progress = Progress(type(model).__name__, len(layers))
    try:
        for group in groups_of(layers, options.get("leaves", ())):
            started = time.perf_counter()
            groups = _fuse_group(group, calls, options, fused, progress, following)
            for g in groups:
                g.handed_to = _handed_to(g, stacks)
            report.groups += groups
            _log_group(progress, group, groups, started)
        for name, module in others:
            if id(module) in calls.varied:  # one plan would serve one of its calls: its parent's holds them all
                report.skipped[name] = f"called again in one forward unlike its first call ({calls.varied[id(module)]}): traced into its parent's forward"
                continue
            _fuse_other(name, module, calls.get(id(module)), options, report, fused, progress)
        _hand_to_final_norms(model, stacks, others, calls, report, fused)
        batch = calls[id(layers[0][1])][0][0].shape[0]
        for name, module in parents:  # its own forward, with its layers and submodules as leaves
            call = calls.get(id(module))
            children = [c for c in _children_called(module) if id(module.get_submodule(c)) not in calls.varied]
            own = dict(options, leaves=[*options.get("leaves", ()), *children],
                       batch_inputs=_batch_inputs(module, *call[:2], batch=batch) if call else {})  # fmt: skip
            _fuse_other(f"{name or type(module).__name__}.forward", module, call, own, report, fused, progress)
        if any(g.report.shared or g.report.across_layers for g in report.groups if g.report):
            for _, module in parents:
                share_within(module)
                add_copy_hooks(module)
    except BaseException:
        for _, module in parents:
            unshare(module)
            if not is_fused(module):
                remove_copy_hooks(module)
        for module in fused:
            restore_module(module)
        raise
    finally:
        progress.close()
    model.__dict__[MODEL_ATTR] = report
    add_copy_hooks(model)  # a copy keeps the report, a pickle leaves it out
    return report


def restore(module: nn.Module) -> None:
    """Undo :func:`fuser.apply`, on one module or on a model fused layer by layer."""
    if module.__dict__.pop(MODEL_ATTR, None) is not None:
        for sub in module.modules():
            unshare(sub)
            if is_fused(sub):
                restore_module(sub)
            remove_copy_hooks(sub)
        return
    restore_module(module)


def _watched(model: nn.Module, stacks) -> list[nn.Module]:
    """The modules whose first call fusing ``stacks`` reads: every layer, the model's other
    submodules and the stacks' parents."""
    layers = [m for _, stack in stacks for m in stack]
    others = _other_submodules(model, {n for n, _ in stacks})
    parents = _stack_parents(model, [n for n, _ in stacks])
    return layers + [m for _, m in others] + [m for _, m in parents]


def _other_submodules(model: nn.Module, stacks: set[str]) -> list[tuple[str, nn.Module]]:
    """Submodules outside the layer stacks that may hold glue of their own (the final norm, the
    rotary embedding): children of the model and of the stacks' parents, no GEMMs or lists."""
    parents = {""} | {name.rpartition(".")[0] for name in stacks}
    found = []
    for parent in sorted(parents):
        owner = model.get_submodule(parent) if parent else model
        for name, child in owner.named_children():
            qualified = f"{parent}.{name}" if parent else name
            if qualified in stacks or _heavy(child) or qualified in parents:
                continue
            found.append((qualified, child))
    return found


def _stack_parents(model: nn.Module, stacks: list[str]) -> list[tuple[str, nn.Module]]:
    """The modules that hold the layer stacks (transformers' ``Qwen3Model``) and those above
    them up to the model (its ``Qwen3ForCausalLM``), innermost first: their own forwards run the
    model's glue around the layers (the positions and the causal mask; the LM head's logit
    soft-capping)."""
    names = set()
    for stack in stacks:
        parts = stack.split(".")[:-1]
        names |= {".".join(parts[:i]) for i in range(len(parts) + 1)}
    ordered = sorted(names, key=lambda n: -(n.count(".") + 1) if n else 1)
    return [(name, model.get_submodule(name) if name else model) for name in ordered]


def _children_called(module: nn.Module) -> list[str]:
    """Every submodule a parent's forward may call, as a leaf: its children, and the items of
    its module lists (the layers)."""
    names = []
    for name, child in module.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            names += [f"{name}.{key}" for key, _ in child.named_children()]
        else:
            names.append(name)
    return names


# --- grouping and fusing ------------------------------------------------------------------------
def _log_group(progress: Progress, group, groups: list[LayerGroup], started: float) -> None:
    cls = type(group[0][1]).__name__
    for g in groups:
        if g.report is None:
            progress.note("%d %s layers left eager: %s", len(g.layers), cls, g.eager, since=started)
        else:
            progress.note("%d %s layers fused, %d -> %d glue launches each", len(g.layers), cls,
                          g.report.launches_before, g.report.launches_after, since=started)  # fmt: skip


def _fuse_group(group, calls, options, fused: Installed, progress: Progress, following: dict) -> list[LayerGroup]:
    """Fuse one structure's layers with one plan; layers whose literals or outputs differ get
    a plan of their own. Returns the groups as fused (or left eager)."""
    (first_name, first), rest = group[0], group[1:]
    args, kwargs, _ = calls[id(first)]
    try:
        p = plan(first, args, example_kwargs=kwargs, batch_inputs=_batch_inputs(first, args, kwargs), **options)
    except Exception as e:  # noqa: BLE001 - a structure fuser cannot fuse stays eager, reported
        progress.advance(len(group))
        return [LayerGroup([name for name, _ in group], eager=f"{type(e).__name__}: {e}")]
    p = _across_layers(p, group, calls[id(first)], options, following)
    # The plan's kernels each passed validation on the first layer's inputs; every layer,
    # the first too, is then checked whole against its own eager forward. One that disagrees
    # (a MoE router picking another expert on its data) stays eager; the others share the plan.
    shared, apart, left = LayerGroup([], report=p.report), [], []
    _install(first, p, p.constants, p.precomputed, fused)
    problem, tied = _disagrees(first, calls[id(first)], p)
    progress.advance()
    if problem:
        restore_module(first)
        fused.remove(first)
        left.append(LayerGroup([first_name], eager=f"fused, it disagreed with eager on its inputs: {problem}"))
    else:
        shared.layers.append(first_name)
        if tied:
            shared.near_ties[first_name] = tied
    for name, layer in rest:
        literals = dict(zip(p.literals, read_attributes(layer, tuple(p.literals))))
        differing = {k for k, v in literals.items() if v != p.literals[k]}
        read = {attribute for _, _, attribute in p.read_at_run_time}
        # An attribute the fused graph already reads at run time needs no trace to tell (the
        # check against the layer's own eager forward below still runs).
        if differing - read and not _traces_alike(p, first, layer, calls[id(layer)], options, fused):
            apart.append((name, layer))  # a scalar the fused graph holds differs: its own plan
            continue
        precomputed = dataclasses.replace(p.precomputed, seen=(), warned=False) if p.precomputed else None
        computed = dict(zip(p.precomputed.names, _computed(p.precomputed, layer, p))) if p.precomputed else {}
        constants = {**p.traced.constants, **computed}
        _install(layer, p, constants, precomputed, fused, literals)
        problem, tied = _disagrees(layer, calls[id(layer)], p)
        if problem:
            restore_module(layer)
            fused.remove(layer)
            apart.append((name, layer))
            continue
        progress.advance()
        shared.layers.append(name)
        if tied:
            shared.near_ties[name] = tied
    result = ([shared] if shared.layers else []) + left
    for name, layer in apart:  # planned on their own: another structure in all but the look
        result += _fuse_group([(name, layer)], calls, options, fused, progress, following)
    return result


def _computed(precomputed, layer: nn.Module, p: Plan) -> tuple:
    if p.hand_overs:  # (a value of the next layer's parameters: read through the layer's NEXT)
        layer.__dict__[NEXT] = p.next_of[id(layer)]
    try:
        with torch.no_grad():
            return tuple(v.detach().clone() for v in precomputed.compute(layer))
    finally:
        layer.__dict__.pop(NEXT, None)


class Installed(list):
    """The modules fused so far (each restored should anything fail), and the plan each was
    installed with (by module id)."""

    def __init__(self):
        super().__init__()
        self.plans: dict[int, Plan] = {}

    def remove(self, module) -> None:
        super().remove(module)
        self.plans.pop(id(module), None)


def _install(layer: nn.Module, p: Plan, constants, precomputed, fused: Installed, literals=None) -> None:
    if p.hand_overs:
        constants = {**constants, NEXT: p.next_of[id(layer)]}
    install(layer, p.forward, p.guard, p.report, constants, precomputed, p.literals if literals is None else literals, p.merged,
            p.bypassed)  # fmt: skip
    fused.append(layer)
    fused.plans[id(layer)] = p


def _hand_to_final_norms(model: nn.Module, stacks, others, calls, report: ModelReport, fused: Installed) -> None:
    """The last layer of each stack that hands its entry kernel over computes the final norm
    called on its output instead (:mod:`fuser.model.final_norm`); reported either way."""
    for stack_name, stack in stacks:
        last = stack[len(stack) - 1]
        layer_plan = fused.plans.get(id(last))
        if layer_plan is None or not layer_plan.hand_overs:
            continue
        for name, module in others:
            norm_plan = fused.plans.get(id(module))
            if norm_plan is None or id(module) not in calls or not called_on_output(calls[id(module)], calls[id(last)]):
                continue
            owner_name, _, attr = name.rpartition(".")
            try:
                kernels = hand_to_final_norm(last, layer_plan, model.get_submodule(owner_name), attr, norm_plan, calls[id(module)])
            except NotHanded as e:
                report.handed_over_apart[name] = str(e)
                continue
            report.handed_over[name] = f"computed by {stack_name}.{len(stack) - 1}'s {', '.join(kernels)}"
            break


def _handed_to(group: LayerGroup, stacks) -> int:
    """The layers of ``group`` whose layer before them in their stack is of ``group`` too."""
    if group.report is None or not group.report.across_layers:
        return 0
    names = set(group.layers)
    return sum(f"{name}.{i - 1}" in names for name, stack in stacks for i in range(1, len(stack)) if f"{name}.{i}" in names)


def _across_layers(p: Plan, group, call, options, following: dict) -> Plan:
    """The plan of ``group``'s layers with the next layer's entry kernels computed by each
    layer's own (:mod:`fuser.pipeline.next_layer_entry`), planned on the group's first layer
    with the second as its next; ``p`` where that saves no launch, the reason in its report."""
    if len(group) < 2 or "glue_across_layers" in switched_off(options.get("disable_passes", ())):
        return p
    entries, why = entries_of(p.kernels, p.traced, p.cops, p.shared_kernels)
    if not entries:
        p.report.across_layers_apart = why
        return p
    (_, first), (_, second) = group[0], group[1]
    args, kwargs, _ = call
    first.__dict__[NEXT] = NextLayer([second], 0)
    try:
        across = plan(first, args, example_kwargs=kwargs, batch_inputs=_batch_inputs(first, args, kwargs),
                      next_entries=entries, **options)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - the layers are fused each on its own, as before
        p.report.across_layers_apart = f"planned with the next layer's entry, it failed: {type(e).__name__}: {e}"
        return p
    finally:
        first.__dict__.pop(NEXT, None)
    handed = [h for h in across.hand_overs if h.launch is not None]
    if not handed or across.report.launches_after - len(handed) >= p.report.launches_after:
        p.report.across_layers_apart = (
            f"computing the next layer's entry ({', '.join(e.kernel for e in entries)}) here saves no launch: "
            f"{across.report.launches_after} a layer with it ({across.report.launches_after - len(handed)} where the "
            f"layer before hands its entry over), {p.report.launches_after} without"
        )
        return p
    across.next_of, across.layer_graph = following, p.traced.graph
    across.report.launches_before, across.report.glue_nodes_before = p.report.launches_before, p.report.glue_nodes_before
    across.report.across_layers = [_handed_line(h, across) for h in handed]
    return across


def _handed_line(hand, p: Plan) -> str:
    """"<entry kernel> of the next layer: computed by <kernel>" for a report."""
    makers = computing_kernels(p.kernels, p.traced.graph, hand)
    return f"{hand.entry.kernel} ({', '.join(hand.entry.outputs)}) of the next layer: computed by {', '.join(makers) or 'PyTorch'}"


def _traces_alike(p: Plan, first: nn.Module, layer: nn.Module, call, options, fused: Installed) -> bool:
    """Does ``layer`` trace to the graph ``p`` was planned on? A scalar attribute may look like
    one the graph holds (``layer_idx = 1`` where the graph has a literal 1) without being read:
    then its layers still share the plan. Where it is read only as an argument of a leaf call
    (``past_key_values.update(k, v, self.layer_idx)``), the fused graph reads it from the layer
    at run time instead (``p`` is changed so, and ``first`` installed again), and the layers
    share the plan too."""
    args, kwargs, _ = call
    try:
        traced = trace(layer, args, example_kwargs=kwargs, leaves=options.get("leaves", ()),
                       batch_inputs=_batch_inputs(layer, args, kwargs))  # fmt: skip
    except Exception:  # noqa: BLE001 - it does not trace alike
        return False
    if graph_key(traced.graph) == graph_key(p.traced_graph):
        return True
    read = attributes_read_by_leaves(p, first, layer, traced.graph)
    if read is None:
        return False
    new = [r for r in read if r not in p.read_at_run_time]
    if new:
        for node_name, position, attribute in new:
            read_argument_at_run_time(p.graph, node_name, position, attribute)
        p.read_at_run_time += new
        p.forward = compile_forward(p.graph, first)
        if first in fused:  # (not when its own check left it eager)
            restore_module(first)
            fused.remove(first)
            _install(first, p, p.constants, p.precomputed, fused)
    return True


def _disagrees(layer: nn.Module, call, p: Plan) -> tuple[str | None, list[int]]:
    """The fused layer against its own eager forward on the inputs it was called with (which
    its guard must take: else the fused forward would never run on them). Tokens where the two
    disagree are left out of the comparison when eager's own result there is not settled by
    its input, and either result is right: a top-k choice (a MoE router's) that is a near tie
    in eager's own scores, where a last-bit difference picks another expert; or a choice
    inside a leaf (an attention's top-k of positions), where eager's output moves as far with
    its input rounded otherwise (:func:`_unsettled`). Returns the problem, or None and the
    tokens left out."""
    args, kwargs, expected = call
    inputs, refused = layer.__dict__[STATE_ATTR].guard.check(args, kwargs)
    if refused:
        return f"its guard refuses the call the model makes: {refused}", []
    args, kwargs = with_state_copied(args, kwargs)
    with preserved_state(layer, tensors_of(args, kwargs)), torch.no_grad():
        out = layer(*args, **kwargs)
    got = tensors_of((out,))
    if not got:
        return "the fused layer returned no tensor", []
    problem = mismatch(got[0], expected, "the layer's output", LAYER)
    if problem is None or not got[0].dim():
        return problem, []
    disagreeing = _disagreeing(got[0], expected)
    tied = disagreeing & _near_ties(layer, p, inputs, rows=expected.shape[0])
    if disagreeing - tied:
        tied |= disagreeing & _unsettled(layer, call, expected)
    kept = rows_besides_ties(tied, expected.shape[0])
    if kept is None:
        return problem, []
    return mismatch(got[0][kept], expected[kept], f"the layer's output without tokens {sorted(tied)}", LAYER), sorted(tied)


#: Draws of :func:`_unsettled`: the input rounded otherwise this many ways.
_REROUNDINGS = 2


def _unsettled(layer: nn.Module, call, expected: torch.Tensor) -> set[int]:
    """Tokens where the layer's eager forward is not settled by its input: run again with its
    first input (the hidden states) moved by a quarter of its dtype's epsilon, randomly (one
    ulp on about a sixth of its elements, as another rounding of the same values would), its
    output there moves beyond the layer tolerance."""
    args, kwargs, _ = call
    hidden = args[0]
    if not hidden.is_floating_point() or not hidden.dim():
        return set()
    found: set[int] = set()
    generator = torch.Generator(hidden.device).manual_seed(0)
    for _ in range(_REROUNDINGS):
        noise = torch.randn(hidden.shape, device=hidden.device, generator=generator)
        moved = (hidden.float() * (1 + torch.finfo(hidden.dtype).eps / 4 * noise)).to(hidden.dtype)
        again_args, again_kwargs = with_state_copied((moved, *args[1:]), kwargs)
        with preserved_state(layer, tensors_of(again_args, again_kwargs)), torch.no_grad():
            out = tensors_of((type(layer).forward(layer, *again_args, **again_kwargs),))
        if out and out[0].shape == expected.shape:
            found |= _disagreeing(out[0], expected)
    return found


def _disagreeing(got: torch.Tensor, expected: torch.Tensor) -> set[int]:
    """Tokens (rows) where ``got`` is beyond the layer tolerance of ``expected``."""
    return {t for t in range(expected.shape[0]) if mismatch(got[t], expected[t], "a token", LAYER) is not None}


def _near_ties(layer: nn.Module, p: Plan, inputs: list, rows: int) -> set[int]:
    """Rows (tokens) where a top-k of the traced graph, run eagerly on ``inputs``, has its k-th
    and next-best scores within NEAR_TIE of each other."""
    topks = [n for n in p.traced.graph.nodes if n in p.cops and p.cops[n].op == "topk"]
    if not topks:
        return set()
    scores: dict = {}

    class Scores(torch.fx.Interpreter):
        def run_node(self, n):
            if n in topks:
                scores[n] = self.env[p.cops[n].args[0]]
            return super().run_node(n)

    graph_inputs = p.traced.fresh_inputs(inputs)
    with preserved_state(layer, [x for x in graph_inputs if isinstance(x, torch.Tensor)]), torch.no_grad():
        Scores(p.traced.graph_module(layer)).run(*graph_inputs)
    tied: set[int] = set()
    for node, value in scores.items():
        if value.dim() == 2 and value.shape[0] == rows:
            tied |= near_tie_rows(value, p.cops[node].attr("k"), p.cops[node].attr("largest"))
    return tied


def _batch_inputs(layer: nn.Module, args, kwargs, batch: int | None = None) -> dict[str, int]:
    """The layer's tensor inputs that follow the batch of its hidden states, read as a single
    module's are (:func:`fuser.trace.token_dims.infer_batch_inputs`): dim 0 of the same size,
    or of a multiple of it (an ALiBi bias ``[batch·heads, 1, kv]``: that many rows per
    sequence); ``batch``, for a module above the layers: the layers' batch. The rest (rotary
    tables of one position for all sequences) are held at their sizes."""
    call = CallSpec.of(layer.forward, args, kwargs)
    tensors, _ = call.flatten(args, kwargs)
    batch = args[0].shape[0] if batch is None else batch
    return infer_batch_inputs(call.names, tensors, tokens=batch)


def _fuse_other(name, module, call, options, report: ModelReport, fused: Installed, progress: Progress) -> None:
    started = time.perf_counter()
    _fuse_one_other(name, module, call, options, report, fused)
    if name in report.others:
        r = report.others[name]
        progress.note("%s fused, %d -> %d glue launches", name, r.launches_before, r.launches_after, since=started)
    elif name in report.skipped:
        progress.note("%s not fused: %s", name, report.skipped[name], since=started)


def _fuse_one_other(name, module, call, options, report: ModelReport, fused: Installed) -> None:
    if call is None:
        return  # not called by the forward
    args, kwargs, _ = call
    if not tensors_of(args, kwargs):
        report.skipped[name] = "called with no tensor"
        return
    try:
        p = plan(module, args, example_kwargs=kwargs, **options)
    except Exception as e:  # noqa: BLE001 - reported; the rest of the model is fused
        report.skipped[name] = f"{type(e).__name__}: {e}"
        return
    faster_alone = any(gave_a_kernel(c.note) for c in p.report.chains)  # a final LayerNorm: faster, not fewer
    # an LM head the decode-GEMM table holds: fuser's kernel reads its weight faster than PyTorch's GEMM
    if p.report.launches_after >= p.report.launches_before and not faster_alone and not p.report.decode_gemms:
        untimed = p.report.decode_gemms_untimed
        report.skipped[name] = "no glue a kernel saves launches on or runs faster" + (
            f"; its GEMMs {', '.join(untimed)} not in this GPU's decode-GEMM table ({tune_command(untimed)} times them)" if untimed else "")
        return
    _install(module, p, p.constants, p.precomputed, fused)
    report.others[name] = p.report
