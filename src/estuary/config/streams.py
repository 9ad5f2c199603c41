"""Job-spec section for one live stream source (NATS JetStream, Redis Streams).

Self-contained (it imports only ``config.errors`` and the generic builder
``config.build``) so that the dataset -> streams -> sources layer
(``config.dataset``) can plug it in: a ``type: stream`` source's ``stream``
section is one (docs/data.md). It is also built on its own::

    from estuary.config.build import build_dataclass
    spec = build_dataclass(StreamSourceSpec, {"kind": "nats", "url": ..., ...}, "stream")

or with ``stream_source_from_dict``. The loader checks types and unknown keys;
``validate`` checks what only makes sense per ``kind``. See ``docs/streams.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal
from urllib.parse import urlsplit

from estuary.config.build import build_dataclass
from estuary.config.errors import ConfigError
from estuary.plugins import STREAM_BACKENDS

__all__ = [
    "Offset",
    "StartPosition",
    "StreamFormatName",
    "StreamKind",
    "StreamSourceSpec",
    "stream_source_from_dict",
]

# The built-in kinds; ``kind`` takes any registered backend (``estuary.plugins``).
StreamKind = Literal["nats", "redis", "memory"]
StreamFormatName = Literal["criteo_tsv", "csv", "tsv", "jsonl"]
StartKind = Literal["earliest", "latest", "timestamp", "after"]
Offset = int | str
"""A message's place in its stream, JSON-able: a JetStream stream sequence
(int), a Redis stream entry id (``"1700000000000-0"``), a memory sequence (int)."""

# Which target fields each kind needs and accepts (one table, no if/elif on kind).
_TARGETS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # kind: (one of these is required, these are allowed)
    "nats": (("subject",), ("subject", "stream")),
    "redis": (("key",), ("key", "payload_field")),
    "memory": (("key",), ("key",)),
}
# A registered backend of another kind reads the target fields it needs itself.
_PLUGIN_TARGETS: tuple[tuple[str, ...], tuple[str, ...]] = (
    (),
    ("subject", "stream", "key", "payload_field"),
)
# How each message format gets its column names.
_COLUMNS_RULE: dict[str, str] = {
    "criteo_tsv": "optional",  # default label, I1..I13, C1..C26
    "csv": "required",
    "tsv": "required",
    "jsonl": "refused",  # keys name the columns
}
_AFTER = "after:"


@dataclass(frozen=True)
class StartPosition:
    """Where a stream reader starts.

    Args:
        kind: ``earliest`` (the oldest message kept), ``latest`` (only messages
            published after opening), ``timestamp`` (the first message at or
            after ``timestamp_ms``) or ``after`` (the messages after ``offset``,
            a position saved in a checkpoint: neither it nor anything before it
            is read again).
        timestamp_ms: Unix time in milliseconds (``timestamp`` only).
        offset: a position as returned by ``StreamConnector.position()``
            (``after`` only).
    """

    kind: StartKind
    timestamp_ms: int | None = None
    offset: Offset | None = None

    def __post_init__(self) -> None:
        if (self.kind == "timestamp") != (self.timestamp_ms is not None):
            raise ValueError("StartPosition: timestamp_ms is set exactly for kind 'timestamp'")
        if (self.kind == "after") != (self.offset is not None):
            raise ValueError("StartPosition: offset is set exactly for kind 'after'")

    @classmethod
    def earliest(cls) -> StartPosition:
        return cls("earliest")

    @classmethod
    def latest(cls) -> StartPosition:
        return cls("latest")

    @classmethod
    def at_time(cls, when: datetime | int) -> StartPosition:
        """From ``when``: a datetime (naive = UTC) or Unix milliseconds."""
        if isinstance(when, datetime):
            aware = when if when.tzinfo is not None else when.replace(tzinfo=UTC)
            when = int(aware.timestamp() * 1000)
        return cls("timestamp", timestamp_ms=when)

    @classmethod
    def after(cls, offset: Offset) -> StartPosition:
        """Resume after ``offset`` (a checkpointed ``position()``)."""
        return cls("after", offset=offset)

    @classmethod
    def parse(cls, text: str, path: str = "start") -> StartPosition:
        """``earliest``, ``latest``, an ISO 8601 time (naive = UTC) or ``after:<offset>``.

        Raises:
            ConfigError: at ``path``, naming the accepted forms.
        """
        text = text.strip()
        if text in ("earliest", "latest"):
            return cls(text)  # type: ignore[arg-type]
        if text.startswith(_AFTER):
            raw = text[len(_AFTER) :].strip()
            if not raw:
                raise ConfigError(path, "'after:' needs an offset, e.g. after:1234")
            return cls.after(int(raw) if raw.isdigit() else raw)
        try:
            return cls.at_time(datetime.fromisoformat(text))
        except ValueError:
            raise ConfigError(
                path,
                f"expected earliest, latest, an ISO 8601 time (2026-01-31T08:00:00Z) or "
                f"after:<offset>; got {text!r}",
            ) from None

    def __str__(self) -> str:
        if self.kind == "timestamp":
            assert self.timestamp_ms is not None
            moment = datetime.fromtimestamp(self.timestamp_ms / 1000, UTC)
            return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")
        if self.kind == "after":
            return f"{_AFTER}{self.offset}"
        return self.kind


@dataclass(frozen=True)
class StreamSourceSpec:
    """One live stream whose messages are rows.

    Args:
        kind: the connector: ``nats`` (JetStream), ``redis`` (Redis Streams),
            ``memory`` (in-process reference broker, for tests), or another
            registered backend (``register_backend``).
        url: the server: ``nats://127.0.0.1:4222``, ``redis://127.0.0.1:6379/0``
            (the path is the database number), ``memory://``.
        subject: nats: the subject to read (a filter inside the stream).
        stream: nats: the JetStream stream name; default: the stream that
            captures ``subject``.
        key: redis, memory: the stream's key.
        payload_field: redis: the entry field holding the row (default ``data``).
        name: the source's name in bad-row reports (``source 'clicks' offset
            1234: ...``); default: the subject, stream or key.
        format: how one message payload is one row: ``criteo_tsv``, ``csv`` /
            ``tsv`` (no header row: ``columns`` names the fields) or ``jsonl``
            (one JSON object, keys name the columns).
        columns: field names of a delimited message, in order; required for
            ``csv``/``tsv``, defaults to Criteo's 40 for ``criteo_tsv``, refused
            for ``jsonl``.
        start: where reading starts when no checkpoint says otherwise:
            ``earliest``, ``latest``, an ISO 8601 time (naive = UTC) or
            ``after:<offset>``.
        batch_max_messages: messages per read (one chunk of rows).
        poll_timeout_s: how long one read waits for the first message.
        reconnect_timeout_s: how long the connector keeps retrying a lost server
            before a read fails.
    """

    kind: str
    url: str
    subject: str | None = None
    stream: str | None = None
    key: str | None = None
    payload_field: str | None = None
    name: str | None = None
    format: StreamFormatName = "criteo_tsv"
    columns: list[str] | None = None
    start: str = "earliest"
    batch_max_messages: int = 1024
    poll_timeout_s: float = 1.0
    reconnect_timeout_s: float = 60.0

    @property
    def display_name(self) -> str:
        """The name bad-row reports use."""
        return self.name or self.subject or self.stream or self.key or self.kind

    @property
    def start_position(self) -> StartPosition:
        return StartPosition.parse(self.start)

    def validate(self, path: str) -> None:
        STREAM_BACKENDS.check(self.kind, f"{path}.kind")
        scheme = urlsplit(self.url).scheme
        if scheme != self.kind:
            raise ConfigError(
                f"{path}.url",
                f"expected a {self.kind}:// URL for kind {self.kind!r}, got {self.url!r}",
            )
        required, allowed = _TARGETS.get(self.kind, _PLUGIN_TARGETS)
        for name in ("subject", "stream", "key", "payload_field"):
            if getattr(self, name) is not None and name not in allowed:
                raise ConfigError(f"{path}.{name}", f"not used by kind {self.kind!r}")
            if getattr(self, name) == "":
                raise ConfigError(f"{path}.{name}", "must not be empty")
        if required and all(getattr(self, name) is None for name in required):
            raise ConfigError(
                f"{path}.{required[0]}", f"kind {self.kind!r} needs {' or '.join(required)}"
            )
        rule = _COLUMNS_RULE[self.format]
        if rule == "required" and not self.columns:
            raise ConfigError(
                f"{path}.columns", f"format {self.format!r} needs the message's column names"
            )
        if rule == "refused" and self.columns is not None:
            raise ConfigError(
                f"{path}.columns",
                f"not used by format {self.format!r}, whose keys name the columns",
            )
        if self.columns is not None:
            duplicates = sorted({c for c in self.columns if self.columns.count(c) > 1})
            if duplicates:
                raise ConfigError(f"{path}.columns", f"duplicate column names {duplicates}")
        StartPosition.parse(self.start, f"{path}.start")
        if self.batch_max_messages < 1:
            raise ConfigError(f"{path}.batch_max_messages", "must be >= 1")
        if self.poll_timeout_s < 0:
            raise ConfigError(f"{path}.poll_timeout_s", "must be >= 0")
        if self.reconnect_timeout_s <= 0:
            raise ConfigError(f"{path}.reconnect_timeout_s", "must be > 0")


def stream_source_from_dict(data: Mapping[str, Any], path: str = "stream") -> StreamSourceSpec:
    """Build and validate a ``StreamSourceSpec`` from a YAML-shaped mapping.

    Raises:
        ConfigError: naming the field path (``stream.start: ...``).
    """
    if not isinstance(data, Mapping):
        raise ConfigError(path, "expected a mapping")
    return build_dataclass(StreamSourceSpec, dict(data), path)
