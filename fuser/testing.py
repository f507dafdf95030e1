"""testing: golden tests for a pattern file, in pytest or from the shell.

A pattern's ``reference`` is its own golden reference, so a pattern file can be tested
without any model: the reference becomes a module, fuser fuses it with the pattern, and the
fused module must (1) run the pattern's kernel — the report names the pattern — and (2)
match the reference at T in {1, 3, 16} within the per-dtype tolerance of
:data:`fuser.validate.tolerance.KERNEL`. In a test file of your own::

    from fuser.testing import golden_tests

    test_my_chain = golden_tests("patterns/my_chain.py")   # one pytest case per dtype and width

or without pytest, ``run_pattern_file("patterns/my_chain.py")`` (``fuser test-pattern FILE``).

The cases cover every dtype the pattern declares (the k-th case gives each input its k-th
dtype, or its last), the width — the last dim of the first input — at its example size and at
6, 42 and 123 where the reference accepts that width (a pattern whose code needs, say, an even
or a power-of-two width skips the others), and, when an input has ``...`` dims, one case with
a leading dim. Other sizes stay at their example values. On the CPU, kernels run in Triton's
interpreter: importing fuser turns it on (``TRITON_INTERPRET=1``) unless triton was imported
before with it off, which both entry points report as an error rather than run no kernel.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

import fuser
from fuser.codegen.emit import template_names
from fuser.pattern import Pattern, PatternError, example_tensors
from fuser.match.pattern_files import load_pattern
from fuser.install.splice import STATE_ATTR
from fuser.validate.tolerance import least_precise, mismatch

#: widths tried besides the example size: small, and odd or not a power of two
WIDTHS = (6, 42, 123)
#: the token count fuser traces at, and those the fused module is called at
TRACE_T = 3
TOKENS = (1, 3, 16)
#: the leading dims given to ``...`` in the one case that has them
LEADING = (2,)


@dataclass(frozen=True)
class Case:
    dtypes: tuple[tuple[str, torch.dtype], ...]  # input name -> dtype
    sizes: tuple[tuple[str, object], ...]  # shape symbol (or "...") -> size

    @property
    def id(self) -> str:
        names = []
        for _, dtype in self.dtypes:
            name = str(dtype).replace("torch.", "")
            if name not in names:
                names.append(name)
        sizes = ",".join(f"{k}={v}" for k, v in self.sizes if k != "...")
        lead = dict(self.sizes).get("...")
        return "+".join(names) + (f"-{sizes}" if sizes else "") + (f"-lead{list(lead)}" if lead else "")


# --- the cases ---------------------------------------------------------------------------------
def pattern_cases(pattern: Pattern) -> list[Case]:
    """The golden cases of ``pattern``: every declared dtype, each width the reference takes."""
    combos = _dtype_combos(pattern)
    widths = _widths(pattern)
    cases = [Case(combo, tuple(sorted(sizes.items()))) for combo in combos for sizes in widths]
    if any("..." in spec.dims for spec in pattern.inputs.values()):
        sizes = dict(pattern.example, **{"...": LEADING})
        if _accepts(pattern, sizes):
            cases.append(Case(combos[0], tuple(sorted(sizes.items()))))
    return cases


def _dtype_combos(pattern: Pattern) -> list[tuple]:
    """The k-th combination gives each input its k-th declared dtype (or its last one), so
    every dtype of every input is covered, in the pairings the pattern lists them."""
    count = max(len(spec.dtypes) for spec in pattern.inputs.values())
    return [
        tuple((name, spec.dtypes[min(k, len(spec.dtypes) - 1)]) for name, spec in pattern.inputs.items())
        for k in range(count)
    ]


def _width_symbol(pattern: Pattern) -> str | None:
    last = next(iter(pattern.inputs.values())).dims[-1:]
    return last[0] if last and last[0] not in ("T", "...") and not last[0].isdigit() else None


def _widths(pattern: Pattern) -> list[dict]:
    """Sizes with the width at its example value, then at each of WIDTHS the reference takes."""
    symbol = _width_symbol(pattern)
    choices = [dict(pattern.example)]
    if symbol is None:
        return choices
    for width in WIDTHS:
        sizes = dict(pattern.example, **{symbol: width})
        if width != pattern.example[symbol] and _accepts(pattern, sizes):
            choices.append(sizes)
    return choices


def _accepts(pattern: Pattern, sizes: dict) -> bool:
    """Does the reference take these sizes? Its own code is where a size constraint lives: it
    must run, and keep one row per token in every output (a fused kernel computes rows)."""
    dtypes = {name: spec.dtypes[0] for name, spec in pattern.inputs.items()}
    try:
        with torch.no_grad():
            result = pattern.reference(*example_tensors(pattern, sizes, dtypes, TRACE_T, seed=0))
    except Exception:  # noqa: BLE001 - any failure means the pattern does not take these sizes
        return False
    outputs = result if isinstance(result, (tuple, list)) else [result]
    return all(isinstance(o, torch.Tensor) and o.dim() and o.shape[0] == TRACE_T for o in outputs)


# --- one case ----------------------------------------------------------------------------------
def reference_module(pattern: Pattern) -> torch.nn.Module:
    """A module whose forward is the pattern's reference, with its parameters at their
    defaults: forward takes the reference's tensor arguments, by name."""
    names = list(pattern.inputs)
    params = {k: float(v) if isinstance(v, float) else int(v) for k, v in pattern.params.items()}  # as model code has them
    source = f"def forward(self, {', '.join(names)}):\n    return reference({', '.join(names)}, **params)\n"
    scope = {"reference": pattern.reference, "params": params}
    exec(source, scope)  # noqa: S102 - a forward with the reference's own argument names
    cls = type(f"Reference_{pattern.name}", (torch.nn.Module,), {"forward": scope["forward"]})
    return cls().eval()


def check_case(pattern: Pattern, case: Case, device="cpu") -> str | None:
    """None when the fused reference runs the pattern's kernel and matches the reference at
    every T in TOKENS, else what went wrong."""
    sizes, dtypes = dict(case.sizes), dict(case.dtypes)
    module = reference_module(pattern)
    batch = {name: 0 for name, spec in pattern.inputs.items() if spec.dims[:1] == ("T",)}
    try:
        report = fuser.apply(
            module, example_tensors(pattern, sizes, dtypes, TRACE_T, 0, device), patterns=[pattern.path], batch_inputs=batch
        )
    except fuser.FuserError as e:
        return str(e)
    try:
        if not any(pattern.name in chain.pattern.split("+") for chain in report.chains):
            why = [f"[{r.category}] {r.reason}" for r in report.rejected if r.pattern == pattern.name]
            return f"{pattern.name}'s kernel is not used: " + ("; ".join(why) or "no chain of the report names it")
        for T in TOKENS:
            problem = _compare_at(pattern, module, example_tensors(pattern, sizes, dtypes, T, seed=T, device=device), T)
            if problem:
                return problem
    finally:
        fuser.restore(module)
    return None


def _compare_at(pattern: Pattern, module, inputs: tuple, T: int) -> str | None:
    why_not = module.__dict__[STATE_ATTR].guard.why_not(inputs, {})
    if why_not:
        return f"at T={T} the fused forward would not run: {why_not}"
    with torch.no_grad():
        got = module(*inputs)
        expected = pattern.reference(*inputs)
    outputs = list(expected) if isinstance(expected, (tuple, list)) else [expected]
    # A value computed from a bf16 input carries bf16's precision, whatever it is stored in.
    coarsest = least_precise([x.dtype for x in inputs] + [o.dtype for o in outputs if isinstance(o, torch.Tensor)])
    return mismatch(got, expected, f"output at T={T}", tol_dtype=coarsest)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# --- pytest and the shell ----------------------------------------------------------------------
def golden_tests(path: str | os.PathLike, device: str | None = None):
    """A pytest test function with one case per golden case of the pattern file at ``path``
    (relative to the working directory): ``test_my_chain = golden_tests("patterns/my_chain.py")``."""
    import pytest  # only the pytest entry point needs it

    problem = fuser.interpreter_problem()
    if problem:
        raise RuntimeError(f"fuser.testing: {problem}")
    pattern = load_pattern(path, template_names())
    cases = pattern_cases(pattern)

    @pytest.mark.parametrize("case", cases, ids=[c.id for c in cases])
    def test_pattern_file(case):
        problem = check_case(pattern, case, device or default_device())
        assert problem is None, f"{pattern.path} [{case.id}]: {problem}"

    test_pattern_file.__name__ = test_pattern_file.__qualname__ = f"test_{pattern.name}_golden"
    return test_pattern_file


def run_pattern_file(path: str | os.PathLike, out=None, err=None, as_json: bool = False) -> int:
    """Run the golden cases of one pattern file; print a line per case and a summary to ``out``
    (stdout), or with ``as_json`` one JSON object: the file, pattern, device, each case's id and
    problem (null when it passes) and the counts. Returns 0 when every case passes, 1 when any
    fails, 2 when the file is not a valid pattern file or no kernel can run here, said on
    ``err``: stderr, or ``out`` when only ``out`` is given (a caller capturing it gets all)."""
    out, err = out or sys.stdout, err or out or sys.stderr
    problem = fuser.interpreter_problem()
    if problem:
        print(f"fuser: {problem}", file=err)
        return 2
    if Path(path).is_dir():
        print(f"fuser: {path} is a directory; give one pattern file", file=err)
        return 2
    device = default_device()
    try:
        pattern = load_pattern(path, template_names())
    except (PatternError, OSError) as e:
        print(f"fuser: not a valid pattern file: {e}", file=err)
        return 2
    cases = pattern_cases(pattern)
    results = []
    for case in cases:
        problem = check_case(pattern, case, device)
        results.append({"id": case.id, "ok": problem is None, "problem": problem})
        if not as_json:
            print(f"{'FAIL' if problem else 'ok':<4} {pattern.name} [{case.id}]" + (f": {problem}" if problem else ""), file=out)
    passed = sum(r["ok"] for r in results)
    if as_json:
        print(json.dumps({
            "file": str(path), "pattern": pattern.name, "device": device, "cases": results,
            "passed": passed, "failed": len(results) - passed,
        }, indent=2), file=out)  # fmt: skip
    else:
        print(f"{Path(path)}: {passed} of {len(cases)} cases pass on {device}", file=out)
    return 0 if passed == len(results) else 1


__all__ = ["golden_tests", "run_pattern_file", "pattern_cases", "check_case", "reference_module", "Case"]
