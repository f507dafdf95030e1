"""The package's imports go down the pipeline: a module imports modules of its own stage or of
a stage before it, never one after it, and no module imports, at its top or inside a function,
a module that imports it back (directly or through others)."""

import ast
from pathlib import Path

import fuser

PACKAGE = Path(fuser.__file__).resolve().parent

#: The stages in pipeline order, each a subpackage (or a top-level module of fuser). The
#: public authoring module ``fuser.pattern`` is part of the vocabulary every stage shares;
#: ``fuser`` itself (its ``__init__``) is the public API, beside ``fuser.api``.
LAYERS = [
    {"ir", "pattern"},
    {"trace"},
    {"canon"},
    {"match"},
    {"regions"},
    {"lower"},
    {"codegen"},
    {"validate"},
    {"install"},
    {"pipeline"},
    {"model"},
    {"api", "testing", "__init__"},
    {"serving"},
    {"tools", "__main__"},
]
RANK = {stage: rank for rank, stages in enumerate(LAYERS) for stage in stages}


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (``fuser.trace.tracing``); a package by its
    ``__init__`` (``fuser.trace``), the package itself as ``fuser``."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(["fuser", *parts])] = path
    return found


def stage(module: str) -> str:
    """The stage a module belongs to: its subpackage, or its own name at the top."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imported_modules(path: Path, known: dict[str, Path]) -> set[str]:
    """The fuser modules ``path`` imports anywhere in its code (``from fuser.x.y import ...``,
    ``from fuser.x import y``, ``import fuser.x.y``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "fuser":
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "fuser"}
    return {m for m in found if m in known}


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported_modules(path, known) - {name} for name, path in known.items()}


def test_every_stage_has_a_rank_and_a_docstring():
    graph = import_graph()
    assert len(graph) > 60 and "fuser.trace.tracing" in graph  # the walk reaches into the subpackages
    unranked = sorted({stage(m) for m in graph} - set(RANK))
    assert unranked == [], f"stages without a place in LAYERS: {unranked}"
    for path in PACKAGE.rglob("__init__.py"):
        assert ast.get_docstring(ast.parse(path.read_text())), f"{path}: a package says what it takes and returns"


def test_no_import_goes_up_the_pipeline():
    graph = import_graph()
    assert "fuser.model.fuse_model" in graph["fuser.api"]  # the graph is read
    upward = [
        f"{module} ({stage(module)}) imports {dep} ({stage(dep)})"
        for module, deps in sorted(graph.items())
        for dep in sorted(deps)
        if RANK[stage(dep)] > RANK[stage(module)]
    ]
    assert upward == [], "\n".join(upward)


def test_the_rule_catches_an_upward_import(tmp_path):
    """The layering check reads a module's imports, including those inside functions."""
    probe = tmp_path / "probe.py"
    probe.write_text("def late():\n    from fuser.install.splice import install\n")
    known = modules()
    assert imported_modules(probe, known) == {"fuser.install.splice"}
    assert RANK[stage("fuser.install.splice")] > RANK[stage("fuser.trace.tracing")]


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()

    def path_back(start: str, goal: str) -> list[str] | None:
        stack, seen = [(start, [start])], set()
        while stack:
            module, path = stack.pop()
            if module == goal:
                return path
            if module not in seen:
                seen.add(module)
                stack += [(m, path + [m]) for m in graph.get(module, ())]
        return None

    cycles = [[module, *path] for module, deps in graph.items() for dep in deps
              if (path := path_back(dep, module))]  # fmt: skip
    assert cycles == [], "\n".join(" -> ".join(c) for c in cycles)
