"""global_reads: the engine-wide flag functions traced code calls (sglang's
``get_is_capture_mode()``) read as guarded values (:class:`GlobalReads`), each replaced
during the trace, in its own module and in every module that imported it by name, by one
that records what it returned."""

from __future__ import annotations

import contextlib
import enum
import functools
import importlib
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

from fuser.serving.fuse_on_call import Unfusable


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
