"""fuser.testing: a pattern file's golden tests in one line, and the same cases from the shell."""

import io
import textwrap

import torch

import fuser.api
import fuser.lower.code
import fuser.pipeline.passes
from fuser.pattern import patterns_dir
from fuser.match.pattern_files import load_pattern
from fuser.testing import golden_tests, pattern_cases, run_pattern_file
from helpers import ROOT

QUICK_GELU = ROOT / "examples" / "authoring" / "quick_gelu_pattern.py"

test_rmsnorm_golden = golden_tests(patterns_dir() / "rmsnorm.py")
test_quick_gelu_golden = golden_tests(QUICK_GELU)


def widths(cases, symbol):
    return {dict(c.sizes)[symbol] for c in cases}


def test_cases_cover_every_declared_dtype_and_odd_widths():
    pattern = load_pattern(patterns_dir() / "rmsnorm.py")
    cases = pattern_cases(pattern)
    for name, spec in pattern.inputs.items():
        assert {dict(c.dtypes)[name] for c in cases} == set(spec.dtypes), name
    assert {6, 42, 123, pattern.example["N"]} <= widths(cases, "N")
    assert any(dict(c.sizes).get("...") for c in cases), "x has '...' dims: one case gives it leading dims"


def test_cases_respect_what_the_reference_takes():
    """swiglu_clamp halves its width (an odd one cannot be split into gate and up); the Sinkhorn
    pattern's width is (2 + n) * n for its n x n matrix: only the example fits."""
    swiglu = pattern_cases(load_pattern(patterns_dir() / "swiglu_clamp.py"))
    assert all(w % 2 == 0 for w in widths(swiglu, "I2")) and {6, 42} <= widths(swiglu, "I2")
    sinkhorn = load_pattern(patterns_dir() / "mhc_sinkhorn.py")
    assert widths(pattern_cases(sinkhorn), "M") == {sinkhorn.example["M"]}


def test_run_pattern_file_passes_a_good_pattern():
    out = io.StringIO()
    assert run_pattern_file(str(QUICK_GELU), out) == 0
    lines = out.getvalue().splitlines()
    cases = pattern_cases(load_pattern(QUICK_GELU))
    assert len(lines) == len(cases) + 1
    assert all(line.startswith("ok ") for line in lines[:-1]), out.getvalue()
    assert f"{len(cases)} of {len(cases)} cases pass" in lines[-1]


def write(tmp_path, name, source):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    return path


ATAN = """\
    import torch
    from fuser.pattern import tensor


    def reference(x):
        xf = x.float()
        return (torch.atan(xf) * xf).to(x.dtype)


    PATTERN = dict(template="pointwise", inputs=dict(x=tensor("T, N", "float32")))
"""


def test_run_pattern_file_fails_a_pattern_whose_kernel_cannot_be_built(tmp_path):
    out = io.StringIO()
    assert run_pattern_file(str(write(tmp_path, "atan_gate", ATAN)), out) == 1
    assert "FAIL" in out.getvalue() and "[lowering]" in out.getvalue() and "atan" in out.getvalue()


def test_run_pattern_file_fails_a_kernel_that_computes_other_math(tmp_path, monkeypatch):
    """sigmoid lowered as exp, and fuser's own validation skipped: the wrong kernel is installed,
    and the comparison with the reference catches it."""
    monkeypatch.setenv("FUSER_KERNEL_DIR", str(tmp_path))
    monkeypatch.setitem(fuser.lower.code.EXPRESSIONS, "sigmoid", "tl.exp({a})")
    monkeypatch.setattr(fuser.pipeline.passes, "validate_all", lambda kernels, *args: [None] * len(kernels))
    out = io.StringIO()
    assert run_pattern_file(str(QUICK_GELU), out) == 1
    assert "max |diff|" in out.getvalue(), out.getvalue()


def test_run_pattern_file_refuses_a_malformed_file(tmp_path):
    bad = write(tmp_path, "bad_template", ATAN.replace('template="pointwise"', 'template="nope"'))
    out = io.StringIO()
    assert run_pattern_file(str(bad), out) == 2
    assert f"{bad.resolve()}:" in out.getvalue() and "nope" in out.getvalue()
    assert run_pattern_file(str(tmp_path / "missing.py"), io.StringIO()) == 2


def test_golden_tests_is_a_parametrized_test_per_case():
    marks = [m for m in getattr(test_rmsnorm_golden, "pytestmark", []) if m.name == "parametrize"]
    (mark,) = marks
    assert mark.args[0] == "case"
    assert len(mark.args[1]) == len(pattern_cases(load_pattern(patterns_dir() / "rmsnorm.py")))
    assert torch.float16 in {dict(c.dtypes)["x"] for c in mark.args[1]}
