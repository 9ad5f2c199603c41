"""The stream-connector interface, the message it returns, and stream errors.

Offsets are ours, not the broker's: a reader's ``position()`` goes into the
training checkpoint with the model, and a restart opens the stream with
``StartPosition.after(position)``. Brokers keep no consumer state for us (NATS:
an ephemeral consumer recreated from our position; Redis: plain ``XREAD``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from estuary.config.streams import Offset, StartPosition
from estuary.data.badrows import BadRow
from estuary.data.errors import DataError

if TYPE_CHECKING:
    from estuary.config.streams import StreamSourceSpec

__all__ = [
    "Offset",
    "StartPosition",
    "StreamBackend",
    "StreamBadRow",
    "StreamConnector",
    "StreamError",
    "StreamMessage",
    "StreamPublisher",
]


class StreamError(DataError):
    """A stream cannot be read or written (server gone for longer than
    ``reconnect_timeout_s``, stream or subject missing, bad offset); the message
    names the source and the server."""


@dataclass(frozen=True)
class StreamMessage:
    """One message: one row's payload and where it sits in the stream.

    Args:
        offset: its place in the stream (JetStream stream sequence, Redis entry
            id); strictly increasing within one reader.
        payload: the row's bytes in the source's format (no trailing newline).
        timestamp_ms: when the broker stored it (Unix ms), if the broker says.
        problem: set when the broker's entry carries no payload (a Redis entry
            without the payload field); the parser counts it as a bad row.
    """

    offset: Offset
    payload: bytes
    timestamp_ms: int | None = None
    problem: str | None = None


class StreamConnector(Protocol):
    """Reads one stream from a position we own. Not thread-safe.

    Lifecycle: ``open(start)`` once, then ``read`` repeatedly, ``position()``
    whenever a checkpoint is taken, ``commit`` after it is saved, ``close()``.
    Implementations register by name in ``estuary.data.streams`` and pass the
    conformance suite in ``estuary.testing.streams``.
    """

    kind: str

    def open(self, start: StartPosition) -> None:
        """Connect and resolve ``start`` to a position (blocking, one round trip).

        Raises:
            StreamError: server unreachable, stream missing, offset invalid.
        """
        ...

    def read(self, max_messages: int, timeout_s: float) -> list[StreamMessage]:
        """Up to ``max_messages`` messages after ``position()``, in stream order.

        Blocks until at least one message is there or ``timeout_s`` passed (then
        returns ``[]``; it may also return ``[]`` sooner, e.g. while
        reconnecting). A lost connection is retried from ``position()``, so a
        server restart loses and repeats nothing.

        Raises:
            StreamError: the server stayed unreachable for ``reconnect_timeout_s``.
        """
        ...

    def position(self) -> Offset:
        """The offset of the last message returned by ``read`` (before any read:
        the offset just before ``start``). JSON-able; ``StartPosition.after``
        of it resumes exactly after that message."""
        ...

    def commit(self, position: Offset) -> None:
        """Note that everything up to ``position`` is in a saved checkpoint.

        The broker's state is not changed (it may be shared with other readers);
        it only bounds what a future ``committed()`` reports.

        Raises:
            StreamError: ``position`` is beyond ``position()``.
        """
        ...

    def committed(self) -> Offset | None:
        """The last committed position, if any."""
        ...

    def close(self) -> None:
        """Release the connection (idempotent)."""
        ...


class StreamPublisher(Protocol):
    """Appends rows to one stream (used by ``estuary replay`` and tests)."""

    def publish(self, payloads: Sequence[bytes]) -> list[Offset]:
        """Append ``payloads`` in order; blocks until the broker stored them all.

        Returns:
            (M,) their offsets, in order.
        """
        ...

    def close(self) -> None: ...


class StreamBackend(Protocol):
    """One broker kind: its connector, its publisher, its offsets."""

    name: str

    def connector(self, spec: StreamSourceSpec) -> StreamConnector:
        """An unopened connector for ``spec``."""
        ...

    def publisher(self, url: str, target: str) -> StreamPublisher:
        """A publisher to ``target`` (subject or key) on the server at ``url``."""
        ...

    def parse_offset(self, value: Offset) -> Offset:
        """``value`` (from a checkpoint or ``after:<offset>``) in canonical form.

        Raises:
            ValueError: not an offset of this broker.
        """
        ...

    def offset_key(self, value: Offset) -> tuple[int, ...]:
        """A sort key of ``value``: offsets later in the stream have larger keys
        (never compare offsets as text: ``"10"`` sorts before ``"9"``).

        Raises:
            ValueError: not an offset of this broker.
        """
        ...


class StreamBadRow(BadRow):
    """A bad message. ``file`` reads ``source 'clicks' offset 1234`` (where, as
    shown to the user), ``line`` is the message's number in its chunk (order
    only), ``reason`` what is wrong. Prints as
    ``source 'clicks' offset 1234: field I5: 'x' is not a number``."""

    __slots__ = ()

    def __str__(self) -> str:
        return f"{self.file}: {self.reason}"
