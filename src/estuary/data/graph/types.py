"""The task graph's vocabulary: tasks, splits, task states, and the interface a
source operator implements (files today; stream connectors plug in the same way).

A **task** is one time window of one source: ``(start_s, rank, stream, source)``
orders tasks exactly as they are planned (time first, then higher priority).
A **split** is the unit a reader works on: one file of a task, or a row range of
one. A **row** is identified by ``(source, split name, row number)``: the row
number is the 1-based physical line of the decompressed file (header and blank
lines counted, as in bad-row reports) or the row number in a Parquet file; a
stream source's split is an offset range and its rows are the messages' places
in it (``graph/streams.py``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import NamedTuple, Protocol

from estuary.data.formats.types import RawChunk

__all__ = [
    "Readiness",
    "SourceOperator",
    "Split",
    "Task",
    "TaskState",
    "format_window",
]


def format_window(start_s: int) -> str:
    """``2026010113`` for the window starting 2026-01-01T13:00 UTC; minutes and
    seconds are added when the start has them (``202601011305``,
    ``20260101130507``), so windows shorter than a minute keep distinct ids."""
    when = datetime.fromtimestamp(start_s, UTC)
    if when.second:
        return when.strftime("%Y%m%d%H%M%S")
    return when.strftime("%Y%m%d%H%M" if when.minute else "%Y%m%d%H")


class Task(NamedTuple):
    """One window ``[start_s, end_s)`` of one source (times in s since 1970 UTC).

    A plain tuple so that a year of hourly tasks over ten sources (87,600) is
    planned and merged in well under a second; comparing tasks compares
    ``(start_s, rank, stream, source)``: the plan order.

    Args:
        start_s: window start.
        rank: ``-priority`` of the stream (lower rank = earlier among equal starts).
        stream: stream name.
        source: source name (for a joined stream, its left source).
        end_s: window end (exclusive).
    """

    start_s: int
    rank: int
    stream: str
    source: str
    end_s: int

    @property
    def id(self) -> str:
        """``stream/source@2026010113``: the task's name in progress and messages."""
        return f"{self.stream}/{self.source}@{format_window(self.start_s)}"

    @property
    def key(self) -> tuple[int, int, str, str]:
        """The plan-order key (JSON-able as a list)."""
        return (self.start_s, self.rank, self.stream, self.source)


@dataclass(frozen=True)
class Split:
    """One file (or row range of one) of a task.

    Args:
        task: the task it belongs to.
        name: the file as shown to users (relative to the job folder when inside
            it), plus ``#rows=a-b`` for a row range; unique within the task.
        location: what the source operator needs to read it (a file path).
        index: position among the task's splits (0-based).
        count: number of splits of the task.
        row_start: first row number of a row range (1-based, inclusive).
        row_stop: end of a row range (exclusive); ``None`` = to the end.
    """

    task: Task
    name: str
    location: str
    index: int
    count: int
    row_start: int = 1
    row_stop: int | None = None


@dataclass(frozen=True)
class Readiness:
    """Whether a task's inputs are complete: a decision the ``Timer`` acts on.

    Args:
        ready: every partition the task needs is complete.
        waiting_for: when not ready, what is missing (a partition folder and its
            marker), for messages.
        until_s: when not ready only because a join waits for late events on a
            stream: the wall-clock time (s since 1970) by which it will be ready.
            The timer then keeps waiting rather than ending an open-ended run as idle.
    """

    ready: bool
    waiting_for: str = ""
    until_s: float | None = None


class TaskState(enum.Enum):
    """A task's life while it is read: ``PENDING`` (planned, waiting to be ready),
    ``RUNNING`` (splits being read), ``SUCCEEDED`` (every split read to its end)
    or ``FAILED`` (a split failed after its retries). Whether its rows were
    *trained* is tracked separately, by ``Progress``."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in (TaskState.SUCCEEDED, TaskState.FAILED)


class SourceOperator(Protocol):
    """What the graph needs from a source: plan windows, judge readiness, list
    splits, read a split. ``FileSource`` implements it for time-partitioned
    files, ``Joiner`` for a joined pair and ``StreamSource`` for a broker
    stream (windows of broker time, splits named by offset range, rows numbered
    by their place in the split), so progress and row accounting work unchanged.
    An operator may also have ``attach(progress)`` (called before ``tasks``, to
    resume) and ``close()`` (called when the driver closes).

    Attributes:
        stream: the stream it feeds.
        name: the task's source name (``Task.source``).
        open_ended: plans windows without end (readiness decides when to stop).
    """

    stream: str
    name: str
    open_ended: bool

    def tasks(self) -> Iterator[Task]:
        """Every window in time order; lazy (open-ended sources never stop)."""
        ...

    def check_ready(self, task: Task) -> Readiness:
        """Whether ``task`` can be read now; never blocks."""
        ...

    def splits(self, task: Task) -> list[Split]:
        """The splits of a ready task, in read order."""
        ...

    def prepare(self, task: Task) -> object:
        """Per-task state every split of it needs (a join index); ``None`` if none.
        Runs once per task, ahead of its splits."""
        ...

    def read(
        self, split: Split, columns: Sequence[str], context: object, block_size_bytes: int
    ) -> Iterator[RawChunk]:
        """The split's rows in row order, ``columns`` (plus what the operator adds,
        e.g. a join's label) in each chunk; ``line_numbers`` are row numbers."""
        ...
