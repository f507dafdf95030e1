"""passes: the planning passes, from canonical ops to the kernels to splice.

They run in the order :data:`fuser.pipeline.pass_list.PASS_LIST` lists them, each by its name
(and each but ``place`` can be switched off there). Each takes the :class:`Planning` (what
the passes before it made) and returns it:

1. ``fuse_patterns``: each pattern match (:mod:`fuser.match.matcher`) a region, lowered and emitted
   as its kernel; a match that does not lower is a rejection naming the pattern;
2. ``fuse_generic``: the glue no pattern took, grouped into regions (:mod:`fuser.regions.builder`),
   each lowered as a row program; an op that does not lower stays eager, the rest around it
   is fused; one op alone gets a kernel where :mod:`fuser.regions.lone_ops` says it is faster;
3. ``widen``: single unfused ops pulled into the kernel next to them;
4. ``merge``: a kernel with the kernel that reads its outputs, then kernels that read the same
   activation, while the union lowers as one row program;
5. ``store_in_place``: a kernel whose output is only copied into a slice writes it there;
   then ``pdl``: each row program launched with programmatic dependent launch, on a GPU that has it;
6. ``validate``: every kernel against eager on one recorded run (:mod:`fuser.validate.against_eager`); a
   merged kernel that disagrees falls back to its parts, any other one stays eager;
7. ``place``: the surviving kernels placed in the program again.

A kernel is lowered (:mod:`fuser.lower.lowerer`), rendered and loaded (:mod:`fuser.codegen.emit`) whenever a
pass makes a region; a region the next pass changes is lowered again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import torch
import torch.fx as fx

from fuser.canon.canonicalize import REDUCING
from fuser.codegen.emit import KernelSpec, emit
from fuser.codegen.kernel import Kernel
from fuser.lower.lowerer import LoweringError, lower_region
from fuser.lower.row_program import operand
from fuser.match.matcher import Rejection, match_all
from fuser.pipeline import growing_state
from fuser.pipeline.growing_state import at_growing_length
from fuser.pattern import is_hand_written
from fuser.regions.growth import feeds, merged, siblings, stored_in_place, widened
from fuser.regions.builder import Region, RegionBuilder, fusible
from fuser.ir.canonical_op import HEAVY
from fuser.ir.report import Rejected
from fuser.trace.tracing import Traced
from fuser.validate.against_eager import record_values, validate_all


@dataclass
class Planning:
    """What the passes hand each other: the traced module and its canonical ops (read only),
    the region builder that owns where each region runs, the kernels so far, and what was
    rejected (by pattern) or left eager (by node) and why."""

    module: torch.nn.Module
    traced: Traced
    cops: dict
    patterns: list
    builder: RegionBuilder
    kernels: list[Kernel] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    failed: dict[fx.Node, str] = field(default_factory=dict)
    taken: set = field(default_factory=set)  # nodes a pattern's kernel covers, or kept eager before any pass
    held: dict[fx.Node, str] = field(default_factory=dict)  # nodes kept eager before any pass -> why

    @property
    def parameters(self) -> frozenset:
        return self.builder.parameters


def planning(module: torch.nn.Module, traced: Traced, cops: dict, patterns: list) -> Planning:
    """The state before the first pass."""
    parameters = frozenset(
        n for n in traced.graph.nodes if n.op == "get_attr" and isinstance(traced.value(n), torch.nn.Parameter)
    )
    return Planning(module, traced, cops, list(patterns), RegionBuilder(traced.graph, cops, parameters, traced.value, traced.batch_dims))


def hold_growing_state(p: Planning) -> Planning:
    """Glue at the length of a cache that grows each call stays eager (:mod:`fuser.pipeline.growing_state`)."""
    p.held = at_growing_length(p.traced, lambda n: n in p.cops and fusible(p.cops[n]),
                               lambda n: getattr(p.cops.get(n), "kind", None) == HEAVY)
    p.taken |= set(p.held)
    p.failed.update(p.held)
    return p


def fuse_patterns(p: Planning) -> Planning:
    """Each pattern match a region and its kernel (:func:`build`)."""
    matches, rejections = match_all(p.patterns, p.traced, p.cops)
    p.rejected += [Rejected(r.pattern, r.anchor, r.category, r.reason) for r in rejections]
    for match in matches:
        region = p.builder.from_match(match)
        if not isinstance(region, Rejection) and region.covered & set(p.held):
            region = Rejection(region.pattern, region.outputs[0].name, growing_state.REASON, "state")
        if isinstance(region, Rejection):
            p.rejected.append(Rejected(region.pattern, region.anchor, region.category, region.reason))
        elif build(p, region):
            p.taken |= region.covered
    return p


def fuse_generic(p: Planning) -> Planning:
    """The glue no pattern took, in regions, each a row program (:func:`build`); a lone op
    left to PyTorch (:mod:`fuser.regions.lone_ops`) is reported with the reason."""
    for region in p.builder.generic(p.taken):
        build(p, region)
    for node, why in p.builder.left_alone.items():
        p.failed.setdefault(node, why)
    return p


def build(p: Planning, region: Region) -> bool:
    """Lower, render and load ``region``'s kernel; False when it does not lower. A generic
    region whose one op does not lower is built again without it."""
    try:
        spec = kernel_spec(region, p.traced, p.cops)
    except LoweringError as e:
        p.builder.uncommit(region)
        if region.match:
            p.rejected.append(Rejected(region.pattern, region.outputs[0].name, "lowering", str(e)))
            return False
        if e.node in region.covered:  # one op is the reason: it stays eager, the rest is fused around it
            p.failed[e.node] = f"no row-program lowering here: {e}"
            rest = [n for n in region.covered if n is not e.node and fusible(p.cops[n])]
            return any([build(p, part) for part in p.builder.regroup(rest)])
        p.failed.update({n: f"generic chain not lowered: {e}" for n in region.nodes})
        return False
    path, launch = emit(spec)
    p.kernels.append(Kernel(region, path, launch, spec))
    return True


def kernel_spec(region: Region, traced: Traced, cops) -> KernelSpec:
    if is_hand_written(region.template):
        inputs = [operand(traced, n, f"in{i}") for i, n in enumerate(region.inputs)]
        names = region.match.output_names or [f"out{i}" for i in range(len(region.outputs))]
        outputs = [operand(traced, n, name) for n, name in zip(region.outputs, names)]
        return KernelSpec(region.template, region.pattern, inputs, outputs, region.params, region.match.sizes)
    program = lower_region(traced, cops, region.nodes, region.inputs, region.outputs, region.stores, region.names)
    if region.template == "pointwise" and any(cops[n].op in REDUCING for n in region.nodes):
        raise LoweringError("the pointwise template takes no reductions")
    sizes = dict(region.match.sizes) if region.match else {}
    return KernelSpec(region.template, region.pattern, program.inputs, program.outputs, region.params, sizes, program)


def widen(p: Planning) -> Planning:
    """Pull single unfused ops into the kernel next to them (re-lowered; kept only if it lowers).
    Again while one grows: an op whose operand another kernel has just taken in (Olmo2's
    residual add after its post-feedforward norm, reading the sum the kernel before now
    writes) may join then."""
    kernels, builder, traced, cops = p.kernels, p.builder, p.traced, p.cops
    covered = set().union(*(k.region.covered for k in kernels)) if kernels else set()
    leftovers = [n for n in traced.graph.nodes if n in cops and fusible(cops[n]) and n not in covered and n not in p.held]
    grew = True
    while grew:
        grew = False
        for i, kernel in enumerate(kernels):
            left = [n for n in leftovers if n not in covered]
            region = widened(builder, kernel.region, left) if left else None
            wider = lowered(region, traced, cops) if region else None
            if wider is not None:
                kernels[i] = wider
                grew = grew or not region.covered <= covered  # (an op it took may stay a view: no growth)
                covered |= region.covered
    return p


def lowered(region: Region, traced: Traced, cops, parts: list | None = None) -> Kernel | None:
    """``region`` lowered, rendered and loaded as a kernel; None if it does not lower."""
    try:
        spec = kernel_spec(region, traced, cops)
    except LoweringError:
        return None
    path, launch = emit(spec)
    return Kernel(region, path, launch, spec, parts or [])


#: Largest register block (padded elements) a merge may create: beyond it a program spills.
MERGED_BLOCK_LIMIT = 1 << 15


def merge(p: Planning) -> Planning:
    """Merge a kernel with a kernel that reads its outputs, and then kernels that read the same
    activation, while the union lowers as one row program and has a place in the program: one
    launch instead of two, and values passed between them never leave registers."""
    failed: set = set()
    for related in (feeds, lambda a, b: siblings(p.builder, a, b, p.traced)):
        again = True
        while again:
            again = _merge_one(p.kernels, p.builder, p.traced, p.cops, related, failed)
    return p


def _merge_one(kernels: list[Kernel], builder: RegionBuilder, traced: Traced, cops, related, failed: set) -> bool:
    """Merge the first pair of kernels ``related`` says belong together; False if none can be."""
    for a in kernels:
        for b in kernels:
            key = (id(a.region), id(b.region))
            if a is b or key in failed or not related(a.region, b.region):
                continue
            region = merged(builder, a.region, b.region)
            union = lowered(region, traced, cops, [a, b]) if region else None
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


def store_in_place(p: Planning) -> Planning:
    """A kernel whose output is only copied into a slice of another tensor (``x[i] = out``)
    writes it there itself: the copy's launch goes."""
    kernels, builder, traced, cops = p.kernels, p.builder, p.traced, p.cops
    for node in traced.graph.nodes:
        if cops.get(node) is None or cops[node].op != "setitem":
            continue
        for i, kernel in enumerate(kernels):
            region = stored_in_place(builder, kernel.region, node, traced)
            storing = lowered(region, traced, cops, [kernel]) if region else None  # falls back to the copy
            if storing is not None:
                builder.commit(region)
                kernels[i] = storing
                break
    return p


def launch_pdl(p: Planning) -> Planning:
    """Each row-program kernel launched with programmatic dependent launch where the module runs
    on an NVIDIA GPU that has it (compute capability 9.0 and later; never in the interpreter): the GPU
    may launch it while the kernel before it still runs, and its first instruction waits
    (``gdc_wait``) until that kernel has finished and its writes are visible, so only the launch
    and the wait overlap, never a read or a write. It then lets the next kernel launch at once
    (``gdc_launch_dependents``), which waits the same way; a kernel launched without PDL (a
    cuBLAS GEMM) waits for it as a stream always does. Inside a CUDA graph the dependency is an
    edge of the graph."""
    if not has_pdl(p.traced):
        return p
    p.kernels = [_with_pdl(kernel) for kernel in p.kernels]
    return p


def has_pdl(traced: Traced) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.version.hip is not None:  # NVIDIA's griddepcontrol only
        return False
    devices = {v.device for v in traced.example_inputs if isinstance(v, torch.Tensor) and v.device.type == "cuda"}
    return bool(devices) and all(torch.cuda.get_device_capability(d) >= (9, 0) for d in devices)


def _with_pdl(kernel: Kernel) -> Kernel:
    """The kernel (and the parts it falls back to) rendered to launch with PDL, if a row program."""
    spec = kernel.spec
    if spec is None or spec.program is None or spec.pdl:
        return kernel
    spec = replace(spec, pdl=True)
    path, launch = emit(spec)
    return Kernel(kernel.region, path, launch, spec, [_with_pdl(part) for part in kernel.parts])


def validate(p: Planning) -> Planning:
    """Every kernel against eager on one recorded run; a merged (or stored in place) kernel that
    disagrees is replaced by its parts, checked in turn; any other one stays eager, reported."""
    values = record_values(p.module, p.traced, p.cops)
    pending = list(zip(p.kernels, validate_all(p.kernels, values, p.cops)))
    p.kernels = []
    while pending:
        kernel, problem = pending.pop(0)
        if problem is None:
            p.kernels.append(kernel)
            continue
        region = kernel.region
        if kernel.parts:  # merged or stored in place: what it was made of may still be right
            p.rejected.append(Rejected(region.pattern, region.outputs[0].name, "validation", f"{problem}; run unmerged"))
            pending[:0] = zip(kernel.parts, validate_all(kernel.parts, values, p.cops))
            continue
        p.rejected.append(Rejected(region.pattern, region.outputs[0].name, "validation", problem))
        p.failed.update({n: f"fused kernel disagreed with eager ({problem})" for n in region.nodes})
    return p


def place(p: Planning) -> Planning:
    """Place the surviving kernels again: a dropped one no longer produces its values early."""
    p.builder.unplace_all()
    p.kernels.sort(key=lambda k: p.builder.order[k.region.position])
    for kernel in list(p.kernels):
        if p.builder.replace(kernel.region) is None:
            p.kernels.remove(kernel)
            p.failed.update({n: "no valid place to run it once other kernels were dropped" for n in kernel.region.nodes})
    return p
