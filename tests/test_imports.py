"""Imports point downwards and never in a circle (docs/architecture.md).

The graph is read from the source (every ``import`` and ``from ... import``,
at module level or inside functions; those under ``if TYPE_CHECKING:`` are
annotations only and not counted), so a lazy import inside a function that
closes a circle fails here too.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "estuary"

# Layers, bottom first: a module imports only its own package and lower layers.
LAYERS: dict[str, int] = {
    "errors": 0,
    "registry": 1,
    "plugins": 2,  # names -> "module:attr" strings: imports nothing it names
    "config": 3,
    "data": 4,
    "embedding": 4,
    "metrics": 4,
    "nn": 5,
    "ps": 5,
    "train": 6,
    "runtime": 7,
    "deploy": 4,  # renders job files for cluster managers: reads config only
    "serve": 7,
    "plan": 7,  # sizing and simulation: calibrates with train, data, nn
    "cli": 8,
    "testing": 8,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(name: str) -> set[str]:
    """The ``estuary`` modules that module ``name`` imports (the nearest existing
    module for ``from package import name``)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    out = set()
    for target in found:
        while target and target not in MODULES:
            target = target.rpartition(".")[0]
        if target.startswith("estuary") and target != name and target != "estuary":
            out.add(target)
    return out


GRAPH = {name: imports_of(name) for name in MODULES}


def layer_of(name: str) -> str:
    return name.split(".")[1] if name.count(".") else ""


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
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


def test_no_import_circle() -> None:
    assert cycles(GRAPH) == []


def test_the_cycle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_every_package_has_a_layer() -> None:
    missing = sorted({layer_of(m) for m in MODULES if layer_of(m)} - set(LAYERS))
    assert not missing, f"add these packages to LAYERS (and docs/architecture.md): {missing}"


def test_layers_import_only_downwards() -> None:
    upward = [
        f"{name} imports {target}"
        for name, targets in sorted(GRAPH.items())
        for target in sorted(targets)
        if layer_of(name)
        and layer_of(target) != layer_of(name)
        and LAYERS[layer_of(target)] >= LAYERS[layer_of(name)]
    ]
    assert not upward, upward


def test_the_graph_is_read_from_the_source() -> None:
    """The checks above see real edges (they cannot pass on an empty graph)."""
    assert len(GRAPH) > 80
    assert "estuary.config" in GRAPH["estuary.train.trainer"]
    assert "estuary.data.streams.backends" in GRAPH["estuary.data.streams.reader"]
