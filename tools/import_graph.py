"""The import graph of backend/, one node per unit: each `backend/<domain>` package and each top-level
`backend/*.py` module (`backend/app.py` is `backend.app`). Reports the strongly connected components
(import cycles) and the imports written inside functions. Run: `.venv/bin/python tools/import_graph.py`.

Imports inside functions count too (they are part of the dependency, only deferred). `import-linter`
(`lint-imports`, contracts in pyproject.toml) enforces the layers in `make lint`; this script measures.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "backend"


@dataclass(frozen=True)
class Import:
    source: str  # the unit that imports
    target: str  # the unit imported
    path: Path
    line: int
    in_function: bool


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def unit_of(module: str) -> str | None:
    """`backend.settlement.views` -> `backend.settlement`; `backend.app` -> `backend.app`; None outside backend."""
    parts = module.split(".")
    if parts[0] != PACKAGE or len(parts) < 2:
        return None
    return ".".join(parts[:2])


def _imported_modules(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
        return
    if node.level:
        base = module.split(".")
        if not is_package:
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join(base)
        target = f"{prefix}.{node.module}" if node.module else prefix
    else:
        target = node.module or ""
    if node.module is None or target == PACKAGE:
        # `from . import x` / `from backend import x`: x is a module of that package.
        for alias in node.names:
            yield f"{target}.{alias.name}"
    else:
        yield target


def _walk(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement with whether it sits inside a function body."""

    def visit(node: ast.AST, in_function: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child, in_function
            inner = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            yield from visit(child, inner)

    yield from visit(tree, False)


def _type_checking_only(tree: ast.AST) -> set[int]:
    """Line numbers of imports under `if TYPE_CHECKING:` (not imported at run time)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                for sub in ast.walk(child):
                    if isinstance(sub, ast.Import | ast.ImportFrom):
                        lines.add(sub.lineno)
    return lines


def collect(root: Path = ROOT) -> list[Import]:
    imports: list[Import] = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        if "migrations" in path.relative_to(root).parts:
            continue
        module = module_name(path)
        source = unit_of(module)
        if source is None:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        skip = _type_checking_only(tree)
        for node, in_function in _walk(tree):
            if node.lineno in skip:
                continue
            for name in _imported_modules(node, module, path.name == "__init__.py"):
                target = unit_of(name)
                if target is not None and target != source:
                    imports.append(Import(source, target, path, node.lineno, in_function))
    return imports


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm; components of more than one node (or a node importing itself), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0

    def connect(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component: list[str] = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    sys.setrecursionlimit(max(1000, 10 * len(graph)))
    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(components, key=lambda c: (-len(c), c))


def in_function_imports(root: Path = ROOT) -> list[tuple[Path, int, str]]:
    """Every import statement inside a function in backend/ (any target), for the count."""
    found: list[tuple[Path, int, str]] = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        if "migrations" in path.relative_to(root).parts:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, in_function in _walk(tree):
            if in_function:
                found.append((path, node.lineno, ast.unparse(node)))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edges", action="store_true", help="list every import that closes a cycle")
    parser.add_argument("--local", action="store_true", help="list the imports written inside functions")
    args = parser.parse_args(argv)

    imports = collect()
    graph: dict[str, set[str]] = {}
    for imp in imports:
        graph.setdefault(imp.source, set()).add(imp.target)
        graph.setdefault(imp.target, set())
    cycles = strongly_connected(graph)
    local = in_function_imports()
    local_backend = [i for i in local if " backend" in i[2] or "from ." in i[2]]
    print(f"units: {len(graph)}")
    print(f"cycles: {len(cycles)}; units in cycles: {sum(len(c) for c in cycles)}")
    for component in cycles:
        print(f"  {len(component)} units: {', '.join(component)}")
        if args.edges:
            members = set(component)
            for imp in imports:
                if imp.source in members and imp.target in members:
                    where = f"{imp.path.relative_to(ROOT)}:{imp.line}"
                    print(f"    {imp.source} -> {imp.target}  {where}{' (in function)' if imp.in_function else ''}")
    print(f"imports inside functions: {len(local)} ({len(local_backend)} of them of backend modules)")
    if args.local:
        for path, line, text in local:
            print(f"  {path.relative_to(ROOT)}:{line}: {text}")
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main())
