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


def test_loading_a_job_imports_neither_torch_nor_numba() -> None:
    """A parameter-server process or ``estuary render`` loads jobs without the heavy
    libraries (an optimizer's implementation is imported only to check a
    parameter of its own)."""
    code = (
        "import sys, estuary; estuary.load_job('examples/criteo.yaml');"
        "print(sorted(m for m in ('torch', 'numba') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]"
