"""The training loop: one process, tables in memory, torch for the dense part.

Reads top to bottom: build tables and model from the job, then per step
lookup -> forward -> backward -> dense step -> hand sparse gradients to the
``SparseUpdater`` (inline in sync mode, background in hybrid/async).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import random
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from estuary import plugins
from estuary.config import JobSpec, to_dict
from estuary.data import DataError, DataPart, TabularDataset
from estuary.data.types import Batch
from estuary.embedding import EmbeddingStore, EmbeddingTable
from estuary.metrics.evaluation import EvalResult, evaluate_predictions
from estuary.metrics.progress import ProgressBar
from estuary.metrics.training import TrainingMetrics
from estuary.nn.embedding_collection import EmbeddingCollection, LookedUpBatch
from estuary.nn.models import accepts_sequences, build_model
from estuary.nn.types import SequenceEmbedding, Sequences
from estuary.registry import Registry
from estuary.train.checkpoint import load_checkpoint, restore_dense_warned, save_checkpoint
from estuary.train.checkpoint_chain import (
    ChainLink,
    plan_checkpoint,
    prune_checkpoints,
    read_link,
)
from estuary.train.pipeline import Prefetcher, StageTimes
from estuary.train.placement import Placement
from estuary.train.sparse_updates import LockedStore, SparseUpdater

KEEP_CHECKPOINTS = 2
"""Checkpoints a run keeps while it trains (the newest ones, plus the full
checkpoint and deltas they are built on); older ones and partial ones left by a
killed run are deleted after each checkpoint."""

DENSE_OPTIMIZERS: Registry[Callable[..., torch.optim.Optimizer]] = plugins.DENSE_OPTIMIZERS
"""``train.dense_optimizer.name`` -> torch optimizer class (adam, adamw, adagrad, sgd)."""


class TableStore(EmbeddingStore, Protocol):
    """A table the trainer can also checkpoint (``EmbeddingTable``, ``RemoteTable``)."""

    def state_dict(self) -> dict[str, np.ndarray]: ...

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None: ...

    def delta_state_dict(self) -> dict[str, np.ndarray]: ...

    def apply_delta(self, delta: dict[str, np.ndarray]) -> None: ...


class TrainingStopped(Exception):
    """``fit`` stopped early on ``Trainer.request_stop`` (e.g. SIGTERM), after the
    step in progress and a checkpoint of it: ``--resume`` continues from there.

    Args:
        reason: what asked for the stop (e.g. ``SIGTERM``).
        step: the global step the run stopped after.
        checkpoint: the checkpoint written (None when the job writes none).
    """

    def __init__(self, reason: str, step: int, checkpoint: Path | None) -> None:
        where = f"checkpoint {checkpoint}" if checkpoint is not None else "no checkpoint"
        super().__init__(f"stopped by {reason} after step {step}; {where}")
        self.reason, self.step, self.checkpoint = reason, step, checkpoint

    def __reduce__(self) -> tuple[type[TrainingStopped], tuple[str, int, Path | None]]:
        return TrainingStopped, (self.reason, self.step, self.checkpoint)  # crosses processes


@dataclass
class FitResult:
    """What a training run produced (also written as ``summary.json``).

    Args:
        eval: metrics on the eval split (``None`` when ``eval_fraction`` is 0).
        train_rows: training rows processed (over all epochs).
        eval_rows: rows in the eval split.
        bad_rows: malformed input rows skipped.
        samples_per_s: training rows per second of training-loop wall time.
        wall_s: whole run, data loading included.
        mode: ``train.mode``.
        checkpoint: the checkpoint folder written, if any.
        profile: per-stage seconds.
        extra: more figures (epochs, steps, table stats).
    """

    eval: EvalResult | None
    train_rows: int
    eval_rows: int
    bad_rows: int
    samples_per_s: float
    wall_s: float
    mode: str
    checkpoint: Path | None = None
    profile: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def auc(self) -> float:
        return self.eval.auc if self.eval else float("nan")

    @property
    def logloss(self) -> float:
        return self.eval.logloss if self.eval else float("nan")

    def summary(self) -> dict[str, Any]:
        """JSON-able summary (NaN written as null)."""

        def clean(x: float) -> float | None:
            return None if math.isnan(x) else x

        out: dict[str, Any] = {
            "auc": clean(self.auc),
            "logloss": clean(self.logloss),
            "train_rows": self.train_rows,
            "eval_rows": self.eval_rows,
            "bad_rows": self.bad_rows,
            "samples_per_s": self.samples_per_s,
            "wall_s": self.wall_s,
            "mode": self.mode,
            "checkpoint": str(self.checkpoint) if self.checkpoint else None,
        }
        if self.eval is not None:
            out["calibration"] = clean(self.eval.calibration)
            out["label_mean"] = clean(self.eval.label_mean)
        out["profile"] = self.profile
        out.update(self.extra)
        return out


def resolve_device(name: str) -> torch.device:
    """``train.device`` -> a torch device: ``auto`` takes CUDA when present."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "train.device: 'cuda' requested but torch sees no CUDA device "
            f"(torch {torch.__version__}, built with CUDA: {torch.version.cuda or 'no'})"
        )
    return torch.device(name)


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
        # Tables: one per feature, or one per `shared` group. Features sharing a
        # table hash their values with the group's seed, so equal values meet.
        shared_names = {m: g for g, ms in job.model.embedding.shared.items() for m in ms}
        self.dataset = (
            dataset
            if dataset is not None
            else TabularDataset(job.data, job.base_dir, hash_names=shared_names)
        )
        self.features = list(self.dataset.feature_names)
        self.load_s = time.perf_counter() - t0
        feature_tables = {f: shared_names.get(f, f) for f in self.features}
        self.tables: dict[str, TableStore] = {}
        for i, table in enumerate(dict.fromkeys(feature_tables.values())):
            spec = job.table_spec(table)
            if tables is not None:
                if table not in tables or tables[table].dim != spec.dim:
                    raise ValueError(f"tables: need table {table!r} with dim {spec.dim}")
                self.tables[table] = tables[table]
                continue
            self.tables[table] = EmbeddingTable(
                spec, seed=job.train.seed * 1_000_003 + i, name=table
            )
        # External tables lock themselves: a LockedStore would hold its lock through a
        # parameter server's staleness wait and so block the push that ends the wait.
        self.stores: dict[str, EmbeddingStore] = (
            dict(self.tables)
            if tables is not None
            else {name: LockedStore(t) for name, t in self.tables.items()}
        )
        # `pooling: none` leaves sequence features unpooled (the model gets them
        # padded); a one-id feature's row is already unpooled and stays in (B, F, D).
        pooling = {f: job.table_spec(feature_tables[f]).pooling for f in self.features}
        jagged = self.dataset.jagged
        pooling = {f: "sum" if p == "none" and f not in jagged else p for f, p in pooling.items()}
        self.embeddings = EmbeddingCollection(self.features, self.stores, feature_tables, pooling)
        sequence_features = self.embeddings.sequence_features
        if model is not None and sequence_features and not accepts_sequences(model):
            raise TypeError(
                f"features {sequence_features} have pooling: none, so the model is called as "
                f"forward(dense, sparse, sequences); accept the third argument or wrap the "
                f"model in estuary.nn.SequencePooling"
            )

        num_dense = len(self.dataset.dense_names)
        self.model = model or build_model(
            job.model.type,
            job.model.params,
            num_dense=num_dense,
            num_sparse=len(self.features),
            embedding_dim=self.embeddings.dim,
            features=self.features,
            sequence_features=sequence_features,
        )
        # The dense network runs on `device`; tables stay in host memory, looked-up
        # rows go to the device and their gradients come back through autograd.
        self.device = resolve_device(job.train.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.model.to(self.device)
        self.train_model = self.model  # what steps call: a DDP wrapper with several trainers
        self.rank = rank
        # Prometheus metrics (``output.metrics_port``); rank 0 serves them.
        self.metrics = TrainingMetrics(
            port=job.output.metrics_port if rank == 0 else None,
            host=job.output.metrics_host,
            job=job.name,
            mode=job.train.mode,
        )
        opt = job.train.dense_optimizer
        self.optimizer = DENSE_OPTIMIZERS[opt.name](
            self.model.parameters(), lr=opt.lr, weight_decay=opt.weight_decay
        )
        self.loss_fn = nn.BCEWithLogitsLoss()
        self.bf16 = job.train.precision == "bf16"
        self.step = 0
        self.epoch = 0
        self.epoch_step = 0  # steps done in epoch `epoch` (a mid-epoch checkpoint resumes there)
        self.times = StageTimes()
        # data.dataset runs: rows trained (``estuary.data.graph.Progress`` JSON),
        # saved with and restored from checkpoints (train/streaming.py).
        self.data_progress: dict[str, Any] | None = None
        # The checkpoint the tables were last saved to or restored from: the
        # parent of the next delta checkpoint (``output.checkpoint_full_every``).
        self.checkpoint_link: ChainLink | None = None
        self.stop_reason: str | None = None  # set by request_stop

    # -- training ---------------------------------------------------------------

    def _train_step(self, batch: Batch, looked_up: LookedUpBatch, updater: SparseUpdater) -> float:
        t0 = time.perf_counter()
        self.model.train()
        self.embeddings.train()
        sparse, sequences = self.embeddings.embed(looked_up)  # (B, F, D), {f: (B, L, D)}
        dense = torch.from_numpy(batch.dense)  # (B, Dd)
        labels = torch.from_numpy(batch.labels)  # (B,)
        logits = self._forward(self.train_model, dense, sparse, sequences)
        loss = self.loss_fn(logits, labels.to(self.device))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        t1 = time.perf_counter()
        self.optimizer.step()
        t2 = time.perf_counter()
        updater.submit(self.embeddings.gradients())
        t3 = time.perf_counter()
        self.times.forward_backward_s += t1 - t0
        self.times.dense_step_s += t2 - t1
        self.times.sparse_submit_s += t3 - t2
        self.times.steps += 1
        return float(loss.detach())

    def _forward(
        self, model: nn.Module, dense: torch.Tensor, sparse: torch.Tensor, sequences: Sequences
    ) -> torch.Tensor:
        """Logits float32 (B,) on ``self.device``, under bf16 autocast when asked.
        ``sequences`` (the ``pooling: none`` features) is passed only when not empty."""
        dense = dense.to(self.device, non_blocking=True)
        sparse = sparse.to(self.device, non_blocking=True)
        inputs: list[Any] = [dense, sparse]
        if sequences:
            moved = {
                name: SequenceEmbedding(
                    s.values.to(self.device, non_blocking=True),
                    s.mask.to(self.device, non_blocking=True),
                )
                for name, s in sequences.items()
            }
            inputs.append(moved)
        autocast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if self.bf16
            else contextlib.nullcontext()
        )
        with autocast:
            logits = model(*inputs)
        return logits.float()

    def sparse_updater(self) -> SparseUpdater:
        """The ``SparseUpdater`` for ``train.mode`` / ``staleness`` / ``sparse_placement``."""
        train = self.job.train
        placement = None if train.sparse_placement == "auto" else Placement(train.sparse_placement)
        return SparseUpdater(self.stores, train.mode, train.staleness, placement=placement)

    def _lookup_train(self, batch: Batch) -> LookedUpBatch:
        return self.embeddings.lookup(batch.sparse, train=True)

    def _steps(
        self, batches: Iterator[Batch], updater: SparseUpdater
    ) -> Iterator[tuple[Batch, LookedUpBatch]]:
        """Yield looked-up batches: inline in sync mode, prefetched otherwise."""
        if self.job.train.mode == "sync":
            for batch in batches:
                t0 = time.perf_counter()
                looked_up = self._lookup_train(batch)
                self.times.lookup_s += time.perf_counter() - t0
                yield batch, looked_up
            return
        prefetch = Prefetcher(
            batches,
            self._lookup_train,
            updater.before_lookup,
            first_step=updater.submitted + 1,
            times=self.times,
            placement=updater.placement,
        )
        for _, batch, looked_up in prefetch:
            yield batch, looked_up

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

    @torch.no_grad()
    def predict(self, batch: Batch) -> np.ndarray:
        """Click probabilities float32 (B,); lookups never insert ids."""
        self.model.eval()
        self.embeddings.eval()
        looked_up = self.embeddings.lookup(batch.sparse, train=False)
        sparse, sequences = self.embeddings.embed(looked_up)
        logits = self._forward(self.model, torch.from_numpy(batch.dense), sparse, sequences)
        return torch.sigmoid(logits).cpu().numpy()

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
