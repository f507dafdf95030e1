"""splice: put the fused graph back into the eager module, in place, behind a guard.

The fused forward is Python generated from the rewritten fx graph with ``self`` as the root,
called with the live module: parameters, buffers and leaves are looked up on it at every call,
so nothing is copied and ``state_dict`` is unchanged. ``module.forward`` becomes a
:class:`GuardedForward` that runs the fused graph only when the call looks like the traced one
(dtypes, devices, non-token sizes, at least one token, no autograd, the user's own predicate,
the module's captured scalar attributes unchanged) on the module as it was fused (each
parameter's and buffer's dtype and device, each submodule's ``training`` flag:
:class:`ModuleSnapshot`), and the original forward otherwise. Under Dynamo (``torch.compile``
of the module or of a model around it) it runs the original forward: Dynamo compiles the
module's own code and never meets the generated kernels. In Triton's CPU interpreter
fused forwards run one at a time (the interpreter patches triton.language around each launch).

Glue computed from parameters alone (a weight's cast) is computed once at apply time and held
in a plain attribute; the guard watches the parameters it reads (version counter and storage)
and recomputes it, in place, after they change. :func:`restore` undoes everything. A deep copy
is fused against its own parameters; a pickled (``torch.save``) module is the eager one: every
``_fuser_*`` attribute and every forward hook of fuser's is left out of its state.
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
import types
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from fuser.install.fixed_at_apply import Literals, ModuleSnapshot, Precomputed, read_attributes, version_stamp
from fuser.install.merged_weights import MergedWeights
from fuser.trace.call_spec import CallSpec
from fuser.trace.refusal import user_stacklevel
from fuser.trace.tracing import Traced, token_count, token_input
from fuser.validate.against_eager import INTERPRETER_LOCK

STATE_ATTR = "_fuser_state"
ANY = -1  # a size of the guard's record that may be anything (fuser.install.free_sizes)
FUSER_PREFIX = "_fuser_"  # every attribute fuser puts on a module


@dataclass
class Guard:
    """When the fused forward may run: what the trace assumed about the call."""

    call: CallSpec  # the traced call's structure and non-tensor values
    traced: list[tuple[str, Any]]  # (graph input name, (dtype, device, sizes)) per tensor
    predicate: Callable[..., bool] | None = None
    state_reads: tuple = ()  # what the trace read off state objects (fuser.trace.call_spec.StateRead)
    # input name -> {dim: the literals next to its size} for the dims held only because of them
    near_literals: dict[str, dict[int, frozenset]] = field(default_factory=dict)
    # a call was declined for such a dim, at a size whose next (a cache grows by one a step)
    # lies clear of those literals: a fuse from the next call would leave the dim free
    declined_near_literal: bool = False
    # branches on the token count taken as traced (fuser.trace.proxy.TokenRange), and where the
    # call's token count is read (fuser.trace.tracing.token_input)
    token_ranges: tuple = ()
    token_input: tuple[int, int, int] | None = None

    @classmethod
    def from_trace(cls, module: torch.nn.Module, traced: Traced, predicate=None, free=None, near_literals=None) -> "Guard":
        """``free``: input name -> dims of any size; ``near_literals``: dims held only because
        a literal lies next to their size (:mod:`fuser.install.free_sizes`)."""
        specs = []
        for name, value in zip(traced.input_names, traced.example_inputs):
            if not isinstance(value, torch.Tensor):
                specs.append((name, None))  # state: the call spec checks its type
                continue
            batch, any_size = traced.batch_inputs.get(name), (free or {}).get(name, ())
            sizes = tuple(None if i == batch else ANY if i in any_size else s for i, s in enumerate(value.shape))
            specs.append((name, (value.dtype, value.device, sizes)))
        where = token_input(traced.input_names, traced.example_inputs, traced.batch_inputs, traced.batch_rows)
        return cls(traced.call, specs, predicate, tuple(traced.state_reads), dict(near_literals or {}),
                   token_ranges=tuple(traced.token_ranges), token_input=where)

    def why_not(self, args, kwargs) -> str | None:
        """None when the fused forward applies to this call, else the reason it does not."""
        return self.check(args, kwargs)[1]

    def check(self, args, kwargs) -> tuple[list | None, str | None]:
        """(the graph's inputs in order, None) when the fused forward applies, else (None, why)."""
        tensors, reason = self.call.flatten(args, kwargs)
        if reason is None:
            reason = self._mismatch(tensors)
        if reason is None and self.token_ranges:
            reason = self._tokens_outside(tensors)
        if reason is None and self.state_reads:
            reason = self._state_changed(tensors)
        if reason is None and self.predicate is not None and not self.predicate(*args, **kwargs):
            reason = USER_GUARD
        if reason is not None:
            return None, reason
        return tensors, None

    def _tokens_outside(self, tensors) -> str | None:
        tokens = token_count(tensors, self.token_input)
        for branch in self.token_ranges:
            if not branch.holds(tokens):
                return f"{tokens} tokens: a branch on the token count was traced for {branch.shown()} ({branch.where})"
        return None

    def _state_changed(self, tensors) -> str | None:
        states = {name: value for (name, spec), value in zip(self.traced, tensors) if spec is None}
        inputs = {name: value for (name, _), value in zip(self.traced, tensors)}
        for read in self.state_reads:
            why = read.differs(states[read.state], inputs)
            if why is not None:
                return why
        return None

    def _mismatch(self, tensors) -> str | None:
        for (name, spec), value in zip(self.traced, tensors):
            if spec is None:
                continue
            dtype, device, sizes = spec
            if value.dtype != dtype or value.device != device or value.dim() != len(sizes):
                return f"{name} is {value.dtype} {tuple(value.shape)} on {value.device}"
            for i, (have, want) in enumerate(zip(value.shape, sizes)):
                if want == ANY:
                    continue
                if want is None:
                    if have == 0:
                        return f"{name} has no tokens"
                elif have != want:
                    near = self.near_literals.get(name, {}).get(i)
                    if near is not None:
                        self.declined_near_literal |= not near & {have, have + 1, have + 2}
                        return f"{name} dim {i} is {have}, traced with {want} (held: a literal of the graph lies next to {want})"
                    return f"{name} dim {i} is {have}, traced with {want}"
        return None


@dataclass
class CallCounts:
    """How the calls of a fused module went: fused, or declined by reason (the guard's reason,
    or what changed on the module). The first decline of a module warns, naming its reason,
    unless it is the user's own guard declining or a change that warns itself."""

    fused: int = 0
    declined: dict[str, int] = field(default_factory=dict)
    warned: bool = False

    def decline(self, module: torch.nn.Module, reason: str, warn: bool) -> None:
        self.declined[reason] = self.declined.get(reason, 0) + 1
        if warn and not self.warned and not declines_expected():
            self.warned = True
            warnings.warn(
                f"fuser: {type(module).__name__} runs its own forward, not the fused one: {reason} "
                "(fuser.stats counts every call; later ones do not warn)",
                stacklevel=user_stacklevel(),
            )


_EXPECTED = threading.local()


def expect_declines(on: bool) -> None:
    """Within a call fuser runs eager by design (a lazily fused model's prefill:
    :mod:`fuser.model.lazy_model`), declines are counted but do not warn; nested calls nest."""
    _EXPECTED.depth = getattr(_EXPECTED, "depth", 0) + (1 if on else -1)


def declines_expected() -> bool:
    return getattr(_EXPECTED, "depth", 0) > 0


#: The hooks every module call runs (``register_module_forward_hook``, ``..._pre_hook``).
_GLOBAL_HOOKS = (torch.nn.modules.module._global_forward_hooks, torch.nn.modules.module._global_forward_pre_hooks)
USER_GUARD = "the user guard declined"
AUTOGRAD = "autograd would record the call (grad enabled and an input or parameter requires grad): the kernels have no backward"


@dataclass
class FuserState:
    original_forward: Callable | None  # the instance attribute we replaced, if any
    fused: Callable  # fused(module, *traced_args): the fused graph, run on the module given
    guard: Guard
    report: Any
    constants: tuple[str, ...] = ()  # attributes holding values computed from parameters
    precomputed: Precomputed | None = None
    literals: Literals = field(default_factory=lambda: Literals({}))
    snapshot: ModuleSnapshot | None = None
    calls: CallCounts = field(default_factory=CallCounts)
    merged: MergedWeights | None = None  # linear layers whose weights are merged (their parameters views)
    # the forward-hook tables of the submodules whose work the fused graph does without calling
    # them (a merged linear layer, one whose GEMM adds the residual): read at each call, since a
    # hook put on one after apply would not run
    bypassed_hooks: tuple[dict, ...] = ()

    def stale(self, module: torch.nn.Module) -> tuple[str | None, bool]:
        """(None, _) when what the fused graph fixed at apply time still holds; else (what
        changed, whether that already warned)."""
        if self.snapshot is not None:
            why = self.snapshot.differs(module)
            if why is not None:
                return why, False
        if self.bypassed_hooks and (any(self.bypassed_hooks) or _GLOBAL_HOOKS[0] or _GLOBAL_HOOKS[1]):
            return "a forward hook on a linear layer the fused graph runs without calling it (merged, adding the residual, or on the decode GEMM kernel)", False
        if self.merged is not None and not self.merged.current(module):
            return "linear layers' weights no longer fit the merged GEMM (or were replaced inside a CUDA-graph capture)", False
        if self.literals.values and not self.literals.current(module):
            return "a scalar attribute the fused graph holds changed", True
        if self.precomputed is not None and not self.precomputed.current(module):
            return "parameters changed inside a CUDA-graph capture", True
        return None, False


def _eager_forward(module: torch.nn.Module, state: FuserState | None) -> Callable:
    if state is not None and state.original_forward is not None:
        return state.original_forward
    return type(module).forward.__get__(module)


def wants_grad(module: torch.nn.Module, tensors) -> bool:
    """Would autograd record this call (``tensors``: every tensor it passes, nested ones too)?
    The fused kernels have no backward, so it must run eager. Parameters are asked at each call
    (after grad mode): requires_grad may change after apply."""
    if not torch.is_grad_enabled():
        return False
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors) or any(
        p.requires_grad for p in module.parameters()
    )  # state objects (a KV cache, a batch's metadata) are among them: their tensors are not inputs


class GuardedForward:
    """``module.forward`` while fused: the fused graph when the guard takes the call, the
    module's own forward otherwise. It holds the module, not a copy of anything, so a deep copy
    of the module gets a guarded forward of its own."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    @property
    def __wrapped__(self) -> Callable:  # inspect.signature() shows the module's own signature
        return _eager_forward(self.module, self.module.__dict__.get(STATE_ATTR))

    def __call__(self, *args, **kwargs):
        module = self.module
        state = module.__dict__.get(STATE_ATTR)
        if torch.compiler.is_compiling():  # Dynamo compiles the module's own code (docstring)
            return _eager_forward(module, state)(*args, **kwargs)
        if state is not None:
            traced_args, why = state.guard.check(args, kwargs)  # every tensor of the call, or None
            warned = why == USER_GUARD  # the user's own predicate: not news to them
            if why is None and wants_grad(module, traced_args):
                why = AUTOGRAD
            if why is None:
                why, warned = state.stale(module)
            if why is None:
                state.calls.fused += 1
                with _one_at_a_time():
                    return state.fused(module, *traced_args)
            state.calls.decline(module, why, warn=not warned)
        return _eager_forward(module, state)(*args, **kwargs)


def _one_at_a_time():
    """The interpreter's lock where kernels run in Triton's CPU interpreter (fused forwards and
    validation then run one at a time, nested ones in the same thread too); nothing otherwise."""
    return INTERPRETER_LOCK if os.environ.get("TRITON_INTERPRET") == "1" else contextlib.nullcontext()


# apply and restore of one module are serialised; different modules fuse concurrently.
_LOCKS: "weakref.WeakKeyDictionary[torch.nn.Module, threading.RLock]" = weakref.WeakKeyDictionary()
_LOCKS_LOCK = threading.Lock()


def module_lock(module: torch.nn.Module) -> threading.RLock:
    """The lock held while ``module`` is being fused or restored."""
    with _LOCKS_LOCK:
        lock = _LOCKS.get(module)
        if lock is None:
            lock = _LOCKS[module] = threading.RLock()
        return lock


class AlreadyFused(ValueError):
    """install() on a module that is fused already (by another thread, say)."""


COPY_HOOKS = ("__getstate__", "__deepcopy__")


def install(
    module: torch.nn.Module,
    fused_forward: Callable,
    guard: Guard,
    report,
    constants=None,
    precomputed: Precomputed | None = None,
    literals: dict[str, Any] | None = None,
    merged: MergedWeights | None = None,
    bypassed: tuple[str, ...] = (),
) -> None:
    """Route ``module.forward`` through the guard to ``fused_forward`` (a function, or a method
    whose function is called with the module as ``self``).

    ``constants`` (name -> tensor) become plain attributes of the module — not parameters or
    buffers, so ``state_dict`` is unchanged; they hold values computed from parameters, which
    ``precomputed`` recomputes after those change. ``literals`` are the module's scalar
    attributes the fused graph holds as constants (dotted path -> value at apply time).
    ``merged`` concatenates the weights of linear layers the fused graph runs as one GEMM and
    makes their parameters views of it (:mod:`fuser.install.merged_weights`). ``bypassed``: the
    submodules (qualified names) whose work the fused graph does without calling them; a call
    made after a forward hook is put on one runs eager.
    Raises :class:`AlreadyFused` (leaving the module as it is) when it is fused already.
    """
    constants = constants or {}
    fused = getattr(fused_forward, "__func__", fused_forward)
    with module_lock(module):
        if is_fused(module):
            raise AlreadyFused(f"{type(module).__name__} is already fused; call fuser.restore() first")
        for name, value in constants.items():  # (first: a precomputed value may read one)
            object.__setattr__(module, name, value)
        if precomputed is not None:
            precomputed.seen = version_stamp(read_attributes(module, precomputed.sources))
        if merged is not None:
            merged.merge(module)
        state = FuserState(
            module.__dict__.get("forward"), fused, guard, report, tuple(constants), precomputed, Literals(dict(literals or {})),
            ModuleSnapshot.of(module), merged=merged,
            bypassed_hooks=tuple(t for name in bypassed for m in [module.get_submodule(name)] for t in (m._forward_hooks, m._forward_pre_hooks)),
        )
        add_copy_hooks(module)
        object.__setattr__(module, STATE_ATTR, state)
        module.__dict__["forward"] = GuardedForward(module)


def add_copy_hooks(module: torch.nn.Module) -> None:
    """Instance hooks that copy and pickle consult before the class's: a deep copy keeps what
    fuser put on the module (fused against the copy's own parameters); pickling (torch.save)
    gives the eager module, since the fused code is generated at apply time and cannot be
    pickled. Given to every module fuser changes: a fused one, and a model's modules that
    hold fuser's report or hooks (:mod:`fuser.model`)."""
    module.__dict__["__getstate__"] = types.MethodType(_eager_state, module)
    module.__dict__["__deepcopy__"] = types.MethodType(_fused_deepcopy, module)


def remove_copy_hooks(module: torch.nn.Module) -> None:
    for name in COPY_HOOKS:
        module.__dict__.pop(name, None)


#: A module's forward-hook tables, and the tables keyed by the same hook ids.
_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks")
_HOOK_FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _fusers(hook) -> bool:
    return getattr(hook, "__module__", "").startswith("fuser.")


def _eager_state(module: torch.nn.Module) -> dict:
    """The module's pickled state, as if it had never been fused: no ``_fuser_*`` attribute,
    no copy hook, no held constant, no forward hook of fuser's."""
    state = type(module).__getstate__(module)
    state = dict(state) if state is not None else dict(module.__dict__)
    fuser_state = state.get(STATE_ATTR)
    for name in (*COPY_HOOKS, *(fuser_state.constants if fuser_state else ())):
        state.pop(name, None)
    for name in [n for n in state if n.startswith(FUSER_PREFIX)]:
        del state[name]
    fuser_hooks = {i for table in _HOOK_TABLES for i, hook in state.get(table, {}).items() if _fusers(hook)}
    for table in (*_HOOK_TABLES, *_HOOK_FLAGS):
        if fuser_hooks and table in state:
            state[table] = type(state[table])((i, v) for i, v in state[table].items() if i not in fuser_hooks)
    if type(state.get("forward")).__module__.startswith("fuser."):  # guarded, or replayed from graphs
        del state["forward"]
        if fuser_state is not None and fuser_state.original_forward is not None:
            state["forward"] = fuser_state.original_forward
    return state


def _fused_deepcopy(module: torch.nn.Module, memo: dict) -> torch.nn.Module:
    """What copy.deepcopy does for a module, keeping the fused state: every reference to the
    module (the guarded forward's) and to its parameters becomes one to the copy's."""
    cls = type(module)
    twin = cls.__new__(cls)
    memo[id(module)] = twin
    state = type(module).__getstate__(module)
    state = {k: v for k, v in (state if state is not None else module.__dict__).items() if k not in COPY_HOOKS}
    twin.__setstate__(copy.deepcopy(state, memo))
    add_copy_hooks(twin)
    return twin


def restore(module: torch.nn.Module) -> None:
    """Undo :func:`fuser.apply`: the module's forward is its own again."""
    with module_lock(module):
        state = module.__dict__.get(STATE_ATTR)
        if state is None:
            raise ValueError(f"{type(module).__name__} is not fused by fuser")
        if state.original_forward is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = state.original_forward
        for name in state.constants:
            module.__dict__.pop(name, None)
        if state.merged is not None:
            state.merged.remove(module)  # (the layers' parameters stay views of the merged tensors)
        if not any(n.startswith(FUSER_PREFIX) and n != STATE_ATTR for n in module.__dict__):
            remove_copy_hooks(module)  # (a model's module that holds fuser's report keeps them)
        del module.__dict__[STATE_ATTR]


def is_fused(module: torch.nn.Module) -> bool:
    return STATE_ATTR in module.__dict__


def call_counts(module: torch.nn.Module) -> dict[str, dict]:
    """Each fused module in ``module`` (itself included) by qualified name: its calls that ran
    fused, and those declined, by reason."""
    return {
        name: {"fused": state.calls.fused, "declined": dict(state.calls.declined)}
        for name, m in module.named_modules()
        if (state := m.__dict__.get(STATE_ATTR)) is not None
    }
