"""``GuardedConnector``: a reader never hands out a message at or before where
it was opened, nor one out of order.

Exactly once rests on one promise of every connector: opened ``after:X``, it
returns only messages after ``X``, in stream order. A broker that breaks it (a
consumer rebuilt from a stale view, a rewritten stream), or a resume that
opened at the wrong offset, would otherwise train rows again without a word.
The guard wraps any connector and turns such a message into a ``StreamError``
that names the source, the offset the reader was opened after and the offset
it got, before anything is trained from it.

Offsets are compared with the backend's ``offset_key``, never as text.
"""

from __future__ import annotations

from estuary.config.streams import StartPosition
from estuary.data.streams.types import (
    Offset,
    StreamBackend,
    StreamConnector,
    StreamError,
    StreamMessage,
)

__all__ = ["GuardedConnector"]


class GuardedConnector:
    """``connector`` with its offsets checked (a ``StreamConnector`` itself).

    Args:
        connector: the unopened connector to wrap.
        backend: its backend (``offset_key`` orders offsets).
        source: the source's name, for errors (``'clicks'``).
        opened_as: what the ``after:`` offset is, for errors (``the committed
            offset`` for a resumed reader, ``the split's start`` for a re-read).
    """

    def __init__(
        self,
        connector: StreamConnector,
        backend: StreamBackend,
        *,
        source: str,
        opened_as: str = "the committed offset",
    ) -> None:
        self.inner = connector
        self.kind = connector.kind
        self.backend = backend
        self.source = source
        self.opened_as = opened_as
        self._start: Offset | None = None  # the offset opened after (None: earliest, ...)
        self._last: Offset | None = None  # the last offset handed out, or the start
        self._last_key: tuple[int, ...] | None = None

    def __repr__(self) -> str:
        return f"GuardedConnector({self.inner!r})"

    def open(self, start: StartPosition) -> None:
        self.inner.open(start)
        self._last = self.inner.position()  # the offset just before the first message
        if start.kind == "after":
            assert start.offset is not None
            self._start = start.offset
        if self._start is not None and self._key(self._last) != self._key(self._start):
            position = self._last
            self.inner.close()
            raise StreamError(
                f"source {self.source!r}: opened after:{self._start} ({self.opened_as}), "
                f"the {self.kind} reader stands at offset {position} instead"
            )
        self._last_key = self._key(self._last)

    def read(self, max_messages: int, timeout_s: float) -> list[StreamMessage]:
        messages = self.inner.read(max_messages, timeout_s)
        for message in messages:
            key = self._key(message.offset)
            if self._last_key is not None and key <= self._last_key:
                raise StreamError(self._refusal(message.offset))
            self._last, self._last_key = message.offset, key
        return messages

    def position(self) -> Offset:
        return self.inner.position()

    def commit(self, position: Offset) -> None:
        self.inner.commit(position)

    def committed(self) -> Offset | None:
        return self.inner.committed()

    def close(self) -> None:
        self.inner.close()

    def _key(self, offset: Offset) -> tuple[int, ...]:
        try:
            return self.backend.offset_key(offset)
        except ValueError as e:
            what = f"source {self.source!r}: {self.kind} offset {offset!r}"
            raise StreamError(f"{what}: {e}") from None

    def _refusal(self, got: Offset) -> str:
        if self._start is not None and self._key(got) <= self._key(self._start):
            return (
                f"source {self.source!r}: the {self.kind} reader was opened after:{self._start} "
                f"({self.opened_as}) but handed out offset {got}, at or before it: refusing "
                "to train a message again"
            )
        return (
            f"source {self.source!r}: the {self.kind} reader handed out offset {got} after "
            f"offset {self._last}: out of stream order, refusing it"
        )
