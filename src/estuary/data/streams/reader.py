"""``StreamReader``: one stream source read as chunks of rows, with positions."""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType

from estuary.config.streams import StartPosition, StreamSourceSpec
from estuary.data.streams.backends import get_backend
from estuary.data.streams.guard import GuardedConnector
from estuary.data.streams.messages import MessageParser, StreamChunk
from estuary.data.streams.types import Offset, StreamConnector, StreamError

__all__ = ["StreamReader"]


class StreamReader:
    """Reads one ``StreamSourceSpec`` as ``StreamChunk``s (the file readers'
    ``RawChunk`` plus offsets). Not thread-safe; one reader per source.

    ::

        reader = StreamReader(spec, columns=decoder.columns)
        reader.open(StartPosition.after(saved) if saved is not None else None)
        while training:
            chunk = reader.read()              # <= batch_max_messages rows; blocks
            decoded = decoder.decode(chunk.raw, 5)  # up to poll_timeout_s
            bad = chunk.bad_rows(decoded.bad_examples)   # source 'x' offset 12: ...
            ...train...; checkpoint(model, chunk.position); reader.commit(chunk.position)

    Args:
        spec: the source.
        columns: columns each row must provide (e.g. ``RowDecoder.columns``).
        where: config path of the source, for errors.
        connector: use this (unopened) connector instead of the registry's.

    Raises:
        ConfigError: an invalid spec, or a column the messages lack.
    """

    def __init__(
        self,
        spec: StreamSourceSpec,
        columns: Sequence[str],
        *,
        where: str = "stream",
        connector: StreamConnector | None = None,
    ) -> None:
        spec.validate(where)  # the loader does too; this covers specs built in code
        self.spec = spec
        self.where = where
        self.parser = MessageParser(
            spec.format, columns, spec.columns, source=spec.display_name, where=where
        )
        backend = get_backend(spec.kind, f"{where}.kind")
        self.connector: StreamConnector = GuardedConnector(
            connector or backend.connector(spec), backend, source=spec.display_name
        )
        self._opened = False

    def __repr__(self) -> str:
        return f"StreamReader({self.spec.kind} {self.spec.display_name!r})"

    def open(self, start: StartPosition | None = None) -> StreamReader:
        """Connect at ``start`` (default ``spec.start``; a checkpoint passes
        ``StartPosition.after(saved_position)``)."""
        self.connector.open(start if start is not None else self.spec.start_position)
        self._opened = True
        return self

    def read(self, max_messages: int | None = None, timeout_s: float | None = None) -> StreamChunk:
        """The next messages as rows: up to ``max_messages`` (default
        ``spec.batch_max_messages``), waiting up to ``timeout_s`` (default
        ``spec.poll_timeout_s``) for the first; an empty chunk when none came."""
        if not self._opened:
            raise StreamError(f"{self!r}: read before open()")
        messages = self.connector.read(
            max_messages or self.spec.batch_max_messages,
            self.spec.poll_timeout_s if timeout_s is None else timeout_s,
        )
        return self.parser.parse(messages, self.connector.position())

    def position(self) -> Offset:
        """The offset after the last chunk returned (see ``StreamConnector.position``)."""
        return self.connector.position()

    def commit(self, position: Offset) -> None:
        """Everything up to ``position`` is in a saved checkpoint."""
        self.connector.commit(position)

    def close(self) -> None:
        self.connector.close()
        self._opened = False

    def __enter__(self) -> StreamReader:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()
