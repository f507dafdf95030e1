"""profile: rank a module's glue chains by what they cost, and draft a pattern for one.

``profile`` groups the traced graph's glue into chains (connected glue ops between heavy ops)
and costs each: eager kernel launches everywhere, and on a GPU also the CUDA time of every node,
measured with torch.profiler while the traced graph runs node by node. ``suggest`` writes a
skeleton pattern file for a chain — its reference function generated from the graph — ready
to be named, constrained and pointed at a template.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from fuser.canon import COMPUTE, REDUCING, UNIT_VIEW, UNSUPPORTED, VIEW, canonicalize, eager_launches, is_glue
from fuser.regions import components
from fuser.trace import Traced, preserved_state


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

    gm = fx.GraphModule(module, traced.graph)
    with preserved_state(module, traced.example_inputs), torch.no_grad():
        Timed(gm).run(*traced.example_inputs)  # warm
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            Timed(gm).run(*traced.example_inputs)
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


def profile(module: torch.nn.Module, example_inputs, **options) -> Profile:
    """The module's glue chains, costliest first, each with what fuser does to it."""
    from fuser.api import plan

    with preserved_state(module, example_inputs):
        p = plan(module, example_inputs, **options)
    traced, cops = p.traced, canonicalize(p.traced)
    on_gpu = any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs)
    times = gpu_time_per_node(module, traced) if on_gpu else {}
    fused_by = {n.name: k.region.pattern for k in p.kernels for n in k.region.covered}
    unfused = {u.node: u.launches for u in p.report.unfused}
    chains = []
    for nodes in glue_chains(traced, cops):
        launches = sum(eager_launches(cops[n]) for n in nodes)
        if not launches:
            continue  # views only
        chains.append(
            Chain(
                nodes,
                launches,
                sum(unfused.get(n.name, 0) for n in nodes),
                sum(times.get(n.name, 0.0) for n in nodes) if on_gpu else None,
                {fused_by[n.name] for n in nodes if n.name in fused_by},
            )
        )
    chains.sort(key=lambda c: (-(c.gpu_us or 0.0), -c.launches))
    return Profile(chains, traced, cops)


def suggestion_target(chains: list[Chain]) -> Chain | None:
    """The costliest chain no pattern claims (fused by the generic fallback or not at all)."""
    for chain in chains:
        if chain.fused_by <= {"generic"}:
            return chain
    return None


def skeleton(chain: Chain, traced: Traced, cops, name: str) -> str:
    """Source of a pattern file whose reference is the chain's own computation."""
    nodes = [n for n in chain.nodes if cops[n].kind in (COMPUTE, UNIT_VIEW, VIEW, UNSUPPORTED)]
    inside = set(nodes)
    inputs = []
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg not in inside and arg not in inputs:
                inputs.append(arg)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    arg_names = []
    for i, node in enumerate(inputs):
        arg_names.append(_arg_name(node, i))
        env[node] = graph.placeholder(arg_names[-1])
    for node in nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    result = tuple(env[o] for o in outputs)
    graph.output(result if len(result) > 1 else result[0])
    body = graph.python_code(root_module="self").src
    body = body.replace("def forward(self, ", "def reference(").replace("def forward(self)", "def reference()")
    body = re.sub(r";\s+(?:\w+\s*=\s*)+None", "", body).rstrip() + "\n"  # fx's early frees: noise here
    reducing = any(cops[n].op in REDUCING for n in nodes)
    specs = "\n".join(
        f"        {arg}=tensor({_dims(traced, node)!r}, {str(traced.value(node).dtype).replace('torch.', '')!r}),"
        for arg, node in zip(arg_names, inputs)
    )
    ops = ", ".join(sorted({cops[n].op for n in nodes if cops[n].kind != VIEW}))
    return f'''"""TODO: say what this chain computes and where it comes from ({name}).

Drafted by `fuser suggest` from nodes {chain.nodes[0].name} … {chain.nodes[-1].name}
({chain.launches} eager launches; ops: {ops}). Before use: rename the arguments, turn literals
the model may vary (eps, limits) into Param(...), keep only the dtypes the math is right for,
and check that the template can lower every op (`fuser explain` says why it cannot).
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
)
'''


def _arg_name(node: fx.Node, i: int) -> str:
    name = "".join(c if c.isalnum() else "_" for c in node.name)
    return name if name[:1].isalpha() else f"x{i}"


def _dims(traced: Traced, node: fx.Node) -> str:
    """ "T, 4, 64"-style dims: the token dim as T, the others as their sizes."""
    value = traced.value(node)
    batch = traced.batch_dims(node)
    return ", ".join("T" if i in batch else str(s) for i, s in enumerate(value.shape))

