"""Sinks: where the graph's rows go.

- ``BatchSink`` feeds a trainer: interleaves open splits (seeded), passes rows
  through a ``RowBuffer`` (FIFO or shuffle) and yields ``Batch``es whose
  ``row_ids`` identify every row (``Progress`` decodes them) and whose ``origin``
  is ``"stream/source"`` when every row came from that one source.
- ``materialize`` writes each task's rows, after the join and before decoding,
  as Parquet in hourly folders with ``_SUCCESS`` markers, i.e. as a new batch
  source: reading it back with ``format: parquet`` gives the same ids.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from estuary.config.spec import DataSpec
from estuary.data.badrows import BadRowReport, BadRowTracker
from estuary.data.decode import RowDecoder
from estuary.data.errors import DataError
from estuary.data.graph.executors import Block
from estuary.data.graph.operators import build_operators
from estuary.data.graph.progress import ROW_BITS, Progress
from estuary.data.graph.shuffle import RowBuffer
from estuary.data.graph.timer import Timer, WaitOutcome
from estuary.data.graph.types import Split, Task
from estuary.data.types import Batch, Int64Array, JaggedIds

__all__ = [
    "BatchSink",
    "EmptyTask",
    "MaterializeReport",
    "OpenedSplit",
    "SinkFailure",
    "SplitEnd",
    "materialize",
]


@dataclass(frozen=True)
class EmptyTask:
    """A task with no splits (an empty partition), or one skipped as never ready."""

    task: Task
    skipped: bool = False


@dataclass(frozen=True)
class OpenedSplit:
    """A split a worker is reading; its blocks arrive on ``blocks``."""

    split: Split
    names: list[str]
    blocks: queue.Queue[object]


@dataclass(frozen=True)
class SplitEnd:
    """The split was read to its end; ``rows`` good rows in all."""

    rows: int


@dataclass(frozen=True)
class SinkFailure:
    """An error raised by a reader, to re-raise in the sink's (caller's) thread."""

    error: BaseException


@dataclass
class _Open:
    split: Split
    blocks: queue.Queue[object]
    code: int


class _Drained(Exception):
    """``should_stop`` said stop while the sink waited for data."""


class BatchSink:
    """Splits in plan order -> interleaved, buffered rows -> ``Batch``es.

    Args:
        opened: announcements from the workers (``OpenedSplit``, ``EmptyTask``,
            ``SinkFailure``, then a done sentinel).
        progress: told about tasks, splits and their row counts.
        data: schema and bad-row policy.
        hash_names: sparse feature -> hashing name.
        batch_size: B.
        interleave: splits read in alternation.
        buffer_rows: shuffle buffer (0 = read order).
        seed: seeds interleaving and shuffling.
        stop: set when the driver closes.
    """

    def __init__(
        self,
        opened: queue.Queue[object],
        progress: Progress,
        data: DataSpec,
        hash_names: Mapping[str, str] | None,
        *,
        batch_size: int,
        interleave: int,
        buffer_rows: int,
        seed: int,
        stop: threading.Event,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        self.opened = opened
        self.should_stop = should_stop
        self.progress = progress
        decoder = RowDecoder(data.schema, hash_names)
        self.features = list(decoder.sparse)
        self.sequences = list(decoder.sequences)  # several ids per row
        self.order = list(decoder.features)  # model order of every sparse feature
        self.num_dense = len(decoder.dense)
        self.tracker = BadRowTracker(
            data.max_bad_row_ratio, data.report_bad_rows, totals=progress.bad_totals
        )
        self.batch_size = batch_size
        self.interleave = interleave
        self.rng = np.random.default_rng([seed, 0x5EED])  # PCG64 via SeedSequence
        self.buffer = RowBuffer(
            self.num_dense, len(self.features), buffer_rows, self.rng, len(self.sequences)
        )
        self.stop = stop
        self._listed: set[str] = set()

    def batches(self) -> Iterator[Batch]:
        for batch in self._steps():
            assert isinstance(batch, Batch)
            yield batch

    def _steps(self) -> Iterator[Any]:
        """What ``_take`` makes, until the input ends (or a stop while waiting)."""
        try:
            yield from self._loop()
        except _Drained:  # a stop while waiting for data: rows not yet yielded stay
            return  # unrecorded in the progress, so a resume reads them again

    def job_bad_rows(self) -> BadRowReport:
        """The job's bad rows so far, each once over restarts
        (``Progress.bad_totals``); the examples are this run's."""
        return BadRowReport(*self.progress.bad_totals(), list(self.tracker.examples))

    def _loop(self) -> Iterator[Any]:
        open_splits: list[_Open] = []
        finished = False
        while True:
            while len(open_splits) < self.interleave and not finished:
                finished = self._open_next(open_splits)
            if not open_splits:
                break
            i = int(self.rng.integers(len(open_splits))) if len(open_splits) > 1 else 0
            current = open_splits[i]
            item = self._get(current.blocks)  # its worker is on it: this wait ends
            if isinstance(item, SinkFailure):
                raise item.error
            if isinstance(item, SplitEnd):
                self.progress.split_ended(current.code, item.rows)
                self.tracker.check_file_end(current.split.name)
                open_splits.pop(i)
                continue
            block: Any = item  # a Block (or a RemoteBlock: ``RoutedSink``)
            read = block.rows_read + block.skipped_rows
            self.progress.split_read(current.code, block.bad_count, read)
            self.tracker.add(read, block.bad_count, block.bad_examples)
            self.tracker.check_early(current.split.name)
            if block.num_rows:
                if int(block.rows.max()) >> ROW_BITS:
                    raise DataError(
                        f"{current.split.name}: row number {int(block.rows.max())} "
                        f"needs more than {ROW_BITS} bits: split the source finer"
                    )
                row_ids = (np.int64(current.code) << ROW_BITS) | block.rows
                self._add(block, current.code, row_ids)
            while self._ready():
                yield self._take()
        while self._pending():
            yield self._take()

    # -- where rows wait (``RoutedSink`` routes them to ranks instead) ---------------

    def _add(self, block: Any, code: int, row_ids: Int64Array) -> None:
        """Buffer a block's good rows (``row_ids``: theirs; ``code``: their split's)."""
        assert isinstance(block, Block)
        bags = [block.jagged[name] for name in self.sequences]
        self.buffer.add(block.labels, block.dense, block.ids, row_ids, bags)

    def _ready(self) -> bool:
        """Whether a full batch may leave now."""
        return self.buffer.ready(self.batch_size)

    def _pending(self) -> bool:
        """Whether rows are left once the input ended."""
        return len(self.buffer) > 0

    def _take(self) -> Any:
        """The next step's rows (a ``Batch``)."""
        return self._batch()

    def _open_next(self, open_splits: list[_Open]) -> bool:
        """Take the next announcement; True once there are no more."""
        item = self._get(self.opened)
        if isinstance(item, SinkFailure):
            raise item.error
        if isinstance(item, EmptyTask):
            self.progress.task_listed(item.task, [], skipped=item.skipped)
            return False
        if not isinstance(item, OpenedSplit):
            return True  # the done sentinel
        task = item.split.task
        if task.id not in self._listed:
            self._listed.add(task.id)
            self.progress.task_listed(task, item.names)
        code = self.progress.open_split(task, item.split.name)
        open_splits.append(_Open(item.split, item.blocks, code))
        return False

    def _get(self, q: queue.Queue[object]) -> object:
        while True:
            try:
                # Blocking wait: for the readers (bounded by their progress).
                return q.get(timeout=0.5)
            except queue.Empty:
                if self.stop.is_set():
                    raise RuntimeError("the data driver was closed") from None
                if self.should_stop is not None and self.should_stop():
                    raise _Drained from None

    def _origin(self, row_ids: np.ndarray) -> str | None:
        """``"stream/source"`` of the tasks the rows' splits belong to, when they
        are one source's, else ``None``. Costs a pass over the B split codes; the
        (few) distinct ones are decoded by ``Progress`` (their tasks are not
        committed: these rows are not trained yet)."""
        tasks, _ = self.progress.row_tasks(row_ids)
        origins = {f"{task.stream}/{task.source}" for task in tasks}
        return origins.pop() if len(origins) == 1 else None

    def _batch(self) -> Batch:
        labels, dense, ids, row_ids, bags = self.buffer.take(self.batch_size)
        columns = np.ascontiguousarray(ids.T)  # (F, B): each feature contiguous
        sparse = {name: JaggedIds.single(columns[f]) for f, name in enumerate(self.features)}
        sparse.update(zip(self.sequences, bags, strict=True))
        return Batch(
            labels=labels,
            dense=dense,
            sparse={name: sparse[name] for name in self.order},  # model order
            row_ids=row_ids,
            origin=self._origin(row_ids),
        )


# -- materialised Parquet ---------------------------------------------------------------


@dataclass
class MaterializeReport:
    """What ``materialize`` wrote: per task id, its Parquet file and row count."""

    files: dict[str, Path] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)

    @property
    def total_rows(self) -> int:
        return sum(self.rows.values())


def materialize(
    data: DataSpec,
    base_dir: Path | str,
    out_dir: Path | str,
    *,
    streams: Sequence[str] | None = None,
) -> MaterializeReport:
    """Write every task's rows (joined, not yet decoded) as Parquet, in plan order.

    Layout: ``out_dir/<stream>/<YYYYMMDD>/<HH>/part-<source>.parquet`` plus a
    ``_SUCCESS`` per folder, with the schema's columns (binary text, the label
    filled in by a join) and ``_file`` / ``_row``, each row's origin. A batch
    source with path ``out_dir/<stream>/{{YYYY}}{{MM}}{{DD}}/{{HH}}/part-*.parquet``
    reads it back. Reading is sequential (one task at a time).

    Raises:
        PartitionNotReadyError, DataFileError, ConfigError.
    """
    if data.dataset is None:
        raise ValueError("materialize needs data.dataset")
    spec = data.dataset
    base = Path(base_dir)
    out = Path(out_dir)
    operators = build_operators(spec, base, data.schema.label, streams)
    timer = Timer(spec.timer, operators)
    columns = RowDecoder(data.schema).columns
    report = MaterializeReport()
    for task in timer.windows():
        outcome = timer.wait_ready(task)
        if outcome is WaitOutcome.END:
            break
        if outcome is WaitOutcome.SKIP:
            continue
        op = timer.operator(task)
        context = op.prepare(task)
        tables = []
        for split in op.splits(task):
            for raw in op.read(split, columns, context, spec.executor.block_size_bytes):
                keep = raw.line_numbers >= split.row_start
                if split.row_stop is not None:
                    keep &= raw.line_numbers < split.row_stop
                arrays = {c: _as_text(raw.columns[c]).filter(pa.array(keep)) for c in columns}
                arrays["_file"] = pa.array([split.name.split("#")[0]] * int(keep.sum()))
                arrays["_row"] = pa.array(raw.line_numbers[keep])
                tables.append(pa.table(arrays))
        when = datetime.fromtimestamp(task.start_s, UTC)
        folder = out / task.stream / when.strftime("%Y%m%d") / when.strftime("%H")
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"part-{task.source}.parquet"
        tmp = folder / f".{path.name}.tmp-{os.getpid()}"
        schema = pa.schema(
            [(c, pa.binary()) for c in columns] + [("_file", pa.string()), ("_row", pa.int64())]
        )
        table = pa.concat_tables(tables) if tables else schema.empty_table()
        pq.write_table(table, tmp)
        os.replace(tmp, path)  # atomic: a reader sees the whole file or none
        (folder / "_SUCCESS").write_text("")
        report.files[task.id] = path
        report.rows[task.id] = table.num_rows
    return report


def _as_text(column: pa.Array) -> pa.Array:
    from estuary.data.formats.values import to_text

    return to_text(column).cast(pa.binary())
