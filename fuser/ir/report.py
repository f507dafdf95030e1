"""report: what fuser did to a module — the ``explain`` output, as data, text and JSON."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field


@dataclass
class FusedChain:
    kernel: str  # kernel file name, without ".py"
    template: str
    pattern: str  # a pattern name, or "generic"
    params: dict
    nodes: list[str]
    inputs: list[str]
    outputs: list[str]
    launches_replaced: int
    path: str = ""  # where the kernel file is (the kernel directory emit chose)
    where: str = ""  # the submodule and source line of its first output (fuser.trace.refusal.source_of)
    note: str = ""  # one op alone with a kernel of its own: why (fuser.regions.lone_ops)


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
    where: str = ""  # its submodule and source line


@dataclass
class Report:
    """What fusing one module did, as ``fuser explain`` prints it (:meth:`text`): the chains
    fused, the candidates rejected and why, the glue left eager and why, the leaves kept
    opaque, and the glue launches before and after."""

    module: str
    chains: list[FusedChain] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    unfused: list[Unfused] = field(default_factory=list)
    precomputed: list[str] = field(default_factory=list)  # parameter-only glue, computed at apply
    literals: dict = field(default_factory=dict)  # module scalar attributes fused in as literals: path -> value
    state_reads: dict = field(default_factory=dict)  # what the trace read off state objects: path -> how it reads
    token_ranges: list = field(default_factory=list)  # branches on the token count taken as traced: "line: counts"
    free_sizes: dict = field(default_factory=dict)  # input -> dims of any size at each call (fuser.install.free_sizes)
    sizes_near_literals: dict = field(default_factory=dict)  # input -> dims held only by a literal next to their size
    merged_projections: list[str] = field(default_factory=list)  # linear layers run as one GEMM ("a + b + c")
    projections_apart: dict = field(default_factory=dict)  # linear layers of one input left apart -> why
    activations_in_gemm: list[str] = field(default_factory=list)  # activations the GEMM applies ("mul_3 (gelu_new) of mlp.fc1")
    activations_apart: dict[str, str] = field(default_factory=dict)  # activations of a GEMM's output left apart -> why
    residuals_in_gemm: list[str] = field(default_factory=list)  # adds done by the GEMM before them ("add_5 + mlp.down_proj")
    upcasts_in_gemm: list[str] = field(default_factory=list)  # matmuls of fp32 casts run as half GEMMs with an fp32 output
    upcasts_apart: dict[str, str] = field(default_factory=dict)  # matmuls of fp32 casts left as they are -> why
    decode_gemms: list[str] = field(default_factory=list)  # GEMMs on fuser's decode GEMM kernel (fuser.install.decode_gemm)
    decode_gemms_untimed: list[str] = field(default_factory=list)  # GEMM shapes on the GPU the decode-GEMM table lacks
    gated_in_gemm: list[str] = field(default_factory=list)  # gated activations the decode GEMM kernel computes
    gated_apart: dict[str, str] = field(default_factory=dict)  # gated activations of a merged gate/up pair left apart -> why
    decode_attention: list[str] = field(default_factory=list)  # attention calls on fuser's decode attention kernel
    norm_in_gemm: list[str] = field(default_factory=list)  # RMSNorms the decode GEMM kernel computes as its prologue
    norms_apart: dict[str, str] = field(default_factory=dict)  # RMSNorms read by a GEMM on the kernel left apart -> why
    early_weights: list[str] = field(default_factory=list)  # decode GEMMs reading their weight before the PDL wait
    early_waiting: dict[str, str] = field(default_factory=dict)  # decode GEMMs with PDL reading it after the wait -> why
    automatic_leaves: list[dict] = field(default_factory=list)  # submodules kept opaque: name, where, reason
    attention_calls: list[str] = field(default_factory=list)  # sdpa calls whose arguments were rewritten, and how
    shared: list[str] = field(default_factory=list)  # kernels of the call's inputs alone, once per model forward
    across_layers: list[str] = field(default_factory=list)  # the next layer's entry kernels this layer's kernels compute
    across_layers_apart: str = ""  # why a layer of a stack computes none
    disabled_passes: list[str] = field(default_factory=list)  # passes switched off by name (fuser.pipeline.pass_list)
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
        if self.disabled_passes:
            lines.append(f"passes switched off (disable_passes, FUSER_DISABLE_PASSES): {', '.join(self.disabled_passes)}")
        lines += ["", f"fused chains ({len(self.chains)}):"]
        pattern_w = max([len(c.pattern) for c in self.chains] + [8])
        template_w = max([len(c.template) for c in self.chains] + [8])
        for c in self.chains:
            params = ", ".join(f"{k}={v!r}" for k, v in sorted(c.params.items()))
            lines.append(
                f"  {c.pattern:<{pattern_w}} {c.template:<{template_w}} {c.launches_replaced:>4} launches -> 1   "
                f"{c.outputs[0] if c.outputs else ''}{' ...' if len(c.outputs) > 1 else ''}"
                + (f"   [{params}]" if params else "")
            )
            kernel = _shown(c.path) if c.path else f"kernels/{c.kernel}.py"
            lines.append(f"  {'':<{pattern_w}} {kernel}  ({len(c.nodes)} nodes)" + (f"  at {c.where}" if c.where else ""))
            if c.note:
                lines.append(f"  {'':<{pattern_w}} {c.note}")
        lines += ["", f"rejected candidates ({len(self.rejected)}):"]
        rejected_w = max([len(r.pattern) for r in self.rejected] + [8])
        for r in self.rejected:
            lines.append(f"  {r.pattern:<{rejected_w}} at {r.anchor}: [{r.category}] {r.reason}")
        if self.automatic_leaves:
            lines += ["", f"leaves (automatic: code the trace cannot go into, and calls into compiled code; they run as they are) ({len(self.automatic_leaves)}):"]
            for leaf in self.automatic_leaves:
                lines.append(f"  leaf (automatic): {leaf['name']} — {leaf['where']}, {leaf['reason']}")
        if self.attention_calls:
            lines += ["", f"attention calls given their arguments as they were made (fuser.trace.attention_calls) ({len(self.attention_calls)}):"]
            lines += [f"  {line}" for line in self.attention_calls]
        if self.shared:
            lines += ["", "kernels of the call's inputs alone, run once per forward of the model for the layers given "
                      f"the same inputs (fuser.install.once_per_forward): {', '.join(self.shared)}"]
        if self.across_layers:
            lines += ["", "the next layer's first kernels, computed by this layer's (handed over within a forward of the "
                          "model; the first layer, and a layer called on its own, launch them; fuser.pipeline.next_layer_entry):"]
            lines += [f"  {line}" for line in self.across_layers]
        elif self.across_layers_apart:
            lines += ["", f"no glue across layers: {self.across_layers_apart}"]
        if self.precomputed:
            lines += ["", f"computed from parameters at apply time, again when they change: {', '.join(self.precomputed)}"]
        if self.merged_projections:
            lines += ["", "linear layers of one input run as one GEMM on their weights merged (their parameters views of it):"]
            lines += [f"  {names}" for names in self.merged_projections]
        if self.projections_apart:
            lines += ["", "linear layers of one input left apart:"]
            lines += [f"  {names}: {why}" for names, why in self.projections_apart.items()]
        if self.activations_in_gemm:
            lines += ["", "activations applied by the GEMM before them, with its bias (cuBLASLt's epilogue; no launch for the activation): "
                          + ", ".join(self.activations_in_gemm)]
        if self.activations_apart:
            lines += ["", "activations of a GEMM's output left apart from it:"]
            lines += [f"  {what}: {why}" for what, why in self.activations_apart.items()]
        if self.residuals_in_gemm:
            lines += ["", "residuals added by the GEMM before them (addmm_ into the residual's buffer, beta = 1; no launch for the add): "
                          + ", ".join(self.residuals_in_gemm)]
        if self.upcasts_in_gemm:
            lines += ["", "matmuls of half tensors cast to fp32 run as the half GEMM with an fp32 output (no cast): "
                          + ", ".join(self.upcasts_in_gemm)]
        if self.upcasts_apart:
            lines += ["", "matmuls of fp32 casts left as they are:"]
            lines += [f"  {what}: {why}" for what, why in self.upcasts_apart.items()]
        if self.decode_gemms:
            lines += ["", "GEMMs on fuser's decode GEMM kernel (this GPU's decode-GEMM table; PyTorch's at more tokens):"]
            lines += [f"  {line}" for line in self.decode_gemms]
        if self.gated_in_gemm:
            lines += ["", "gated activations computed by the decode GEMM kernel of their merged gate/up projection (no launch for "
                          "them at the table's sizes): " + ", ".join(self.gated_in_gemm)]
        if self.gated_apart:
            lines += ["", "gated activations of a merged gate/up projection left apart from its GEMM:"]
            lines += [f"  {what}: {why}" for what, why in self.gated_apart.items()]
        if self.norm_in_gemm:
            lines += ["", "RMSNorms computed by the decode GEMM kernel that reads them, as its prologue (no launch for them at the "
                          "table's sizes): " + ", ".join(self.norm_in_gemm)]
        if self.norms_apart:
            lines += ["", "RMSNorms read by a GEMM on the decode GEMM kernel left apart from it:"]
            lines += [f"  {what}: {why}" for what, why in self.norms_apart.items()]
        if self.early_weights:
            lines += ["", "decode GEMMs reading their weight's first chunk while the kernel before them ends (PDL; that kernel "
                          "the same forward's): " + ", ".join(self.early_weights)]
        if self.early_waiting:
            lines += ["", "decode GEMMs waiting for the kernel before them to end before reading their weight:"]
            lines += [f"  {what}: {why}" for what, why in self.early_waiting.items()]
        if self.decode_attention:
            lines += ["", "attention calls on fuser's decode attention kernel at one query row (PyTorch's at any other call): "
                          + ", ".join(self.decode_attention)]
        if self.decode_gemms_untimed:
            lines += ["", f"GEMMs left to PyTorch's at every size, their shapes not in this GPU's decode-GEMM table: "
                          f"{', '.join(self.decode_gemms_untimed)} ({tune_command(self.decode_gemms_untimed)} "
                          "times fuser's kernel against PyTorch's for them on this GPU)"]
        if self.literals:
            values = ", ".join(f"{k}={v!r}" for k, v in self.literals.items())
            lines += ["", f"module attributes fused in as literals (a change runs eager): {values}"]
        if self.state_reads:
            values = ", ".join(f"{k}={v}" for k, v in self.state_reads.items())
            lines += ["", f"read off the call's state as traced (a call where one differs runs eager): {values}"]
        if self.token_ranges:
            lines += ["", "branches on the token count taken as traced (a call with another count runs eager): "
                          + ", ".join(self.token_ranges)]
        if self.free_sizes:
            values = ", ".join(f"{k} dims {v}" for k, v in self.free_sizes.items())
            lines += ["", "inputs that reach no kernel (or only a kernel of the call's inputs alone, which runs their glue as "
                          f"PyTorch's ops at sizes it was not built for: fuser.install.any_size), whose sizes may differ from "
                          f"call to call: {values}"]
        if self.sizes_near_literals:
            values = ", ".join(f"{k} dims {v}" for k, v in self.sizes_near_literals.items())
            lines += ["", f"inputs that reach no kernel, held at their sizes because a literal of the graph lies next to them "
                          f"(it may have been read off them; a model fused at its first decode call is fused again from a later "
                          f"one): {values}"]
        launches = sum(u.launches for u in self.unfused)
        lines += ["", f"unfused glue ({len(self.unfused)} nodes, {launches} launches):"]
        node_w = max([len(u.node) for u in self.unfused] + [8])
        op_w = max([len(u.op) for u in self.unfused] + [8])
        for u in self.unfused:
            lines.append(f"  {u.node:<{node_w}} {u.op:<{op_w}} {u.reason}" + (f"  (at {u.where})" if u.where else ""))
        return "\n".join(lines)


def _shown(path: str) -> str:
    """``path`` relative to the working directory when it is inside it, else as it is."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def tune_command(untimed: list[str]) -> str:
    """The ``fuser tune --decode-gemm`` command that times GEMM shapes (``NxK dtype`` each)."""
    shapes = ",".join(s.split()[0] for s in untimed)
    dtypes = ",".join(sorted({s.split()[1] for s in untimed}))
    return f"`fuser tune --decode-gemm --shapes {shapes} --dtypes {dtypes}`"
