"""api: what users call — apply, explain, check — on one module (:mod:`fuser.pipeline.fuse_module`) or on a
model of repeated layers (:mod:`fuser.model.fuse_model`, which fuses each layer structure through the
pipeline).

    fused = fuser.apply(module, example_inputs)   # in place; returns the report
    fuser.restore(module)                         # undo
    report = fuser.explain(module, example_inputs)  # what apply would do, nothing installed
    result = fuser.check(module, example_inputs)    # fused vs eager, outputs and buffers
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from fuser.install.splice import is_fused
from fuser.model.fuse_model import MODEL_ATTR, apply_model, layer_stacks, restore as restore_model
from fuser.model.cuda_graphs import wrap as wrap_in_cuda_graphs
from fuser.model.lazy_model import apply_lazily
from fuser.pipeline.fuse_module import FuserError, apply_plan, plan, tensors_of
from fuser.pipeline.options import library_options
from fuser.pipeline.pass_list import UnknownPass, switched_off
from fuser.ir.report import Report
from fuser.trace.call_spec import state_tensors, with_state_copied
from fuser.install.splice import restore
from fuser.validate.tolerance import LAYER, mismatch
from fuser.trace.tracing import preserved_state
from fuser.validate.against_eager import unordered_outputs


def apply(module: torch.nn.Module, example_inputs=None, **options) -> Report:
    """Fuse ``module``'s glue in place. On any error the module is left exactly as it was.

    With no example call, a model with a stack of decoder layers (a transformers CausalLM; one
    layer is a stack too, a draft model's) is fused at its first decode call — one new token per sequence, as
    ``model.generate`` makes after the prompt — with that call as the example
    (:mod:`fuser.model.lazy_model`); the report returned is filled in then.

    The example call is ``module(*example_inputs, **example_kwargs)`` (``example_kwargs=`` among
    the options): its tensors, nested in tuples, lists and dicts too, are the fused forward's
    inputs; every other value is baked in and checked at each call. A submodule whose forward
    cannot be traced is kept opaque by itself (``report.automatic_leaves``).

    The fused forward runs only when the guard takes the call; otherwise the module's own
    forward runs: other dtypes, devices or non-token sizes, no tokens, autograd (grad enabled
    and an input or parameter requiring grad: the kernels have no backward), the user's
    ``guard`` declining, or a changed literal (below).

    What is fixed at apply time:

    * glue computed from parameters alone (a weight's cast, ``w * scale``) is computed once and
      held in an attribute (``report.precomputed``); the parameters it reads are watched (their
      version counter and storage, so in-place writes under ``no_grad``, ``load_state_dict``
      and replaced storage are seen) and it is recomputed at the next call, or the eager
      forward runs if that call is inside a CUDA-graph capture. A write through ``p.data``
      bypasses the version counter and is not seen: pass ``precompute=False`` to read every
      weight live if weights are written that way;
    * scalar attributes read by the traced forward (``self.eps``) become literals
      (``report.literals``); a call after one of them changed runs the eager forward, with a
      warning.

    A model with a stack of repeated layers (a transformers CausalLM) is fused layer by layer
    (:mod:`fuser.model.fuse_model`): each distinct layer structure is traced once, with the inputs one real
    forward of the model gives its first layer, and its kernels serve every layer of that
    structure; the report is then a :class:`fuser.model.fuse_model.ModelReport`.

    A second apply on a fused module (also from another thread) raises :class:`FuserError`.
    ``copy.deepcopy`` gives a copy fused against its own parameters; pickling (``torch.save``)
    gives the eager module.

    ``cuda_graphs=True`` (a model of decoder layers) replays its decode steps with a static
    cache from CUDA graphs, one per batch size (:mod:`fuser.model.cuda_graphs`).

    ``leaves=[...]`` names more opaque leaves (a submodule's qualified name or its tail, a
    class or its name, a function or its dotted path; an unknown name raises
    :class:`FuserError`); ``FUSER_LEAVES`` adds to them and ``FUSER_PRECOMPUTE=0`` reads every
    weight live where ``precompute=`` is not given (:mod:`fuser.pipeline.options`).

    ``disable_passes=("merge", ...)`` (or ``FUSER_DISABLE_PASSES=merge,...``) switches passes
    of :data:`fuser.pipeline.pass_list.PASS_LIST` off by name, to bisect a wrong result to one;
    ``report.disabled_passes`` names them.
    """
    options = library_options(module, options)
    _check_pass_names(options)
    graphs = options.pop("cuda_graphs", False)
    if graphs and not torch.cuda.is_available():
        warnings.warn("fuser: cuda_graphs=True on a machine without CUDA: nothing is captured", stacklevel=2)
    if example_inputs is None and "example_kwargs" not in options:
        return _apply_lazily(module, dict(options, cuda_graphs=graphs))
    layered = apply_model(module, example_inputs or (), **options)
    if graphs and layered is None:
        raise FuserError(f"cuda_graphs=True: {type(module).__name__} is no model of decoder layers (its decode steps are what is captured)")
    if graphs:
        wrap_in_cuda_graphs(module)
    return layered if layered is not None else apply_plan(module, example_inputs or (), **options).report


def _apply_lazily(module: torch.nn.Module, options: dict) -> Report:
    if not layer_stacks(module):
        raise FuserError(
            f"{type(module).__name__} has no stack of repeated layers to fuse at its first decode call: "
            "pass an example call, fuser.apply(module, example_inputs, example_kwargs=...)"
        )
    if MODEL_ATTR in module.__dict__ or any(is_fused(m) for m in module.modules()):
        raise FuserError(f"{type(module).__name__} is already fused; call fuser.restore() first")
    return apply_lazily(module, **options)


def explain(module: torch.nn.Module, example_inputs, **options) -> Report:
    """What :func:`apply` would fuse, and why the rest is not; installs nothing (a model fused
    layer by layer is fused, reported and restored)."""
    options = library_options(module, options)
    _check_pass_names(options)
    layered = apply_model(module, example_inputs, **options)
    if layered is not None:
        restore_model(module)
        return layered
    with preserved_state(module, tensors_of(example_inputs, options.get("example_kwargs"))):
        return plan(module, example_inputs, **options).report


def _check_pass_names(options: dict) -> None:
    """Refuse a ``disable_passes`` or ``FUSER_DISABLE_PASSES`` name that switches no pass off
    before anything runs (a model's layers would each be left eager with the error)."""
    try:
        switched_off(options.get("disable_passes", ()))
    except UnknownPass as e:
        raise FuserError(str(e)) from None


@dataclass
class CheckResult:
    ok: bool
    problems: list[str]
    compared: list[str]
    report: Report | None = None
    not_run: list[str] = field(default_factory=list)  # candidates whose kernel raised at validation

    @property
    def kernels(self) -> int:
        """Fused kernels that ran against eager."""
        return sum(len(one.chains) for one in module_reports(self.report))

    def text(self) -> str:
        head = "check passed" if self.ok else "check FAILED"
        lines = [f"{head}: fused vs eager on the example inputs ({len(self.compared)} tensors compared, {self.kernels} fused kernels ran)"]
        lines += [f"  {p}" for p in self.problems]
        lines += [f"  could not run (an error of the environment or of fuser, not compared): {n}" for n in self.not_run]
        return "\n".join(lines)


def module_reports(report) -> list[Report]:
    """The per-module reports in ``report``: itself, or a model's per layer structure and other submodule."""
    if report is None:
        return []
    if hasattr(report, "groups"):  # a ModelReport
        return [g.report for g in report.groups if g.report] + list(report.others.values())
    return [report]


def kernels_that_could_not_run(report) -> list[str]:
    """Candidates validation rejected because their kernel raised (``kernel k.py failed: ...``):
    an error of the environment (triton in the wrong mode, out of memory) or of fuser, not a
    difference from the model's eager result, so nothing was compared for them."""
    return [
        f"{r.pattern} at {r.anchor}: {r.reason}"
        for one in module_reports(report) for r in one.rejected
        if r.category == "validation" and r.reason.startswith("kernel ") and " failed: " in r.reason
    ]  # fmt: skip


def _state_tensors(module: torch.nn.Module, inputs: list) -> dict[str, torch.Tensor]:
    tensors = {f"buffer {n}": b for n, b in module.named_buffers()}
    tensors.update({f"input {i}": x for i, x in enumerate(inputs)})
    return tensors


def _run(module, args, kwargs):
    """One call, on a copy of the call's state objects (a KV cache): its output, and every
    buffer, input and state tensor after it."""
    args, kwargs = with_state_copied(args, kwargs)
    with torch.no_grad():
        out = module(*args, **kwargs)
    tensors = {**_state_tensors(module, tensors_of(args, kwargs)), **state_tensors(args, kwargs)}
    return out, {k: v.detach().clone() for k, v in tensors.items()}


def check(module: torch.nn.Module, example_inputs, **options) -> CheckResult:
    """Run fused and eager from identical state; compare outputs and every buffer and input
    the forward writes in place. The module and inputs are left as they were."""
    options = library_options(module, options)
    _check_pass_names(options)
    args, kwargs = tuple(example_inputs), dict(options.get("example_kwargs") or {})
    tensors = tensors_of(args, kwargs)
    with preserved_state(module, tensors):
        eager_out, eager_state = _run(module, args, kwargs)
    layered = _check_layered(module, args, kwargs, eager_out, options)
    if layered is not None:
        return layered
    fused = apply_plan(module, args, **options)
    report = fused.report
    try:
        state = module.__dict__["_fuser_state"]
        reason = state.guard.why_not(args, kwargs)
        if reason:
            return CheckResult(False, [f"the guard refuses the example inputs: {reason}"], [], report)
        with preserved_state(module, tensors):
            fused_out, fused_state = _run(module, args, kwargs)
    finally:
        restore(module)
    problems, compared = [], ["output"] + list(eager_state)
    fused_out, eager_out = unordered_outputs(fused.traced, fused.cops, fused_out, eager_out)
    problem = mismatch(fused_out, eager_out, "output", LAYER)
    if problem:
        problems.append(problem)
    for name, expected in eager_state.items():
        problem = mismatch(fused_state[name], expected, name, LAYER)
        if problem:
            problems.append(problem)
    not_run = kernels_that_could_not_run(report)
    return CheckResult(not problems and not not_run, problems, compared, report, not_run)


def _check_layered(module, args, kwargs, eager_out, options) -> CheckResult | None:
    """:func:`check` on a model fused layer by layer (each layer was checked against its own
    eager forward while fusing): the model's outputs, fused against eager. None when the
    module is no such model."""
    report = apply_model(module, args, **options)
    if report is None:
        return None
    try:
        with preserved_state(module, tensors_of(args, kwargs)):
            fused_out, _ = _run(module, args, kwargs)
    finally:
        restore_model(module)
    problem = mismatch(tensors_of((fused_out,)), tensors_of((eager_out,)), "output", LAYER)
    not_run = kernels_that_could_not_run(report)
    return CheckResult(problem is None and not not_run, [problem] if problem else [], ["output"], report, not_run)




__all__ = ["apply", "restore", "explain", "check", "plan", "FuserError", "Report", "CheckResult"]
