"""body: tidy the lines of a lowered row program before they are rendered.

The lowerer writes one assignment per graph node, in graph order. Three passes make that read
as a person would write it, without changing what the kernel computes:

- :func:`live`: assignments nothing reads are dropped (a value a region holds for no output);
- :func:`without_echo`: ``add_1 = ...  # add_1`` loses the comment its name already gives;
- :func:`rolled`: a block of lines repeated three or more times, each repeat reading the one
  before it (a Sinkhorn's twenty normalisations), becomes a ``tl.static_range`` loop, which
  Triton unrolls again when it compiles the kernel.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# A name the line reads or writes: not an attribute (``tl.sum``), not a keyword argument (``axis=``).
_NAME = re.compile(r"(?<![\w.])([A-Za-z_]\w*)(?!\w)(?!\s*=(?!=))")
# Fewest repeats worth a loop, and the longest block looked for.
MIN_REPEATS = 3
MAX_BLOCK = 32


def tidy(lines: list[str]) -> list[str]:
    return rolled([without_echo(line) for line in live(lines)])


def live(lines: list[str]) -> list[str]:
    """``lines`` without the assignments nothing after them reads. Lines in a loop, and every
    line that is not a one-name assignment, are kept."""
    kept, read = [], set()
    for line in reversed(lines):
        code = _code(line)
        target, expr = _assignment(line)
        if target is not None:
            if target not in read:
                continue
            read.discard(target)
            code = expr
        read.update(_NAME.findall(code))
        kept.append(line)
    return kept[::-1]


def without_echo(line: str) -> str:
    """``add_1 = ...  # add_1`` without its comment: the local already says which node it holds."""
    code, _, comment = line.partition("  # ")
    return code if comment and code.startswith(f"{comment} = ") else line


def _code(line: str) -> str:
    return line.split("  # ", 1)[0]


def _assignment(line: str) -> tuple[str | None, str]:
    """(name, expression) of a top-level one-name assignment, else (None, the line's code)."""
    code = _code(line)
    target, equals, expr = code.partition(" = ")
    if equals and not line.startswith(" ") and target.isidentifier():
        return target, expr
    return None, code


# --- rolling repeated blocks into loops ----------------------------------------------------------
@dataclass
class _Run:
    start: int
    period: int
    repeats: int
    carried: dict[int, str]  # index in the block of a value the next repeat reads -> its value before the first

    @property
    def end(self) -> int:
        return self.start + self.period * self.repeats


def rolled(lines: list[str]) -> list[str]:
    """``lines`` with every run of a repeated block (:func:`_run_at`) written as a loop."""
    out, i = [], 0
    while i < len(lines):
        run = _run_at(lines, i)
        if run is None:
            out.append(lines[i])
            i += 1
            continue
        first = _block(lines, run.start, run.period, 0)
        out.extend(_loop(first, run))
        lines = lines[: run.end] + _renamed_after(lines, run, first)
        i = run.end
    return out


def _run_at(lines: list[str], start: int) -> _Run | None:
    """The longest run from ``start`` of a block repeated at least :data:`MIN_REPEATS` times,
    each repeat reading values of the one before, that a loop can hold; None if there is none."""
    best = None
    for period in range(1, min(MAX_BLOCK, (len(lines) - start) // MIN_REPEATS) + 1):
        first, second = _block(lines, start, period, 0), _block(lines, start, period, 1)
        carried = _carried_in(first, second) if first and second else None
        if not carried:
            continue
        shape, repeats = _shape(second, first), 2
        while (block := _block(lines, start, period, repeats)) and _shape(block, second) == shape:
            second, repeats = block, repeats + 1
        run = _Run(start, period, repeats, carried)
        if repeats >= MIN_REPEATS and (best is None or period * repeats > best.period * best.repeats):
            best = run if _loopable(lines, run, first) else best
    return best


def _block(lines: list[str], start: int, period: int, k: int) -> list[tuple[str, str]] | None:
    """Block ``k`` of a run as (name, expression) pairs; None if a line is no assignment."""
    pairs = [_assignment(line) for line in lines[start + k * period : start + (k + 1) * period]]
    if len(pairs) < period or any(name is None for name, _ in pairs):
        return None
    return pairs


def _shape(block, previous) -> list[list[str]]:
    """A block's expressions with its own values as ``#j`` and the previous block's as ``@j``
    (other names kept): two repeats of one loop body have one shape."""
    own = {name: f"#{j}" for j, (name, _) in enumerate(block)}
    before = {name: f"@{j}" for j, (name, _) in enumerate(previous)}
    return [
        [own.get(p, before.get(p, p)) if i % 2 else p for i, p in enumerate(_NAME.split(expr))]
        for _, expr in block
    ]  # fmt: skip


def _carried_in(first, second) -> dict[int, str] | None:
    """When block 0 is the first repeat of the shape block 1 has (the same text, an outside
    name wherever block 1 reads block 0's values, one per value, and used for nothing else):
    for each value block 1 reads, by index, the outside name block 0 reads in its place."""
    own = {name: f"#{j}" for j, (name, _) in enumerate(first)}
    carried: dict[int, str] = {}
    plain: set[str] = set()
    for (_, expr), want in zip(first, _shape(second, first)):
        parts = _NAME.split(expr)
        if len(parts) != len(want):
            return None
        for i, (got, expected) in enumerate(zip(parts, want)):
            if expected.startswith("@") and i % 2:
                if got in own or carried.setdefault(int(expected[1:]), got) != got:
                    return None
            elif (own.get(got, got) if i % 2 else got) != expected:
                return None
            elif i % 2 and got not in own:
                plain.add(got)
    return None if plain & set(carried.values()) else carried


def _loopable(lines: list[str], run: _Run, first) -> bool:
    """Can a loop hold the run: does each repeat read a carried value before it writes the next
    one, and does nothing after the run read a repeat's values but the last one's?"""
    for j, outside in run.carried.items():
        if any(outside in _NAME.findall(expr) for _, expr in first[j + 1 :]):
            return False
    earlier = {name for k in range(run.repeats - 1) for name, _ in _block(lines, run.start, run.period, k)}
    return not any(earlier & set(_NAME.findall(_code(line))) for line in lines[run.end :])


def _loop(first, run: _Run) -> list[str]:
    """The run as: each carried value set to its value before the first repeat, then the first
    repeat in a ``tl.static_range`` loop, reading the carried values by the names it gives them."""
    carry = {outside: first[j][0] for j, outside in run.carried.items()}
    lines = [f"{first[j][0]} = {outside}" for j, outside in run.carried.items()]
    lines.append(f"for _repeat in tl.static_range({run.repeats}):")
    for name, expr in first:
        lines.append(f"    {name} = " + _NAME.sub(lambda m: carry.get(m.group(1), m.group(1)), expr))
    return lines


def _renamed_after(lines: list[str], run: _Run, first) -> list[str]:
    """The lines after the run, reading the last repeat's values by the loop's names for them."""
    last = _block(lines, run.start, run.period, run.repeats - 1)
    names = {name: first[j][0] for j, (name, _) in enumerate(last)}
    return [_NAME.sub(lambda m: names.get(m.group(1), m.group(1)), line) for line in lines[run.end :]]
