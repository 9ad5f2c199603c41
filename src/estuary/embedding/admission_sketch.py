"""Approximate admission counting: a two-generation blocked count-min sketch.

The exact filter (``estuary.embedding.admission``) keeps 16 B (at load <= 0.7:
23-34 B) per id seen but not admitted; in a Zipf stream with ``min_count: 2``
most distinct ids are seen once, several per admitted row, so it cost more
than the rows' own metadata (68 B per row on the 4-hour synthetic job). This
filter keeps a few bits per id instead.

Layout: a *layer* is an array of 64-byte blocks (8 uint64 words) of ``b``-bit
saturating counters, ``b`` the smallest of 1, 2, 4, 8 with ``2**b - 1 >=
min_count - 1`` (``b = 8`` whenever ``probability < 1``, so repeated sightings
keep flipping fresh coins). An id hashes to one block (one cache line) and to
``hashes`` counters inside it; its estimate in the layer is the minimum of those
counters (count-min), which never undercounts. Updates are *conservative*: only
counters below the new estimate are raised to it.

Two generations: ``current`` takes updates; ``previous`` is frozen. An id's
estimate is the sum of its two layer estimates. When more than ``FILL`` of the
current layer's counters are non-zero, it becomes ``previous`` (the old
previous is dropped: sightings older than two generations are forgotten, as
the exact filter's halving forgets rare ids) and a fresh current layer of twice
the size starts, up to the size for ``max_pending_ids`` ids. So memory follows
the stream (a table with 5 distinct ids holds 2 KiB) and is bounded.

Error (documented, tested): an id never seen before is *falsely admitted*
(treated as seen ``min_count - 1`` times) when all of its counters are already
high enough in a layer: per layer with a fraction ``f`` of counters non-zero
about ``f ** hashes`` (blocked: a little more); the frozen layer has ``f <=
FILL``. With ``FILL = 0.5`` and ``hashes = 6`` (the default) that is about 2%
for ``min_count: 2`` (measured 1.4-2.2% on random ids at the size bound;
tests/embedding/test_admission_sketch.py bounds it at 3%). Ids are never
admitted *later* than exactly, except when their sightings span more than two
generations (on the 4-hour synthetic job: 9.7% of the exact counter's rows were
not admitted, 4.6% of the sketch's rows were false admissions; docs/results.md).
Memory per tracked id at the rotation point is ``hashes / ln 2 * b`` bits
(8.7 bits for b = 1, 6 hashes).

Decisions depend only on the set of ids seen before (and the seed), not on
the order within a call; each shard keeps its own sketch, so collisions (and
so false admissions) differ between shard counts, not their rate.

State (``state_dict``): ``words`` uint64 (current then previous words),
``sizes`` int64 (2,) words per layer, ``meta`` int64 (3,) non-zero counters of
the current layer, rotations, counter bits. Loading restores it bit for
bit, so a resumed run makes the same decisions. ``merge_states`` combines the
sketches of several shards (layers expanded to one size, element-wise max: an
upper bound of every id's count, in the previous layer), for loading into another shard count.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
from numba import njit

from estuary.config.spec import AdmissionSpec
from estuary.embedding.admission_counter import AdmissionCounter
from estuary.embedding.hashing import id_hash, mix64, unit_float
from estuary.embedding.types import Int64Array

BoolArray = npt.NDArray[np.bool_]
UInt64Array = npt.NDArray[np.uint64]

FILL = 0.5  # rotate when this fraction of the current layer's counters is non-zero
BLOCK_WORDS = 8  # one 64-byte cache line per id
_MIN_BLOCKS = 16  # first layer: 1 KiB
_POS_SALT = np.uint64(0x94D049BB133111EB)
_S32 = np.uint64(32)


def counter_bits(spec: AdmissionSpec) -> int:
    """Bits per counter for ``spec`` (module docstring)."""
    if spec.probability < 1.0:
        return 8
    for bits in (1, 2, 4, 8):
        if (1 << bits) - 1 >= spec.min_count - 1:
            return bits
    raise ValueError(f"min_count {spec.min_count} needs the exact counter (sketch counts to 256)")


@njit(cache=True, nogil=True, inline="always")
def _estimate(
    layer: UInt64Array, key: np.int64, bits: int, hashes: int, pos_bits: int
) -> tuple[np.int64, np.int64]:
    # (estimate, block start word) of ``key`` in ``layer``.
    blocks = layer.size // 8
    if blocks == 0:
        return np.int64(0), np.int64(-1)
    h = id_hash(key)
    start = np.int64(((h >> _S32) * np.uint64(blocks)) >> _S32) * 8
    g = mix64(h ^ _POS_SALT)
    per_word = 64 // bits
    mask = np.uint64((1 << bits) - 1)
    pos_mask = np.uint64((1 << pos_bits) - 1)
    best = np.int64(255)
    for j in range(hashes):
        p = np.int64((g >> np.uint64(j * pos_bits)) & pos_mask)
        w = start + p // per_word
        shift = np.uint64((p % per_word) * bits)
        c = np.int64((layer[w] >> shift) & mask)
        if c < best:
            best = c
    return best, start


@njit(cache=True, nogil=True)
def _observe_kernel(
    cur: UInt64Array,
    prev: UInt64Array,
    ids: Int64Array,
    counts: Int64Array,
    admitted: BoolArray,
    start_at: int,
    meta: Int64Array,
    limit: int,
    bits: int,
    pos_bits: int,
    hashes: int,
    min_count: int,
    probability: float,
    seed: np.uint64,
) -> int:
    # meta[0] = non-zero counters in ``cur``.
    # Returns where it stopped: ids.size when done, earlier when ``cur`` filled up
    # (more than ``limit`` non-zero counters): the caller rotates and resumes.
    per_word = 64 // bits
    mask = np.uint64((1 << bits) - 1)
    cap = np.int64((1 << bits) - 1)
    pos_mask = np.uint64((1 << pos_bits) - 1)
    for n in range(start_at, ids.size):
        if meta[0] > limit:
            return n
        key = ids[n]
        e_prev, _ = _estimate(prev, key, bits, hashes, pos_bits)
        e_cur, start = _estimate(cur, key, bits, hashes, pos_bits)
        c = e_prev + e_cur + counts[n]
        ok = c >= min_count
        if ok and probability < 1.0:
            ok = unit_float(seed, key, np.uint64(c)) < probability
        admitted[n] = ok
        if ok:
            continue
        v = min(cap, e_cur + counts[n])
        g = mix64(id_hash(key) ^ _POS_SALT)
        for j in range(hashes):
            p = np.int64((g >> np.uint64(j * pos_bits)) & pos_mask)
            w = start + p // per_word
            shift = np.uint64((p % per_word) * bits)
            old = np.int64((cur[w] >> shift) & mask)
            if old < v:
                if old == 0:
                    meta[0] += 1
                cur[w] = (cur[w] & ~(mask << shift)) | (np.uint64(v) << shift)
    return ids.size


@njit(cache=True, nogil=True)
def _count_new(layer: UInt64Array, ids: Int64Array, bits: int, pos_bits: int, hashes: int) -> int:
    # Ids whose estimate in ``layer`` is 0 (each sets up to ``hashes`` counters).
    n = 0
    for i in range(ids.size):
        if _estimate(layer, ids[i], bits, hashes, pos_bits)[0] == 0:
            n += 1
    return n


def _expanded(layer: UInt64Array, blocks: int) -> UInt64Array:
    # ``layer`` grown to ``blocks`` blocks keeping every id's estimate: block i of
    # the result is block floor(i * old / new) of ``layer`` (the block an id's
    # multiply-shift home maps to), so estimates stay upper bounds.
    old = layer.size // BLOCK_WORDS
    if old == blocks:
        return layer
    src = (np.arange(blocks, dtype=np.int64) * old) // blocks
    return np.ascontiguousarray(layer.reshape(old, BLOCK_WORDS)[src].reshape(-1))


class SketchAdmissionFilter(AdmissionCounter):
    """Admission by approximate counts (module docstring); same interface as
    ``AdmissionFilter``.

    Args:
        spec: the table's admission section (``min_count``, ``probability``,
            ``sketch_hashes``).
        seed: 64-bit seed of the probability coin.
        max_pending_ids: ids a layer is sized for at most (bounds memory at
            ``3 * max_pending_ids * hashes / ln 2 * b / 8`` B).
    """

    def __init__(self, spec: AdmissionSpec, seed: int, *, max_pending_ids: int = 1 << 20) -> None:
        if max_pending_ids < 1:
            raise ValueError("max_pending_ids must be >= 1")
        self.spec = spec
        self._seed = np.uint64(seed)
        self.bits = counter_bits(spec)
        self.hashes = spec.sketch_hashes
        cells = max_pending_ids * self.hashes / math.log(2)
        self._max_blocks = max(_MIN_BLOCKS, math.ceil(cells * self.bits / 512))
        self._cur: UInt64Array = np.zeros(_MIN_BLOCKS * BLOCK_WORDS, np.uint64)
        self._prev: UInt64Array = np.zeros(0, np.uint64)
        self._meta = np.zeros(2, np.int64)  # non-zero counters of cur, rotations
        self.counting = True

    @property
    def max_min_count(self) -> int:
        """The highest ``min_count`` its ``bits``-bit counters decide (they
        count to ``2**bits - 1`` past the first sighting)."""
        return 1 << self.bits

    @property
    def aged(self) -> int:
        """Rotations so far (each forgets the sightings of two generations ago)."""
        return int(self._meta[1])

    def __len__(self) -> int:
        """Ids the sketch holds counts of, estimated from how many counters are
        set (admitted ids stay in it: a sketch cannot delete). One pass over it."""
        return sum(self._tracked_in(layer) for layer in (self._cur, self._prev) if layer.size)

    @property
    def nbytes(self) -> int:
        """Memory held by the two layers."""
        return int(self._cur.nbytes + self._prev.nbytes)

    def _decide(self, uniq: Int64Array, counts: Int64Array) -> Int64Array:
        return self.observe_counts(uniq, counts)

    def observe_counts(
        self, uniq: Int64Array, counts: Int64Array, *, admit: bool = True
    ) -> Int64Array:
        """``observe`` of unique ids ``uniq`` (U,) seen ``counts`` (U,) times each;
        ``admit=False`` only counts (nothing is admitted)."""
        admitted = np.empty(uniq.size, np.bool_)
        start = 0
        s = self.spec
        min_count = s.min_count if admit else np.iinfo(np.int64).max
        # Rotate before the call rather than in it when its new ids would overfill
        # the current layer (sized for them: one rotation instead of several, each
        # of which forgets a layer).
        need = self.hashes * _count_new(
            self._cur, uniq, self.bits, _pos_bits(self.bits), self.hashes
        )
        if self._meta[0] + need > self._limit():
            self._rotate(need)
        while True:
            start = _observe_kernel(
                self._cur, self._prev, uniq, counts, admitted, start, self._meta, self._limit(),
                self.bits, _pos_bits(self.bits), self.hashes, min_count, s.probability, self._seed,
            )  # fmt: skip
            if start == uniq.size:
                return uniq[admitted]
            self._rotate()

    def _limit(self) -> int:
        return int(FILL * self._cur.size * 64 // self.bits)

    def _rotate(self, cells: int = 0) -> None:
        # The new current layer: twice the old, or room for ``cells`` more
        # non-zero counters below FILL, up to the bound.
        fit = math.ceil(cells / FILL * self.bits / 512)
        blocks = min(self._max_blocks, max(2 * (self._cur.size // BLOCK_WORDS), fit))
        self._prev = self._cur
        self._cur = np.zeros(blocks * BLOCK_WORDS, np.uint64)
        self._meta[0] = 0
        self._meta[1] += 1

    def _tracked_in(self, layer: UInt64Array) -> int:
        # Ids a layer holds, estimated from its non-zero counters (Swamidass-Baldi).
        cells = layer.size * 64 // self.bits
        nonzero = _nonzero_cells(layer, self.bits)
        if nonzero >= cells:
            return cells
        return round(-cells / self.hashes * math.log(1.0 - nonzero / cells))

    def state_dict(self) -> dict[str, np.ndarray]:
        """``words`` uint64, ``sizes`` int64 (2,), ``meta`` int64 (3,): non-zero
        counters of the current layer, rotations, counter bits."""
        return {
            "words": np.concatenate([self._cur, self._prev]),
            "sizes": np.array([self._cur.size, self._prev.size], np.int64),
            "meta": np.append(self._meta, self.bits),
        }

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Restore ``state`` (as from ``state_dict``) bit for bit."""
        words = np.asarray(state["words"], np.uint64)
        sizes = np.asarray(state["sizes"], np.int64).reshape(-1)
        meta = np.asarray(state["meta"], np.int64).reshape(-1)
        if sizes.size != 2 or meta.size != 3 or int(sizes.sum()) != words.size:
            raise ValueError(
                f"admission sketch state: sizes {sizes.tolist()} do not match {words.size} words"
            )
        if int(meta[2]) != self.bits:
            raise ValueError(
                f"admission sketch state has {int(meta[2])}-bit counters, this table "
                f"counts with {self.bits} bits (min_count or probability changed)"
            )
        meta = meta[:2]
        if any(int(s) % BLOCK_WORDS for s in sizes):
            raise ValueError(f"admission sketch state: layer sizes {sizes.tolist()} not in blocks")
        cur = words[: sizes[0]].copy()
        self._cur = cur if cur.size else np.zeros(_MIN_BLOCKS * BLOCK_WORDS, np.uint64)
        self._prev = words[sizes[0] :].copy()
        self._meta = meta.copy()
        self._meta[0] = _nonzero_cells(self._cur, self.bits)


def _pos_bits(bits: int) -> int:
    # Bits of a counter's position in a block: log2(512 / bits).
    return 9 - (bits.bit_length() - 1)


def merge_states(states: list[dict[str, np.ndarray]], bits: int) -> dict[str, np.ndarray]:
    """Several shards' sketch states (same spec) -> one whose estimate of every id is
    at least its estimate in any of them.

    Each shard's two layers are added counter by counter (saturating; the
    previous layer expanded to the current one's size), the sums expanded to
    the largest size and combined by element-wise maximum: the result is the
    merged state's *previous* layer, under a fresh current layer. (Merging into
    the current layer would make it start over-full and rotate at once, dropping
    what the previous layer held.) Until the next rotation drops it, that layer
    holds the union of every shard's ids, so false admissions run higher."""
    if len(states) == 1:
        return states[0]
    sums = []
    for st in states:
        words, sizes = np.asarray(st["words"], np.uint64), np.asarray(st["sizes"], np.int64)
        cur, prev = words[: sizes[0]].copy(), words[sizes[0] :]
        if prev.size:
            _combine_fields(cur, _expanded(prev, cur.size // BLOCK_WORDS), bits, True)
        sums.append(cur)
    blocks = max(p.size for p in sums) // BLOCK_WORDS
    prev = np.zeros(blocks * BLOCK_WORDS, np.uint64)
    for part in sums:
        _combine_fields(prev, _expanded(part, blocks), bits, False)
    cur = np.zeros_like(prev)
    metas = np.stack([np.asarray(st["meta"], np.int64) for st in states])
    return {
        "words": np.concatenate([cur, prev]),
        "sizes": np.array([cur.size, prev.size], np.int64),
        "meta": np.array([0, metas[:, 1].max(), bits], np.int64),
    }


@njit(cache=True, nogil=True)
def _combine_fields(out: UInt64Array, other: UInt64Array, bits: int, add: bool) -> None:
    # Counter by counter: out = min(cap, out + other) (add) or max(out, other).
    mask = np.uint64((1 << bits) - 1)
    for i in range(out.size):
        a, b = out[i], other[i]
        if b == 0 or (a == b and not add):
            continue
        r = np.uint64(0)
        for f in range(64 // bits):
            shift = np.uint64(f * bits)
            x = (a >> shift) & mask
            y = (b >> shift) & mask
            if add:
                z = x + y
                v = z if z < mask else mask
            else:
                v = x if x > y else y
            r |= v << shift
        out[i] = r


@njit(cache=True, nogil=True)
def _nonzero_cells(layer: UInt64Array, bits: int) -> int:
    mask = np.uint64((1 << bits) - 1)
    n = 0
    for i in range(layer.size):
        w = layer[i]
        if w == 0:
            continue
        for f in range(64 // bits):
            if (w >> np.uint64(f * bits)) & mask:
                n += 1
    return n
