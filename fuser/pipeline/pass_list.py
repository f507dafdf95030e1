"""pass_list: every step from a module's example call to its fused forward, in order, by name.

:data:`PASS_LIST` below is the pipeline: :func:`run_pass_list` runs its steps in that order
(the trace rewrites inside :func:`fuser.trace.tracing.trace`, which takes them from here), and
nothing else decides the order. Each step reads and writes one :class:`Fusing`.

A pass can be switched off by name, to bisect a wrong result to the pass that makes it:

    fuser.apply(module, inputs, disable_passes=("merge",))   # explain, check, a whole model too
    FUSER_DISABLE_PASSES=merge,store_in_place fuser explain ...

The report says which passes were off (``Report.disabled_passes``). The steps a fused forward
cannot do without (``trace``, ``canonicalize``, ``place``, ``rewrite_graph``,
``compile_forward``) are listed but not switchable; naming one, or a name not in the list, is
an error that lists the switchable ones. ``validate=False`` and ``precompute=False`` switch
off ``validate`` and ``precompute`` as they always did.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.fx as fx

from fuser.canon.canonicalize import COMPUTE, UNIT_VIEW, VIEW, canonicalize
from fuser.codegen.kernel import Kernel
from fuser.install.copies import Copy, copy_kernels, install_copies
from fuser.install.fused_graph import REGION_META, compile_forward, rewrite_graph
from fuser.install.kv_cache import write_in_one_kernel
from fuser.install.merged_weights import MergedWeights
from fuser.install.free_sizes import free_sizes, reached_from
from fuser.install.leaf_sizes import fed_by_state, size_checked
from fuser.install.any_size import at_any_size, eager_region
from fuser.install.once_per_forward import once_per_forward, shareable, take_handed_over
from fuser.pipeline import passes
from fuser.pipeline.merged_projections import merge_projections
from fuser.pipeline.residual_in_gemm import residuals_in_gemm
from fuser.pipeline.activation_in_gemm import activations_in_gemm
from fuser.pipeline.decode_gemms import decode_gemms
from fuser.pipeline.early_weights import early_weights
from fuser.pipeline import decode_attentions
from fuser.pipeline.gated_in_gemm import gated_in_gemm
from fuser.pipeline.norm_in_gemm import norm_in_gemm
from fuser.pipeline.next_layer_entry import add_next_entries
from fuser.pipeline.upcast_in_gemm import upcasts_in_gemm
from fuser.pipeline.passes import Planning, planning
from fuser.trace import tracing
from fuser.trace.tracing import Traced, trace

#: The environment variable naming passes to switch off, comma-separated.
DISABLE_PASSES_ENV = "FUSER_DISABLE_PASSES"


@dataclass
class Fusing:
    """What the steps hand each other: the example call and the options (read only), then
    what each step made, in the order the steps make it."""

    module: torch.nn.Module
    example_inputs: tuple
    example_kwargs: dict | None
    leaves: Iterable
    patterns: list  # loaded (fuser.match.pattern_files)
    batch_inputs: dict[str, int] | None
    off: frozenset[str] = frozenset()  # the switches turned off
    next_entries: list = field(default_factory=list)  # the next layer's entry kernels to compute (fuser.pipeline.next_layer_entry)
    traced: Traced | None = None  # trace
    cops: dict = field(default_factory=dict)  # canonicalize: node -> its canonical op
    planning: Planning | None = None  # canonicalize, then the planning passes
    constants: dict = field(default_factory=dict)  # precompute: node -> (attribute, value)
    copies: list[Copy] = field(default_factory=list)  # copy_kernels
    shared: list[Kernel] = field(default_factory=list)  # once_per_forward
    hand_overs: list = field(default_factory=list)  # next_layer_entry: each entry's HandOver
    taken: list[Kernel] = field(default_factory=list)  # glue_across_layers: entry kernels that take a hand-over
    graph: fx.Graph | None = None  # rewrite_graph: the fused graph
    survivors: set = field(default_factory=set)  # rewrite_graph: the traced nodes it keeps
    free: dict = field(default_factory=dict)  # rewrite_graph: input -> dims of any size (install.free_sizes)
    near_literals: dict = field(default_factory=dict)  # rewrite_graph: input -> dims held by a literal next to their size
    cache_writes: list[str] = field(default_factory=list)  # static_cache_write: the calls changed
    merged: MergedWeights | None = None  # merge_projections: the groups merged
    merges: list[str] = field(default_factory=list)  # merge_projections: each group merged, named
    merges_refused: dict[str, str] = field(default_factory=dict)  # merge_projections: group -> why not
    activations_in_gemm: list[tuple[str, str, str, bool]] = field(default_factory=list)  # activation_in_gemm: (output, activation, GEMM, a layer bypassed)
    activations_apart: dict[str, str] = field(default_factory=dict)  # activation_in_gemm: activation -> why not
    residuals_in_gemm: list[tuple[str, str]] = field(default_factory=list)  # residual_in_gemm: (add, its linear) rewritten
    upcasts_in_gemm: list[str] = field(default_factory=list)  # upcast_in_gemm: matmuls of fp32 casts rewritten
    upcasts_apart: dict[str, str] = field(default_factory=dict)  # upcast_in_gemm: matmul -> why its casts stay
    casts_back: int = 0  # upcast_in_gemm: kernel outputs cast back to half (a launch each)
    decode_gemms: list[tuple[str, str]] = field(default_factory=list)  # decode_gemm: (GEMM, its shape and token counts) rewritten
    uncalled: list[str] = field(default_factory=list)  # decode_gemm: linear layers no longer called as modules
    decode_gemms_untimed: list[str] = field(default_factory=list)  # decode_gemm: GEMM shapes on a CUDA GPU the table lacks
    gated_in_gemm: list[str] = field(default_factory=list)  # gated_in_gemm: the gated activations the decode GEMM computes
    gated_apart: dict[str, str] = field(default_factory=dict)  # gated_in_gemm: those of a merged pair left apart -> why
    norm_in_gemm: list[str] = field(default_factory=list)  # norm_in_gemm: the norms the decode GEMM computes
    norms_apart: dict[str, str] = field(default_factory=dict)  # norm_in_gemm: those read by one left apart -> why
    early_weights: list[str] = field(default_factory=list)  # early_weights: GEMMs reading their weight before the wait
    early_waiting: dict[str, str] = field(default_factory=dict)  # early_weights: those left waiting -> why
    decode_attention: list[str] = field(default_factory=list)  # decode_attention: the attention calls on fuser's kernel
    forward: Callable | None = None  # compile_forward

    @property
    def kernels(self) -> list[Kernel]:
        return self.planning.kernels

    def covered(self) -> set[fx.Node]:
        """The traced nodes the kernels replace."""
        return set().union(*(k.region.covered for k in self.kernels))


@dataclass(frozen=True)
class Pass:
    """One step: its name, what it does (``run`` on a :class:`Fusing`, or, with ``inside``, a
    rewrite the step of that name runs), and whether it can be switched off."""

    name: str
    run: Callable
    does: str
    required: bool = False  # a fused forward cannot do without it: not switchable
    off_with: str = ""  # switched off with another pass (it installs what that one made)
    inside: str = ""  # run by the step of this name, not by run_pass_list

    @property
    def switch(self) -> str | None:
        """The name that switches it off; None for a required step."""
        return None if self.required else (self.off_with or self.name)


# --- the steps that are not planning passes (those are in fuser.pipeline.passes) --------------
def trace_module(f: Fusing) -> None:
    rewrites = [p.run for p in PASS_LIST if p.inside == "trace" and p.switch not in f.off]
    f.traced = trace(f.module, f.example_inputs, example_kwargs=f.example_kwargs, leaves=f.leaves,
                     batch_inputs=f.batch_inputs, rewrites=rewrites)  # fmt: skip


def next_layer_entry(f: Fusing) -> None:
    if f.next_entries:
        f.hand_overs = add_next_entries(f.traced, f.next_entries, f.module)


def canonicalize_ops(f: Fusing) -> None:
    f.cops = canonicalize(f.traced)
    f.planning = planning(f.module, f.traced, f.cops, f.patterns)


def planning_pass(step: Callable[[Planning], Planning]) -> Callable[[Fusing], None]:
    """A planning pass (:mod:`fuser.pipeline.passes`) as a step."""

    def run(f: Fusing) -> None:
        f.planning = step(f.planning)

    run.__name__ = run.__qualname__ = step.__name__
    return run


CONSTANT_PREFIX = "_fuser_const_"


def precompute(f: Fusing) -> None:
    """Glue that reads parameters only (a weight's cast, say): computed once, here, and read
    from an attribute at every call instead (node -> (attribute name, value))."""
    traced, cops, covered = f.traced, f.cops, f.covered()
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
    f.constants = chosen


def choose_copy_kernels(f: Fusing) -> None:
    covered = f.covered()
    left = {n for n in f.cops if n not in covered and n not in f.constants}
    f.copies, kept = copy_kernels(f.traced, f.cops, left)
    f.planning.failed.update(kept)


def share_once_per_forward(f: Fusing) -> None:
    f.shared = [k for k in f.kernels if shareable(k.region, f.cops)]


def link_hand_overs(f: Fusing) -> None:
    """Each hand-over to this plan's kernel of the same entry; that kernel takes it."""
    for hand in f.hand_overs:
        kernel = next((k for k in f.kernels if k not in f.shared and hand.link(k)), None)
        if kernel is not None:
            f.taken.append(kernel)


def fused_graph(f: Fusing) -> None:
    copied = {c.node for c in f.copies}
    from_state = fed_by_state(f.traced)
    # a shared kernel whose glue runs as PyTorch's ops at other sizes holds none (fuser.install.any_size)
    any_size = {id(k): (k, ops) for k in f.shared if (ops := eager_region(k.region, f.traced.graph)) is not None}
    held = f.covered() - set().union(*(k.region.covered for k, _ in any_size.values()))
    f.free, f.near_literals = free_sizes(f.traced, f.cops, held | copied, from_state)
    fed = from_state | reached_from(f.traced.graph, f.free)

    def launcher(k):
        if id(k) in any_size:
            return once_per_forward(at_any_size(k.launch, any_size[id(k)][1], k.region.inputs, f.traced))
        launch = once_per_forward(k.launch) if k in f.shared else take_handed_over(k.launch) if k in f.taken else k.launch
        return size_checked(launch, k.path.name if k.path else "", k.region.inputs, f.traced, fed)

    launchers = {i: launcher(k) for i, k in enumerate(f.kernels)}
    constants = {n: attribute for n, (attribute, _) in f.constants.items()}
    f.graph, f.survivors = rewrite_graph(f.traced.graph, f.cops, [k.region for k in f.kernels], launchers, constants)


def copies_installed(f: Fusing) -> None:
    install_copies(f.graph, f.copies)


def _pdl(f: Fusing) -> bool:
    """Are the kernels a rewrite puts in the graph launched with PDL (the ``pdl`` pass on, the GPU has it)?"""
    return "pdl" not in f.off and passes.has_pdl(f.traced)


def static_cache_write(f: Fusing) -> None:
    f.cache_writes = write_in_one_kernel(f.graph, f.traced, pdl=_pdl(f))


def merged_projection_groups(f: Fusing) -> None:
    f.merged, f.merges, f.merges_refused = merge_projections(f.graph, f.module, f.traced, f.cops, f.covered())


def _drop_erased_survivors(f: Fusing, before: set[str]) -> None:
    """A rewrite of the fused graph erased some traced nodes (``before``: the graph's node names
    before it): they run no more. Only those go; other survivors the graph holds under another
    name (a reshape install_copies made a copy kernel's call) stay."""
    gone = before - {n.name for n in f.graph.nodes}
    f.survivors = {n for n in f.survivors if n.name not in gone}


def activations_by_gemm(f: Fusing) -> None:
    shared = [k.region for k in f.shared]
    merged = {name: g.layers for g in (f.merged.groups if f.merged else ()) for name in g.layers}
    before = {n.name for n in f.graph.nodes}
    f.activations_in_gemm, f.activations_apart = activations_in_gemm(f.graph, f.module, f.traced, f.cops, f.survivors,
                                                                     shared, merged)  # fmt: skip
    if f.activations_in_gemm:  # the kernels and ops that computed them run no more
        live = {id(n.meta[REGION_META]) for n in f.graph.nodes if REGION_META in n.meta}
        f.planning.kernels = [k for k in f.kernels if id(k.region) in live]
        _drop_erased_survivors(f, before)


def upcasts_by_gemm(f: Fusing) -> None:
    before = {n.name for n in f.graph.nodes}
    f.upcasts_in_gemm, f.upcasts_apart, f.casts_back = upcasts_in_gemm(f.graph, f.traced)
    _drop_erased_survivors(f, before)  # the casts run no more


def residual_adds_in_gemm(f: Fusing) -> None:
    f.residuals_in_gemm = residuals_in_gemm(f.graph, f.module, f.traced, [k.region for k in f.shared])
    added = {add for add, _ in f.residuals_in_gemm}
    f.survivors = {n for n in f.survivors if n.name not in added}  # no launch of its own any more


def decode_gemm_kernels(f: Fusing) -> None:
    f.decode_gemms, f.uncalled, f.decode_gemms_untimed = decode_gemms(f.graph, f.module, f.merged, _pdl(f))


def gated_by_gemm(f: Fusing) -> None:
    before = {n.name for n in f.graph.nodes}
    f.gated_in_gemm, f.gated_apart = gated_in_gemm(f.graph, f.traced, f.cops, f.survivors, [k.region for k in f.shared], f.merged)
    _drop_erased_survivors(f, before)  # ops of a product left to PyTorch run only past the table's sizes now
    # (a product's kernel stays in the plan: it runs past the table's sizes, after PyTorch's GEMM)


def norm_by_gemm(f: Fusing) -> None:
    before = {n.name for n in f.graph.nodes}
    f.norm_in_gemm, f.norms_apart = norm_in_gemm(f.graph, f.traced, f.cops, [k.region for k in f.shared], [k.region for k in f.taken])
    _drop_erased_survivors(f, before)
    # (a norm's kernel stays in the plan: it runs past the table's sizes, before PyTorch's GEMM)


def decode_attention_kernel(f: Fusing) -> None:
    f.decode_attention = decode_attentions.decode_attentions(f.graph, decode_attentions.on_gpu(f.traced.example_inputs), _pdl(f))


def cache_write_by_attention(f: Fusing) -> None:
    merged = dict(decode_attentions.cache_writes_in_attention(f.graph))
    f.decode_attention = [f"{entry}, writing the cache before it ({merged[name]})" if (name := entry.split(" ")[0]) in merged
                          else entry for entry in f.decode_attention]  # fmt: skip


def slices_combined_by_attention(f: Fusing) -> None:
    if decode_attentions.slices_combined_in_attention(f.graph):  # every call that writes the cache
        f.decode_attention = [f"{entry}, combining its slices of keys itself" if "writing the cache" in entry else entry
                              for entry in f.decode_attention]  # fmt: skip


def weights_read_early(f: Fusing) -> None:
    f.early_weights, f.early_waiting = early_weights(f.graph, f.module, tuple(k.region for k in f.shared + f.taken))


def compiled_forward(f: Fusing) -> None:
    f.forward = compile_forward(f.graph, f.module)


# --- the list ----------------------------------------------------------------------------------
PASS_LIST: tuple[Pass, ...] = (
    Pass("trace", trace_module, "the forward as an fx graph, each value shadowed at two batch sizes", required=True),
    Pass("in_place_idioms", tracing.in_place_idioms, "in-place spellings of a value (out.add_(b) on a fresh out) as one functional op", inside="trace"),
    Pass("attention_calls", tracing.attention_calls, "sdpa calls given the un-repeated heads and an additive mask", inside="trace"),
    Pass("per_slice_norms", tracing.per_slice_norms, "a LayerNorm per slice of a tensor, weights per slice, as one LayerNorm with the weights stacked", inside="trace"),
    Pass("repeated_rows", tracing.repeated_rows, "the token rows repeated block by block (x.repeat(E, 1)) and the elementwise ops over them, over [blocks, tokens, ...]", inside="trace"),
    Pass("next_layer_entry", next_layer_entry, "the next layer's entry kernels (given by fuser.model) computed again after the output, from the next layer's parameters", off_with="glue_across_layers"),
    Pass("canonicalize", canonicalize_ops, "each node's canonical op", required=True),
    Pass("growing_state", planning_pass(passes.hold_growing_state), "glue at the length of a cache that grows each call (a dynamic cache) kept eager"),
    Pass("fuse_patterns", planning_pass(passes.fuse_patterns), "each pattern match a region and its kernel"),
    Pass("fuse_generic", planning_pass(passes.fuse_generic), "the glue no pattern took, in regions, each a row program"),
    Pass("widen", planning_pass(passes.widen), "single unfused ops pulled into the kernel next to them"),
    Pass("merge", planning_pass(passes.merge), "a kernel with the kernel that reads it, then kernels reading one activation"),
    Pass("store_in_place", planning_pass(passes.store_in_place), "a kernel whose output is only copied into a slice writes it there"),
    Pass("pdl", planning_pass(passes.launch_pdl), "row programs launched with programmatic dependent launch (compute capability 9.0+): each waits for the kernel before it, its launch overlapping that kernel's end"),
    Pass("validate", planning_pass(passes.validate), "every kernel against eager on one recorded run; a wrong one falls back"),
    Pass("place", planning_pass(passes.place), "the surviving kernels placed in the program again", required=True),
    Pass("precompute", precompute, "glue of parameters alone computed once, at apply time"),
    Pass("copy_kernels", choose_copy_kernels, "a copy kernel for each reshape left eager that must copy"),
    Pass("once_per_forward", share_once_per_forward, "kernels of the call's inputs alone launched once per model forward"),
    Pass("glue_across_layers", link_hand_overs, "the next layer's entry kernels, computed by this layer's last kernel, handed over to the next layer's launch of them within a model forward (fuser.pipeline.next_layer_entry)"),
    Pass("rewrite_graph", fused_graph, "the fused graph: kernels in, the nodes they replace out", required=True),
    Pass("install_copies", copies_installed, "the copy kernels put in the fused graph", off_with="copy_kernels"),
    Pass("static_cache_write", static_cache_write, "a plain StaticCache layer written by one kernel"),
    Pass("merge_projections", merged_projection_groups, "linear layers that read one input as one GEMM on their weights concatenated at apply time"),
    Pass("activation_in_gemm", activations_by_gemm, "a ReLU or tanh GELU of a linear layer's output alone applied by the GEMM's epilogue with the bias (cuBLASLt, torch._addmm_activation): no launch for the activation"),
    Pass("upcast_in_gemm", upcasts_by_gemm, "a matmul of two half tensors each cast to fp32 for it run as the half GEMM with an fp32 output (cuBLAS, bmm out_dtype): no cast, no fp32 copy"),
    Pass("residual_in_gemm", residual_adds_in_gemm, "a residual added to a linear layer's output, in a buffer nothing else reads, added by the GEMM itself (addmm_, beta = 1): no launch for the add"),
    Pass("decode_gemm", decode_gemm_kernels, "linear layers whose weight shape this GPU's decode-GEMM table holds run on fuser's GEMM kernel at decode sizes (none without a table)"),
    Pass("gated_in_gemm", gated_by_gemm, "the gated activation act(gate)·up of a merged gate/up GEMM on the decode GEMM kernel computed by that kernel (the halves' columns in one program): no launch for it"),
    Pass("norm_in_gemm", norm_by_gemm, "an RMSNorm (of a residual add too) whose output only a GEMM on the decode GEMM kernel reads computed by that kernel as its prologue: no launch for it"),
    Pass("decode_attention", decode_attention_kernel, "attention calls of one query row (a decode step) on fuser's decode attention kernel, on a CUDA GPU: the query heads of a key head as one tile, the keys in slices, blocks the mask hides not read"),
    Pass("cache_write_in_attention", cache_write_by_attention, "a plain StaticCache layer's write at decode made by the decode attention kernel that reads the cache next (the program whose slice holds the new slot): no launch for the write"),
    Pass("combine_in_attention", slices_combined_by_attention, "the decode attention kernel that writes the cache combining its slices of keys too (the program that finishes a key head's last): no launch for the combine"),
    Pass("early_weights", weights_read_early, "a decode GEMM launched with PDL right after a kernel of the same forward reads its first chunk of weight before waiting for that kernel: the read overlaps its end"),
    Pass("compile_forward", compiled_forward, "the fused graph as the forward to install", required=True),
)  # fmt: skip


def switchable() -> list[str]:
    """The names that switch a pass off, in list order."""
    return [p.name for p in PASS_LIST if p.switch == p.name]


def switched_off(names: Iterable[str] | str = ()) -> tuple[str, ...]:
    """The passes to switch off, in list order: ``names`` (the ``disable_passes`` option; a
    comma-separated string too) and those of :data:`DISABLE_PASSES_ENV`. A name that is not a
    switchable pass raises :class:`UnknownPass`, naming it and listing the switchable ones."""
    if isinstance(names, str):
        names = names.split(",")
    asked = [("disable_passes", n.strip()) for n in names if n.strip()]
    asked += [(DISABLE_PASSES_ENV, n.strip()) for n in os.environ.get(DISABLE_PASSES_ENV, "").split(",") if n.strip()]
    known = switchable()
    for where, name in asked:
        if name not in known:
            raise UnknownPass(_why_not(name, where, known))
    return tuple(n for n in known if n in {name for _, name in asked})


def _why_not(name: str, where: str, known: list[str]) -> str:
    found = next((p for p in PASS_LIST if p.name == name), None)
    if found is None:
        what = f"{name!r} (in {where}) is no pass of fuser.pipeline.pass_list"
    elif found.required:
        what = f"{name!r} (in {where}) cannot be switched off: a fused forward needs it"
    else:
        what = f"{name!r} (in {where}) is switched off with {found.switch!r}"
    return f"{what}; the passes that can be switched off are: {', '.join(known)}"


class UnknownPass(ValueError):
    """A name in ``disable_passes`` or ``FUSER_DISABLE_PASSES`` that switches no pass off."""


def run_pass_list(f: Fusing) -> Fusing:
    """Run every step of :data:`PASS_LIST` in order, but those ``f.off`` switches off."""
    for p in PASS_LIST:
        if not p.inside and p.switch not in f.off:
            p.run(f)
    return f


def describe() -> str:
    """The list as text, a line a step: name, what it does, and how to switch it off."""
    lines = []
    for p in PASS_LIST:
        how = "required" if p.required else f"off with {p.switch}" if p.switch != p.name else "switchable"
        lines.append(f"{'  ' if p.inside else ''}{p.name:<{20 if p.inside else 22}} {how:<24} {p.does}")
    return "\n".join(lines)
