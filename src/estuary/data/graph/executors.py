"""Executors: read one split into decoded ``Block``s, with retries.

A ``SplitReader`` turns a split's raw chunks into blocks of good rows, each row
tagged with its row number (so ids equal ``TabularDataset``'s: the same
``RowDecoder`` hashes them). It skips, before decoding:

- rows outside the split's row range;
- rows trained by an earlier run (``skip``: ranges from ``Progress``);
- rows handed over by an earlier attempt of this read (a retry continues after
  the last row it gave out, so no row is read out twice).

Read errors (``DataFileError``, ``OSError``) are retried by ``RetryPolicy``;
config errors and too many bad rows are not (they would fail again).
``read_split_whole`` runs a split to its end in a worker process
(``executor.kind: processes``).
"""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Iterator, Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from estuary.config.errors import ConfigError
from estuary.config.spec import SchemaSpec
from estuary.data.badrows import BadRow
from estuary.data.decode import RowDecoder
from estuary.data.errors import BadDataError, DataError, DataFileError
from estuary.data.formats import RawChunk
from estuary.data.graph.progress import Ranges, ranges_contain
from estuary.data.graph.types import SourceOperator, Split
from estuary.data.types import Float32Array, Int64Array, JaggedIds

__all__ = [
    "Block",
    "ProcessSplitPool",
    "RetryDecision",
    "RetryPolicy",
    "SplitPool",
    "SplitReader",
    "TaskFailedError",
    "read_split_whole",
]

logger = logging.getLogger(__name__)


class TaskFailedError(DataError):
    """A split could not be read within its retries; names the task and the split."""


@dataclass(frozen=True)
class Block:
    """G good rows of one split, decoded.

    Args:
        rows: int64 (G,) row numbers (line in the file / row in a Parquet file).
        labels: float32 (G,).
        dense: float32 (G, Dd).
        ids: int64 (G, F).
        rows_read: data rows the block covered, good + bad (skipped ones excluded).
        bad_count: bad rows among them.
        bad_examples: every bad row of the block, in line order.
        skipped_rows: good rows of the block's range left out as trained already
            (they count as read for the bad-row ratio, as they did in the run
            that trained them).
        jagged: sequence feature -> its bags of the G rows (``RowDecoder.sequences``).
    """

    rows: Int64Array
    labels: Float32Array
    dense: Float32Array
    ids: Int64Array
    rows_read: int
    bad_count: int
    bad_examples: list[BadRow] = field(default_factory=list)
    skipped_rows: int = 0
    jagged: dict[str, JaggedIds] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return int(self.rows.shape[0])


@dataclass(frozen=True)
class RetryDecision:
    """What to do after a failed read attempt."""

    retry: bool
    delay_s: float = 0.0


@dataclass(frozen=True)
class RetryPolicy:
    """Retry read errors ``max_retries`` times, waiting ``backoff_s`` then doubling.

    Args:
        max_retries: retries after the first attempt.
        backoff_s: wait before the first retry.
    """

    max_retries: int = 2
    backoff_s: float = 1.0

    def decide(self, attempt: int, error: BaseException) -> RetryDecision:
        """``attempt``: 0-based number of the attempt that just failed."""
        transient = isinstance(error, DataFileError | OSError) and not isinstance(
            error, ConfigError | BadDataError
        )
        if not transient or attempt >= self.max_retries:
            return RetryDecision(False)
        return RetryDecision(True, self.backoff_s * (2**attempt))


class SplitReader:
    """Reads one split into blocks; keeps its place across attempts (see module doc).

    Args:
        op: the split's source operator.
        split: what to read.
        context: ``op.prepare(split.task)``.
        schema: column roles (the decoder is built from it).
        hash_names: sparse feature -> hashing name.
        skip: row ranges trained already.
        block_size_bytes: decompressed text per block.
    """

    def __init__(
        self,
        op: SourceOperator,
        split: Split,
        context: object,
        schema: SchemaSpec,
        hash_names: Mapping[str, str] | None,
        skip: Ranges,
        block_size_bytes: int,
    ) -> None:
        self.op = op
        self.split = split
        self.context = context
        self.schema = schema
        self.hash_names = dict(hash_names or {})
        self.skip = skip
        self.block_size_bytes = block_size_bytes
        self.last_row = 0  # every row numbered <= this was handed out or skipped
        self.good_rows = 0  # good rows of the split so far (handed out + skipped as trained)
        self._decoder: RowDecoder | None = None

    def __getstate__(self) -> dict[str, Any]:  # to a worker process: rebuild the decoder there
        state = dict(self.__dict__)
        state["_decoder"] = None
        return state

    @property
    def decoder(self) -> RowDecoder:
        if self._decoder is None:
            self._decoder = RowDecoder(self.schema, self.hash_names)
        return self._decoder

    def blocks(self) -> Iterator[Block]:
        """One attempt: the blocks after ``last_row``. State advances only once a
        block has been taken (after its ``yield``), so a failed attempt resumes
        right after the last block handed out."""
        split = self.split
        columns = self.decoder.columns
        raws = self.op.read(split, columns, self.context, self.block_size_bytes)
        try:
            for raw in raws:
                if raw.num_rows == 0 and not raw.invalid:
                    continue
                last = _last_row(raw)
                if last <= self.last_row:
                    continue  # an earlier attempt handed these out
                if split.row_stop is not None and _first_row(raw) >= split.row_stop:
                    break  # past the row range: the rest of the file is not ours
                kept, skipped = self._select(raw)
                block = self._decode(kept, skipped)
                if block.rows_read or skipped:
                    yield block
                self.last_row = last
                self.good_rows += block.num_rows + skipped
        finally:
            close = getattr(raws, "close", None)
            if close is not None:
                close()  # stop the format's reader at once (and its threads)

    def _select(self, raw: RawChunk) -> tuple[RawChunk, int]:
        """The rows of ``raw`` to decode, and how many were skipped as trained."""
        split = self.split
        rows = raw.line_numbers
        keep = rows > self.last_row
        if split.row_start > 1:
            keep &= rows >= split.row_start
        if split.row_stop is not None:
            keep &= rows < split.row_stop
        trained = ranges_contain(self.skip, rows) & keep
        skipped = int(trained.sum())
        keep &= ~trained

        def wanted(row: int) -> bool:
            inside = split.row_stop is None or row < split.row_stop
            return row > self.last_row and row >= split.row_start and inside

        invalid = [b for b in raw.invalid if wanted(b.line)]
        if keep.all() and len(invalid) == len(raw.invalid):
            return raw, skipped
        mask = pa.array(keep)
        columns = {name: column.filter(mask) for name, column in raw.columns.items()}
        return RawChunk(raw.file, columns, rows[keep], invalid), skipped

    def _decode(self, raw: RawChunk, skipped: int) -> Block:
        decoded = self.decoder.decode(raw, max_examples=raw.rows_read)  # every bad row
        rows = raw.line_numbers
        if decoded.bad_count > len(raw.invalid):  # the decoder rejected some: which?
            bad = np.array([b.line for b in decoded.bad_examples], dtype=np.int64)
            rows = rows[~np.isin(rows, bad)]
        assert rows.shape[0] == decoded.labels.shape[0], "good rows and their numbers agree"
        return Block(
            rows=rows,
            labels=decoded.labels,
            dense=decoded.dense,
            ids=decoded.ids,
            rows_read=decoded.rows_read,
            bad_count=decoded.bad_count,
            bad_examples=decoded.bad_examples,
            skipped_rows=skipped,
            jagged=decoded.jagged,
        )


def _last_row(raw: RawChunk) -> int:
    last = int(raw.line_numbers[-1]) if raw.num_rows else 0
    return max([last, *(b.line for b in raw.invalid)])


def _first_row(raw: RawChunk) -> int:
    first = int(raw.line_numbers[0]) if raw.num_rows else 1 << 62
    return min([first, *(b.line for b in raw.invalid)])


def read_split_whole(reader: SplitReader) -> tuple[list[Block], int, int]:
    """Read a split to its end (in a worker process): blocks, good rows, last row."""
    blocks = list(reader.blocks())
    return blocks, reader.good_rows, reader.last_row


class SplitPool(Protocol):
    """Where whole splits are read, away from the driver's threads (worker
    processes, or a cluster runtime's data executors). ``read`` may be called
    from several threads at once; it recovers from its own workers' loss (or
    raises) and returns ``read_split_whole``'s result, or for direct delivery
    ``RemoteBlock``s in place of the blocks (``estuary.data.graph.routing``)."""

    def read(self, reader: SplitReader) -> tuple[list[Any], int, int]: ...

    def summary(self) -> dict[str, Any]:
        """Figures for summary.json (e.g. executors lost and replaced)."""
        ...

    def close(self) -> None: ...


class ProcessSplitPool:
    """``executor.kind: processes``: splits read in spawned worker processes."""

    def __init__(self, workers: int) -> None:
        context = multiprocessing.get_context("spawn")  # threads are running: no fork
        self._pool = ProcessPoolExecutor(workers, mp_context=context)

    def read(self, reader: SplitReader) -> tuple[list[Block], int, int]:
        # Blocking wait: the whole split is read in a worker process.
        return self._pool.submit(read_split_whole, reader).result()

    def summary(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
