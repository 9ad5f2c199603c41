"""The disk tier of a table with a memory budget: rows that left memory.

A shard whose table sets ``disk.memory_bytes`` keeps at most that many bytes
of rows in memory (an LRU capacity derived from the budget, see
``memory_rows``); the rows it evicts for room move here instead of being
dropped, and come back into memory on their next training access (or are read
in place by eval lookups). So the table holds more rows than its budget.
Limit: one call bringing back more rows than the budget holds brings back
what fits; the rest stay on disk and read the shared unknown row in that call
(their gradients train it), as new ids beyond a capacity do.

Layout: two memory-mapped files in the tier's folder, grown by ``GROWTH``
(``ftruncate`` and a new mapping; nothing is copied)::

    rows.f32   float32 (C, V)  whole storage rows (weights in the table's
                               dtype + optimizer state, as ``RowStorage``)
    stamp.i64  int64   (C,)    the row's access stamp when it left memory

and, in memory, a ``HashIndex`` id -> disk slot (16 B / load per disk row:
the tier's stated memory overhead, ~21 B per disk row at load 0.75). Freed
slots are reused (the index's free list).

Chosen by measurement over an embedded key-value store: sqlite3 (the one in
the standard library; journal and sync off, rows as blobs keyed by id) took
11x longer per row moved out and back than this (55 vs 4.8 us per row,
4096-row batches of 100k 128-byte rows, one run on a loaded 2-core machine;
docs/results.md). The mapping's pages live in the OS page cache: they count
in the process's file-backed resident pages while cached, and the kernel
reclaims them under pressure (anonymous memory, which the budget bounds, is
what cannot be reclaimed).

Checkpoints and deltas see one table: a state lists memory and disk rows
alike (``EmbeddingShard.export_raw``); a disk row is dirty for a delta when
its stamp is newer than the mark, as a memory row.
"""

from __future__ import annotations

import contextlib
import mmap
import shutil
import tempfile
import weakref
from pathlib import Path

import numpy as np

from estuary.embedding.hash_index import MAX_LOAD, HashIndex
from estuary.embedding.types import Float32Array, Int64Array

GROWTH = 1.5  # file growth factor (a remap, not a copy)
_INITIAL_ROWS = 1024


def memory_rows(memory_bytes: int, stored_width: int, shards: int) -> int:
    """Rows a shard keeps in memory for a table budget of ``memory_bytes``: the
    budget split over ``shards``, divided by a memory row's cost (the stored row
    ``4 V`` B, owner id and stamp 16 B, its hash-index entry 16 / MAX_LOAD B)."""
    per_row = 4 * stored_width + 16 + 16 / MAX_LOAD
    return max(1, int(memory_bytes / shards / per_row))


class _MappedArray:
    """A growable array backed by a file (``np.frombuffer`` over ``mmap``)."""

    def __init__(self, path: Path, dtype: type, width: int) -> None:
        self.path = path
        self.dtype = np.dtype(dtype)
        self.width = width
        self._file = open(path, "w+b")  # noqa: SIM115 (closed in close())
        self._map: mmap.mmap | None = None
        self.array: np.ndarray = np.zeros((0, width) if width else 0, self.dtype)

    @property
    def rows(self) -> int:
        return int(self.array.shape[0])

    def resize(self, rows: int) -> None:
        row_bytes = self.dtype.itemsize * max(self.width, 1)
        self._file.truncate(rows * row_bytes)
        old = self._map
        self._map = mmap.mmap(self._file.fileno(), rows * row_bytes)
        arr = np.frombuffer(self._map, self.dtype)
        self.array = arr.reshape(rows, self.width) if self.width else arr
        if old is not None:
            _close_quietly(old)

    def close(self) -> None:
        self.array = np.zeros((0, self.width) if self.width else 0, self.dtype)
        if self._map is not None:
            _close_quietly(self._map)
            self._map = None
        self._file.close()


def _close_quietly(m: mmap.mmap) -> None:
    # A view still exported (a caller kept a slice) keeps the mapping alive until
    # it goes; closing then raises BufferError and the GC unmaps it later.
    with contextlib.suppress(BufferError):
        m.close()


class DiskRows:
    """Rows of one shard on disk (module docstring).

    Args:
        width: floats per stored row (V, ``RowFormat.stored_width``).
        folder: where the files go (a fresh temporary folder when ``None``);
            removed files are the caller's folder's business.
    """

    def __init__(self, width: int, folder: str | None = None) -> None:
        self.width = width
        if folder is not None:
            Path(folder).mkdir(parents=True, exist_ok=True)
        self.folder = Path(tempfile.mkdtemp(prefix="estuary-disk-", dir=folder))
        self._index = HashIndex(_INITIAL_ROWS)
        self._rows = _MappedArray(self.folder / "rows.f32", np.float32, width)
        self._stamp = _MappedArray(self.folder / "stamp.i64", np.int64, 0)
        self._grow(_INITIAL_ROWS)
        # The folder goes when the tier does, or at interpreter exit at the latest.
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.folder), True)
        self.reads = 0  # rows read back (promoted or read in place)
        self.writes = 0  # rows written (demoted)

    def __len__(self) -> int:
        return len(self._index)

    @property
    def memory_bytes(self) -> int:
        """Memory the tier holds (its index), not counting the OS page cache."""
        return self._index.nbytes

    @property
    def disk_bytes(self) -> int:
        """Bytes of its files."""
        return self._rows.rows * (4 * self.width + 8)

    def _grow(self, rows: int) -> None:
        if rows <= self._rows.rows:
            return
        target = max(rows, int(self._rows.rows * GROWTH), _INITIAL_ROWS)
        self._rows.resize(target)
        self._stamp.resize(target)

    def put(self, ids: Int64Array, rows: Float32Array, stamps: Int64Array) -> None:
        """Store ``rows`` (N, V) with ``stamps`` (N,) for unique ``ids`` (N,) not on disk."""
        if ids.size == 0:
            return
        slots = self._index.get_or_insert(ids)
        self._grow(self._index.slot_end)
        self._rows.array[slots] = rows
        self._stamp.array[slots] = stamps
        self.writes += ids.size

    def slots(self, ids: Int64Array) -> Int64Array:
        """Disk slots of ``ids`` (N,), -1 where not on disk."""
        return self._index.lookup(ids)

    def take(self, ids: Int64Array) -> tuple[Int64Array, Float32Array, Int64Array]:
        """Remove the ones of unique ``ids`` (N,) held here -> (their positions in
        ``ids`` (F,), rows (F, V), stamps (F,))."""
        slots = self._index.lookup(ids)
        found = np.flatnonzero(slots >= 0)
        if found.size == 0:
            return found, np.empty((0, self.width), np.float32), np.empty(0, np.int64)
        rows = self._rows.array[slots[found]]
        stamps = self._stamp.array[slots[found]]
        self._index.remove(ids[found])
        self.reads += found.size
        return found, rows, stamps

    def gather(self, slots: Int64Array) -> Float32Array:
        """Rows of disk ``slots`` (N,) (copies), read in place."""
        self.reads += slots.size
        return self._rows.array[slots]

    def remove(self, ids: Int64Array) -> Int64Array:
        """Drop ``ids`` held here; returns those that were."""
        return ids[self._index.remove(ids) >= 0]

    def items(self, dirty_after: int | None = None) -> tuple[Int64Array, Float32Array, Int64Array]:
        """(ids (R,), rows (R, V), stamps (R,)) of every disk row, or of those with
        a stamp newer than ``dirty_after`` (copies)."""
        ids, slots = self._index.items()
        stamps = self._stamp.array[slots]
        if dirty_after is not None:
            keep = stamps > dirty_after
            ids, slots, stamps = ids[keep], slots[keep], stamps[keep]
        return ids, self._rows.array[slots], stamps.copy()

    def clear(self) -> None:
        """Drop every row (a full state is being loaded)."""
        self._index = HashIndex(_INITIAL_ROWS)

    def close(self) -> None:
        """Unmap and delete the files (also done when the tier is collected)."""
        self._rows.close()
        self._stamp.close()
        self._cleanup()
