"""Embedding workers (``runtime.embedding_workers``): PERSIA's middle tier
between a trainer and the PS shards.

::

    trainer rank r                        EmbeddingWorkerActor r (its own process)
      lookup(batch ids, CSR) ---------->    EmbeddingCollection over the PS shards:
                                            dedup per table, route to shards,
                                            gather, pool
      <------------- pooled (B, F, D)       (keeps the bag layout of the step)
      forward / backward on the block
      push(pooled grad (B, F, D)) ------>   scatter to per-id sums, push_many to
                                            every shard as rank r's step
      <------- each table's pushed step

So a trainer moves pooled blocks (B x F x D floats each way) instead of unique
rows and per-id gradients (U x D floats plus U ids each way), and none of the
dedup/route/pool work runs in its process: the case for it is bags of many ids
(multi-hot features) or a trainer whose time is dear (a GPU); with one id per
feature (B x F >= U) the trainer's own lookups move fewer bytes and measured
faster (docs/results.md).

On the trainer, ``WorkerEmbeddings`` stands in for the ``EmbeddingCollection``
and ``WorkerStore`` for the tables: the ``SparseUpdater`` (sync, hybrid, async,
staleness) pushes a step's pooled gradient to the worker as it would push
per-table gradients to the tables. The trainer's own ``RemoteTable``s still
serve checkpoints and stats; they learn each step the worker pushed, so a
checkpoint waits for exactly those steps.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import torch

from estuary.data.types import JaggedIds
from estuary.embedding.types import Float32Array, Int64Array, TableStats
from estuary.nn.embedding_collection import (
    EmbeddingCollection,
    LookedUpBatch,
    SparseGradients,
    StepGradients,
)
from estuary.ps import PSClient, ShardedPSClient, connect_servers

__all__ = [
    "WORKER_TABLE",
    "EmbeddingWorkerActor",
    "WorkerEmbeddings",
    "WorkerStore",
    "use_embedding_worker",
]

WORKER_TABLE = "__embedding_worker__"
"""The one store a trainer with an embedding worker pushes to."""


@ray.remote
class EmbeddingWorkerActor:
    """One trainer's embedding worker: an ``EmbeddingCollection`` over the PS shards.

    Args:
        addresses, authkeys: the shards' socket addresses and keys (or
            ``server_actors``: their actors, for the actor data plane).
        rank, world_size: the trainer it serves (its pushes are that rank's).
        timeout_s: longest a server request may take.
        sharded: a sharded client even of one server (the job may add shards).
    """

    def __init__(
        self,
        addresses: Sequence[Any],
        authkeys: Sequence[bytes],
        server_actors: Sequence[Any],
        rank: int,
        world_size: int,
        timeout_s: float,
        sharded: bool = False,
    ) -> None:
        client: PSClient | ShardedPSClient
        if server_actors:
            from estuary.runtime.ray.plane import actor_clients, connect_actor

            clients = actor_clients(server_actors, timeout_s=timeout_s)
            if len(clients) == 1 and not sharded:
                client = clients[0]
            else:
                client = ShardedPSClient(clients, connect=connect_actor)
        else:
            client = connect_servers(
                addresses,
                authkeys,
                sharded=sharded,
                timeout_s=timeout_s,
                connect_timeout_s=timeout_s,
            )
        self.client = client
        self.tables = client.tables(rank=rank, grad_scale=1.0 / world_size)
        self.collection: EmbeddingCollection | None = None
        self._held: dict[int, LookedUpBatch] = {}
        self._tokens = itertools.count(1)

    def configure(
        self,
        features: list[str],
        feature_tables: dict[str, str],
        pooling: dict[str, str],
        max_lengths: dict[str, int],
    ) -> None:
        """The trainer's collection, rebuilt here over the shards' tables."""
        tables = {name: self.tables[name] for name in set(feature_tables.values())}
        self.collection = EmbeddingCollection(
            features, tables, feature_tables, pooling, max_lengths
        )

    def lookup(
        self, sparse: dict[str, JaggedIds], train: bool
    ) -> tuple[int, Float32Array, list[str]]:
        """(token, pooled float32 (B, F, D), tables); a train lookup keeps the step's
        layout under ``token`` for ``push``."""
        assert self.collection is not None, "configure first"
        looked_up = self.collection.lookup(sparse, train=train)
        token = 0
        if train:
            token = next(self._tokens)
            self._held[token] = looked_up
        return token, looked_up.pooled, list(looked_up.tables)

    def push(self, token: int, grad: Float32Array, lr_scale: float) -> dict[str, int]:
        """Rank r's step: the pooled gradient of lookup ``token`` scattered to
        per-id sums and pushed to every shard; returns each table's pushed step."""
        assert self.collection is not None, "configure first"
        looked_up = self._held.pop(token)
        block = grad if grad.flags.writeable else grad.copy()  # Ray's arrays are read-only
        parts = list(StepGradients(looked_up, torch.from_numpy(block), self.collection.dim))
        stores = [self.tables[p.table] for p in parts]
        self.client.apply_gradients_many(
            stores, [p.ids for p in parts], [p.grads for p in parts], [lr_scale] * len(parts)
        )
        return {name: table.pushed for name, table in self.tables.items()}


@dataclass
class _RemoteLookedUp(LookedUpBatch):
    """A lookup the embedding worker holds the layout of (``token``)."""

    token: int = 0


class WorkerEmbeddings(EmbeddingCollection):
    """The trainer's ``EmbeddingCollection``, with lookups and gradients done by
    its embedding worker (module docstring). Built from the collection it
    replaces (same features, tables, pooling); pooling ``none`` features are
    not supported (the worker returns pooled blocks only)."""

    def __init__(self, base: EmbeddingCollection, worker: Any) -> None:
        if base.sequence_features:
            raise ValueError(
                f"runtime.embedding_workers: features {base.sequence_features} have "
                "pooling: none; embedding workers return pooled blocks only"
            )
        super().__init__(
            base.features, base.tables, base.feature_tables, base.pooling, base.max_lengths
        )
        self.worker = worker
        ray.get(
            worker.configure.remote(
                base.features, base.feature_tables, base.pooling, base.max_lengths
            )
        )

    def lookup(self, sparse: Mapping[str, JaggedIds], *, train: bool) -> LookedUpBatch:
        # Blocking wait: the worker dedups, gathers from the shards and pools.
        token, pooled, tables = ray.get(self.worker.lookup.remote(dict(sparse), train))
        empty = np.zeros(0, np.int64)
        return _RemoteLookedUp(
            num_rows=int(pooled.shape[0]),
            pooled=np.array(pooled),  # writeable: the forward's leaf
            tables=tables,
            ids=[],
            row_start=empty,
            layout=None,  # type: ignore[arg-type]
            token=token,
        )

    def gradients(self) -> Sequence[SparseGradients]:
        if self._pending is None:
            return []
        batch, pooled, _ = self._pending
        self._pending = None
        assert isinstance(batch, _RemoteLookedUp)
        grad = pooled.grad
        block = (
            np.zeros_like(batch.pooled)
            if grad is None
            else np.ascontiguousarray(grad.detach().numpy())
        )
        return [SparseGradients(WORKER_TABLE, np.array([batch.token], np.int64), block)]


@dataclass
class WorkerStore:
    """The store the ``SparseUpdater`` pushes a trainer's steps to: each "gradient"
    is one lookup's pooled gradient, sent to the embedding worker; the trainer's
    own tables learn the step the worker pushed (checkpoints wait for it)."""

    worker: Any
    tables: Mapping[str, Any]
    dim: int
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def apply_gradients(
        self, ids: Int64Array, grads: Float32Array, *, lr_scale: float = 1.0
    ) -> None:
        # Blocking wait: the worker scatters and pushes to every shard.
        pushed = ray.get(self.worker.push.remote(int(ids[0]), grads, float(lr_scale)))
        with self._lock:
            for name, step in pushed.items():
                table = self.tables.get(name)
                if table is not None:
                    table.note_pushed(step)

    def lookup(self, ids: Int64Array, *, train: bool, out: Float32Array | None = None) -> Any:
        raise TypeError("the embedding worker's store only takes pooled gradients")

    def stats(self) -> TableStats:
        return TableStats()


def use_embedding_worker(trainer: Any, worker: Any) -> None:
    """Route ``trainer``'s (a ``DistributedTrainer``) lookups and sparse pushes
    through ``worker``: its engine gets a ``WorkerEmbeddings`` and one
    ``WorkerStore`` in place of its tables (which keep serving checkpoints)."""
    engine = trainer.engine
    embeddings = WorkerEmbeddings(engine.embeddings, worker)
    engine.embeddings = embeddings
    engine.stores = {WORKER_TABLE: WorkerStore(worker, trainer.remote_tables, embeddings.dim)}
