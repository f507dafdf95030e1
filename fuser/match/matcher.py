"""match: find the chains of a traced model that a pattern's reference function computes.

Matching runs in two rounds per candidate, so that a pattern is written once for every size
and dtype yet never matches something that computes different math:

1. *loose*: the reference, traced at its example sizes, is compared with the model from an
   anchor (a node computing the pattern's output) backwards, by op name only. This binds the
   pattern's tensor inputs to model nodes.
2. *exact*: the reference is traced again with the bound inputs' real shapes and dtypes and
   compared op by op, attribute by attribute, literal by literal. ``Param`` literals are
   captured; any other difference rejects the candidate with the node and the reason.

Commutative ops are tried both ways round. A match must be self-contained: an intermediate
used outside it (fan-out) rejects it, since the fused kernel would not produce that value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from fuser.canon.canonicalize import COMMUTATIVE, INPUT, META, COp
from fuser.pattern import Pattern, is_param
from fuser.match.pattern_graph import PatternGraph, trace_pattern
from fuser.trace.tracing import Traced


@dataclass
class Match:
    pattern: Pattern
    inputs: list[fx.Node]  # model node bound to each pattern input, in order
    outputs: list[fx.Node]  # model node for each pattern output, in order
    nodes: set[fx.Node]  # every model node the matched ops stand for
    primary: list[fx.Node]  # the model node of each matched pattern op
    params: dict[str, Any]
    sizes: dict[str, int]
    dtypes: dict[str, torch.dtype]
    output_names: list[str] | None = None  # the pattern's names of ``outputs``, when it names them
    # the reference's name of each model node it names: its inputs by their parameters, a value
    # it binds to a variable by that variable (fuser.match.reference_names), for the kernel's locals
    names: dict[fx.Node, str] = field(default_factory=dict)


@dataclass
class Rejection:
    pattern: str
    anchor: str
    reason: str
    category: str  # dtype | shape | literal | fan-out | structure | order | lowering | validation | no match | replaced


@dataclass
class _State:
    p2m: dict = field(default_factory=dict)  # pattern node -> model node
    bound: dict = field(default_factory=dict)  # pattern input -> model node
    params: dict = field(default_factory=dict)

    def copy(self) -> "_State":
        return _State(dict(self.p2m), dict(self.bound), dict(self.params))


class _Comparer:
    """Structural comparison of a pattern graph with the model from given anchors."""

    def __init__(self, pg: PatternGraph, mcops: dict[fx.Node, COp], exact: bool, taken: set):
        self.pg, self.mcops, self.exact, self.taken = pg, mcops, exact, taken
        self.reason = ""
        self.category = "structure"

    def fail(self, reason: str, category: str = "structure") -> bool:
        if not self.reason:
            self.reason, self.category = reason, category
        return False

    def node(self, pn: fx.Node, mn: fx.Node, st: _State) -> bool:
        if not self.exact:
            # A cast the reference needs at its example dtype is a no-op at another (x.float()
            # on fp32): the loose round, which only binds inputs, looks through a cast that one
            # side has and the other lacks.
            p_cast = self.pg.cops[pn].op == "cast"
            m_cast = mn in self.mcops and self.mcops[mn].op == "cast"
            if p_cast and not m_cast:
                pn = self.pg.cops[pn].args[0]
            elif m_cast and not p_cast and self.pg.cops[pn].kind != INPUT:
                mn = self.mcops[mn].args[0]
        pc = self.pg.cops[pn]
        if pc.kind == INPUT:
            if pn in st.bound and st.bound[pn] is not mn:
                return self.fail(f"input `{pn.name}` would be bound to both `{st.bound[pn].name}` and `{mn.name}`")
            st.bound[pn] = mn
            return True
        if pn in st.p2m:
            return st.p2m[pn] is mn or self.fail(f"`{mn.name}` is not the value the pattern reuses")
        if mn in st.p2m.values() or mn in self.taken or mn not in self.mcops:
            return self.fail(f"`{mn.name}` already belongs to another match")
        mc = self.mcops[mn]
        if mc.op != pc.op or self.exact and mc.kind != pc.kind or len(mc.args) != len(pc.args):
            return self.fail(f"`{mn.name}` computes {mc.op} where the pattern has {pc.op}")
        if self.exact and mc.attrs != pc.attrs:
            differ = {k for k in dict(mc.attrs).keys() | dict(pc.attrs).keys() if mc.attr(k) != pc.attr(k)}
            category = "dtype" if "dtype" in differ else "shape" if differ & {"shape", "stride", "offset", "dim"} else "literal"
            return self.fail(f"`{mn.name}` ({mc.op}) has {dict(mc.attrs)} where the pattern has {dict(pc.attrs)}", category)
        st.p2m[pn] = mn
        orders = [pc.args]
        if pc.op in COMMUTATIVE and len(pc.args) == 2:
            orders.append(pc.args[::-1])
        for args in orders:
            trial = st.copy()
            if all(self.arg(pa, ma, trial, mn) for pa, ma in zip(args, mc.args)):
                st.__dict__.update(trial.__dict__)
                return True
        return False

    def arg(self, pa, ma, st: _State, where: fx.Node) -> bool:
        if isinstance(pa, fx.Node) != isinstance(ma, fx.Node):
            return self.fail(f"`{where.name}` mixes a tensor and a literal differently from the pattern")
        if isinstance(pa, fx.Node):
            return self.node(pa, ma, st)
        if not self.exact:
            return True
        if is_param(pa):
            name = self.pg.param_names.get(id(pa))
            if isinstance(ma, bool) or not isinstance(ma, (int, float)):
                return self.fail(f"`{where.name}`: parameter {name} bound to {ma!r}", "literal")
            if name in st.params and st.params[name] != ma:
                return self.fail(f"`{where.name}`: parameter {name} is {st.params[name]} and {ma} at once", "literal")
            st.params[name] = ma
            return True
        if type(pa) is bool or type(ma) is bool:
            same = pa is ma
        else:
            same = pa == ma
        return same or self.fail(f"`{where.name}`: literal {ma!r} where the pattern has {pa!r}", "literal")

    def outputs(self, anchors: list[fx.Node], st: _State) -> bool:
        """Match pattern outputs in order; outputs after the first are searched for."""
        first, rest = self.pg.outputs[0], self.pg.outputs[1:]
        if not self.node(first, anchors[0], st):
            return False
        return self._rest(rest, st)

    def _rest(self, rest: list[fx.Node], st: _State) -> bool:
        if not rest:
            return True
        pn, tail = rest[0], rest[1:]
        if pn in st.p2m or pn in st.bound:
            return self._rest(tail, st)
        op = self.pg.cops[pn].op
        telling = None  # a candidate that failed on a literal, dtype or shape says more
        for mn, mc in self.mcops.items():
            if mc.op != op:
                continue
            trial = st.copy()
            saved = (self.reason, self.category)
            self.reason = ""
            if self.node(pn, mn, trial) and self._rest(tail, trial):
                st.__dict__.update(trial.__dict__)
                return True
            if self.category != "structure" and telling is None:
                telling = (self.reason, self.category)
            self.reason, self.category = saved
        if telling:
            return self.fail(*telling)
        return self.fail(f"no node computes the pattern's output `{pn.name}` ({op}) alongside the others")


def _through_casts(cops, node):
    while isinstance(node, fx.Node) and node in cops and cops[node].op == "cast":
        node = cops[node].args[0]
    return node


def _structural_choices(pattern: Pattern) -> list[dict[str, int]]:
    """Structural values to try: the defaults first, then each searched value, largest first."""
    structural = pattern.structural
    if not structural:
        return [{}]
    choices = [{k: int(v) for k, v in structural.items()}]
    for name, p in structural.items():
        # Largest first: a shorter chain also matches a prefix of a longer one.
        for value in sorted(p.search, reverse=True):
            choice = dict(choices[0], **{name: int(value)})
            if choice not in choices:
                choices.append(choice)
    return choices


def _sizes_from_binding(pattern: Pattern, bound: dict[str, fx.Node], traced: Traced):
    """Solve the pattern's shape symbols from the bound inputs. Returns (sizes, error)."""
    sizes: dict[str, int] = {}
    for name, spec in pattern.inputs.items():
        node = bound[name]
        value = traced.value(node)
        dims = list(spec.dims)
        if not isinstance(value, torch.Tensor):
            return None, f"input {name} (`{node.name}`) is not a tensor"
        if "..." in dims:
            at = dims.index("...")
            extra = value.dim() - (len(dims) - 1)
            if extra < 0:
                return None, f"input {name} needs at least {len(dims) - 1} dims, `{node.name}` has {value.dim()}"
            middle = tuple(int(s) for s in value.shape[at : at + extra])
            if sizes.setdefault("...", middle) != middle:
                return None, f"the '...' dims are {sizes['...']} and {middle} at once"
            dims[at : at + 1] = ["..."] * extra
        if value.dim() != len(dims):
            return None, f"input {name} of {pattern.name} must have {len(dims)} dims, `{node.name}` has {value.dim()}"
        batch = traced.batch_dims(node)
        for i, d in enumerate(dims):
            if d == "...":
                if i in batch:
                    return None, f"dim {i} of `{node.name}` follows the batch; '...' dims must be static"
                continue
            if d == "T":
                if i not in batch:
                    return None, f"dim {i} of `{node.name}` should be the token dim"
                continue
            if i in batch:
                return None, f"dim {i} of `{node.name}` follows the batch; the pattern has {d} there"
            size = int(value.shape[i])
            if d.isdigit():
                if size != int(d):
                    return None, f"dim {i} of `{node.name}` is {size}; the pattern needs {d}"
            elif sizes.setdefault(d, size) != size:
                return None, f"size {d} is {sizes[d]} and {size} at once (`{node.name}`)"
    return sizes, None


def match_pattern(pattern: Pattern, traced: Traced, mcops: dict[fx.Node, COp], taken: set):
    """All non-overlapping matches of one pattern, latest anchors first, and the rejections."""
    matches: list[Match] = []
    tried: dict[fx.Node, Match | Rejection] = {}  # anchor -> what matching there gave
    device = next((v.device for v in traced.example_inputs if isinstance(v, torch.Tensor)), "cpu")
    loose_default = trace_pattern(pattern, pattern.example, {}, None)
    anchor_op = loose_default.cops[_through_casts(loose_default.cops, loose_default.outputs[0])].op
    for mn in reversed(list(mcops)):
        if mn in taken or mcops[mn].op not in (anchor_op, "cast"):
            continue
        if mcops[_through_casts(mcops, mn)].op != anchor_op:
            continue
        found = _match_at(pattern, traced, mcops, mn, taken | _claimed(matches), device)
        if isinstance(found, Match):
            matches.append(found)
        if found is not None:
            tried[mn] = found
    return matches, [r for mn, r in tried.items() if isinstance(r, Rejection) and not _said_better(mn, r, tried, mcops)]


def _said_better(anchor: fx.Node, rejection: Rejection, tried: dict, mcops) -> bool:
    """Is the rejection at a cast tried as the anchor (its source computes the pattern's output)
    only structural, where the source itself matched or was rejected for a telling reason?"""
    source = _through_casts(mcops, anchor)
    other = tried.get(source)
    if source is anchor or rejection.category != "structure" or other is None:
        return False
    return isinstance(other, Match) or other.category != "structure"


def _claimed(matches: list[Match]) -> set:
    return set().union(*(m.nodes for m in matches)) if matches else set()


def _match_at(pattern, traced, mcops, anchor, taken, device):
    """A Match at this anchor, a Rejection if it loosely matched but failed, else None."""
    for structural in _structural_choices(pattern):
        loose = trace_pattern(pattern, pattern.example, {}, structural)
        cmp = _Comparer(loose, mcops, exact=False, taken=taken)
        st = _State()
        if not cmp.outputs([anchor], st):
            continue
        names = list(pattern.inputs)
        bound = {names[loose.inputs.index(p)]: m for p, m in st.bound.items()}
        if len(bound) != len(names):
            continue

        def reject(reason, category):
            return Rejection(pattern.name, anchor.name, reason, category)

        dtypes = {}
        for name, node in bound.items():
            value = traced.value(node)
            dtype = getattr(value, "dtype", None)
            if dtype not in pattern.inputs[name].dtypes:
                allowed = ", ".join(str(d).replace("torch.", "") for d in pattern.inputs[name].dtypes)
                return reject(f"input {name} (`{node.name}`) is {dtype}; the pattern takes {allowed}", "dtype")
            dtypes[name] = dtype
        sizes, error = _sizes_from_binding(pattern, bound, traced)
        if error:
            return reject(error, "shape")
        exact_pg = trace_pattern(pattern, sizes, dtypes, structural, device, named=True)
        cmp = _Comparer(exact_pg, mcops, exact=True, taken=taken)
        st = _State()
        if not cmp.outputs([anchor], st):
            return reject(cmp.reason, cmp.category)
        inputs = [st.bound[p] for p in exact_pg.inputs]
        outputs = [st.p2m[p] for p in exact_pg.outputs]
        nodes = set()
        for pn, mn in st.p2m.items():
            nodes.update(mcops[mn].covers)
        problem = _containment_problem(nodes, outputs, inputs, mcops)
        if problem:
            return reject(problem, "fan-out")
        params = dict(st.params)
        params.update({k: v for k, v in structural.items()})
        problem = pattern.constraint_problem(params)
        if problem:
            return reject(problem, "literal")
        primary = [mn for pn, mn in st.p2m.items()]
        names = None
        if pattern.outputs is not None:
            outputs, names = _read_outputs(outputs, list(pattern.outputs), nodes, mcops)
        reference_names = _model_names(exact_pg, st)
        return Match(pattern, inputs, outputs, nodes, primary, params, sizes, dtypes, names, reference_names)
    return None


def _model_names(pg: PatternGraph, st: _State) -> dict[fx.Node, str]:
    """The reference's name of each model node a named pattern value stands for."""
    pairs = list(st.bound.items()) + list(st.p2m.items())
    names: dict[fx.Node, str] = {}
    for pn, mn in pairs:
        if pn in pg.names:
            names.setdefault(mn, pg.names[pn])
    return names


def _read_outputs(outputs: list, names: list, nodes: set, cops) -> tuple[list, list]:
    """The outputs someone outside the chain reads, with their names (all, if none is read)."""
    read = [i for i, node in enumerate(outputs) if _used_outside(node, nodes, cops)]
    if not read:
        return outputs, names
    return [outputs[i] for i in read], [names[i] for i in read]


def _used_outside(node: fx.Node, nodes: set, cops) -> list[fx.Node]:
    """Users of ``node`` outside the match that need its value. A no-op cast is looked
    through; a size read (x.shape[0]) counts only if what it feeds is outside too."""
    found = []
    for user in node.users:
        if user in nodes:
            continue
        cop = cops.get(user)
        if cop is not None and cop.op == "identity":
            found += _used_outside(user, nodes, cops)
        elif cop is not None and cop.kind == META:
            if _used_outside(user, nodes, cops):
                found.append(user)
        else:
            found.append(user)
    return found


def _containment_problem(nodes: set, outputs: list, inputs: list, cops) -> str | None:
    for inp in inputs:
        if inp in nodes:
            return f"`{inp.name}` is both an input and an intermediate of the chain"
    if len(set(outputs)) != len(outputs):
        return "two pattern outputs are the same model value"
    for node in nodes:
        if node in outputs:
            continue
        outside = [u.name for u in _used_outside(node, nodes, cops)]
        if outside:
            return f"fan-out: intermediate `{node.name}` is also used by `{outside[0]}` outside the chain"
    return None


def match_all(patterns: list[Pattern], traced: Traced, mcops: dict[fx.Node, COp]):
    """Match every pattern, biggest chains first; a node belongs to one match at most."""
    ordered = sorted(patterns, key=lambda p: (-p.priority, -_size(p), p.name))
    matches, rejections, taken = [], [], set()
    for pattern in ordered:
        found, rejected = match_pattern(pattern, traced, mcops, taken)
        matches += found
        rejections += rejected
        taken |= _claimed(found)
        rejections += _said_about(pattern, bool(found or rejected))
    return matches, rejections


def _said_about(pattern: Pattern, matched: bool) -> list[Rejection]:
    """What the report says of a pattern file the user gave beyond its matches: that it was
    used instead of a built-in of the same name, or that it matched nothing (so a typo in a
    pattern is not mistaken for a chain the model lacks). Built-ins that match nothing are the
    rule, not news, and are not listed."""
    said = []
    if pattern.replaces is not None:
        reason = f"{pattern.path} is used instead of the built-in {pattern.replaces} (same name)"
        said.append(Rejection(pattern.name, "-", reason, "replaced"))
    if not pattern.builtin and not matched:
        said.append(Rejection(pattern.name, "-", f"matched no chain in this module ({pattern.path})", "no match"))
    return said


def _size(pattern: Pattern) -> int:
    pg = trace_pattern(pattern, pattern.example, {}, None)
    return sum(1 for c in pg.cops.values() if c.kind != INPUT)


__all__ = ["Match", "Rejection", "match_all", "match_pattern", "trace_pattern"]
