"""Admission: when a new id earns its own row.

Two counters implement the rule below: this module's exact one
(``counter: exact``) and the approximate sketch of
``estuary.embedding.admission_sketch`` (``counter: sketch``, the default: a few
bits per id instead of 16+ B). ``make_admission_filter`` picks by the spec.

A policy (``AdmissionFilter.observe``) decides which of a batch's row-less ids are
admitted; the shard acts on the decision (inserts and initialises those rows).

Counting is exact but memory-bounded: a "pending" open-addressing table
(id -> sightings, 16 B per entry, the same probe/delete kernels as the hash
index) holds ids seen but not yet admitted. It grows by ``hash_index.GROWTH`` as needed (as the
index, ``hash_index.GROWTH``) up to ``max_pending_ids / 0.7`` entries (24 MB
for the default 2**20 ids).
When it holds ``max_pending_ids`` ids, every count is halved and ids reaching 0
are dropped (TinyLFU-style ageing), repeated until at most half that many remain.
So an id that stays rare loses its count rather than holding memory, while an id
seen more often than the filter ages still gets through. Admitted ids leave the
pending table.

Rule: an id is admitted on a sighting where its count (including this batch)
is >= ``min_count`` *and* a coin with ``probability`` of heads comes up heads.
The coin is counter-based on (seed, id, count), so decisions do not depend on
batch order or shard count. Within one call an id is decided once, however
many times it occurs; all its occurrences count.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit

from estuary.config.spec import AdmissionSpec
from estuary.embedding.admission_counter import AdmissionCounter
from estuary.embedding.admission_sketch import SketchAdmissionFilter
from estuary.embedding.hash_index import (
    GROWTH,
    delete_at,
    entries_for,
    occupied_items,
    probe,
    rehash_into,
)
from estuary.embedding.hashing import as_ids, unit_float
from estuary.embedding.types import Int64Array

BoolArray = npt.NDArray[np.bool_]
_MAX_LOAD = 0.7


@njit(cache=True, nogil=True)
def _observe_kernel(
    table: Int64Array,
    ids: Int64Array,
    counts: Int64Array,
    admitted: BoolArray,
    start: int,
    meta: Int64Array,
    limit: int,
    min_count: int,
    probability: float,
    seed: np.uint64,
) -> int:
    # meta[0] = pending size. Returns where it stopped (ids.size when done; earlier
    # when a new entry would pass ``limit``: the caller grows or ages and resumes).
    for n in range(start, ids.size):
        key = ids[n]
        i = probe(table, key)
        c = table[i, 1]
        if c == 0:
            if meta[0] >= limit:
                return n
            table[i, 0] = key
            meta[0] += 1
        c += counts[n]
        ok = c >= min_count
        if ok and probability < 1.0:
            ok = unit_float(seed, key, np.uint64(c)) < probability
        admitted[n] = ok
        if ok:
            delete_at(table, i)
            meta[0] -= 1
        else:
            table[i, 1] = c
    return ids.size


@njit(cache=True, nogil=True)
def _halve_counts(table: Int64Array) -> None:
    for i in range(table.shape[0]):
        table[i, 1] >>= 1  # counts >= 1; 1 -> 0 empties the entry


class AdmissionFilter(AdmissionCounter):
    """Decides admission of row-less ids (see module docstring for the rule).

    Args:
        spec: the table's admission section.
        seed: 64-bit seed of the probability coin (the table seed).
        max_pending_ids: bound on ids counted while pending.
    """

    def __init__(self, spec: AdmissionSpec, seed: int, *, max_pending_ids: int = 1 << 20) -> None:
        self.spec = spec
        self._seed = np.uint64(seed)
        if max_pending_ids < 1:
            raise ValueError("max_pending_ids must be >= 1")
        self._max_pending = max_pending_ids
        self._max_entries = entries_for(max_pending_ids, _MAX_LOAD)
        self._table = np.zeros((min(1024, self._max_entries), 2), np.int64)
        self._meta = np.zeros(1, np.int64)
        self.aged = 0  # how many times counts were halved (a sign the bound is tight)
        self.counting = True

    def __len__(self) -> int:
        """Ids seen but not admitted."""
        return int(self._meta[0])

    @property
    def nbytes(self) -> int:
        """Memory held by the pending table."""
        return int(self._table.nbytes)

    def _decide(self, uniq: Int64Array, counts: Int64Array) -> Int64Array:
        admitted = np.empty(uniq.size, np.bool_)
        start = 0
        s = self.spec
        while True:
            start = _observe_kernel(
                self._table, uniq, counts, admitted, start, self._meta, self._limit(),
                s.min_count, s.probability, self._seed,
            )  # fmt: skip
            if start == uniq.size:
                return uniq[admitted]
            self._make_room()

    def _limit(self) -> int:
        # Pending ids allowed before the table must grow (or age, at the bound).
        if self._table.shape[0] < self._max_entries:
            return int(self._table.shape[0] * _MAX_LOAD)
        return self._max_pending

    def _make_room(self) -> None:
        if self._table.shape[0] < self._max_entries:
            self._rebuild(min(self._max_entries, int(self._table.shape[0] * GROWTH)))
            return
        # Full at the bound: age until at most half the bound is used.
        while len(self) > self._max_pending // 2:
            _halve_counts(self._table)
            self._rebuild(self._table.shape[0])
            self.aged += 1

    def _rebuild(self, entries: int) -> None:
        # Rehash (also repairs probe chains after ageing emptied entries in place).
        new = np.zeros((entries, 2), np.int64)
        rehash_into(self._table, new)
        self._table = new
        self._meta[0] = int(np.count_nonzero(new[:, 1]))

    def state_dict(self) -> dict[str, Int64Array]:
        """Pending ids and their counts, int64 (P,) each."""
        keys, counts = occupied_items(self._table, len(self))
        return {"ids": keys, "counts": counts}

    def load_state_dict(self, state: dict[str, Int64Array]) -> None:
        """Replace the pending counts with ``state`` (as from ``state_dict``)."""
        keys = as_ids(state["ids"])
        counts = np.asarray(state["counts"], np.int64)
        if keys.shape != counts.shape:
            raise ValueError("admission ids and counts differ in length")
        keep = counts > 0
        keys, counts = keys[keep], counts[keep]
        entries = min(self._max_entries, entries_for(keys.size, _MAX_LOAD))
        entries = max(entries, 1024 if self._max_entries >= 1024 else self._max_entries)
        self._table = np.zeros((entries, 2), np.int64)
        self._meta[0] = 0
        # Re-count through the kernel with min_count unreachable, so nothing is admitted.
        admitted = np.empty(keys.size, np.bool_)
        start = 0
        while start < keys.size:
            start = _observe_kernel(
                self._table, keys, counts, admitted, start, self._meta, self._limit(),
                np.iinfo(np.int64).max, 1.0, self._seed,
            )  # fmt: skip
            if start < keys.size:
                self._make_room()


def make_admission_filter(
    spec: AdmissionSpec, seed: int, *, max_pending_ids: int
) -> AdmissionCounter:
    """The filter ``spec.counter`` names: ``exact`` -> ``AdmissionFilter``,
    ``sketch`` -> ``SketchAdmissionFilter`` (both bounded by ``max_pending_ids``)."""
    if spec.counter == "exact":
        return AdmissionFilter(spec, seed, max_pending_ids=max_pending_ids)
    return SketchAdmissionFilter(spec, seed, max_pending_ids=max_pending_ids)
