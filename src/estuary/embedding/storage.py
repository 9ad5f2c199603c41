"""Row storage of one shard: float32 rows (R, V) and per-slot metadata beside them.

Row 0 is the shard's shared *unknown* row (read by ids without a row, trained by
their gradients); rows 1.. belong to ids via the hash index. The column layout
of a row is the optimizer's (see ``estuary.embedding.optimizers``), with the
weights in the table's dtype (``estuary.embedding.row_formats``: V = W for
fp32, ``ceil(D/2) + W - D`` for 16-bit weights).

Per-slot metadata (slot = row number; R allocated rows)::

    owner    int64   (R,)  the id holding the slot (valid where stamp > 0); only
                           in tables that evict (a capacity or a TTL: the victims'
                           ids), size 0 otherwise
    stamp    int64   (R,)  access clock of the last touch (eviction.AccessClock);
                           0 = slot free (and the unknown row). In tables that
                           do not evict, uint8 (R,) instead: 1 = touched since the
                           last mark (all a delta needs), 0 = not
    freq     int32   (R,)  touches, for LFU (size 0 unless the policy is lfu)
    touch_s  float64 (R,)  wall time of the last touch (size 0 unless ttl_s is set)

They live in separate arrays, not inline in the float rows, so the optimizer
kernels keep their layout; a touch costs one extra cache line per kept array.
Memory per row: ``4 V + 1`` B without eviction; ``4 V + 16`` B with (+4 lfu,
+8 ttl_s).

Rows grow by ``GROWTH`` (1.1x) at a time: at most 10% of the rows allocated
and unused (5% on average), for one more copy of the rows per row held every
growth (a memcpy; 10 in all, amortised: ~1 KB copied per 128-byte row, well
under a microsecond, against 2-4 with 1.25x growth and twice the slack).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from estuary.embedding.delta import dirty_slots
from estuary.embedding.hash_index import Float64Array, Int32Array, Touch
from estuary.embedding.initializers import initial_weight
from estuary.embedding.memory import grown, shrunk, zeros
from estuary.embedding.precision import FP32, draw_row_bits, f32_to_half_sr
from estuary.embedding.prefetch import ROWS_AHEAD, prefetch, prefetch_span
from estuary.embedding.row_formats import RowFormat
from estuary.embedding.types import Float32Array, Int64Array

UNKNOWN_ROW = 0


@njit(cache=True, nogil=True)
def _init_rows_kernel(
    storage: Float32Array,
    bits: Any,
    dim: int,
    words: int,
    code: int,
    round_key: np.uint64,
    rows: Int64Array,
    ids: Int64Array,
    seed: np.uint64,
    dist: int,
    scale: float,
    truncate: float,
    state: Float32Array,
    owner: Int64Array,
    stamp: Int64Array,
    freq: Int32Array,
    touch_s: Float64Array,
    now: int,
    now_s: float,
) -> None:
    # One pass over scattered new rows: weights, optimizer state and the claim
    # (owner, stamp, freq, touch_s) of each row while its lines are in cache.
    # 16-bit weights (code != FP32) go to ``bits``, the storage's uint16 view,
    # rounded as row_formats' generic encoding rounds them (same bits).
    width = storage.shape[1]
    rnd = np.empty(dim, np.uint32)  # a row's draws (draw_row_bits)
    for n in range(rows.size):
        if n + ROWS_AHEAD < rows.size:
            ahead = rows[n + ROWS_AHEAD]
            prefetch_span(storage, ahead * width, width)
            if owner.size:
                prefetch(owner, ahead)
            prefetch(stamp, ahead)
        r = rows[n]
        key = ids[n]
        if code == FP32:
            for j in range(dim):
                storage[r, j] = initial_weight(dist, seed, key, j, dim, scale, truncate)
        else:
            draw_row_bits(round_key, key, rnd)
            for j in range(dim):
                w = np.float32(initial_weight(dist, seed, key, j, dim, scale, truncate))
                bits[r, j] = f32_to_half_sr(w, rnd[j], code)
        for c in range(state.size):
            storage[r, words + c] = state[c]
        if owner.size:
            owner[r] = key
        stamp[r] = now
        if freq.size:
            freq[r] = 1
        if touch_s.size:
            touch_s[r] = now_s


def rows_out(out: Float32Array | None, n: int, dim: int) -> Float32Array:
    """``out`` checked as the destination of ``n`` rows of width ``dim``, or a fresh
    float32 (n, dim) when ``out`` is None.

    A caller that reuses one buffer across calls (or passes a row slice of a larger
    one) saves the fresh array's first-touch page faults and a copy: on VMs the
    faults cost as much as the gather itself at D = 64.
    """
    if out is None:
        return np.empty((n, dim), np.float32)
    if (
        not isinstance(out, np.ndarray)
        or out.dtype != np.float32
        or out.shape != (n, dim)
        or not out.flags.c_contiguous
        or not out.flags.writeable
    ):
        got = (
            f"{out.dtype} {out.shape}, c_contiguous={out.flags.c_contiguous}, "
            f"writeable={out.flags.writeable}"
            if isinstance(out, np.ndarray)
            else type(out).__name__
        )
        raise ValueError(
            f"out must be a writeable C-contiguous float32 array of shape ({n}, {dim}), got {got}"
        )
    return out


GROWTH = 1.1  # row growth factor (module docstring)
# Every array of RowStorage with one entry per row: what a growth, a packing
# (``pack``) and a cut (``shrink``) must all carry.
PER_ROW = ("array", "owner", "stamp", "freq", "touch_s")


@njit(cache=True, nogil=True)
def _move_rows(arr: Any, src: Int64Array, dst: Int64Array) -> None:
    # arr[dst[n]] = arr[src[n]] row by row, in place (no temporary): the two sets
    # of rows are disjoint (``RowStorage.pack``).
    for n in range(src.size):
        if n + ROWS_AHEAD < src.size:
            prefetch_span(arr, src[n + ROWS_AHEAD] * arr.shape[1], arr.shape[1])
        arr[dst[n]] = arr[src[n]]


class RowStorage:
    """Growable rows + per-slot metadata; grows by ``GROWTH`` (amortised O(1) per row).

    Args:
        fmt: the row format (its ``stored_width`` V is the floats per row).
        capacity_rows: rows allocated up front (row 0 included).
        max_rows: growth stops here (a capacity-bounded shard needs
            ``capacity + 1`` rows at most); a request beyond it is still met.
        keep_freq: keep ``freq`` (LFU).
        keep_time: keep ``touch_s`` (TTL in seconds).
        evicts: the table evicts (capacity or TTL): keep ``owner`` and clock
            stamps; else no owner and 1-byte touched-since-mark stamps.
    """

    def __init__(
        self,
        fmt: RowFormat,
        capacity_rows: int,
        *,
        max_rows: int | None = None,
        keep_freq: bool = False,
        keep_time: bool = False,
        evicts: bool = True,
    ) -> None:
        self.fmt = fmt
        self.width = width = fmt.stored_width
        self.max_rows = max_rows
        rows = max(1, capacity_rows if max_rows is None else min(capacity_rows, max_rows))
        self.array: Float32Array = zeros((rows, width), np.float32)
        self.evicts = evicts
        self.owner: Int64Array = zeros((rows if evicts else 0,), np.int64)
        self.stamp: Int64Array = zeros((rows,), np.int64 if evicts else np.uint8)
        self.freq: Int32Array = zeros((rows if keep_freq else 0,), np.int32)
        self.touch_s: Float64Array = zeros((rows if keep_time else 0,), np.float64)

    @property
    def capacity_rows(self) -> int:
        """Rows allocated (R_alloc >= rows in use)."""
        return int(self.array.shape[0])

    @property
    def nbytes(self) -> int:
        """Memory held by the rows and the metadata."""
        return int(sum(getattr(self, name).nbytes for name in PER_ROW))

    def pack(self, src: Int64Array, dst: Int64Array) -> None:
        """Move rows ``src`` int64 (M,) to free slots ``dst`` (M,), every per-row
        array (``PER_ROW``) alike: weights, optimizer state and metadata. The
        slots of ``src`` are left holding stale copies (the caller cuts them off
        with ``shrink``). In place: no temporary beyond the two index arrays."""
        for name in PER_ROW:
            arr = getattr(self, name)
            if arr.size:
                _move_rows(arr.reshape(arr.shape[0], -1), src, dst)

    def shrink(self, rows: int) -> None:
        """Cut every per-row array to ``rows`` rows and give the memory past them
        back to the OS (``memory.shrunk``: no copy for the large arrays). Rows
        ``rows..`` must be free."""
        for name in PER_ROW:
            arr = getattr(self, name)
            if arr.size:
                setattr(self, name, shrunk(arr, rows))

    def ensure_rows(self, rows: int) -> None:
        """Make rows ``0 .. rows-1`` addressable (copies once per growth).

        New rows and metadata start at zero (stamp 0 = free).
        """
        if rows <= self.array.shape[0]:
            return
        target = max(rows, int(GROWTH * self.array.shape[0]))
        if self.max_rows is not None:
            target = max(rows, min(target, self.max_rows))
        for name in PER_ROW:
            setattr(self, name, grown(getattr(self, name), target))

    def _stamp_of(self, now: int) -> int:
        # The value a touch at clock ``now`` leaves in ``stamp``.
        return now if self.evicts else 1

    def touch(self, now: int, now_s: float) -> Touch:
        """The metadata a hit of this call updates (valid until the next growth)."""
        return Touch(self.stamp, self.freq, self.touch_s, self._stamp_of(now), now_s)

    def dirty_slots(self, end: int, clean_stamp: int) -> Int64Array:
        """Slots below ``end`` touched since the mark at clock ``clean_stamp``."""
        stamp = self.stamp[:end]
        slots = np.empty(stamp.size, np.int64)
        return slots[: dirty_slots(stamp, clean_stamp if self.evicts else 0, slots)]

    def mark_clean(self) -> None:
        """Start a new delta interval: clears the touched flags of a table that
        does not evict (one pass over R bytes); clock stamps need nothing."""
        if not self.evicts:
            self.stamp[:] = 0

    def load_stamps(self, slots: Int64Array, stamps: np.ndarray) -> None:
        """Set the clock stamps of ``slots`` (N,) from a state (kept only where the
        table evicts; others just loaded count as touched)."""
        if self.evicts:
            self.stamp[slots] = np.maximum(np.asarray(stamps, np.int64), 1)

    def claim(self, slots: Int64Array, ids: Int64Array, now: int, now_s: float) -> None:
        """Record that ``ids`` int64 (N,) now own ``slots`` (N,), touched once at ``now``."""
        if self.owner.size:
            self.owner[slots] = ids
        self.stamp[slots] = self._stamp_of(now)
        if self.freq.size:
            self.freq[slots] = 1
        if self.touch_s.size:
            self.touch_s[slots] = now_s

    def init_rows(
        self,
        rows: Int64Array,
        ids: Int64Array,
        weights: tuple[int, float, float],
        seed: int,
        state: Float32Array,
        now: int,
        now_s: float,
        round_key: int,
    ) -> None:
        """Initialise ``rows`` int64 (N,) for new ``ids`` (N,) in one pass: weights
        drawn by ``initializers.initial_weight`` (``weights`` = distribution, scale,
        truncate; ``seed`` the table seed; 16-bit weights rounded with
        ``round_key``), state columns set to ``state`` float32 (W - D,), then
        ``claim``. Same result as ``RowFormat.fill`` and ``claim`` in turn, one
        pass instead of two."""
        dist, scale, truncate = weights
        f = self.fmt
        _init_rows_kernel(
            self.array, self.array.view(np.uint16), f.dim, f.words, f.code, np.uint64(round_key),
            rows, ids, np.uint64(seed), dist, scale, truncate, state,
            self.owner, self.stamp, self.freq, self.touch_s, self._stamp_of(now), now_s,
        )  # fmt: skip

    def release(self, slots: Int64Array) -> None:
        """Mark ``slots`` int64 (N,) free (their rows are re-initialised on reuse)."""
        self.stamp[slots] = 0
        if self.freq.size:
            self.freq[slots] = 0

    def gather(self, rows: Int64Array, dim: int, out: Float32Array | None = None) -> Float32Array:
        """Weights of ``rows`` int64 (N,) -> float32 (N, D); row < 0 reads row 0.

        Writes into ``out`` (see ``rows_out``) when given, else into a fresh array.
        """
        out = rows_out(out, rows.size, dim)
        self.fmt.gather(self.array, rows, out)
        return out
