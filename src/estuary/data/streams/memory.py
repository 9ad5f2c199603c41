"""``memory``: an in-process broker, the reference backend.

Streams live in this process, keyed by ``(url host, key)``; offsets are ints
from 1, like JetStream sequences. For tests and examples that need no server;
it passes the same conformance suite as the real brokers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from estuary.config.streams import MemorySection, StartPosition, StreamSourceSpec
from estuary.data.streams.types import Offset, StreamError, StreamMessage

__all__ = ["BACKEND", "MemoryBackend", "MemoryConnector", "MemoryPublisher", "memory_stream"]


@dataclass
class MemoryStream:
    """One in-process stream: entries ``(offset, payload, timestamp_ms)``, in order."""

    entries: list[tuple[int, bytes, int]] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)

    def append(self, payloads: Sequence[bytes], timestamp_ms: int | None = None) -> list[int]:
        stamp = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
        with self.changed:
            first = self.entries[-1][0] + 1 if self.entries else 1
            offsets = list(range(first, first + len(payloads)))
            self.entries.extend(
                (o, bytes(p), stamp) for o, p in zip(offsets, payloads, strict=True)
            )
            self.changed.notify_all()
        return offsets

    def last_offset(self) -> int:
        with self.changed:
            return self.entries[-1][0] if self.entries else 0


_STREAMS: dict[tuple[str, str], MemoryStream] = {}
_STREAMS_LOCK = threading.Lock()


def memory_stream(url: str, key: str) -> MemoryStream:
    """The stream ``key`` of the broker named by ``url``'s host (created empty)."""
    with _STREAMS_LOCK:
        return _STREAMS.setdefault((urlsplit(url).netloc, key), MemoryStream())


def _parse_offset(value: Offset) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"expected a sequence number, got {value!r}")
    number = int(value) if isinstance(value, int) or value.isdigit() else -1
    if number < 0:
        raise ValueError(f"expected a sequence number >= 0, got {value!r}")
    return number


class MemoryConnector:
    """Reads one in-process stream (see ``StreamConnector``)."""

    kind = "memory"

    def __init__(self, spec: StreamSourceSpec) -> None:
        section: MemorySection = spec.section  # or a subclass's, a plugin's
        self.spec = spec
        self.key: str = section.key
        self._stream: MemoryStream | None = None
        self._cursor = 0  # offset of the last message returned
        self._committed: int | None = None

    def open(self, start: StartPosition) -> None:
        self._stream = stream = memory_stream(self.spec.url, self.key)
        with stream.changed:
            if start.kind == "earliest":
                self._cursor = stream.entries[0][0] - 1 if stream.entries else 0
            elif start.kind == "latest":
                self._cursor = stream.entries[-1][0] if stream.entries else 0
            elif start.kind == "timestamp":
                before = [o for o, _, t in stream.entries if t < (start.timestamp_ms or 0)]
                self._cursor = before[-1] if before else 0
            else:
                assert start.offset is not None
                self._cursor = self._offset(start.offset)

    def read(self, max_messages: int, timeout_s: float) -> list[StreamMessage]:
        stream = self._require_open()
        deadline = time.monotonic() + timeout_s
        with stream.changed:
            while True:
                # Offsets are dense from 1, so the next entry sits at index cursor.
                batch = stream.entries[self._cursor : self._cursor + max_messages]
                remaining = deadline - time.monotonic()
                if batch or remaining <= 0:
                    break
                stream.changed.wait(remaining)  # blocks until a publish or the timeout
        if batch:
            self._cursor = batch[-1][0]
        return [StreamMessage(o, p, t) for o, p, t in batch]

    def position(self) -> Offset:
        return self._cursor

    def commit(self, position: Offset) -> None:
        offset = self._offset(position)
        if offset > self._cursor:
            read = self._cursor
            raise StreamError(f"memory {self.key!r}: cannot commit {offset}: read up to {read}")
        self._committed = offset

    def committed(self) -> Offset | None:
        return self._committed

    def close(self) -> None:
        self._stream = None

    def _offset(self, value: Offset) -> int:
        try:
            return _parse_offset(value)
        except ValueError as e:
            raise StreamError(f"memory {self.key!r}: {e}") from None

    def _require_open(self) -> MemoryStream:
        if self._stream is None:
            raise StreamError(f"memory {self.key!r}: not open")
        return self._stream


class MemoryPublisher:
    """Appends to one in-process stream."""

    def __init__(self, url: str, key: str) -> None:
        self._stream = memory_stream(url, key)

    def publish(self, payloads: Sequence[bytes]) -> list[Offset]:
        return list(self._stream.append(payloads))

    def close(self) -> None:
        pass


class MemoryBackend:
    """``kind: memory``."""

    name = "memory"

    def connector(self, spec: StreamSourceSpec) -> MemoryConnector:
        return MemoryConnector(spec)

    def publisher(self, url: str, target: str) -> MemoryPublisher:
        return MemoryPublisher(url, target)

    def parse_offset(self, value: Offset) -> Offset:
        return _parse_offset(value)

    def offset_key(self, value: Offset) -> tuple[int, ...]:
        return (_parse_offset(value),)


BACKEND = MemoryBackend()
