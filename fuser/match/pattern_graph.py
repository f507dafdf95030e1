"""pattern_graph: a pattern's reference function traced and canonicalised at given sizes and
dtypes (cached), the graph :mod:`fuser.match.matcher` compares with a model's and
:func:`fuser.match.pattern_files.load_pattern` runs to check a pattern file, with the names
the reference gives its values (:mod:`fuser.match.reference_names`)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from dataclasses import dataclass

import torch.fx as fx

from fuser.canon.canonicalize import COp, canonicalize
from fuser.ir.canonical_op import through_identities
from fuser.match.reference_names import names_bound, value_names
from fuser.pattern import Param, Pattern, example_tensors, patterns_dir
from fuser.trace.tracing import Traced, trace

EXAMPLE_T = 3


@dataclass
class PatternGraph:
    """A pattern's reference, traced and canonicalised at one set of sizes and dtypes."""

    traced: Traced
    cops: dict[fx.Node, COp]
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    param_names: dict[int, str]  # id(Param object) -> parameter name
    names: dict[fx.Node, str]  # the reference's name of each value it names, if traced ``named`` (trace_pattern)


@functools.lru_cache(maxsize=512)
def _trace_pattern_cached(pattern_key, pattern: Pattern, sizes_items, dtype_items, structural_items, device, named):
    sizes, dtypes, structural = dict(sizes_items), dict(dtype_items), dict(structural_items)
    fn = pattern.reference
    if structural:
        fn = _with_defaults(fn, {k: Param(v, search=pattern.params[k].search) for k, v in structural.items()})
    batch = {name: 0 for name, spec in pattern.inputs.items() if spec.dims[:1] == ("T",)}
    recording = names_bound({pattern.path.parent, patterns_dir()}) if named else contextlib.nullcontext({})
    with recording as bound:
        traced = trace(fn, example_tensors(pattern, sizes, dtypes, EXAMPLE_T, 0, device), batch_inputs=batch, torch_only=True)
    cops = canonicalize(traced)
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder" and n.target in pattern.inputs]
    out = next(n for n in traced.graph.nodes if n.op == "output").args[0]
    outs = [through_identities(cops, o) for o in (out if isinstance(out, (tuple, list)) else [out])]
    param_names = {id(v): k for k, v in pattern.params.items()}
    names = value_names(cops, placeholders, outs, bound, pattern.outputs) if named else {}
    return PatternGraph(traced, cops, placeholders, outs, param_names, names)


def _with_defaults(fn, overrides: dict):
    """A copy of ``fn`` whose parameters in ``overrides`` default to the given values."""
    params = list(inspect.signature(fn).parameters.values())
    defaults = tuple(overrides.get(p.name, p.default) for p in params if p.default is not inspect.Parameter.empty)
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, defaults, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


def trace_pattern(pattern: Pattern, sizes, dtypes, structural=None, device="cpu", named=False) -> PatternGraph:
    """The reference traced at ``sizes`` and ``dtypes``; ``named``: with the names it gives its
    values (:mod:`fuser.match.reference_names`: the line tracer that reads them makes a trace a
    few times slower, and only the graph of a match needs them, not the many that the search for
    one traces)."""
    return _trace_pattern_cached(
        (pattern.name, str(pattern.path)), pattern,
        tuple(sorted(sizes.items())), tuple(sorted(dtypes.items(), key=lambda kv: kv[0])),
        tuple(sorted((structural or {}).items())), str(device), named,
    )  # fmt: skip
