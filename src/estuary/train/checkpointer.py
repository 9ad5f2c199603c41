"""A run's checkpoints: what goes in one (model, dense optimizer, tables, loop
state, data position) and how one comes back.

``save`` writes the tables in full or as a delta of the previous checkpoint
(``plan_checkpoint``); ``save_consistent`` first lets every submitted sparse
update land and holds the tables' locks, so a checkpoint taken in the middle of
training is consistent with itself. ``save_async`` takes the same consistent
snapshot but writes the files in the background (``output.checkpoint_async``;
tables on parameter servers are written by the servers themselves, in
parallel), so training stalls only for the copy; ``wait`` joins it. ``load``
restores a checkpoint into the run's model, optimizer, tables and ``LoopState``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from estuary.config import JobSpec, to_dict
from estuary.embedding.delta import BASE, LINEAGE
from estuary.metrics.training import TrainingMetrics
from estuary.ps.held import ReadyState, Snapshot
from estuary.ps.sharded import ROUTING_METADATA, restore_routing, routing_metadata
from estuary.ps.snapshots import MixedSnapshotError, ServerSnapshot, held_by_servers
from estuary.train.callbacks import LoopState
from estuary.train.checkpoint import (
    StagedCheckpoint,
    load_checkpoint,
    read_extra,
    restore_dense_warned,
    save_checkpoint,
    stage_checkpoint,
    table_versions,
)
from estuary.train.checkpoint_chain import (
    ChainLink,
    CheckpointError,
    plan_checkpoint,
    prune_checkpoints,
    read_link,
)
from estuary.train.engine import Engine
from estuary.train.plan import TrainPlan
from estuary.train.sparse_updates import LockedStore, SparseUpdater

__all__ = ["KEEP_CHECKPOINTS", "CheckpointExtra", "Checkpointer"]

# extra name -> its state (``CheckpointExtra.checkpoint_state``)
ExtraStates = dict[str, dict[str, torch.Tensor]]


class CheckpointExtra(Protocol):
    """Training state beyond model, optimizer and tables, saved with each
    checkpoint as ``extra/<name>.safetensors`` (``Checkpointer.extras``)."""

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """A copy of the state as tensors (taken at the step)."""
        ...

    def restore_state(self, tensors: dict[str, torch.Tensor] | None) -> None:
        """Back to ``tensors`` (``None``: the checkpoint has none: start empty)."""
        ...


logger = logging.getLogger(__name__)

KEEP_CHECKPOINTS = 2
"""Checkpoints a run keeps while it trains (the newest ones, plus the full
checkpoint and deltas they are built on); older ones and partial ones left by a
killed run are deleted after each checkpoint."""


@dataclass
class _Snapshot:
    """One step's state, set apart, for a background commit (``save_async``)."""

    staged: StagedCheckpoint
    servers: Future[ServerSnapshot] | None  # tables whose servers write their own parts
    states: dict[str, Snapshot]  # in-process tables' states (or deltas), gathered later
    dense: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None
    metadata: dict[str, Any]
    extras: dict[str, dict[str, torch.Tensor]]


def _on_top_of(parent: ChainLink, states: Mapping[str, Snapshot]) -> bool:
    """Whether these (in-process) tables' deltas were taken against ``parent``
    (the tables on servers are checked once their chain keys are back)."""
    return all(
        BASE in s.chain
        and (int(s.chain[LINEAGE][0]), int(s.chain[BASE][0])) == parent.versions.get(name)
        for name, s in states.items()
    )


def _cloned(state: dict[str, Any]) -> dict[str, Any]:
    """A torch optimizer state dict whose tensors are copies (the optimizer goes on
    stepping its own)."""
    return {
        "state": {
            key: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in values.items()}
            for key, values in state["state"].items()
        },
        "param_groups": copy.deepcopy(state["param_groups"]),
    }


class _Inconsistent(Exception):
    """An asynchronous checkpoint that would not load as written (it is dropped)."""


def _snapshot(table: Any, *, delta: bool) -> Snapshot:
    """An in-process table's state at this moment: ``EmbeddingTable.snapshot``
    (rows copied now, gathered by the writer), else the state dict itself."""
    if hasattr(table, "snapshot"):
        snapshot: Snapshot = table.snapshot(delta=delta)
        return snapshot
    return ReadyState(table.delta_state_dict() if delta else table.state_dict())


class Checkpointer:
    """Saves and restores one trainer's state.

    Args:
        job: the job (saved resolved in each manifest).
        engine: model and dense optimizer.
        tables: table name -> table (``state_dict``, ``delta_state_dict``, ...).
        metrics: told of each checkpoint (count, step, seconds).
        plan: the job's plan (its features, in model order, go in the manifest).
        dense: dense feature names (saved in the manifest).
    """

    def __init__(
        self,
        job: JobSpec,
        engine: Engine,
        tables: Mapping[str, Any],
        metrics: TrainingMetrics,
        plan: TrainPlan,
        dense: list[str],
    ) -> None:
        self.job, self.engine, self.tables, self.metrics = job, engine, tables, metrics
        self.features, self.dense = list(plan.features), dense
        # The checkpoint the tables were last saved to or restored from: the
        # parent of the next delta checkpoint (``output.checkpoint_full_every``).
        self.link: ChainLink | None = None
        # data.dataset runs: rows trained (``estuary.data.graph.Progress`` JSON),
        # saved with and restored from checkpoints.
        self.data_progress: dict[str, Any] | None = None
        # Mid-run checkpoints: how many, training time they took (stall), and time
        # until committed (write; equal to the stall for blocking ones).
        self.timings: dict[str, float] = {
            "checkpoints": 0,
            "checkpoint_stall_s": 0.0,
            "checkpoint_write_s": 0.0,
            "checkpoints_dropped": 0,
        }
        self._pending: threading.Thread | None = None  # an asynchronous checkpoint's writer
        self._job_dict: dict[str, Any] | None = None
        # Called with (step, seconds until committed) after each checkpoint (the
        # fit's RunObserver: the time series); an asynchronous one's, on its writer.
        self.listeners: list[Callable[[int, float], None]] = []
        self._error: BaseException | None = None
        # Other training state saved with each checkpoint and restored by
        # ``load`` (name -> owner), e.g. a mixture's ``history_ids``.
        self.extras: dict[str, CheckpointExtra] = {}
        # After ``load``: the loaded checkpoint's extra state not yet claimed by
        # an owner (``add_extra``; e.g. progressive evaluation's, made by fit),
        # read from the checkpoint when claimed: a rank or run that never claims
        # one (progressive evaluation is rank 0's, or off) holds none of it.
        self._loaded_extras: dict[str, Callable[[], dict[str, torch.Tensor] | None]] | None = None

    def add_extra(self, name: str, owner: CheckpointExtra) -> None:
        """Save ``owner``'s state with each checkpoint as ``name``; after a
        ``load``, first restore it from that checkpoint (``None`` to the owner
        when the checkpoint has none, e.g. written before it was saved; once)."""
        self.extras[name] = owner
        if self._loaded_extras is not None:
            read = self._loaded_extras.pop(name, None)
            owner.restore_state(None if read is None else read())
            if not self._loaded_extras:
                self._loaded_extras = None

    def root(self) -> Path:
        return self.job.resolve(self.job.output.dir) / "checkpoints"

    def save(self, state: LoopState, root: Path | None = None) -> Path:
        """Write model, dense optimizer and every table atomically: the tables in
        full, or as a delta of the previous checkpoint (``plan_checkpoint``)."""
        started = time.perf_counter()
        path = self._write(state, root)
        self._saved(path, state.step, time.perf_counter() - started)
        return path

    def _saved(self, path: Path, step: int, duration_s: float) -> None:
        """Tell the log, the metrics and the listeners of a committed checkpoint."""
        logger.info("checkpoint of step %d in %.2f s: %s", step, duration_s, path)
        self.metrics.checkpointed(step, duration_s)
        for listener in list(self.listeners):
            listener(step, duration_s)

    def capture_extras(self) -> ExtraStates:
        """Every extra's state now (``add_extra``), to save with a checkpoint
        whose data position was captured at the same moment."""
        return {name: extra.checkpoint_state() for name, extra in self.extras.items()}

    def _write(
        self, state: LoopState, root: Path | None = None, extras: ExtraStates | None = None
    ) -> Path:
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
            metadata=self._metadata(state),
            extras=self.capture_extras() if extras is None else extras,
        )
        self.link = read_link(path)
        return path

    def _metadata(self, state: LoopState) -> dict[str, Any]:
        if self._job_dict is None:  # the job never changes: resolved once
            self._job_dict = to_dict(self.job, resolve_paths=True)
        routing = routing_metadata(self.tables.values())  # PS shards: count and slot map
        return {
            "job": self._job_dict,
            "epoch": state.epoch,
            "epoch_step": state.epoch_step,
            "features": self.features,
            "dense": self.dense,
            "restarts": state.restarts,
            **({"data_progress": self.data_progress} if self.data_progress else {}),
            **({ROUTING_METADATA: routing} if routing is not None else {}),
        }

    def save_consistent(
        self, updater: SparseUpdater, state: LoopState, extras: ExtraStates | None = None
    ) -> Path:
        """A checkpoint in the middle of training, consistent with itself: every
        submitted sparse update lands first and no prefetch lookup runs during the
        snapshot. Keeps the ``KEEP_CHECKPOINTS`` newest (and the checkpoints their
        delta chains are built on). ``extras``: ``capture_extras()`` taken with
        the data position (``None``: captured now)."""
        self.wait()
        started = time.perf_counter()
        updater.flush()  # Blocking wait: every submitted sparse update lands first
        with contextlib.ExitStack() as stack:
            for store in self.engine.stores.values():
                if isinstance(store, LockedStore):
                    stack.enter_context(store.lock)  # no prefetch lookup mid-snapshot
            path = self._write(state, extras=extras)
        prune_checkpoints(path.parent, keep=KEEP_CHECKPOINTS, newest=path)
        took = time.perf_counter() - started
        self._saved(path, state.step, took)
        self.timings["checkpoint_stall_s"] += took
        self.timings["checkpoint_write_s"] += took
        self.timings["checkpoints"] += 1
        return path

    def save_async(
        self, updater: SparseUpdater, state: LoopState, extras: ExtraStates | None = None
    ) -> Path:
        """A checkpoint in the middle of training that stalls it only while its
        parts are set apart (``output.checkpoint_async``): every submitted sparse
        update is sent; tables on parameter servers are captured by each server
        right after this step is applied there (it then writes its own part),
        in-process tables copied here; the dense model and optimizer cloned. A
        background thread writes the rest and commits, while training goes on.
        Returns the folder the checkpoint will have once committed; ``wait``
        blocks until it is. At most one is in flight: the next one (or any
        other checkpoint) waits for this one first.

        A checkpoint that cannot be committed consistently (a table marked since
        the delta's parent, a table whose servers' parts disagree on being full)
        is dropped with a warning and the next one is written full."""
        self.wait()
        started = time.perf_counter()
        remote_only = all(held_by_servers(t) for t in self.tables.values())
        if not remote_only:
            updater.flush()  # Blocking wait: every submitted sparse update lands first
        with contextlib.ExitStack() as stack:
            for store in self.engine.stores.values():
                if isinstance(store, LockedStore):
                    stack.enter_context(store.lock)  # no prefetch lookup mid-snapshot
            snapshot = self._snapshot(state, updater, extras)
        self._pending = threading.Thread(
            target=self._commit, args=(snapshot, started), name="estuary-checkpoint", daemon=True
        )
        self._pending.start()
        self.timings["checkpoint_stall_s"] += time.perf_counter() - started
        return snapshot.staged.final

    def _snapshot(
        self, state: LoopState, updater: SparseUpdater, extras: ExtraStates | None = None
    ) -> _Snapshot:
        root = self.root()
        plan = plan_checkpoint(
            self.link, root=root, step=state.step, full_every=self.job.output.checkpoint_full_every
        )
        remote = {n: t for n, t in self.tables.items() if held_by_servers(t)}
        local = {n: t for n, t in self.tables.items() if n not in remote}
        parent = plan.parent
        states = {n: _snapshot(t, delta=True) for n, t in local.items()} if parent else {}
        if parent is not None and not _on_top_of(parent, states):
            parent = None  # a table was marked since: write it full
        if parent is None:
            states = {n: _snapshot(t, delta=False) for n, t in local.items()}
        staged = stage_checkpoint(root, step=state.step, parent=parent)
        servers: Future[ServerSnapshot] | None = None
        if remote:
            delta = parent is not None
            # Asked from the update thread once this step's pushes are sent (each
            # part then knows its step), so the trainer does not wait for them.
            servers = updater.after_submitted(
                lambda: ServerSnapshot(remote, delta=delta, paths=staged.part_paths)
            )
        optimizer = self.engine.optimizer
        metadata = self._metadata(state)
        if self.data_progress:  # the feed goes on recording into its own
            metadata["data_progress"] = copy.deepcopy(self.data_progress)
        return _Snapshot(
            staged=staged,
            servers=servers,
            states=states,
            dense={k: v.detach().clone() for k, v in self.engine.model.state_dict().items()},
            optimizer=None if optimizer is None else _cloned(optimizer.state_dict()),
            metadata=metadata,
            extras=self.capture_extras() if extras is None else extras,
        )

    def _commit(self, snapshot: _Snapshot, started: float) -> None:
        staged = snapshot.staged
        try:
            staged.write_dense(snapshot.dense, snapshot.optimizer)
            staged.write_tables({n: s.materialize() for n, s in snapshot.states.items()})
            for name, tensors in snapshot.extras.items():
                staged.write_extra(name, tensors)
            chains = {n: s.chain for n, s in snapshot.states.items()}
            if snapshot.servers is not None:
                servers = snapshot.servers.result()  # Blocking wait: the request went out
                files, server_chains = servers.wait()
                for name, written in files.items():
                    staged.add_files(name, servers.parts[name], written)
                chains.update(server_chains)
                if servers.routing is not None:  # the map the parts were captured at
                    snapshot.metadata[ROUTING_METADATA] = servers.routing
            parent = staged.parent
            if parent is not None and not parent.accepts(chains):
                raise _Inconsistent("a table was marked since its parent checkpoint")
            path = staged.commit(versions=table_versions(chains), metadata=snapshot.metadata)
            self.link = read_link(path)
            prune_checkpoints(path.parent, keep=KEEP_CHECKPOINTS, newest=path)
            self._saved(path, staged.step, time.perf_counter() - started)
        except (_Inconsistent, MixedSnapshotError) as exc:
            logger.warning(
                "checkpoint of step %d dropped (%s); the next one is written full",
                staged.step,
                exc,
            )
            staged.abandon()
            self.link = None
            self.timings["checkpoints_dropped"] += 1
        except BaseException as exc:
            self._error = exc
            staged.abandon()
            if snapshot.servers is not None and snapshot.servers.exception() is None:
                snapshot.servers.result().drop()
        finally:
            self.timings["checkpoint_write_s"] += time.perf_counter() - started
            self.timings["checkpoints"] += 1

    def wait(self) -> None:
        """Block until the asynchronous checkpoint in flight (if any) is committed.

        Raises:
            CheckpointError: it failed (its cause chained); the run's newest
                checkpoint is then the one before it.
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.join()  # Blocking wait: the background writer commits
        error, self._error = self._error, None
        if error is not None:
            self.link = None  # its chain is broken: the next checkpoint is full
            raise CheckpointError(f"an asynchronous checkpoint failed: {error}") from error

    def load(self, path: Path, state: LoopState, *, tables: bool = True) -> None:
        """Restore model, dense optimizer, loop state and data progress from
        ``path`` (a checkpoint folder, a checkpoints root or a run folder), and the
        tables unless ``tables`` is False (another rank restores shared ones)."""
        ckpt = load_checkpoint(path, tables=tables)
        restore_dense_warned(
            ckpt, self.job, self.engine.model, self.engine.optimizer, tables=tables
        )
        if tables:
            # The run's slot map first (as many servers): rows land where they were.
            restore_routing(self.tables.values(), ckpt.manifest["metadata"].get(ROUTING_METADATA))
            ckpt.restore_tables(self.tables)  # a delta: its full checkpoint, then each delta
            self.link = ckpt.link
        metadata = ckpt.manifest["metadata"]
        state.step = int(ckpt.manifest["step"])
        state.epoch = int(metadata.get("epoch", 0))
        state.epoch_step = int(metadata.get("epoch_step", 0))
        state.restarts = int(metadata.get("restarts", 0)) + 1  # this load resumes the run
        self.data_progress = metadata.get("data_progress")
        for name, extra in self.extras.items():
            extra.restore_state(ckpt.extra(name))
        # For owners added later (add_extra), each claimed once; read then.
        self._loaded_extras = {
            name: functools.partial(read_extra, ckpt.path, name)
            for name in ckpt.manifest.get("extras", [])
            if name not in self.extras
        }
