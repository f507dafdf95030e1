"""fixed_at_apply: what the fused graph fixed when it was made, and how the guard sees that it
still holds at a call — values computed from parameters alone (:class:`Precomputed`: recomputed
after their parameters change), the module's scalar attributes held as literals
(:class:`Literals`), and the module itself as it was fused: its tensors' dtypes and devices,
its submodules and their ``training`` flags (:class:`ModuleSnapshot`)."""

from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx

from fuser.codegen.capture_guard import capturing
from fuser.install.fused_graph import compile_function
from fuser.trace.refusal import user_stacklevel


def read_attributes(module: torch.nn.Module, names: tuple[str, ...]) -> tuple:
    """The values of the dotted attribute paths ``names`` on ``module``, as one tuple."""
    if not names:
        return ()
    values = operator.attrgetter(*names)(module)
    return values if len(names) > 1 else (values,)


_MISSING = object()


def _owner(module: torch.nn.Module, path: str):
    """The submodule that holds the attribute at dotted ``path``."""
    owner = path.rpartition(".")[0]
    return module.get_submodule(owner) if owner else module


def version_stamp(tensors) -> tuple:
    """What changes when a tensor is written in place (version counter) or replaced (storage).
    Inference tensors keep no version counter: only their storage is compared."""
    return tuple((0 if t.is_inference() else t._version, t.data_ptr()) for t in tensors)


@dataclass
class Precomputed:
    """Values computed from parameters alone, held in plain module attributes (``names``) and
    recomputed from the parameters they read (``sources``) whenever one of those changes."""

    names: tuple[str, ...]  # the module attributes holding the values
    sources: tuple[str, ...]  # qualified names of the parameters they are computed from
    compute: Callable  # compute(module) -> the values, in the order of ``names``
    seen: tuple = ()  # the sources' stamp when the values were last computed
    warned: bool = False

    def current(self, module: torch.nn.Module) -> bool:
        """True when the held values match the parameters (recomputing them if needed); False
        when they are stale and cannot be recomputed now (inside a CUDA-graph capture)."""
        stamp = version_stamp(read_attributes(module, self.sources))
        if stamp == self.seen:
            return True
        if capturing():
            if not self.warned:
                self.warned = True
                warnings.warn(
                    f"fuser: parameters of {type(module).__name__} ({', '.join(self.sources)}) changed since "
                    "the values computed from them were; they cannot be recomputed during a CUDA-graph "
                    "capture, so this capture runs the eager forward",
                    stacklevel=user_stacklevel(),
                )
            return False
        self.refresh(module, stamp)
        return True

    def refresh(self, module: torch.nn.Module, stamp: tuple) -> None:
        with torch.no_grad():
            values = self.compute(module)
        for name, value in zip(self.names, values):
            held = module.__dict__[name]
            if held.shape == value.shape and held.dtype == value.dtype and held.device == value.device:
                held.copy_(value)  # in place: a CUDA graph captured earlier reads this memory
            else:
                module.__dict__[name] = value.detach().clone()
        self.seen = stamp


def precomputation(graph: fx.Graph, nodes: dict[fx.Node, str]) -> Precomputed:
    """How to recompute the parameter-only ``nodes`` (node -> attribute holding its value):
    the part of ``graph`` they are computed from, as a function of the module."""
    needed: set[fx.Node] = set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack += node.all_input_nodes
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node in needed:
            env[node] = sub.node_copy(node, lambda n: env[n])
    sub.output(tuple(env[n] for n in nodes))
    sources = tuple(sorted(n.target for n in needed if n.op == "get_attr"))
    return Precomputed(tuple(nodes.values()), sources, compile_function(sub, "values computed from parameters"))


@dataclass
class Literals:
    """Scalar attributes of the module (dotted paths) whose values the fused graph holds as
    literals: a call after one of them changed runs the eager forward (with one warning)."""

    values: dict[str, Any]
    warned: bool = False
    # (owner submodule, attribute, value) per path, found at the first call: a submodule
    # replaced since is seen by the guard's ModuleSnapshot, which is asked first
    owners: list | None = None

    def current(self, module: torch.nn.Module) -> bool:
        if self.owners is None:
            self.owners = [(_owner(module, path), path.rpartition(".")[2], value) for path, value in self.values.items()]
        if all(getattr(owner, name, _MISSING) == value for owner, name, value in self.owners):
            return True
        names = tuple(self.values)
        if not self.warned:
            self.warned = True
            now = dict(zip(names, read_attributes(module, names)))
            changed = ", ".join(f"{n}={now[n]!r} (fused with {v!r})" for n, v in self.values.items() if now[n] != v)
            warnings.warn(
                f"fuser: {type(module).__name__} changed {changed} after fuser.apply; the fused forward "
                "holds the old values, so the eager forward runs (fuser.restore and apply again to fuse)",
                stacklevel=user_stacklevel(),
            )
        return False


@dataclass
class ModuleSnapshot:
    """What the fused graph assumed of the module itself: each parameter's and buffer's dtype
    and device (a ``.to(torch.float32)``, ``.half()`` or ``.cuda()`` after apply changes what
    the kernels would read) and each submodule's ``training`` flag (dropout is the identity in
    eval mode only; ``.train()`` after apply must run it)."""

    tensors: tuple  # (module, its _parameters or _buffers, name, dtype, device) per tensor
    training: tuple  # (module, flag) per submodule
    children: tuple = ()  # (module, name, child) per submodule: a replaced one is seen

    @classmethod
    def of(cls, module: torch.nn.Module) -> "ModuleSnapshot":
        tensors, training, children = [], [], []
        for sub in module.modules():
            training.append((sub, sub.training))
            children += [(sub, name, child) for name, child in sub._modules.items()]
            for store in (sub._parameters, sub._buffers):
                tensors += [(sub, store, name, t.dtype, t.device) for name, t in store.items() if t is not None]
        return cls(tuple(tensors), tuple(training), tuple(children))

    def differs(self, module: torch.nn.Module) -> str | None:
        """None when the module still is as it was fused, else what changed."""
        for sub, name, child in self.children:
            if sub._modules.get(name) is not child:
                return f"{type(sub).__name__}.{name} was replaced"
        for sub, flag in self.training:
            if sub.training is not flag:
                return f"{type(sub).__name__}.training is {sub.training}, fused with {flag}"
        for sub, store, name, dtype, device in self.tensors:
            now = store.get(name)
            if now is None or now.dtype is not dtype or now.device != device:
                what = "missing" if now is None else f"{now.dtype} on {now.device}"
                return f"{type(sub).__name__}.{name} is {what}, fused as {dtype} on {device}"
        return None
