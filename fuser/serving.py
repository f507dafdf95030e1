"""serving: fuse inside a serving engine, lazily and never inside a CUDA-graph capture.

Engine-neutral; an engine adapter (``fuser/sglang_plugin.py``) decides *which* layers and
calls qualify and supplies its engine's facts (its leaf classes, how a call says "decode").

* :class:`ModeSplice` wraps a layer's ``forward``: a call the adapter's predicate accepts
  (sglang: ``forward_batch.forward_mode.is_decode()``) runs with the mode set
  (:func:`mode_active`); any other call runs exactly the original code.
* :func:`fusion_targets` picks the submodules of a layer to fuse: the topmost ones that are
  not leaves and do not pass the engine's per-call state into leaves that consume it
  (attention). A target that takes the state is traced with it as state
  (:mod:`fuser.signature`): the values it reads off it are guarded at every call.
* :class:`GlobalReads` reads the engine-wide flags traced code calls (sglang's
  ``get_is_capture_mode()``) as guarded values: a call where one differs from what the
  trace saw runs the module's own code.
* :class:`LazyFusion` fuses one module at its first call while the mode is set, with that
  call's real inputs as the example (an engine's warm-ups, which run before any capture,
  are that call). Its fused forward is guarded on the mode.
* :class:`ClosureSeam` is a decorator for nested helper functions (closures) that an engine
  would hand to ``torch.compile``: each is fused at its first call on a stream that is not
  capturing, keyed by its code object and the contents of its closure cells.

Whatever cannot be fused stays eager and is logged once with the reason; ``strict`` raises
instead. A first call that arrives while the current stream is capturing runs eager (and is
logged): nothing is ever traced, compiled or validated inside a capture.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import importlib
import inspect
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from fuser.capture import capturing

log = logging.getLogger("fuser")


# ------------------------------------------------------------------------------------------
# Options (environment variables, inherited by an engine's worker processes)
# ------------------------------------------------------------------------------------------

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_flag(environ, name: str, default: bool = False) -> bool:
    """``environ[name]`` read as a boolean; unset or empty gives ``default``."""
    value = environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={environ[name]!r}: expected one of {', '.join(_TRUE + _FALSE)}")


def env_names(environ, name: str, separator: str = ",") -> tuple[str, ...]:
    return tuple(x.strip() for x in environ.get(name, "").split(separator) if x.strip())


@dataclass(frozen=True)
class Options:
    """What the serving integration does; :meth:`from_env` reads the ``FUSER_*`` variables."""

    enable: bool = False  # FUSER_ENABLE
    layers: tuple[str, ...] = ()  # FUSER_LAYERS: decoder-layer class names (an adapter's default)
    patterns: tuple[str, ...] = ()  # FUSER_PATTERNS: extra pattern files, os.pathsep-separated
    leaves: tuple[str, ...] = ()  # FUSER_LEAVES: extra opaque leaves
    draft: bool = False  # FUSER_DRAFT: also fuse speculative-decoding draft models
    strict: bool = False  # FUSER_STRICT: raise instead of leaving a module eager
    precompute: bool = True  # FUSER_PRECOMPUTE: parameter-only glue computed once at fuse time
    compile_seam: bool = True  # FUSER_COMPILE_SEAM: replace the engine's torch.compile seam
    explain: bool = False  # FUSER_EXPLAIN: log what is selected, and each fused module's full report

    @classmethod
    def from_env(cls, environ=None):
        environ = os.environ if environ is None else environ
        return cls(
            enable=env_flag(environ, "FUSER_ENABLE"),
            layers=env_names(environ, "FUSER_LAYERS") or cls().layers,
            patterns=env_names(environ, "FUSER_PATTERNS", os.pathsep),
            leaves=env_names(environ, "FUSER_LEAVES"),
            draft=env_flag(environ, "FUSER_DRAFT"),
            strict=env_flag(environ, "FUSER_STRICT"),
            precompute=env_flag(environ, "FUSER_PRECOMPUTE", True),
            compile_seam=env_flag(environ, "FUSER_COMPILE_SEAM", True),
            explain=env_flag(environ, "FUSER_EXPLAIN"),
        )

    def apply_options(self) -> dict:
        """The keyword arguments of :func:`fuser.apply` these options give."""
        options = {} if self.precompute else {"precompute": False}
        if self.patterns:
            options["patterns"] = list(self.patterns)
        if self.leaves:
            options["leaves"] = list(self.leaves)
        return options


# ------------------------------------------------------------------------------------------
# Fusing one module, outside any capture
# ------------------------------------------------------------------------------------------


class Unfusable(Exception):
    """A module or closure fuser leaves eager; the message says which and why."""


def fuse_now(module: torch.nn.Module, args: tuple, kwargs: dict, options: Options, leaves=(), **apply_options):
    """``fuser.apply`` on one real call's inputs (``leaves``: more opaque leaves, the engine's
    classes); the report. Raises :class:`Unfusable` when nothing can be fused (the module is
    then exactly as it was)."""
    import fuser

    apply_options = {**options.apply_options(), **apply_options}
    leaves = [*apply_options.pop("leaves", []), *leaves]
    if leaves:
        apply_options["leaves"] = leaves
    try:
        report = fuser.apply(module, args, example_kwargs=kwargs, **apply_options)
    except fuser.FuserError as e:
        raise Unfusable(str(e)) from e
    if not report.chains:
        fuser.restore(module)
        raise Unfusable(f"no glue to fuse ({report.launches_before} glue launches, none fusible)")
    return report


def give_up(name: str, reason: str, options: Options) -> None:
    """Log that ``name`` stays eager, or raise :class:`fuser.FuserError` when strict."""
    import fuser

    if options.strict:
        raise fuser.FuserError(f"fuser: {name} cannot be fused: {reason}")
    log.warning("fuser: %s left eager: %s", name, reason)


def log_fused(what: str, report, options: Options, note: str = "") -> None:
    """Log that ``what`` was fused (its glue launches, eager -> fused); with ``options.explain``,
    its whole report too, as ``fuser explain`` prints it."""
    log.info("fuser: %s fused: %d glue launches -> %d%s", what, report.launches_before, report.launches_after, note)
    if options.explain:
        log.info("%s", report.text())


def postponed_by_capture(waiting, name: str, options: Options) -> bool:
    """Is the current stream capturing? Then the first call of ``name`` runs eager, logged once
    per ``waiting`` (a :class:`LazyFusion` or :class:`FusedClosure`; raises when strict), and a
    later call outside the capture fuses it."""
    import fuser

    if not capturing():
        return False
    if not waiting.warned_capture:
        waiting.warned_capture = True
        message = (f"fuser: the first call of {name} came during CUDA-graph capture; it runs eager there "
                   "(fuser traces and compiles only outside a capture: a warm-up call fuses it)")
        if options.strict:
            raise fuser.FuserError(message)
        log.warning("%s", message)
    return True


# ------------------------------------------------------------------------------------------
# What an engine adapter says about its modules
# ------------------------------------------------------------------------------------------


def _forward_of(module: torch.nn.Module) -> Callable:
    return module.forward


@dataclass(frozen=True)
class EngineFacts:
    """An engine adapter's facts about its modules, for target selection and tracing.

    ``is_leaf``: a module never fused nor looked into (GEMMs, attention, experts, the
    engine's own kernels). ``searched``: a module that passes the engine's per-call state
    into a leaf that consumes it (attention, a KV-cache writer): it is searched for targets,
    not traced. ``called_method``: the method the engine's call of a module runs (its
    ``forward``, or what a ``forward(*args, **kwargs)`` dispatches to); that is what is traced.
    ``global_reads``: dotted paths of engine-wide flag functions that traced code may call
    (``get_is_capture_mode``); each one read is a guarded value (:class:`GlobalReads`).
    ``always_guarded``: dotted paths of zero-argument functions compared at every call of
    every target, read or not (a setting the adapter's own decisions depend on)."""

    is_leaf: Callable[[torch.nn.Module], bool]
    searched: Callable[[torch.nn.Module], bool]
    called_method: Callable[[torch.nn.Module], Callable] = _forward_of
    global_reads: tuple[str, ...] = ()
    always_guarded: tuple[str, ...] = ()


def leaf_paths(module: torch.nn.Module, is_leaf: Callable[[torch.nn.Module], bool]) -> list[str]:
    """The qualified names of ``module``'s topmost submodules that are leaves (what the trace
    keeps opaque, by name: a class may be a leaf in one configuration and glue in another)."""
    paths = []

    def visit(prefix: str, parent: torch.nn.Module):
        for name, child in parent.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if is_leaf(child):
                paths.append(path)
            else:
                visit(path, child)

    visit("", module)
    return paths


def resolve_dotted(path: str):
    """The object a dotted path names (``package.module.function``), or None if it does not import."""
    module_name, _, attribute = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    return getattr(module, attribute, None)


class GlobalReads:
    """Engine-wide flag functions (``get_is_capture_mode()``) read as guarded values.

    While :meth:`recording` is active, each function is replaced, in its own module and in
    every module that imported it by name, by one that records what it returned for its
    arguments; a value that is not a plain value (a tensor, an object), or two different
    values for one call, make the module :class:`Unfusable`. :meth:`unchanged` calls each
    recorded function again and compares: the guard of the fused forward. Functions in
    ``always`` are zero-argument and compared whether the traced code read them or not."""

    def __init__(self, paths: Iterable[str], always: Iterable[str] = ()):
        self.functions = {p: f for p in paths if callable(f := resolve_dotted(p))}
        self.always = {p: f for p in always if callable(f := resolve_dotted(p))}
        self.values: dict[tuple, Any] = {}  # (path, args, kwargs) -> value
        self.problem: str | None = None

    def snapshot_always(self) -> None:
        for path, function in self.always.items():
            self.values[path, (), ()] = function()

    @contextlib.contextmanager
    def recording(self):
        """Inside the block every call of the functions is recorded (:meth:`check` says whether
        what was recorded can be guarded)."""
        replaced = []  # (namespace, name, original)
        with _GLOBALS_LOCK:
            try:
                holders = _holders(self.functions.values())
                for path, function in self.functions.items():
                    recorder = self._recorder(path, function)
                    for namespace, name in holders[id(function)]:
                        replaced.append((namespace, name, function))
                        namespace[name] = recorder
                yield self
            finally:
                for namespace, name, original in reversed(replaced):
                    namespace[name] = original

    def check(self) -> None:
        """Raise :class:`Unfusable` when a read cannot be guarded."""
        if self.problem is not None:
            raise Unfusable(self.problem)

    def _recorder(self, path: str, function: Callable) -> Callable:
        @functools.wraps(function)
        def record(*args, **kwargs):
            value = function(*args, **kwargs)
            key = (path, args, tuple(sorted(kwargs.items())))
            if not _plain_value(value):
                self.problem = f"{path}{args} returned {type(value).__name__}, not a value the guard can compare"
            elif key in self.values and self.values[key] != value:
                self.problem = f"{path}{args} returned {self.values[key]!r} and then {value!r} during the trace"
            else:
                self.values[key] = value
            return value

        return record

    def read(self) -> dict[str, Any]:
        """What was read, for the log: ``path(args) -> value``."""
        return {f"{p}{a if a else '()'}": v for (p, a, _), v in self.values.items()}

    def unchanged(self) -> bool:
        functions = {**self.functions, **self.always}
        return all(functions[p](*a, **dict(k)) == v for (p, a, k), v in self.values.items())


_GLOBALS_LOCK = threading.RLock()


_HOLDERS: dict = {}  # (function ids, number of modules loaded) -> holders


def _holders(functions: Iterable[Callable]) -> dict[int, list[tuple[dict, str]]]:
    """For each function (by id): every (module namespace, name) that holds it, its own module
    and each module that imported it by name. One pass over the loaded modules, kept until
    another module loads."""
    functions = list(functions)
    key = (tuple(id(f) for f in functions), len(sys.modules))
    if key not in _HOLDERS:
        wanted = {id(f) for f in functions}
        found = {id(f): [] for f in functions}
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if not isinstance(namespace, dict):
                continue
            for name, value in list(namespace.items()):
                if id(value) in wanted and callable(value):
                    found[id(value)].append((namespace, name))
        _HOLDERS.clear()
        _HOLDERS[key] = found
    return _HOLDERS[key]


def _plain_value(value) -> bool:
    if value is None or isinstance(value, (bool, int, float, str, enum.Enum)):
        return True
    if isinstance(value, tuple):
        return all(_plain_value(v) for v in value)
    return False


# ------------------------------------------------------------------------------------------
# The mode splice
# ------------------------------------------------------------------------------------------

_MODE = threading.local()
SPLICE_ATTR = "_fuser_mode_splice"


def mode_active() -> bool:
    """True while a spliced layer runs a call its adapter accepted (in this thread)."""
    return getattr(_MODE, "depth", 0) > 0


class ModeSplice:
    """One layer: its forward wrapped so that a call ``accepts(bound_arguments)`` takes runs
    with :func:`mode_active` set, and its fusion targets wrapped to fuse themselves at their
    first such call. ``functools.wraps`` keeps the signature (engines read it)."""

    def __init__(self, name: str, layer: torch.nn.Module, accepts: Callable[[dict], bool],
                 targets: Iterable[tuple[str, torch.nn.Module]], options: Options, facts: EngineFacts,
                 on_fused: Callable[[LazyFusion], None] | None = None):
        self.name, self.layer, self.options = name, layer, options
        self.original = layer.__dict__.get("forward")
        eager = layer.forward
        binder = inspect.signature(eager)

        @functools.wraps(eager)
        def forward(*args, **kwargs):
            if not accepts(binder.bind_partial(*args, **kwargs).arguments):
                return eager(*args, **kwargs)
            _MODE.depth = getattr(_MODE, "depth", 0) + 1
            try:
                return eager(*args, **kwargs)
            finally:
                _MODE.depth -= 1

        layer.forward = forward
        object.__setattr__(layer, SPLICE_ATTR, self)
        self.targets = [LazyFusion(f"{name}.{path}" if name else path, module, options, facts, on_fused)
                        for path, module in targets]

    def remove(self) -> None:
        """Undo the splice and every fusion it made."""
        for target in self.targets:
            target.remove()
        if self.original is None:
            del self.layer.forward
        else:
            self.layer.forward = self.original
        del self.layer.__dict__[SPLICE_ATTR]


def uninstall(model: torch.nn.Module) -> None:
    """Undo every :class:`ModeSplice` in ``model``."""
    for module in model.modules():
        splice = module.__dict__.get(SPLICE_ATTR)
        if splice is not None:
            splice.remove()


def target_decisions(layer: torch.nn.Module, facts: EngineFacts) -> list[tuple[str, str, str]]:
    """What :func:`fusion_targets` decides for each submodule it looks at, top down:
    ``(path, class name, "leaf" | "searched" | "target")``. A leaf (``facts.is_leaf``: GEMMs,
    attention, experts, the engine's own kernels) is never fused nor looked into; a module
    that passes the engine's per-call state into a leaf that consumes it (``facts.searched``:
    attention) is searched, not traced; the topmost others are the targets, whether their
    called method takes the engine's state or not (it is traced as state)."""
    decisions = []

    def visit(prefix: str, module: torch.nn.Module):
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if facts.is_leaf(child):
                decisions.append((path, type(child).__name__, "leaf"))
            elif facts.searched(child):
                decisions.append((path, type(child).__name__, "searched"))
                visit(path, child)
            else:
                decisions.append((path, type(child).__name__, "target"))

    visit("", layer)
    return decisions


def decisions_text(name: str, layer: torch.nn.Module, decisions: list[tuple[str, str, str]]) -> str:
    """``decisions`` (:func:`target_decisions` of ``layer``) as an indented table, under a line
    naming the layer."""
    width = max(len(path) + 2 * path.count(".") for path, _, _ in decisions)
    lines = [f"fuser: {name} ({type(layer).__name__}): leaves, searched modules and fusion targets"]
    for path, cls, decision in decisions:
        indented = "  " * path.count(".") + path
        lines.append(f"  {indented:<{width}}  {cls:<36} {decision}")
    return "\n".join(lines)


def fusion_targets(layer: torch.nn.Module, facts: EngineFacts) -> list[tuple[str, torch.nn.Module]]:
    """The submodules of ``layer`` to fuse (see :func:`target_decisions`)."""
    return [(path, layer.get_submodule(path)) for path, _, decision in target_decisions(layer, facts)
            if decision == "target"]


class LazyFusion:
    """One module, fused at its first call while the mode is set, outside any capture.

    What is traced is the method the engine's call runs (``facts.called_method``), with the
    engine's leaves kept opaque by name. Once fused, a call runs the fused forward only while
    the mode is set and every engine-wide flag the trace read still has its value
    (:class:`GlobalReads`); any other call runs the module's own forward."""

    def __init__(self, name: str, module: torch.nn.Module, options: Options, facts: EngineFacts,
                 on_fused: Callable[[LazyFusion], None] | None = None):
        self.name, self.module, self.options, self.facts = name, module, options, facts
        self.on_fused = on_fused
        self.original = module.__dict__.get("forward")
        self.state = "waiting"  # -> "fused" | "eager"
        self.report = None
        self.globals = GlobalReads(facts.global_reads, facts.always_guarded)
        self.fused_module = module  # or the method the module's forward dispatches to, as a module
        self.warned_capture = False
        eager = module.forward

        @functools.wraps(eager)
        def forward(*args, **kwargs):
            if self.state == "waiting" and mode_active():
                self.fuse(args, kwargs)
            if self.state == "fused" and self.takes_fused_path():
                return self.module_forward(*args, **kwargs)
            return eager(*args, **kwargs)

        self.module_forward = eager
        module.forward = forward

    @property
    def label(self) -> str:
        return f"{self.name} ({type(self.module).__name__})"

    def takes_fused_path(self) -> bool:
        return mode_active() and self.globals.unchanged()

    def fuse(self, args, kwargs) -> None:
        if postponed_by_capture(self, self.label, self.options):
            return  # stays waiting
        wrapper = self.module.forward
        del self.module.forward  # fuse the module's own forward, not this wrapper
        if self.original is not None:
            self.module.forward = self.original
        method = self.facts.called_method(self.module)
        if getattr(method, "__func__", method) is not getattr(self.module.forward, "__func__", None):
            self.fused_module = method_module(self.module, method.__name__)  # a forward(*args) dispatching
        leaves = leaf_paths(self.fused_module, self.facts.is_leaf)
        try:
            self.globals.snapshot_always()
            with self.globals.recording():
                self.report = fuse_now(self.fused_module, args, kwargs, self.options, leaves,
                                       guard=lambda *a, **k: self.takes_fused_path())
            self.globals_guardable()
        except Unfusable as e:
            self.state = "eager"  # and unwrapped: nothing of fuser's stays on the module
            give_up(self.name, str(e), self.options)
            return
        except BaseException:
            self.module.forward = wrapper
            raise
        self.module_forward = self.fused_module.forward
        self.module.forward = wrapper
        self.state = "fused"
        read = self.globals.read()
        log_fused(self.name, self.report, self.options, f" (guarded on {read})" if read else "")
        if self.on_fused is not None:
            self.on_fused(self)

    def globals_guardable(self) -> None:
        """Raise :class:`Unfusable`, leaving the module unfused, when a global read cannot be guarded."""
        from fuser.splice import restore

        try:
            self.globals.check()
        except Unfusable:
            restore(self.fused_module)
            raise

    def remove(self) -> None:
        from fuser.splice import is_fused, restore

        if is_fused(self.fused_module):
            if self.fused_module is self.module:
                self.module.forward = self.module_forward  # the guarded forward fuser installed
            restore(self.fused_module)
        if self.original is None:
            self.module.__dict__.pop("forward", None)
        else:
            self.module.forward = self.original


# ------------------------------------------------------------------------------------------
# The closure seam: fuser in place of torch.compile on nested helper functions
# ------------------------------------------------------------------------------------------


class ClosureModule(torch.nn.Module):
    """A closure as a module fuser can apply to: ``forward`` calls it, with its signature."""

    def __init__(self, function: Callable):
        super().__init__()
        self.function = function

    def extra_repr(self) -> str:
        return where(self.function)


def closure_module(function: Callable) -> ClosureModule:
    """A :class:`ClosureModule` for ``function``, of a class named after it (the report's name)."""
    signature = inspect.signature(function)

    def forward(self, *args, **kwargs):
        return self.function(*args, **kwargs)

    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    forward.__signature__ = signature.replace(parameters=[self_parameter, *signature.parameters.values()])
    cls = type(function.__name__, (ClosureModule,), {"forward": forward, "__module__": function.__module__})
    return cls(function)


class MethodModule(torch.nn.Module):
    """One method of a module as a module fuser can apply to: ``forward`` calls
    ``self.owner.<method>`` with the method's signature. The owner is a submodule, so its
    parameters stay parameters (read live, as the owner's)."""

    def __init__(self, owner: torch.nn.Module, method: str):
        super().__init__()
        self.owner, self.method = owner, method

    def extra_repr(self) -> str:
        return f"{type(self.owner).__name__}.{self.method}"


def method_module(owner: torch.nn.Module, method: str) -> MethodModule:
    """A :class:`MethodModule` for ``owner.<method>``, of a class named after the owner's (the report's name)."""
    signature = inspect.signature(getattr(owner, method))

    def forward(self, *args, **kwargs):
        return getattr(self.owner, self.method)(*args, **kwargs)

    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    forward.__signature__ = signature.replace(parameters=[self_parameter, *signature.parameters.values()])
    cls = type(f"{type(owner).__name__}.{method}", (MethodModule,), {"forward": forward, "__module__": type(owner).__module__})
    return cls(owner, method)


def where(function: Callable) -> str:
    """``file:line`` of a function's definition."""
    code = function.__code__
    return f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}"


def closure_key(function: Callable) -> tuple | None:
    """The code object and the identity of each closure cell's contents, or None when a cell
    is empty. The cells themselves are new at each call of the enclosing function; what
    they hold (``self``, a config) is what makes two closures the same computation."""
    contents = []
    for cell in function.__closure__ or ():
        try:
            contents.append(cell.cell_contents)
        except ValueError:
            return None
    return (function.__code__, tuple(id(c) for c in contents))


def _has_proxy(values) -> bool:
    return any(isinstance(v, torch.fx.Proxy) for v in values)


class FusedClosure:
    """One closure (code object + cell contents): its module, its state and its report."""

    def __init__(self, function: Callable):
        self.function = function  # holds the cell contents, so their ids stay theirs
        self.name = f"{function.__qualname__} ({where(function)})"
        self.module = closure_module(function)
        self.state = "waiting"  # -> "fused" | "eager"
        self.report = None
        self.warned_capture = False


class ClosureSeam:
    """``decorate(function)`` stands in for an engine's ``torch.compile`` decorator on nested
    helpers. While ``active()`` holds (sglang: capture mode) the decorated closure is fused at
    its first call on a stream that is not capturing, and every later call of the same code
    with the same cell contents, inside a capture too, runs the fused forward (its guard
    sends other dtypes, shapes or autograd to the closure itself). While ``active()`` does not
    hold, ``decorate`` returns the function as it is. Never calls ``torch.compile``."""

    #: Closures of one code object with different cell contents fused at most (a closure over
    #: a value made afresh at each call would otherwise fuse at every call).
    MAX_VARIANTS = 32

    def __init__(self, options: Options, active: Callable[[], bool]):
        self.options, self.active = options, active
        self.entries: dict[tuple, FusedClosure] = {}
        self.variants: dict[Any, int] = {}
        self.refused: set = set()  # code objects already logged as not keyable
        self.lock = threading.RLock()

    def decorate(self, function: Callable) -> Callable:
        if not self.active():
            return function

        @functools.wraps(function)
        def call(*args, **kwargs):
            return self.call(function, args, kwargs)

        return call

    def call(self, function: Callable, args: tuple, kwargs: dict):
        if _has_proxy(args) or _has_proxy(kwargs.values()):
            return function(*args, **kwargs)  # being traced itself: the trace sees the code
        entry = self.entry(function)
        if entry is None:
            return function(*args, **kwargs)
        if entry.state == "waiting":
            self.fuse(entry, args, kwargs)
        if entry.state == "fused":
            return entry.module(*args, **kwargs)
        return function(*args, **kwargs)

    def entry(self, function: Callable) -> FusedClosure | None:
        key = closure_key(function)
        code = function.__code__
        with self.lock:
            if key is None or (key not in self.entries and self.variants.get(code, 0) >= self.MAX_VARIANTS):
                if code not in self.refused:
                    self.refused.add(code)
                    why = ("a closure cell is empty" if key is None else
                           f"more than {self.MAX_VARIANTS} different closure cell contents")
                    give_up(f"{function.__qualname__} ({where(function)})", why, self.options)
                return None
            entry = self.entries.get(key)
            if entry is None:
                entry = self.entries[key] = FusedClosure(function)
                self.variants[code] = self.variants.get(code, 0) + 1
            return entry

    def fuse(self, entry: FusedClosure, args: tuple, kwargs: dict) -> None:
        with self.lock:
            if entry.state != "waiting":
                return
            if postponed_by_capture(entry, entry.name, self.options):
                return
            tensors = [(n, v) for n, v in inspect.signature(entry.function).bind(*args, **kwargs).arguments.items()
                       if isinstance(v, torch.Tensor)]
            try:
                entry.report = fuse_now(entry.module, args, kwargs, self.options,
                                        batch_inputs=token_major(tensors))
            except Unfusable as e:
                entry.state = "eager"
                give_up(entry.name, str(e), self.options)
                return
            entry.state = "fused"
            log_fused(f"compile seam: {entry.name}", entry.report, self.options)

    def summary(self) -> list[dict]:
        """Each closure seen: its name, state and launches (eager -> fused)."""
        return [{"name": e.name, "state": e.state,
                 "launches": None if e.report is None else [e.report.launches_before, e.report.launches_after]}
                for e in self.entries.values()]


def token_major(tensors: list[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """The batch dims of a closure's tensor arguments: dim 0 of every argument that is not
    a parameter (weights are passed in as arguments too) and has the first such argument's
    row count."""
    activations = [(n, v) for n, v in tensors if not isinstance(v, torch.nn.Parameter) and v.dim() >= 1]
    if not activations:
        return {}
    rows = activations[0][1].shape[0]
    return {n: 0 for n, v in activations if v.shape[0] == rows}
