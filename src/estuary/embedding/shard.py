"""One embedding shard: hash index + row storage + optimizer + admission + eviction.

Shapes: ``N`` ids in a call, ``D`` the table's dim, ``W`` floats per storage row,
``R`` rows held.

Calls on one shard are serialised by a lock inside the shard (uncontended cost
~50 ns); the numba kernels release the GIL, so other threads (torch compute,
another shard) run while a shard works.

Every training call (``lookup(train=True)``, ``apply_gradients``) takes a stamp
from the shard's access clock and stamps the rows it touches, in the same probe
pass that finds them: rows it inserts or updates always, rows it only reads
when the table evicts (a capacity or a TTL, where recency matters). The stamps
drive LRU, TTL and the choice of delta rows (see ``estuary.embedding.eviction``
and ``estuary.embedding.delta``); a table that does not evict keeps only a
touched-since-mark flag per row (``estuary.embedding.storage``). A step ends
with each ``apply_gradients`` (or ``advance_step()``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from estuary.config.spec import TableSpec
from estuary.embedding.admission import AdmissionFilter, make_admission_filter
from estuary.embedding.admission_sketch import SketchAdmissionFilter
from estuary.embedding.compaction import (
    COMPACT_BELOW,
    Compaction,
    check_below,
    rows_to_keep,
    skip_reason,
)
from estuary.embedding.delta import (
    AGING,
    AGING_TOUCHES,
    CLOCK,
    EVICTED_IDS,
    FREQ,
    IDS,
    OPT_PREFIX,
    PENDING_COUNTS,
    PENDING_IDS,
    SKETCH_WORDS,
    STAMP,
    TOUCH_S,
    UNKNOWN_PREFIX,
    WEIGHTS,
    DeltaChain,
    EvictionLog,
    is_full,
    scalar,
    sketch_keys,
    sketch_parts,
)
from estuary.embedding.disk_tier import DiskRows, memory_rows
from estuary.embedding.eviction import AccessClock, EvictionPolicy, age
from estuary.embedding.hash_index import NO_TOUCH, HashIndex, Touch
from estuary.embedding.hashing import as_ids, table_seed
from estuary.embedding.initializers import make_initializer
from estuary.embedding.optimizers import make_optimizer
from estuary.embedding.precision import call_key, decode, dtype_name, encode_nearest
from estuary.embedding.row_formats import RowFormat, make_row_format
from estuary.embedding.storage import UNKNOWN_ROW, RowStorage, rows_out
from estuary.embedding.types import Float32Array, Int64Array, TableStats

__all__ = ["IDS", "PENDING_COUNTS", "PENDING_IDS", "UNKNOWN_PREFIX", "WEIGHTS", "EmbeddingShard"]

State = dict[str, np.ndarray]
_log = logging.getLogger(__name__)
_UNKNOWN_ROWS = np.array([UNKNOWN_ROW], np.int64)
# The unknown row's id in the rounding of 16-bit weights (a real id may share it:
# the two rows then share random bits in one call, which biases neither).
_UNKNOWN_KEY = np.array([-1], np.int64)
_PENDING_KEYS = (PENDING_IDS, PENDING_COUNTS)


def _gather(
    array: Float32Array, rows: Int64Array | slice, fmt: RowFormat, opt: Any, prefix: str
) -> State:
    """Weights (in the stored dtype) and optimizer state of ``rows`` of a storage ``array``."""
    state: State = {prefix + WEIGHTS: fmt.weights(array, rows)}
    for name in opt.state_names:
        state[f"{prefix}{OPT_PREFIX}{name}"] = array[rows, fmt.columns(opt.columns(name))]
    for name in opt.scalar_names:
        state[f"{prefix}{OPT_PREFIX}{name}"] = array[rows, fmt.columns(opt.columns(name)).start]
    return state


def _row_subset(state: State, sel: Int64Array) -> State:
    # The row-aligned keys of a state (ids, weights, optimizer slots, eviction
    # fields), rows ``sel`` only.
    return {
        k: np.asarray(v)[sel]
        for k, v in state.items()
        if k in (IDS, WEIGHTS, STAMP, FREQ, TOUCH_S) or k.startswith(OPT_PREFIX)
    }


def _unique_counts(ids: Int64Array, counts: Int64Array) -> tuple[Int64Array, Int64Array]:
    # Sorted unique ids with their counts summed.
    uniq, inverse = np.unique(ids, return_inverse=True)
    return uniq, np.bincount(inverse, weights=counts, minlength=uniq.size).astype(np.int64)


@dataclass(frozen=True)
class RawExport:
    """A shard's state copied under its lock, gathered later (``materialize``).

    ``rows`` are storage rows (all rows in use, or the dirty ones), ``picked``
    the positions in ``rows`` of the exported ids ``ids`` (``slice(None)``: all of
    them, in order: the state's arrays are views of ``rows``, no second copy); ``stamps``, ``freq``,
    ``touch`` are aligned with ``rows`` (``None`` where the table keeps none:
    stamps are clock stamps only in tables that evict);
    ``small`` the per-shard keys, already final."""

    fmt: RowFormat
    optimizer: Any
    rows: Float32Array
    picked: Int64Array | slice
    ids: Int64Array
    stamps: Any
    freq: Any
    touch: Any
    small: State

    def materialize(self) -> State:
        state = _gather(self.rows, self.picked, self.fmt, self.optimizer, "")
        state[IDS] = self.ids
        if self.stamps is not None:
            state[STAMP] = self.stamps[self.picked]
        if self.freq is not None:
            state[FREQ] = self.freq[self.picked]
        if self.touch is not None:
            state[TOUCH_S] = self.touch[self.picked]
        state.update(self.small)
        return state


class EmbeddingShard:
    """Hash-keyed embedding rows of one shard, with their optimizer state.

    Implements ``EmbeddingStore``.

    Args:
        spec: table settings (dim, initializer, optimizer, admission, eviction).
        seed: job seed; with ``name`` it fixes every id's initial row.
        name: the table's name (all shards of a table share it, so an id's
            initial row does not depend on the shard count).
        max_pending_ids: bound on ids counted by the admission filter
            (default ``spec.admission.max_pending_ids``).
        shards: shards of the table this one belongs to (splits the capacity).
        time_fn: wall clock for ``ttl_s`` (seconds; injectable for tests).
    """

    def __init__(
        self,
        spec: TableSpec,
        seed: int,
        name: str,
        *,
        max_pending_ids: int | None = None,
        shards: int = 1,
        time_fn: Callable[[], float] = time.time,
    ) -> None:
        self.spec = spec
        self.name = name
        self._seed = table_seed(seed, name)
        self._optimizer = make_optimizer(spec.optimizer, spec.dim)
        self._initializer = make_initializer(spec.initializer, spec.dim)
        self._format = make_row_format(spec.dtype, spec.dim, self._optimizer.width)
        # New rows in one fused pass unless the initializer only offers ``fill``.
        dist = self._initializer.distribution
        self._fused_init = dist is not None
        self._init_weights = (dist or 0, self._initializer.scale, self._initializer.truncate)
        self._init_state = self._optimizer.initial_state_row()
        # Separate coin stream for admission (the init stream uses the table seed).
        self._admission = make_admission_filter(
            spec.admission,
            table_seed(seed, name + "/admission"),
            max_pending_ids=(
                spec.admission.max_pending_ids if max_pending_ids is None else max_pending_ids
            ),
        )
        # A disk tier: an LRU capacity from the memory budget; victims go to disk.
        self._disk: DiskRows | None = None
        eviction = spec.eviction
        if spec.disk.memory_bytes is not None:
            cap = memory_rows(spec.disk.memory_bytes, self._format.stored_width, shards)
            eviction = replace(eviction, capacity_rows=cap * shards, policy="lru")
            self._disk = DiskRows(self._format.stored_width, spec.disk.path)
        self._policy = EvictionPolicy(eviction, shards)
        self._time_fn = time_fn
        self._clock = AccessClock()
        self._chain = DeltaChain()
        self._log = EvictionLog()
        self._clean_stamp = 0  # clock at the last mark: newer stamps are dirty
        # One pass per call when every id gets a row and nothing must be evicted.
        self._single_pass = self._admission.admits_all and self._policy.capacity_rows is None
        # Reads stamp rows only where recency matters (a capacity or a TTL): else a
        # stamp only marks a row changed since the last mark (deltas), which a read
        # does not do, and skipping it saves a cache line per id read.
        self._stamp_reads = self._policy.capacity_rows is not None or self._policy.has_ttl
        self._lock = threading.Lock()
        self._reset_rows(spec.initial_capacity_rows)
        self._lookups = self._hits = self._admissions = self._unknown_grads = 0
        self._evictions = 0
        self._memory_hits = 0

    def _reset_rows(self, capacity_rows: int) -> None:
        # Slot 0 is the unknown row: zeros and fresh optimizer state, never stamped.
        cap = self._policy.capacity_rows
        # A disk tier's memory index is sized for its budget once (no growth slack).
        ids = cap if self._disk is not None and cap else min(capacity_rows, cap or capacity_rows)
        self._index = HashIndex(ids, first_slot=1)
        self._storage = RowStorage(
            self._format,
            capacity_rows + 1,
            max_rows=None if cap is None else cap + 1,
            keep_freq=self._policy.lfu,
            keep_time=self._policy.keep_time,
            evicts=self._stamp_reads,
        )
        # Fresh storage is zeros: the unknown row's weights are 0 in every dtype.
        self._format.reset_state(
            self._optimizer, self._storage.array, _UNKNOWN_ROWS, self._init_state
        )

    @property
    def dim(self) -> int:
        """Embedding width D."""
        return self.spec.dim

    @property
    def step(self) -> int:
        """Training steps ended (``apply_gradients`` + ``advance_step`` calls)."""
        return self._clock.step

    def __len__(self) -> int:
        """Ids holding their own row (in memory or on disk)."""
        return len(self._index) + (len(self._disk) if self._disk is not None else 0)

    # -- lookups and updates -------------------------------------------------

    def lookup(
        self, ids: Int64Array, *, train: bool, out: Float32Array | None = None
    ) -> Float32Array:
        """Rows of ``ids`` int64 (N,) -> float32 (N, D): ``out`` if given, else fresh.

        ``train=True`` inserts new ids that pass admission (initialised by the
        table's initializer), evicting first if the capacity would be passed;
        ids that do not pass read the unknown row. It stamps every row it
        touches. ``train=False`` never inserts nor stamps.

        ``out``: a writeable C-contiguous float32 (N, D) to write the rows into
        (e.g. one buffer reused across steps); ``ValueError`` otherwise.
        """
        ids = as_ids(ids)
        out = rows_out(out, ids.size, self.dim)
        with self._lock:
            if not train:
                rows = self._index.lookup(ids)
                hits = int(np.count_nonzero(rows >= 0))
                self._memory_hits += hits
                self._storage.gather(rows, self.dim, out)  # rows < 0 read UNKNOWN_ROW
                if self._disk is not None and hits < ids.size:
                    hits += self._read_disk(ids, rows, out)
            else:
                now = self._clock.tick()
                now_s = self._time_fn() if self._policy.keep_time else 0.0
                if self._single_pass:
                    hits = self._get_or_insert(ids, out, now, now_s)
                else:
                    rows = self._index.lookup(ids, self._read_touch(now, now_s))
                    missing = rows < 0
                    hits = ids.size - int(np.count_nonzero(missing))
                    self._memory_hits += hits
                    if hits < ids.size:
                        hits += self._admit(ids, rows, missing, now, now_s)
                    self._storage.gather(rows, self.dim, out)
                self._age_if_due(ids.size)
            self._lookups += ids.size
            self._hits += hits
            return out

    def _read_touch(self, now: int, now_s: float) -> Touch:
        return self._storage.touch(now, now_s) if self._stamp_reads else NO_TOUCH

    def _get_or_insert(self, ids: Int64Array, out: Float32Array, now: int, now_s: float) -> int:
        # Every id gets a row: one probe pass (inserting, touching the rows it
        # finds), the new rows initialised, one gather pass. Returns the hits.
        # Measured against it (1M-10M rows, D 16/64): touching in the gather pass
        # instead (stamps prefetched with the rows) is ~5% faster at D=16 but
        # ~12% slower at D=64, where the gather is bound by memory throughput;
        # one fused probe+gather pass is ~10% faster at D=16, ~15% slower at D=64.
        # One pass that probes, inserts, initialises and gathers (two stages 8 ids
        # apart, new rows initialised in full) at D=16: 8-12% faster at 1M rows,
        # ~5% at 3M, 5-7% slower at 10M; 7-8% slower at D=24/32, 20-28% at D=64.
        rows, new_at = self._index.get_or_insert_new(ids, self._read_touch(now, now_s))
        if new_at.size:
            self._insert_rows(rows[new_at], ids[new_at], now, now_s)
        self._storage.gather(rows, self.dim, out)
        return ids.size - new_at.size

    def _admit(
        self, ids: Int64Array, rows: Int64Array, missing: np.ndarray, now: int, now_s: float
    ) -> int:
        # Policies decide (admission, then room), the shard acts; every occurrence
        # of an admitted id in this batch gets the new row (slots re-resolved).
        # Ids on disk come back first (they hold rows: no admission). Returns the
        # occurrences of ids found on disk (hits).
        candidates = ids[missing]
        from_disk = 0
        disk = self._disk
        if disk is not None and len(disk):
            if self._promote(np.unique(candidates), now, now_s):
                rows[missing] = self._index.lookup(candidates)
                from_disk = int(np.count_nonzero(rows[missing] >= 0))
                missing = rows < 0
                candidates = ids[missing]
            # Rows left on disk (a call with more of them than the budget holds)
            # read the unknown row this time; they are not new ids.
            on_disk = disk.slots(candidates) >= 0
            from_disk += int(np.count_nonzero(on_disk))
            missing[np.flatnonzero(missing)[on_disk]] = False
            candidates = candidates[~on_disk]
            if candidates.size == 0:
                return from_disk
        admitted = self._admission.observe(candidates)  # unique
        if admitted.size:
            decision = self._policy.make_room(
                self._storage, self._index.slot_end, len(self._index), admitted.size, now
            )
            self._evict(decision.slots)
            # Fewer fit only when this call alone brings more new ids than the
            # capacity: the rest read the unknown row and start counting afresh.
            admitted = admitted[: decision.admit]
        if admitted.size:
            new_rows = self._index.get_or_insert(admitted)
            self._insert_rows(new_rows, admitted, now, now_s)
            rows[missing] = self._index.lookup(candidates)
        return from_disk

    def _promote(self, ids: Int64Array, now: int, now_s: float) -> int:
        # Rows of unique ``ids`` held on disk move into memory (room made by
        # demoting the least recently used); returns how many came back.
        disk = self._disk
        assert disk is not None
        found, data, _ = disk.take(ids)
        if found.size == 0:
            return 0
        back = ids[found]
        decision = self._policy.make_room(
            self._storage, self._index.slot_end, len(self._index), back.size, now
        )
        self._evict(decision.slots)
        if decision.admit < back.size:  # more than the budget in one call: the rest stay
            stay = slice(decision.admit, None)
            disk.put(back[stay], data[stay], np.full(back.size - decision.admit, now, np.int64))
            back, data = back[: decision.admit], data[: decision.admit]
        slots = self._index.get_or_insert(back)
        self._storage.ensure_rows(self._index.slot_end)
        self._storage.array[slots] = data
        self._storage.claim(slots, back, now, now_s)
        return int(back.size)

    def _read_disk(self, ids: Int64Array, rows: Int64Array, out: Float32Array) -> int:
        # Eval lookups read rows on disk in place (no promotion); returns how many.
        disk = self._disk
        assert disk is not None
        at = np.flatnonzero(rows < 0)
        slots = disk.slots(ids[at])
        on_disk = slots >= 0
        if on_disk.any():
            part = np.empty((int(np.count_nonzero(on_disk)), self.dim), np.float32)
            self._format.gather(disk.gather(slots[on_disk]), np.arange(part.shape[0]), part)
            out[at[on_disk]] = part
        return int(np.count_nonzero(on_disk))

    def _insert_rows(self, rows: Int64Array, ids: Int64Array, now: int, now_s: float) -> None:
        self._storage.ensure_rows(self._index.slot_end)
        if self._fused_init:
            weights, state = self._init_weights, self._init_state
            key = self._key(now)
            self._storage.init_rows(rows, ids, weights, self._seed, state, now, now_s, key)
        else:
            self._format.fill(
                self._storage.array, rows, ids, self._initializer, self._seed,
                self._init_state, self._key(now),
            )  # fmt: skip
            self._storage.claim(rows, ids, now, now_s)
        self._admissions += rows.size

    def apply_gradients(
        self, ids: Int64Array, grads: Float32Array, *, lr_scale: float = 1.0
    ) -> None:
        """One optimizer step for ``ids`` int64 (N,), unique, with ``grads`` float32 (N, D),
        at the optimizer's learning rate times ``lr_scale``.

        Slots are re-resolved by id, so this is safe after later lookups inserted
        or moved rows. Ids without a row (not admitted, evicted, or only seen in
        eval) have their gradients summed into one step of the unknown row.
        Ends the shard's current step (TTL sweeps may run).
        """
        ids = as_ids(ids)
        grads = np.ascontiguousarray(grads, dtype=np.float32)
        if grads.shape != (ids.size, self.dim):
            raise ValueError(f"grads must have shape ({ids.size}, {self.dim}), got {grads.shape}")
        with self._lock:
            now = self._clock.tick()
            now_s = self._time_fn() if self._policy.keep_time else 0.0
            rows = self._index.lookup(ids, self._storage.touch(now, now_s))
            missing = rows < 0
            disk_held = self._disk is not None and len(self._disk) > 0
            # Rows moved to disk since their lookup come back for the update.
            if disk_held and missing.any() and self._promote(ids[missing], now, now_s):
                rows = self._index.lookup(ids, self._storage.touch(now, now_s))
                missing = rows < 0
            n_missing = int(np.count_nonzero(missing))
            storage, opt, step, key = (
                self._storage.array,
                self._optimizer,
                self._format.step,
                self._key(now),
            )
            if n_missing == 0:
                step(opt, storage, rows, ids, grads, lr_scale, key)
            else:
                known = ~missing
                if n_missing < ids.size:
                    known_grads = np.ascontiguousarray(grads[known])
                    step(opt, storage, rows[known], ids[known], known_grads, lr_scale, key)
                unknown_grad = grads[missing].sum(axis=0, dtype=np.float32, keepdims=True)
                step(opt, storage, _UNKNOWN_ROWS, _UNKNOWN_KEY, unknown_grad, lr_scale, key)
                self._unknown_grads += n_missing
            self._age_if_due(ids.size - n_missing)
            self._end_step()

    def _key(self, now: int) -> int:
        # Random bits of 16-bit rounding: the table seed and this call's clock.
        return int(call_key(np.uint64(self._seed), np.int64(now)))

    def advance_step(self) -> None:
        """End a training step without gradients for this shard (``apply_gradients``
        already ends one; call this only for steps that skip it)."""
        with self._lock:
            self._end_step()

    def _end_step(self) -> None:
        if self._policy.sweep_due(self._clock.end_step()):
            self._sweep()

    def _age_if_due(self, touches: int) -> None:
        if self._policy.note_touches(touches, len(self._index)):
            age(self._storage.freq, 1)  # cost: one pass over the counts

    def set_admission_counting(self, enabled: bool) -> None:
        """Count sightings towards ``admission.min_count`` (on by default).

        A multi-epoch run turns it off after the first epoch: re-reading the same
        rows is not new evidence, so an id that occurs once in the data must not
        earn a row by being read twice. Not-yet-admitted ids keep reading (and
        training) the unknown row; admitted ids keep their rows.
        """
        with self._lock:
            self._admission.counting = enabled

    @property
    def admission_min_count(self) -> int | None:
        """The admission rule's ``min_count`` now; ``None``: every id is
        admitted at first sight (no counter to tighten)."""
        return (
            None
            if self._single_pass or self._admission.admits_all
            else (self._admission.spec.min_count)
        )

    def raise_admission(self, min_count: int) -> int | None:
        """Admit only ids seen ``min_count`` times from now on (never lowered,
        at most what the counter counts to; the scaling manager's memory rule);
        returns the rule's ``min_count`` now, ``None`` without a counter."""
        with self._lock:
            if self.admission_min_count is None:
                return None
            return self._admission.raise_min_count(min_count)

    # -- eviction ------------------------------------------------------------

    def sweep(self) -> int:
        """Apply the TTL now (``ttl_steps``, ``ttl_s``); returns rows evicted."""
        with self._lock:
            return self._sweep()

    def _sweep(self) -> int:
        now_s = self._time_fn() if self._policy.keep_time else 0.0
        slots = self._policy.expired(self._storage, self._index.slot_end, self.step, now_s)
        self._evict(slots)
        return int(slots.size)

    def _evict(self, slots: Int64Array) -> None:
        if slots.size == 0:
            return
        ids = self._storage.owner[slots]
        self._index.remove(ids)  # the slots go on the index's free list for reuse
        if self._disk is not None:  # demoted, not evicted: the row lives on on disk
            s = self._storage
            self._disk.put(ids, s.array[slots], s.stamp[slots])
            s.release(slots)
            return
        self._forget(slots, ids)

    def _forget(self, slots: Int64Array, ids: Int64Array) -> None:
        self._storage.release(slots)
        self._log.record(ids, limit=self._policy.capacity_rows or len(self._index))
        self._evictions += ids.size

    def remove(self, ids: Int64Array) -> int:
        """Drop the rows of ``ids`` int64 (N,) (eviction); returns how many existed.

        Their slots are reused by later admissions, which re-initialise them.
        """
        ids = as_ids(ids)
        with self._lock:
            slots = self._index.remove(ids)
            held = slots >= 0
            self._forget(slots[held], ids[held])
            on_disk = 0
            if self._disk is not None:
                gone = self._disk.remove(ids[~held])
                self._log.record(gone, limit=self._policy.capacity_rows or len(self._index))
                self._evictions += gone.size
                on_disk = gone.size
            return int(np.count_nonzero(held)) + on_disk

    def cap_rows(self, rows: int) -> int:
        """Lower this shard's row capacity to ``rows`` while it runs (the scaling
        manager, ``estuary.runtime.scaling``): the next admissions evict down to
        it (by the table's policy) and its arrays stop growing there. Needs
        ``eviction.capacity_rows`` (reads stamped); never raises the capacity.
        Returns the capacity now."""
        with self._lock:
            cap = self._policy.capacity_rows
            if cap is None:
                raise ValueError(
                    f"table {self.name!r}: cap_rows needs eviction.capacity_rows set "
                    "(recency is only kept for a bounded table)"
                )
            cap = max(1, min(cap, rows))
            self._policy.capacity_rows = cap
            self._storage.max_rows = cap + 1
            return cap

    def compact(self, *, below: float = COMPACT_BELOW) -> Compaction:
        """Give back the memory of rows that left (moved away, evicted) when fewer
        than ``below`` of the rows allocated hold an id: the rows in use are
        packed to the front, every per-row array and the hash index renumbered
        alike, and the arrays cut to the rows in use plus one growth's headroom
        (``estuary.embedding.compaction``). Lookups, updates and states are
        unchanged (only row numbers move). Safe between any two calls (it holds
        the lock). Returns what it did, or why it skipped."""
        below = check_below(below)
        with self._lock:
            s, index = self._storage, self._index
            held, allocated = len(index), s.capacity_rows - 1
            before = index.nbytes + s.nbytes
            reason = skip_reason(held, allocated, below)
            if self._disk is not None:
                reason = "a disk tier's memory rows are bounded by its budget and refill from disk"
            if reason is not None:
                return Compaction(held, allocated, allocated, before, before, skipped=reason)
            src, dst = index.pack()
            s.pack(src, dst)
            s.shrink(rows_to_keep(held, s.max_rows))
            after = index.nbytes + s.nbytes
            return Compaction(held, allocated, s.capacity_rows - 1, before, after, int(src.size))

    @property
    def capacity_rows(self) -> int | None:
        """Most rows this shard holds; ``None``: unbounded."""
        return self._policy.capacity_rows

    @property
    def allocated_rows(self) -> int:
        """Rows its arrays hold before they grow (rows removed leave room reused
        by later admissions)."""
        with self._lock:
            return max(0, self._storage.capacity_rows - 1)  # row 0 is reserved

    def stats(self) -> TableStats:
        """Counters since construction (``load_state_dict`` keeps them)."""
        with self._lock:
            disk = self._disk
            return TableStats(
                rows=len(self),
                bytes=self._index.nbytes
                + self._storage.nbytes
                + self._admission.nbytes
                + self._log.nbytes
                + (disk.memory_bytes if disk is not None else 0),
                lookups=self._lookups,
                hits=self._hits,
                admissions=self._admissions,
                pending_ids=len(self._admission),
                unknown_grads=self._unknown_grads,
                evictions=self._evictions,
                memory_hits=self._hits if disk is None else self._memory_hits,
                disk_rows=len(disk) if disk is not None else 0,
                disk_bytes=disk.disk_bytes if disk is not None else 0,
                disk_reads=disk.reads if disk is not None else 0,
                disk_writes=disk.writes if disk is not None else 0,
            )

    # -- snapshots and deltas (layout: estuary.embedding.delta) ----------------

    def state_dict(self, *, mark_clean: bool = True) -> State:
        """All rows and state as flat numpy arrays for safetensors (copies).

        Layout in ``estuary.embedding.delta`` (S = 1); rows in hash-table order.
        ``mark_clean`` starts a new delta interval (the next ``delta_state_dict``
        holds changes after this call) and a new chain version.
        """
        state = self.export_state(dirty_only=False, mark=mark_clean)
        if mark_clean:
            self._chain.advance()
        return {**state, **self._chain.keys()}

    def delta_state_dict(self) -> State:
        """Changes since the last mark (see ``estuary.embedding.delta``); marks clean."""
        full = self.log_overflowed()
        state = self.export_state(dirty_only=not full, mark=True)
        return {**state, **self._chain.delta_keys(self._chain.advance(), full)}

    def mark_clean(self) -> None:
        """Start a new delta interval without exporting anything."""
        with self._lock:
            self._mark()
        self._chain.advance()

    def load_state_dict(self, state: State) -> None:
        """Replace all rows with ``state`` (as from ``state_dict``; any S=1 part).

        ``ids`` and ``weights`` are required. Optimizer slots or eviction fields
        missing from ``state`` start fresh (rows count as touched now); extra ones
        are ignored. Stats counters are kept. Marks clean.
        """
        self.import_state(state, delta=False)
        self._chain.adopt(state)

    def apply_delta(self, delta: State) -> None:
        """Apply a ``delta_state_dict`` of this shard's chain on top of its current state."""
        self._chain.check(delta, self.name)
        self.import_state(delta, delta=not is_full(delta))
        self._chain.adopt(delta)

    def log_overflowed(self) -> bool:
        """Whether the next delta must be a full state (too many evictions logged)."""
        with self._lock:
            return self._log.overflowed

    def export_state(self, *, dirty_only: bool, mark: bool) -> State:
        """This shard's part of a table state (no chain keys); ``dirty_only`` keeps
        only rows stamped since the last mark and adds ``evicted_ids``."""
        return self.export_raw(dirty_only=dirty_only, mark=mark).materialize()

    def export_raw(self, *, dirty_only: bool, mark: bool) -> RawExport:
        """``export_state`` in two halves: under the lock, contiguous copies of the
        rows in use (a memcpy: the stall of a snapshot); ``materialize()`` then
        gathers the state from the copies, off the lock, on any thread."""
        with self._lock:
            end = self._index.slot_end
            evicts = self._storage.evicts
            if dirty_only:
                slots, ids = self._dirty_rows(end)
                # Few rows: gather them now (the copy of every row would cost more).
                rows = self._storage.array[slots]
                picked: Int64Array | slice = slice(None)  # every gathered row, in order
                stamps, freq, touch = (
                    self._storage.stamp[slots] if evicts else None,
                    self._storage.freq[slots] if self._policy.lfu else None,
                    self._storage.touch_s[slots] if self._policy.keep_time else None,
                )
            else:
                ids, picked = self._index.items()
                rows = self._storage.array[:end].copy()
                stamps = self._storage.stamp[:end].copy() if evicts else None
                freq = self._storage.freq[:end].copy() if self._policy.lfu else None
                touch = self._storage.touch_s[:end].copy() if self._policy.keep_time else None
            if self._disk is not None:
                rows, picked, ids, stamps = self._with_disk_rows(
                    rows, picked, ids, stamps, self._clean_stamp if dirty_only else None
                )
            small = self._rows_state(_UNKNOWN_ROWS, UNKNOWN_PREFIX)
            small.update(self._admission_state())
            small[CLOCK] = scalar(self._clock.value)
            small[AGING] = scalar(self._policy.aging)
            small[AGING_TOUCHES] = scalar(self._policy.aging_touches)
            if dirty_only:
                gone = np.unique(self._log.ids())
                small[EVICTED_IDS] = gone[self._index.lookup(gone) < 0]  # not back since
            if mark:
                self._mark()
        return RawExport(
            self._format, self._optimizer, rows, picked, ids, stamps, freq, touch, small
        )

    def _with_disk_rows(
        self, rows: Any, picked: Any, ids: Int64Array, stamps: Any, dirty_after: int | None
    ) -> tuple[Any, Int64Array, Int64Array, Any]:
        # The export's rows followed by the disk tier's (all, or those stamped
        # after ``dirty_after``): one table, whichever tier a row is in.
        assert self._disk is not None
        d_ids, d_rows, d_stamps = self._disk.items(dirty_after)
        rows = np.concatenate([rows[picked], d_rows])
        stamps = np.concatenate([stamps[picked], d_stamps])
        # Picked by an index array: the state's arrays are then contiguous copies.
        return rows, np.arange(ids.size + d_ids.size), np.concatenate([ids, d_ids]), stamps

    def _dirty_rows(self, end: int) -> tuple[Int64Array, Int64Array]:
        # (slots, ids) of the rows touched since the mark; without owners (a table
        # that does not evict) the ids come from one pass over the index.
        if self._storage.owner.size:
            slots = self._storage.dirty_slots(end, self._clean_stamp)
            return slots, self._storage.owner[slots]
        ids, all_slots = self._index.items()
        dirty = self._storage.stamp[all_slots] != 0
        return all_slots[dirty], ids[dirty]

    def _mark(self) -> None:
        self._clean_stamp = self._clock.value
        self._storage.mark_clean()
        self._log.clear()

    def _rows_state(self, rows: Int64Array, prefix: str) -> State:
        return _gather(self._storage.array, rows, self._format, self._optimizer, prefix)

    def import_state(self, state: State, *, delta: bool) -> None:
        """Load a full state part (``delta=False``: replaces every row) or apply a
        delta part (removes ``evicted_ids``, ages untouched LFU counts, upserts
        rows, replaces the rest). Marks clean."""
        ids = as_ids(state[IDS])
        weights = np.asarray(state[WEIGHTS])
        if weights.shape != (ids.size, self.dim):
            raise ValueError(
                f"{self.name}: weights shape {weights.shape} != ({ids.size}, {self.dim})"
            )
        with self._lock:
            aging = int(state[AGING][0]) if AGING in state else self._policy.aging
            if delta:
                age(self._storage.freq[: self._index.slot_end], aging - self._policy.aging)
                gone = as_ids(state.get(EVICTED_IDS, np.empty(0, np.int64)))
                slots = self._index.remove(gone)
                self._storage.release(slots[slots >= 0])
                if self._disk is not None:  # gone from either tier
                    self._disk.remove(gone)
            else:
                self._reset_rows(max(ids.size, self.spec.initial_capacity_rows))
                if self._disk is not None:
                    self._disk.clear()
            if CLOCK in state:
                self._clock.value = int(state[CLOCK][0])
            self._clock.value = max(self._clock.value, 1)  # loaded rows need stamps > 0
            self._policy.aging = aging
            if AGING_TOUCHES in state:
                self._policy.aging_touches = int(state[AGING_TOUCHES][0])
            if self._disk is not None:
                self._upsert_within_budget(ids, state, check_new=not delta)
            else:
                self._upsert_rows(ids, state, check_new=not delta)
            self._load_rows(_UNKNOWN_ROWS, state, UNKNOWN_PREFIX, 1)
            self._load_admission(state)
            self._mark()

    def export_rows(self, select: Callable[[Int64Array], np.ndarray]) -> State:
        """The row keys (ids, weights, optimizer slots, eviction fields) of the ids
        held whose ``select(ids)`` bool mask is set, plus those ids' exact pending
        admission counts (``admission.ids/counts``); copies, nothing removed."""
        with self._lock:
            if self._disk is not None:  # rows in either tier: the full export, filtered
                full = self.export_state(dirty_only=False, mark=False)
                state = _row_subset(full, np.flatnonzero(select(as_ids(full[IDS]))))
            else:
                ids, slots = self._index.items()
                keep = select(ids)
                ids, slots = ids[keep], slots[keep]
                state = _gather(
                    self._storage.array[slots], slice(None), self._format, self._optimizer, ""
                )
                state[IDS] = ids
                s = self._storage
                if s.evicts:
                    state[STAMP] = s.stamp[slots]
                if self._policy.lfu:
                    state[FREQ] = s.freq[slots]
                if self._policy.keep_time:
                    state[TOUCH_S] = s.touch_s[slots]
            if isinstance(self._admission, AdmissionFilter):
                pending = self._admission.state_dict()
                keep = select(as_ids(pending["ids"]))
                state[PENDING_IDS] = pending["ids"][keep]
                state[PENDING_COUNTS] = pending["counts"][keep]
        return state

    def import_rows(self, state: State) -> int:
        """Take in rows moved from another server (``estuary.ps.migration``): the
        row keys of a state (weights, optimizer slots, eviction fields) for ids
        this shard does not hold, plus their exact pending admission counts.
        The rows count as changed since the last mark (the next delta carries
        them). Returns the rows taken in."""
        ids = as_ids(state[IDS])
        rows = {k: np.asarray(v) for k, v in state.items() if k not in _PENDING_KEYS}
        with self._lock:
            if self._storage.evicts and STAMP in rows:
                rows[STAMP] = np.maximum(rows[STAMP].astype(np.int64), self._clean_stamp + 1)
            if ids.size:
                if self._disk is not None:
                    self._upsert_within_budget(ids, rows, check_new=True)
                else:
                    self._upsert_rows(ids, rows, check_new=True)
            moved = as_ids(state.get(PENDING_IDS, np.empty(0, np.int64)))
            if moved.size and isinstance(self._admission, AdmissionFilter):
                have = self._admission.state_dict()
                self._admission.load_state_dict(
                    {
                        "ids": np.concatenate([have["ids"], moved]),
                        "counts": np.concatenate(
                            [have["counts"], np.asarray(state[PENDING_COUNTS], np.int64)]
                        ),
                    }
                )
        return int(ids.size)

    def forget_pending(self, ids: Int64Array) -> int:
        """Drop the exact pending admission counts of ``ids`` (moved to another
        server); returns how many were pending. A sketch counter keeps counting
        them (it cannot forget single ids)."""
        ids = as_ids(ids)
        with self._lock:
            if not ids.size or not isinstance(self._admission, AdmissionFilter):
                return 0
            have = self._admission.state_dict()
            gone = np.isin(have["ids"], ids)
            if gone.any():
                self._admission.load_state_dict(
                    {"ids": have["ids"][~gone], "counts": have["counts"][~gone]}
                )
            return int(np.count_nonzero(gone))

    def _upsert_within_budget(self, ids: Int64Array, state: State, *, check_new: bool) -> None:
        # A tiered shard loads its rows oldest first (by stamp), half its capacity
        # at a time, making room (to disk) before each part: memory never holds
        # more than the budget, and the most recent rows end in memory.
        cap = self._policy.capacity_rows or ids.size
        order = (
            np.argsort(np.asarray(state[STAMP]), kind="stable")
            if STAMP in state
            else np.arange(ids.size)
        )
        now = self._clock.value + 1  # loaded rows are all older: any may go
        step = max(1, cap // 2)
        for start in range(0, ids.size, step):
            sel = order[start : start + step]
            decision = self._policy.make_room(
                self._storage, self._index.slot_end, len(self._index), sel.size, now
            )
            self._evict(decision.slots)
            # Upserts come to memory: older copies on disk go (some may have just
            # been moved there to make room).
            assert self._disk is not None
            self._disk.remove(ids[sel])
            self._upsert_rows(ids[sel], _row_subset(state, sel), check_new=check_new)

    def _admission_state(self) -> State:
        # This shard's pending counts under the state keys of its counter.
        filt = self._admission
        if isinstance(filt, SketchAdmissionFilter):
            return sketch_keys([filt.state_dict()])
        pending = filt.state_dict()
        return {PENDING_IDS: pending["ids"], PENDING_COUNTS: pending["counts"]}

    def _load_admission(self, state: State) -> None:
        # A state saved with the other counter: exact counts go into a sketch;
        # a sketch cannot give an exact table its ids (counting restarts).
        filt = self._admission
        if SKETCH_WORDS in state:
            (sketch,) = sketch_parts(state)
            if isinstance(filt, SketchAdmissionFilter):
                filt.load_state_dict(sketch)
            else:
                _log.warning(
                    "table %r: pending admission counts were saved as a sketch; the "
                    "exact counter starts empty", self.name,
                )  # fmt: skip
        elif PENDING_IDS in state:
            ids, counts = as_ids(state[PENDING_IDS]), np.asarray(state[PENDING_COUNTS], np.int64)
            if isinstance(filt, AdmissionFilter):
                filt.load_state_dict({"ids": ids, "counts": counts})
            elif isinstance(filt, SketchAdmissionFilter):
                filt.observe_counts(*_unique_counts(ids, counts), admit=False)

    def _upsert_rows(self, ids: Int64Array, state: State, *, check_new: bool) -> None:
        if check_new:  # all new: room for them first (``HashIndex.reserve``)
            self._index.reserve(len(self._index) + ids.size)
        rows, new_at = self._index.get_or_insert_new(ids)
        if check_new and new_at.size < ids.size:
            raise ValueError(f"{self.name}: state has duplicate ids")
        self._storage.ensure_rows(self._index.slot_end)
        fresh = rows[new_at]
        self._format.reset_state(self._optimizer, self._storage.array, fresh, self._init_state)
        self._load_rows(rows, state, "", ids.size)
        s = self._storage
        s.claim(rows, ids, self._clock.value, self._time_fn() if s.touch_s.size else 0.0)
        if STAMP in state:
            s.load_stamps(rows, state[STAMP])
        if FREQ in state and s.freq.size:
            s.freq[rows] = np.asarray(state[FREQ], np.int32)
        if TOUCH_S in state and s.touch_s.size:
            s.touch_s[rows] = np.asarray(state[TOUCH_S], np.float64)

    def _load_rows(self, rows: Int64Array, state: State, prefix: str, n: int) -> None:
        arr = self._storage.array
        opt = self._optimizer
        if prefix + WEIGHTS in state:
            weights = self._stored_weights(np.asarray(state[prefix + WEIGHTS]), prefix + WEIGHTS)
            self._format.put_weights(arr, rows, weights.reshape(n, self.dim))
        for name in opt.state_names + opt.scalar_names:
            key = f"{prefix}{OPT_PREFIX}{name}"
            if key in state:
                cols = opt.columns(name)
                value = np.asarray(state[key], np.float32).reshape(n, cols.stop - cols.start)
                arr[rows, self._format.columns(cols)] = value

    def _stored_weights(self, weights: np.ndarray, key: str) -> np.ndarray:
        # Weights saved in another dtype are converted (round to nearest), with a
        # warning: a bf16 state loaded as fp32 keeps its bf16 precision, an fp32
        # one loaded as bf16 loses precision. One warning per load (the rows'
        # weights; the unknown row's come from the same state).
        fmt = self._format
        if weights.dtype == fmt.dtype:
            return weights
        if key == WEIGHTS:
            _log.warning(
                "table %r: weights saved as %s, loaded as %s (the table's dtype)",
                self.name, dtype_name(weights), fmt.name,
            )  # fmt: skip
        return encode_nearest(decode(weights), fmt.name)
