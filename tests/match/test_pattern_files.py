"""Pattern files and templates: a mistake is reported as ``file:line:``; user patterns are used."""

import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fuser
import fuser.codegen.emit
import fuser.pattern
import helpers
from fuser.lower.row_program import Operand
from fuser.match.pattern_files import load_pattern, load_patterns

GOOD = '''\
"""A fine pattern."""
import torch
from fuser.pattern import Param, tensor


def reference(x, weight, eps=Param(1e-6)):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


PATTERN = dict(
    template="row_reduce",
    inputs=dict(
        x=tensor("T, N", "bfloat16 float32"),
        weight=tensor("N", "bfloat16 float32"),
    ),
    example=dict(N=32),
)
'''


def write(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    return path


def line_with(path: Path, needle: str) -> int:
    hits = [i for i, line in enumerate(path.read_text().splitlines(), 1) if needle in line]
    assert len(hits) == 1, f"{needle!r} appears on lines {hits} of {path}"
    return hits[0]


def load_error(path: Path) -> str:
    with pytest.raises(fuser.PatternError) as excinfo:
        load_pattern(path, fuser.codegen.emit.template_names())
    return str(excinfo.value)


def assert_located(message: str, path: Path, line: int):
    prefix = f"{path.resolve()}:{line}:"
    assert message.startswith(prefix), f"expected the message to start with {prefix!r}: {message!r}"


def test_the_good_pattern_loads(tmp_path):
    p = load_pattern(write(tmp_path, "good_norm", GOOD), fuser.codegen.emit.template_names())
    assert p.name == "good_norm"
    assert p.template == "row_reduce"
    assert list(p.inputs) == ["x", "weight"]
    assert p.params == {"eps": 1e-6}
    assert p.description == "A fine pattern."


def test_a_template_is_hand_written_unless_it_frames_a_row_program(tmp_path, monkeypatch):
    """Read off the template file: one that extends _row_program.py.jinja renders a lowered
    chain, any other its pattern's inputs and parameters, with no list to add it to."""
    for template in fuser.pattern.templates_dir().glob("*.jinja"):
        (tmp_path / template.name).write_text(template.read_text())
    (tmp_path / "my_gate.py.jinja").write_text('{% extends "_kernel_base.py.jinja" %}\n{% block kernel %}{% endblock %}\n')
    (tmp_path / "my_rows.py.jinja").write_text('{%- extends "_row_program.py.jinja" -%}\n')
    monkeypatch.setattr(fuser.pattern, "templates_dir", lambda: tmp_path)
    kinds = {t: fuser.pattern.is_hand_written(t) for t in ("pointwise", "row_reduce", "sinkhorn", "expert_sort", "my_gate", "my_rows")}
    assert kinds == dict(pointwise=False, row_reduce=False, sinkhorn=True, expert_sort=True, my_gate=True, my_rows=False)


def test_syntax_error(tmp_path):
    path = write(tmp_path, "syntax", GOOD.replace("    xf = x.float()\n", "    xf = x.float(\n"))
    message = load_error(path)
    assert_located(message, path, line_with(path, "xf = x.float("))
    assert "syntax error" in message


@pytest.mark.parametrize("form", ["call", "literal"])
def test_unknown_pattern_key(tmp_path, form):
    source = GOOD.replace("    example=dict(N=32),\n", "    example=dict(N=32),\n    exampel=dict(N=32),\n")
    if form == "literal":
        source = source.replace("PATTERN = dict(\n", "PATTERN = {\n").replace(
            '    template="row_reduce",', '    "template": "row_reduce",'
        )
        source = source.replace("    inputs=dict(\n", '    "inputs": dict(\n').replace("    example=dict(N=32),", '    "example": dict(N=32),')
        source = source.replace("    exampel=dict(N=32),", '    "exampel": dict(N=32),').replace("\n)\n", "\n}\n")
    path = write(tmp_path, f"key_{form}", source)
    message = load_error(path)
    assert_located(message, path, line_with(path, "exampel"))
    assert "'exampel'" in message


def test_unknown_template(tmp_path):
    path = write(tmp_path, "tmpl", GOOD.replace('template="row_reduce"', 'template="row_reduction"'))
    message = load_error(path)
    assert_located(message, path, line_with(path, "template="))
    assert "row_reduction" in message


@pytest.mark.parametrize(
    "inputs",
    [
        pytest.param('x=tensor("T, N", "float32"), w=tensor("N", "float32")', id="wrong-name"),
        pytest.param('x=tensor("T, N", "float32")', id="missing"),
        pytest.param('weight=tensor("N", "float32"), x=tensor("T, N", "float32")', id="order"),
        pytest.param('x=tensor("T, N", "float32"), weight=tensor("N", "float32"), eps=tensor("1", "float32")', id="param"),
    ],
)
def test_inputs_must_name_the_reference_tensor_arguments(tmp_path, inputs):
    source = GOOD.replace(
        '    inputs=dict(\n        x=tensor("T, N", "bfloat16 float32"),\n        weight=tensor("N", "bfloat16 float32"),\n    ),\n',
        f"    inputs=dict({inputs}),\n",
    )
    assert source != GOOD
    path = write(tmp_path, "inputs", source)
    message = load_error(path)
    assert_located(message, path, line_with(path, "inputs="))
    assert "['x', 'weight']" in message


def test_missing_reference(tmp_path):
    path = write(tmp_path, "noref", GOOD.replace("def reference(", "def referenc("))
    message = load_error(path)
    assert_located(message, path, 1)
    assert "reference" in message


def test_missing_pattern(tmp_path):
    path = write(tmp_path, "nodecl", GOOD.replace("PATTERN = dict(", "PATTERNS = dict("))
    message = load_error(path)
    assert "PATTERN" in message
    assert message.startswith(f"{path.resolve()}:")


@pytest.mark.parametrize(
    "statement",
    [
        pytest.param('raise RuntimeError("broken on purpose")', id="raise"),
        pytest.param('BAD = torch.zeros("not a size")', id="in-a-library-call"),
        pytest.param('BAD = tensor("T, N", "float33")', id="bad-dtype"),
    ],
)
def test_exception_at_import(tmp_path, statement):
    source = GOOD.replace("\n\ndef reference(", f"\n{statement}  # HERE\n\n\ndef reference(")
    path = write(tmp_path, "boom", source)
    message = load_error(path)
    assert_located(message, path, line_with(path, "# HERE"))


def test_exception_in_a_helper_points_at_the_raise(tmp_path):
    source = GOOD.replace(
        "\n\ndef reference(",
        '\n\ndef helper():\n    raise ValueError("from a helper")  # RAISE\n\n\nX = helper()\n\n\ndef reference(',
    )
    path = write(tmp_path, "helper", source)
    message = load_error(path)
    assert_located(message, path, line_with(path, "# RAISE"))
    assert "ValueError: from a helper" in message


def test_load_patterns_names_a_missing_file(tmp_path):
    with pytest.raises(fuser.PatternError, match="no_such_pattern.py"):
        load_patterns([tmp_path / "no_such_pattern.py"], fuser.codegen.emit.template_names())


# ---------------------------------------------------------------------------------------------
# A user pattern passed to apply
# ---------------------------------------------------------------------------------------------

USER_PATTERN = '''\
"""Sigmoid of a scaled input in fp32, cast back."""
import torch
from fuser.pattern import Param, tensor


def reference(x, scale=Param(2.0)):
    return torch.sigmoid(x.float() * scale).to(x.dtype)


PATTERN = dict(
    template="pointwise",
    inputs=dict(x=tensor("T, N", "bfloat16 float32")),
    example=dict(N=32),
)
'''


class ScaledSigmoid(nn.Module):
    def forward(self, x):
        return torch.sigmoid(x.float() * 2.0).to(x.dtype)


def test_user_pattern_is_used_by_apply(tmp_path):
    path = write(tmp_path, "scaled_sigmoid", USER_PATTERN)
    m = ScaledSigmoid()
    x = torch.randn(5, 32).to(torch.bfloat16)
    report = fuser.apply(m, (x,), patterns=[path])
    try:
        assert [c.pattern for c in report.chains] == ["scaled_sigmoid"], report.text()
        (chain,) = report.chains
        assert chain.template == "pointwise"
        assert chain.params == {"scale": 2.0}
        assert "scaled_sigmoid" in report.text()
        y = torch.randn(9, 32).to(torch.bfloat16)
        torch.testing.assert_close(m(y), ScaledSigmoid()(y), rtol=2**-7, atol=1e-2)
    finally:
        fuser.restore(m)


def test_apply_with_a_malformed_user_pattern_fails_cleanly(tmp_path):
    path = write(tmp_path, "broken_user", USER_PATTERN.replace('template="pointwise"', 'template="nope"'))
    m = ScaledSigmoid()
    with pytest.raises(fuser.FuserError) as excinfo:
        fuser.apply(m, (torch.randn(5, 32).to(torch.bfloat16),), patterns=[path])
    assert isinstance(excinfo.value.__cause__, fuser.PatternError)
    assert f"{path.resolve()}:{line_with(path, 'template=')}:" in str(excinfo.value)
    assert not fuser.is_fused(m) and "forward" not in m.__dict__


# ---------------------------------------------------------------------------------------------
# Templates
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def templates(tmp_path, monkeypatch):
    """fuser.codegen.emit reading its templates from a temporary directory."""
    directory = tmp_path / "templates"
    directory.mkdir()
    monkeypatch.setattr(fuser.codegen.emit, "templates_dir", lambda: directory)
    monkeypatch.setattr(fuser.codegen.emit, "_ENV", None)

    def add(name: str, source: str) -> Path:
        path = directory / f"{name}.py.jinja"
        path.write_text(source)
        return path

    return add


def spec(template: str) -> fuser.codegen.emit.KernelSpec:
    x = Operand("in0", "x", (8,), torch.float32, True)
    y = Operand("out0", "y", (8,), torch.float32, True)
    return fuser.codegen.emit.KernelSpec(template, "somepattern", [x], [y], {"eps": 1e-6})


def template_error(template: str) -> str:
    with pytest.raises(fuser.codegen.emit.TemplateError) as excinfo:
        fuser.codegen.emit.render(spec(template), "k")
    return str(excinfo.value)


def test_template_syntax_error_names_file_and_line(templates):
    path = templates("broken", "# line 1\n# line 2\n{{ pattern + }}\n# line 4\n")
    assert "broken" in fuser.codegen.emit.template_names()
    message = template_error("broken")
    assert message.startswith(f"{path}:3:"), message


def test_template_undefined_variable_names_file_and_line(templates):
    path = templates("undef", "# {{ pattern }}\n# {{ params }}\n\n{{ no_such_variable }}\n")
    message = template_error("undef")
    assert message.startswith(f"{path}:4:"), message
    assert "no_such_variable" in message


def test_a_good_template_renders(templates):
    templates("fine", "# {{ template }} {{ pattern }} {{ params }}\n# {{ kernel_name }} {{ row_source }}\n")
    assert fuser.codegen.emit.render(spec("fine"), "kern") == "# fine somepattern eps=1e-06\n# kern in0\n"


def test_unknown_template_is_a_template_error(templates):
    with pytest.raises(fuser.codegen.emit.TemplateError, match="no_such_template"):
        fuser.codegen.emit.render(spec("no_such_template"), "k")


@pytest.mark.parametrize(
    "base_source, line",
    [
        pytest.param("# base\n{% if %}\n", 2, id="syntax"),
        pytest.param("# base\n# more\n{{ no_such_variable }}\n", 3, id="undefined"),
    ],
)
def test_error_in_an_extended_template_names_the_parent_file(templates, base_source, line):
    base = templates("_base", base_source)
    templates("child", '{% extends "_base.py.jinja" %}\n')
    message = template_error("child")
    assert message.startswith(f"{base}:{line}:"), message


# ---------------------------------------------------------------------------------------------
# Mistakes found when the reference first runs, and what the report says of user patterns
# ---------------------------------------------------------------------------------------------


def test_a_name_error_in_the_reference_is_located(tmp_path):
    path = write(tmp_path, "typo", GOOD.replace("+ eps) * weight).to(x.dtype)\n", "+ epsilon) * weight).to(x.dtype)  # TYPO\n"))
    message = load_error(path)
    assert_located(message, path, line_with(path, "# TYPO"))
    assert "NameError" in message and "epsilon" in message


def test_a_reference_that_cannot_take_the_example_sizes_is_located(tmp_path):
    """The reference splits rows into 48-wide halves; the example width is 32."""
    source = GOOD.replace("    xf = x.float()\n", "    xf = x.float().view(-1, 2, 48).flatten(1)  # SPLIT\n")
    path = write(tmp_path, "split", source)
    message = load_error(path)
    assert_located(message, path, line_with(path, "# SPLIT"))
    assert "N=32" in message, message


@pytest.mark.parametrize(
    "example, needle",
    [pytest.param("dict(M=32)", "M", id="unknown-symbol"), pytest.param("dict(N=0)", "N=0", id="not-positive")],
)
def test_example_sizes_must_be_dimensions_of_the_inputs(tmp_path, example, needle):
    path = write(tmp_path, "example", GOOD.replace("example=dict(N=32)", f"example={example}"))
    message = load_error(path)
    assert_located(message, path, line_with(path, "example="))
    assert needle in message


def test_an_empty_dimension_is_refused(tmp_path):
    path = write(tmp_path, "empty_dim", GOOD.replace('x=tensor("T, N",', 'x=tensor("T,, N",'))
    message = load_error(path)
    assert_located(message, path, line_with(path, 'tensor("T,, N"'))
    assert "empty dimension" in message


class AtanScaled(nn.Module):
    def forward(self, x):
        xf = x.float()
        return (torch.atan(xf * 2.0) * xf).to(x.dtype)


class OnlyAtan(nn.Module):
    def forward(self, x):
        return torch.atan(x) * 3.0


class CumprodScaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, 32).to(torch.bfloat16))

    def forward(self, x):
        return (torch.cumprod(x.float(), -1) * self.weight).to(x.dtype)


UNLOWERED = {
    "atan_scaled": (AtanScaled, "atan", """
        def reference(x, scale=Param(2.0)):
            xf = x.float()
            return (torch.atan(xf * scale) * xf).to(x.dtype)

        PATTERN = dict(template="pointwise", inputs=dict(x=tensor("T, N", "bfloat16 float32")), example=dict(N=32))
    """),
    "only_atan": (OnlyAtan, "atan", """
        def reference(x):
            return torch.atan(x)

        PATTERN = dict(template="pointwise", inputs=dict(x=tensor("T, N", "bfloat16 float32")))
    """),
    "cumprod_scaled": (CumprodScaled, "cumprod", """
        def reference(x, weight):
            return (torch.cumprod(x.float(), -1) * weight).to(x.dtype)

        PATTERN = dict(
            template="row_reduce",
            inputs=dict(x=tensor("T, N", "bfloat16 float32"), weight=tensor("N", "bfloat16 float32")),
            example=dict(N=32),
        )
    """),
}  # fmt: skip


@pytest.mark.parametrize("name", list(UNLOWERED))
def test_a_pattern_with_an_op_no_template_lowers_is_rejected(tmp_path, name):
    """The matched chain holds an op without a lowering: the pattern is rejected (naming the op),
    the chain is left to the generic path and eager, and the fused module still computes it."""
    module_class, op, body = UNLOWERED[name]
    header = "import torch\nimport torch.nn.functional as F\nfrom fuser.pattern import Param, tensor\n"
    path = write(tmp_path, name, header + textwrap.dedent(body))
    module = module_class()
    x = torch.randn(5, 32).to(torch.bfloat16)
    expected = module(x)
    report = fuser.explain(module, (x,), patterns=[path])
    rejected = [r for r in report.rejected if r.pattern == name]
    assert [r.category for r in rejected] == ["lowering"], report.text()
    assert op in rejected[0].reason
    assert name not in {c.pattern for c in report.chains}
    assert any(u.op == op for u in report.unfused), report.text()
    fuser.apply(module, (x,), patterns=[path])
    try:
        torch.testing.assert_close(module(x), expected, rtol=2**-7, atol=1e-2)
    finally:
        fuser.restore(module)


def test_a_user_pattern_that_matches_nothing_says_so(tmp_path):
    path = write(tmp_path, "scaled_sigmoid", USER_PATTERN)
    report = fuser.explain(AtanScaled(), (torch.randn(5, 32).to(torch.bfloat16),), patterns=[path])
    said = [r for r in report.rejected if r.category == "no match"]
    assert [r.pattern for r in said] == ["scaled_sigmoid"], report.text()  # not the built-ins
    assert "matched no chain in this module" in said[0].reason
    assert "scaled_sigmoid" in report.text()


def test_a_user_pattern_with_a_built_in_name_is_used_instead_and_said(tmp_path, caplog):
    """A user file rmsnorm.py (here the scaled sigmoid) replaces the built-in rmsnorm: the
    report and the log name both files, the user's pattern fuses, the built-in no longer does."""
    path = write(tmp_path, "rmsnorm", USER_PATTERN)
    builtin = fuser.pattern.patterns_dir() / "rmsnorm.py"
    x = torch.randn(5, 32).to(torch.bfloat16)
    with caplog.at_level("WARNING", logger="fuser"):
        report = fuser.explain(ScaledSigmoid(), (x,), patterns=[path])
    (said,) = [r for r in report.rejected if r.category == "replaced"]
    assert said.pattern == "rmsnorm"
    assert str(path.resolve()) in said.reason and str(builtin.resolve()) in said.reason
    assert str(path.resolve()) in caplog.text and str(builtin.resolve()) in caplog.text
    (chain,) = report.chains
    assert (chain.pattern, chain.template, chain.params) == ("rmsnorm", "pointwise", {"scale": 2.0})
    norm = fuser.explain(helpers.BF16RMSNorm(32), (x,), patterns=[path])
    assert "rmsnorm" not in {c.pattern for c in norm.chains}, norm.text()


def test_a_built_in_given_again_is_loaded_once():
    builtin = fuser.pattern.patterns_dir() / "rmsnorm.py"
    names = [p.name for p in load_patterns([builtin], fuser.codegen.emit.template_names())]
    assert names.count("rmsnorm") == 1
    report = fuser.explain(helpers.BF16RMSNorm(32), (torch.randn(3, 32).to(torch.bfloat16),), patterns=[builtin])
    assert [c.pattern for c in report.chains] == ["rmsnorm"], report.text()
    assert not [r for r in report.rejected if r.pattern == "rmsnorm"], report.text()
