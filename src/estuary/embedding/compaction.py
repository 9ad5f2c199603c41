"""Compaction of one shard's rows: memory given back after many rows left.

Rows leave a shard when a migration moves their slots away (``drop_ids`` on a
split's source servers, ``estuary.ps.migration``) or when they are evicted.
Their slots go on the hash index's free list and later admissions reuse them,
but the arrays keep their size: without compaction a split relieves growth,
not memory already held. ``EmbeddingShard.compact`` packs the rows in use to
the front and cuts the arrays::

    before   [U|a|.|b|.|.|c|.|.|d|.|.]   U unknown row, . free, 4 ids held
    pack     [U|a|d|b|c|.|.|c|.|d|.|.]   ids past row 4 move into the holes
    cut      [U|a|d|b|c|+]               + headroom (GROWTH - 1 of the held rows)

1. ``HashIndex.pack``: ids held in slots past ``1 + held`` get the free slots
   below it (the index's values are rewritten; the free list empties); the
   table is rebuilt smaller where it holds more than one growth of slack.
2. ``RowStorage.pack``: the same moves on every per-row array (weights,
   optimizer state, owner, stamps, LFU counts, touch times: ``PER_ROW``), in
   place, row by row.
3. ``RowStorage.shrink``: every per-row array cut to ``1 + held`` rows plus
   headroom; the pages past it go back to the OS (``memory.shrunk``: an
   ``madvise``, no copy, for the large arrays).

Peak memory: the rows are moved in place and cut without a copy; the extra
memory is a few int64 arrays over the ids held and the rows moved (the
index's items, 16 B per id; the moves and their map, up to 24 B per moved
row) and, when the index is rebuilt, its new (smaller) table: measured +13-15
MiB over the RSS before for 500k ids kept of 1M (``bench/compact.py``).

When it is safe: every shard call resolves rows from ids under the shard's
lock and keeps no row number past the call (lookups, updates, admission,
eviction, the delta's dirty rows: stamps move with their rows; exports copy
the rows under the lock), so ``compact`` (under the lock) may run between any
two calls. A parameter server runs it between steps anyway (``drop_ids``).
Skipped, with the reason in the result: a shard with a disk tier (its memory
rows are bounded by the tier's budget and refilled from disk as rows are
touched: cutting them would only be undone) and a shard whose arrays are not
mostly empty (``held >= below * allocated``).
"""

from __future__ import annotations

from dataclasses import dataclass

from estuary.embedding.storage import GROWTH

# Compact when fewer than this share of the rows allocated hold an id (a
# quarter or more free). A split takes every other slot of the fullest server:
# its shards keep about half their rows, which is just above or below one half
# of the rows allocated depending on the growth slack (0-10%) and the slots'
# sizes, so a threshold of 0.5 would skip many split sources. Above 0.75 the
# room is left for later admissions to reuse (a compaction there would give
# back under 17% once the headroom is kept).
COMPACT_BELOW = 0.75


@dataclass(frozen=True)
class Compaction:
    """What one shard's ``compact`` did.

    Args:
        held: ids holding a row.
        rows_before: rows allocated before (the unknown row excluded).
        rows_after: rows allocated after (== ``rows_before`` when skipped).
        bytes_before: memory of the rows, their metadata and the hash index before.
        bytes_after: the same after.
        moved: rows moved to a lower slot.
        skipped: why nothing was done; ``None`` when it compacted.
    """

    held: int
    rows_before: int
    rows_after: int
    bytes_before: int
    bytes_after: int
    moved: int = 0
    skipped: str | None = None

    @property
    def freed_bytes(self) -> int:
        """Memory given back (0 when skipped)."""
        return self.bytes_before - self.bytes_after


def check_below(below: float, field: str = "below") -> float:
    """``below`` checked as a share of the rows allocated in [0, 1] (0: never
    compact); ``ValueError`` naming ``field`` otherwise."""
    if not 0.0 <= below <= 1.0:
        raise ValueError(f"{field}: must be in [0, 1] (0 = never compact), got {below}")
    return float(below)


def skip_reason(held: int, allocated: int, below: float) -> str | None:
    """Why a shard with ``held`` ids in ``allocated`` rows is not compacted at
    threshold ``below``; ``None``: compact it."""
    if held >= below * allocated:
        return f"{held} of {allocated} rows in use, not below {below:g} of them"
    return None


def rows_to_keep(held: int, max_rows: int | None) -> int:
    """Rows a compacted storage keeps: the unknown row, the ``held`` rows in use
    and the slack one growth leaves (``GROWTH - 1`` of them), at most
    ``max_rows`` (a bounded shard's) but never fewer than in use."""
    keep = 1 + held + int((GROWTH - 1.0) * held)
    if max_rows is not None:
        keep = min(keep, max_rows)
    return max(keep, 1 + held)
