"""report: what fuser did to a module — the ``explain`` output, as data, text and JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass
class FusedChain:
    kernel: str  # kernel file name in kernels/
    template: str
    pattern: str  # a pattern name, or "generic"
    params: dict
    nodes: list[str]
    inputs: list[str]
    outputs: list[str]
    launches_replaced: int


@dataclass
class Rejected:
    pattern: str
    anchor: str
    category: str
    reason: str


@dataclass
class Unfused:
    node: str
    op: str
    reason: str
    launches: int


@dataclass
class Report:
    module: str
    chains: list[FusedChain] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    unfused: list[Unfused] = field(default_factory=list)
    precomputed: list[str] = field(default_factory=list)  # parameter-only glue, computed at apply
    glue_nodes_before: int = 0
    glue_nodes_after: int = 0
    launches_before: int = 0
    launches_after: int = 0

    def to_json(self) -> dict:
        return asdict(self)

    def json(self) -> str:
        return json.dumps(self.to_json(), indent=2, default=str)

    def text(self) -> str:
        lines = [f"fuser report for {self.module}", ""]
        lines.append(
            f"glue kernel launches per call: {self.launches_before} eager -> {self.launches_after} fused"
            f"   (glue nodes {self.glue_nodes_before} -> {self.glue_nodes_after})"
        )
        lines += ["", f"fused chains ({len(self.chains)}):"]
        for c in self.chains:
            params = ", ".join(f"{k}={v!r}" for k, v in sorted(c.params.items()))
            lines.append(
                f"  {c.pattern:<22} {c.template:<11} {c.launches_replaced:>4} launches -> 1   "
                f"{c.outputs[0] if c.outputs else ''}{' ...' if len(c.outputs) > 1 else ''}"
                + (f"   [{params}]" if params else "")
            )
            lines.append(f"  {'':<22} kernels/{c.kernel}.py  ({len(c.nodes)} nodes)")
        lines += ["", f"rejected candidates ({len(self.rejected)}):"]
        for r in self.rejected:
            lines.append(f"  {r.pattern:<22} at {r.anchor}: [{r.category}] {r.reason}")
        if self.precomputed:
            lines += ["", f"computed once from parameters at apply time: {', '.join(self.precomputed)}"]
        launches = sum(u.launches for u in self.unfused)
        lines += ["", f"unfused glue ({len(self.unfused)} nodes, {launches} launches):"]
        for u in self.unfused:
            lines.append(f"  {u.node:<28} {u.op:<22} {u.reason}")
        return "\n".join(lines)
