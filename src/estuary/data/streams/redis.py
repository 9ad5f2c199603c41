"""``redis``: Redis Streams, through redis-py (``pip install 'estuary[streams]'``).

Offsets are **entry ids** (``"1700000000000-0"``: milliseconds, sequence).
Reading is ``XREAD COUNT n BLOCK ms STREAMS key <position>``, which returns the
entries after our position; no consumer group, so the broker keeps no
progress for us. A lost connection is retried with the same position (redis-py
reconnects on the next command), so a restart loses and repeats nothing as long
as the server kept its data (AOF or RDB). Each entry's row is the value of one
field (``payload_field``, default ``data``).
"""

from __future__ import annotations

import re
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis
import redis.exceptions
from redis.backoff import NoBackoff
from redis.retry import Retry

from estuary.config.streams import RedisSection, StartPosition, StreamSourceSpec
from estuary.data.errors import DataWarning
from estuary.data.streams._retry import Outage
from estuary.data.streams.types import Offset, StreamError, StreamMessage

__all__ = ["BACKEND", "DEFAULT_PAYLOAD_FIELD", "RedisBackend", "RedisConnector", "RedisPublisher"]

T = TypeVar("T")

DEFAULT_PAYLOAD_FIELD = "data"
_CONNECT_TIMEOUT_S = 10.0  # opening waits at most this (and reconnect_timeout_s)
_SOCKET_TIMEOUT_S = 30.0  # a server that answers nothing this long is treated as lost
_MAX_BLOCK_S = 25.0  # one XREAD never blocks longer (it must end before the socket timeout)
_ID = re.compile(r"^(\d+)-(\d+)$")
_START = "0-0"  # before every entry (the smallest real id is 0-1)
_LOST = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


def _parse_offset(value: Offset) -> str:
    match = _ID.match(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"expected a Redis stream entry id like '1700000000000-0', got {value!r}")
    return value  # type: ignore[return-value]


def _key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq)


def _text(value: Any) -> str | None:
    """An id from a redis-py reply (bytes or str), None for none."""
    if value is None:
        return None
    text = value.decode() if isinstance(value, bytes) else str(value)
    return text if _ID.match(text) else None


def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=2,
        socket_timeout=_SOCKET_TIMEOUT_S,
        retry=Retry(NoBackoff(), 0),  # we retry ourselves, from our own position
    )


class RedisConnector:
    """Reads one Redis stream key (see ``StreamConnector``)."""

    kind = "redis"

    def __init__(self, spec: StreamSourceSpec) -> None:
        section: RedisSection = spec.section
        self.spec = spec
        self.key = section.key
        self.field = (section.payload_field or DEFAULT_PAYLOAD_FIELD).encode()
        self.what = f"redis {spec.url} key {section.key!r}"
        self._client: redis.Redis | None = None
        self._cursor = _START  # id of the last entry returned
        self._min_ms: int | None = None  # timestamp start: skip older entries
        self._committed: str | None = None
        self._outage = Outage(self.what, spec.reconnect_timeout_s)

    def open(self, start: StartPosition) -> None:
        if self._client is not None:
            raise StreamError(f"{self.what}: already open")
        self._client = _client(self.spec.url)
        first = Outage(self.what, min(self.spec.reconnect_timeout_s, _CONNECT_TIMEOUT_S))
        try:
            self._cursor = self._retry(lambda: self._resolve(start), first)
        except redis.exceptions.ResponseError as e:  # e.g. WRONGTYPE: the key is no stream
            self.close()
            raise StreamError(f"{self.what}: cannot open: {e}") from e
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def read(self, max_messages: int, timeout_s: float) -> list[StreamMessage]:
        if max_messages < 1:
            raise ValueError(f"max_messages must be >= 1, got {max_messages}")
        client = self._require_open()
        deadline = time.monotonic() + timeout_s
        while self._outage.pause(deadline):  # False: still down at the deadline
            block_s = min(max(deadline - time.monotonic(), 0.0), _MAX_BLOCK_S)
            try:
                # BLOCK 0 would mean "forever": a zero wait is a plain (non-blocking) XREAD.
                reply = client.xread(
                    {self.key: self._cursor},
                    count=max_messages,
                    block=int(block_s * 1000) or None,
                )
            except _LOST as e:
                self._outage.failed(e)  # raises once down too long
                continue
            except redis.exceptions.ResponseError as e:
                raise StreamError(f"{self.what}: {e}") from e
            self._outage.ok()
            return self._accept(reply)
        return []

    def position(self) -> Offset:
        return self._cursor

    def commit(self, position: Offset) -> None:
        offset = self._offset(position)
        if _key(offset) > _key(self._cursor):
            raise StreamError(
                f"{self.what}: cannot commit offset {offset}: read up to {self._cursor}"
            )
        self._committed = offset

    def committed(self) -> Offset | None:
        return self._committed

    # -- internals ---------------------------------------------------------------------

    def _accept(self, reply: Any) -> list[StreamMessage]:
        out = []
        for _, entries in reply or ():
            for raw_id, fields in entries:
                entry_id = raw_id.decode()
                ms = _key(entry_id)[0]
                self._cursor = entry_id  # our position: moves only with what we hand out
                if self._min_ms is not None:
                    if ms < self._min_ms:
                        continue  # before the requested start time
                    self._min_ms = None  # ids only grow: no older entry can follow
                payload = fields.get(self.field)
                if payload is None:
                    names = ", ".join(sorted(f.decode("utf-8", "replace") for f in fields))
                    problem = f"entry has no {self.field.decode()!r} field (fields: {names})"
                    out.append(StreamMessage(entry_id, b"", ms, problem=problem))
                else:
                    out.append(StreamMessage(entry_id, payload, ms))
        return out

    def _resolve(self, start: StartPosition) -> str:
        """The position just before ``start``."""
        client = self._require_open()
        client.ping()  # fail here, not at the first read, when the server is unreachable
        if start.kind == "earliest":
            return _START
        if start.kind == "latest":
            last: Any = client.xrevrange(self.key, "+", "-", count=1)
            return str(last[0][0].decode()) if last else _START
        if start.kind == "timestamp":
            assert start.timestamp_ms is not None
            if start.timestamp_ms <= 0:
                return _START
            self._min_ms = start.timestamp_ms  # also filters entries added later
            before: Any = client.xrevrange(self.key, f"({start.timestamp_ms}-0", "-", count=1)
            return str(before[0][0].decode()) if before else _START
        assert start.offset is not None
        offset = self._offset(start.offset)
        self._warn_if_deleted(offset)
        return offset

    def _warn_if_deleted(self, offset: str) -> None:
        """Warn about entries after ``offset`` that were removed before we read them:
        deleted (``XDEL`` records the highest id) or trimmed (``XTRIM``/``MAXLEN``
        leave no record, but then ``offset`` itself is gone too)."""
        client = self._require_open()
        try:
            info: Any = client.xinfo_stream(self.key)
        except redis.exceptions.ResponseError:
            return  # no such key yet
        deleted = _text(info.get("max-deleted-entry-id"))
        first = info.get("first-entry")
        first_id = _text(first[0]) if first else None
        if deleted and _key(deleted) > _key(offset):
            lost = f"entries after {offset} (up to {deleted}) were deleted"
        elif (
            first_id is not None
            and offset != _START
            and _key(first_id) > _key(offset)
            and not client.xrange(self.key, offset, offset)
        ):
            lost = f"the stream was trimmed past {offset}: entries before {first_id}, if any,"
        else:
            return
        warnings.warn(f"{self.what}: {lost} before they were read", DataWarning, stacklevel=2)

    def _retry(self, call: Callable[[], T], outage: Outage) -> T:
        while True:
            try:
                return call()
            except _LOST as e:
                outage.failed(e)  # raises once down too long
                time.sleep(outage.wait_s())  # blocks: backoff before the next try

    def _offset(self, value: Offset) -> str:
        try:
            return _parse_offset(value)
        except ValueError as e:
            raise StreamError(f"{self.what}: {e}") from None

    def _require_open(self) -> redis.Redis:
        if self._client is None:
            raise StreamError(f"{self.what}: not open")
        return self._client


class RedisPublisher:
    """Appends to one stream key with ``XADD`` (server-made ids), one pipeline
    per batch."""

    def __init__(self, url: str, key: str, field: str = DEFAULT_PAYLOAD_FIELD) -> None:
        self.key = key
        self.field = field
        self.what = f"redis {url} key {key!r}"
        self._client = _client(url)

    def publish(self, payloads: Sequence[bytes]) -> list[Offset]:
        pipe = self._client.pipeline(transaction=False)
        for payload in payloads:
            pipe.xadd(self.key, {self.field: payload})
        try:
            ids = pipe.execute()  # blocks for one round trip
        except (*_LOST, redis.exceptions.ResponseError) as e:
            raise StreamError(f"{self.what}: publish failed: {e}") from e
        return [i.decode() for i in ids]

    def close(self) -> None:
        self._client.close()


class RedisBackend:
    """``kind: redis``."""

    name = "redis"

    def connector(self, spec: StreamSourceSpec) -> RedisConnector:
        return RedisConnector(spec)

    def publisher(self, url: str, target: str) -> RedisPublisher:
        return RedisPublisher(url, target)

    def parse_offset(self, value: Offset) -> Offset:
        return _parse_offset(value)

    def offset_key(self, value: Offset) -> tuple[int, ...]:
        return _key(_parse_offset(value))


BACKEND = RedisBackend()
