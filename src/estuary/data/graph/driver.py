"""``Driver``: runs a dataset's task graph and yields ``Batch``es.

Threads and queues (every queue bounded, so a slow trainer slows the readers)::

    dispatcher --jobs (lookahead)--> W workers --opened--> BatchSink (caller's thread)
    Timer.windows(): tasks in plan order        each split: its own queue of
    Timer.wait_ready(): polls readiness         <= queue_blocks decoded blocks
    op.splits() / op.prepare() (join index)     -> interleave + shuffle -> Batch

Workers take splits in plan order and announce each on ``opened`` before
reading it, so the sink sees splits in plan order whatever the timing; it
reads blocks from its first ``interleave_splits`` open splits, choosing with its
seeded rng. Every open split has a worker on it (``interleave_splits <=
workers``), so the sink's blocking reads always end: no deadlock, and the row
order depends only on the data and the seed.

Task states (``task_states``): ``PENDING`` once planned and waited for,
``RUNNING`` when a worker starts one of its splits, ``SUCCEEDED`` when every
split was read to its end, ``FAILED`` when a split failed after its retries.
The failure surfaces in the caller's thread when the sink reaches that split.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from estuary.config.dataset import DatasetSpec
from estuary.config.spec import DataSpec
from estuary.data.badrows import BadRowReport
from estuary.data.graph.executors import (
    ProcessSplitPool,
    RetryPolicy,
    SplitPool,
    SplitReader,
    TaskFailedError,
)
from estuary.data.graph.operators import build_operators
from estuary.data.graph.progress import Progress
from estuary.data.graph.routing import RoutedSink, StepRoute
from estuary.data.graph.sinks import BatchSink, EmptyTask, OpenedSplit, SinkFailure, SplitEnd
from estuary.data.graph.timer import Timer, WaitOutcome
from estuary.data.graph.types import SourceOperator, Split, Task, TaskState
from estuary.data.types import Batch

__all__ = ["Driver"]

logger = logging.getLogger(__name__)

_DONE = object()
_T = TypeVar("_T")
_POLL_S = 0.1  # how often blocked threads look at the stop flag


class _Stopped(Exception):
    """The driver is closing; a thread unwinds."""


@dataclass(frozen=True)
class _SplitJob:
    split: Split
    op: SourceOperator
    context: object
    names: list[str]  # every split of the task, for progress


class Driver:
    """Reads a ``data.dataset`` as batches, in plan order, exactly once per progress.

    Args:
        data: the job's ``data`` section (``dataset`` must be set).
        base_dir: the job file's folder.
        batch_size: rows per batch (the last may be smaller).
        seed: interleave/shuffle seed when ``dataset.shuffle.seed`` is null.
        hash_names: sparse feature -> hashing name (shared tables).
        progress: what was trained before (resume); a fresh one by default.
        streams: streams to read (default: all but ``eval_stream``).
        shuffle: apply ``dataset.shuffle`` (``False``: read order, one split at a time).
        operators: source operators to use instead of building them (tests).
        should_stop: polled while ``batches()`` waits for data (every 0.5 s); once
            it returns True the batches end there, without the rows still in the
            shuffle buffer (not in the progress, so a resume reads them again).
            Training stops between batches on its own (the fit loop polls its stop signal).
        pool: where whole splits are read (a cluster runtime's data executors);
            default: the worker threads themselves, or worker processes with
            ``executor.kind: processes``. The driver closes it.
    """

    def __init__(
        self,
        data: DataSpec,
        base_dir: Path | str,
        *,
        batch_size: int,
        seed: int = 0,
        hash_names: Mapping[str, str] | None = None,
        progress: Progress | None = None,
        streams: Sequence[str] | None = None,
        shuffle: bool = True,
        operators: Sequence[SourceOperator] | None = None,
        should_stop: Callable[[], bool] | None = None,
        pool: SplitPool | None = None,
    ) -> None:
        if data.dataset is None:
            raise ValueError("Driver needs data.dataset")
        if batch_size < 1:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        self.data = data
        self.spec: DatasetSpec = data.dataset
        self.base_dir = Path(base_dir)
        self.batch_size = batch_size
        self.hash_names = dict(hash_names or {})
        self.progress = progress if progress is not None else Progress()
        if operators is None:
            operators = build_operators(self.spec, self.base_dir, data.schema.label, streams)
        self.operators = list(operators)
        for op in self.operators:
            attach = getattr(op, "attach", None)  # stream sources resume from progress
            if attach is not None:
                attach(self.progress)
        self.timer = Timer(self.spec.timer, operators)
        executor = self.spec.executor
        self.workers = executor.workers
        self.policy = RetryPolicy(executor.max_retries, executor.retry_backoff_s)
        self.interleave = self.spec.shuffle.interleave_splits if shuffle else 1
        self.buffer_rows = self.spec.shuffle.buffer_rows if shuffle else 0
        self.seed = self.spec.shuffle.seed if self.spec.shuffle.seed is not None else seed
        self.should_stop = should_stop
        self.task_states: dict[str, TaskState] = {}
        self._remaining: dict[str, int] = {}  # task id -> splits not yet read to the end
        self._state_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._pool: SplitPool | None = pool
        self._sink: BatchSink | None = None
        self._jobs: queue.Queue[object] = queue.Queue(maxsize=executor.lookahead_splits)
        self._opened: queue.Queue[object] = queue.Queue()  # bounded by the workers
        self._take_lock = threading.Lock()  # take a job + announce it, atomically

    # -- public ---------------------------------------------------------------------

    def batches(self) -> Iterator[Batch]:
        """Batches until every planned task was read (or an open range went idle).

        ``Batch.row_ids`` are ``(split code << 32) | row number``: pass them to
        ``progress.record`` once the batch is trained.

        Raises:
            PartitionNotReadyError, TaskFailedError, BadDataError, ConfigError.
        """
        sink = BatchSink(self._opened, self.progress, self.data, self.hash_names, **self._order())
        yield from self._run(sink, sink.batches)

    def steps(self, ranks: int) -> Iterator[StepRoute]:
        """Direct delivery (``estuary.data.graph.routing``): each step's rows
        routed to ``ranks`` trainers, ``batch_size // ranks`` rows each at most;
        the split pool must return ``RemoteBlock``s. Record ``StepRoute.row_ids``
        once a step is trained. Raises as ``batches``."""
        order = self._order()
        order["batch_size"] = self.batch_size // ranks
        sink = RoutedSink(
            self._opened, self.progress, self.data, self.hash_names, ranks=ranks, **order
        )
        yield from self._run(sink, sink.routes)

    def _order(self) -> dict[str, Any]:
        """The sink's batching and ordering arguments."""
        return {
            "batch_size": self.batch_size,
            "interleave": self.interleave,
            "buffer_rows": self.buffer_rows,
            "seed": self.seed,
            "stop": self._stop,
            "should_stop": self.should_stop,
        }

    def _run(self, sink: BatchSink, items: Callable[[], Iterator[_T]]) -> Iterator[_T]:
        if self._threads:
            raise RuntimeError("a Driver reads its dataset once")
        self._start()
        self._sink = sink
        try:
            yield from items()
        finally:
            self.close()

    @property
    def bad_rows(self) -> BadRowReport:
        """The job's bad rows so far: count and rows read exactly once over
        restarts (a resumed run starts from its checkpoint's totals and counts a
        re-read split once, ``Progress.bad_totals``), and this run's first
        examples. (``bad_rows_this_run``: what this run's reads saw.)"""
        if self._sink is None:
            return BadRowReport(*self.progress.bad_totals())
        return self._sink.job_bad_rows()

    @property
    def bad_rows_this_run(self) -> BadRowReport:
        """Bad rows this run's reads saw (re-read splits again, committed tasks
        not). ``data.max_bad_row_ratio`` is checked on the job's (``bad_rows``)."""
        return self._sink.tracker.report() if self._sink is not None else BadRowReport()

    def summary(self) -> dict[str, Any]:
        """The split pool's figures (e.g. data executors lost and replaced)."""
        return self._pool.summary() if self._pool is not None else {}

    def queue_depths(self) -> dict[str, int]:
        """Items waiting between the reader's stages (approximate: ``qsize``):
        ``data_splits`` planned splits no worker took yet, ``data_opened`` splits
        being read that the batch sink has not reached."""
        return {"data_splits": self._jobs.qsize(), "data_opened": self._opened.qsize()}

    def close(self) -> None:
        """Stop every thread (and the split pool); idempotent."""
        self._stop.set()
        if self._pool is not None:
            self._pool.close()  # first: wakes the threads waiting on it
        for thread in self._threads:
            thread.join(timeout=10)
        for op in self.operators:
            close = getattr(op, "close", None)  # stream sources hold a connection
            if close is not None:
                close()

    # -- threads -----------------------------------------------------------------------

    def _start(self) -> None:
        if self._pool is None and self.spec.executor.kind == "processes":
            self._pool = ProcessSplitPool(self.workers)
        threads = [threading.Thread(target=self._dispatch, name="estuary-graph-dispatch")]
        threads += [
            threading.Thread(target=self._work, name=f"estuary-graph-worker-{i}")
            for i in range(self.workers)
        ]
        for thread in threads:
            thread.daemon = True
            thread.start()
        self._threads = threads

    def _put(self, q: queue.Queue[object], item: object) -> None:
        while True:
            if self._stop.is_set():
                raise _Stopped
            try:
                q.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                continue

    def _get(self, q: queue.Queue[object]) -> object:
        while True:
            if self._stop.is_set():
                raise _Stopped
            try:
                return q.get(timeout=_POLL_S)
            except queue.Empty:
                continue

    def _set_state(self, task: Task, state: TaskState) -> None:
        with self._state_lock:
            current = self.task_states.get(task.id)
            if current is None or not current.is_terminal:  # a failed task stays failed
                self.task_states[task.id] = state

    def _dispatch(self) -> None:
        """Plan, wait for readiness, list splits, hand them out in order."""
        try:
            for task in self.timer.windows(done=self.progress.is_committed):
                self._set_state(task, TaskState.PENDING)
                outcome = self.timer.wait_ready(task, self._stop)
                if outcome is WaitOutcome.END:
                    break
                if outcome is WaitOutcome.SKIP:
                    self._set_state(task, TaskState.SUCCEEDED)
                    self._put(self._jobs, EmptyTask(task, skipped=True))
                    continue
                op = self.timer.operator(task)
                splits = op.splits(task)
                if not splits:
                    self._set_state(task, TaskState.SUCCEEDED)
                    self._put(self._jobs, EmptyTask(task))
                    continue
                context = op.prepare(task)
                names = [s.name for s in splits]
                with self._state_lock:
                    self._remaining[task.id] = len(splits)
                for split in splits:
                    self._put(self._jobs, _SplitJob(split, op, context, names))
            self._put(self._jobs, _DONE)
        except _Stopped:
            return
        except BaseException as exc:  # surfaced in the caller's thread, in order
            try:
                self._put(self._jobs, SinkFailure(exc))
            except _Stopped:
                return

    def _work(self) -> None:
        """Take the next split (in plan order), announce it, read it."""
        try:
            while True:
                with self._take_lock:
                    job = self._get(self._jobs)
                    if job is _DONE or isinstance(job, SinkFailure):
                        self._put(self._jobs, job)  # the other workers stop too
                        self._put(self._opened, job)
                        return
                    if isinstance(job, EmptyTask):
                        self._put(self._opened, job)
                        continue
                    assert isinstance(job, _SplitJob)
                    blocks: queue.Queue[object] = queue.Queue(self.spec.executor.queue_blocks)
                    self._put(self._opened, OpenedSplit(job.split, job.names, blocks))
                self._read(job, blocks)
        except _Stopped:
            return

    def _read(self, job: _SplitJob, blocks: queue.Queue[object]) -> None:
        split, task = job.split, job.split.task
        self._set_state(task, TaskState.RUNNING)
        reader = SplitReader(
            job.op,
            split,
            job.context,
            self.data.schema,
            self.hash_names,
            self.progress.trained_ranges(task, split.name),
            self.spec.executor.block_size_bytes,
        )
        attempt = 0
        while True:
            try:
                if self._pool is not None:
                    # Blocking wait: the whole split is read by the pool.
                    got, good, last = self._pool.read(reader)
                    for block in got:
                        self._put(blocks, block)
                    reader.good_rows, reader.last_row = good, last
                else:
                    for block in reader.blocks():
                        self._put(blocks, block)
                self._put(blocks, SplitEnd(reader.good_rows))
                self._split_done(task)
                return
            except _Stopped:
                raise
            except BaseException as exc:
                if self._stop.is_set():
                    raise _Stopped from None  # closing: the pool's error says nothing
                decision = self.policy.decide(attempt, exc)
                if not decision.retry:
                    self._set_state(task, TaskState.FAILED)
                    if isinstance(exc, TaskFailedError | KeyboardInterrupt):
                        error: BaseException = exc
                    elif attempt or isinstance(exc, OSError):
                        error = TaskFailedError(
                            f"{task.id}: split {split.name} failed after {attempt + 1} "
                            f"attempt(s): {exc}"
                        )
                        error.__cause__ = exc
                    else:
                        error = exc  # not retryable: the original error says it best
                    self._put(blocks, SinkFailure(error))
                    return
                attempt += 1
                logger.warning(
                    "%s: reading %s failed (%s); retry %d of %d in %.1f s",
                    task.id,
                    split.name,
                    exc,
                    attempt,
                    self.policy.max_retries,
                    decision.delay_s,
                )
                if self._stop.wait(decision.delay_s):  # Blocking wait: the backoff
                    raise _Stopped from None

    def _split_done(self, task: Task) -> None:
        with self._state_lock:
            self._remaining[task.id] -= 1
            if self._remaining[task.id] == 0:
                del self._remaining[task.id]
                self.task_states[task.id] = TaskState.SUCCEEDED
