"""The tools hold the line: lint, format and types are part of the test suite."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "command",
    [
        ["ruff", "check", "."],
        ["ruff", "format", "--check", "."],
        [sys.executable, "-m", "mypy"],
    ],
    ids=["ruff-check", "ruff-format", "mypy"],
)
def test_tool_is_clean(command: list[str]) -> None:
    if command[0] == "ruff" and shutil.which("ruff") is None:
        pytest.skip("ruff not installed (pip install -e '.[dev]')")
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr


def test_importing_estuary_does_not_import_torch() -> None:
    code = "import sys, estuary; estuary.load_job; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_layers_import_only_downwards() -> None:
    """config <- {data, embedding} <- nn <- train <- runtime <- cli (ARCHITECTURE.md)."""
    forbidden = {
        "config": ["estuary.data", "estuary.embedding", "estuary.nn", "estuary.train"],
        "data": ["estuary.embedding", "estuary.nn", "estuary.train"],
        "embedding": ["estuary.data", "estuary.nn", "estuary.train"],
        "nn": ["estuary.train"],
        "metrics": ["estuary.train", "estuary.nn"],
        "ps": ["estuary.data", "estuary.nn", "estuary.train"],
        "train": ["estuary.runtime", "estuary.cli"],
        "runtime": ["estuary.cli"],
    }
    offenders = []
    for layer, banned in forbidden.items():
        for path in (ROOT / "src" / "estuary" / layer).rglob("*.py"):
            text = path.read_text()
            offenders += [f"{path.relative_to(ROOT)} imports {b}" for b in banned if f"{b}" in text]
    assert not offenders, offenders


def test_train_and_runtime_modules_import_no_circle() -> None:
    """No module of ``estuary.train`` or ``estuary.runtime`` reaches itself through
    its imports (at any depth; type-checking and in-function imports count)."""
    import ast

    packages = ("estuary.train", "estuary.runtime")
    modules: dict[str, set[str]] = {}
    for package in packages:
        folder = ROOT / "src" / Path(*package.split("."))
        for path in folder.glob("*.py"):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            imported = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module:
                    imported.add(node.module)
                elif isinstance(node, ast.Import):
                    imported.update(alias.name for alias in node.names)
            modules[name] = imported
    edges = {m: {i for i in deps if i in modules and i != m} for m, deps in modules.items()}
    for package in packages:  # a package's __init__ may gather its modules
        for module in list(edges):
            edges[module].discard(package)

    def cycle_from(start: str) -> list[str] | None:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in edges[node]:
                if nxt == start:
                    return [*path, start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
        return None

    cycles = [c for m in edges if (c := cycle_from(m)) is not None]
    assert not cycles, cycles
