"""The ``SourceOperator`` conformance suite: what the Timer, Driver and Progress
rely on. Every operator (files, joins, and later stream connectors) subclasses
``OperatorConformance`` and provides ``make(tmp_path) -> (operator, columns)``
over data with at least two ready windows."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np

from estuary.data.graph import FileSource, Joiner, SourceOperator, build_operators

from .conftest import COLUMNS, dataset_job, source, write_hours
from .test_joiner import clicks, impressions, join_job


class OperatorConformance:
    def make(self, tmp_path: Path) -> tuple[SourceOperator, list[str]]:
        raise NotImplementedError

    def test_tasks_are_lazy_ordered_and_named(self, tmp_path: Path) -> None:
        op, _ = self.make(tmp_path)
        tasks = list(itertools.islice(op.tasks(), 50))
        assert tasks == sorted(tasks)
        assert len({t.id for t in tasks}) == len(tasks)
        assert all(t.stream == op.stream and t.source == op.name for t in tasks)
        assert all(t.start_s < t.end_s for t in tasks)

    def test_ready_tasks_list_splits_whose_rows_come_in_order(self, tmp_path: Path) -> None:
        op, columns = self.make(tmp_path)
        task = next(op.tasks())
        assert op.check_ready(task).ready
        splits = op.splits(task)
        assert [s.index for s in splits] == list(range(len(splits)))
        assert all(s.count == len(splits) and s.task == task for s in splits)
        assert len({s.name for s in splits}) == len(splits)
        context = op.prepare(task)
        rows = []
        for split in splits:
            last = 0
            for chunk in op.read(split, columns, context, 1 << 16):
                assert set(columns) <= set(chunk.columns)
                numbers = chunk.line_numbers
                assert np.all(np.diff(numbers) > 0) and (numbers.size == 0 or numbers[0] > last)
                last = int(numbers[-1]) if numbers.size else last
                rows.append(chunk.num_rows)
        assert sum(rows) > 0

    def test_an_unready_task_says_what_it_waits_for(self, tmp_path: Path) -> None:
        op, _ = self.make(tmp_path)
        far = next(t for t in itertools.islice(op.tasks(), 100) if not op.check_ready(t).ready)
        assert far.id in op.check_ready(far).waiting_for


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
