"""pattern_files: loading pattern files (:mod:`fuser.pattern` describes the format). A mistake
raises :class:`fuser.pattern.PatternError` naming the file and line: a key the format does not
know, an input spec or template that does not exist, or a reference that fails when it is
traced at the file's example sizes (:mod:`fuser.match.pattern_graph`)."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import logging
import os
from pathlib import Path

from fuser.pattern import ALLOWED_KEYS, Pattern, PatternError, TensorSpec, is_param, patterns_dir
from fuser.match.pattern_graph import trace_pattern

_log = logging.getLogger("fuser")


def _key_lines(path: Path, source: str) -> tuple[int, dict[str, int]]:
    """Line of the PATTERN assignment, and of each of its keys."""
    tree = ast.parse(source, filename=str(path))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "PATTERN" for t in node.targets):
            lines = {}
            value = node.value
            if isinstance(value, ast.Call):
                lines = {kw.arg: kw.value.lineno for kw in value.keywords if kw.arg}
            elif isinstance(value, ast.Dict):
                lines = {k.value: k.lineno for k in value.keys if isinstance(k, ast.Constant)}
            return node.lineno, lines
    return 1, {}


_LOADED: dict[tuple, Pattern] = {}


def load_pattern(path: str | os.PathLike, templates: set[str] | None = None, replaces: Path | None = None) -> Pattern:
    """Load one pattern file; a mistake raises :class:`PatternError` naming file and line.

    A file loaded before and unchanged since gives the same Pattern (its traces stay cached).
    ``replaces``: the built-in pattern file of the same name that this one is used instead of.
    """
    path = Path(path).resolve()
    source = path.read_text()
    key = (path, source, frozenset(templates) if templates is not None else None, replaces)
    if key not in _LOADED:
        pattern = _load_pattern(path, source, templates)
        pattern.replaces = replaces
        _check_reference(pattern)
        _LOADED[key] = pattern
    return _LOADED[key]


def _check_reference(pattern: Pattern) -> None:
    """Run the reference at its example sizes, as matching will: a mistake in its body (a
    misspelt name, a size the code cannot take) is reported here, at its line in the file."""
    try:
        graph = trace_pattern(pattern, pattern.example, {}, None)
    except Exception as e:
        line = next((f.lineno for f in reversed(_tb_frames(e)) if Path(f.filename).resolve() == pattern.path), None)
        if line is None:
            raise  # it failed before running the file's code: not the file's mistake
        sizes = ", ".join(f"{k}={v}" for k, v in sorted(pattern.example.items()))
        raise PatternError(
            f"{pattern.path}:{line}: the reference fails at the example sizes ({sizes}): {type(e).__name__}: {e}"
        ) from e
    if pattern.outputs is not None and len(pattern.outputs) != len(graph.outputs):
        line = inspect.getsourcelines(pattern.reference)[1]
        raise PatternError(
            f"{pattern.path}:{line}: PATTERN names {len(pattern.outputs)} outputs {list(pattern.outputs)}; "
            f"the reference returns {len(graph.outputs)}"
        )


def _load_pattern(path: Path, source: str, templates: set[str] | None) -> Pattern:
    try:
        pattern_line, key_lines = _key_lines(path, source)
    except SyntaxError as e:
        raise PatternError(f"{path}:{e.lineno}: syntax error: {e.msg}") from None

    def fail(line: int, message: str) -> PatternError:
        return PatternError(f"{path}:{line}: {message}")

    spec = importlib.util.spec_from_file_location(f"fuser_patterns.{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - report any import-time failure with its line
        line = next((f.lineno for f in reversed(_tb_frames(e)) if Path(f.filename).resolve() == path), 1)
        raise fail(line, f"{type(e).__name__}: {e}") from e
    reference = getattr(module, "reference", None)
    if not callable(reference):
        raise fail(1, "a pattern file must define a function `reference(...)` (the chain in plain PyTorch)")
    decl = getattr(module, "PATTERN", None)
    if not isinstance(decl, dict):
        raise fail(pattern_line, "a pattern file must define `PATTERN = dict(template=..., inputs=...)`")
    for key in decl:
        if key not in ALLOWED_KEYS:
            raise fail(key_lines.get(key, pattern_line), f"unknown PATTERN key {key!r}; allowed: {sorted(ALLOWED_KEYS)}")
    for key in ("template", "inputs"):
        if key not in decl:
            raise fail(pattern_line, f"PATTERN lacks {key!r}")
    template = decl["template"]
    if templates is not None and template not in templates:
        raise fail(key_lines.get("template", pattern_line), f"no template {template!r}; known: {sorted(templates)}")
    signature = inspect.signature(reference)
    params = {n: p.default for n, p in signature.parameters.items() if is_param(p.default)}
    tensor_args = [n for n, p in signature.parameters.items() if not is_param(p.default)]
    inputs = decl["inputs"]
    if not isinstance(inputs, dict) or not all(isinstance(v, TensorSpec) for v in inputs.values()):
        raise fail(key_lines.get("inputs", pattern_line), "inputs must map argument names to tensor('dims', 'dtypes')")
    if list(inputs) != tensor_args:
        raise fail(
            key_lines.get("inputs", pattern_line),
            f"inputs {list(inputs)} must name reference's tensor arguments {tensor_args}, in order",
        )
    example = dict(decl.get("example", {}))
    symbols = {d for s in inputs.values() for d in s.dims if not d.isdigit()} - {"T", "..."}
    example_line = key_lines.get("example", pattern_line)
    for name, size in example.items():
        if name not in symbols:
            raise fail(example_line, f"example names {name}, which is no dimension of the inputs {sorted(symbols)}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise fail(example_line, f"example size {name}={size!r} is not a positive integer")
    missing = sorted(s for s in symbols if s not in example)
    if missing:
        # A reasonable size for symbols without an example: small, not a power of two.
        example.update({s: 24 for s in missing})
    outputs = decl.get("outputs")
    if outputs is not None and (
        not isinstance(outputs, tuple) or not outputs or not all(isinstance(o, str) and o.isidentifier() for o in outputs)
        or len(set(outputs)) != len(outputs)
    ):  # fmt: skip
        raise fail(key_lines.get("outputs", pattern_line), f"outputs must be a tuple of distinct names, not {outputs!r}")
    constraint = decl.get("constraint")
    if constraint is not None:
        unknown = [n for n in inspect.signature(constraint).parameters if n not in params] if callable(constraint) else None
        if unknown is None or unknown:
            what = "is not callable" if unknown is None else f"takes {unknown}, which are no Param of the reference {sorted(params)}"
            raise fail(key_lines.get("constraint", pattern_line), f"constraint {what}")
    doc = (module.__doc__ or "").strip().splitlines()
    return Pattern(
        name=path.stem,
        path=path,
        reference=reference,
        template=template,
        inputs=dict(inputs),
        params=params,
        example=example,
        description=decl.get("description", doc[0] if doc else ""),
        priority=int(decl.get("priority", 0)),
        outputs=outputs,
        constraint=constraint,
    )


def _tb_frames(error: BaseException):
    import traceback

    return traceback.extract_tb(error.__traceback__)


def load_patterns(paths=None, templates: set[str] | None = None) -> list[Pattern]:
    """Load the built-in patterns plus any extra files or directories given.

    A file given with a built-in pattern's name is used instead of the built-in (its
    ``replaces`` names the built-in; the log and the report say so).
    """
    builtin = {p.stem: p.resolve() for p in _pattern_files(patterns_dir())}
    extra: dict[Path, None] = {}
    for entry in [Path(p) for p in (paths or [])]:
        if not entry.exists():
            raise PatternError(f"{entry}: no such pattern file or directory")
        for f in _pattern_files(entry) if entry.is_dir() else [entry]:
            if f.resolve() not in builtin.values():  # a built-in given again is loaded once
                extra[f.resolve()] = None
    replaced = {f.stem: builtin.pop(f.stem) for f in extra if f.stem in builtin}
    for name, original in replaced.items():
        user = next(f for f in extra if f.stem == name)
        _log.warning("pattern %s: using %s instead of the built-in %s", name, user, original)
    patterns = [load_pattern(f, templates) for f in builtin.values()]
    return patterns + [load_pattern(f, templates, replaces=replaced.get(f.stem)) for f in extra]


def _pattern_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("*.py") if not p.name.startswith("_"))
