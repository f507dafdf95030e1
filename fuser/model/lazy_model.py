"""lazy_model: ``fuser.apply(model)`` with no example call — the model is fused at its first
decode call, with that call as the example.

A decode call brings one new token per sequence: its token input (``input_ids`` [B, 1],
``inputs_embeds`` [B, 1, H], else its first tensor argument) has 1 as dim 1. The first such call,
outside a CUDA-graph capture and Dynamo, is what :func:`fuser.model.fuse_model.apply_model`
fuses the model on — whatever ``generate`` passes then (its cache type, ``position_ids``, a
padding mask, the batch size) is what the trace sees — and the call then runs on the fused
layers. Calls before it (the prefill) run eager.

A layer whose guard holds a size only because a literal of its graph lies next to it (a
padding mask of 17 keys in a graph with a head dim of 16:
:func:`fuser.install.free_sizes.free_sizes`) declines the decode steps after the one it was
fused at, as the mask grows. Once a decline comes at a length whose next lies clear of the
literal (the guard tells), the next decode call fuses the model again, from that call (at most
:data:`MAX_FUSES_AGAIN` times; a prefill in between calls it off): the dim is free then, and
the plan serves every length after. The report says so (``ModelReport.fused_again``).

Afterwards a call of more than one new token per sequence (the next prompt's prefill) runs
eager by design: its declines are counted (``fuser.stats``) without a warning. A decode call
that a fused module declines warns once, as any decline does. A model that cannot be fused
runs eager, with one warning naming why (the report says it too); ``fuser.restore(model)``
removes everything, the hooks included.

transformers' ``generate`` compiles the forward by itself for a static cache; under Dynamo a
fused module runs its own code, so fuser's kernels would not run: the model's
``generation_config.disable_compile`` is set while it is fused (and put back by restore).
"""

from __future__ import annotations

import logging
import threading
import warnings

import torch
import torch.nn as nn

from fuser.codegen.capture_guard import capturing
from fuser.install.splice import STATE_ATTR, add_copy_hooks, expect_declines
from fuser.model import cuda_graphs, fuse_model
from fuser.model.decode_calls import is_decode_call
from fuser.model.fuse_model import MODEL_ATTR
from fuser.model.fuse_model import restore as restore_fused
from fuser.model.model_report import ModelReport
from fuser.trace.refusal import user_stacklevel

log = logging.getLogger("fuser")

LAZY_ATTR = "_fuser_lazy"  # on a model fused at its first decode call: its LazyModel
MAX_FUSES_AGAIN = 2  # fuses from a later decode call, for sizes held by a literal next to them


class LazyModel:
    """Forward hooks on the model: at its first decode call, fuse it; around every other call
    (a prefill), declines are expected."""

    def __init__(self, model: nn.Module, report: ModelReport, options: dict):
        self.cuda_graphs = options.pop("cuda_graphs", False)
        self.model, self.report, self.options = model, report, options
        self.state = "waiting"  # -> "fused" or "eager"
        self.near_literal_guards = []  # the fused modules' guards that hold a size by a literal next to it
        self._per_thread()
        self.compile_setting = _turn_off_auto_compile(model)
        model.register_forward_pre_hook(self.before, with_kwargs=True)
        model.register_forward_hook(self.after, with_kwargs=True, always_call=True)

    def _per_thread(self) -> None:
        self.lock = threading.Lock()
        self.local = threading.local()  # .fusing: the calls apply_model makes; .prefills: a stack

    def __getstate__(self) -> dict:  # a deep copy of the model gets its own lock
        return {k: v for k, v in self.__dict__.items() if k not in ("lock", "local")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._per_thread()

    def before(self, model, args, kwargs):
        if torch.compiler.is_compiling():
            return None
        decode = is_decode_call(args, kwargs)
        fusing = getattr(self.local, "fusing", False)
        if decode and not fusing and not capturing():
            if self.state == "waiting":
                self._fuse(args, kwargs)
            elif self.near_literal_guards and any(g.declined_near_literal for g in self.near_literal_guards):
                self._fuse_again(args, kwargs)
        prefill = not decode and not fusing
        self.local.prefills = [*getattr(self.local, "prefills", []), prefill]
        if prefill:
            expect_declines(True)
        return None

    def after(self, model, args, kwargs, output):
        prefills = getattr(self.local, "prefills", None)
        if prefills and not torch.compiler.is_compiling() and prefills.pop():
            expect_declines(False)
            # the next decode call's length is the new prompt's, not one more than a declined
            # one's; and what the prefill's own calls declined says nothing of decode steps
            for guard in self.near_literal_guards:
                guard.declined_near_literal = False
        return None

    def _fuse(self, args, kwargs) -> None:
        with self.lock:
            if self.state != "waiting":
                return
            self.local.fusing = True
            try:
                fused = fuse_model.apply_model(self.model, args, kwargs, report=self.report, **self.options)
            except Exception as e:  # noqa: BLE001 - the model runs eager, said once
                self._give_up(f"{type(e).__name__}: {e}")
                return
            finally:
                self.local.fusing = False
            if fused is None:
                self._give_up("its layer stacks are not called as decoder layers (hidden states in and out)")
                return
            self.state = "fused"
            self.report.pending = None
            if len(self.report.fused_again) < MAX_FUSES_AGAIN:
                guards = (m.__dict__[STATE_ATTR].guard for m in self.model.modules() if STATE_ATTR in m.__dict__)
                self.near_literal_guards = [g for g in guards if g.near_literals]
            if self.cuda_graphs:
                cuda_graphs.wrap(self.model)

    def _fuse_again(self, args, kwargs) -> None:
        """Undo the fuse and fuse from this decode call: a size held by a literal next to it
        at the first one declined a later call (the module docstring)."""
        with self.lock:
            if self.state != "fused":
                return
            held = sorted({f"{name} dims {sorted(dims)}" for g in self.near_literal_guards if g.declined_near_literal
                           for name, dims in g.near_literals.items()})  # fmt: skip
            cuda_graphs.unwrap(self.model)
            restore_fused(self.model)
            self.model.__dict__[MODEL_ATTR] = self.report
            add_copy_hooks(self.model)
            self.report.groups, self.report.others, self.report.skipped = [], {}, {}
            self.report.fused_again.append(f"{', '.join(held)}: held by a literal next to their sizes at the call fused before")
            self.near_literal_guards, self.state = [], "waiting"
            log.info("fuser: %s is fused again at a later decode call (%s)", type(self.model).__name__, self.report.fused_again[-1])
        self._fuse(args, kwargs)

    def _give_up(self, why: str) -> None:
        self.state = "eager"
        self.report.pending = f"left eager: {why}"
        warnings.warn(f"fuser: {type(self.model).__name__} runs eager: {why}", stacklevel=user_stacklevel())

    def remove(self) -> None:
        """Take the hooks and the CUDA graphs off and put transformers' compile setting back."""
        cuda_graphs.unwrap(self.model)
        for table in (self.model._forward_pre_hooks, self.model._forward_hooks):
            for key in [k for k, hook in table.items() if getattr(hook, "__self__", None) is self]:
                del table[key]
                self.model._forward_hooks_always_called.pop(key, None)
                self.model._forward_hooks_with_kwargs.pop(key, None)
                self.model._forward_pre_hooks_with_kwargs.pop(key, None)
        config = getattr(self.model, "generation_config", None)
        if self.compile_setting is not _UNSET and config is not None:
            config.disable_compile = self.compile_setting


_UNSET = object()


def _turn_off_auto_compile(model: nn.Module):
    """Set ``generation_config.disable_compile`` (transformers); the value it had, or _UNSET."""
    config = getattr(model, "generation_config", None)
    if config is None or not hasattr(config, "disable_compile"):
        return _UNSET
    before = config.disable_compile
    if not before:
        config.disable_compile = True
        log.info("fuser: %s: transformers' automatic torch.compile in generate is off while fused "
                 "(under Dynamo a fused module runs its own code)", type(model).__name__)
    return before


def apply_lazily(model: nn.Module, **options) -> ModelReport:
    """Hook ``model`` to fuse itself at its first decode call; the report, filled in then."""
    report = ModelReport(type(model).__name__, pending="fuses at the model's first decode call (one new token per sequence)")
    model.__dict__[LAZY_ATTR] = LazyModel(model, report, options)
    model.__dict__[MODEL_ATTR] = report
    add_copy_hooks(model)  # a copy is fused lazily too; a pickle is the eager model
    return report


def restore(module: nn.Module) -> None:
    """Undo :func:`fuser.apply` — on one module, a model fused layer by layer, or one waiting
    for its first decode call — and take off its CUDA graphs."""
    cuda_graphs.unwrap(module)
    lazy = module.__dict__.pop(LAZY_ATTR, None)
    if lazy is not None:
        lazy.remove()
    restore_fused(module)
