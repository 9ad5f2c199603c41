"""Live stream sources: connectors found by name, messages parsed as rows.

    reader = StreamReader(spec, columns=decoder.columns)   # spec: StreamSourceSpec
    reader.open()                                          # or open(StartPosition.after(saved))
    chunk = reader.read()                                  # StreamChunk: RawChunk + offsets
    decoded = decoder.decode(chunk.raw, max_examples=5)    # the file readers' decoder
    saved = chunk.position                                 # goes into the checkpoint

Backends (``nats``: JetStream, ``redis``: Redis Streams, ``memory``: in-process
reference) are imported lazily from the ``STREAM_BACKENDS`` table in
``estuary.plugins``, so the client packages are needed only by jobs that use them
(``pip install 'estuary[streams]'``); ``register_backend`` (or an
``estuary.streams`` entry point) adds more. Adding a broker = one module with a
backend object + one line in that table + a subclass of
``estuary.testing.streams.StreamConformance``.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from estuary.config.errors import ConfigError
from estuary.config.streams import StartPosition, StreamSourceSpec
from estuary.data.streams.backends import (
    BACKENDS,
    available_backends,
    get_backend,
    register_backend,
)
from estuary.data.streams.messages import MESSAGE_FORMATS, MessageParser, StreamChunk
from estuary.data.streams.reader import StreamReader
from estuary.data.streams.types import (
    Offset,
    StreamBackend,
    StreamBadRow,
    StreamConnector,
    StreamError,
    StreamMessage,
    StreamPublisher,
)

__all__ = [
    "BACKENDS",
    "MESSAGE_FORMATS",
    "MessageParser",
    "Offset",
    "StartPosition",
    "StreamBackend",
    "StreamBadRow",
    "StreamChunk",
    "StreamConnector",
    "StreamError",
    "StreamMessage",
    "StreamPublisher",
    "StreamReader",
    "available_backends",
    "get_backend",
    "open_connector",
    "open_publisher",
    "register_backend",
]


def open_connector(
    spec: StreamSourceSpec, start: StartPosition | None = None, where: str = "stream"
) -> StreamConnector:
    """A connector for ``spec``, opened at ``start`` (default: ``spec.start``)."""
    backend = get_backend(spec.kind, f"{where}.kind")
    connector = backend.connector(spec)
    connector.open(start if start is not None else spec.start_position)
    return connector


def open_publisher(url: str) -> StreamPublisher:
    """A publisher for ``scheme://host:port/TARGET`` (``nats://127.0.0.1:4222/clicks``,
    ``redis://127.0.0.1:6379/clicks``, ``memory:///clicks``): the path is the
    subject or key.

    Raises:
        ConfigError: no target in the URL, or an unknown scheme.
    """
    parts = urlsplit(url)
    target = parts.path.lstrip("/")
    if not target:
        raise ConfigError("--to", f"{url!r} names no subject or key (scheme://host:port/NAME)")
    backend = get_backend(parts.scheme, "--to")
    server = parts._replace(path="", query="", fragment="").geturl()
    return backend.publisher(server, target)
