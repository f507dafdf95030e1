"""pattern: the declarative pattern format (:func:`fuser.match.pattern_files.load_pattern` loads a file
with located errors).

A pattern file (one chain per file, in ``patterns/``) holds exactly three things::

    '''Weighted RMSNorm in fp32, cast back (sglang RMSNorm.forward_native).'''
    import torch
    from fuser.pattern import Param, tensor

    def reference(x, weight, eps=Param(1e-6)):          # the chain, in plain PyTorch;
        xf = x.float()                                   # also its golden reference
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (xf * weight).to(x.dtype)

    PATTERN = dict(
        template="row_reduce",                           # templates/row_reduce.py.jinja
        inputs=dict(                                     # shapes (T = tokens) and dtypes
            x=tensor("T, N", "bfloat16 float16 float32"),
            weight=tensor("N", "bfloat16 float32"),
        ),
        example=dict(N=64),                              # sizes to trace the reference at
    )

A hand-written template (one that is not a row program, like ``sinkhorn``) may name the
reference's outputs, ``outputs=("sorted_ids", "perm", "offsets")``: the kernel's output
arguments then carry those names, and an output nobody outside the chain reads is left out (the
template writes only the outputs it is given). ``constraint=lambda bins, top: top == bins - 1``
is a condition on the captured ``Param`` values, by name, that a match must meet.

``Param(value)`` arguments are literals the matcher captures from the model instead of
requiring them equal (eps, a clamp limit); ``Param(20, search=range(1, 65))`` is a structural
integer (a loop count) that the matcher searches for. Everything else in the reference must
appear in the model as written, up to the spellings ``fuser.canon.canonicalize`` folds together.
"""

from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

PACKAGE_DIR = Path(__file__).resolve().parent


def _data_dir(name: str) -> Path:
    """``patterns/`` or ``templates/``: beside the package in a checkout, inside it when installed."""
    for candidate in (PACKAGE_DIR / name, PACKAGE_DIR.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"fuser cannot find its {name}/ directory next to {PACKAGE_DIR}")


def patterns_dir() -> Path:
    return _data_dir("patterns")


def templates_dir() -> Path:
    return _data_dir("templates")


def is_hand_written(template: str) -> bool:
    """Is ``template`` written by hand from its pattern's parameters (``sinkhorn``,
    ``expert_sort``: its kernel reads the matched inputs itself), rather than the frame of a
    row program fuser lowers from the chain (``pointwise``, ``row_reduce``: they extend
    ``_row_program.py.jinja``)? Read off the template file, so a new one needs no list."""
    return _hand_written(templates_dir() / f"{template}.py.jinja")


@functools.lru_cache(maxsize=None)
def _hand_written(path: Path) -> bool:
    return not re.search(r"""{%-?\s*extends\s+["']_row_program\.py\.jinja["']""", path.read_text())


class PatternError(Exception):
    """A malformed pattern file. The message starts with ``file:line:``."""


class FloatParam(float):
    search = None


class IntParam(int):
    search = None


def Param(default: float | int, search=None):
    """A literal of the reference the matcher captures from the model (or searches for)."""
    if isinstance(default, bool) or not isinstance(default, (int, float)):
        raise TypeError(f"Param takes an int or a float, not {default!r}")
    p = IntParam(default) if isinstance(default, int) else FloatParam(default)
    p.search = tuple(search) if search is not None else None
    return p


def is_param(value) -> bool:
    return isinstance(value, (FloatParam, IntParam))


DTYPES = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
    "int32": torch.int32, "int64": torch.int64,
}  # fmt: skip


@dataclass(frozen=True)
class TensorSpec:
    dims: tuple[str, ...]  # symbols, integers as strings, "..." (any static dims); "T" = tokens
    dtypes: tuple[torch.dtype, ...]


def tensor(dims: str, dtypes: str) -> TensorSpec:
    """``tensor("T, N", "bfloat16 float32")``: a tensor input's shape symbols and dtypes."""
    names = tuple(d.strip() for d in dims.split(",")) if dims.strip() else ()
    if "" in names:
        raise ValueError(f"an empty dimension in {dims!r}: write the dims as symbols or integers between commas")
    for d in names:
        if not re.fullmatch(r"[A-Za-z_]\w*|\d+|\.\.\.", d):
            raise ValueError(f"dimension {d!r} in {dims!r} is neither a symbol nor an integer")
    unknown = [d for d in dtypes.split() if d not in DTYPES]
    if unknown or not dtypes.split():
        raise ValueError(f"unknown dtype(s) {unknown} in {dtypes!r}; known: {' '.join(DTYPES)}")
    return TensorSpec(names, tuple(DTYPES[d] for d in dtypes.split()))


ALLOWED_KEYS = {"template", "inputs", "example", "description", "priority", "outputs", "constraint"}


@dataclass(eq=False)
class Pattern:
    name: str
    path: Path
    reference: Callable
    template: str
    inputs: dict[str, TensorSpec]
    params: dict[str, Any]  # name -> Param default
    example: dict[str, int] = field(default_factory=dict)
    description: str = ""
    priority: int = 0
    replaces: Path | None = None  # the built-in pattern of the same name this file is used instead of
    outputs: tuple[str, ...] | None = None  # names of the reference's outputs; unread ones are dropped
    constraint: Callable | None = None  # a condition on the captured parameters, by name

    def constraint_problem(self, params: dict) -> str | None:
        """Why the captured parameters fail the pattern's constraint, or None if they meet it."""
        if self.constraint is None:
            return None
        names = list(inspect.signature(self.constraint).parameters)
        if self.constraint(**{n: params[n] for n in names}):
            return None
        values = ", ".join(f"{n}={params[n]}" for n in names)
        return f"the parameters ({values}) fail the pattern's constraint ({self.path.name})"

    @property
    def builtin(self) -> bool:
        return self.path.parent == patterns_dir().resolve()

    @property
    def structural(self) -> dict[str, IntParam]:
        return {k: v for k, v in self.params.items() if isinstance(v, IntParam) and v.search}


def example_tensors(pattern: "Pattern", sizes: dict, dtypes: dict, T: int, seed: int = 0, device="cpu") -> tuple:
    """Random inputs of ``pattern`` at ``sizes`` and ``T`` tokens (an input's dtype from
    ``dtypes``, else its first declared one): normal floats drawn in fp32 and rounded once to
    their dtype, small non-negative integers."""
    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for name, spec in pattern.inputs.items():
        shape = []
        for d in spec.dims:
            if d == "...":
                shape += list(sizes.get("...", ()))
            else:
                shape.append(T if d == "T" else int(d) if d.isdigit() else sizes[d])
        dtype = dtypes.get(name, spec.dtypes[0])
        if dtype.is_floating_point:
            value = torch.randn(shape, generator=generator).to(dtype)
        else:
            value = torch.randint(0, 4, shape, generator=generator).to(dtype)
        tensors.append(value.to(device))
    return tuple(tensors)
