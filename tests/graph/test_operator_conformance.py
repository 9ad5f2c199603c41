"""File sources and joins pass the ``SourceOperator`` conformance suite
(``estuary.testing.operators``)."""

from __future__ import annotations

from pathlib import Path

from estuary.data.graph import FileSource, Joiner, SourceOperator, build_operators
from estuary.testing.operators import OperatorConformance

from .conftest import COLUMNS, dataset_job, source, write_hours
from .test_joiner import clicks, impressions, join_job


class TestFileSource(OperatorConformance):
    def make(self, tmp_path: Path) -> tuple[SourceOperator, list[str]]:
        write_hours(tmp_path, 2, 30, files=2)
        job = dataset_job(tmp_path, {"s": {"sources": [source(hours=4)]}})
        assert job.data.dataset is not None
        (op,) = build_operators(job.data.dataset, tmp_path, "label")
        assert isinstance(op, FileSource)
        return op, COLUMNS


class TestJoiner(OperatorConformance):
    def make(self, tmp_path: Path) -> tuple[SourceOperator, list[str]]:
        impressions(tmp_path)
        clicks(tmp_path, 0, [])
        clicks(tmp_path, 1, [])
        job = join_job(tmp_path, left_end="2026-01-01T04")
        (op,) = build_operators(job.data.dataset, tmp_path, "label")  # type: ignore[attr-defined]
        assert isinstance(op, Joiner)
        return op, ["label", "I1", "I2", "C1", "C2"]
