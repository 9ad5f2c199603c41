"""State-dict keys, incremental checkpoints (deltas) and resharding helpers.

A full state (``state_dict``; R rows, P pending ids, S shards, D dim)::

    ids                 int64   (R,)     row keys ...
    weights             float32 (R, D)   the table's dtype: float16 (fp16), uint16 (bf16 bits)
    opt.<slot>          float32 (R, D) per optimizer slot, (R,) per scalar
    evict.stamp         int64   (R,)     access stamp of the last touch (tables that evict)
    evict.freq          int32   (R,)     LFU use count (lfu tables only)
    evict.touch_s       float64 (R,)     wall time of the last touch (ttl_s only)
    admission.ids       int64   (P,)     pending (not yet admitted) ids
    admission.counts    int64   (P,)     their sightings (``counter: exact``)
    admission.sketch.words  uint64 (K,)  every shard's sketch layers, one after
                                         another (``counter: sketch``)
    admission.sketch.sizes  int64 (S, 2) words of each shard's two layers
    admission.sketch.meta   int64 (S, 3) each shard's sketch: non-zero counters,
                                         rotations, counter bits
    unknown.weights     float32 (S, D)   one unknown row per shard (dtype as weights) ...
    unknown.opt.<slot>  float32 (S, D) or (S,)
    meta.clock          int64   (S,)     per shard: access clock (step << 24 | call)
    meta.aging          int64   (S,)     LFU halvings so far
    meta.aging_touches  int64   (S,)     touches since the last halving
    delta.lineage       int64   (1,)     random id of this table's checkpoint chain
    delta.version       int64   (1,)     version of this state in the chain

A *delta* (``delta_state_dict``) has the same keys, but its rows are only those
changed (inserted, updated by a gradient, or touched by a train lookup) since
the last mark (``state_dict()``, ``delta_state_dict()`` or ``mark_clean()``),
plus::

    evicted_ids         int64   (E,)     ids removed since the mark and not back
    delta.base          int64   (1,)     the version it applies on top of
    delta.full          int64   (1,)     1: the rows are all rows (see below)

The pending-admission table, the unknown rows and ``meta.*`` are included whole
(they are small and bounded). Applying a delta: remove ``evicted_ids``, age LFU
counts of untouched rows by the missing halvings, upsert the rows, replace the
rest. The result equals the source's state at the delta, on every row, optimizer
slot, eviction field and pending count (stats counters are not state).

Dirtiness is free: a row changed since the mark iff its stamp is newer than the
clock at the mark (one pass over the stamps, ``dirty_slots``); inserts and
updates stamp, reads only in tables that evict (``estuary.embedding.shard``).
Tables that neither evict nor expire keep a 1-byte touched flag per row instead
(cleared at each mark) and no owner ids: a delta's ids come from one pass over
the hash index (``estuary.embedding.storage``).
Evicted ids go into a bounded ``EvictionLog``; when more ids were evicted since the mark than
the shard can hold rows (most rows have changed anyway), the log is dropped and
the next delta is a full state (``delta.full = 1``), so memory stays bounded.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
from numba import njit

from estuary.embedding.hashing import SERVER_SALT, as_ids, route
from estuary.embedding.precision import decode, dtype_name, encode_nearest
from estuary.embedding.types import Int64Array

IDS = "ids"
WEIGHTS = "weights"
OPT_PREFIX = "opt."
STAMP = "evict.stamp"
FREQ = "evict.freq"
TOUCH_S = "evict.touch_s"
UNKNOWN_PREFIX = "unknown."
PENDING_IDS = "admission.ids"
PENDING_COUNTS = "admission.counts"
SKETCH_PREFIX = "admission.sketch."
SKETCH_WORDS = "admission.sketch.words"
SKETCH_SIZES = "admission.sketch.sizes"
SKETCH_META = "admission.sketch.meta"
META_PREFIX = "meta."
CLOCK = "meta.clock"
AGING = "meta.aging"
AGING_TOUCHES = "meta.aging_touches"
EVICTED_IDS = "evicted_ids"
CHAIN_PREFIX = "delta."
LINEAGE = "delta.lineage"
VERSION = "delta.version"
BASE = "delta.base"
FULL = "delta.full"
# The parameter servers' slot map (``estuary.ps.slots``), saved with a sharded
# table's state; no part of any server's or shard's rows (splits leave it out).
ROUTING_PREFIX = "routing."

_PENDING = (PENDING_IDS, PENDING_COUNTS)
Router = Callable[[Int64Array], tuple[Int64Array, Int64Array]]
_MIN_LOG_LIMIT = 1024


@njit(cache=True, nogil=True)
def dirty_slots(stamp: Int64Array, clean: int, out: Int64Array) -> int:
    """Write the slots with ``stamp > clean`` into ``out`` int64 (R,); return the count."""
    got = 0
    for s in range(stamp.size):
        if stamp[s] > clean:
            out[got] = s
            got += 1
    return got


def scalar(value: int) -> Int64Array:
    """``value`` as int64 (1,), the shape of per-shard and chain scalars."""
    return np.array([value], np.int64)


class EvictionLog:
    """Ids removed since the last mark, for ``evicted_ids``; bounded.

    ``record`` past ``limit`` ids drops the log and sets ``overflowed`` (the next
    delta is then a full state). Memory: at most ``8 * limit`` B.
    """

    def __init__(self) -> None:
        self._ids = np.empty(0, np.int64)
        self._n = 0
        self.overflowed = False

    @property
    def nbytes(self) -> int:
        """Memory held by the log."""
        return int(self._ids.nbytes)

    def record(self, ids: Int64Array, limit: int) -> None:
        """Append ``ids`` int64 (N,); ``limit`` = most ids kept (floored at 1024)."""
        if self.overflowed or ids.size == 0:
            return
        need = self._n + ids.size
        limit = max(limit, _MIN_LOG_LIMIT)
        if need > limit:
            self.overflowed = True
            self._ids = np.empty(0, np.int64)
            self._n = 0
            return
        if need > self._ids.size:
            grown = np.empty(max(need, min(2 * self._ids.size, limit)), np.int64)
            grown[: self._n] = self._ids[: self._n]
            self._ids = grown
        self._ids[self._n : need] = ids
        self._n = need

    def ids(self) -> Int64Array:
        """The recorded ids, int64 (n,), oldest first, duplicates possible (a view)."""
        return self._ids[: self._n]

    def clear(self) -> None:
        """Start a new interval (after a mark)."""
        self._n = 0
        self.overflowed = False


class DeltaChain:
    """Where a state sits in its checkpoint chain: ``lineage`` and ``version``.

    A mark (``state_dict``, ``delta_state_dict``, ``mark_clean``) bumps the
    version; a delta from version ``b`` to ``v`` applies only to a state at
    version ``b`` of the same lineage, and leaves it at ``v``. Loading a state
    adopts its lineage and version, so deltas keep applying after a restore.
    """

    def __init__(self) -> None:
        self.lineage = int.from_bytes(os.urandom(8), "little") >> 2
        self.version = 0

    def keys(self) -> dict[str, np.ndarray]:
        """``delta.lineage`` and ``delta.version`` of the current state."""
        return {LINEAGE: scalar(self.lineage), VERSION: scalar(self.version)}

    def advance(self) -> int:
        """Start a new version; returns the previous one (the base of a delta)."""
        self.version += 1
        return self.version - 1

    def delta_keys(self, base: int, full: bool) -> dict[str, np.ndarray]:
        """Chain keys of a delta from ``base`` to the current version."""
        return {**self.keys(), BASE: scalar(base), FULL: scalar(int(full))}

    def check(self, delta: dict[str, np.ndarray], name: str) -> None:
        """Raise ``ValueError`` unless ``delta`` applies to the current state."""
        if BASE not in delta:
            raise ValueError(f"{name}: not a delta (no {BASE!r}); use load_state_dict")
        lineage, base = int(delta[LINEAGE][0]), int(delta[BASE][0])
        if lineage != self.lineage:
            raise ValueError(
                f"{name}: delta is from checkpoint chain {lineage:#x}, "
                f"this table follows {self.lineage:#x}"
            )
        if base != self.version and not is_full(delta):
            raise ValueError(
                f"{name}: delta applies on top of version {base}, this table is at "
                f"version {self.version} (apply deltas in order, once each)"
            )

    def adopt(self, state: dict[str, np.ndarray]) -> None:
        """Take the lineage and version of a loaded state or applied delta."""
        if LINEAGE in state:
            self.lineage = int(state[LINEAGE][0])
        if VERSION in state:
            self.version = int(state[VERSION][0])


def is_full(delta: dict[str, np.ndarray]) -> bool:
    """Whether a delta carries all rows (``delta.full = 1``)."""
    return FULL in delta and bool(delta[FULL][0])


def merge_states(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Shard states -> one table state: every key concatenated along axis 0
    (row keys, pending and evicted ids; per-shard ``unknown.*``/``meta.*``
    stack to a leading axis S)."""
    if len(parts) == 1:
        return dict(parts[0])
    return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}


def merge_server_parts(parts: list[dict[str, np.ndarray]], name: str) -> dict[str, np.ndarray]:
    """The parts of one table held by several parameter servers (each a whole
    table state or delta with its own chain keys) -> one state: ``merge_states``
    of the rows, and server 0's chain keys (the servers advance together).

    Raises:
        ValueError: the parts' chain versions or keys differ (a server was
            replaced, or the parts are of different checkpoints).
    """
    versions = {int(p[VERSION][0]) for p in parts if VERSION in p}
    if len(versions) > 1:
        raise ValueError(
            f"table {name!r}: its parts are at chain versions {sorted(versions)}; the "
            "servers advance together unless a server was replaced"
        )
    keys = [sorted(p) for p in parts]
    if any(k != keys[0] for k in keys):
        raise ValueError(f"table {name!r}: its parts hold different keys")
    chain = {k: v for k, v in parts[0].items() if k.startswith(CHAIN_PREFIX)}
    rows = [{k: v for k, v in p.items() if not k.startswith(CHAIN_PREFIX)} for p in parts]
    return {**merge_states(rows), **chain}


def split_state(state: dict[str, np.ndarray], n_shards: int) -> list[dict[str, np.ndarray]]:
    """A table state (or delta) saved with any shard count -> one part per shard.

    Row keys go with ``ids``, pending keys with ``admission.ids``, and
    ``evicted_ids`` with themselves, each routed by ``shard_of``. Per-shard keys
    (``unknown.*``, ``meta.*``): with the same S each shard gets its own back;
    otherwise unknown rows are averaged and ``meta.*`` takes the maximum. Chain
    keys (``delta.*``) belong to the table and are left out.
    """
    return _split(state, n_shards, salt=None, shards_per_part=None)


def split_for_servers(
    state: dict[str, np.ndarray],
    n_servers: int,
    shards_per_server: int,
    *,
    router: Router | None = None,
) -> list[dict[str, np.ndarray]]:
    """A table state (or delta) of any shard count -> one part per parameter-server
    process (ids routed with ``SERVER_SALT``), each a whole table state its server
    loads into its own ``shards_per_server`` shards.

    Per-shard keys: a state of ``n_servers x shards_per_server`` shards (one saved
    by the same servers: ``merge_states`` of their parts) gives each server its own
    back; any other count goes whole to every server, whose table averages it.
    Chain keys (``delta.*``) go to every part: the servers adopt one chain.
    ``router``: ids -> (order, offsets) by server (a slot map's ``route``;
    default ``splitmix64(id ^ SERVER_SALT) mod n_servers``). ``routing.*`` keys
    go to no part.
    """
    return _split(
        state, n_servers, salt=SERVER_SALT, shards_per_part=shards_per_server, router=router
    )


def _split(
    state: dict[str, np.ndarray],
    n_parts: int,
    *,
    salt: int | None,
    shards_per_part: int | None,
    router: Router | None = None,
) -> list[dict[str, np.ndarray]]:
    # shards_per_part None: the parts are shards (leaves); else whole tables.
    stacked = {
        k: np.asarray(v) for k, v in state.items() if k.startswith((UNKNOWN_PREFIX, META_PREFIX))
    }
    per = 1 if shards_per_part is None else shards_per_part
    same_count = all(v.shape[0] == n_parts * per for v in stacked.values())
    # Positions each part takes, per routing key (one counting sort each).
    picks: dict[str, list[Int64Array]] = {}
    for owner_key in (IDS, PENDING_IDS, EVICTED_IDS):
        if owner_key in state and n_parts > 1:
            ids = as_ids(state[owner_key])
            order, offsets = route(ids, n_parts, salt=salt) if router is None else router(ids)
            picks[owner_key] = [order[offsets[k] : offsets[k + 1]] for k in range(n_parts)]
    parts: list[dict[str, np.ndarray]] = [{} for _ in range(n_parts)]
    if SKETCH_WORDS in state:
        for part, sketch in zip(parts, _split_sketches(state, n_parts, per), strict=True):
            part.update(sketch)
    for key, value in state.items():
        arr = np.asarray(value)
        if key.startswith((SKETCH_PREFIX, ROUTING_PREFIX)):
            continue
        if key.startswith(CHAIN_PREFIX):
            if shards_per_part is not None:
                for part in parts:
                    part[key] = arr
            continue
        owner_key = PENDING_IDS if key in _PENDING else EVICTED_IDS if key == EVICTED_IDS else IDS
        for k, part in enumerate(parts):
            if key in stacked:
                if same_count:
                    part[key] = arr[k * per : (k + 1) * per]
                elif shards_per_part is not None:
                    part[key] = arr
                elif key.startswith(UNKNOWN_PREFIX):  # averaged in float32, stored back
                    mean = decode(arr).mean(axis=0, keepdims=True)
                    part[key] = encode_nearest(mean, dtype_name(arr))
                else:
                    part[key] = arr.max(axis=0, keepdims=True)
            elif owner_key in picks:
                part[key] = arr[picks[owner_key][k]]
            else:
                part[key] = arr
    return parts


def sketch_parts(state: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """The per-shard admission sketches of a table state: ``words``, ``sizes``
    (2,), ``meta`` (3,) each (``admission_sketch.SketchAdmissionFilter.state_dict``)."""
    words = np.asarray(state[SKETCH_WORDS], np.uint64)
    sizes = np.asarray(state[SKETCH_SIZES], np.int64).reshape(-1, 2)
    meta = np.asarray(state[SKETCH_META], np.int64).reshape(sizes.shape[0], -1)
    ends = np.cumsum(sizes.sum(axis=1))
    if ends.size and int(ends[-1]) != words.size:
        raise ValueError(f"{SKETCH_WORDS}: {words.size} words, {SKETCH_SIZES} says {int(ends[-1])}")
    starts = ends - sizes.sum(axis=1)
    return [
        {"words": words[a:b], "sizes": sizes[k], "meta": meta[k]}
        for k, (a, b) in enumerate(zip(starts, ends, strict=True))
    ]


def sketch_keys(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Per-shard sketches -> the state keys (inverse of ``sketch_parts``)."""
    return {
        SKETCH_WORDS: np.concatenate([np.asarray(p["words"], np.uint64) for p in parts]),
        SKETCH_SIZES: np.stack([np.asarray(p["sizes"], np.int64) for p in parts]),
        SKETCH_META: np.stack([np.asarray(p["meta"], np.int64) for p in parts]),
    }


def _split_sketches(
    state: dict[str, np.ndarray], n_parts: int, per: int
) -> list[dict[str, np.ndarray]]:
    # Same shard count: each part gets its shards' sketches back (exact resume);
    # otherwise every part gets the merge of all (an upper bound of every count).
    from estuary.embedding.admission_sketch import merge_states as merge_sketches

    shards = sketch_parts(state)
    if len(shards) == n_parts * per:
        return [sketch_keys(shards[k * per : (k + 1) * per]) for k in range(n_parts)]
    bits = int(shards[0]["meta"][2])
    merged = merge_sketches(shards, bits)
    return [sketch_keys([merged]) for _ in range(n_parts)]
