"""Eviction: capacity (LRU / LFU), TTL (steps, seconds) and LFU ageing.

The policy decides (``EvictionPolicy`` returns slots to free); the shard acts
(removes them from the index, frees the slots for reuse, records the ids for
the next delta, counts ``TableStats.evictions``).

**Access clock.** Every training call on a shard (a train lookup or an
``apply_gradients``) takes a new *stamp* from ``AccessClock``; every row it
touches records that stamp (``RowStorage.stamp``). A stamp packs the step
above 24 bits of call-within-step, ``stamp = step << 24 | call``, so it is
strictly increasing, ``stamp >> 24`` is the step of the last touch (TTL in
steps needs no second per-row array), and the rows of the call being served are
exactly those with ``stamp == now`` (they are never chosen as victims). A
*step* ends with each ``apply_gradients`` (or ``advance_step()``).

**Capacity.** When inserting ``n`` new ids would pass the shard's
``capacity_rows``, the shard evicts ``held + n - 0.95 * capacity`` rows in one
batch (at least enough to fit), so eviction runs once per ~5% of capacity
inserted, not per batch. Victims are chosen *exactly* by key, smallest first:

    lru: key = stamp                         (least recently touched)
    lfu: key = min(freq, 2**22-1) << 40 | step of last touch
         (least often touched; ties go to the least recent)

``select_victims`` is a radix select in numba: one pass for min/max, one
histogram pass (4096 buckets) per 12 bits of key range, one collecting pass;
3-6 sequential passes over the shard's stamps (8-12 B per row), e.g. ~10-20 ms
per pass-set over 10M rows, amortised over >= 5% of capacity evicted: a few
tens of ns per inserted row. No sampling error, no heap to maintain per touch.
Ties at the threshold key go to the smallest ids (a sort of the tied slots
only), so the choice does not depend on slot layout: a replica restored from a
snapshot and deltas evicts exactly what its source does.

**LFU ageing.** After every ``10 x capacity`` touches (TinyLFU's reset window)
all counts are halved (one pass), so an old heavy hitter that stops appearing
decays and eventually goes.

**TTL.** ``ttl_steps``: a row last touched in step ``k`` expires once
``ttl_steps`` further steps have ended without touching it (``step - 1 - k >=
ttl_steps``, i.e. ``stamp < (step - ttl_steps) << 24``). ``ttl_s``: a row
expires when its last touch is older than ``ttl_s`` wall seconds. A sweep is one
pass over the stamps; it runs every ``sweep_every_steps`` steps and on ``sweep()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from estuary.config.spec import EvictionSpec
from estuary.embedding.hash_index import Float64Array, Int32Array
from estuary.embedding.storage import RowStorage
from estuary.embedding.types import Int64Array

STEP_SHIFT = 24
_CALL_MASK = (1 << STEP_SHIFT) - 1
LOW_WATER = 0.95  # a capacity eviction leaves the shard at this fraction of capacity
AGING_WINDOW = 10  # LFU counts halve after this many x capacity touches
_LFU_SHIFT = 40
_STEP_MAX = (1 << _LFU_SHIFT) - 1
_BUCKET_BITS = 12
_EMPTY = np.empty(0, np.int64)


class AccessClock:
    """Stamps of training calls: ``step << 24 | call`` (see module docstring).

    Args:
        value: the last stamp handed out (0 = none yet).
    """

    def __init__(self, value: int = 0) -> None:
        self.value = value

    @property
    def step(self) -> int:
        """Steps ended so far."""
        return self.value >> STEP_SHIFT

    def tick(self) -> int:
        """A new stamp for one call (saturates after 2**24 - 1 calls in one step)."""
        if (self.value & _CALL_MASK) < _CALL_MASK:
            self.value += 1
        return self.value

    def end_step(self) -> int:
        """End the current step; returns the number of steps ended."""
        self.value = (self.step + 1) << STEP_SHIFT
        return self.step


@njit(cache=True, nogil=True, inline="always")
def _key(stamp: np.int64, freq: np.int32, lfu: bool) -> np.int64:
    # Scalars only: an njit helper taking arrays keeps refcounting in the loop.
    if not lfu:
        return stamp
    step = min(stamp >> STEP_SHIFT, np.int64(_STEP_MAX))
    return (np.int64(freq) << _LFU_SHIFT) | step


@njit(cache=True, nogil=True)
def select_victims(
    stamp: Int64Array,
    freq: Int32Array,
    owner: Int64Array,
    protect_from: int,
    k: int,
    out: Int64Array,
) -> int:
    """Write the ``k`` eligible slots with the smallest keys into ``out``; return the count.

    Args:
        stamp: int64 (R,) per slot; eligible slots have ``0 < stamp < protect_from``.
        freq: int32 (R,) for LFU keys, or size 0 for LRU (key = stamp).
        owner: int64 (R,) the id in each slot; ties at the threshold key go to the
            smallest ids, so the choice does not depend on slot layout (a restored
            replica evicts exactly what its source would).
        protect_from: stamps >= this are protected (the current call's rows).
        k: victims wanted.
        out: int64 (>= k,) receives slot numbers.

    Returns:
        ``min(k, eligible)``.
    """
    n = stamp.size
    lfu = freq.size > 0
    count = 0
    lo = np.int64(np.iinfo(np.int64).max)
    hi = np.int64(-1)
    for s in range(n):
        st = stamp[s]
        if st <= 0 or st >= protect_from:
            continue
        key = _key(st, freq[s] if lfu else np.int32(0), lfu)
        count += 1
        lo = min(lo, key)
        hi = max(hi, key)
    if count == 0 or k <= 0:
        return 0
    take_all = k >= count
    threshold = hi
    rest = k  # victims still to place at or above the current range's start
    hist = np.zeros(1 << _BUCKET_BITS, np.int64)
    b = 0
    if not take_all:
        while True:
            span = hi - lo  # keys in [lo, hi]
            shift = 0
            while (span >> shift) >= (1 << _BUCKET_BITS):
                shift += 1
            hist[:] = 0
            for s in range(n):
                st = stamp[s]
                if st <= 0 or st >= protect_from:
                    continue
                key = _key(st, freq[s] if lfu else np.int32(0), lfu)
                if lo <= key <= hi:
                    hist[(key - lo) >> shift] += 1
            b = 0
            below = 0
            while below + hist[b] < rest:
                below += hist[b]
                b += 1
            rest -= below
            lo = lo + (np.int64(b) << shift)
            hi = min(hi, lo + (np.int64(1) << shift) - 1)
            if shift == 0:
                break
        threshold = lo  # k-th smallest key: all keys below it go, `rest` ties too
    got = 0
    ties = np.empty(0 if take_all else hist[b], np.int64)  # slots at the threshold key
    n_ties = 0
    for s in range(n):
        st = stamp[s]
        if st <= 0 or st >= protect_from:
            continue
        key = _key(st, freq[s] if lfu else np.int32(0), lfu)
        if take_all or key < threshold:
            out[got] = s
            got += 1
        elif key == threshold:
            ties[n_ties] = s
            n_ties += 1
    if not take_all and rest > 0:
        if rest < n_ties:  # keep the smallest ids among the ties
            ties = ties[np.argsort(owner[ties])]
        out[got : got + rest] = ties[:rest]
        got += rest
    return got


@njit(cache=True, nogil=True)
def expired_slots(
    stamp: Int64Array, touch_s: Float64Array, stamp_cut: int, time_cut: float, out: Int64Array
) -> int:
    """Slots in use with ``stamp < stamp_cut`` or (kept) ``touch_s < time_cut``.

    Args:
        stamp: int64 (R,); 0 = free.
        touch_s: float64 (R,) or size 0 (no wall-time TTL).
        stamp_cut: 0 disables the step TTL.
        time_cut: -inf disables the wall-time TTL.
        out: int64 (R,) receives slot numbers.
    """
    got = 0
    timed = touch_s.size > 0
    for s in range(stamp.size):
        st = stamp[s]
        if st <= 0:
            continue
        if st < stamp_cut or (timed and touch_s[s] < time_cut):
            out[got] = s
            got += 1
    return got


@njit(cache=True, nogil=True)
def age_counts(freq: Int32Array, shift: int) -> None:
    """Halve every count ``shift`` times (``freq >>= shift``)."""
    for s in range(freq.size):
        freq[s] >>= shift


@dataclass(frozen=True)
class EvictionDecision:
    """What the shard must do before inserting new ids.

    Args:
        slots: int64 (V,) slots to evict now.
        admit: how many of the new ids fit afterwards (fewer than asked only when
            one call brings more new ids than the shard's capacity).
    """

    slots: Int64Array
    admit: int


class EvictionPolicy:
    """Decides capacity victims, TTL expiry and LFU ageing for one shard.

    Args:
        spec: the table's eviction section.
        shards: shards of the table; each gets ``ceil(capacity_rows / shards)``.

    Holds the LFU ageing counters (``aging``: halvings so far; ``aging_touches``:
    touches since the last one), which travel in state dicts.
    """

    def __init__(self, spec: EvictionSpec, shards: int = 1) -> None:
        self.spec = spec
        cap = spec.capacity_rows
        self.capacity_rows: int | None = None if cap is None else -(-cap // shards)
        self.lfu = spec.policy == "lfu"
        self.keep_time = spec.ttl_s is not None
        self.has_ttl = spec.ttl_steps is not None or spec.ttl_s is not None
        self.aging = 0
        self.aging_touches = 0

    def make_room(
        self, storage: RowStorage, slot_end: int, held: int, new: int, now: int
    ) -> EvictionDecision:
        """Victims so that ``held + new`` rows fit the capacity (see module docstring).

        Rows stamped ``now`` (this call's) are never chosen.
        """
        cap = self.capacity_rows
        if cap is None or held + new <= cap:
            return EvictionDecision(_EMPTY, new)
        k = min(held, max(held + new - cap, held + new - int(cap * LOW_WATER)))
        out = np.empty(k, np.int64)
        freq = storage.freq[:slot_end]
        got = select_victims(storage.stamp[:slot_end], freq, storage.owner[:slot_end], now, k, out)
        return EvictionDecision(out[:got], max(0, min(new, cap - (held - got))))

    def sweep_due(self, step: int) -> bool:
        """Whether the automatic TTL sweep runs at the end of ``step``."""
        return self.has_ttl and step % self.spec.sweep_every_steps == 0

    def expired(self, storage: RowStorage, slot_end: int, step: int, now_s: float) -> Int64Array:
        """Slots whose TTL has passed at ``step`` (steps ended) and wall time ``now_s``."""
        if not self.has_ttl:
            return _EMPTY
        ttl_steps, ttl_s = self.spec.ttl_steps, self.spec.ttl_s
        stamp_cut = (step - ttl_steps) << STEP_SHIFT if ttl_steps and step > ttl_steps else 0
        time_cut = now_s - ttl_s if ttl_s is not None else -np.inf
        out = np.empty(slot_end, np.int64)
        got = expired_slots(
            storage.stamp[:slot_end], storage.touch_s[:slot_end], stamp_cut, time_cut, out
        )
        return out[:got]

    def note_touches(self, touches: int, held: int) -> bool:
        """Count touches; True when LFU counts are due to be halved (then counted)."""
        if not self.lfu:
            return False
        self.aging_touches += touches
        window = AGING_WINDOW * (self.capacity_rows or max(held, 1024))
        if self.aging_touches < window:
            return False
        self.aging_touches = 0
        self.aging += 1
        return True


def age(freq: Int32Array, halvings: int) -> None:
    """Apply ``halvings`` halvings to counts ``freq`` int32 (R,) in place."""
    if halvings > 0 and freq.size:
        age_counts(freq, min(halvings, 31))
