"""A source whose every split read starts after a fixed delay: a latency-bound
source (remote storage, a slow service) where more concurrent readers help
without more cores. ``bench/elastic.py`` reads through it; it wraps any
``SourceOperator`` and changes nothing else (rows, order, accounting)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from estuary.data.formats import RawChunk
from estuary.data.graph.types import Readiness, SourceOperator, Split, Task

__all__ = ["DelayedSource"]


class DelayedSource:
    """``op`` with ``delay_s`` of waiting before each split's first row."""

    def __init__(self, op: SourceOperator, delay_s: float) -> None:
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        self.op = op
        self.delay_s = delay_s
        self.stream = op.stream
        self.name = op.name
        self.open_ended = op.open_ended

    def tasks(self) -> Iterator[Task]:
        return self.op.tasks()

    def check_ready(self, task: Task) -> Readiness:
        return self.op.check_ready(task)

    def splits(self, task: Task) -> list[Split]:
        return self.op.splits(task)

    def prepare(self, task: Task) -> object:
        return self.op.prepare(task)

    def read(
        self, split: Split, columns: Sequence[str], context: object, block_size_bytes: int
    ) -> Iterator[RawChunk]:
        time.sleep(self.delay_s)  # Blocking wait: the source's latency
        yield from self.op.read(split, columns, context, block_size_bytes)
