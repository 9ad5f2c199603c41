"""docs/job-spec.md stays true to spec.py: every field listed, the example loads."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import pytest

from estuary.config import JobSpec, load_job

DOC = Path(__file__).resolve().parents[2] / "docs" / "job-spec.md"


def field_paths(cls: type, prefix: str = "") -> list[str]:
    """Dotted YAML keys of every field, with ``[]`` for list items."""
    paths = []
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.metadata.get("yaml", True):
            continue
        path = f"{prefix}{f.name}"
        paths.append(path)
        tp: Any = hints[f.name]
        if get_origin(tp) is list and dataclasses.is_dataclass(get_args(tp)[0]):
            paths += field_paths(get_args(tp)[0], f"{path}[].")
        elif isinstance(tp, type) and dataclasses.is_dataclass(tp):
            paths += field_paths(tp, f"{path}.")
    return paths


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text(encoding="utf-8")


def test_every_field_is_documented(doc: str) -> None:
    missing = [p for p in field_paths(JobSpec) if f"`{p}`" not in doc]
    assert not missing, f"add these to docs/job-spec.md: {missing}"


def test_loader_only_fields_are_not_documented_as_keys(doc: str) -> None:
    assert "| `base_dir` |" not in doc


def test_documented_example_job_loads(doc: str, tmp_path: Path) -> None:
    match = re.search(r"<!-- example-job[^>]*-->\s*```yaml\n(.*?)```", doc, re.DOTALL)
    assert match, "the example job block is missing"
    path = tmp_path / "examples" / "criteo.yaml"
    path.parent.mkdir()
    path.write_text(match.group(1), encoding="utf-8")
    job = load_job(path)
    assert job.resolve(job.output.dir).resolve() == tmp_path / "runs" / "criteo-dlrm"
    assert job.data.sources[0].path.endswith("criteo_dac_sample_34k.tsv.gz")
    assert len(job.data.schema.sparse) == 26
    assert job.table_spec("C16").optimizer.name == "adagrad"
