"""No import cycle within the graphmode package, at module level or inside
functions.

A cycle makes a module's names depend on which module of the cycle was
imported first (a partially initialised module), and is usually papered over
with imports inside functions, which is why those count too. This reads
every module's source (ast): every import statement, at module level, in
classes and inside functions (those under ``if TYPE_CHECKING:`` excepted:
they never run), where importing ``a.b.c`` also runs the packages ``a`` and
``a.b`` (but a module's own ancestors are initialised before it, so those
edges are left out), and ``from package import Name`` reaches the module
that a package with an ``_EXPORTS`` table (``graphmode``) loads ``Name``
from on first use (PEP 562). Modules are checked, and so are rooms (each
subpackage and each top-level module of graphmode: :func:`rooms`), whose
imports form layers: the HAL's modules, the checks, the families, the runner.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import graphmode

ROOT = Path(graphmode.__file__).parent


def _modules(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    modules = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def _exports(modules: dict[str, tuple[Path, bool]]) -> dict[str, dict[str, str]]:
    """package -> (name -> module) for every package with an _EXPORTS table."""
    tables = {}
    for name, (path, is_package) in modules.items():
        if not is_package:
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "_EXPORTS":
                tables[name] = ast.literal_eval(node.value)
    assert "graphmode" in tables, "graphmode/__init__.py has no _EXPORTS table"
    return tables


def _imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: at module level, in classes and
    in functions, but not under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for child in node.orelse:
                visit(child)
        else:
            for child in ast.iter_child_nodes(node):
                visit(child)

    visit(tree)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Each graphmode module -> the graphmode modules its import runs
    (``root``: the graphmode tree read)."""
    modules = _modules(root)
    exports = _exports(modules)

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
        for node in _imports(ast.parse(path.read_text())):
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
                    elif alias.name in exports.get(base, {}):
                        hits.append(exports[base][alias.name])
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


def test_the_analysis_sees_module_level_and_function_level_imports():
    graph = import_graph()
    assert "graphmode.emulator.capture" in graph["graphmode.emulator.graph"]
    assert "graphmode.errors" in graph["graphmode.plugins.manager"]
    # from graphmode import ConfigError reaches graphmode.errors, through PEP 562.
    assert "graphmode.errors" in graph["graphmode.buckets"] or "graphmode.errors" in graph["graphmode.config"]
    # A package's imports: graphmode.runner imports its runner module and the families.
    assert {"graphmode.runner.runner", "graphmode.families.full"} <= graph["graphmode.runner"]
    # Imports inside functions: BufferSpec.allocate imports the emulator's mark_host.
    assert "graphmode.emulator.host" in graph["graphmode.spec"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_a_function_level_import_closing_a_cycle_is_seen(tmp_path):
    tree = ast.parse("def f():\n    from graphmode.runner.runner import GraphRunner\n")
    assert [ast.unparse(node) for node in _imports(tree)] == ["from graphmode.runner.runner import GraphRunner"]
    hidden = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import graphmode.runner\n")
    assert [ast.unparse(node) for node in _imports(hidden)] == ["from typing import TYPE_CHECKING"]


def rooms(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between rooms: each subpackage of graphmode
    (``graphmode.runner``, ``graphmode.families``) and each top-level module
    (``graphmode.spec``) is one room; imports inside a room are left out, and
    so is the ``graphmode`` package itself (its names load on first use)."""

    def room(module: str) -> str:
        return ".".join(module.split(".")[:2])

    found: dict[str, set[str]] = {}
    for module, targets in graph.items():
        if module == "graphmode":
            continue
        found.setdefault(room(module), set()).update(
            room(target) for target in targets if target != "graphmode" and room(target) != room(module))
    return found


def _problems(root: Path) -> list[str]:
    """Every import cycle under ``root`` (a graphmode tree): between modules,
    then between rooms, one line each."""
    graph = import_graph(root)
    return ([" <-> ".join(cycle) for cycle in cycles(graph)]
            + ["rooms: " + " <-> ".join(cycle) for cycle in cycles(rooms(graph))])


def test_no_import_cycle_in_graphmode():
    found = _problems(ROOT)
    assert not found, (
        "import cycles in graphmode, imports inside functions included (each line: the modules, or the rooms, "
        "of one cycle). Move what both sides need into a module of its own, in the lower room:\n"
        + "\n".join(found)
    )


def _planted(tmp_path: Path, module: str, line: str) -> Path:
    """A copy of the graphmode tree with ``line`` added to ``module``'s file."""
    root = tmp_path / "graphmode"
    shutil.copytree(ROOT, root, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.cpp"))
    path = root.parent / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text() + "\n\n" + line + "\n")
    return root


def test_a_planted_cycle_between_two_rooms_fails(tmp_path):
    # The checks sit below the runner: a function-level import of the runner closes a cycle between rooms.
    root = _planted(tmp_path, "graphmode.checks.validate",
                    "def planted():\n    from graphmode.runner.runner import GraphRunner\n    return GraphRunner")
    found = _problems(root)
    assert any(line.startswith("rooms: ") and {"graphmode.checks", "graphmode.runner"} <= set(line[7:].split(" <-> "))
               for line in found), found
    assert not _problems(ROOT)


def test_a_planted_cycle_inside_the_hal_fails(tmp_path):
    # buffers sits below the built-in plugin, which imports it.
    root = _planted(tmp_path, "graphmode.buffers", "def planted():\n    from graphmode import default\n    return default")
    assert any({"graphmode.buffers", "graphmode.default"} <= set(line.split(" <-> ")) for line in _problems(root))


def test_the_layers_of_the_runner_wing():
    """The checks import no family and no runner; the families no runner."""
    graph = rooms(import_graph())
    assert not graph["graphmode.checks"] & {"graphmode.families", "graphmode.runner"}
    assert "graphmode.runner" not in graph["graphmode.families"]
    assert "graphmode.model" not in graph["graphmode.attention"]
