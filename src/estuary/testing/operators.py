"""The ``SourceOperator`` conformance suite: what the Timer, Driver and Progress
rely on. Every operator (files, joins, streams, a plugin's source kind)
subclasses ``OperatorConformance`` and provides ``make(tmp_path) -> (operator,
columns)`` over data with at least two ready windows::

    from estuary.testing.operators import OperatorConformance

    class TestMySource(OperatorConformance):
        def make(self, tmp_path):
            ...write two ready windows of data under tmp_path...
            return MySource(...), ["label", "I1", "C1"]
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np

from estuary.data.graph import SourceOperator

__all__ = ["OperatorConformance"]


class OperatorConformance(ABC):
    """Shared tests for every source operator; a subclass provides ``make``."""

    @abstractmethod
    def make(self, tmp_path: Path) -> tuple[SourceOperator, list[str]]:
        """A fresh operator over data under ``tmp_path``, and the columns to read."""

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
