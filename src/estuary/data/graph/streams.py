"""``StreamSource``: a live broker stream (NATS JetStream, Redis Streams) as a
source of the task graph (``type: stream``).

Tasks are windows of ``window_s`` of broker time, aligned to multiples of it and
planned from the window of the first message (or of the committed position on
resume). A task is ready once a message not yet assigned to a task is there
(an open-ended stream with no new message for ``timer.idle_timeout_s`` ends the
run). Its messages are read in offset order until the first one stored at or
after the window's end (kept for the next task) or until none is waiting: a
message that arrives late lands in a later task, never in none and never in two.

Splits are runs of up to ``stream.batch_max_messages`` messages, named by their
offset range, ``after 17 through 20 (3 messages)``; rows are numbered 1..M in
the split, so ``Progress`` accounts for them as for file rows. A split is read
again (a retry, a resumed partly trained task) by opening the broker at
``after:<first offset>`` and taking exactly M messages. Once the watermark
passes a task, its last offset becomes the source's committed position in the
progress JSON (``streams``); a resumed run opens the broker after it (or after
the last split of a task it had listed), so it neither loses nor repeats a
message.

All planning calls (``tasks``, ``check_ready``, ``splits``) run in the
driver's dispatcher thread on one connector; ``read`` opens nothing when the
messages are still held from planning.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from estuary.config.dataset import BatchSourceSpec
from estuary.config.streams import Offset, StartPosition, StreamSourceSpec
from estuary.data.formats import RawChunk
from estuary.data.graph.progress import Progress
from estuary.data.graph.types import Readiness, Split, Task
from estuary.data.streams import MessageParser, StreamConnector, StreamError, get_backend
from estuary.data.streams.guard import GuardedConnector
from estuary.data.streams.types import StreamMessage

__all__ = ["StreamSource", "parse_split_name", "split_name"]

_SPLIT_NAME = re.compile(r"^after (\S+) through (\S+) \((\d+) messages?\)$")
_REREAD_EMPTY_READS = 3  # empty reads in a row before a re-read gives up


def split_name(after: Offset, last: Offset, count: int) -> str:
    """``after 17 through 20 (3 messages)``: the messages after ``after`` up to ``last``."""
    return f"after {after} through {last} ({count} message{'s' if count != 1 else ''})"


def parse_split_name(name: str) -> tuple[str, str, int]:
    """``(after, last, count)`` of a ``split_name`` (offsets as text).

    Raises:
        ValueError: not a stream split name.
    """
    match = _SPLIT_NAME.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not a stream split name")
    return match.group(1), match.group(2), int(match.group(3))


def _offset_value(text: str) -> Offset:
    return int(text) if text.isdigit() else text


class StreamSource:
    """A ``type: stream`` source (see module docstring).

    Args:
        spec: the source section (``spec.stream`` is the broker side).
        stream: the dataset stream it belongs to.
        priority: that stream's priority.
        base_dir: the job file's folder (unused: streams have no paths).
        where: config path of the source, for errors.
        until_s: plan no window starting at or after it.
    """

    open_ended = True

    def __init__(
        self,
        spec: BatchSourceSpec,
        stream: str,
        priority: int,
        base_dir: Path,
        where: str,
        until_s: int | None = None,
    ) -> None:
        spec.validate(where)
        assert spec.stream is not None  # validate checked it
        self.spec = spec
        self.source: StreamSourceSpec = dataclasses.replace(
            spec.stream, name=spec.stream.name or spec.name
        )
        self.stream = stream
        self.name = spec.name
        self.rank = -priority
        self.where = where
        self.window_s = spec.window_s
        self.until_s = until_s
        self.backend = get_backend(self.source.kind, f"{where}.stream.kind")
        self._connector: StreamConnector | None = None
        self._after: Offset | None = None  # planning position: every message <= it is assigned
        self._buffer: list[StreamMessage] = []  # read while planning, not yet assigned
        self._first_start_s: int | None = None
        self._recorded: dict[str, list[str]] = {}  # task id -> its splits in a resumed run
        self._held: dict[tuple[str, str], list[StreamMessage]] = {}  # split -> its messages
        self._held_lock = threading.Lock()
        self._progress: Progress | None = None

    def __repr__(self) -> str:
        return f"StreamSource({self.stream}/{self.name}: {self.source.kind} {self.target})"

    def __getstate__(self) -> dict[str, Any]:  # to a worker process: read from the broker
        state = dict(self.__dict__)
        state.update(_connector=None, _buffer=[], _held={}, _held_lock=None, _progress=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._held_lock = threading.Lock()

    @property
    def target(self) -> str:
        return str(self.source.target)

    # -- resume -------------------------------------------------------------------------

    def attach(self, progress: Progress) -> None:
        """Take the resume point from ``progress`` (call before ``tasks``).

        The source resumes after the latest offset the progress knows for it: the
        committed position, or the last split of any task it holds (a listed task
        above the watermark keeps its splits and is read again from them). Split
        names are put in stream order by their offsets, never by their order in
        the checkpoint's JSON (which sorts keys as text: ``after 9216 ...`` after
        ``after 29696 ...``).
        """
        self._progress = progress
        committed = progress.stream_position(self.stream, self.name)
        after: Offset | None = None
        first: int | None = None
        if committed is not None:
            after, first = self._parse(committed[0]), committed[1]
        for task, names, done in progress.source_tasks(self.stream, self.name):
            if first is None:
                first = task.start_s
            ordered = self._in_stream_order(task, names)
            if not done:
                self._recorded[task.id] = ordered
            if ordered:
                last = self._parse(parse_split_name(ordered[-1])[1])
                if after is None or self._key(last) > self._key(after):
                    after = last
        self._after = after
        self._first_start_s = first

    def _parse(self, text: Offset) -> Offset:
        value = _offset_value(text) if isinstance(text, str) else text
        try:
            return self.backend.parse_offset(value)
        except ValueError as e:
            raise StreamError(f"{self.where}: data progress: {e}") from None

    def _key(self, offset: Offset) -> tuple[int, ...]:
        return self.backend.offset_key(offset)

    def _in_stream_order(self, task: Task, names: Sequence[str]) -> list[str]:
        """``names`` (one task's splits) sorted by their first offset; they must
        chain (each starts where the one before ended)."""
        parsed = []
        for name in names:
            after, last, _ = parse_split_name(name)
            parsed.append((self._parse(after), self._parse(last), name))
        parsed.sort(key=lambda item: self._key(item[0]))
        for (_, end, name), (start, _, later) in itertools.pairwise(parsed):
            if self._key(start) != self._key(end):
                raise StreamError(
                    f"{self.where}: data progress of {task.id}: split {later!r} does not start "
                    f"where {name!r} ends (a corrupt or edited checkpoint?)"
                )
        return [name for _, _, name in parsed]

    # -- planning (dispatcher thread) ---------------------------------------------------

    def tasks(self) -> Iterator[Task]:
        start = self._first_start_s
        if start is None:
            start = self._first_window()
        step, rank, stream, name = self.window_s, self.rank, self.stream, self.name
        starts: Iterator[int] = (
            itertools.count(start, step)
            if self.until_s is None
            else iter(range(start, self.until_s, step))
        )
        for s in starts:
            yield Task(s, rank, stream, name, s + step)

    def check_ready(self, task: Task) -> Readiness:
        if task.id in self._recorded or self._buffer or self._fill():
            return Readiness(True)
        return Readiness(False, f"{task.id}: new messages on {self.source.kind} {self.target!r}")

    def splits(self, task: Task) -> list[Split]:
        names = self._recorded.pop(task.id, None)
        if names is None:
            names = self._plan(task)
        elif names and self._progress is not None:
            self._progress.set_task_offset(task, _offset_value(parse_split_name(names[-1])[1]))
        return [Split(task, n, n, i, len(names)) for i, n in enumerate(names)]

    def prepare(self, task: Task) -> object:
        return None

    def _plan(self, task: Task) -> list[str]:
        """Assign the waiting messages stored before the window's end to ``task``."""
        end_ms = task.end_s * 1000
        messages: list[StreamMessage] = []
        while self._buffer or self._fill():
            taken = 0
            for message in self._buffer:
                if message.timestamp_ms is not None and message.timestamp_ms >= end_ms:
                    break
                taken += 1
            messages += self._buffer[:taken]
            del self._buffer[:taken]
            if self._buffer:
                break  # a message of a later window: this one is complete
        if not messages:
            return []
        names = []
        size = self.source.batch_max_messages
        after = self._position()
        for first in range(0, len(messages), size):
            chunk = messages[first : first + size]
            name = split_name(after, chunk[-1].offset, len(chunk))
            with self._held_lock:
                self._held[(task.id, name)] = chunk
            names.append(name)
            after = chunk[-1].offset
        self._after = after
        if self._progress is not None:
            self._progress.set_task_offset(task, after)
        return names

    def _open(self) -> StreamConnector:
        if self._connector is None:
            connector = self._guarded("the committed offset")
            after = self._after
            connector.open(
                self.source.start_position if after is None else StartPosition.after(after)
            )
            if self._after is None:
                self._after = connector.position()
            self._connector = connector
        return self._connector

    def _position(self) -> Offset:
        self._open()
        assert self._after is not None
        return self._after

    def _fill(self, timeout_s: float = 0.0) -> bool:
        """Read waiting messages into the buffer (without waiting by default)."""
        connector = self._open()
        self._buffer += connector.read(self.source.batch_max_messages, timeout_s)
        return bool(self._buffer)

    def _first_window(self) -> int:
        """The window of the first message (waiting up to ``poll_timeout_s``), else now's."""
        self._fill(self.source.poll_timeout_s)
        stamp = self._buffer[0].timestamp_ms if self._buffer else None
        now_s = time.time() if stamp is None else stamp / 1000
        return math.floor(now_s / self.window_s) * self.window_s

    # -- reading (worker threads) -------------------------------------------------------

    def read(
        self, split: Split, columns: Sequence[str], context: object, block_size_bytes: int
    ) -> Iterator[RawChunk]:
        after, last, count = parse_split_name(split.name)
        with self._held_lock:
            messages = self._held.pop((split.task.id, split.name), None)
        if messages is None:
            messages = self._reread(_offset_value(after), last, count, split)
        parser = MessageParser(
            self.source.format,
            columns,
            self.source.columns,
            source=self.source.display_name,
            where=f"{self.where}.stream",
        )
        yield parser.parse(messages, messages[-1].offset).raw

    def _reread(self, after: Offset, last: str, count: int, split: Split) -> list[StreamMessage]:
        """The split's ``count`` messages read again from the broker."""
        connector = self._guarded("the split's start")
        connector.open(StartPosition.after(self._parse(after)))
        messages: list[StreamMessage] = []
        try:
            empty = 0
            while len(messages) < count and empty < _REREAD_EMPTY_READS:
                got = connector.read(count - len(messages), max(self.source.poll_timeout_s, 0.1))
                empty = 0 if got else empty + 1
                messages += got
        finally:
            connector.close()
        if len(messages) != count or str(messages[-1].offset) != last:
            raise StreamError(
                f"{split.task.id}: split {split.name!r} cannot be read again from "
                f"{self.source.kind} {self.target!r}: got {len(messages)} message(s)"
                + (f" ending at {messages[-1].offset}" if messages else "")
                + " (the stream was trimmed or rewritten?)"
            )
        return messages

    def _guarded(self, opened_as: str) -> StreamConnector:
        return GuardedConnector(
            self.backend.connector(self.source),
            self.backend,
            source=self.source.display_name,
            opened_as=opened_as,
        )

    def close(self) -> None:
        """Release the planning connection (idempotent)."""
        connector, self._connector = self._connector, None
        if connector is not None:
            connector.close()
