"""profile: rank a module's glue chains by what they cost, and draft a pattern for one.

``profile`` groups the traced graph's glue into chains (connected glue ops between heavy ops)
and costs each: eager kernel launches everywhere, and on a GPU also the CUDA time of every node,
measured with torch.profiler while the traced graph runs node by node. ``suggest`` writes a
skeleton pattern file for a chain — its reference function generated from the graph — ready
to be named, constrained and pointed at a template. The draft calls public APIs only (``F.gelu``,
not ``torch._C._nn.gelu``) and names every dim by a symbol (``"T, N"``, T = tokens), with the
model's sizes as the pattern's example sizes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.node import _get_qualified_name

from fuser.canon.canonicalize import COMPUTE, REDUCING, UNIT_VIEW, UNSUPPORTED, VIEW, canonicalize, eager_launches, is_glue
from fuser.pattern import DTYPES
from fuser.regions.builder import components
from fuser.trace.tracing import Traced, preserved_state


@dataclass
class Chain:
    nodes: list[fx.Node]
    launches: int  # eager kernel launches of the chain
    unfused_launches: int  # of those, the ones fuser leaves as they are
    gpu_us: float | None  # eager CUDA time (GPU only)
    fused_by: set[str] = field(default_factory=set)  # pattern names, or "generic"

    def describe(self) -> str:
        fused = ", ".join(sorted(self.fused_by)) or "-"
        cost = f"{self.gpu_us:9.1f} µs" if self.gpu_us is not None else ""
        return (
            f"{self.launches:4d} launches{cost}  {self.unfused_launches:3d} left unfused  fused by: {fused:<28} "
            f"{self.nodes[0].name} … {self.nodes[-1].name} ({len(self.nodes)} nodes)"
        )

    def to_json(self) -> dict:
        return dict(
            launches=self.launches,
            unfused_launches=self.unfused_launches,
            gpu_us=self.gpu_us,
            fused_by=sorted(self.fused_by),
            nodes=[n.name for n in self.nodes],
        )


def glue_chains(traced: Traced, cops) -> list[list[fx.Node]]:
    """Connected glue ops (views included), in graph order."""
    glue = [n for n in traced.graph.nodes if n in cops and is_glue(cops[n])]
    return components(glue, set(glue), {}, lambda n: n.all_input_nodes)


def gpu_time_per_node(module: torch.nn.Module, traced: Traced) -> dict[str, float]:
    """CUDA time (µs) of each node, running the traced graph node by node under the profiler."""

    class Timed(fx.Interpreter):
        def run_node(self, n):
            with torch.profiler.record_function(f"fuser_node::{n.name}"):
                return super().run_node(n)

    gm = traced.graph_module(module)
    with preserved_state(module, traced.example_inputs), torch.no_grad():
        Timed(gm).run(*traced.fresh_inputs())  # warm
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            Timed(gm).run(*traced.fresh_inputs())
            torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        if event.key.startswith("fuser_node::"):
            times[event.key.split("::", 1)[1]] = getattr(event, "device_time_total", getattr(event, "cuda_time_total", 0.0))
    return times


@dataclass
class Profile:
    chains: list[Chain]  # costliest first
    traced: Traced
    cops: dict
    # Connected glue that no pattern claims (fused by the generic fallback, or not at all), costliest first.
    unclaimed: list[Chain] = field(default_factory=list)


def patterns_by_node(kernels) -> dict[str, str]:
    """Node name -> the pattern (or "generic") of the kernel that replaces it. A merged kernel's
    nodes are named after the kernels it was made of."""
    found: dict[str, str] = {}
    for kernel in kernels:
        stack = [kernel]
        while stack:
            k = stack.pop()
            if k.parts:
                stack += k.parts
            else:
                for n in k.region.covered:
                    found.setdefault(n.name, k.region.pattern)
        for n in kernel.region.covered:  # computed only by the merged kernel
            found.setdefault(n.name, kernel.region.pattern)
    return found


def _claimed(pattern: str) -> bool:
    """Is a kernel of this pattern name ("a", "generic", merged "a+generic") a pattern's own?"""
    return any(part != "generic" for part in pattern.split("+"))


def profile(module: torch.nn.Module, example_inputs, **options) -> Profile:
    """The module's glue chains, costliest first, each with what fuser does to it."""
    from fuser.pipeline.fuse_module import plan, tensors_of

    with preserved_state(module, tensors_of(example_inputs, options.get("example_kwargs"))):
        p = plan(module, example_inputs, **options)
    traced, cops = p.traced, canonicalize(p.traced)
    on_gpu = any(x.is_cuda for x in traced.example_inputs if isinstance(x, torch.Tensor))
    times = gpu_time_per_node(module, traced) if on_gpu else {}
    fused_by = {n.name: k.region.pattern for k in p.kernels for n in k.region.covered}
    by_pattern = patterns_by_node(p.kernels)
    handled = {name for name, pattern in by_pattern.items() if _claimed(pattern)} | set(p.report.precomputed)
    unfused = {u.node: u.launches for u in p.report.unfused}

    def chain(nodes: list[fx.Node]) -> Chain:
        return Chain(
            nodes,
            sum(eager_launches(cops[n]) for n in nodes),
            sum(unfused.get(n.name, 0) for n in nodes),
            sum(times.get(n.name, 0.0) for n in nodes) if on_gpu else None,
            {fused_by[n.name] for n in nodes if n.name in fused_by},
        )

    def costliest_first(chains: list[Chain]) -> list[Chain]:
        costly = [c for c in chains if c.launches]  # views only cost nothing
        return sorted(costly, key=lambda c: (-(c.gpu_us or 0.0), -c.launches))

    chains, unclaimed = [], []
    for nodes in glue_chains(traced, cops):
        chains.append(chain(nodes))
        free = [n for n in nodes if n.name not in handled]
        unclaimed += [chain(part) for part in components(free, set(free), {}, lambda n: n.all_input_nodes)]
    return Profile(costliest_first(chains), traced, cops, costliest_first(unclaimed))


def suggestion_target(result: Profile) -> Chain | None:
    """The costliest connected glue no pattern claims (fused by the generic fallback or left
    unfused; parameter-only glue computed once at apply time does not count), or None."""
    return result.unclaimed[0] if result.unclaimed else None


def skeleton(chain: Chain, traced: Traced, cops, name: str) -> str:
    """Source of a pattern file whose reference is the chain's own computation."""
    nodes, inputs = _reference_nodes(chain, traced, cops)
    inside = set(nodes)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    graph = fx.Graph()
    env: dict[fx.Node, object] = {}
    arg_names = []
    for node in inputs:
        if isinstance(traced.value(node), torch.Tensor):
            arg_names.append(_arg_name(node, len(arg_names)))
            env[node] = graph.placeholder(arg_names[-1])
        else:  # a value the chain takes as it is (an int argument of forward): a literal here
            env[node] = traced.value(node)
    inputs = [n for n in inputs if isinstance(traced.value(n), torch.Tensor)]
    for node in nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
        _make_public(env[node])
    result = tuple(env[o] for o in outputs)
    graph.output(result if len(result) > 1 else result[0])
    body = graph.python_code(root_module="self").src
    body = body.replace("def forward(self, ", "def reference(").replace("def forward(self)", "def reference()")
    body = re.sub(r";\s+(?:\w+\s*=\s*)+None", "", body).rstrip() + "\n"  # fx's early frees: noise here
    for node in graph.nodes:
        if node.op == "call_function":
            qualified = _get_qualified_name(node.target)
            body = re.sub(rf"(?<![\w.]){re.escape(qualified)}\(", _public_name(node.target, qualified) + "(", body)
    reducing = any(cops[n].op in REDUCING for n in nodes)
    symbols: dict[int, str] = {}  # size -> its symbol, shared by every dim of that size
    specs = "\n".join(
        f"        {arg}=tensor({_dims(traced, node, symbols)!r}, {_dtype(traced.value(node))!r}),"
        + ("" if _is_pattern_input(traced.value(node)) else "  # TODO: patterns take no inputs of this dtype")
        for arg, node in zip(arg_names, inputs)
    )
    example = ", ".join(f"{symbol}={size}" for size, symbol in symbols.items())
    ops = ", ".join(sorted({cops[n].op for n in nodes if cops[n].kind != VIEW}))
    return f'''"""TODO: say what this chain computes and where it comes from ({name}).

Drafted by `fuser suggest` from nodes {chain.nodes[0].name} … {chain.nodes[-1].name}
({chain.launches} eager launches; ops: {ops}). Before use: rename the arguments, turn literals
the model may vary (eps, limits) into Param(...), keep only the dtypes the math is right for,
and check that the template can lower every op (`fuser explain` says why it cannot). Dims of
equal size share a symbol: give unrelated dims their own, and "..." the dims the math ignores.
"""

import torch  # noqa: F401 - the reference uses torch ops
import torch.nn.functional as F  # noqa: F401

from fuser.pattern import Param, tensor  # noqa: F401
{body}

PATTERN = dict(
    template={"row_reduce" if reducing else "pointwise"!r},
    inputs=dict(
{specs}
    ),
    example=dict({example}),  # the sizes of the chain it was drafted from
)
'''


def _dtype(value: torch.Tensor) -> str:
    return str(value.dtype).replace("torch.", "")


def _is_pattern_input(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype in DTYPES.values()


def _reference_nodes(chain: Chain, traced: Traced, cops) -> tuple[list[fx.Node], list[fx.Node]]:
    """The chain's nodes the reference computes, in graph order, and the nodes it reads. An
    input no pattern can declare (a size read, a complex view) is computed in the reference
    too, from what it reads in turn."""
    nodes = [n for n in chain.nodes if cops[n].kind in (COMPUTE, UNIT_VIEW, VIEW, UNSUPPORTED)]
    order = {n: i for i, n in enumerate(traced.graph.nodes)}
    while True:
        inside = set(nodes)
        inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))
        pulled = [a for a in inputs if a.op in ("call_function", "call_method") and not _is_pattern_input(traced.value(a))]
        if not pulled:
            return nodes, inputs
        nodes = sorted(nodes + pulled, key=order.get)


def _arg_name(node: fx.Node, i: int) -> str:
    name = "".join(c if c.isalnum() else "_" for c in node.name)
    return name if name[:1].isalpha() else f"x{i}"


SYMBOLS = ("N", "M", "K", "L", "P", "Q", "R", "S")


def _dims(traced: Traced, node: fx.Node, symbols: dict[int, str]) -> str:
    """ "T, M, N"-style dims: the token dim as T, size-1 dims as 1, every other size as a symbol
    (the same one for equal sizes; the last dims are named first)."""
    value = traced.value(node)
    batch = traced.batch_dims(node)
    dims = []
    for i in reversed(range(value.dim())):
        size = int(value.shape[i])
        if i in batch:
            dims.append("T")
        elif size == 1:
            dims.append("1")
        else:
            dims.append(symbols.setdefault(size, SYMBOLS[len(symbols)] if len(symbols) < len(SYMBOLS) else f"D{len(symbols)}"))
    return ", ".join(reversed(dims))


def _public(target) -> tuple[str, object] | None:
    """("F.gelu", F.gelu)-style public spelling of a private function (``torch._C._nn.gelu``),
    found by its name in torch.nn.functional, then torch; None if neither has it."""
    name = getattr(target, "__name__", "")
    for prefix, namespace in (("F", F), ("torch", torch)):
        if not name.startswith("_") and callable(getattr(namespace, name, None)):
            return f"{prefix}.{name}", getattr(namespace, name)
    return None


def _public_name(target, qualified: str) -> str:
    """How the draft spells a call_function target: public modules as written (F for
    torch.nn.functional), private ones (``torch._C._nn.softplus``) by their public name."""
    if qualified.startswith("torch.nn.functional."):
        return "F." + qualified[len("torch.nn.functional.") :]
    module = qualified.rpartition(".")[0]
    if module.startswith("torch") and (module != "torch" or any(p.startswith("_") for p in qualified.split("."))):
        public = _public(target)
        if public is not None:
            return public[0]
    return qualified


def _make_public(node: fx.Node) -> None:
    """A private torch function that neither torch nor torch.nn.functional offers under its
    name, but a Tensor method does, becomes that method call."""
    if node.op != "call_function" or not _get_qualified_name(node.target).startswith("torch._"):
        return
    name = getattr(node.target, "__name__", "")
    if _public(node.target) is None and node.args and hasattr(torch.Tensor, name) and not name.startswith("_"):
        node.op, node.target = "call_method", name
