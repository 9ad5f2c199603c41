"""``Joiner``: label one source's rows by whether another's event follows them.

Impressions joined with clicks (``data.dataset.streams.<s>.join``)::

    impressions window [13:00, 14:00)        clicks windows [13:00, 14:00 + wait_s)
    key=r1 t=13:05  -> label 1  <----------  key=r1 t=13:20   (13:20 - 13:05 <= wait_s)
    key=r2 t=13:50  -> label 0               key=r2 t=13:40   (before the impression)
    key=r3 t=13:59  -> label 0               key=r3 t=15:30   (later than wait_s)

A left window waits until every right partition overlapping ``[start, end +
wait_s)`` is ready (late events get ``wait_s`` to arrive); right windows outside
the right source's configured range are not waited for. The right partitions are
parsed once (key hash, time) and kept for the next windows that need them.
Left rows whose time is missing or not an integer are bad rows (they name the
time column); the label goes into ``data.schema.label`` and is then decoded like
any label, so ids equal ``TabularDataset``'s.

Either side may be a live stream (``type: stream``). A left stream gives the
tasks and splits of a ``StreamSource`` (windows of broker time, offset-range
splits); a right stream is read by ``StreamEvents`` (``join_events.py``): a left
window ``[s, e)`` takes the right messages stored in ``[s, e + wait_s)`` and is
ready once those are all read. Both sides' offsets go into ``Progress`` with the
left window, so a resumed run neither repeats nor loses a left row and labels
the rest from the same right events.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import numpy as np
import pyarrow as pa

from estuary.config.dataset import JoinSpec
from estuary.data.badrows import BadRow
from estuary.data.formats import RawChunk
from estuary.data.graph.join_events import EventIndex, StreamEvents, event_times, key_hashes
from estuary.data.graph.progress import Progress
from estuary.data.graph.sources import FileSource
from estuary.data.graph.streams import StreamSource
from estuary.data.graph.types import Readiness, Split, Task
from estuary.data.types import Int64Array

__all__ = ["EventIndex", "Joiner", "label_within"]

JoinSide = FileSource | StreamSource
"""A join's source: time-partitioned files or a live broker stream."""


def label_within(keys: Int64Array, times: Int64Array, events: EventIndex, wait: int) -> np.ndarray:
    """bool (L,): whether an event with the same key has a time in ``[t, t + wait]``.

    One sort of queries and events together by (key, time, queries before events
    at equal times), then each query's next event in that order: O((L + E) log).
    """
    n_left, n_right = keys.shape[0], events.keys.shape[0]
    if n_left == 0 or n_right == 0:
        return np.zeros(n_left, dtype=bool)
    all_keys = np.concatenate([events.keys, keys])
    all_times = np.concatenate([events.times, times])
    is_event = np.concatenate([np.ones(n_right, np.int8), np.zeros(n_left, np.int8)])
    order = np.lexsort((is_event, all_times, all_keys))  # last key sorts first
    n = order.shape[0]
    event_pos = np.where(is_event[order] == 1, np.arange(n), n)
    next_event = np.minimum.accumulate(event_pos[::-1])[::-1]  # (n,) next event at or after
    query_pos = np.flatnonzero(is_event[order] == 0)  # sorted positions of queries
    nxt = next_event[query_pos]
    found = nxt < n
    hit = np.zeros(query_pos.shape[0], dtype=bool)
    q = order[query_pos[found]]
    e = order[nxt[found]]
    hit[found] = (all_keys[e] == all_keys[q]) & (all_times[e] - all_times[q] <= wait)
    out = np.zeros(n_left, dtype=bool)
    out[order[query_pos] - n_right] = hit
    return out


class Joiner:
    """A joined stream's operator: the left source's tasks and splits, each row
    labelled from the right source (see module docstring).

    Args:
        spec: the stream's ``join`` section.
        left: the source whose rows are trained (files or a stream).
        right: the source of events (files or a stream).
        label: ``data.schema.label``: the column the label is written to.
        where: config path of the join, for errors.
    """

    def __init__(
        self, spec: JoinSpec, left: JoinSide, right: JoinSide, label: str, where: str
    ) -> None:
        self.spec = spec
        self.left = left
        self.right = right
        self.label = label
        self.where = where
        self.stream = left.stream
        self.name = left.name
        self.open_ended = left.open_ended
        self.unit_per_s = 1000 if spec.time_unit == "ms" else 1
        self.wait = round(spec.wait_s * self.unit_per_s)  # in time_unit
        self.right_events = StreamEvents(right, spec) if isinstance(right, StreamSource) else None
        self._progress: Progress | None = None
        self._cache_size = 0
        if isinstance(right, FileSource):
            # Right windows a left window needs, +2 for the overlap with the next one.
            left_step = left.step_s if isinstance(left, FileSource) else left.window_s
            self._cache_size = math.ceil((left_step + spec.wait_s) / right.step_s) + 2
        self._cache: OrderedDict[Task, EventIndex] = OrderedDict()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Joiner({self.left!r} x {self.right!r})"

    def __getstate__(self) -> dict[str, object]:  # process executors: no lock, no cache
        state = dict(self.__dict__)
        state["_lock"] = None
        state["_cache"] = OrderedDict()
        state["_progress"] = None
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def attach(self, progress: Progress) -> None:
        """Resume both sides from ``progress`` (stream sides only; call before ``tasks``)."""
        self._progress = progress
        if isinstance(self.left, StreamSource):
            self.left.attach(progress)
        if self.right_events is not None:
            self.right_events.attach(progress)

    def close(self) -> None:
        """Release the stream connections (idempotent)."""
        if isinstance(self.left, StreamSource):
            self.left.close()
        if self.right_events is not None:
            self.right_events.close()

    def tasks(self) -> Iterator[Task]:
        return self.left.tasks()

    def right_tasks(self, task: Task) -> list[Task]:
        """Right windows overlapping ``[task.start_s, task.end_s + wait_s)``, within the
        right source's configured range (a right stream has none: ``[]``)."""
        right = self.right
        if not isinstance(right, FileSource):
            return []
        step = right.step_s
        lo = max(right.start_s, right.start_s + (task.start_s - right.start_s) // step * step)
        hi = task.end_s + math.ceil(self.spec.wait_s)  # exclusive
        if right.stop_s is not None:
            hi = min(hi, right.stop_s)
        return [
            Task(s, right.rank, right.stream, right.name, s + step) for s in range(lo, hi, step)
        ]

    def check_ready(self, task: Task) -> Readiness:
        left = self.left.check_ready(task)
        if not left.ready:
            return left
        if self.right_events is not None:
            return self.right_events.check_ready(task)
        assert isinstance(self.right, FileSource)
        for needed in self.right_tasks(task):
            ready = self.right.check_ready(needed)
            if not ready.ready:
                return Readiness(False, f"{ready.waiting_for} (events for {task.id})")
        return Readiness(True)

    def splits(self, task: Task) -> list[Split]:
        splits = self.left.splits(task)
        events = self.right_events
        if events is not None and self._progress is not None:
            # The right stream may resume after this once the window is committed.
            position = events.position_before(task.end_s * 1000)
            if position is not None:
                self._progress.set_task_offset(task, position, source=events.name)
        return splits

    def prepare(self, task: Task) -> EventIndex:
        """The right events a left window can match (parsed once per right window)."""
        if self.right_events is not None:
            return self.right_events.events(task)
        return EventIndex.concat([self._events(t) for t in self.right_tasks(task)])

    def read(
        self, split: Split, columns: Sequence[str], context: object, block_size_bytes: int
    ) -> Iterator[RawChunk]:
        assert isinstance(context, EventIndex), "prepare() gives a read its events"
        spec = self.spec
        wanted = [c for c in columns if c != self.label]
        read_columns = list(dict.fromkeys([*wanted, spec.key, spec.time_column]))
        for raw in self.left.read(split, read_columns, None, block_size_bytes):
            yield self._label(raw, context, wanted)

    # -- internals ------------------------------------------------------------------

    def _events(self, task: Task) -> EventIndex:
        assert isinstance(self.right, FileSource)
        with self._lock:
            cached = self._cache.get(task)
            if cached is not None:
                self._cache.move_to_end(task)
                return cached
        columns = [self.spec.key, self.spec.time_column]
        parts = []
        for split in self.right.splits(task):
            for raw in self.right.read(split, columns, None, 2 << 20):
                times, ok = event_times(raw.columns[self.spec.time_column])
                keys = key_hashes(raw.columns[self.spec.key])
                parts.append(EventIndex(keys[ok], times[ok]))
        index = EventIndex.concat(parts)
        with self._lock:
            self._cache[task] = index
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return index

    def _label(self, raw: RawChunk, events: EventIndex, wanted: list[str]) -> RawChunk:
        spec = self.spec
        times, ok = event_times(raw.columns[spec.time_column])
        keys = key_hashes(raw.columns[spec.key])
        hit = label_within(keys[ok], times[ok], events, self.wait)
        labels = np.full(raw.num_rows, b"0", dtype=object)
        labels[np.flatnonzero(ok)[hit]] = b"1"
        columns = {c: raw.columns[c] for c in wanted}
        columns[self.label] = pa.array(labels, type=pa.binary())
        if ok.all():
            return RawChunk(raw.file, columns, raw.line_numbers, raw.invalid)
        # Rows without a usable time are bad rows, reported like a reader's.
        bad = np.flatnonzero(~ok)
        texts = raw.columns[spec.time_column].take(pa.array(bad)).to_pylist()
        invalid = raw.invalid + [
            BadRow(
                raw.file,
                int(raw.line_numbers[i]),
                f"field {spec.time_column}: {_show(v)} "
                f"is not a whole number of {spec.time_unit} (needed to join)",
            )
            for i, v in zip(bad, texts, strict=True)
        ]
        invalid.sort(key=lambda b: b.line)
        keep = pa.array(ok)
        return RawChunk(
            raw.file,
            {c: a.filter(keep) for c, a in columns.items()},
            raw.line_numbers[ok],
            invalid,
        )


def _show(value: object) -> str:
    if value is None or value == b"" or value == "":
        return "(missing)"
    text = value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else str(value)
    return repr(text[:40])
