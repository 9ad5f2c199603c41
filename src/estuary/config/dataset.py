"""The three-layer data definition: ``data.dataset`` -> named streams -> sources.

::

    data:
      dataset:
        streams:
          history:                      # a stream: one or more sources, one priority
            priority: 0
            sources:
              - name: clicks_log        # a batch source: files by time partition
                path: logs/{{YYYY}}{{MM}}{{DD}}/{{HH}}/part-*.tsv
                format: tsv
                success_marker: _SUCCESS
                start: 2026-01-01T00
                end: 2026-01-08T00      # null = open-ended
              - name: live_clicks       # a stream source: a live broker, windows of
                type: stream            # broker time, rows identified by offsets
                window_s: 60
                stream: {kind: redis, url: "redis://127.0.0.1:6379/0", key: clicks,
                         format: csv, columns: [label, I1, C1], start: earliest}
        timer: {poll_interval_s: 30, idle_timeout_s: 60}
        executor: {workers: 2}
        shuffle: {buffer_rows: 100000, interleave_splits: 2}

The task graph that runs it lives in ``data/graph``; docs/data.md explains
windows, readiness, joins and exactly-once progress. This module holds only the
typed spec (it imports nothing else from ``estuary`` but ``config.errors`` and
the self-contained ``config.streams``, so ``config.spec`` can import it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal

from estuary.config.errors import ConfigError
from estuary.config.streams import StreamSourceSpec
from estuary.plugins import FORMATS, SOURCE_TYPES

__all__ = [
    "PLACEHOLDERS",
    "BatchSourceSpec",
    "DatasetSpec",
    "ExecutorSpec",
    "JoinSpec",
    "ShuffleSpec",
    "StreamSpec",
    "TimerSpec",
    "parse_time",
    "pattern_step_s",
]

# The built-in formats; ``format`` takes any registered one (``estuary.plugins``).
# Keep in step with ``spec.FormatName`` (a test checks they agree).
DatasetFormatName = Literal["criteo_tsv", "csv", "tsv", "parquet", "jsonl"]

PLACEHOLDERS: dict[str, str] = {"YYYY": "%Y", "MM": "%m", "DD": "%d", "HH": "%H"}
"""Time placeholders of a path pattern (``{{YYYY}}`` or ``{YYYY}``) -> strftime code."""
_TOKEN = re.compile(r"\{\{?([A-Za-z]+)\}?\}")
_HOUR_S = 3600
_DAY_S = 86400


def parse_time(text: str, path: str) -> int:
    """An ISO 8601 time (``2026-01-01T00``, ``2026-01-01``, ``2026-01-01T00:00:00Z``)
    as whole seconds since 1970-01-01T00 UTC; a time without a zone is UTC.

    Raises:
        ConfigError: at ``path`` when the text is not such a time.
    """
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(
            path, f"{text!r} is not an ISO 8601 time (e.g. '2026-01-01T00' or '2026-01-01')"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int(when.timestamp())


def pattern_step_s(pattern: str, path: str) -> int:
    """The partition length a path pattern implies: 3600 with ``{{HH}}``, else 86400.

    Raises:
        ConfigError: unknown placeholder, or ``YYYY``/``MM``/``DD`` missing.
    """
    names = set(_TOKEN.findall(pattern))
    unknown = sorted(names - set(PLACEHOLDERS))
    if unknown:
        raise ConfigError(path, f"unknown placeholder {{{{{unknown[0]}}}}} (YYYY, MM, DD, HH)")
    missing = [n for n in ("YYYY", "MM", "DD") if n not in names]
    if missing:
        raise ConfigError(
            path,
            f"needs the time placeholders {{{{YYYY}}}}, {{{{MM}}}} and {{{{DD}}}} "
            f"(missing {', '.join(missing)}); add {{{{HH}}}} for hourly partitions",
        )
    return _HOUR_S if "HH" in names else _DAY_S


@dataclass(frozen=True)
class BatchSourceSpec:
    """One source of a stream: files in time partitions (``type: files``, one
    window per hour when the pattern has ``{{HH}}``, else per day) or a live
    broker stream (``type: stream``, windows of ``window_s`` of broker time).

    Args:
        name: unique in the dataset; names the source in progress and row identities.
        path: files: file pattern with time placeholders ``{{YYYY}} {{MM}} {{DD}}
            {{HH}}`` (``{YYYY}`` also accepted) and optionally a glob
            (``part-*.tsv``); relative paths resolve against the job file.
        start: files: first window (ISO 8601, UTC unless a zone is given), on a
            partition boundary. (A stream's start is ``stream.start``.)
        type: the source kind: ``files`` or ``stream``.
        format: files: a registered format: ``criteo_tsv``, ``csv``, ``tsv``,
            ``parquet``, ``jsonl``.
        columns: files: column names for header-less formats (``criteo_tsv``).
        compression: files: ``auto`` (by suffix), ``none``, ``gzip`` or ``zstd``.
        success_marker: files: a partition is ready once this file exists in the
            folder of its files; ``null``: ready once at least one file matches.
        end: files: end of the last window (exclusive); ``null`` = open-ended (see
            ``TimerSpec.until`` and ``idle_timeout_s``). Streams are open-ended.
        split_rows: files: split each file into row ranges of this many rows
            (``parquet`` only: row counts come from the file footer); ``null`` =
            one split per file.
        stream: stream: the broker, target, message format and start position (a
            ``StreamSourceSpec``; its ``name`` defaults to this source's name).
        window_s: stream: length of one task's window of broker time (windows
            are aligned to multiples of it since 1970).
    """

    name: str
    path: str = ""
    start: str = ""
    type: str = "files"
    format: str = "criteo_tsv"
    columns: list[str] | None = None
    compression: Literal["auto", "none", "gzip", "zstd"] = "auto"
    success_marker: str | None = "_SUCCESS"
    end: str | None = None
    split_rows: int | None = None
    stream: StreamSourceSpec | None = None
    window_s: int = 60

    @property
    def step_s(self) -> int:
        """Partition length in seconds (3600 or 86400)."""
        return pattern_step_s(self.path, "path")

    @property
    def start_s(self) -> int:
        return parse_time(self.start, "start")

    @property
    def end_s(self) -> int | None:
        return None if self.end is None else parse_time(self.end, "end")

    def validate(self, path: str) -> None:
        if not self.name or "/" in self.name or "@" in self.name:
            raise ConfigError(f"{path}.name", "must be a non-empty name without '/' or '@'")
        SOURCE_TYPES.check(self.type, f"{path}.type")
        if self.type == "stream":
            self._validate_stream(path)
            return
        FORMATS.check(self.format, f"{path}.format")
        if self.type != "files":
            return  # a plugin source type: its operator checks its own fields
        if self.stream is not None:
            raise ConfigError(f"{path}.stream", "only for type 'stream'")
        for name in ("path", "start"):
            if not getattr(self, name):
                raise ConfigError(f"{path}.{name}", "required for type 'files'")
        step = pattern_step_s(self.path, f"{path}.path")
        start = parse_time(self.start, f"{path}.start")
        if start % step:
            raise ConfigError(f"{path}.start", f"must be on a partition boundary ({step} s)")
        if self.end is not None:
            end = parse_time(self.end, f"{path}.end")
            if end <= start:
                raise ConfigError(f"{path}.end", "must be after start")
            if end % step:
                raise ConfigError(f"{path}.end", f"must be on a partition boundary ({step} s)")
        if self.success_marker is not None and (
            not self.success_marker or "/" in self.success_marker
        ):
            raise ConfigError(f"{path}.success_marker", "must be a file name (or null)")
        if self.split_rows is not None:
            if self.split_rows < 1:
                raise ConfigError(f"{path}.split_rows", "must be >= 1")
            if self.format != "parquet":
                raise ConfigError(
                    f"{path}.split_rows",
                    "needs format parquet (row counts come from the footer); "
                    "text files are one split each",
                )

    def _validate_stream(self, path: str) -> None:
        if self.stream is None:
            raise ConfigError(f"{path}.stream", "type 'stream' needs the stream section")
        for name in ("path", "start", "end", "split_rows", "columns"):
            if getattr(self, name):
                where = "stream.columns" if name == "columns" else "stream.start"
                hint = f" (use {where})" if name in ("start", "columns") else ""
                raise ConfigError(f"{path}.{name}", f"not used by type 'stream'{hint}")
        if self.window_s < 1:
            raise ConfigError(f"{path}.window_s", "must be >= 1")
        self.stream.validate(f"{path}.stream")


@dataclass(frozen=True)
class JoinSpec:
    """Label the ``left`` source's rows by whether a ``right`` event follows them.

    A left row (an impression) gets label 1 when a right row (a click) with the
    same ``key`` has a time in ``[t, t + wait_s]``, else 0; the label goes into
    ``data.schema.label``. A left window ``[s, e)`` waits until the right
    partitions covering ``[s, e + wait_s)`` are ready; a right ``type: stream``
    source until its messages stored before ``e + wait_s`` are all read. Either
    side may be files or a stream.

    Args:
        left: the source whose rows are trained (its label column, if any, is replaced).
        right: the source of later events; its rows are only looked up.
        key: column present in both sources (compared as text).
        time_column: event time column in both, an integer count of ``time_unit``
            since 1970-01-01 UTC.
        time_unit: ``s`` or ``ms``.
        wait_s: how long after a left row a right event still counts (late events).
    """

    left: str
    right: str
    key: str
    time_column: str
    wait_s: float
    time_unit: Literal["s", "ms"] = "ms"

    def validate(self, path: str) -> None:
        if self.wait_s < 0:
            raise ConfigError(f"{path}.wait_s", "must be >= 0")
        if self.left == self.right:
            raise ConfigError(f"{path}.right", "must name a different source than left")


@dataclass(frozen=True)
class StreamSpec:
    """A named stream: its sources' rows in time order.

    Args:
        sources: one or more sources; without ``join`` their rows are all trained.
        priority: among tasks whose windows start at the same time, higher first.
        join: label one source's rows with another's events (the stream then
            trains only ``join.left``'s rows).
    """

    sources: list[BatchSourceSpec]
    priority: int = 0
    join: JoinSpec | None = None

    def validate(self, path: str) -> None:
        if not self.sources:
            raise ConfigError(f"{path}.sources", "at least one source is required")
        names = [s.name for s in self.sources]
        if self.join is not None:
            for side in ("left", "right"):
                name = getattr(self.join, side)
                if name not in names:
                    raise ConfigError(
                        f"{path}.join.{side}", f"{name!r} is not a source of this stream"
                    )
            if len(names) != 2:
                raise ConfigError(f"{path}.join", "a joined stream has exactly two sources")


@dataclass(frozen=True)
class TimerSpec:
    """When windows are read: readiness polling and the end of open-ended ranges.

    Args:
        poll_interval_s: seconds between readiness checks of a partition not yet ready.
        ready_timeout_s: give up on a partition of a closed range that stays
            unready this long (``on_timeout``); ``null`` = wait for ever.
        on_timeout: ``error`` (fail naming the partition) or ``skip`` it (a warning).
        until: open-ended sources plan no window starting at or after this time.
        idle_timeout_s: an open-ended source whose next partition stays unready this
            long ends the run (cleanly); ``null`` = keep waiting.
    """

    poll_interval_s: float = 30.0
    ready_timeout_s: float | None = None
    on_timeout: Literal["error", "skip"] = "error"
    until: str | None = None
    idle_timeout_s: float | None = None

    def validate(self, path: str) -> None:
        if self.poll_interval_s <= 0:
            raise ConfigError(f"{path}.poll_interval_s", "must be > 0")
        for name in ("ready_timeout_s", "idle_timeout_s"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"{path}.{name}", "must be >= 0")
        if self.until is not None:
            parse_time(self.until, f"{path}.until")


@dataclass(frozen=True)
class ExecutorSpec:
    """Who reads the splits.

    Args:
        kind: ``threads`` (parsing releases the GIL) or ``processes`` (a split is
            read whole in a worker process, then handed over: more memory).
        workers: splits read at once.
        queue_blocks: decoded blocks (~``block_size_bytes`` of text each) a split
            may hold ahead of the trainer: the backpressure bound.
        lookahead_splits: splits of ready tasks (listed, joins indexed) queued ahead
            of the readers.
        max_retries: re-reads of a split after a read error (``DataFileError``,
            ``OSError``); rows already handed over are not repeated.
        retry_backoff_s: wait before the first retry; doubles each time.
        block_size_bytes: decompressed text per parsed block.
    """

    kind: Literal["threads", "processes"] = "threads"
    workers: int = 2
    queue_blocks: int = 4
    lookahead_splits: int = 4
    max_retries: int = 2
    retry_backoff_s: float = 1.0
    block_size_bytes: int = 2 << 20

    def validate(self, path: str) -> None:
        for name in ("workers", "queue_blocks", "lookahead_splits", "block_size_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{path}.{name}", "must be >= 1")
        if self.max_retries < 0:
            raise ConfigError(f"{path}.max_retries", "must be >= 0")
        if self.retry_backoff_s < 0:
            raise ConfigError(f"{path}.retry_backoff_s", "must be >= 0")


@dataclass(frozen=True)
class ShuffleSpec:
    """Row order: splits interleaved, then a bounded shuffle buffer; seeded.

    Args:
        buffer_rows: rows held and drawn from at random; ``0`` keeps read order.
        interleave_splits: splits read in alternation (seeded choice of the next
            block); at most ``executor.workers``.
        seed: ``null`` = ``train.seed``.
    """

    buffer_rows: int = 0
    interleave_splits: int = 1
    seed: int | None = None

    def validate(self, path: str) -> None:
        if self.buffer_rows < 0:
            raise ConfigError(f"{path}.buffer_rows", "must be >= 0")
        if self.interleave_splits < 1:
            raise ConfigError(f"{path}.interleave_splits", "must be >= 1")


@dataclass(frozen=True)
class DatasetSpec:
    """Streams read through the task graph (``data/graph``).

    Args:
        streams: stream name -> stream.
        timer: readiness polling, open-ended ranges.
        executor: readers, retries, backpressure.
        shuffle: interleaving and buffer shuffle.
        eval_stream: a stream held out of training and read once, in order, for
            evaluation at the end (and by ``estuary eval``); ``null`` = no evaluation.
    """

    streams: dict[str, StreamSpec]
    timer: TimerSpec = field(default_factory=TimerSpec)
    executor: ExecutorSpec = field(default_factory=ExecutorSpec)
    shuffle: ShuffleSpec = field(default_factory=ShuffleSpec)
    eval_stream: str | None = None

    def validate(self, path: str) -> None:
        if not self.streams:
            raise ConfigError(f"{path}.streams", "at least one stream is required")
        seen: dict[str, str] = {}
        for stream_name, stream in self.streams.items():
            where = f"{path}.streams.{stream_name}"
            if not stream_name or "/" in stream_name or "@" in stream_name:
                raise ConfigError(where, "a stream name must be non-empty, without '/' or '@'")
            stream.validate(where)
            for i, source in enumerate(stream.sources):
                if source.name in seen:
                    raise ConfigError(
                        f"{where}.sources[{i}].name",
                        f"{source.name!r} is already a source of stream {seen[source.name]!r}",
                    )
                seen[source.name] = stream_name
        self.timer.validate(f"{path}.timer")
        self.executor.validate(f"{path}.executor")
        self.shuffle.validate(f"{path}.shuffle")
        if self.shuffle.interleave_splits > self.executor.workers:
            raise ConfigError(
                f"{path}.shuffle.interleave_splits",
                f"must be <= executor.workers ({self.executor.workers}): "
                "every interleaved split needs a reader",
            )
        if self.eval_stream is not None:
            if self.eval_stream not in self.streams:
                raise ConfigError(
                    f"{path}.eval_stream", f"{self.eval_stream!r} is not a stream of the dataset"
                )
            if len(self.streams) < 2:
                raise ConfigError(f"{path}.eval_stream", "leaves no stream to train on")

    def train_streams(self) -> list[str]:
        """The streams trained on: all but ``eval_stream``."""
        return [name for name in self.streams if name != self.eval_stream]
