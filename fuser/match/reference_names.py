"""reference_names: the Python names a pattern's reference gives its values, so that a kernel
lowered from a match reads as the reference does (``g``, ``u``, ``xf``) rather than as the
model's graph (``clamp``, ``clamp_1``, ``mul``).

How the names are found. fx names a node after its op, never after the variable that holds
it; and reading the reference's source (``ast``) would mean replaying Python's evaluation to
know which of a line's ops a name ends up bound to, how often a loop runs, and what a helper
the reference calls names its values. So the names are read off the reference as it runs:
while it is traced, a line tracer (``sys.settrace``) watches the frames of code from the
pattern files' directories (a reference may call another's: mhc_sinkhorn_rms calls
mhc_sinkhorn's) and, before each line and at each return, records every local bound to a
traced value: node -> the first name it was bound to. This reads the bindings themselves: a
loop's twenty values called ``c`` are twenty nodes called ``c``, and a value a helper is given
unnamed is called by the helper's parameter. Frames of other code (``input`` inside
``torch.nn.functional.silu``) are not read, and the tracer in place before (a debugger,
coverage) is put back afterwards.

:func:`value_names` then names the graph's values for the matcher: the inputs by the
reference's parameters, a value bound to a variable by that variable, and an output by the
name the pattern gives it, else its variable's, else ``out``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator

import torch.fx as fx

from fuser.canon.canonicalize import COp

#: What an output the reference does not name is called (the second where an input has the first).
OUTPUT_NAMES = ("out", "result")


@contextlib.contextmanager
def names_bound(directories: set[Path]) -> Iterator[dict[fx.Node, str]]:
    """While the block runs, each traced node a local of code from ``directories`` is bound to,
    with the first name it was bound to (the dict yielded, filled as the code runs)."""
    names: dict[fx.Node, str] = {}
    watched = {os.fspath(Path(d).resolve()) for d in directories}

    def record(frame, event, arg):
        if event in ("line", "return"):
            for name, value in frame.f_locals.items():
                # type(), not isinstance(): tracing patches isinstance to answer for the shadow.
                if issubclass(type(value), fx.Proxy):
                    names.setdefault(value.node, name)
        return record

    decided: dict = {}  # code object -> its frames' tracer (record, or None): asked once a code

    def watch(frame, event, arg):
        code = frame.f_code
        if code not in decided:
            decided[code] = record if os.path.dirname(code.co_filename) in watched else None
        return decided[code]

    before = sys.gettrace()
    sys.settrace(watch)
    try:
        yield names
    finally:
        sys.settrace(before)


def value_names(
    cops: dict[fx.Node, COp], inputs: list[fx.Node], outputs: list[fx.Node], bound: dict[fx.Node, str],
    output_names: tuple[str, ...] | None,
) -> dict[fx.Node, str]:
    """The reference's name of each value of its canonical graph that it names (module docstring).

    ``inputs``: the placeholders of its tensor arguments, named after them; ``bound``: what
    :func:`names_bound` recorded; ``output_names``: the pattern's names of its outputs, if any.
    """
    names = {node: str(node.target) for node in inputs}
    if output_names is not None:
        names.update((node, name) for node, name in zip(outputs, output_names) if node not in names)
    for node in cops:
        if node not in names and node in bound:
            names[node] = bound[node]
    unnamed = next((n for n in OUTPUT_NAMES if n not in names.values()), OUTPUT_NAMES[0])
    names.update((node, unnamed) for node in outputs if node not in names)
    return names

