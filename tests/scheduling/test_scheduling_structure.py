"""The planner's code stays readable: short functions, imports at module top, no cycles."""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_skrull.scheduling as scheduling

PACKAGE = Path(scheduling.__file__).parent
MODULES = sorted(PACKAGE.glob("*.py"))
MAX_FUNCTION_LINES = 80


def _functions(tree: ast.AST):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_function_is_longer_than_80_lines() -> None:
    # Docstrings included: a function that needs more is doing two things.
    long = [
        f"{path.name}:{fn.name} ({fn.end_lineno - fn.lineno + 1} lines)"
        for path in MODULES
        for fn in _functions(ast.parse(path.read_text()))
        if fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long == []


def test_no_function_imports() -> None:
    # A function-level import inside scheduling/ would dodge an import cycle; every module
    # imports at its top.
    found = [
        f"{path.name}:{node.lineno} {fn.name}"
        for path in MODULES
        for fn in _functions(ast.parse(path.read_text()))
        for node in ast.walk(fn)
        if isinstance(node, (ast.Import, ast.ImportFrom))
    ]
    assert found == []


def test_the_scheduling_modules_import_each_other_without_a_cycle() -> None:
    graph: dict[str, set[str]] = {}
    for path in MODULES:
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "lightning_skrull.scheduling."
            ):
                deps.add(node.module.rsplit(".", 1)[1])
        graph[path.stem] = deps
    graph.pop("__init__")
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import cycle: {' -> '.join((*path, module))}"
        if module in done:
            return
        for dep in sorted(graph[module]):
            visit(dep, (*path, module))
        done.add(module)

    for module in sorted(graph):
        visit(module, ())
    assert "sequence_costs" in graph["dacp"] and "cost_model" in graph["fit"]  # the graph is read
