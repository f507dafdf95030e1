"""The package's imports go one way: no module of fuser imports, at its top or inside a
function, a module that imports it back (directly or through others)."""

import ast
from pathlib import Path

import fuser

PACKAGE = Path(fuser.__file__).resolve().parent


def imported_modules(path: Path) -> set[str]:
    """The fuser modules ``path`` imports anywhere in its code (``from fuser.x import ...``,
    ``from fuser import x``, ``import fuser.x``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "fuser":
            parts = node.module.split(".")
            found |= {parts[1]} if len(parts) > 1 else {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("fuser.")}
    return {m for m in found if (PACKAGE / f"{m}.py").exists()} - {path.stem}


def test_no_module_imports_one_that_imports_it_back():
    graph = {p.stem: imported_modules(p) for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert graph["api"] >= {"model", "pipeline"}  # the graph is read

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
