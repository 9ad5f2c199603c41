"""``estuary replay``: a file's rows into a stream at a given rate.

::

    file (.gz/.zst/plain) -> lines (header skipped for csv/tsv, blank lines dropped)
        -> batches of B rows -> token bucket (rate rows/s) -> publisher.publish(batch)

Every row is sent as its raw line, so a stream source with the same ``format``
reads back exactly the rows of the file. Batches are small (about 50 ms of rows)
so the rate is smooth; each ``publish`` waits for the broker's acks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import pyarrow as pa

from estuary.data.errors import DataFileError
from estuary.data.formats.text import compression_for
from estuary.data.streams.types import StreamPublisher

__all__ = ["REPLAY_FORMATS", "ReplayReport", "TokenBucket", "file_rows", "replay"]

REPLAY_FORMATS: dict[str, bool] = {"criteo_tsv": False, "csv": True, "tsv": True, "jsonl": False}
"""Line formats ``replay`` reads -> whether the file's first line is a header."""

_READ_BYTES = 1 << 20
_MAX_BATCH_ROWS = 1000


class TokenBucket:
    """A rate limiter: ``take(n)`` blocks until ``n`` tokens have accrued.

    Tokens accrue at ``rate_per_s`` up to ``burst``; the bucket starts empty, so
    the first ``n`` rows also wait their turn and the long-run rate is exact.

    Args:
        rate_per_s: tokens per second (> 0).
        burst: most tokens held (>= the largest ``n`` taken).
        clock: monotonic seconds; ``sleep``: waits (both injectable for tests).
    """

    def __init__(
        self,
        rate_per_s: float,
        burst: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if rate_per_s <= 0:
            raise ValueError(f"rate_per_s must be > 0, got {rate_per_s}")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.clock = clock
        self.sleep = sleep
        self.tokens = 0.0
        self.last = clock()

    def take(self, n: int) -> None:
        if n > self.burst:
            raise ValueError(f"cannot take {n} tokens from a bucket of {self.burst:g}")
        while True:
            now = self.clock()
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate_per_s)
            self.last = now
            if self.tokens >= n - 1e-9:  # tolerance: float sums may fall a hair short
                self.tokens = max(self.tokens - n, 0.0)
                return
            self.sleep((n - self.tokens) / self.rate_per_s)  # blocks until enough accrued


@dataclass(frozen=True)
class ReplayReport:
    """What a replay did.

    Args:
        rows: rows published.
        wall_s: seconds from the first read to the last ack.
        header: the file's header line (csv/tsv), to configure ``columns``.
    """

    rows: int
    wall_s: float
    header: str | None = None

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.wall_s if self.wall_s > 0 else 0.0


def file_rows(path: Path, format: str) -> tuple[str | None, Iterator[bytes]]:
    """(header line or None, the file's rows as raw lines without line ends).

    Raises:
        DataFileError: missing, unreadable or corrupt file; a format without lines.
    """
    if format not in REPLAY_FORMATS:
        known = ", ".join(sorted(REPLAY_FORMATS))
        raise DataFileError(f"{path}: replay reads line formats ({known}), not {format!r}")
    lines = _lines(path)
    header = None
    if REPLAY_FORMATS[format]:
        first = next(lines, None)
        header = None if first is None else first.decode("utf-8", "replace")
    if format == "jsonl":  # blank lines are not rows (for jsonl also spaces and tabs)
        return header, (line for line in lines if line.strip(b" \t"))
    return header, (line for line in lines if line)


def _lines(path: Path) -> Iterator[bytes]:
    codec = compression_for(path, "auto")
    try:
        stream = pa.input_stream(str(path), compression=codec)
    except FileNotFoundError:
        raise DataFileError(f"{path}: file not found") from None
    except (OSError, pa.ArrowException) as e:
        raise DataFileError(f"{path}: cannot open: {e}") from e
    carry = b""
    with stream:
        while True:
            try:
                data = stream.read(_READ_BYTES)
            except (OSError, pa.ArrowException) as e:
                raise DataFileError(f"{path}: truncated or corrupt {codec} stream: {e}") from e
            if not data:
                break
            parts = (carry + data).split(b"\n")
            carry = parts.pop()
            for line in parts:
                yield line.removesuffix(b"\r")
    if carry:
        yield carry.removesuffix(b"\r")


def replay(
    path: Path,
    publisher: StreamPublisher,
    rate_rows_per_s: float,
    *,
    format: str = "criteo_tsv",
    limit: int | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    on_batch: Callable[[int], None] | None = None,
) -> ReplayReport:
    """Publish the rows of ``path`` at ``rate_rows_per_s`` (0 = as fast as possible).

    Args:
        path: a line-format file, optionally compressed (by suffix).
        publisher: where rows go (``open_publisher(url)``).
        rate_rows_per_s: target rate; 0 for no limit.
        format: the file's format (``REPLAY_FORMATS``).
        limit: stop after this many rows.
        on_batch: called with the rows published so far after each batch.
    """
    if rate_rows_per_s < 0:
        raise ValueError(f"rate must be >= 0, got {rate_rows_per_s}")
    header, rows = file_rows(path, format)
    if limit is not None:
        rows = islice(rows, limit)
    batch_rows = _MAX_BATCH_ROWS
    bucket = None
    if rate_rows_per_s > 0:
        batch_rows = max(1, min(_MAX_BATCH_ROWS, int(rate_rows_per_s / 20)))  # ~50 ms a batch
        bucket = TokenBucket(rate_rows_per_s, batch_rows, clock, sleep)
    start = clock()
    sent = 0
    while batch := list(islice(rows, batch_rows)):
        if bucket is not None:
            bucket.take(len(batch))
        publisher.publish(batch)  # blocks until the broker acked the batch
        sent += len(batch)
        if on_batch is not None:
            on_batch(sent)
    return ReplayReport(rows=sent, wall_s=clock() - start, header=header)
