"""Feeds: where a fit loop's batches come from, and how far it got.

Two feeds, one interface (``Feed``):

* ``EpochFeed`` — ``data.sources``: the rows loaded in memory, ``train.epochs``
  passes, each a permutation of (seed, epoch); rank r of W trains rows
  ``perm[r::W]`` (``rank_rows``). The position is (epoch, step in the epoch),
  kept in ``LoopState``: an epoch's batches are a function of (seed, epoch), so a
  resume skips the ones a checkpoint holds.
* ``GraphFeed`` — ``data.dataset``: the task graph's ``Driver`` (rank 0 only)
  yields batches of W x B rows in plan order, each split into W parts
  (``estuary.train.batch_scatter``); rank 0 records every trained row in a
  ``Progress``, which is the feed's position (``data_progress`` in checkpoints).

Both give each step's ``StepShare`` (rows over all ranks, rows to record, how
the loss is reduced), their eval batches and a few summary figures, and tell the
loop their checkpoint rules (``CheckpointRules``).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np

from estuary.config import JobSpec
from estuary.config.errors import ConfigError
from estuary.config.mixed_buffer import (
    STEPS_HELD,
    check_max_age,
    live_origins,
    min_row_bytes,
)
from estuary.data import DataError, DataPart, TabularDataset
from estuary.data.decode import RowDecoder
from estuary.data.graph import Driver, Progress
from estuary.data.graph.executors import SplitPool
from estuary.data.graph.routing import PartAssembler
from estuary.data.types import Batch, Int64Array
from estuary.train.batch_routes import PartRoutes, RoutedBatches
from estuary.train.batch_scatter import BatchScatter
from estuary.train.callbacks import LoopState
from estuary.train.mixed_feed import BufferedSource
from estuary.train.plan import TrainPlan

__all__ = [
    "CheckpointRules",
    "EpochFeed",
    "Feed",
    "GraphFeed",
    "StepShare",
    "feed_for",
    "rank_batches",
    "rank_rows",
    "stream_batches",
]

_S = TypeVar("_S")


@dataclass(frozen=True)
class StepShare:
    """One step's rows, over all ranks.

    Args:
        rows: rows the step trained on all W ranks together.
        row_ids: int64 (rows,) their ids, to record as trained (``None``: not tracked).
        loss_scale: ``None``: the loss is the mean over the rank's rows; else the
            sum over them times this (``W / rows``: the mean over the whole step
            once DDP averages over ranks, whatever each rank's part holds).
    """

    rows: int
    row_ids: Int64Array | None = None
    loss_scale: float | None = None


@dataclass(frozen=True)
class CheckpointRules:
    """When a feed's run writes checkpoints beyond ``output.checkpoint_every_steps``.

    Args:
        on_stop: a stop writes a checkpoint of its step (rank 0; unless the last
            checkpoint already holds it).
        final: write a checkpoint at the end (rank 0).
        final_before_eval: the final checkpoint is written before evaluation and
            pruned like periodic ones (else written after evaluation and kept).
        stop_when_drained: a stop asked by the time the batches ended still raises
            ``TrainingStopped`` (a graph feed's batches end on a stop while it
            waits for data).
        stop_finishes: a stop ends the run like the end of the data (final
            checkpoint, evaluation, result) instead of raising ``TrainingStopped``
            (``train.continuous``).
    """

    on_stop: bool
    final: bool
    final_before_eval: bool
    stop_when_drained: bool
    stop_finishes: bool = False


class Feed(Protocol):
    """Batches for one rank of a fit, and the figures that go with them."""

    epochs: int  # passes over the data (1 for a graph feed)
    total_rows: int  # rows the whole run trains, for the progress bar (0: unknown)
    rules: CheckpointRules
    # True: the loop state's (epoch, epoch_step) is the data position (EpochFeed);
    # False: ``position()`` is, and the loop leaves epoch and epoch_step alone.
    epoch_positions: bool
    restored: bool  # the position came from a checkpoint of the current step

    def batches(self, epoch: int, skip: int) -> Iterator[Batch]:
        """This rank's batches of ``epoch``, after the first ``skip`` steps."""
        ...

    def share(self, batch: Batch) -> StepShare:
        """The step ``batch`` (this rank's part) belongs to; call once per step."""
        ...

    def commit(self, share: StepShare) -> None:
        """Record the step's rows as trained (after the step)."""
        ...

    def position(self) -> dict[str, Any] | None:
        """How far the data was trained (``data_progress``), or ``None`` when the
        loop state's (epoch, epoch_step) says it all."""
        ...

    def commits_paused(self) -> AbstractContextManager[object]:
        """While held, no row is recorded in the position by another thread (a
        checkpoint captures the position with the state that goes with it)."""
        ...

    def bad_rows(self) -> int:
        """Malformed input rows skipped so far: the job's, each once over
        restarts (a graph feed resumes from its checkpoint's count)."""
        ...

    def bad_rows_this_run(self) -> int:
        """The ones this process's reads skipped (a graph feed: re-read splits
        again, committed ones not)."""
        ...

    def eval_batches(self, batch_size: int) -> Iterator[Batch] | None:
        """The eval batches (``None``: the job has no eval set)."""
        ...

    def newest_event_s(self) -> dict[str, float]:
        """Stream -> event time (s since 1970) of the newest trained row, to its
        window's start; empty when the data has no event time (``data.sources``)."""
        ...

    def queue_depths(self) -> dict[str, int]:
        """The reader's queues -> items waiting (empty when it has none)."""
        ...

    def summary(self) -> dict[str, Any]:
        """Figures for ``summary.json``."""
        ...

    def close(self) -> None:
        """Stop reading (idempotent)."""
        ...


def rank_rows(
    part: DataPart, rank: int, world_size: int, *, shuffle: bool, seed: int, epoch: int
) -> Int64Array:
    """Row ids rank ``rank`` trains in one epoch -> int64 (R // W,).

    The epoch's order is the one ``DataPart.batches`` uses (a permutation drawn from
    (seed, epoch) when ``shuffle``); rank r takes every W-th row from r, after
    dropping the last ``R mod W`` rows so every rank takes as many steps (DDP needs
    that). Batch t of every rank together is rows ``[t W B, (t + 1) W B)`` of the
    epoch order.
    """
    rows = part.row_ids
    if shuffle:
        rng = np.random.default_rng([seed, epoch])  # as DataPart.batches
        rows = rows[rng.permutation(rows.shape[0])]
    usable = rows.shape[0] - rows.shape[0] % world_size
    return rows[rank:usable:world_size]


def rank_batches(
    part: DataPart,
    batch_size: int,
    rank: int,
    world_size: int,
    *,
    shuffle: bool,
    seed: int,
    epoch: int,
) -> Iterator[Batch]:
    """Rank ``rank``'s batches of ``batch_size`` rows (per rank) of one epoch."""
    rows = rank_rows(part, rank, world_size, shuffle=shuffle, seed=seed, epoch=epoch)
    for begin in range(0, rows.shape[0], batch_size):
        yield part.dataset.take(rows[begin : begin + batch_size])


class EpochFeed:
    """``data.sources``: epochs over the loaded dataset (see module docstring).

    Args:
        job: the job (``train`` and ``output`` sections).
        dataset: the loaded rows.
        rank: this trainer's rank r.
        world_size: W.

    Raises:
        DataError: no rows to train on.
    """

    def __init__(self, job: JobSpec, dataset: TabularDataset, rank: int, world_size: int) -> None:
        self.job, self.dataset, self.rank, self.world_size = job, dataset, rank, world_size
        self.train_part, self.eval_part = dataset.split()
        if self.train_part.num_rows == 0:
            files = ", ".join(dataset.files) or "none matched"
            raise DataError(
                f"data.sources: no rows to train on ({dataset.num_rows} good rows, "
                f"{self.eval_part.num_rows} of them eval; files read: {files})"
            )
        self.epochs = job.train.epochs
        self.epoch_positions, self.restored = True, False
        # Rows over all ranks: each epoch drops the last R mod W (``rank_rows``).
        rows = self.train_part.num_rows
        self.total_rows = (rows - rows % world_size) * self.epochs
        checkpoint = job.output.checkpoint
        self.rules = CheckpointRules(
            on_stop=checkpoint, final=checkpoint, final_before_eval=False, stop_when_drained=False
        )

    def batches(self, epoch: int, skip: int) -> Iterator[Batch]:
        train = self.job.train
        batches = rank_batches(
            self.train_part,
            train.batch_size,
            self.rank,
            self.world_size,
            shuffle=train.shuffle,
            seed=train.seed,
            epoch=epoch,
        )
        # An epoch's batches are a function of (seed, epoch): skip the ones a
        # mid-epoch checkpoint already holds.
        return itertools.islice(batches, skip, None)

    def share(self, batch: Batch) -> StepShare:
        return StepShare(rows=batch.num_rows * self.world_size)  # every rank as many

    def commit(self, share: StepShare) -> None:
        return None  # the position is the loop state's (epoch, epoch_step)

    def position(self) -> dict[str, Any] | None:
        return None

    def commits_paused(self) -> AbstractContextManager[object]:
        return contextlib.nullcontext()  # rows are committed on the loop's thread only

    def bad_rows(self) -> int:
        return self.dataset.bad_rows.count

    def bad_rows_this_run(self) -> int:
        return self.dataset.bad_rows.count  # every run parses the files whole

    def eval_batches(self, batch_size: int) -> Iterator[Batch] | None:
        if not self.eval_part.num_rows:
            return None
        return self.dataset.batches(self.eval_part, batch_size, shuffle=False, seed=0, epoch=0)

    def newest_event_s(self) -> dict[str, float]:
        return {}

    def queue_depths(self) -> dict[str, int]:
        return {}

    def summary(self) -> dict[str, Any]:
        return {"epochs": self.epochs}

    def close(self) -> None:
        return None


def restored_progress(data_progress: dict[str, Any] | None) -> Progress:
    """The data progress of a checkpoint's manifest (or fresh)."""
    if data_progress is None:
        return Progress()
    try:
        return Progress.from_json(data_progress)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError("", f"checkpoint data_progress is unreadable: {exc}") from exc


class GraphFeed:
    """``data.dataset``: batches from the task graph, exactly once (see module
    docstring and ``estuary.train.dataset_eval``).

    Args:
        job: the job.
        plan: its tables and features (hash names, model order).
        num_dense: Dd.
        rank: this trainer's rank r; rank 0 alone reads and records.
        world_size: W: a step is W x B rows, split over the ranks.
        group: with W > 1, the gloo group that carries the batches.
        data_progress: the position to resume from (``None``: the start).
        should_stop: polled while the reader waits for data; a stop ends the batches.
        split_pool: makes the pool rank 0's driver reads whole splits with (a
            cluster runtime's data executors); ``None``: its own threads.
        part_routes: with ``split_pool``, direct delivery: every rank receives
            its part of each step from rank 0 as row ids and fetches the rows
            from the executors' output (``estuary.train.batch_routes``); ``None``:
            rank 0 reads the rows and sends ranks their parts.

    Raises:
        ConfigError: ``train.epochs`` is not 1, or the progress is unreadable.
    """

    def __init__(
        self,
        job: JobSpec,
        plan: TrainPlan,
        num_dense: int,
        *,
        rank: int,
        world_size: int,
        group: Any = None,
        data_progress: dict[str, Any] | None = None,
        should_stop: Callable[[], bool] | None = None,
        split_pool: Callable[[], SplitPool] | None = None,
        part_routes: PartRoutes | None = None,
    ) -> None:
        if job.train.epochs != 1:
            raise ConfigError(
                "train.epochs", "must be 1 with data.dataset (streams are read once, in time order)"
            )
        self.job, self.plan, self.world_size = job, plan, world_size
        self.progress = restored_progress(data_progress)
        self.rows_before = self.progress.rows_trained
        self.epochs, self.total_rows = 1, 0
        self.epoch_positions, self.restored = False, data_progress is not None
        every = job.output.checkpoint_every_steps
        final = rank == 0 and (job.output.checkpoint or every is not None)
        self.rules = CheckpointRules(
            on_stop=final,
            final=final,
            final_before_eval=True,
            stop_when_drained=True,
            stop_finishes=job.train.continuous,
        )
        self.driver = None
        self.mixed = self._mixed_source(job, rank, world_size, part_routes is not None)
        pool = None
        if rank == 0:  # the only reader and planner; a step is W x B rows
            pool = None if split_pool is None else split_pool()
            self.driver = Driver(
                job.data,
                job.base_dir,
                batch_size=job.train.batch_size * world_size,
                seed=job.train.seed,
                hash_names=dict(plan.shared),
                progress=self.progress,
                should_stop=should_stop,  # while idle: end the batches there
                pool=pool,
            )
        self.scatter: BatchScatter | RoutedBatches
        if part_routes is not None:
            decoder = RowDecoder(job.data.schema, dict(plan.shared))
            assembler = PartAssembler(
                decoder.sparse, decoder.sequences, decoder.features, num_dense, part_routes.fetch
            )
            self.scatter = RoutedBatches(
                rank=rank,
                world_size=world_size,
                assembler=assembler,
                routes=part_routes,
                source=(
                    _scaled(job, pool, self.driver.steps(world_size), lambda s: s.rows)
                    if self.driver is not None
                    else None
                ),
            )
            return
        source = self.driver.batches() if self.driver is not None else None
        if source is not None and self.mixed is not None:
            source = self.mixed.batches(source)
        self.scatter = BatchScatter(
            rank=rank,
            world_size=world_size,
            features=list(plan.features),
            num_dense=num_dense,
            source=(
                _scaled(job, pool, source, lambda b: b.num_rows) if source is not None else None
            ),
            group=group,
        )

    def _mixed_source(
        self, job: JobSpec, rank: int, world_size: int, direct: bool
    ) -> BufferedSource | None:
        """Rank 0's ``train.mixed_buffer`` (``None``: not set, or another rank)."""
        spec = job.train.mixed_buffer
        if spec is None:
            return None
        if direct:
            raise ConfigError(
                "train.mixed_buffer", "is not supported with direct data delivery (data executors)"
            )
        step_rows = job.train.batch_size * world_size
        check_max_age(spec, step_rows)  # the load checked one trainer's step
        need = STEPS_HELD * step_rows * min_row_bytes(job)
        if spec.capacity_bytes < need:
            raise ConfigError(
                "train.mixed_buffer.capacity_bytes",
                f"{spec.capacity_bytes} bytes cannot hold {STEPS_HELD} steps of {step_rows} "
                f"rows ({world_size} trainers x train.batch_size); set it to at least {need}",
            )
        if rank != 0:
            return None
        return BufferedSource(
            spec, step_rows, self.progress, job.train.seed, live=live_origins(job)
        )

    def batches(self, epoch: int, skip: int) -> Iterator[Batch]:
        return self.scatter.batches()  # the Driver skips what the progress holds

    def share(self, batch: Batch) -> StepShare:
        share = self.scatter.next_share()  # this step's rows over all ranks
        scale = self.world_size / max(share.rows, 1) if self.world_size > 1 else None
        return StepShare(rows=share.rows, row_ids=share.row_ids, loss_scale=scale)

    def commit(self, share: StepShare) -> None:
        if share.row_ids is not None:
            self.progress.record(share.row_ids)  # committed with the next checkpoint

    def position(self) -> dict[str, Any] | None:
        return self.progress.to_json()

    def commits_paused(self) -> AbstractContextManager[object]:
        # The mixed buffer's dropped rows are recorded as they drop, in hybrid
        # or async mode on the read-ahead thread, with their progressive scores.
        return self.mixed.commit_lock if self.mixed is not None else contextlib.nullcontext()

    def bad_rows(self) -> int:
        return self.driver.bad_rows.count if self.driver is not None else 0

    def bad_rows_this_run(self) -> int:
        return self.driver.bad_rows_this_run.count if self.driver is not None else 0

    def eval_batches(self, batch_size: int) -> Iterator[Batch] | None:
        spec = self.job.data.dataset
        if spec is None or spec.eval_stream is None:
            return None
        return stream_batches(self.job, self.plan, spec.eval_stream, batch_size)

    def newest_event_s(self) -> dict[str, float]:
        return {stream: float(s) for stream, s in self.progress.newest_window_s.items()}

    def queue_depths(self) -> dict[str, int]:
        return self.driver.queue_depths() if self.driver is not None else {}

    def summary(self) -> dict[str, Any]:
        return {
            "epochs": 1,
            "rows_committed": self.progress.rows_trained,
            "rows_committed_before": self.rows_before,
            "rows_dropped": self.progress.rows_dropped,
            "duplicate_rows": self.progress.duplicate_rows,
            "tasks_committed": self.progress.tasks_committed,
            "batch_send_s": round(self.scatter.send_s, 4),  # rank 0 to W - 1 ranks
            **self._delivery(),
            **(self.driver.summary() if self.driver is not None else {}),
            **({"mixed_buffer": self.mixed.summary()} if self.mixed is not None else {}),
        }

    def _delivery(self) -> dict[str, Any]:
        if not isinstance(self.scatter, RoutedBatches):
            return {"data_delivery": "rank0"}
        return {"data_delivery": "direct", "rows_fetched_rank0": self.scatter.rows_fetched}

    def close(self) -> None:
        if self.mixed is not None:
            self.mixed.stop_reader()  # first: it may be waiting to queue a batch
        if self.driver is not None:
            self.driver.close()  # ends the batch the reader may be waiting for
        if self.mixed is not None:
            self.mixed.join_reader()


def stream_batches(
    job: JobSpec, plan: TrainPlan, stream: str | None, batch_size: int
) -> Iterator[Batch]:
    """One stream of ``data.dataset`` (default ``eval_stream``), read once, in plan
    order, unshuffled, from its first window (no data progress).

    Raises:
        ConfigError: not a ``data.dataset`` job, no such stream, or no stream named
            and no ``eval_stream`` set.
    """
    spec = job.data.dataset
    if spec is None:
        raise ConfigError("data.dataset", "evaluating a stream needs a data.dataset job")
    name = stream if stream is not None else spec.eval_stream
    if name is None:
        raise ConfigError(
            "data.dataset.eval_stream",
            "not set: name the stream to evaluate (estuary eval --stream NAME) "
            "or set data.dataset.eval_stream",
        )
    if name not in spec.streams:
        known = ", ".join(spec.streams)
        raise ConfigError("data.dataset.streams", f"no stream {name!r} (streams: {known})")
    driver = Driver(
        job.data,
        job.base_dir,
        batch_size=batch_size,
        hash_names=dict(plan.shared),
        streams=[name],
        shuffle=False,
    )
    return driver.batches()


def feed_for(
    job: JobSpec,
    dataset: TabularDataset,
    plan: TrainPlan,
    state: LoopState,
    group: Any = None,
    data_progress: dict[str, Any] | None = None,
    split_pool: Callable[[], SplitPool] | None = None,
    part_routes: PartRoutes | None = None,
) -> Feed:
    """The feed of one rank (``state``) for the job's data path: an ``EpochFeed``
    for ``data.sources``, a ``GraphFeed`` for ``data.dataset``."""
    if job.data.dataset is None:
        return EpochFeed(job, dataset, state.rank, state.world_size)
    return GraphFeed(
        job,
        plan,
        len(dataset.dense_names),
        rank=state.rank,
        world_size=state.world_size,
        group=group,
        data_progress=data_progress,
        should_stop=state.stop.asked,
        split_pool=split_pool,
        part_routes=part_routes,
    )


@runtime_checkable
class ScaledPool(Protocol):
    """A split pool that scales itself while rank 0's steps run: a cluster
    runtime's data executors under ``runtime.scaling`` (the runtime layer
    implements it; this layer only hands it the steps)."""

    def scaled(
        self, job: JobSpec, steps: Iterator[_S], rows_of: Callable[[_S], int]
    ) -> Iterator[_S]: ...


def _scaled(
    job: JobSpec, pool: Any, steps: Iterator[_S], rows_of: Callable[[_S], int]
) -> Iterator[_S]:
    """Rank 0's steps under the scaling manager (``runtime.scaling``), if on and
    the pool scales."""
    if not job.runtime.scaling.enabled or not isinstance(pool, ScaledPool):
        return steps
    return pool.scaled(job, steps, rows_of)
