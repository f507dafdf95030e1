"""regions: decide which nodes become one fused kernel each.

Pattern matches come first. The glue no pattern claims is grouped by the generic fallback:
connected elementwise/reduction nodes at the same *depth*, where a node's depth counts how
often its longest path from the inputs leaves the fusible glue through a barrier (GEMMs,
leaves, in-place writes, unsupported ops, views a kernel cannot take, pattern regions). Nodes
separated by a barrier never share a kernel, which keeps every region free of cycles through
the rest of the graph.

Then regions grow (:mod:`fuser.regions.growth`): they take in the unfused ops next to them, merge
with one that reads their outputs or reads the same activation, and write a result that is
only copied into a slice of another tensor there.

A region of one op alone (a LayerNorm between a residual and a GEMM) saves no launch: it is
made only where :mod:`fuser.regions.lone_ops` says fuser's kernel is faster than PyTorch's for
that op (a table measured offline per GPU, else a default), and the decision is kept for the
report either way. Lone ops left to PyTorch that read the same activation run as one kernel:
together they save launches.

Every region must also be safe to run at one point of the program — the place of its last
node, or else right after its last input is made: all its inputs exist there, all values it
produces are used after it, and nothing between the chain's own reads of an input and that
point writes to the input (or to any view of it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from fuser.ir import ops
from fuser.ir.canonical_op import viewed
from fuser.canon.canonicalize import COMPUTE, HEAVY, INPUT, META, MUTATION, REDUCING, UNIT_VIEW, VIEW, COp, op_name
from fuser.match.matcher import Match, Rejection
from fuser.pattern import is_hand_written
from fuser.regions import lone_ops


def row_template(nodes, cops) -> str:
    """The frame a lowered row program renders in: ``row_reduce`` when it reduces, else ``pointwise``."""
    return "row_reduce" if any(cops[n].op in REDUCING for n in nodes) else "pointwise"


@dataclass
class Region:
    nodes: list[fx.Node]  # in graph order
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    template: str
    match: Match | None = None  # None: the generic fallback
    covered: set = field(default_factory=set)  # every node the kernel replaces
    position: fx.Node | None = None  # the kernel runs just before this node of the old graph
    parts: tuple[str, ...] = ()  # a merged region: the patterns (or "generic") it was made of
    merged_params: dict = field(default_factory=dict)  # a merged region: "<part>.<name>" -> value
    stores: dict = field(default_factory=dict)  # output -> the ``x[index] = output`` it writes in place
    # node -> the name a matched pattern's reference gives it (Match.names), for the kernel's
    # locals; a merged region has its parts'
    names: dict = field(default_factory=dict)
    note: str = ""  # a region of one op alone: why it has a kernel (fuser.regions.lone_ops)

    @property
    def pattern(self) -> str:
        if self.parts:
            return "+".join(self.parts)
        return self.match.pattern.name if self.match else "generic"

    @property
    def params(self) -> dict:
        if self.parts:
            return dict(self.merged_params)
        return dict(self.match.params) if self.match else {}

    def qualified_params(self) -> dict:
        """The parameters, each named after the pattern it belongs to."""
        if self.parts:
            return dict(self.merged_params)
        return {f"{self.pattern}.{k}": v for k, v in self.params.items()}


def fusible(cop: COp) -> bool:
    """Can the op join a fused kernel (a computation or free view that the op table lowers)?"""
    return cop.kind in (COMPUTE, UNIT_VIEW) and cop.op != "identity" and ops.lowers(cop.op)


class RegionBuilder:
    """Builds the regions of one traced graph and owns where each of them runs.

    It makes a region from a pattern match (:meth:`from_match`) or from the glue no pattern
    took (:meth:`generic`, :meth:`regroup`); :meth:`placement` finds the one point of the
    program where a set of nodes can run as a kernel (module docstring). It is the only owner
    of placement state: the position each committed region's outputs are made at
    (``made_at``) and where each node it replaces is read (``read_at``), changed only by
    :meth:`commit`, :meth:`uncommit` and :meth:`unplace_all`, so a later region is placed
    around the kernels already committed. :mod:`fuser.regions.growth` grows regions with its helpers
    (:meth:`boundary`, :meth:`peel`, :meth:`drop_view_outputs`).
    """

    def __init__(self, graph: fx.Graph, cops: dict[fx.Node, COp], parameters: frozenset = frozenset(), value_of=None,
                 token_dims_of=None):  # fmt: skip
        self.graph, self.cops = graph, cops
        # node -> its traced value and its dims that follow the tokens, for the lone-op decision
        # (None: a lone op is never fused)
        self.value_of, self.token_dims_of = value_of, token_dims_of
        self.left_alone: dict[fx.Node, str] = {}  # lone op left to PyTorch -> why (lone_ops)
        self.parameters = parameters  # get_attr nodes of parameters: weights no leaf writes
        self.order = {n: i for i, n in enumerate(graph.nodes)}
        self.alias = _alias_classes(graph, cops)
        self.writers = [n for n in graph.nodes if n in cops and cops[n].kind in (MUTATION, HEAVY)]
        self.made_at: dict[fx.Node, int] = {}  # region output -> position of its kernel
        self.read_at: dict[fx.Node, int] = {}  # node replaced by a kernel -> that kernel's position

    # --- shared structure --------------------------------------------------------------------
    def boundary(self, nodes: list[fx.Node], recomputed: set = frozenset()) -> tuple[list[fx.Node], list[fx.Node]]:
        """Inputs (values read from outside) and outputs (values used outside), in graph order."""
        inside = set(nodes)
        inputs, outputs = [], []
        for node in nodes:
            for arg in self.cops[node].args:
                if isinstance(arg, fx.Node) and arg not in inside and arg not in inputs:
                    inputs.append(arg)
        for node in nodes:
            if node not in recomputed and self.users_outside(node, inside):
                outputs.append(node)
        return inputs, outputs

    def users_outside(self, node: fx.Node, inside: set) -> list[fx.Node]:
        """Users of ``node`` outside ``inside``, looking through no-op casts and the like."""
        found = []
        for user in node.users:
            if user in inside:
                continue
            if self.cops.get(user) and self.cops[user].op == "identity":
                found += self.users_outside(user, inside)
            elif self.cops.get(user) and self.cops[user].kind == META and op_name(user) in _SPLITS:
                found += self.users_outside(user, inside)  # a split's tuple is free: its parts' users read
            else:
                found.append(user)
        return found

    def args_of(self, node: fx.Node) -> list[fx.Node]:
        """The values a node reads, with no-op casts looked through."""
        cop = self.cops.get(node)
        if cop is None or cop.kind == INPUT:
            return list(node.all_input_nodes)
        return [a for a in cop.args if isinstance(a, fx.Node)] or list(node.all_input_nodes)

    def placement(self, covered: set, inputs: list, outputs: list) -> tuple[fx.Node | None, str, int]:
        """Where the kernel can run: (the node it runs just before, "", 0) or (None, why, cut).

        Tried in turn: at the chain's last node, then right after its last input is made.
        """
        nodes = list(self.graph.nodes)
        last = max(self.order[n] for n in covered)
        earliest = max((self._ready(i) for i in inputs), default=0)
        problems = []
        for position in (last, earliest):
            problem = self._problem_at(position, covered, inputs, outputs)
            if problem is None:
                return nodes[position], "", 0
            problems.append(problem)
        return None, *problems[0]

    def _ready(self, value: fx.Node) -> int:
        """The first position at which ``value`` exists (a region's output: where it runs; a
        parameter or buffer: from the start, the fused graph reads attributes first)."""
        if value.op == "get_attr":
            return 0
        return self.made_at.get(value, self.order[value] + 1)

    def _problem_at(self, position: int, covered: set, inputs: list, outputs: list):
        for inp in inputs:
            if self._ready(inp) > position:
                return f"`{inp.name}` is made after the point the chain would run", self._ready(inp)
        for out in outputs:
            for user in self.users_outside(out, covered):
                used_at = self.read_at.get(user, self.order[user])
                if used_at < position:
                    return f"`{out.name}` is used by `{user.name}` before the chain ends", self.order[user]
        for inp in inputs:
            reads = [self.order[n] for n in covered if inp in n.all_input_nodes or _reads(self.cops[n], inp)]
            low, high = min(reads + [position]), max(reads + [position])
            for writer in self.writers:
                if low < self.order[writer] < high and writer not in covered and self._writes(writer, inp):
                    return f"`{writer.name}` writes `{inp.name}` while the chain reads it", self.order[writer]
        return None

    def peel(self, nodes: list[fx.Node]) -> list[fx.Node]:
        """``nodes`` without the reshapes of inputs and of heavy ops' results: those stay in the
        graph as views, and the kernel reads them through their strides (``wq_b(x).view(T,
        heads, dim)`` loads as [heads, dim], which a kernel can split by heads, not as one row)."""
        return [n for n in nodes if not self.view_of_input(n)]

    def view_of_input(self, node: fx.Node) -> bool:
        """A reshape of a graph input or of a heavy op's result (or of a view of one: q_proj's
        output viewed as heads, then transposed): a view no kernel needs to take."""
        cop = self.cops[node]
        if cop.op != "reshape":
            return False
        source = cop.args[0]
        while isinstance(source, fx.Node) and (self.cops[source].kind == VIEW or self.cops[source].op == "reshape"):
            source = self.cops[source].args[0]
        return isinstance(source, fx.Node) and self.cops[source].kind in (INPUT, HEAVY)

    def drop_view_outputs(self, region: "Region") -> "Region":
        """An output that only reshapes another output stays in the graph as a view of it (when
        it comes after the kernel): the kernel writes each value once."""
        outputs = set(region.outputs)
        for out in list(region.outputs):
            cop = self.cops[out]
            source = cop.args[0] if cop.args else None
            if cop.op == "reshape" and source in outputs and self.order[out] > self.order[region.position]:
                region.outputs.remove(out)
                region.covered.discard(out)
        return region

    def commit(self, region: "Region") -> None:
        """Record where a region runs, so later regions are placed consistently with it."""
        at = self.order[region.position]
        for node in region.outputs:
            self.made_at[node] = at
        for node in region.covered:
            self.read_at[node] = at

    def uncommit(self, region: "Region") -> None:
        """Forget where a region runs (it was not built): its values are made where the graph
        makes them again."""
        at = self.order[region.position]
        for node in region.outputs:
            if self.made_at.get(node) == at:
                del self.made_at[node]
        for node in region.covered:
            if self.read_at.get(node) == at:
                del self.read_at[node]

    def unplace_all(self) -> None:
        """Forget where every region runs, before the surviving ones are placed again."""
        self.made_at.clear()
        self.read_at.clear()

    def replace(self, region: "Region") -> "Region | None":
        """Place an already built region again (after others were dropped); None if it cannot be."""
        position, _, _ = self.placement(region.covered, region.inputs, region.outputs)
        if position is None or (region.stores and position not in region.stores.values()):
            return None
        region.position = position
        self.commit(region)
        return region

    def _writes(self, writer: fx.Node, value: fx.Node) -> bool:
        cls = self.alias.get(value)
        targets = [self.cops[writer].args[0]] if self.cops[writer].kind == MUTATION else writer.all_input_nodes
        if writer.op == "call_module" and self.cops.get(value) and self.cops[value].kind == INPUT:
            return value.op == "get_attr" and value not in self.parameters  # a leaf may write buffers
        return any(self.alias.get(t) == cls for t in targets if isinstance(t, fx.Node))

    # --- pattern regions ---------------------------------------------------------------------
    def from_match(self, match: Match) -> Region | Rejection:
        pattern = match.pattern
        if is_hand_written(pattern.template):
            # The kernel reads the pattern's inputs itself: it replaces every matched node.
            covered = set(match.nodes)
            nodes = sorted(covered, key=self.order.get)
            inputs, outputs = list(match.inputs), list(match.outputs)
        else:
            unlowered = self.unlowered(match)
            if unlowered is not None:
                # Left out of the kernel, the op would read the kernel's values and feed them
                # back: the chain goes to the generic path (or stays eager) instead.
                op = self.cops[unlowered].op
                reason = f"{op} (`{unlowered.name}`) has no row-program lowering: the {pattern.template} template cannot run it"
                return Rejection(pattern.name, match.outputs[0].name, reason, "lowering")
            # Lowered from the graph: views of the inputs stay (free) and become its inputs.
            nodes = self.peel(sorted((n for n in match.primary if fusible(self.cops[n])), key=self.order.get))
            covered = {c for n in nodes for c in self.cops[n].covers}
            inputs, _ = self.boundary(nodes)
            outputs = list(match.outputs)
        if not covered:
            return Rejection(pattern.name, match.outputs[0].name, "the chain has no op for a kernel to compute", "lowering")
        position, problem, _ = self.placement(covered, inputs, outputs)
        if position is None:
            return Rejection(pattern.name, match.outputs[0].name, problem, "order")
        names = self.argument_names(match)
        region = Region(nodes, inputs, outputs, pattern.template, match, covered, position, names=names)
        self.commit(region)
        return region

    def argument_names(self, match: Match) -> dict[fx.Node, str]:
        """What the pattern's reference calls the kernel's values (:attr:`Match.names`), and each
        view of a pattern input that a kernel reads as its argument rather than computes
        (``gate_up[..., :inter]``, ``R.unsqueeze(2)`` of a GEMM's result: they stay in the
        graph) called as the input it views."""
        names = dict(match.names)
        for node in match.nodes:
            cop = self.cops.get(node)
            if node in names or cop is None or cop.kind not in (VIEW, UNIT_VIEW):
                continue
            if fusible(cop) and not self.view_of_input(node):
                continue  # a kernel computes it: called as the model's graph calls it
            source = node
            while source in match.nodes and self.cops[source].kind in (VIEW, UNIT_VIEW):
                source = self.cops[source].args[0]
            if source in match.inputs and source in names:
                names[node] = names[source]
        return names

    def unlowered(self, match: Match) -> fx.Node | None:
        """A matched op the kernel cannot compute, or None: every op of a pattern lowered from
        the graph must be lowered (a view of an input may stay a view)."""
        inside = set(match.primary)
        for node in match.primary:
            cop = self.cops[node]
            if cop.kind in (INPUT, META) or cop.op == "identity" or fusible(cop):
                continue
            if cop.kind == VIEW and not any(a in inside for a in self.args_of(node)):
                continue
            return node
        return None

    # --- generic fallback --------------------------------------------------------------------
    def generic(self, taken: set) -> list[Region]:
        candidates = [n for n in self.graph.nodes if n in self.cops and n not in taken and fusible(self.cops[n])]
        pool = set(candidates)
        depth: dict[fx.Node, int] = {}
        for node in self.graph.nodes:
            # Leaving the pool costs a level; a path back into it arrives one level deeper.
            depth[node] = max(
                (depth[a] + (1 if a in pool and node not in pool else 0) for a in self.args_of(node)),
                default=0,
            )
        regions = []
        for component in components(candidates, pool, depth, self.args_of):
            regions += self._place(component)
        # Ops left alone by the depth split may still run together where a path between them
        # stays inside the pool (a gather by a sorted index feeding the add after a GEMM).
        placed = set().union(*(r.covered for r in regions)) if regions else set()
        alone = [n for n in candidates if n not in placed]
        for component in components(alone, set(alone), {}, self.args_of):
            if len(component) > 1:
                regions += self._place(component)
        for group in self._siblings_left_alone():
            regions += self._place(group)
        return regions

    def _siblings_left_alone(self) -> list[list[fx.Node]]:
        """Lone ops left to PyTorch that read the same activation (two GELUs of one GEMM's
        result), grouped: as one kernel they save launches, which one alone does not."""
        groups: dict[fx.Node, list[fx.Node]] = {}
        for node in self.left_alone:
            reads = [a for a in self.args_of(node) if a.op != "get_attr" and isinstance(self.value_of(a), torch.Tensor)]
            floating = [a for a in reads if self.value_of(a).is_floating_point()]
            if floating:
                groups.setdefault(self.alias[floating[0]], []).append(node)
        found = []
        for group in groups.values():
            if len(group) > 1:
                for node in group:
                    self.left_alone.pop(node)
                found.append(sorted(group, key=self.order.get))
        return found

    def regroup(self, nodes: list[fx.Node]) -> list[Region]:
        """Regions of ``nodes``: what is left of a generic region without the op that could not
        be lowered, split into its connected parts, each placed anew."""
        pool = set(nodes)
        regions = []
        for component in components(sorted(nodes, key=self.order.get), pool, {n: 0 for n in nodes}, self.args_of):
            regions += self._place(component)
        return regions

    def _copied(self, outputs: list[fx.Node]) -> bool:
        """Is an output only copied into a slice of another tensor (``x[i] = out``)? Then one op
        alone gains: its kernel can write there itself (see :func:`stored_in_place`)."""
        for out in outputs:
            users = self.users_outside(out, set())
            if len(users) == 1 and users[0] in self.cops and self.cops[users[0]].op == "setitem":
                return True
        return False

    def recomputable(self, node: fx.Node) -> bool:
        """Cheap glue computed from graph inputs only (a table lookup, a view of it): each kernel
        that reads it may compute it again instead of reading a copy someone wrote."""
        cop = self.cops.get(node)
        if cop is None or not fusible(cop) or cop.op not in _RECOMPUTABLE or self.view_of_input(node):
            return False
        return all(self.of_input(a) or self.recomputable(a) for a in cop.args if isinstance(a, fx.Node))

    def of_input(self, node: fx.Node) -> bool:
        """A graph input, or a view of one (a slice of a sin/cos table): a kernel reads it
        through its strides."""
        while (base := viewed(self.cops.get(node))) is not None:
            node = base
        return self.cops[node].kind == INPUT

    def alone(self, node: fx.Node) -> "lone_ops.Decision | None":
        """Does ``node``, one op alone between ops that cannot share its kernel, get a kernel of
        its own (:mod:`fuser.regions.lone_ops`)? None where the question does not arise: no
        traced values to judge by, or a value of parameters alone (computed once at apply time)."""
        if self.value_of is None or self.token_dims_of is None or token_free(node):
            return None
        return lone_ops.forced_decision() or lone_ops.decide(node, self.cops[node], self.value_of, self.token_dims_of)

    def _place(self, nodes: list[fx.Node]) -> list[Region]:
        """Split a component until every part can run at one point of the program."""
        nodes = self.peel(sorted(nodes, key=self.order.get))
        lowered, recomputed = list(nodes), set()
        while True:
            extra = [i for i in self.boundary(lowered)[0] if self.recomputable(i)]
            if not extra:
                break
            recomputed.update(extra)
            lowered = sorted(set(lowered) | set(extra), key=self.order.get)
        inputs, outputs = self.boundary(lowered, recomputed)
        covered = set(nodes) - recomputed
        position, _, cut = self.placement(covered, inputs, outputs) if covered else (None, "", 0)
        if position is not None:
            computing = [n for n in covered if self.cops[n].kind == COMPUTE]
            note = ""
            if len(computing) < 2 and not self._copied(outputs):
                # One op alone saves no launch: a kernel of its own only where it is faster.
                decision = self.alone(computing[0]) if computing else None
                if decision is None or not decision.fuse:
                    if decision is not None:
                        self.left_alone[computing[0]] = decision.why
                    return []
                note = decision.why
            template = row_template(nodes, self.cops)
            # A node folded into another (sum into mean) is computed by that one.
            absorbed = {c for n in nodes for c in self.cops[n].covers[1:]}
            lowered = [n for n in lowered if n not in absorbed]
            region = Region(lowered, inputs, outputs, template, None, covered, position, note=note)
            region = self.drop_view_outputs(region)
            self.commit(region)
            return [region]
        before = [n for n in nodes if self.order[n] < cut]
        after = [n for n in nodes if self.order[n] >= cut]
        if not before or not after:
            return []
        parts = []
        for half in (before, after):
            pool = set(half)
            for component in components(half, pool, {n: 0 for n in half}, self.args_of):
                parts += self._place(component)
        return parts


_SPLITS = ("split", "chunk", "unbind")  # a tuple of views of its input, read through getitems
_RECOMPUTABLE = {"gather_rows", "reshape", "expand", "conj", "cast", "repeat_interleave"}


def token_free(node: fx.Node) -> bool:
    """Is ``node`` computed from no graph input (parameters and constants alone)?"""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n.op == "placeholder":
            return False
        if n not in seen:
            seen.add(n)
            stack += n.all_input_nodes
    return True


def _reads(cop: COp, value: fx.Node) -> bool:
    return any(a is value for a in cop.args)


class _Classes:
    """Union-find over graph nodes: which class of joined nodes each one is in."""

    def __init__(self, nodes):
        self.parent = {n: n for n in nodes}

    def find(self, n):
        parent = self.parent
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    def join(self, a, b) -> None:
        self.parent[self.find(a)] = self.find(b)


def components(nodes, pool: set, depth: dict, args_of) -> list[list[fx.Node]]:
    """Connected components of ``nodes`` over edges between pool members of equal depth."""
    classes = _Classes(nodes)
    for node in nodes:
        for arg in args_of(node):
            if arg in pool and depth.get(arg) == depth.get(node):
                classes.join(arg, node)
    groups: dict[fx.Node, list] = {}
    for node in nodes:
        groups.setdefault(classes.find(node), []).append(node)
    return list(groups.values())


def _alias_classes(graph: fx.Graph, cops: dict[fx.Node, COp]) -> dict[fx.Node, fx.Node]:
    """Union of values that may share storage: a view and its base, an identity and its source."""
    classes = _Classes(graph.nodes)
    for node in graph.nodes:
        base = viewed(cops.get(node))
        if base is not None:
            classes.join(node, base)
    return {n: classes.find(n) for n in graph.nodes}
