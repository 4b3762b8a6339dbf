"""No module-level import cycle within the graphmode package.

A cycle makes a module's names depend on which module of the cycle was
imported first (a partially initialised module), and is usually papered over
with imports inside functions. This reads every module's source (ast): the
imports at module level (those under ``if TYPE_CHECKING:`` excepted; imports
inside functions are fine), where importing ``a.b.c`` also runs the packages
``a`` and ``a.b`` (but a module's own ancestors are initialised before it,
so those edges are left out), and ``from graphmode import Name`` reaches the
module that ``graphmode/__init__.py`` loads ``Name`` from (PEP 562).
"""

from __future__ import annotations

import ast
from pathlib import Path

import graphmode

ROOT = Path(graphmode.__file__).parent


def _modules() -> dict[str, tuple[Path, bool]]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def _exports() -> dict[str, str]:
    for node in ast.walk(ast.parse((ROOT / "__init__.py").read_text())):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "_EXPORTS":
            return ast.literal_eval(node.value)
    raise AssertionError("graphmode/__init__.py has no _EXPORTS table")


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                visit(node.orelse)
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.ClassDef)):
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(node, field, []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    return found


def import_graph() -> dict[str, set[str]]:
    """Each graphmode module -> the graphmode modules its import runs."""
    modules, exports = _modules(), _exports()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    def with_packages(name: str) -> set[str]:
        found = {name}
        while "." in name:
            name = name.rpartition(".")[0]
            found.add(name)
        return found

    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        targets: set[str] = set()
        for node in _module_level_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                hits = [resolve(alias.name) for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    package = name if is_package else name.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        package = package.rpartition(".")[0]
                    base = f"{package}.{base}" if base else package
                hits = []
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if full in modules:
                        hits.append(full)
                    elif base == "graphmode" and alias.name in exports:
                        hits.append(exports[alias.name])
                    else:
                        hits.append(resolve(base))
            for hit in hits:
                if hit is not None:
                    targets |= with_packages(hit)
        graph[name] = targets - with_packages(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_the_analysis_sees_module_level_imports():
    graph = import_graph()
    assert "graphmode.emulator.capture" in graph["graphmode.emulator.graph"]
    assert "graphmode.errors" in graph["graphmode.plugins.manager"]
    # from graphmode import ConfigError reaches graphmode.errors, through PEP 562.
    assert "graphmode.errors" in graph["graphmode.buckets"] or "graphmode.errors" in graph["graphmode.config"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_level_import_cycle_in_graphmode():
    found = cycles(import_graph())
    assert not found, (
        "module-level import cycles in graphmode (each line: the modules of one cycle). Move what both "
        "sides need into a module of its own rather than importing inside a function:\n"
        + "\n".join(" <-> ".join(cycle) for cycle in found)
    )
