"""``Progress``: which rows were trained, per task and split; the row accounting
that makes a resumed run neither lose nor repeat a row.

The trainer calls ``record(batch.row_ids)`` after each step; the checkpoint
stores ``to_json()`` with the model, so model and progress never disagree. A
resumed run skips committed tasks and, inside the others, every row already
trained (``trained_ranges``). Progress is kept as row-number ranges, not a
reader position, so it stays exact under shuffle buffers, interleaved splits
and prefetching: rows read but not yet trained are simply read again.

JSON layout (``version`` 1)::

    {"version": 1,
     "watermark": [start_s, rank, stream, source] | null,   # every task <= it is committed
     "rows_trained": 12345, "rows_dropped": 0, "duplicate_rows": 0,
     "bad_rows": 3, "rows_read": 15003,
     "tasks": [{"task": [start_s, rank, stream, source, end_s], "committed": false,
                "skipped": false,
                "splits": {"logs/20260101/13/part-0.tsv": {"rows": 5000 | null,
                                                           "bad": 1, "read": 5001,
                                                           "trained": [[1, 2001], ...]}}}],
     "streams": {"live/clicks": {"offset": "1700000000000-3", "next_start_s": 1700000060}}}

``streams`` holds, per stream source (``stream/source``), the last broker offset
of the newest task at or below the watermark: every message up to it was
trained, so a resumed run reads ``after:<offset>`` (tasks above the watermark
keep their own splits, named by offset ranges, in ``tasks``). A join's right
stream is there too: its offset is the last message the remaining left windows
cannot need, so a resumed run reads their events again (``joiner.py``).

``trained`` ranges are ``[first, stop)`` row numbers (rows a mixed buffer
dropped are in them too: consumed, counted in ``rows_dropped``); ``rows`` (good rows of the
split) is known once the split was read to its end. A task is committed when
every split is listed, read to its end and fully trained.

Bad rows, exactly once over restarts: ``bad`` and ``read`` (good + bad rows) are
how far each split has been read, its end or not (``split_read`` after each
block), and ``bad_rows`` / ``rows_read`` their totals over every split, kept
when old tasks are forgotten. A resumed run re-parses a split from its start, so
a split read again counts only what goes past its saved figures, and its end
sets them to its whole counts: no bad row is counted twice, none a checkpoint
held is lost, the totals go down only when a split is listed no more (its rows
are then read again under new names), and the ratio check sees the rows a
killed run had read ahead of its checkpoint as that run did.

Row ids handed to the trainer: ``(split code << 32) | row number`` (int64),
codes assigned here as splits open (``row_identity`` decodes one).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from estuary.data.graph.types import Task
from estuary.data.types import Int64Array

__all__ = ["Progress", "Ranges", "RowIdentity", "merge_ranges", "ranges_contain", "runs_of"]

Ranges = tuple[Int64Array, Int64Array]
"""Disjoint, sorted half-open ranges: starts int64 (K,), stops int64 (K,)."""

ROW_BITS = 32
_ROW_MASK = (1 << ROW_BITS) - 1
_EMPTY: Ranges = (np.zeros(0, np.int64), np.zeros(0, np.int64))


def runs_of(rows: Int64Array) -> Ranges:
    """Sorted unique row numbers -> the ranges they form."""
    if rows.shape[0] == 0:
        return _EMPTY
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = rows[np.concatenate([[0], breaks])]
    stops = rows[np.concatenate([breaks - 1, [rows.shape[0] - 1]])] + 1
    return starts.astype(np.int64), stops.astype(np.int64)


def _union(starts: Int64Array, stops: Int64Array) -> Ranges:
    """Any ranges -> disjoint, sorted ones (overlapping or adjacent ranges merge)."""
    if starts.shape[0] == 0:
        return _EMPTY
    order = np.argsort(starts, kind="stable")
    starts, stops = starts[order], stops[order]
    reach = np.maximum.accumulate(stops)
    new = np.concatenate([[True], starts[1:] > reach[:-1]])  # a gap before this range
    last = np.concatenate([new[1:], [True]])
    return starts[new], reach[last]


def merge_ranges(a: Ranges, b: Ranges) -> Ranges:
    """The union of two range sets."""
    if a[0].shape[0] == 0:
        return b
    if b[0].shape[0] == 0:
        return a
    return _union(np.concatenate([a[0], b[0]]), np.concatenate([a[1], b[1]]))


def ranges_contain(ranges: Ranges, rows: Int64Array) -> np.ndarray:
    """bool (R,): whether each row number lies in ``ranges``."""
    starts, stops = ranges
    if starts.shape[0] == 0 or rows.shape[0] == 0:
        return np.zeros(rows.shape[0], dtype=bool)
    i = np.searchsorted(starts, rows, side="right") - 1
    inside = i >= 0
    inside[inside] = rows[inside] < stops[i[inside]]
    return inside


def _count(ranges: Ranges) -> int:
    return int((ranges[1] - ranges[0]).sum())


@dataclass
class SplitRecord:
    """One split's accounting: good rows (once read to its end), how far it was
    read (bad rows, rows read), and rows trained."""

    rows: int | None = None
    trained: Ranges = _EMPTY
    bad: int = 0  # bad rows read so far (all of them once ``rows`` is known)
    read: int = 0  # rows read so far, good + bad

    @property
    def trained_rows(self) -> int:
        return _count(self.trained)

    @property
    def complete(self) -> bool:
        return self.rows is not None and self.trained_rows == self.rows


@dataclass
class TaskRecord:
    """One task's accounting. ``splits`` is ``None`` until its splits are listed."""

    task: Task
    splits: dict[str, SplitRecord] | None = None
    committed: bool = False
    skipped: bool = False


@dataclass(frozen=True)
class RowIdentity:
    """Where a trained row came from: ``(stream, source, split, row)``."""

    task: Task
    split: str
    row: int


@dataclass
class _Code:
    task_id: str
    split: str
    bad: int = 0  # this run's read of the split so far
    read: int = 0


class Progress:
    """The run's data progress (see module docstring). Thread-safe: the reader
    reports splits and the trainer reports rows from different threads.

    Args:
        history_tasks: committed tasks below the watermark kept with their split
            accounting (older ones are summarised by the watermark and counters).
    """

    def __init__(self, history_tasks: int = 100_000) -> None:
        self.history_tasks = history_tasks
        self.watermark: tuple[int, int, str, str] | None = None
        self.rows_trained = 0
        self.rows_dropped = 0  # consumed but not trained (a mixed buffer sampled them out)
        self.duplicate_rows = 0
        # bad rows and rows read (good + bad) over every split, exactly once
        self.bad_rows = 0
        self.rows_read = 0
        self.tasks: dict[str, TaskRecord] = {}  # plan order (resumed ones first)
        self._order: deque[str] = deque()  # listed this run, not yet below the watermark
        self._codes: dict[int, _Code] = {}
        self._next_code = 1
        self.stream_offsets: dict[str, dict[str, Any]] = {}  # "stream/source" -> offset, next
        # task id -> "stream/source" -> offset, recorded once the watermark passes the task
        self._task_offsets: dict[str, dict[str, Any]] = {}
        # stream -> start of the newest window a trained row came from (s since
        # 1970): the run's data lag, to the window. Not saved; the next step sets it.
        self.newest_window_s: dict[str, int] = {}
        self._lock = threading.Lock()

    # -- what to read ---------------------------------------------------------------

    def is_committed(self, task: Task) -> bool:
        """Whether every row of ``task`` was trained (planning skips it)."""
        if self.watermark is not None and task.key <= self.watermark:
            return True
        with self._lock:
            record = self.tasks.get(task.id)
            return record is not None and record.committed

    def trained_ranges(self, task: Task, split: str) -> Ranges:
        """Rows of ``split`` trained already (a resumed read skips them)."""
        with self._lock:
            record = self.tasks.get(task.id)
            if record is None or record.splits is None or split not in record.splits:
                return _EMPTY
            return record.splits[split].trained

    def stream_position(self, stream: str, source: str) -> tuple[Any, int] | None:
        """A stream source's committed ``(offset, next window start)``, if any."""
        with self._lock:
            entry = self.stream_offsets.get(f"{stream}/{source}")
            return None if entry is None else (entry["offset"], int(entry["next_start_s"]))

    def source_tasks(self, stream: str, source: str) -> list[tuple[Task, list[str], bool]]:
        """The listed tasks of one source held here, in plan order: (task, its split
        names, committed). The split names come in no particular order (a
        checkpoint's JSON sorts them as text)."""
        with self._lock:
            found = [
                (r.task, list(r.splits), r.committed)
                for r in self.tasks.values()
                if r.splits is not None and (r.task.stream, r.task.source) == (stream, source)
            ]
        return sorted(found, key=lambda item: item[0].key)

    def set_task_offset(self, task: Task, offset: Any, source: str | None = None) -> None:
        """A stream offset reached with ``task``: its own source's last offset, or
        (``source``: another source of its stream, a join's right side) the offset
        that source may resume after. Becomes that source's committed position
        once the watermark passes ``task``."""
        with self._lock:
            key = f"{task.stream}/{source or task.source}"
            self._task_offsets.setdefault(task.id, {})[key] = offset

    # -- events from the reader (in plan order) -------------------------------------

    def task_listed(self, task: Task, splits: Sequence[str], *, skipped: bool = False) -> None:
        """``task`` is being read; these are its splits (a resumed task keeps what it had)."""
        with self._lock:
            record = self.tasks.get(task.id)
            if record is None:
                record = self.tasks[task.id] = TaskRecord(task)
            record.skipped = skipped
            old = record.splits or {}
            record.splits = {name: old.get(name, SplitRecord()) for name in splits}
            for name, gone in old.items():  # renamed (e.g. files recompacted):
                if name not in record.splits:  # read again under the new names
                    self.bad_rows -= gone.bad
                    self.rows_read -= gone.read
            if task.id not in self._order:
                self._order.append(task.id)
            self._settle(record)

    def open_split(self, task: Task, split: str) -> int:
        """A code for ``split``'s row ids (``code << 32 | row``)."""
        with self._lock:
            code = self._next_code
            if code >= 1 << (63 - ROW_BITS):
                raise OverflowError("too many splits open in one run")
            self._next_code += 1
            self._codes[code] = _Code(task.id, split)
            return code

    def split_read(self, code: int, bad: int, read: int) -> None:
        """A block of the split was read: ``read`` rows (good, trained ones
        skipped included, + bad), ``bad`` of them bad. The split's figures grow
        only past what they held (a resumed run reads the split again from its
        start); nothing changes once its task committed."""
        with self._lock:
            entry = self._codes.get(code)
            if entry is None:
                return
            entry.bad += bad
            entry.read += read
            split = self._record_of(entry)
            if entry.bad > split.bad:
                self.bad_rows += entry.bad - split.bad
                split.bad = entry.bad
            if entry.read > split.read:
                self.rows_read += entry.read - split.read
                split.read = entry.read

    def split_ended(self, code: int, rows: int) -> None:
        """The split was read to its end: it has ``rows`` good rows, and the bad
        rows ``split_read`` counted in this run's read. A resumed run re-reads
        every split of an uncommitted task, complete ones too (their rows all
        skipped); when the task commits while such a split is still being read,
        its end changes nothing."""
        with self._lock:
            entry = self._codes.get(code)
            if entry is None:  # its task committed meanwhile: its figures stand
                return
            split = self._record_of(entry)
            split.rows = rows
            # the whole split's figures (a re-read of the same data: the ones held)
            self.bad_rows += entry.bad - split.bad
            self.rows_read += rows + entry.bad - split.read
            split.bad, split.read = entry.bad, rows + entry.bad
            self._settle(self.tasks[entry.task_id])

    def bad_totals(self) -> tuple[int, int]:
        """The job's ``(bad rows, rows read)`` so far, each row once over restarts."""
        with self._lock:
            return self.bad_rows, self.rows_read

    def _record_of(self, entry: _Code) -> SplitRecord:
        """An open split's record (lock held)."""
        splits = self.tasks[entry.task_id].splits
        assert splits is not None, "a split opens after its task is listed"
        return splits[entry.split]

    # -- events from the trainer ----------------------------------------------------

    def record(self, row_ids: Int64Array | None, *, dropped: bool = False) -> None:
        """These rows were trained (call after the step). Rows trained twice are
        counted in ``duplicate_rows`` (an exactly-once violation; tests assert 0).
        ``dropped``: the rows were consumed and deliberately not trained (a mixed
        buffer sampled them down or evicted them): they count in ``rows_dropped``
        instead of ``rows_trained`` and are never read again, like trained rows."""
        if row_ids is None or row_ids.shape[0] == 0:
            return
        codes = row_ids >> ROW_BITS
        order = np.argsort(row_ids, kind="stable")
        sorted_ids = row_ids[order]
        sorted_codes = codes[order]
        bounds = np.flatnonzero(np.diff(sorted_codes)) + 1
        with self._lock:
            touched: dict[str, TaskRecord] = {}
            for group in np.split(sorted_ids, bounds):
                code = int(group[0] >> ROW_BITS)
                rows = group & _ROW_MASK
                entry = self._codes.get(code)
                if entry is None:  # its task was committed already: trained again
                    self.duplicate_rows += rows.shape[0]
                    continue
                record = self.tasks[entry.task_id]
                assert record.splits is not None
                stream, start_s = record.task.stream, record.task.start_s
                if start_s > self.newest_window_s.get(stream, start_s - 1):
                    self.newest_window_s[stream] = start_s
                split = record.splits[entry.split]
                unique = np.unique(rows)
                before = split.trained_rows
                split.trained = merge_ranges(split.trained, runs_of(unique))
                added = split.trained_rows - before
                self.duplicate_rows += rows.shape[0] - added
                if dropped:
                    self.rows_dropped += added
                else:
                    self.rows_trained += added
                touched[entry.task_id] = record
            for record in touched.values():
                self._settle(record)

    def row_identity(self, row_id: int) -> RowIdentity:
        """Decode one row id (only while its split is open or its task uncommitted)."""
        entry = self._codes[int(row_id) >> ROW_BITS]
        return RowIdentity(self.tasks[entry.task_id].task, entry.split, int(row_id) & _ROW_MASK)

    def row_tasks(self, row_ids: Int64Array) -> tuple[list[Task], Int64Array]:
        """The tasks of rows ``row_ids`` int64 (B,): (the distinct tasks T, int64 (B,)
        each row's index into them). Costs a pass over the B split codes; only the
        (few) distinct ones are decoded, so the rows' tasks must be uncommitted."""
        codes = row_ids >> ROW_BITS
        first = codes[0] if codes.shape[0] else 0
        if (codes == first).all():  # the common case: one split, no sort
            distinct, inverse = [int(first)], np.zeros(codes.shape[0], np.int64)
        else:
            unique, inverse = np.unique(codes, return_inverse=True)
            distinct = unique.tolist()
        codes_tasks = [self.row_identity(code << ROW_BITS).task for code in distinct]
        tasks = list(dict.fromkeys(codes_tasks))  # splits of one task share it
        index = np.array([tasks.index(t) for t in codes_tasks], np.int64)
        return tasks, index[inverse]

    # -- bookkeeping ------------------------------------------------------------------

    def _settle(self, record: TaskRecord) -> None:
        """Commit a finished task and advance the watermark (lock held)."""
        splits = record.splits
        if not record.committed and splits is not None and all(s.complete for s in splits.values()):
            record.committed = True
            self._codes = {c: e for c, e in self._codes.items() if e.task_id != record.task.id}
        while self._order and self.tasks[self._order[0]].committed:
            head = self.tasks[self._order.popleft()]
            if self.watermark is None or head.task.key > self.watermark:
                self.watermark = head.task.key
            for key, offset in self._task_offsets.pop(head.task.id, {}).items():
                self.stream_offsets[key] = {"offset": offset, "next_start_s": head.task.end_s}
        self._prune()

    def _prune(self) -> None:
        """Forget the oldest committed tasks beyond ``history_tasks`` (lock held)."""
        while len(self.tasks) > self.history_tasks + len(self._order):
            oldest = next(iter(self.tasks.values()))
            if not (oldest.committed and self.is_below_watermark(oldest.task)):
                return
            del self.tasks[oldest.task.id]

    def is_below_watermark(self, task: Task) -> bool:
        return self.watermark is not None and task.key <= self.watermark

    @property
    def tasks_committed(self) -> int:
        """Committed tasks still held (see ``history_tasks``)."""
        with self._lock:
            return sum(r.committed for r in self.tasks.values())

    def accounting(self) -> dict[str, dict[str, list[tuple[int, int]]]]:
        """task id -> split -> trained ``[first, stop)`` ranges: the row ledger."""
        with self._lock:
            return {
                task_id: {
                    name: [(int(a), int(b)) for a, b in zip(*s.trained, strict=True)]
                    for name, s in (r.splits or {}).items()
                }
                for task_id, r in self.tasks.items()
            }

    # -- JSON ---------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """A JSON-able snapshot (see module docstring)."""
        with self._lock:
            tasks = []
            for record in self.tasks.values():
                splits = None
                if record.splits is not None:
                    splits = {
                        name: {
                            "rows": s.rows,
                            "bad": s.bad,
                            "read": s.read,
                            "trained": [[int(a), int(b)] for a, b in zip(*s.trained, strict=True)],
                        }
                        for name, s in record.splits.items()
                    }
                tasks.append(
                    {
                        "task": list(record.task),
                        "committed": record.committed,
                        "skipped": record.skipped,
                        "splits": splits,
                    }
                )
            return {
                "version": 1,
                "watermark": None if self.watermark is None else list(self.watermark),
                "rows_trained": self.rows_trained,
                "rows_dropped": self.rows_dropped,
                "duplicate_rows": self.duplicate_rows,
                "bad_rows": self.bad_rows,
                "rows_read": self.rows_read,
                "tasks": tasks,
                "streams": {key: dict(value) for key, value in self.stream_offsets.items()},
            }

    @classmethod
    def from_json(cls, data: dict[str, Any], history_tasks: int = 100_000) -> Progress:
        """Rebuild from ``to_json()`` output (split codes start afresh).

        Raises:
            ValueError: not a version-1 progress snapshot.
        """
        if not isinstance(data, dict) or data.get("version") != 1:
            raise ValueError("data progress: not a version-1 snapshot")
        progress = cls(history_tasks=history_tasks)
        mark = data.get("watermark")
        if mark is not None:
            progress.watermark = (int(mark[0]), int(mark[1]), str(mark[2]), str(mark[3]))
        progress.rows_trained = int(data.get("rows_trained", 0))
        progress.rows_dropped = int(data.get("rows_dropped", 0))
        progress.duplicate_rows = int(data.get("duplicate_rows", 0))
        for key, entry in (data.get("streams") or {}).items():
            offset = entry["offset"]
            if not isinstance(offset, int | str):
                raise ValueError(f"data progress: stream {key!r} has offset {offset!r}")
            progress.stream_offsets[str(key)] = {
                "offset": offset,
                "next_start_s": int(entry["next_start_s"]),
            }
        for item in data.get("tasks", []):
            start, rank, stream, source, end = item["task"]
            task = Task(int(start), int(rank), str(stream), str(source), int(end))
            record = TaskRecord(
                task, committed=bool(item["committed"]), skipped=bool(item.get("skipped"))
            )
            if item.get("splits") is not None:
                record.splits = {
                    name: SplitRecord(
                        rows=s["rows"],
                        trained=_ranges_from(s["trained"]),
                        bad=int(s.get("bad", 0)),
                        # without "read": an ended split was read whole
                        read=int(
                            s.get("read", 0 if s["rows"] is None else s["rows"] + s.get("bad", 0))
                        ),
                    )
                    for name, s in item["splits"].items()
                }
            progress.tasks[task.id] = record
        if "rows_read" in data:
            progress.bad_rows = int(data["bad_rows"])
            progress.rows_read = int(data["rows_read"])
        else:  # a snapshot from before bad-row figures: the ended splits' good rows
            splits = [s for r in progress.tasks.values() for s in (r.splits or {}).values()]
            progress.rows_read = sum(s.read for s in splits)
        return progress


def _ranges_from(pairs: Iterable[Sequence[int]]) -> Ranges:
    items = [(int(a), int(b)) for a, b in pairs]
    starts = np.array([a for a, _ in items], dtype=np.int64)
    stops = np.array([b for _, b in items], dtype=np.int64)
    return _union(starts, stops)
