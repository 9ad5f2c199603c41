"""``SlotTable``: a served table over a slot file's hashed layout, and the compiled
kernels that write and read that layout.

A slot file (``estuary.serve.slots``) keeps each table as an open-addressing
hash index over its rows, so a version is written by touching only the rows and
index entries a delta changed (no sorted array to keep sorted, nothing moved):

- ``index`` (H, 2) int64, H a power of two: per entry an id and its row
  (``index[p] = (id, row)``), the row ``EMPTY`` (-1, the end of a probe) or
  ``GONE`` (-2, an evicted id's entry, probed past and reused); linear probing
  from ``mix64(id) & (H - 1)``. An entry's id and row share a cache line, so a
  probe costs one memory read.
- ``weights`` (m, D): the rows as stored (float32, float16 or bfloat16 bits), in
  the order their ids arrived; an evicted id's row stays, unreferenced, until
  the slot is laid out again.

Lookups read what ``FrozenTable`` reads: an id's row, else its shard's unknown
row (``shard_of``'s routing), decoded only for the rows looked up.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from estuary.embedding.delta import IDS, UNKNOWN_PREFIX, WEIGHTS
from estuary.embedding.hashing import _ROUTE_SALT as ROUTE_SALT
from estuary.embedding.hashing import as_ids, mix64, shard_of
from estuary.embedding.storage import rows_out
from estuary.embedding.types import Float32Array, Int64Array, TableStats
from estuary.serve.frozen_table import UNSCALED_ROW_DTYPES, ReadOnlyStore, decode_rows

__all__ = ["EMPTY", "GONE", "SlotTable", "index_size", "warm_up"]

State = dict[str, np.ndarray]
EMPTY, GONE = -1, -2
_UNKNOWN = UNKNOWN_PREFIX + WEIGHTS


def index_size(rows: int) -> int:
    """H for a region of ``rows`` rows: a power of two at least twice as large
    (the index at most half full, evicted entries included)."""
    size = 16
    while size < 2 * rows:
        size *= 2
    return size


@njit(cache=True, nogil=True, inline="always")
def _slot_of(x: np.int64, mask: np.uint64) -> np.int64:
    return np.int64(mix64(np.uint64(x)) & mask)


@njit(cache=True, nogil=True)
def find_rows(index: np.ndarray, ids: Int64Array, out: Int64Array) -> int:
    """``out[i]``: the row of ``ids[i]``, or -1 when it has none; returns how many have one."""
    mask = np.uint64(index.shape[0] - 1)
    found = 0
    for i in range(ids.size):
        x = ids[i]
        p = _slot_of(x, mask)
        out[i] = -1
        while index[p, 1] != EMPTY:
            if index[p, 1] >= 0 and index[p, 0] == x:
                out[i] = index[p, 1]
                found += 1
                break
            p = (p + 1) & np.int64(mask)
    return found


@njit(cache=True, nogil=True)
def _gather_hashed(
    index: np.ndarray,
    weights: Float32Array,
    unknown: Float32Array,
    ids: Int64Array,
    out: Float32Array,
) -> int:
    """``SlotTable.lookup`` of float32 rows in one compiled call."""
    mask = np.uint64(index.shape[0] - 1)
    shards = np.uint64(unknown.shape[0])
    found = 0
    for i in range(ids.size):
        x = ids[i]
        p = _slot_of(x, mask)
        row = -1
        while index[p, 1] != EMPTY:
            if index[p, 1] >= 0 and index[p, 0] == x:
                row = index[p, 1]
                break
            p = (p + 1) & np.int64(mask)
        if row >= 0:
            out[i, :] = weights[row, :]
            found += 1
        elif shards > 1:
            out[i, :] = unknown[np.int64(mix64(np.uint64(x) ^ ROUTE_SALT) % shards), :]
        else:
            out[i, :] = unknown[0, :]
    return found


@njit(cache=True, nogil=True)
def fill_index(index: np.ndarray, ids: Int64Array) -> None:
    """The index of rows ``0..N-1`` holding ``ids`` (unique), from empty."""
    mask = np.uint64(index.shape[0] - 1)
    index[:, 1] = EMPTY
    for i in range(ids.size):
        p = _slot_of(ids[i], mask)
        while index[p, 1] != EMPTY:
            p = (p + 1) & np.int64(mask)
        index[p, 0] = ids[i]
        index[p, 1] = i


@njit(cache=True, nogil=True)
def count_new(index: np.ndarray, ids: Int64Array) -> int:
    """How many of ``ids`` the index does not hold."""
    out = np.empty(ids.size, np.int64)
    return ids.size - find_rows(index, ids, out)


@njit(cache=True, nogil=True)
def remove_ids(index: np.ndarray, gone: Int64Array) -> int:
    """Mark the entries of ``gone``'s ids ``GONE``; returns how many were held."""
    mask = np.uint64(index.shape[0] - 1)
    removed = 0
    for i in range(gone.size):
        x = gone[i]
        p = _slot_of(x, mask)
        while index[p, 1] != EMPTY:
            if index[p, 1] >= 0 and index[p, 0] == x:
                index[p, 1] = GONE
                removed += 1
                break
            p = (p + 1) & np.int64(mask)
    return removed


@njit(cache=True, nogil=True)
def upsert_rows(
    index: np.ndarray,
    weights: np.ndarray,
    m: int,
    ids: Int64Array,
    rows: np.ndarray,
) -> tuple[int, int]:
    """Write ``rows`` (K, B bytes) for ``ids`` (K,, unique) into the region
    (``weights``: (cap, B) bytes, ``m`` rows used; room checked by the caller):
    a held id's row where it is, a new id's after the last row, indexed at the
    first ``GONE`` or ``EMPTY`` entry of its probe. Returns the rows used and
    the ``GONE`` entries reused."""
    mask = np.uint64(index.shape[0] - 1)
    reused = 0
    for i in range(ids.size):
        x = ids[i]
        p = _slot_of(x, mask)
        free = np.int64(-1)
        row = -1
        while index[p, 1] != EMPTY:
            if index[p, 1] >= 0:
                if index[p, 0] == x:
                    row = index[p, 1]
                    break
            elif free < 0:
                free = p
            p = (p + 1) & np.int64(mask)
        if row >= 0:
            weights[row, :] = rows[i, :]
            continue
        if free >= 0:
            p = free
            reused += 1
        index[p, 0] = x
        index[p, 1] = m
        weights[m, :] = rows[i, :]
        m += 1
    return m, reused


def warm_up() -> None:
    """Compile (or load from numba's cache) the lookup kernels now, on a table of
    one row: not on the prediction thread at the first lookup after the first
    update, where it would hold predictions back (a compile takes seconds)."""
    index = np.zeros((16, 2), np.int64)
    fill_index(index, np.array([7], np.int64))
    table = SlotTable("warm-up", index, np.zeros((1, 1), np.float32), np.zeros((1, 1)), 1, 1)
    table.lookup(np.array([7, 8], np.int64), train=False)
    SlotTable("warm-up", index, np.zeros((1, 1), np.float16), np.zeros((1, 1)), 1, 1).lookup(
        np.array([7, 8], np.int64), train=False
    )


class SlotTable(ReadOnlyStore):
    """One table of a slot file, read-only (the layout in the module docstring).

    Args:
        name: the table's name (in errors).
        index: the hash index, (H, 2), H a power of two.
        weights: (m, D) rows as stored.
        unknown: (S', D) float32, the unknown rows as saved.
        shards: S, the table's shard count (unknown rows of another count are
            averaged, as ``FrozenTable`` does).
        rows: how many ids the index holds (for ``stats``).
    """

    def __init__(
        self,
        name: str,
        index: np.ndarray,
        weights: np.ndarray,
        unknown: np.ndarray,
        shards: int,
        rows: int,
    ) -> None:
        size = index.shape[0]
        if index.ndim != 2 or index.shape[1] != 2 or size < 1 or size & (size - 1):
            raise ValueError(f"{name}: an index of shape {index.shape}, not (2^k, 2)")
        if weights.ndim != 2:
            raise ValueError(f"{name}: weights shape {weights.shape} is not (rows, dim)")
        if weights.dtype not in UNSCALED_ROW_DTYPES:  # a set lookup: one per table per update
            allowed = sorted(map(str, UNSCALED_ROW_DTYPES))
            raise ValueError(f"{name}: rows of dtype {weights.dtype}, not one of {allowed}")
        if unknown.ndim != 2 or unknown.shape[1] != weights.shape[1]:
            raise ValueError(f"{name}: unknown rows {unknown.shape} do not fit {weights.shape}")
        if unknown.shape[0] != shards:
            unknown = np.repeat(unknown.mean(axis=0, keepdims=True), shards, axis=0)
        self.name = name
        self.index, self.weights = index, weights
        self.unknown = np.ascontiguousarray(unknown, np.float32)
        self.shards = shards
        self.rows = rows
        self._lookups = self._hits = 0

    @property
    def dim(self) -> int:
        return int(self.weights.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes held: the index, the rows as stored (evicted ones included), the unknown rows."""
        return self.index.nbytes + self.weights.nbytes + self.unknown.nbytes

    def lookup(
        self, ids: Int64Array, *, train: bool, out: Float32Array | None = None
    ) -> Float32Array:
        """Rows of ``ids`` (N,) as float32 (N, D), into ``out`` when given; an id
        without a row reads its shard's unknown row. ``train`` must be False."""
        if train:
            raise TypeError(f"table {self.name!r}: served tables are read-only")
        ids = as_ids(ids)
        out = rows_out(out, ids.size, self.dim)
        if ids.size == 0:
            return out
        if self.weights.dtype == np.float32:
            found = _gather_hashed(self.index, self.weights, self.unknown, ids, out)
        else:
            at = np.empty(ids.size, np.int64)
            found = find_rows(self.index, ids, at)
            hit = at >= 0
            out[hit] = decode_rows(self.weights[at[hit]], None)
            miss = ~hit
            if miss.any():
                owner = shard_of(ids[miss], self.shards) if self.shards > 1 else 0
                out[miss] = self.unknown[owner]
        self._lookups += int(ids.size)
        self._hits += int(found)
        return out

    def state_dict(self) -> State:
        """The rows held decoded to float32, sorted by id (``ids``, ``weights``,
        ``unknown.weights``)."""
        live = self.index[:, 1] >= 0
        ids, rows = self.index[live, 0], self.index[live, 1]
        order = np.argsort(ids, kind="stable")
        return {
            IDS: ids[order],
            WEIGHTS: decode_rows(self.weights[rows[order]], None).copy(),
            _UNKNOWN: self.unknown.copy(),
        }

    def stats(self) -> TableStats:
        return TableStats(rows=self.rows, bytes=self.nbytes, lookups=self._lookups, hits=self._hits)
