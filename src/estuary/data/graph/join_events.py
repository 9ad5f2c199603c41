"""A join's right-side events: ``EventIndex`` (key hashes and event times) and
``StreamEvents``, a live broker stream as the right side of a join.

A right **stream** has no partitions to wait for; it is cut by broker time (the
time the broker stored a message, as for a ``type: stream`` source's windows)::

    left window [s, e)      right messages stored in [s, e + wait_s)
    ready once              a right message stored at or after e + wait_s was read,
                            or the clock passed e + wait_s and every waiting
                            message was read (one stored later cannot fall before it)

Messages are read in offset order and kept (key hash, event time, broker time)
until the left windows no longer need them: preparing window ``[s, e)`` drops
the messages before the first one stored at or after ``s`` (windows are
prepared in time order).

Exactly once across a restart: for each left window the joiner records
``position_before(e)`` (the offset just before the first message stored at or
after ``e``) as the right source's offset in ``Progress``; when the watermark
passes the window it becomes the right source's committed position, stored in
the checkpoint with the left side's progress. A resumed run reads the right
stream after it, so every window not yet committed sees the same events (and
gives the same labels) as before the crash. Broker times must not decrease
along the stream (true of JetStream and of Redis entry ids).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from estuary.config.dataset import JoinSpec
from estuary.config.streams import Offset, StartPosition
from estuary.data.dense import OK, parse_numbers
from estuary.data.graph.types import Readiness, Task
from estuary.data.hashing import hash_array
from estuary.data.streams import MessageParser, StreamConnector
from estuary.data.streams.guard import GuardedConnector
from estuary.data.types import Int64Array

if TYPE_CHECKING:
    from estuary.data.graph.progress import Progress
    from estuary.data.graph.streams import StreamSource

__all__ = ["EventIndex", "StreamEvents", "event_times", "key_hashes"]

_KEY_SEED = 0x6A6F696E  # any fixed seed: keys are compared, never trained


@dataclass(frozen=True)
class EventIndex:
    """Right-side events of one left window: key hashes and times (in ``time_unit``).

    Args:
        keys: int64 (E,).
        times: int64 (E,).
    """

    keys: Int64Array
    times: Int64Array

    @classmethod
    def concat(cls, parts: Sequence[EventIndex]) -> EventIndex:
        if not parts:
            return cls(np.zeros(0, np.int64), np.zeros(0, np.int64))
        return cls(
            np.concatenate([p.keys for p in parts]), np.concatenate([p.times for p in parts])
        )


def key_hashes(column: pa.Array) -> Int64Array:
    """int64 (R,): join keys hashed (compared as text)."""
    return hash_array(column, _KEY_SEED)


def event_times(column: pa.Array) -> tuple[Int64Array, np.ndarray]:
    """int64 (R,) times and bool (R,) whether each is a whole number."""
    values, codes = parse_numbers(column)
    ok = (codes == OK) & (np.floor(values) == values) & (np.abs(values) < 2.0**62)
    return np.where(ok, values, 0).astype(np.int64), ok


class StreamEvents:
    """A ``type: stream`` source as a join's right side (see module docstring).
    Used from one thread (the driver's dispatcher).

    Args:
        source: the right source (its broker spec, backend and names).
        spec: the join section.
        clock: wall-clock seconds since 1970 (tests pass a fake).
    """

    def __init__(
        self, source: StreamSource, spec: JoinSpec, clock: Callable[[], float] = time.time
    ) -> None:
        self.source = source
        self.spec = spec
        self.clock = clock
        self.wait_ms = math.ceil(spec.wait_s * 1000)
        self._parser = MessageParser(
            source.source.format,
            [spec.key, spec.time_column],
            source.source.columns,
            source=source.source.display_name,
            where=f"{source.where}.stream",
        )
        self._connector: StreamConnector | None = None
        self._resume: Offset | None = None  # committed position from a checkpoint
        self._dropped: Offset | None = None  # the last message dropped (or the start)
        # One entry per message kept, in offset order.
        self._offsets: list[Offset] = []
        self._stamps: Int64Array = np.zeros(0, np.int64)  # broker time, ms
        self._keys: Int64Array = np.zeros(0, np.int64)
        self._times: Int64Array = np.zeros(0, np.int64)  # event time, time_unit
        self._ok = np.zeros(0, dtype=bool)  # a usable key and time
        self._newest_ms = -1  # latest broker time read

    def __getstate__(self) -> dict[str, Any]:  # process executors never read events
        state = dict(self.__dict__)
        state.update(_connector=None, _parser=None)
        return state

    @property
    def name(self) -> str:
        return self.source.name

    def attach(self, progress: Progress) -> None:
        """Resume after the right source's committed position (call before reading)."""
        committed = progress.stream_position(self.source.stream, self.source.name)
        if committed is not None:
            self._resume = self.source.backend.parse_offset(committed[0])

    # -- readiness and events -----------------------------------------------------------

    def check_ready(self, task: Task) -> Readiness:
        """Ready once the events up to ``task.end_s + wait_s`` are all read."""
        limit_ms = task.end_s * 1000 + self.wait_ms
        now_ms = self.clock() * 1000  # before reading: a message stored later is later
        self._fill(limit_ms)
        if self._newest_ms >= limit_ms or now_ms >= limit_ms:
            return Readiness(True)
        return Readiness(
            False,
            f"{self.source.source.kind} {self.source.target!r} events up to "
            f"{limit_ms / 1000:.0f} s (events for {task.id})",
            until_s=limit_ms / 1000,
        )

    def events(self, task: Task) -> EventIndex:
        """The events of left window ``task``: messages stored in ``[start, end + wait)``."""
        start_ms = task.start_s * 1000
        self._drop_before(start_ms)
        stamps = self._stamps
        take = self._ok & (stamps >= start_ms) & (stamps < task.end_s * 1000 + self.wait_ms)
        return EventIndex(self._keys[take], self._times[take])

    def position_before(self, stamp_ms: int) -> Offset | None:
        """The offset just before the first message kept stored at or after ``stamp_ms``
        (the last one read when there is none); ``None`` before the stream is open."""
        later = np.flatnonzero(self._stamps >= stamp_ms)
        if later.shape[0] == 0:
            return self._offsets[-1] if self._offsets else self._dropped
        first = int(later[0])
        return self._offsets[first - 1] if first else self._dropped

    def close(self) -> None:
        connector, self._connector = self._connector, None
        if connector is not None:
            connector.close()

    # -- internals ------------------------------------------------------------------

    def _open(self) -> StreamConnector:
        if self._connector is None:
            spec = self.source.source
            backend = self.source.backend
            connector = GuardedConnector(backend.connector(spec), backend, source=spec.display_name)
            resume = self._resume
            connector.open(spec.start_position if resume is None else StartPosition.after(resume))
            self._dropped = connector.position()
            self._connector = connector
        return self._connector

    def _fill(self, limit_ms: int) -> None:
        """Read waiting messages (without waiting) until none is left or one is
        stored at or after ``limit_ms``."""
        connector = self._open()
        size = self.source.source.batch_max_messages
        while self._newest_ms < limit_ms:
            messages = connector.read(size, 0.0)
            if not messages:
                return
            chunk = self._parser.parse(messages, messages[-1].offset)
            raw = chunk.raw
            n = len(messages)
            keys = np.zeros(n, np.int64)
            times = np.zeros(n, np.int64)
            ok = np.zeros(n, dtype=bool)
            good = raw.line_numbers - 1  # message numbers of the parsed rows, 0-based
            if good.shape[0]:
                got, usable = event_times(raw.columns[self.spec.time_column])
                keys[good] = key_hashes(raw.columns[self.spec.key])
                times[good] = got
                ok[good] = usable
            stamps = chunk.timestamps_ms
            self._offsets += [m.offset for m in messages]
            self._stamps = np.concatenate([self._stamps, stamps])
            self._keys = np.concatenate([self._keys, keys])
            self._times = np.concatenate([self._times, times])
            self._ok = np.concatenate([self._ok, ok])
            self._newest_ms = max(self._newest_ms, int(stamps.max()))

    def _drop_before(self, stamp_ms: int) -> None:
        """Forget the messages before the first one stored at or after ``stamp_ms``."""
        later = np.flatnonzero(self._stamps >= stamp_ms)
        cut = int(later[0]) if later.shape[0] else len(self._offsets)
        if cut == 0:
            return
        self._dropped = self._offsets[cut - 1]
        del self._offsets[:cut]
        self._stamps = self._stamps[cut:]
        self._keys = self._keys[cut:]
        self._times = self._times[cut:]
        self._ok = self._ok[cut:]
