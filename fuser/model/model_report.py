"""model_report: what fusing a model layer by layer did (:class:`ModelReport`): one
:class:`LayerGroup` per layer structure and the model's other submodules fused on their own."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from fuser.ir.report import Report


@dataclass
class LayerGroup:
    """Layers of one structure: fused with one plan, or left eager with the reason."""

    layers: list[str]
    report: Report | None = None
    eager: str | None = None  # why the group runs eager, if it does
    # layer -> tokens its check left out: near ties of a top-k (a router's) in eager's scores,
    # and tokens where eager's own output is not settled by its input (model._unsettled)
    near_ties: dict[str, list[int]] = field(default_factory=dict)
    # layers given their entry kernels' results by the layer before them, of this group too
    # (fuser.pipeline.next_layer_entry): they launch ``len(report.across_layers)`` fewer
    handed_to: int = 0


@dataclass
class ModelReport:
    """What fusing a model layer by layer did: one :class:`LayerGroup` per layer structure
    (its layers, its report or why it stayed eager), and the model's other submodules fused on
    their own; launch counts are totals over the model."""

    model: str
    groups: list[LayerGroup] = field(default_factory=list)
    others: dict[str, Report] = field(default_factory=dict)  # other submodules fused: name -> report
    skipped: dict[str, str] = field(default_factory=dict)  # other submodules not fused: name -> why
    # other submodules whose one kernel a stack's last layer computes (fuser.model.final_norm): name -> by what
    handed_over: dict[str, str] = field(default_factory=dict)
    handed_over_apart: dict[str, str] = field(default_factory=dict)  # name -> why its kernel is its own
    pending: str | None = None  # fused lazily (fuser.model.lazy_model): why nothing is fused yet
    fused_again: list[str] = field(default_factory=list)  # fused lazily, then again from a later call: why

    @property
    def launches_before(self) -> int:
        return self._total("launches_before")

    @property
    def launches_after(self) -> int:
        return self._total("launches_after")

    def _total(self, what: str) -> int:
        layers = sum(getattr(g.report, what) * len(g.layers) for g in self.groups if g.report)
        if what == "launches_after":  # a kernel of the layers' inputs alone: once for the group
            layers -= sum(len(g.report.shared) * (len(g.layers) - 1) for g in self.groups if g.report)
            layers -= sum(len(g.report.across_layers) * g.handed_to for g in self.groups if g.report)
            layers -= len(self.handed_over)
        return layers + sum(getattr(r, what) for r in self.others.values())

    @property
    def kernels(self) -> int:
        """Distinct fused kernels: one set per layer structure, shared by its layers."""
        return sum(len(g.report.chains) for g in self.groups if g.report) + sum(len(r.chains) for r in self.others.values())

    def to_json(self) -> dict:
        totals = {"launches_before": self.launches_before, "launches_after": self.launches_after, "kernels": self.kernels}
        return {**dataclasses.asdict(self), **totals}

    def json(self) -> str:
        return json.dumps(self.to_json(), indent=2, default=str)

    def text(self) -> str:
        lines = [f"fuser report for {self.model} (layer by layer)", ""]
        if self.pending:
            return "\n".join([*lines, f"nothing fused: {self.pending}"])
        lines.append(f"glue kernel launches per forward: {self.launches_before} eager -> {self.launches_after} fused")
        for why in self.fused_again:
            lines.append(f"fused again from a later decode call: {why}")
        for i, g in enumerate(self.groups):
            head = f"layer structure {i}: {len(g.layers)} layers ({g.layers[0]} ...)"
            if g.report is None:
                lines += ["", head, f"  left eager: {g.eager}"]
            else:
                r = g.report
                lines += ["", f"{head}: {r.launches_before} -> {r.launches_after} launches each, {len(r.chains)} kernels shared"]
                if g.handed_to:
                    lines.append(f"  {g.handed_to} of them given their first kernels' results by the layer before: "
                                 f"{r.launches_after - len(r.across_layers)} launches each")
                for name, rows in g.near_ties.items():
                    lines.append(f"  checked against eager without tokens {rows} of {name}: near ties, where eager's own choice is not "
                                 "settled by its input (a top-k's k-th and next scores meet, or its output moves as far with "
                                 "its input rounded otherwise) and either result is right")
                lines += ["  " + line for line in r.text().splitlines()]
        for name, r in self.others.items():
            lines += ["", f"{name}: {r.launches_before} -> {r.launches_after} launches"]
            if name in self.handed_over:
                lines.append(f"  0 within a forward of the model: {self.handed_over[name]}")
            elif name in self.handed_over_apart:
                lines.append(f"  not computed by the last layer: {self.handed_over_apart[name]}")
        for name, why in self.skipped.items():
            lines.append(f"{name}: not fused ({why})")
        return "\n".join(lines)
