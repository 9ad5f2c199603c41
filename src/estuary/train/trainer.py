"""The training loop: one process, tables in memory, torch for the dense part.

Reads top to bottom: build tables and model from the job, then per step
lookup -> forward -> backward -> dense step -> hand sparse gradients to the
``SparseUpdater`` (inline in sync mode, background in hybrid/async).
"""

from __future__ import annotations

import contextlib
import itertools
import random
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from estuary.config import JobSpec, to_dict
from estuary.data import DataError, DataPart, TabularDataset
from estuary.data.types import Batch
from estuary.embedding import EmbeddingStore, EmbeddingTable
from estuary.metrics.evaluation import EvalResult, evaluate_predictions
from estuary.metrics.progress import ProgressBar
from estuary.metrics.training import TrainingMetrics
from estuary.nn.embedding_collection import EmbeddingCollection, LookedUpBatch
from estuary.nn.models import accepts_sequences, build_model
from estuary.train.checkpoint import load_checkpoint, restore_dense_warned, save_checkpoint
from estuary.train.checkpoint_chain import (
    ChainLink,
    plan_checkpoint,
    prune_checkpoints,
    read_link,
)
from estuary.train.engine import Engine, resolve_device
from estuary.train.plan import TrainPlan, shared_names
from estuary.train.result import FitResult, TrainingStopped
from estuary.train.sparse_updates import LockedStore, SparseUpdater

KEEP_CHECKPOINTS = 2
"""Checkpoints a run keeps while it trains (the newest ones, plus the full
checkpoint and deltas they are built on); older ones and partial ones left by a
killed run are deleted after each checkpoint."""

DENSE_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "adagrad": torch.optim.Adagrad,
    "sgd": torch.optim.SGD,
}


class TableStore(EmbeddingStore, Protocol):
    """A table the trainer can also checkpoint (``EmbeddingTable``, ``RemoteTable``)."""

    def state_dict(self) -> dict[str, np.ndarray]: ...

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None: ...

    def delta_state_dict(self) -> dict[str, np.ndarray]: ...

    def apply_delta(self, delta: dict[str, np.ndarray]) -> None: ...


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


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
    """

    world_size = 1  # trainers in the run (``DistributedTrainer``: W)

    def __init__(
        self,
        job: JobSpec,
        model: nn.Module | None = None,
        *,
        dataset: TabularDataset | None = None,
        tables: Mapping[str, TableStore] | None = None,
        rank: int = 0,
    ) -> None:
        t0 = time.perf_counter()
        self.job = job
        seed_everything(job.train.seed)
        if job.train.threads:
            torch.set_num_threads(job.train.threads)
        self.dataset = (
            dataset
            if dataset is not None
            else TabularDataset(job.data, job.base_dir, hash_names=shared_names(job))
        )
        self.plan = TrainPlan.from_job(job, self.dataset.feature_names)
        self.features = list(self.plan.features)
        self.load_s = time.perf_counter() - t0
        # Tables: one per feature, or one per `shared` group. Features sharing a
        # table hash their values with the group's name, so equal values meet.
        self.tables: dict[str, TableStore] = {}
        for table, spec in self.plan.tables.items():
            if tables is not None:
                if table not in tables or tables[table].dim != spec.dim:
                    raise ValueError(f"tables: need table {table!r} with dim {spec.dim}")
                self.tables[table] = tables[table]
                continue
            self.tables[table] = EmbeddingTable(spec, seed=self.plan.seeds[table], name=table)
        # External tables lock themselves: a LockedStore would hold its lock through a
        # parameter server's staleness wait and so block the push that ends the wait.
        stores: dict[str, EmbeddingStore] = (
            dict(self.tables)
            if tables is not None
            else {name: LockedStore(t) for name, t in self.tables.items()}
        )
        # `pooling: none` leaves sequence features unpooled (the model gets them
        # padded); a one-id feature's row is already unpooled and stays in (B, F, D).
        feature_tables = self.plan.feature_tables
        pooling = {f: self.plan.tables[feature_tables[f]].pooling for f in self.features}
        jagged = self.dataset.jagged
        pooling = {f: "sum" if p == "none" and f not in jagged else p for f, p in pooling.items()}
        embeddings = EmbeddingCollection(self.features, stores, feature_tables, pooling)
        sequence_features = embeddings.sequence_features
        if model is not None and sequence_features and not accepts_sequences(model):
            raise TypeError(
                f"features {sequence_features} have pooling: none, so the model is called as "
                f"forward(dense, sparse, sequences); accept the third argument or wrap the "
                f"model in estuary.nn.SequencePooling"
            )
        model = model or build_model(
            job.model.type,
            job.model.params,
            num_dense=len(self.dataset.dense_names),
            num_sparse=len(self.features),
            embedding_dim=embeddings.dim,
            features=self.features,
            sequence_features=sequence_features,
        )
        # The dense network runs on `device`; tables stay in host memory, looked-up
        # rows go to the device and their gradients come back through autograd.
        device = resolve_device(job.train.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        model.to(device)
        opt = job.train.dense_optimizer
        optimizer = DENSE_OPTIMIZERS[opt.name](
            model.parameters(), lr=opt.lr, weight_decay=opt.weight_decay
        )
        self.engine = Engine(model, embeddings, stores, optimizer, job.train, device)
        self.rank = rank
        # Prometheus metrics (``output.metrics_port``); rank 0 serves them.
        self.metrics = TrainingMetrics(
            port=job.output.metrics_port if rank == 0 else None,
            host=job.output.metrics_host,
            job=job.name,
            mode=job.train.mode,
        )
        self.step = 0
        self.epoch = 0
        self.epoch_step = 0  # steps done in epoch `epoch` (a mid-epoch checkpoint resumes there)
        # data.dataset runs: rows trained (``estuary.data.graph.Progress`` JSON),
        # saved with and restored from checkpoints (train/streaming.py).
        self.data_progress: dict[str, Any] | None = None
        # The checkpoint the tables were last saved to or restored from: the
        # parent of the next delta checkpoint (``output.checkpoint_full_every``).
        self.checkpoint_link: ChainLink | None = None
        self.stop_reason: str | None = None  # set by request_stop

    # -- training ---------------------------------------------------------------

    # The engine's parts, under the names users and tests know.
    model = property(lambda self: self.engine.model, doc="the dense network")
    optimizer = property(lambda self: self.engine.optimizer, doc="the dense optimizer")
    embeddings = property(lambda self: self.engine.embeddings, doc="the EmbeddingCollection")
    device = property(lambda self: self.engine.device, doc="where the dense network runs")
    times = property(lambda self: self.engine.times, doc="per-stage seconds (StageTimes)")

    @property
    def stores(self) -> dict[str, EmbeddingStore]:
        return self.engine.stores

    @property
    def train_model(self) -> nn.Module:
        """What steps call: ``model``, or a DDP wrapper of it with several trainers."""
        return self.engine.train_model

    @train_model.setter
    def train_model(self, module: nn.Module) -> None:
        self.engine.train_model = module

    @property
    def loss_fn(self) -> Any:
        """The loss: ``loss_fn(logits (B,), labels (B,), weight (B,) | None)``."""
        return self.engine.loss_fn

    @loss_fn.setter
    def loss_fn(self, fn: Any) -> None:
        self.engine.loss_fn = fn

    def _train_step(self, batch: Batch, looked_up: LookedUpBatch, updater: SparseUpdater) -> float:
        return self.engine.step(batch, looked_up, updater)

    def sparse_updater(self) -> SparseUpdater:
        """The ``SparseUpdater`` for ``train.mode`` / ``staleness`` / ``sparse_placement``."""
        return self.engine.sparse_updater()

    def _steps(
        self, batches: Iterator[Batch], updater: SparseUpdater
    ) -> Iterator[tuple[Batch, LookedUpBatch]]:
        return self.engine.looked_up(batches, updater)

    def _epoch_batches(self, part: DataPart, epoch: int) -> Iterator[Batch]:
        """This trainer's training batches of one epoch (a multi-trainer run's
        ``DistributedTrainer`` reads only its share)."""
        train = self.job.train
        return self.dataset.batches(
            part, train.batch_size, shuffle=train.shuffle, seed=train.seed, epoch=epoch
        )

    def _refresh_metrics(self, updater: SparseUpdater, *, bad_rows: int) -> None:
        """Table stats, staleness and bad rows to ``self.metrics``; called every
        ``metrics.refresh_s`` seconds, as stats take each table's lock."""
        stats = {name: t.stats() for name, t in self.tables.items()}
        self.metrics.refresh(stats, staleness_max=updater.log.max_behind, bad_rows=bad_rows)

    def fit(self, *, progress: bool | None = None) -> FitResult:
        """Train for ``train.epochs``, evaluate, checkpoint, return the result;
        serves ``/metrics`` meanwhile when ``output.metrics_port`` is set."""
        with self.metrics.serving():  # the port is released when fit returns
            if self.job.data.dataset is not None:  # streams through the task graph
                from estuary.train.streaming import fit_streaming

                return fit_streaming(self, progress=progress)
            return self._fit_sources(progress=progress)

    def request_stop(self, reason: str) -> None:
        """Ask a running ``fit`` to stop after the step in progress: it writes a
        checkpoint of that step (when the job writes checkpoints) and raises
        ``TrainingStopped``. Safe to call from a signal handler. One-process runs
        only: several trainers would have to agree on the step."""
        self.stop_reason = reason

    def stop_asked(self) -> bool:
        """Whether a stop was asked of this process (no collective; safe from any
        thread)."""
        return self.stop_reason is not None

    def asked_reason(self) -> str:
        """What asked for the stop (``stop_asked()`` is True)."""
        return self.stop_reason or "a stop request"

    def poll_stop(self) -> bool:
        """Whether to stop now (called between steps; several trainers agree on
        it, see ``DistributedTrainer.poll_stop``)."""
        return self.stop_reason is not None

    def stop_now(self, updater: SparseUpdater, *, saved_step: int | None) -> None:
        """Checkpoint the current step (unless ``saved_step`` already is it, or the
        job writes no checkpoints; rank 0 only) and raise ``TrainingStopped``."""
        path = None
        if self.rank == 0 and self.job.output.checkpoint and saved_step != self.step:
            path = self.checkpoint_now(updater)
        elif saved_step == self.step and self.checkpoint_link is not None:
            path = self.checkpoint_link.path
        raise TrainingStopped(self.stop_reason or "a stop request", self.step, path)

    def _fit_sources(self, *, progress: bool | None) -> FitResult:
        """``fit`` for ``data.sources`` jobs: epochs over the loaded dataset."""
        job = self.job
        show = job.output.progress if progress is None else progress
        train_part, eval_part = self.dataset.split()
        if train_part.num_rows == 0:
            files = ", ".join(self.dataset.files) or "none matched"
            raise DataError(
                f"data.sources: no rows to train on ({self.dataset.num_rows} good rows, "
                f"{eval_part.num_rows} of them eval; files read: {files})"
            )
        train_rows_per_epoch = train_part.num_rows
        updater = self.sparse_updater()
        rows_done = 0
        t_start = time.perf_counter()
        bar = ProgressBar(total=train_rows_per_epoch * job.train.epochs, enabled=show)
        try:
            every = job.output.checkpoint_every_steps if self.rank == 0 else None
            saved_step = None
            for epoch in range(self.epoch, job.train.epochs):
                self.epoch = epoch
                done_before = self.epoch_step  # > 0: resumed from a mid-epoch checkpoint
                # Later epochs re-read rows already counted for admission (tables
                # on a parameter server too: every rank may switch it, idempotently).
                for table in self.tables.values():
                    switch = getattr(table, "set_admission_counting", None)
                    if switch is not None:  # EmbeddingTable, RemoteTable
                        switch(epoch == 0)
                # An epoch's batches are a function of (seed, epoch): skip the ones
                # a mid-epoch checkpoint already holds.
                batches = itertools.islice(
                    self._epoch_batches(train_part, epoch), done_before, None
                )
                for batch, looked_up in self._steps(batches, updater):
                    loss = self._train_step(batch, looked_up, updater)
                    self.step += 1
                    self.epoch_step += 1
                    rows_done += batch.num_rows
                    bar.update(batch.num_rows, loss, epoch)
                    if self.metrics.step(self.step, batch.num_rows * self.world_size, loss):
                        self._refresh_metrics(updater, bad_rows=self.dataset.bad_rows.count)
                    if every is not None and self.step % every == 0:
                        self.checkpoint_now(updater)
                        saved_step = self.step
                    if self.poll_stop():
                        self.stop_now(updater, saved_step=saved_step)
                self.epoch, self.epoch_step = epoch + 1, 0
            updater.flush()
        finally:
            updater.close()
            bar.close()
        train_wall_s = time.perf_counter() - t_start
        samples_per_s = rows_done / train_wall_s if train_wall_s > 0 else 0.0
        chief = self.rank == 0  # one trainer evaluates and checkpoints
        result = self.evaluate(eval_part) if eval_part.num_rows and chief else None
        if result is not None:
            self.metrics.evaluated(result)
        checkpoint = self.save_checkpoint() if job.output.checkpoint and chief else None
        if checkpoint is not None:
            self.metrics.checkpointed(self.step)
        stats = {name: t.stats() for name, t in self.tables.items()}
        bad_rows = self.dataset.bad_rows.count
        self.metrics.refresh(stats, staleness_max=updater.log.max_behind, bad_rows=bad_rows)
        self.metrics.trained(samples_per_s * self.world_size)
        return FitResult(
            eval=result,
            train_rows=rows_done,
            eval_rows=eval_part.num_rows,
            bad_rows=bad_rows,
            samples_per_s=samples_per_s,
            wall_s=time.perf_counter() - t_start + self.load_s,
            mode=job.train.mode,
            checkpoint=checkpoint,
            profile=self.times.as_dict(),
            extra={
                "epochs": job.train.epochs,
                "steps": self.step,
                "train_wall_s": train_wall_s,
                "load_s": self.load_s,
                "max_staleness_seen": updater.log.max_behind,
                "sparse_placement": updater.placement.value,
                "precision": job.train.precision,
                "device": str(self.device),
                "embedding_rows": sum(s.rows for s in stats.values()),
                "embedding_bytes": sum(s.bytes for s in stats.values()),
                "unknown_grads": sum(s.unknown_grads for s in stats.values()),
            },
        )

    # -- evaluation -------------------------------------------------------------

    def predict(self, batch: Batch) -> np.ndarray:
        """Click probabilities float32 (B,); lookups never insert ids."""
        return self.engine.predict(batch)

    def evaluate(self, part: Any | None = None) -> EvalResult:
        """AUC / logloss on the eval split (or ``part``)."""
        if part is None:
            _, part = self.dataset.split()
        labels, probabilities = [], []
        for batch in self.dataset.batches(
            part, self.job.train.eval_batch_size, shuffle=False, seed=0, epoch=0
        ):
            probabilities.append(self.predict(batch))
            labels.append(batch.labels)
        if not labels:
            return evaluate_predictions(np.zeros(0), np.zeros(0))
        return evaluate_predictions(np.concatenate(labels), np.concatenate(probabilities))

    # -- checkpoints --------------------------------------------------------------

    def checkpoint_root(self) -> Path:
        return self.job.resolve(self.job.output.dir) / "checkpoints"

    def save_checkpoint(self, root: Path | None = None) -> Path:
        """Write model, dense optimizer and every table atomically: the tables in
        full, or as a delta of the previous checkpoint (``plan_checkpoint``)."""
        root = root or self.checkpoint_root()
        plan = plan_checkpoint(
            self.checkpoint_link,
            root=root,
            step=self.step,
            full_every=self.job.output.checkpoint_full_every,
        )
        parent, tables = plan.parent, None
        if parent is not None:  # a delta: rows changed since the parent
            tables = {name: t.delta_state_dict() for name, t in self.tables.items()}
            if not parent.accepts(tables):  # a table was marked since: write it full
                parent, tables = None, None
        if tables is None:  # full: every row (also marks the tables clean)
            tables = {name: t.state_dict() for name, t in self.tables.items()}
        path = save_checkpoint(
            root,
            step=self.step,
            model=self.model,
            optimizer=self.optimizer,
            tables=tables,
            parent=parent,
            metadata={
                "job": to_dict(self.job, resolve_paths=True),
                "epoch": self.epoch,
                "epoch_step": self.epoch_step,
                "features": self.features,
                "dense": list(self.dataset.dense_names),
                **({"data_progress": self.data_progress} if self.data_progress else {}),
            },
        )
        self.checkpoint_link = read_link(path)
        return path

    def checkpoint_now(self, updater: SparseUpdater) -> Path:
        """A checkpoint in the middle of training, consistent with itself: every
        submitted sparse update lands first and no prefetch lookup runs during the
        snapshot. Keeps the ``KEEP_CHECKPOINTS`` newest (and the checkpoints their
        delta chains are built on)."""
        updater.flush()  # Blocking wait: every submitted sparse update lands first
        with contextlib.ExitStack() as stack:
            for store in self.stores.values():
                if isinstance(store, LockedStore):
                    stack.enter_context(store.lock)  # no prefetch lookup mid-snapshot
            path = self.save_checkpoint()
        prune_checkpoints(path.parent, keep=KEEP_CHECKPOINTS, newest=path)
        self.metrics.checkpointed(self.step)
        return path

    def load_checkpoint(self, path: Path) -> None:
        """Restore model, dense optimizer and tables from ``path`` (a checkpoint
        folder, a checkpoints root or a run folder)."""
        ckpt = load_checkpoint(path)
        restore_dense_warned(ckpt, self.job, self.model, self.optimizer, tables=True)
        ckpt.restore_tables(self.tables)  # a delta: its full checkpoint, then each delta
        self.checkpoint_link = ckpt.link
        self.step = int(ckpt.manifest["step"])
        self.epoch = int(ckpt.manifest["metadata"].get("epoch", 0))
        self.epoch_step = int(ckpt.manifest["metadata"].get("epoch_step", 0))
        self.data_progress = ckpt.manifest["metadata"].get("data_progress")
