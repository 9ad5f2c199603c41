"""Job-spec section for one live stream source (NATS JetStream, Redis Streams).

Self-contained (it imports only ``config.errors`` and the generic builder
``config.build``) so that the dataset -> streams -> sources layer
(``config.dataset``) can plug it in: a ``type: stream`` source's ``stream``
section is one (docs/data.md). It is also built on its own::

    from estuary.config.build import build_dataclass
    spec = build_dataclass(StreamSourceSpec, {"kind": "nats", "url": ..., ...}, "stream")

or with ``stream_source_from_dict``. The loader checks types and unknown keys;
``validate`` checks what only makes sense per ``kind``: the fields of the named
backend's own section, against the dataclass it declares (``NatsSection``,
``RedisSection``, ``MemorySection`` here, light, so a job loads without the
client packages; a plugin's in ``Registry.section``). See ``docs/streams.md``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal
from urllib.parse import urlsplit

from estuary.config.build import REST, build_dataclass, foreign_key
from estuary.config.errors import ConfigError
from estuary.plugins import STREAM_BACKENDS

__all__ = [
    "MemorySection",
    "NatsSection",
    "Offset",
    "RedisSection",
    "StartPosition",
    "StreamFormatName",
    "StreamKind",
    "StreamSourceSpec",
    "UndeclaredSection",
    "stream_source_from_dict",
]

# The built-in kinds; ``kind`` takes any registered backend (``estuary.plugins``).
StreamKind = Literal["nats", "redis", "memory"]
StreamFormatName = Literal["criteo_tsv", "csv", "tsv", "jsonl"]
StartKind = Literal["earliest", "latest", "timestamp", "after"]
Offset = int | str
"""A message's place in its stream, JSON-able: a JetStream stream sequence
(int), a Redis stream entry id (``"1700000000000-0"``), a memory sequence (int)."""

# The fields the stream sections of every kind had before each backend declared
# its own: a null one is "unset" for any kind, and ``to_dict`` writes them (null
# when unset), so jobs and checkpoints written before read the same.
_FORMER_TARGETS = ("subject", "stream", "key", "payload_field")
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


def _check_names(section: Any, path: str) -> None:
    for f in dataclasses.fields(section):
        if getattr(section, f.name) == "":
            raise ConfigError(f"{path}.{f.name}", "must not be empty")


@dataclass(frozen=True)
class NatsSection:
    """The fields of a ``nats`` (JetStream) stream section.

    Args:
        subject: the subject to read (a filter inside the stream).
        stream: the JetStream stream name; default: the stream that captures
            ``subject``.
    """

    subject: str
    stream: str | None = None

    def validate(self, path: str) -> None:
        _check_names(self, path)


@dataclass(frozen=True)
class RedisSection:
    """The fields of a ``redis`` (Redis Streams) stream section.

    Args:
        key: the stream's key.
        payload_field: the entry field holding the row (default ``data``).
    """

    key: str
    payload_field: str | None = None

    def validate(self, path: str) -> None:
        _check_names(self, path)


@dataclass(frozen=True)
class MemorySection:
    """The fields of a ``memory`` (in-process) stream section.

    Args:
        key: the stream's key.
    """

    key: str

    def validate(self, path: str) -> None:
        _check_names(self, path)


@dataclass(frozen=True)
class UndeclaredSection:
    """The fields of a registered backend that declares no section: the former
    flat fields, all optional; the backend reads the ones it needs."""

    subject: str | None = None
    stream: str | None = None
    key: str | None = None
    payload_field: str | None = None

    def validate(self, path: str) -> None:
        _check_names(self, path)


@dataclass(frozen=True, init=False)
class StreamSourceSpec:
    """One live stream whose messages are rows.

    The section is flat in the job file: the fields below are common to every
    kind, and the others are the named backend's own, declared by it as a
    dataclass (``NatsSection``: ``subject``, ``stream``; ``RedisSection``:
    ``key``, ``payload_field``; ``MemorySection``: ``key``; a plugin's own,
    ``Registry.section``). They are kept in ``options`` and checked at load
    against that declaration; ``section`` is the built declaration the
    connector reads. In Python they are keyword arguments
    (``StreamSourceSpec(kind="nats", url=..., subject="clicks")``).

    Args:
        kind: the connector: ``nats`` (JetStream), ``redis`` (Redis Streams),
            ``memory`` (in-process reference broker, for tests), or another
            registered backend (``register_backend``).
        url: the server: ``nats://127.0.0.1:4222``, ``redis://127.0.0.1:6379/0``
            (the path is the database number), ``memory://``.
        options: the backend's own fields, by name (see above).
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
    options: dict[str, Any] = field(
        default_factory=dict, metadata={REST: _FORMER_TARGETS, "yaml": False}, hash=False
    )
    name: str | None = None
    format: StreamFormatName = "criteo_tsv"
    columns: list[str] | None = None
    start: str = "earliest"
    batch_max_messages: int = 1024
    poll_timeout_s: float = 1.0
    reconnect_timeout_s: float = 60.0

    def __init__(
        self,
        kind: str,
        url: str,
        options: Mapping[str, Any] | None = None,
        *,
        name: str | None = None,
        format: StreamFormatName = "criteo_tsv",
        columns: list[str] | None = None,
        start: str = "earliest",
        batch_max_messages: int = 1024,
        poll_timeout_s: float = 1.0,
        reconnect_timeout_s: float = 60.0,
        **fields: Any,
    ) -> None:
        own = {**(options or {}), **fields}
        values = {
            "kind": kind,
            "url": url,
            # A null former field is unset (jobs written before say ``key: null``).
            "options": {k: v for k, v in own.items() if v is not None or k not in _FORMER_TARGETS},
            "name": name,
            "format": format,
            "columns": columns,
            "start": start,
            "batch_max_messages": batch_max_messages,
            "poll_timeout_s": poll_timeout_s,
            "reconnect_timeout_s": reconnect_timeout_s,
        }
        for key, value in values.items():
            object.__setattr__(self, key, value)

    # The fields of the built-in kinds, as they read before sections were typed
    # (``spec.subject``, ``spec.key``): ``None`` when the kind has no such field.
    @property
    def subject(self) -> str | None:
        return self.options.get("subject")

    @property
    def stream(self) -> str | None:
        return self.options.get("stream")

    @property
    def key(self) -> str | None:
        return self.options.get("key")

    @property
    def payload_field(self) -> str | None:
        return self.options.get("payload_field")

    @functools.cached_property
    def section(self) -> Any:
        """The backend's own fields, built from ``options`` as its declaration
        (``NatsSection``, ...) says; what its connector reads."""
        return self.build_section("stream")

    def build_section(self, path: str) -> Any:
        """``options`` checked against the declaration of ``kind``'s section.

        Raises:
            ConfigError: a field the backend does not declare, naming its fields
                (``stream.key: not a field of stream kind 'nats' (its fields:
                subject, stream)``), or a wrong, empty or missing one.
        """
        declared = STREAM_BACKENDS.section(self.kind, f"{path}.kind") or UndeclaredSection
        own = [f.name for f in dataclasses.fields(declared)]
        for key in self.options:
            if key not in own:
                owner = f"stream kind {self.kind!r}"
                raise foreign_key(path, key, own, "field", owner, near=[*_COMMON_KEYS, *own])
        for f in dataclasses.fields(declared):
            unset = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if unset and f.name not in self.options:
                raise ConfigError(f"{path}.{f.name}", f"kind {self.kind!r} needs {f.name}")
        return build_dataclass(declared, self.options, path)

    @property
    def target(self) -> str | None:
        """What is read on the server: the first of the backend's own fields that
        is a set string (nats: the subject; redis, memory: the key)."""
        section = self.section
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if isinstance(value, str) and value:
                return value
        return None

    @property
    def display_name(self) -> str:
        """The name bad-row reports use: ``name``, else the target, else the kind."""
        return self.name or self.target or self.kind

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
        self.build_section(path)
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


_COMMON_KEYS = tuple(f.name for f in dataclasses.fields(StreamSourceSpec) if f.name != "options")
