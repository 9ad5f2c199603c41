"""A run's checkpoints: what goes in one (model, dense optimizer, tables, loop
state, data position) and how one comes back.

``save`` writes the tables in full or as a delta of the previous checkpoint
(``plan_checkpoint``); ``save_consistent`` first lets every submitted sparse
update land and holds the tables' locks, so a checkpoint taken in the middle of
training is consistent with itself. ``load`` restores a checkpoint into the
run's model, optimizer, tables and ``LoopState``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from estuary.config import JobSpec, to_dict
from estuary.train.callbacks import LoopState
from estuary.train.checkpoint import load_checkpoint, restore_dense_warned, save_checkpoint
from estuary.train.checkpoint_chain import ChainLink, plan_checkpoint, prune_checkpoints, read_link
from estuary.train.engine import Engine
from estuary.train.plan import TrainPlan
from estuary.train.sparse_updates import LockedStore, SparseUpdater

__all__ = ["KEEP_CHECKPOINTS", "Checkpointer"]

logger = logging.getLogger(__name__)

KEEP_CHECKPOINTS = 2
"""Checkpoints a run keeps while it trains (the newest ones, plus the full
checkpoint and deltas they are built on); older ones and partial ones left by a
killed run are deleted after each checkpoint."""


class Checkpointer:
    """Saves and restores one trainer's state.

    Args:
        job: the job (saved resolved in each manifest).
        engine: model and dense optimizer.
        tables: table name -> table (``state_dict``, ``delta_state_dict``, ...).
        plan: the job's plan (its features, in model order, go in the manifest).
        dense: dense feature names (saved in the manifest).
    """

    def __init__(
        self,
        job: JobSpec,
        engine: Engine,
        tables: Mapping[str, Any],
        plan: TrainPlan,
        dense: list[str],
    ) -> None:
        self.job, self.engine, self.tables = job, engine, tables
        self.features, self.dense = list(plan.features), dense
        # The checkpoint the tables were last saved to or restored from: the
        # parent of the next delta checkpoint (``output.checkpoint_full_every``).
        self.link: ChainLink | None = None
        # data.dataset runs: rows trained (``estuary.data.graph.Progress`` JSON),
        # saved with and restored from checkpoints.
        self.data_progress: dict[str, Any] | None = None
        # Called with (step, seconds) after each checkpoint (the fit's RunObserver:
        # metrics and time series).
        self.listeners: list[Callable[[int, float], None]] = []

    def root(self) -> Path:
        return self.job.resolve(self.job.output.dir) / "checkpoints"

    def save(self, state: LoopState, root: Path | None = None) -> Path:
        """Write model, dense optimizer and every table atomically: the tables in
        full, or as a delta of the previous checkpoint (``plan_checkpoint``)."""
        t0 = time.perf_counter()
        path = self._write(state, root)
        self._saved(path, state.step, time.perf_counter() - t0)
        return path

    def _saved(self, path: Path, step: int, duration_s: float) -> None:
        logger.info("checkpoint of step %d in %.2f s: %s", step, duration_s, path)
        for listener in self.listeners:
            listener(step, duration_s)

    def _write(self, state: LoopState, root: Path | None = None) -> Path:
        root = root or self.root()
        plan = plan_checkpoint(
            self.link, root=root, step=state.step, full_every=self.job.output.checkpoint_full_every
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
            step=state.step,
            model=self.engine.model,
            optimizer=self.engine.optimizer,
            tables=tables,
            parent=parent,
            metadata={
                "job": to_dict(self.job, resolve_paths=True),
                "epoch": state.epoch,
                "epoch_step": state.epoch_step,
                "features": self.features,
                "dense": self.dense,
                "restarts": state.restarts,
                **({"data_progress": self.data_progress} if self.data_progress else {}),
            },
        )
        self.link = read_link(path)
        return path

    def save_consistent(self, updater: SparseUpdater, state: LoopState) -> Path:
        """A checkpoint in the middle of training, consistent with itself: every
        submitted sparse update lands first and no prefetch lookup runs during the
        snapshot. Keeps the ``KEEP_CHECKPOINTS`` newest (and the checkpoints their
        delta chains are built on)."""
        t0 = time.perf_counter()
        updater.flush()  # Blocking wait: every submitted sparse update lands first
        with contextlib.ExitStack() as stack:
            for store in self.engine.stores.values():
                if isinstance(store, LockedStore):
                    stack.enter_context(store.lock)  # no prefetch lookup mid-snapshot
            path = self._write(state)
        prune_checkpoints(path.parent, keep=KEEP_CHECKPOINTS, newest=path)
        self._saved(path, state.step, time.perf_counter() - t0)
        return path

    def load(self, path: Path, state: LoopState, *, tables: bool = True) -> None:
        """Restore model, dense optimizer, loop state and data progress from
        ``path`` (a checkpoint folder, a checkpoints root or a run folder), and the
        tables unless ``tables`` is False (another rank restores shared ones)."""
        ckpt = load_checkpoint(path, tables=tables)
        restore_dense_warned(
            ckpt, self.job, self.engine.model, self.engine.optimizer, tables=tables
        )
        if tables:
            ckpt.restore_tables(self.tables)  # a delta: its full checkpoint, then each delta
            self.link = ckpt.link
        metadata = ckpt.manifest["metadata"]
        state.step = int(ckpt.manifest["step"])
        state.epoch = int(metadata.get("epoch", 0))
        state.epoch_step = int(metadata.get("epoch_step", 0))
        state.restarts = int(metadata.get("restarts", 0)) + 1  # this load resumes the run
        self.data_progress = metadata.get("data_progress")
