"""leaves: what the trace keeps as one opaque call without being told.

A leaf runs its own code at run time and is never looked into. ``nn.Linear`` and
``nn.Embedding`` always are, unless a subclass defines a forward of its own
(:func:`is_default_leaf`). Besides the leaves a user names (and ``@fuser.opaque``), the trace
makes these by itself, each listed in ``Traced.automatic_leaves`` with the file, line and
reason:

* **untraceable code** — a function or submodule whose code the tracer refused or that raised
  on traced values (a loop over experts, ``.item()``, a branch on data): the innermost such
  function, else the innermost submodule, becomes a leaf and the trace starts again;
* **calls into compiled code**, kept as one call where they are, with no retrace:
  custom ops outside aten (``torch.ops.<ns>.<op>``), Triton kernel launches, and functions of
  C extensions given traced tensors.

Only the traced module's own forward is never made a leaf: what it cannot trace is refused.

The leaves a user names (``fuser.apply(leaves=...)``, ``FUSER_LEAVES``, the CLI's ``--leaf``)
are read by :func:`resolve_leaves`, one way everywhere; a name that names nothing is
:class:`UnknownLeaf`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import inspect
import sys
import sysconfig
import types
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate

from fuser.ir.opaque import is_opaque, opaque
from fuser.trace.refusal import UNKNOWN_LOCATION, TraceRefused, calling_line, error_location, first_line, is_library_file

#: How many leaves one trace may make by retracing before it gives up.
MAX_AUTOMATIC_LEAVES = 64

LEAF = "fuser_leaf"  # node.meta key of a call the trace kept opaque
#: node.meta key of a fused graph's call that took a leaf call's place with its arguments at the
#: same places (a rewrite merged the leaf into it): the leaf's node name
TOOK_OVER = "fuser_took_over"

_STDLIB = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")})
_SITE = ("site-packages", "dist-packages")
_BUILTIN_OP_NAMESPACES = {"aten", "prim", "prims", "_operator"}


@dataclass
class AutomaticLeaf:
    """Code the trace kept as an opaque call by itself."""

    name: str  # a submodule's qualified name, or what is called (function, custom op, kernel)
    where: str  # file:line of the code that could not be traced, or of the call
    reason: str
    function: Callable | None = field(default=None, repr=False, compare=False)  # a function leaf's


# --- the heavy modules, kept whole ------------------------------------------------------------
# Module types kept opaque whatever the user says: the heavy ops of a decode layer. A subclass
# is one too unless its class defines a forward of its own (:func:`is_default_leaf`).
DEFAULT_LEAF_TYPES: tuple[type, ...] = (torch.nn.Linear, torch.nn.Embedding)


def is_default_leaf(module: torch.nn.Module) -> bool:
    """Is ``module`` one of :data:`DEFAULT_LEAF_TYPES` running that type's own forward?

    A subclass whose class overrides ``forward`` may do more than the GEMM or the lookup
    (transformers' ``Llama4Router``: ``super().forward(x)``, then top-k, a scatter into -inf and
    a sigmoid): it is traced into like any module, so that its glue is fused or reported, and
    the ``F.linear`` / ``F.embedding`` it reaches is the heavy op. Code inside that cannot be
    traced (a quantised linear's own kernel) becomes a leaf by the usual rules (below), with
    its reason. A subclass that keeps the base's forward
    (``NonDynamicallyQuantizableLinear``, a parametrized ``Linear``) stays whole; so does a
    forward set on the instance (a hook wrapper's), which only the module call runs."""
    for base in DEFAULT_LEAF_TYPES:
        if isinstance(module, base):
            return type(module).forward is base.forward
    return False


# --- the leaves a user names -------------------------------------------------------------------
class UnknownLeaf(ValueError):
    """A leaf name that names no submodule, module class or function of the module fused."""

    def __init__(self, name: str, module):
        self.name = name
        known = [n for n, _ in module.named_children()] if isinstance(module, torch.nn.Module) else []
        # what follows the name in the message (the CLI puts ``--leaf`` before it)
        self.detail = (
            f"names no submodule, module class or function of {type(module).__name__}"
            f" (its submodules: {', '.join(known) or 'none'})"
        )
        super().__init__(f"leaf {name!r} {self.detail}")


def resolve_leaves(module, names: Iterable) -> list:
    """Leaf names -> what the trace keeps opaque, read one way by ``fuser.apply(leaves=...)``,
    ``FUSER_LEAVES`` and the CLI's ``--leaf``:

    * anything but a string (a module class, a function, a module instance): as it is;
    * a submodule's qualified name in ``module``, or the tail of one (``"mlp"`` names every
      ``...mlp``, each decoder layer's when a whole model is fused layer by layer): the
      submodules themselves, which the trace keeps opaque by identity, so that a name relative
      to the model reaches each layer's trace (:mod:`fuser.model.fuse_model` traces each layer
      on its own, with names relative to the layer);
    * the class name of a submodule: that class (every instance of it is a leaf);
    * ``package.module.function``: that function.

    A string that is none of these raises :class:`UnknownLeaf`. The result holds each leaf once.
    """
    submodules = [(n, m) for n, m in module.named_modules() if n] if isinstance(module, torch.nn.Module) else []
    classes = {type(m).__name__: type(m) for _, m in submodules}
    leaves: list = []
    for name in names or ():
        if not isinstance(name, str):
            found = [name]
        elif name and (found := [m for n, m in submodules if n == name or n.endswith("." + name)]):
            pass
        elif name in classes:
            found = [classes[name]]
        elif (function := _function_at(name)) is not None:
            found = [function]
        else:
            raise UnknownLeaf(name, module)
        leaves += [x for x in found if not any(x is y for y in leaves)]
    return leaves


def _function_at(path: str):
    """The function a dotted path ``package.module.function`` names, or None."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        return None
    try:
        value = getattr(importlib.import_module(module_name), attr, None)
    except Exception:  # noqa: BLE001 - not an importable module: not a function path
        return None
    return value if callable(value) and not isinstance(value, type) else None


# --- which namespaces hold a function by name --------------------------------------------------
# (the loaded modules' ids, the modules, held so that no id is reused, their user namespaces)
_NAMESPACES: tuple[tuple, list, list[dict]] = ((), [], [])


def _user_namespaces() -> list[dict]:
    """The dicts of every loaded module outside torch, Triton, the stdlib and fuser (found anew
    once the loaded modules change; what each dict holds is read when it is used)."""
    global _NAMESPACES
    modules = list(sys.modules.values())
    loaded = tuple(map(id, modules))
    if loaded != _NAMESPACES[0]:
        _NAMESPACES = (loaded, modules, _find_user_namespaces(modules))
    return _NAMESPACES[2]


def _find_user_namespaces(modules: list) -> list[dict]:
    spaces = []
    for module in modules:
        namespace = _namespace(module)
        file = namespace.get("__file__") if isinstance(namespace, dict) else None
        if isinstance(namespace, dict) and not (file and (is_library_file(file) or _is_stdlib(file))):
            spaces.append(namespace)
    return spaces


def _namespace(module) -> dict | None:
    """A loaded module's dict (what ``sys.modules`` holds may be another object: its own
    ``__dict__``), read without running its ``__getattr__``."""
    try:
        namespace = object.__getattribute__(module, "__dict__")
    except Exception:  # noqa: BLE001 - an object without a dict of its own holds nothing by name
        return None
    return namespace if isinstance(namespace, dict) else None


def _static(value, name: str):
    """``value.name`` as stored (an instance's own attribute, else its class's), or None: no
    ``__getattr__`` or property runs. A lazy module (sglang's ``LazyImport``) imports what it
    stands for on any other attribute read, and looking at loaded modules must import nothing."""
    try:
        return inspect.getattr_static(value, name, None)
    except Exception:  # noqa: BLE001 - an object whose very layout cannot be read: nothing there
        return None


def _is_stdlib(file: str) -> bool:
    return file.startswith(_STDLIB) and not any(s in file for s in _SITE)


def opaque_functions() -> list[Callable]:
    """Functions marked @fuser.opaque, in any loaded module outside the libraries."""
    found = {}
    for namespace in _user_namespaces():
        for value in list(namespace.values()):
            if isinstance(value, types.FunctionType) and is_opaque(value):
                found[id(value)] = value
    return list(found.values())


def compiled_functions() -> list[Callable]:
    """Functions of loaded C extensions (outside torch, Triton and the stdlib): given a traced
    tensor, each is kept as one call."""
    found = {}
    for module in list(sys.modules.values()):
        namespace = _namespace(module)
        if not isinstance(module, types.ModuleType) or namespace is None:
            continue
        origin = getattr(namespace.get("__spec__"), "origin", None) or ""
        if not isinstance(origin, str) or not origin.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)):
            continue
        if is_library_file(origin) or _is_stdlib(origin):
            continue
        for value in list(namespace.values()):
            if isinstance(value, types.BuiltinFunctionType) and getattr(value, "__self__", None) is module:
                found[id(value)] = value
    return list(found.values())


def _find_proxy(args, kwargs) -> fx.Proxy | None:
    found = []
    map_aggregate((args, kwargs), lambda a: found.append(a) if isinstance(a, fx.Proxy) else None)
    return found[0] if found else None


class patched_leaf_functions:
    """While tracing, each of ``functions`` called with a traced value is one graph node,
    wherever the traced code reaches it from: every module that holds it by name (a helper in
    another module, a private ``_name``, a C extension's own attribute) holds the patch."""

    def __init__(self, functions: Iterable[Callable], compiled: Iterable[Callable] = ()):
        self.leaves = {id(f): (f, False) for f in functions}
        self.leaves.update({id(f): (f, True) for f in compiled if id(f) not in self.leaves})

    def __enter__(self):
        self._patched = []
        if not self.leaves:
            return self
        for namespace in _user_namespaces():
            for name, value in list(namespace.items()):
                hit = self.leaves.get(id(value))
                if hit is not None and hit[0] is value:
                    namespace[name] = _leaf_call(*hit)
                    self._patched.append((namespace, name, value))
        return self

    def __exit__(self, *exc):
        for namespace, name, value in reversed(self._patched):
            namespace[name] = value
        return False


def _leaf_call(fn: Callable, compiled: bool) -> Callable:
    @functools.wraps(fn)
    def call(*args, **kwargs):
        proxy = _find_proxy(args, kwargs)
        if proxy is None:
            return fn(*args, **kwargs)
        if compiled:
            module = getattr(fn, "__module__", None) or getattr(getattr(fn, "__self__", None), "__name__", "?")
            proxy.tracer.note(
                AutomaticLeaf(
                    f"{module}.{fn.__name__}",
                    calling_line(),
                    "a compiled function (a C extension's) given traced tensors: one call, as it is",
                )
            )
        result = proxy.tracer.create_proxy("call_function", fn, args, kwargs)
        result.node.meta[LEAF] = True
        return result

    return call


# --- custom ops and kernel launches ------------------------------------------------------------
def custom_op(target) -> AutomaticLeaf | None:
    """The leaf record of a call of ``torch.ops.<ns>.<op>`` outside aten, else None."""
    if not isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return None
    namespace = getattr(target, "namespace", None) or str(target).split(".")[0]
    if namespace in _BUILTIN_OP_NAMESPACES:
        return None
    return AutomaticLeaf(f"torch.ops.{target}", calling_line(), "a custom op (compiled code): one call, as it is")


class KernelLaunch:
    """A Triton kernel launched from traced code: one opaque call that launches it."""

    def __init__(self, kernel):
        self.kernel = kernel
        name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", "kernel")
        self.__name__ = self.__qualname__ = f"launch_{name}"
        self.__module__ = __name__
        opaque(self)

    def __call__(self, *args, **kwargs):
        return self.kernel.run(*args, **kwargs)


class kernel_launches_as_leaves:
    """While tracing, a Triton launch given traced values becomes one node (run, for the
    shadows, on their real values) instead of running on proxies."""

    def __enter__(self):
        self._patched = []
        try:
            from triton.runtime import jit as triton_jit
        except ImportError:
            return self
        targets = [triton_jit.JITFunction]
        try:
            from triton.runtime.interpreter import InterpretedFunction

            targets.append(InterpretedFunction)
        except ImportError:
            pass
        launches: dict[int, KernelLaunch] = {}
        for cls in targets:
            original = cls.run

            def run(kernel, *args, __original=original, **kwargs):
                proxy = _find_proxy(args, kwargs)
                if proxy is None:
                    return __original(kernel, *args, **kwargs)
                launch = launches.setdefault(id(kernel), KernelLaunch(kernel))
                proxy.tracer.note(
                    AutomaticLeaf(
                        f"Triton kernel {launch.__name__.removeprefix('launch_')}",
                        calling_line(),
                        "a Triton kernel launch: one call, as it is",
                    )
                )
                return proxy.tracer.create_proxy("call_function", launch, args, kwargs)

            cls.run = run
            self._patched.append((cls, original))
        return self

    def __exit__(self, *exc):
        for cls, original in self._patched:
            cls.run = original
        return False


# --- untraceable code: which function or submodule to keep opaque ------------------------------
def leaf_after(error: Exception, taken: list[AutomaticLeaf]) -> AutomaticLeaf | None:
    """What to keep opaque after ``error`` stopped the trace: the innermost function the traced
    code called straight (in a module's namespace, so that it can be patched) that the error came
    out of, else the innermost submodule it came out of; None when the error came from the traced
    forward's own code (then it is the trace's answer) or nothing new is left to try."""
    if len(taken) >= MAX_AUTOMATIC_LEAVES:
        return None
    names = {a.name for a in taken}
    where, reason = error_location(error), _reason(error)
    try:
        functions = _functions_raising(error)
    except Exception:  # noqa: BLE001 - the user's objects misbehaved while looked at: no function to name
        functions = []
    for function in functions:
        name = f"{function.__module__}.{function.__qualname__}"
        if name not in names:
            return AutomaticLeaf(name, where, reason, function)
    submodule = getattr(error, "_fuser_submodule", None)
    if submodule is None or submodule in names:
        return None
    return AutomaticLeaf(submodule, getattr(error, "_fuser_where", where), reason)


def _reason(error: Exception) -> str:
    message = first_line(error) or type(error).__name__
    if not isinstance(error, TraceRefused):
        return f"{type(error).__name__}: {message}"
    where = error.location
    return message[len(where) :].lstrip(": ") if where != UNKNOWN_LOCATION and message.startswith(where) else message


def _functions_raising(error: Exception) -> list[Callable]:
    """The functions ``error`` came out of, innermost first, that user code called straight,
    below the innermost module forward (the traced root's or a submodule's)."""
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    user = [i for i, f in enumerate(frames) if not is_library_file(f.f_code.co_filename)]
    found, held = [], None
    for k in reversed(range(1, len(user))):
        frame = frames[user[k]]
        if _is_module_forward(frame):
            break
        held = _functions_held() if held is None else held
        function, wrapped = held.get(frame.f_code, (None, False))
        # Called straight from user code, or through the library wrapper the module holds
        # (a decorator's): a call through anything else (a hook, a module call) has no name to patch.
        if function is not None and (wrapped or user[k - 1] == user[k] - 1):
            found.append(function)
    return found


def _is_module_forward(frame) -> bool:
    self_ = frame.f_locals.get("self")
    if not isinstance(self_, torch.nn.Module):
        return False
    return any(frame.f_code is getattr(vars(c).get("forward"), "__code__", None) for c in type(self_).__mro__)


def _functions_held() -> dict[types.CodeType, tuple[Callable, bool]]:
    """Code -> the first function a loaded module holds by name that runs it, and whether it
    runs it through a wrapper (a decorated function: the module holds the wrapper). Read without
    running any of the values' code (:func:`_static`): a lazy import held by name stays unimported."""
    held: dict = {}
    for namespace in _user_namespaces():
        for value in list(namespace.values()):
            if isinstance(value, type) or not callable(value):
                continue
            if (code := _code_of(value)) is not None:
                held.setdefault(code, (value, False))
            if (code := _code_of(_unwrapped(value))) is not None:
                held.setdefault(code, (value, True))
    return held


def _code_of(value) -> types.CodeType | None:
    """The code a plain Python function (or a method of one) runs, else None."""
    if isinstance(value, types.MethodType):
        value = value.__func__
    return value.__code__ if isinstance(value, types.FunctionType) else None


def _unwrapped(value, depth: int = 100):
    """The function a decorator's wrapper wraps (its ``__wrapped__`` chain, as stored), or None."""
    inner = None
    while depth and (wrapped := _static(value, "__wrapped__")) is not None:
        if not callable(wrapped) or isinstance(wrapped, type):
            break
        inner = value = wrapped
        depth -= 1
    return inner
