"""No import cycles inside ``areal_core``, imports inside functions included.

Every ``.py`` under ``areal_core`` is parsed with ``ast`` (nothing is imported). An edge A -> B is
any ``import B`` / ``from B import name`` in A, at module level or inside a function or class,
relative imports resolved; ``from pkg import name`` where ``name`` is a submodule of ``pkg`` is an
edge to that submodule, otherwise to ``pkg`` itself (so a submodule importing its package for a
name ``__init__`` defines or re-exports is an edge to the package). Imports under
``if TYPE_CHECKING:`` are never executed and do not count. A strongly connected component of more
than one module is a cycle; the test prints each one's modules and the import lines inside it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "areal_core"


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    path: str  # relative to the repository root
    line: int
    text: str
    in_function: bool


def module_files() -> dict[str, Path]:
    """Module name -> file, for every module of the package."""
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module):
    """(node, inside a function) for every import statement that can run (TYPE_CHECKING skipped)."""

    def walk(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, in_function
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.orelse:  # the else branch does run
                    yield from walk(ast.Module(body=[sub], type_ignores=[]), in_function)
            else:
                inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                yield from walk(child, inner)

    yield from walk(tree, False)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_edges() -> list[Edge]:
    files = module_files()
    edges = []
    for module, path in files.items():
        source = path.read_text()
        lines = source.splitlines()
        rel = str(path.relative_to(ROOT))
        for node, in_function in _imports(ast.parse(source, filename=rel)):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                target = _resolve(module, path.name == "__init__.py", node)
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    targets.append(sub if sub in files else target)
            text = lines[node.lineno - 1].strip()
            for dst in dict.fromkeys(targets):
                if dst in files and dst != module:
                    edges.append(Edge(module, dst, rel, node.lineno, text, in_function))
    return edges


def strongly_connected(nodes, graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative): the strongly connected components."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    counter = 0
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def find_cycles() -> list[tuple[list[str], list[Edge]]]:
    edges = import_edges()
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.src, set()).add(edge.dst)
    cycles = []
    for component in strongly_connected(sorted(module_files()), graph):
        if len(component) > 1:
            members = set(component)
            inside = [e for e in edges if e.src in members and e.dst in members]
            cycles.append((component, sorted(inside, key=lambda e: (e.path, e.line))))
    return sorted(cycles)


def describe(cycles) -> str:
    out = []
    for i, (component, inside) in enumerate(cycles, 1):
        out.append(f"cycle {i}: {', '.join(component)}")
        for e in inside:
            where = " (in a function)" if e.in_function else ""
            out.append(f"    {e.path}:{e.line}: {e.text}    [{e.src} -> {e.dst}]{where}")
    return "\n".join(out)


def test_parser_sees_the_package():
    files = module_files()
    assert "areal_core.run.setup" in files and "areal_core.rollout.backends" in files
    edges = import_edges()
    assert any(e.in_function for e in edges)  # function-level imports are read
    assert len({e.src for e in edges}) > len(files) // 2


def test_tarjan_finds_components():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"f"}}
    found = sorted(strongly_connected(sorted(graph), graph))
    assert found == [["a", "b", "c"], ["d", "e"], ["f"]]


def test_relative_imports_resolve():
    node = ast.parse("from ..reward import code").body[0]
    assert _resolve("areal_core.rollout.config", False, node) == "areal_core.reward"
    node = ast.parse("from . import config").body[0]
    assert _resolve("areal_core.rollout", True, node) == "areal_core.rollout"


def test_no_import_cycles_in_areal_core():
    cycles = find_cycles()
    if cycles:
        print(describe(cycles))
    assert not cycles, f"{len(cycles)} import cycle(s) in {PACKAGE}:\n{describe(cycles)}"
