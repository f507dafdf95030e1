"""growth: regions made larger after they are first grouped (:mod:`fuser.regions.builder`), each step
kept only if the larger region still lowers and has a place in the program:

- :func:`widened`: a region takes in the unfused ops next to it;
- :func:`merged`: a region and one that reads its outputs (:func:`feeds`), or two that read
  the same activation (:func:`siblings`), become one when the union lowers as one row program
  and has a place to run;
- :func:`stored_in_place`: a region whose result is only copied into a slice of another tensor
  writes it there.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.fx as fx

from fuser.canon.canonicalize import VIEW
from fuser.pattern import is_hand_written
from fuser.regions.builder import Region, RegionBuilder, fusible, row_template


def widened(builder: RegionBuilder, region: Region, leftovers: list[fx.Node]) -> Region | None:
    """``region`` with the unfused ops next to it pulled in, or None if none can be.

    An op joins when it reads the region's values and otherwise only values that exist already
    (inputs, a heavy op's result, another kernel's output) — an epilogue, it becomes an extra
    output (Gemma's last residual add after its post-feedforward norm) — or when the region
    reads it — a prologue, an extra output too when others read it as well (a residual add read
    by the next norm and the next residual: one kernel writes the sum and the norm). Each op
    joins only if the kernel still has a place to run with it.
    """
    if is_hand_written(region.template):
        return None
    pending = set(leftovers)
    wider = None
    grew = True
    while grew:  # an op that joined may make the one before it a prologue too
        grew = False
        for node in leftovers:
            current = wider or region
            covered = current.covered
            if node not in pending or node in covered or builder.view_of_input(node):
                continue
            args = builder.args_of(node)
            epilogue = any(a in covered for a in args) and all(a in covered or a not in pending for a in args)
            prologue = any(u in covered for u in builder.users_outside(node, set()))
            # A constant (``x.new_zeros(shape)``) reads no value: a kernel of its rows may write it.
            constant = builder.cops[node].op == "full"
            if epilogue or prologue or constant:
                candidate = _grown(builder, region, current, node)
                if candidate is not None:
                    wider = candidate
                    pending.discard(node)
                    grew = True
    return wider


def _grown(builder: RegionBuilder, region: Region, current: Region, node: fx.Node) -> Region | None:
    """``current`` (``region`` grown so far) with ``node`` added, placed; None if it has no place."""
    covered = current.covered | {node}
    nodes = sorted(set(current.nodes) | {node}, key=builder.order.get)
    inputs, outputs = builder.boundary(nodes)
    if region.match:  # the pattern's outputs first, in its order; a value nobody reads now is not written
        outputs = [o for o in region.outputs if o in outputs] + [o for o in outputs if o not in region.outputs]
    position, _, _ = builder.placement(covered, inputs, outputs)
    if position is None:
        return None
    grown = Region(nodes, inputs, outputs, region.template, region.match, covered, position, names=region.names, note=region.note)
    return builder.drop_view_outputs(grown)


def feeds(a: Region, b: Region) -> bool:
    """Does ``b`` read a value ``a`` computes?"""
    return any(out in b.inputs for out in a.outputs)


def siblings(builder: RegionBuilder, a: Region, b: Region, traced) -> bool:
    """Do ``a`` and ``b`` read the same activation (one floating-point tensor, or views of it,
    or the same per-token positions, as MoE's gathers by ``perm``; one computed at run time
    and broadcast over the tokens counts too, as the RoPE ``cos`` and ``sin`` of a decode step
    whose positions are one row for the whole batch)? Two such kernels run as one (a
    horizontal fusion) where the program order allows."""

    def activations(region):
        return {
            builder.alias[n] for n in region.inputs
            if n.op != "get_attr" and _activation_or_positions(traced.value(n))
        }  # fmt: skip

    return bool(activations(a) & activations(b))


def _activation_or_positions(value) -> bool:
    """Floating-point or complex values (Llama-4's rotary ``freqs_cis``), and positions."""
    return value.is_floating_point() or value.is_complex() or value.dtype in (torch.int64, torch.int32)


def merged(builder: RegionBuilder, a: Region, b: Region) -> Region | None:
    """``a`` and ``b`` (one reads the other's outputs, or both read the same activation) as one
    region lowered from the graph, or None if they cannot run at one point of the program.

    Both run one program per token row, so the union does too: values passed between them stay
    in registers instead of a round trip through memory, and one launch goes. A region with a
    hand-written template joins as the ops its pattern matched (lowered like any others).
    """
    covered = a.covered | b.covered
    nodes, recomputed = [], set()
    for region in (a, b):
        absorbed = {c for n in region.nodes for c in builder.cops[n].covers[1:]}
        for node in region.nodes:
            cop = builder.cops[node]
            if node in absorbed or node in nodes:
                continue
            if fusible(cop):
                nodes.append(node)
                if node not in region.covered:
                    recomputed.add(node)
            elif cop.kind == VIEW:
                covered.discard(node)  # a view stays in the graph, the kernel reads it
            else:
                return None
    nodes = builder.peel(sorted(nodes, key=builder.order.get))
    covered -= {n for n in covered if builder.cops[n].op == "reshape" and n not in nodes}
    recomputed -= covered
    inputs, outputs = builder.boundary(nodes, recomputed)
    position, _, _ = builder.placement(covered, inputs, outputs)
    if position is None:
        return None
    template = row_template(nodes, builder.cops)
    parts = (a.parts or (a.pattern,)) + (b.parts or (b.pattern,))
    params = {**a.qualified_params(), **b.qualified_params()}
    names = {**b.names, **a.names}  # a value both name (an input they share) keeps the first part's name
    note = "; ".join(dict.fromkeys(r.note for r in (a, b) if r.note))  # lone ops fused alone, now together
    region = Region(nodes, inputs, outputs, template, None, covered, position, parts, params, names=names, note=note)
    return builder.drop_view_outputs(region)


def stored_in_place(builder: RegionBuilder, region: Region, setitem: fx.Node, traced) -> Region | None:
    """``region`` writing its output ``value`` straight into ``x[index]`` for the in-place
    ``x[index] = value`` that follows it, or None if it cannot: one launch instead of a kernel
    and a copy. The kernel then runs where the write was, so every read of ``x`` keeps its order.
    """
    target, index, value = setitem.args[:3]
    copies = []  # no-op casts between the value and the write
    while isinstance(value, fx.Node) and builder.cops[value].op == "identity" and len(value.users) == 1:
        copies.append(value)
        value = builder.cops[value].args[0]
    if value not in region.outputs or region.stores or set(value.users) != {copies[-1] if copies else setitem}:
        return None
    if not isinstance(target, fx.Node) or not _static_index(index):
        return None
    dest, shadow = (traced.shadows[target.name][k][index] for k in (0, 1))
    result, result_shadow = traced.shadows[value.name]
    if dest.shape != result.shape or shadow.shape != result_shadow.shape or dest.dtype != result.dtype:
        return None  # a broadcasting or casting write
    if traced.batch_dims(value) != (0,) or dest.shape[0] == shadow.shape[0]:
        return None  # the kernel writes one row per token: the target must follow the tokens too
    covered = region.covered | {setitem, *copies}
    position, _, _ = builder.placement(covered, region.inputs, region.outputs)
    if position is not setitem:
        return None
    return replace(region, covered=covered, position=position, stores={value: setitem})


def _static_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return all(
        p is Ellipsis or p is None or isinstance(p, int)
        or (isinstance(p, slice) and all(v is None or isinstance(v, int) for v in (p.start, p.stop, p.step)))
        for p in parts
    )  # fmt: skip
