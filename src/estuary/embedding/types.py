"""Interfaces of the embedding parameter server.

Shapes: ``N`` ids in a call, ``D`` the table's dim.

A *shard* owns a hash index (raw int64 id -> row slot) and contiguous row storage
with the optimizer state beside each row. A *table* routes ids to its shards by a
stable hash of the id. Both speak the same small API so a shard can later live in
its own process.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

Int64Array = npt.NDArray[np.int64]
Float32Array = npt.NDArray[np.float32]


@dataclass
class TableStats:
    """Counters of one table (or shard), ready to export as metrics.

    Args:
        rows: ids holding their own row now.
        bytes: memory held by index + rows + optimizer state.
        lookups: ids looked up (train and eval).
        hits: looked-up ids that had their own row.
        admissions: ids that got a row.
        pending_ids: ids seen but not yet admitted (counted by the admission filter).
        unknown_grads: gradient rows routed to the shared unknown row because
            their id was not admitted.
        evictions: rows removed by capacity, TTL or an explicit sweep.
        memory_hits: looked-up ids whose row was in memory (``hits`` less those
            read from a disk tier).
        disk_rows: rows held in the disk tier (included in ``rows``).
        disk_bytes: bytes of the disk tier's files (not in ``bytes``).
        disk_reads: rows read from the disk tier (brought back, or read in place).
        disk_writes: rows written to the disk tier (moved out of memory).
    """

    rows: int = 0
    bytes: int = 0
    lookups: int = 0
    hits: int = 0
    admissions: int = 0
    pending_ids: int = 0
    unknown_grads: int = 0
    evictions: int = 0
    memory_hits: int = 0
    disk_rows: int = 0
    disk_bytes: int = 0
    disk_reads: int = 0
    disk_writes: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    @property
    def memory_hit_rate(self) -> float:
        """Share of the ids that had a row whose row was in memory (1 without a disk tier)."""
        return self.memory_hits / self.hits if self.hits else 1.0

    def __add__(self, other: TableStats) -> TableStats:
        return TableStats(
            **{k: getattr(self, k) + getattr(other, k) for k in self.__dataclass_fields__}
        )


class EmbeddingStore(Protocol):
    """What the trainer needs from a table or a shard."""

    @property
    def dim(self) -> int: ...

    def lookup(
        self, ids: Int64Array, *, train: bool, out: Float32Array | None = None
    ) -> Float32Array:
        """Rows for ``ids`` -> float32 (N, D): ``out`` if given, else a fresh array.

        ``train=True`` inserts new ids (subject to admission; non-admitted ids read
        the shared unknown row). ``train=False`` never inserts: unknown ids read the
        unknown row (zeros unless it was trained by non-admitted ids).

        ``out``: a writeable C-contiguous float32 (N, D) to write the rows into
        (e.g. a table's slice of a batch's (U, D) block); ``ValueError`` otherwise.
        """
        ...

    def apply_gradients(
        self, ids: Int64Array, grads: Float32Array, *, lr_scale: float = 1.0
    ) -> None:
        """Apply one optimizer step. ``ids`` int64 (N,) must be unique; ``grads``
        float32 (N, D) is the summed gradient of each id for one batch. Ids without
        a row (not admitted, or evicted since lookup) update the unknown row.

        ``lr_scale``: the step runs at the optimizer's learning rate times this (the
        step an optimizer configured with that rate would take); 1 is the plain step."""
        ...

    def stats(self) -> TableStats: ...


class MultiTableStore(Protocol):
    """One endpoint serving several tables, whose calls for all of them travel as
    one (a parameter server: one round trip per step instead of one per table).

    A store it serves names it in its ``multi_store`` attribute (see
    ``shared_multi_store``). ``stores`` are such stores; ``ids[i]``, ``out[i]`` and
    ``grads[i]`` belong to ``stores[i]``. Each store still behaves exactly as if
    called on its own (same rows, same step, same errors, naming the table).
    """

    def lookup_many(
        self,
        stores: Sequence[EmbeddingStore],
        ids: Sequence[Int64Array],
        *,
        train: bool,
        out: Sequence[Float32Array] | None = None,
    ) -> list[Float32Array]:
        """``stores[i].lookup(ids[i], train=train, out=out[i])`` for every i, in one
        call -> each store's float32 (N_i, D_i) rows (``out[i]`` when given)."""
        ...

    def apply_gradients_many(
        self,
        stores: Sequence[EmbeddingStore],
        ids: Sequence[Int64Array],
        grads: Sequence[Float32Array],
        lr_scales: Sequence[float] | None = None,
    ) -> None:
        """``stores[i].apply_gradients(ids[i], grads[i], lr_scale=lr_scales[i])`` for
        every i, in one call (``lr_scales`` ``None``: every scale 1)."""
        ...

    def stats_many(self, stores: Sequence[EmbeddingStore]) -> list[TableStats]:
        """``stores[i].stats()`` for every i, in one call."""
        ...


def shared_multi_store(stores: Iterable[object]) -> MultiTableStore | None:
    """The ``MultiTableStore`` that serves every one of ``stores`` (each store's
    ``multi_store`` attribute, one and the same object), else ``None`` (some store
    has none, or they differ): the caller then calls the stores one by one."""
    found: MultiTableStore | None = None
    for store in stores:
        multi = getattr(store, "multi_store", None)
        if multi is None or (found is not None and multi is not found):
            return None
        found = multi
    return found


def stats_of(tables: Mapping[str, EmbeddingStore]) -> dict[str, TableStats]:
    """Every table's ``stats()`` by name: one ``stats_many`` call where one
    ``MultiTableStore`` serves them all (one request per parameter server instead
    of one per table and server), else table by table."""
    multi = shared_multi_store(tables.values())
    if multi is None:
        return {name: table.stats() for name, table in tables.items()}
    return dict(zip(tables, multi.stats_many(list(tables.values())), strict=True))
