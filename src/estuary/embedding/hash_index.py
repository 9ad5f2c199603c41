"""Open-addressing hash index: raw int64 id -> int64 row slot.

Layout: one int64 array ``table`` of shape (C, 2), any C < 2**32. Entry ``i``
holds ``table[i, 0] = key`` and ``table[i, 1] = value``; ``value == 0`` marks an
empty entry, so *every* int64 is a valid key (no sentinel key). The index stores
``slot + 1`` as the value. Key and value share one 16-byte entry, so a probe that
finds its key costs one cache miss, not two.

Probing is linear from ``home_of(key, C)`` (the hash's high bits scaled to C, so
C need not be a power of two). The table grows by ``GROWTH`` (1.25x) when it
would pass ``max_load`` (``MAX_LOAD`` = 0.75 by default; after a growth it is at
0.6), so memory is 16 B / load ~ 21-27 B per id (23.4 B per row measured on
the 4-hour synthetic job's 26 tables; 1.5x growth at load 0.7, 23-34 B per id,
gave 25.5 B there).
Removal uses backward-shift deletion (no tombstones),
so probe chains never rot under churn; freed slots go on a free list and are
handed out again before new slots.

The kernels here are generic over "value 0 = empty" tables; the admission filter
reuses them with value = sighting count.

*Touch*: ``lookup`` and ``get_or_insert_new`` optionally update per-slot
metadata of every id they find, in the same probe pass (``Touch``: a stamp, a
saturating use count, a wall time; each array may be empty = not kept). The
shard uses it for LRU/LFU/TTL eviction and delta dirtiness at no extra pass.
Ids inserted by the call are not touched (their slots may lie beyond the
metadata arrays until the caller grows them).

All kernels are ``nogil`` so a caller may overlap them with torch compute, but an
index is not thread-safe: serialise calls on one index.

Numba's on-disk cache (``cache=True``) keys a kernel on its own file only: after
editing a kernel here, delete ``__pycache__/*.nbi`` so callers in other modules
(admission) recompile against it.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt
from numba import njit

from estuary.embedding.hashing import as_ids, id_hash
from estuary.embedding.memory import zeros
from estuary.embedding.prefetch import IDS_AHEAD, prefetch
from estuary.embedding.types import Int64Array

BoolArray = npt.NDArray[np.bool_]
Int32Array = npt.NDArray[np.int32]
Float64Array = npt.NDArray[np.float64]

# meta[] fields of the index kernels.
_SIZE, _NEXT_SLOT, _FREE_COUNT = 0, 1, 2
_S32 = np.uint64(32)
# Use counts saturate here (LFU keys pack the count above 40 bits of step).
FREQ_MAX = (1 << 22) - 1


class Touch(NamedTuple):
    """Per-slot metadata a hit updates; every array is indexed by slot.

    Args:
        stamp: int64 (R,) set to ``now`` (size 0: not kept; uint8 flags with
            ``now`` = 1 in tables that do not evict).
        freq: int32 (R,) incremented, saturating at ``FREQ_MAX`` (size 0: not kept).
        touch_s: float64 (R,) set to ``now_s`` (size 0: not kept).
        now: the stamp of this call.
        now_s: the wall time of this call.
    """

    stamp: Int64Array
    freq: Int32Array
    touch_s: Float64Array
    now: int
    now_s: float


NO_TOUCH = Touch(np.empty(0, np.int64), np.empty(0, np.int32), np.empty(0, np.float64), 0, 0.0)


@njit(cache=True, nogil=True, inline="always")
def home_of(key: np.int64, entries: int) -> np.int64:
    """Home entry of ``key`` in a table of ``entries`` (< 2**32) entries: the high
    32 bits of its hash scaled to ``[0, entries)`` (Lemire's multiply-shift), so
    a table may have any size, not only a power of two."""
    return np.int64(((id_hash(key) >> _S32) * np.uint64(entries)) >> _S32)


@njit(cache=True, nogil=True, inline="always")
def next_entry(i: np.int64, entries: int) -> np.int64:
    """The entry after ``i``, wrapping at ``entries``."""
    i += 1
    return i if i < entries else np.int64(0)


@njit(cache=True, nogil=True, inline="always")
def probe(table: Int64Array, key: np.int64) -> np.int64:
    """Position of ``key`` in ``table``, or of the empty entry where it would go."""
    return probe_from(table, key, home_of(key, table.shape[0]))


@njit(cache=True, nogil=True, inline="always")
def probe_from(table: Int64Array, key: np.int64, home: np.int64) -> np.int64:
    """``probe`` with ``key``'s home entry already computed."""
    entries = table.shape[0]
    i = home
    while table[i, 1] != 0 and table[i, 0] != key:
        i = next_entry(i, entries)
    return i


@njit(cache=True, nogil=True, inline="always")
def _homes(table: Int64Array, ids: Int64Array, start: int) -> Int64Array:
    # Home entries of ids[start:], in one short pass before the probe loop: the
    # loop then prefetches ``homes[n + IDS_AHEAD]`` instead of hashing each id
    # twice, and stays short enough for the CPU to overlap more misses
    # (uniform random hits at 10M ids: get_or_insert_new 39 -> 26 ns, a bare
    # lookup loop 25.5 -> 20.5 ns).
    entries = table.shape[0]
    homes = np.empty(ids.size - start, np.int64)
    for n in range(start, ids.size):
        homes[n - start] = home_of(ids[n], entries)
    return homes


@njit(cache=True, nogil=True, inline="always")
def delete_at(table: Int64Array, pos: np.int64) -> None:
    """Empty entry ``pos`` by backward-shift deletion (Knuth 6.4, Algorithm R).

    Later entries of the same probe run move back into the hole unless their home
    bucket lies cyclically in (hole, entry], which would put them before home.
    """
    entries = table.shape[0]
    hole = pos
    j = pos
    while True:
        j = next_entry(j, entries)
        if table[j, 1] == 0:
            break
        home = home_of(table[j, 0], entries)
        # Distance walked from home to j versus from the hole to j (cyclic).
        walked = j - home if j >= home else j - home + entries
        if walked >= (j - hole if j >= hole else j - hole + entries):
            table[hole, 0] = table[j, 0]
            table[hole, 1] = table[j, 1]
            hole = j
    table[hole, 1] = 0


@njit(cache=True, nogil=True)
def rehash_into(old: Int64Array, new: Int64Array) -> None:
    """Insert every occupied entry of ``old`` into the empty table ``new``."""
    entries = new.shape[0]
    for k in range(old.shape[0]):
        if old[k, 1] != 0:
            i = home_of(old[k, 0], entries)
            while new[i, 1] != 0:
                i = next_entry(i, entries)
            new[i, 0] = old[k, 0]
            new[i, 1] = old[k, 1]


@njit(cache=True, nogil=True)
def occupied_items(table: Int64Array, size: int) -> tuple[Int64Array, Int64Array]:
    """(keys, values) of the occupied entries, int64 (size,) each, table order."""
    keys = np.empty(size, np.int64)
    vals = np.empty(size, np.int64)
    n = 0
    for k in range(table.shape[0]):
        if table[k, 1] != 0:
            keys[n] = table[k, 0]
            vals[n] = table[k, 1]
            n += 1
    return keys, vals


@njit(cache=True, nogil=True)
def _get_or_insert_kernel(
    table: Int64Array,
    ids: Int64Array,
    out: Int64Array,
    new_at: Int64Array,
    base: int,
    start: int,
    meta: Int64Array,
    free: Int64Array,
    limit: int,
    stamp: Int64Array,
    freq: Int32Array,
    touch_s: Float64Array,
    now: int,
    now_s: float,
) -> int:
    # Returns the position it stopped at: ids.size when done, earlier when the
    # next insert would pass ``limit`` (the caller grows the table and resumes).
    # A hit touches its slot; an insert does not (see module docstring). The
    # prefetch and touch code is written out here, not in helpers: an njit
    # helper taking arrays keeps reference counting in the loop (3x slower).
    # ``new_at[k]`` (if kept) is the position in ``ids`` of the k-th id inserted
    # by this call; ``base`` is the index size when the call began.
    track = new_at.size > 0
    homes = _homes(table, ids, start)
    for n in range(start, ids.size):
        if n + IDS_AHEAD < ids.size:
            prefetch(table, homes[n + IDS_AHEAD - start] * 2)
        key = ids[n]
        i = probe_from(table, key, homes[n - start])
        v = table[i, 1]
        if v != 0:
            slot = v - 1
            out[n] = slot
            if slot < stamp.size:  # (same touch as _lookup_kernel)
                stamp[slot] = now
            if slot < freq.size and freq[slot] < FREQ_MAX:
                freq[slot] += 1
            if slot < touch_s.size:
                touch_s[slot] = now_s
            continue
        if meta[_SIZE] >= limit:
            return n
        if meta[_FREE_COUNT] > 0:
            meta[_FREE_COUNT] -= 1
            slot = free[meta[_FREE_COUNT]]
        else:
            slot = meta[_NEXT_SLOT]
            meta[_NEXT_SLOT] += 1
        table[i, 0] = key
        table[i, 1] = slot + 1
        if track:
            new_at[meta[_SIZE] - base] = n
        meta[_SIZE] += 1
        out[n] = slot
    return ids.size


@njit(cache=True, nogil=True)
def _lookup_kernel(
    table: Int64Array,
    ids: Int64Array,
    out: Int64Array,
    stamp: Int64Array,
    freq: Int32Array,
    touch_s: Float64Array,
    now: int,
    now_s: float,
) -> None:
    homes = _homes(table, ids, 0)
    for n in range(ids.size):
        if n + IDS_AHEAD < ids.size:
            prefetch(table, homes[n + IDS_AHEAD] * 2)
        i = probe_from(table, ids[n], homes[n])
        v = table[i, 1]
        slot = v - 1
        out[n] = slot  # empty entry holds 0 -> -1
        if v != 0:
            # Touch: slots past an array's end are skipped (a later copy of an id
            # inserted by the same call; its caller stamps new rows itself).
            if slot < stamp.size:
                stamp[slot] = now
            if slot < freq.size and freq[slot] < FREQ_MAX:
                freq[slot] += 1
            if slot < touch_s.size:
                touch_s[slot] = now_s


@njit(cache=True, nogil=True)
def _remove_kernel(
    table: Int64Array, ids: Int64Array, meta: Int64Array, free: Int64Array, out: Int64Array
) -> int:
    removed = 0
    for n in range(ids.size):
        i = probe(table, ids[n])
        v = table[i, 1]
        if v == 0:
            out[n] = -1
            continue
        out[n] = v - 1
        free[meta[_FREE_COUNT]] = v - 1
        meta[_FREE_COUNT] += 1
        delete_at(table, i)
        meta[_SIZE] -= 1
        removed += 1
    return removed


@njit(cache=True, nogil=True)
def _renumber_kernel(table: Int64Array, new_end: int, moved_to: Int64Array) -> None:
    # Values (slot + 1) of slots >= new_end become moved_to[slot - new_end] + 1.
    for k in range(table.shape[0]):
        slot = table[k, 1] - 1
        if slot >= new_end:
            table[k, 1] = moved_to[slot - new_end] + 1


GROWTH = 1.25  # table growth factor: amortised O(1) rehash per insert (module docstring)


MAX_LOAD = 0.75  # default fill before growth (module docstring)


def entries_for(ids: int, max_load: float) -> int:
    """Entries a table needs to hold ``ids`` ids at ``max_load`` (at least 8)."""
    return max(8, int(ids / max_load) + 1)


class HashIndex:
    """Maps raw int64 ids to dense int64 slots ``first_slot, first_slot + 1, ...``.

    Args:
        capacity_ids: ids to hold before the first growth.
        max_load: fraction of entries used before the table grows (0.3-0.9).
        first_slot: slot handed to the first id (a shard reserves slot 0 for its
            unknown row).

    Shapes: ``N`` ids per call. Calls must be serialised by the caller.
    """

    def __init__(
        self, capacity_ids: int = 1024, *, max_load: float = MAX_LOAD, first_slot: int = 0
    ):
        if not 0.3 <= max_load <= 0.9:
            raise ValueError(f"max_load must be in [0.3, 0.9], got {max_load}")
        self._max_load = max_load
        self._first_slot = first_slot
        self._table = zeros((entries_for(capacity_ids, max_load), 2), np.int64)
        self._limit = int(self._table.shape[0] * max_load)
        self._meta = np.array([0, first_slot, 0], np.int64)
        self._free = np.empty(0, np.int64)

    def __len__(self) -> int:
        return int(self._meta[_SIZE])

    @property
    def capacity(self) -> int:
        """Entries in the table (C); it grows before ``len`` passes ``max_load * C``."""
        return int(self._table.shape[0])

    @property
    def slot_end(self) -> int:
        """One past the highest slot ever handed out (storage must hold this many rows)."""
        return int(self._meta[_NEXT_SLOT])

    @property
    def nbytes(self) -> int:
        """Memory held by the table and the free list."""
        return int(self._table.nbytes + self._free.nbytes)

    def _grow(self, expected_ids: int = 0) -> None:
        # Grows by at least GROWTH (amortised O(1) per insert); jumps straight to
        # the size ``expected_ids`` needs, so one large batch of new ids pays one
        # rehash instead of one per growth. Cost: one pass over the old table.
        entries = max(int(self._table.shape[0] * GROWTH), entries_for(expected_ids, self._max_load))
        new = zeros((entries, 2), np.int64)
        rehash_into(self._table, new)
        self._table = new
        self._limit = int(new.shape[0] * self._max_load)

    def reserve(self, ids: int) -> None:
        """Grow now, if needed, so the table holds ``ids`` ids in all without
        passing ``max_load``: for a caller about to insert that many new ids at
        once (rows moved in). Besides paying one rehash, it keeps ids that
        arrive in hash order (another table's export) from piling up in one
        probe run: inserted in home order into a table whose load plus the new
        ids' share passes 1 before the limit is reached, each id probes past
        all the ids inserted before it (measured: 250k exported rows imported
        into a compacted shard, index at load 0.6: 1.2 s; 60 ms with the table
        grown first)."""
        if ids > self._limit:
            self._grow(ids)

    def pack(self) -> tuple[Int64Array, Int64Array]:
        """Renumber the slots so the ``len`` ids held use ``first_slot ..
        first_slot + len - 1``: each id in a slot past that range moves to a free
        slot inside it. Returns the moves ``(src, dst)`` int64 (M,) each, for the
        caller to move its rows the same way. Empties the free list
        (``slot_end`` becomes ``first_slot + len``) and rebuilds the table at the
        size the ids need (load ``max_load / GROWTH``, as after a growth) where
        it has more than ``GROWTH`` times that. Cost: a pass over the table, a
        sort of the M moved slots; a rehash when it is rebuilt."""
        first, held = self._first_slot, len(self)
        new_end = first + held
        _, slots = self.items()
        src = np.sort(slots[slots >= new_end])
        used = np.zeros(held, np.bool_)
        used[slots[slots < new_end] - first] = True
        dst = np.flatnonzero(~used) + first  # the free slots below new_end, as many as src
        moved_to = np.full(self.slot_end - new_end, -1, np.int64)
        moved_to[src - new_end] = dst
        _renumber_kernel(self._table, new_end, moved_to)
        self._meta[_NEXT_SLOT] = new_end
        self._meta[_FREE_COUNT] = 0
        self._free = np.empty(0, np.int64)
        need = entries_for(int(held * GROWTH), self._max_load)
        if self._table.shape[0] > GROWTH * need:
            new = zeros((need, 2), np.int64)
            rehash_into(self._table, new)
            self._table = new
            self._limit = int(need * self._max_load)
        return src, dst

    def get_or_insert_new(
        self, ids: Int64Array, touch: Touch = NO_TOUCH
    ) -> tuple[Int64Array, Int64Array]:
        """Slots of ``ids``, inserting absent ones, in one probe pass.

        Args:
            ids: int64 (N,); duplicates allowed (later copies find the first).
            touch: metadata to update for ids found (ids this call inserts are
                the caller's to stamp).

        Returns:
            ``slots`` int64 (N,) and ``new_at`` int64 (K,): positions in ``ids`` of
            the K ids this call inserted (first occurrences), in order.
        """
        ids = as_ids(ids)
        out = np.empty(ids.size, np.int64)
        new_at = np.empty(ids.size, np.int64)
        base = len(self)
        self._insert(ids, out, new_at, touch)
        return out, new_at[: len(self) - base]

    def get_or_insert_mask(self, ids: Int64Array) -> tuple[Int64Array, BoolArray]:
        """Slots of ``ids`` int64 (N,), inserting absent ones; plus ``is_new`` bool
        (N,), True where this call inserted the id (first occurrence only)."""
        slots, new_at = self.get_or_insert_new(ids)
        is_new = np.zeros(slots.size, np.bool_)
        is_new[new_at] = True
        return slots, is_new

    def get_or_insert(self, ids: Int64Array) -> Int64Array:
        """Slots of ``ids`` int64 (N,) -> int64 (N,), inserting absent ones."""
        ids = as_ids(ids)
        out = np.empty(ids.size, np.int64)
        self._insert(ids, out, np.empty(0, np.int64), NO_TOUCH)
        return out

    def _insert(self, ids: Int64Array, out: Int64Array, new_at: Int64Array, touch: Touch) -> None:
        start = 0
        size_before = len(self)
        t = touch
        while True:
            start = _get_or_insert_kernel(
                self._table, ids, out, new_at, size_before, start, self._meta, self._free,
                self._limit, t.stamp, t.freq, t.touch_s, t.now, t.now_s,
            )  # fmt: skip
            if start == ids.size:
                return
            # Extrapolate this batch's share of new ids to the part not yet inserted.
            new_share = (len(self) - size_before) / start if start else 0.0
            self._grow(len(self) + int(new_share * (ids.size - start)))

    def lookup(self, ids: Int64Array, touch: Touch = NO_TOUCH) -> Int64Array:
        """Slots of ``ids`` int64 (N,) -> int64 (N,); -1 where absent. Never inserts.

        ``touch``: metadata to update for every id found.
        """
        ids = as_ids(ids)
        out = np.empty(ids.size, np.int64)
        t = touch
        _lookup_kernel(self._table, ids, out, t.stamp, t.freq, t.touch_s, t.now, t.now_s)
        return out

    def remove(self, ids: Int64Array) -> Int64Array:
        """Remove ``ids`` (N,); returns their former slots int64 (N,), -1 where absent.

        Freed slots are reused by later inserts; the caller owns what the slot's
        storage row held.
        """
        ids = as_ids(ids)
        need = int(self._meta[_FREE_COUNT]) + ids.size
        if self._free.size < need:
            grown = np.empty(max(need, 2 * self._free.size), np.int64)
            grown[: self._free.size] = self._free
            self._free = grown
        out = np.empty(ids.size, np.int64)
        _remove_kernel(self._table, ids, self._meta, self._free, out)
        return out

    def items(self) -> tuple[Int64Array, Int64Array]:
        """All (keys, slots), int64 (len,) each, in table order."""
        keys, vals = occupied_items(self._table, len(self))
        vals -= 1
        return keys, vals

    def keys(self) -> Int64Array:
        """All ids held, int64 (len,), in table order (matches ``slots()``)."""
        return self.items()[0]

    def slots(self) -> Int64Array:
        """All slots held, int64 (len,), in table order (matches ``keys()``)."""
        return self.items()[1]
