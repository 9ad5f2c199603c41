"""``Trainer``: one job's training, as one object.

A facade over the parts that do the work (``estuary.train``): ``TrainPlan``
(tables, seeds), ``Engine`` (one step), a ``Feed`` (``EpochFeed`` for
``data.sources``, ``GraphFeed`` for ``data.dataset``), ``FitLoop`` (the loop,
with callbacks), a ``StopSignal`` and a ``Checkpointer``. Reads top to bottom:
build from the job, then ``fit`` runs the loop over the feed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from estuary.config import JobSpec
from estuary.data import DataPart, TabularDataset
from estuary.data.graph.executors import SplitPool
from estuary.data.types import Batch
from estuary.metrics.evaluation import EvalResult
from estuary.metrics.progress import ProgressBar
from estuary.metrics.training import TrainingMetrics
from estuary.train.batch_routes import PartRoutes
from estuary.train.build import (
    DENSE_OPTIMIZERS,
    TableStore,
    build_engine,
    build_tables,
    seed_everything,
)
from estuary.train.callbacks import AdmissionSwitch, Callback, LoopState
from estuary.train.checkpointer import KEEP_CHECKPOINTS, Checkpointer
from estuary.train.engine import UpdatePlan, resolve_device
from estuary.train.feeds import Feed, feed_for
from estuary.train.loop import FitLoop, evaluate_batches
from estuary.train.mixed_feed import BufferedSource, register_collector
from estuary.train.mixture import mixture_plan_for
from estuary.train.plan import TrainPlan, shared_names
from estuary.train.result import FitResult, TrainingStopped
from estuary.train.sparse_updates import SparseUpdater
from estuary.train.stop import LocalStop, StopSignal

__all__ = ["DENSE_OPTIMIZERS", "KEEP_CHECKPOINTS", "FitResult", "TableStore", "Trainer"]
__all__ += ["TrainingStopped", "resolve_device", "seed_everything"]  # re-exported


class Trainer:
    """Trains one job.

    Args:
        job: the validated job spec.
        model: a ``torch.nn.Module`` with ``forward(dense (B, Dd), sparse (B, F, D))
            -> logits (B,)`` (plus ``sequences``, feature -> ``SequenceEmbedding``,
            when some feature has ``pooling: none``); ``None`` builds
            ``job.model.type`` from the registry.
        dataset: an already loaded dataset (else read from ``job.data``).
        tables: table name -> an external table (e.g. a parameter server's
            ``RemoteTable``) instead of in-process ones; used as given, so it must
            be thread-safe.
        rank: this trainer's rank in a multi-trainer run; only rank 0 evaluates
            and writes the checkpoint.
        world_size: trainers in the run (W); the runtime sets up the rest.
        stop: the run's stop signal (default: a ``LocalStop``).
        callbacks: more callbacks for ``fit`` (see ``estuary.train.callbacks``).
    """

    default_callbacks: ClassVar[list[Callable[[], Callback]]] = []
    """Factories of callbacks every Trainer gets, e.g. a ``FaultInjection`` that a
    test installs before the command line runs in a subprocess."""

    def __init__(
        self,
        job: JobSpec,
        model: nn.Module | None = None,
        *,
        dataset: TabularDataset | None = None,
        tables: Mapping[str, TableStore] | None = None,
        rank: int = 0,
        world_size: int = 1,
        stop: StopSignal | None = None,
        callbacks: Sequence[Callback] = (),
    ) -> None:
        t0 = time.perf_counter()
        self.job = job
        seed_everything(job.train.seed)
        if job.train.threads:
            torch.set_num_threads(job.train.threads)
        if dataset is None:
            dataset = TabularDataset(job.data, job.base_dir, hash_names=shared_names(job))
        self.dataset = dataset
        self.plan = TrainPlan.from_job(job, dataset.feature_names)
        self.features = list(self.plan.features)
        self.load_s = time.perf_counter() - t0
        self.tables: dict[str, TableStore] = build_tables(self.plan, tables)
        self.engine = build_engine(
            job,
            self.plan,
            self.tables,
            external=tables is not None,
            num_dense=len(dataset.dense_names),
            jagged=dataset.jagged,
            model=model,
        )
        self.state = LoopState(rank=rank, world_size=world_size, stop=stop or LocalStop())
        # Prometheus metrics (``output.metrics_port``); rank 0 serves them.
        self.metrics = TrainingMetrics(
            port=job.output.metrics_port if rank == 0 else None,
            host=job.output.metrics_host,
            job=job.name,
            mode=job.train.mode,
        )
        dense = list(dataset.dense_names)
        self.checkpointer = Checkpointer(
            job, self.engine, self.tables, self.metrics, self.plan, dense
        )
        self.callbacks = [make() for make in self.default_callbacks] + list(callbacks)
        self.restores_tables = True  # False: another rank restores shared tables
        self.data_group: Any = None  # W > 1, data.dataset: the group batches travel on
        # Each batch's UpdatePlan (e.g. by ``batch.origin``); None: the plain step.
        # A mixture model's update rules give one (``estuary.train.mixture``).
        mixture_plans = mixture_plan_for(
            self.engine.model, self.plan.tables, self.engine.embeddings.features
        )
        self.plan_for: Callable[[Batch], UpdatePlan | None] | None = mixture_plans
        if mixture_plans is not None and mixture_plans.history_ids is not None:
            # Which ids the history had: checkpointed, so a resume knows them.
            self.checkpointer.extras["history_ids"] = mixture_plans.history_ids
        # data.dataset: makes the pool rank 0 reads whole splits with (a cluster
        # runtime's data executors); None: the driver's own threads.
        self.split_pool: Callable[[], SplitPool] | None = None
        # With ``split_pool``: every rank receives its rows from the executors
        # (direct delivery); None: rank 0 reads and sends ranks their parts.
        self.part_routes: PartRoutes | None = None

    # The parts, under the names users and tests know.
    model = property(lambda self: self.engine.model, doc="the dense network")
    optimizer = property(lambda self: self.engine.optimizer, doc="the dense optimizer")
    embeddings = property(lambda self: self.engine.embeddings, doc="the EmbeddingCollection")
    device = property(lambda self: self.engine.device, doc="where the dense network runs")
    loss_fn = property(lambda self: self.engine.loss_fn, doc="loss(logits, labels[, weight])")
    rank = property(lambda self: self.state.rank, doc="this trainer's rank")
    world_size = property(lambda self: self.state.world_size, doc="trainers in the run")
    checkpoint_link = property(lambda self: self.checkpointer.link, doc="last checkpoint")
    step = property(lambda self: self.state.step, doc="global steps done")
    epoch = property(lambda self: self.state.epoch, doc="the epoch in progress")
    data_progress = property(
        lambda self: self.checkpointer.data_progress, doc="data.dataset: rows trained"
    )

    def feed(self) -> Feed:
        """This trainer's feed for the job's data path."""
        data_progress = self.checkpointer.data_progress
        return feed_for(
            self.job,
            self.dataset,
            self.plan,
            self.state,
            self.data_group,
            data_progress,
            split_pool=self.split_pool,
            part_routes=self.part_routes,
        )

    def fit(self, *, progress: bool | None = None) -> FitResult:
        """Train, evaluate (rank 0), checkpoint, return the result; serves
        ``/metrics`` meanwhile when ``output.metrics_port`` is set."""
        show = self.job.output.progress if progress is None else progress
        # One bar for the run: rank 0's, counting every rank's rows (a step's rows
        # over all ranks, ``StepShare.rows``) against the run's total.
        show = bool(show) and self.state.chief
        with self.metrics.serving():  # the port is released when fit returns
            feed = self.feed()
            extra = [AdmissionSwitch(self.tables.values())] if feed.epoch_positions else []
            loop = FitLoop(
                self.engine,
                feed,
                self.state,
                self.checkpointer,
                self.metrics,
                self.tables,
                callbacks=[*extra, *self.callbacks],
                progress=show,
                load_s=self.load_s,
                plan_for=self.plan_for,
            )
            mixed = getattr(feed, "mixed", None)  # train.mixed_buffer (rank 0)
            if not isinstance(mixed, BufferedSource):
                return loop.run()
            collector = register_collector(self.metrics, mixed)
            try:
                return loop.run()
            finally:
                self.metrics.registry.unregister(collector)

    def request_stop(self, reason: str) -> None:
        """Ask a running ``fit`` to stop after the step in progress: it writes a
        checkpoint of that step (when the job writes checkpoints) and raises
        ``TrainingStopped``. Safe to call from a signal handler; with several
        trainers, all stop after one step they agree on."""
        self.state.stop.request(reason)

    def stop_asked(self) -> bool:
        """Whether a stop was asked of this process (no collective; any thread)."""
        return self.state.stop.asked()

    def sparse_updater(self) -> SparseUpdater:
        """The ``SparseUpdater`` for ``train.mode`` / ``staleness`` / ``sparse_placement``."""
        return self.engine.sparse_updater()

    def predict(self, batch: Batch) -> np.ndarray:
        """Click probabilities float32 (B,); lookups never insert ids."""
        return self.engine.predict(batch)

    def evaluate(
        self,
        part: DataPart | None = None,
        *,
        progress: bool = False,
        sink: Callable[[Batch, np.ndarray], None] | None = None,
    ) -> EvalResult:
        """AUC / logloss on the eval split (or ``part``); ``progress``: a bar of
        rows evaluated on stderr; ``sink``: gets each batch and its probabilities."""
        if part is None:
            _, part = self.dataset.split()
        size = self.job.train.eval_batch_size
        batches = self.dataset.batches(part, size, shuffle=False, seed=0, epoch=0)
        bar = ProgressBar(part.num_rows, enabled=progress, desc="eval")
        return evaluate_batches(self.predict, batches, bar, sink)

    def save_checkpoint(self, root: Path | None = None) -> Path:
        """Write model, dense optimizer and every table (full, or a delta)."""
        return self.checkpointer.save(self.state, root)

    def checkpoint_now(self, updater: SparseUpdater) -> Path:
        """A checkpoint consistent with itself in the middle of training."""
        return self.checkpointer.save_consistent(updater, self.state)

    def load_checkpoint(self, path: Path) -> None:
        """Restore model, dense optimizer, tables, step and data progress from
        ``path`` (a checkpoint folder, a checkpoints root or a run folder). With
        several trainers every rank calls it; only one restores the tables."""
        self.checkpointer.load(path, self.state, tables=self.restores_tables)
