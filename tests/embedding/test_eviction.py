"""Eviction: exact victim choice, capacity (LRU/LFU), TTL in steps and seconds, memory bounds."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from estuary.config.spec import EvictionSpec, InitializerSpec, SparseOptimizerSpec, TableSpec
from estuary.embedding import EmbeddingShard, EmbeddingTable
from estuary.embedding.eviction import STEP_SHIFT, AccessClock, select_victims

DIM = 4
SPEC = TableSpec(
    dim=DIM,
    initializer=InitializerSpec("uniform", 0.5),
    optimizer=SparseOptimizerSpec(name="adagrad", lr=0.1),
    initial_capacity_rows=8,
)


def _shard(time_fn: object = None, **eviction: object) -> EmbeddingShard:
    spec = replace(SPEC, eviction=EvictionSpec(**eviction))  # type: ignore[arg-type]
    if time_fn is None:
        return EmbeddingShard(spec, seed=0, name="t")
    return EmbeddingShard(spec, seed=0, name="t", time_fn=time_fn)  # type: ignore[arg-type]


def _ids(*values: int) -> np.ndarray:
    return np.array(values, np.int64)


def _step(store: EmbeddingShard | EmbeddingTable, ids: np.ndarray) -> np.ndarray:
    """One training step: train lookup, then a gradient for every id."""
    rows = store.lookup(ids, train=True)
    uniq = np.unique(ids)
    store.apply_gradients(uniq, np.full((uniq.size, DIM), 0.1, np.float32))
    return rows


def _held(store: EmbeddingShard | EmbeddingTable, ids: np.ndarray) -> np.ndarray:
    """Which of ``ids`` own a row (reading it does not touch anything)."""
    return store.lookup(ids, train=False).any(axis=1)


# -- the victim-selection kernel -------------------------------------------------


def _reference(stamp: np.ndarray, freq: np.ndarray, protect_from: int, k: int) -> np.ndarray:
    """The k smallest keys among eligible slots, by a full sort."""
    eligible = np.flatnonzero((stamp > 0) & (stamp < protect_from))
    if freq.size:
        keys = (freq[eligible].astype(np.int64) << 40) | (stamp[eligible] >> STEP_SHIFT)
    else:
        keys = stamp[eligible]
    return np.sort(keys)[:k]


def _selected_keys(stamp: np.ndarray, freq: np.ndarray, protect_from: int, k: int) -> np.ndarray:
    out = np.empty(max(k, 0), np.int64)
    owner = np.arange(stamp.size, dtype=np.int64)[::-1].copy()  # ids: ties go to high slots
    got = select_victims(stamp, freq, owner, protect_from, k, out)
    victims = out[:got]
    assert np.unique(victims).size == got
    assert ((stamp[victims] > 0) & (stamp[victims] < protect_from)).all()
    if freq.size:
        return np.sort((freq[victims].astype(np.int64) << 40) | (stamp[victims] >> STEP_SHIFT))
    return np.sort(stamp[victims])


@settings(max_examples=80, deadline=None)
@given(
    stamps=st.lists(st.integers(0, 40), min_size=1, max_size=60),
    freqs=st.lists(st.integers(0, 5), min_size=60, max_size=60),
    k=st.integers(0, 70),
    protect_from=st.integers(1, 45),
    lfu=st.booleans(),
)
def test_select_victims_takes_exactly_the_smallest_keys(
    stamps: list[int], freqs: list[int], k: int, protect_from: int, lfu: bool
) -> None:
    stamp = np.array(stamps, np.int64) << STEP_SHIFT  # small keys in the step bits
    freq = np.array(freqs[: len(stamps)], np.int32) if lfu else np.empty(0, np.int32)
    protect = protect_from << STEP_SHIFT
    np.testing.assert_array_equal(
        _selected_keys(stamp, freq, protect, k), _reference(stamp, freq, protect, k)
    )


def test_select_victims_is_exact_over_a_wide_key_range() -> None:
    # Keys spread over ~2**50 need several histogram refinements.
    rng = np.random.default_rng(0)
    stamp = rng.integers(1, 2**50, size=50_000, dtype=np.int64)
    stamp[rng.random(stamp.size) < 0.1] = 0  # free slots
    stamp[:100] = 12345  # a block of ties
    for k in (1, 77, 5_000, 44_000, 60_000):
        np.testing.assert_array_equal(
            _selected_keys(stamp, np.empty(0, np.int32), 2**50, k),
            _reference(stamp, np.empty(0, np.int32), 2**50, k),
        )


def test_clock_stamps_increase_and_carry_the_step() -> None:
    clock = AccessClock()
    first = clock.tick()
    assert clock.tick() > first and clock.step == 0
    assert clock.end_step() == 1
    assert clock.tick() == (1 << STEP_SHIFT) + 1 > first


# -- capacity --------------------------------------------------------------------


def test_evicts_least_recent_when_full_down_to_low_water() -> None:
    shard = _shard(capacity_rows=100)
    for start in range(0, 100, 10):  # ten calls: ids 0-9 oldest ... 90-99 newest
        shard.lookup(np.arange(start, start + 10, dtype=np.int64), train=True)
    shard.lookup(np.arange(10, dtype=np.int64), train=True)  # 0-9 now the newest
    shard.lookup(np.arange(1000, 1010, dtype=np.int64), train=True)
    # 110 rows wanted, capacity 100: evict down to 95 after the insert = 15 rows,
    # the least recently touched: 10-19, then 20-24 (ties go to the smallest ids).
    assert len(shard) == 95
    gone = np.arange(10, 25, dtype=np.int64)
    assert not _held(shard, gone).any()
    assert _held(shard, np.concatenate([np.arange(10), np.arange(25, 100)])).all()
    assert _held(shard, np.arange(1000, 1010, dtype=np.int64)).all()
    stats = shard.stats()
    assert (stats.evictions, stats.admissions, stats.rows) == (15, 110, 95)


def test_never_evicts_ids_of_the_batch_being_inserted() -> None:
    shard = _shard(capacity_rows=10)
    old = np.arange(10, dtype=np.int64)
    before = shard.lookup(old, train=True)
    new = np.arange(100, 108, dtype=np.int64)
    rows = shard.lookup(np.concatenate([old[:5], new]), train=True)
    # Only old[5:] may go, which makes room for 5 of the 8 new ids; the other 3
    # read the unknown row this time.
    np.testing.assert_array_equal(rows[:5], before[:5])
    assert len(shard) == 10 and _held(shard, old[:5]).all() and not _held(shard, old[5:]).any()
    assert np.count_nonzero(rows[5:].any(axis=1)) == 5
    assert shard.stats().evictions == 5


def test_evicted_and_readmitted_id_starts_from_its_initial_row() -> None:
    shard = _shard(capacity_rows=4)
    first = _step(shard, _ids(7))
    for i in range(1, 6):  # push id 7 out
        _step(shard, np.arange(i * 10, i * 10 + 4, dtype=np.int64))
    assert not _held(shard, _ids(7)).any()
    np.testing.assert_array_equal(shard.lookup(_ids(7), train=True), first)


def test_lfu_keeps_frequent_rows_until_their_counts_age_out() -> None:
    hot = np.arange(10, dtype=np.int64)
    stores = {policy: _shard(capacity_rows=100, policy=policy) for policy in ("lru", "lfu")}
    for store in stores.values():
        for _ in range(20):
            _step(store, hot)
    fresh = iter(range(1000, 10**6, 10))
    kept_at: dict[str, list[bool]] = {"lru": [], "lfu": []}
    for _ in range(400):  # 10 new ids a step, the hot ones never again
        new = np.arange(next(fresh), dtype=np.int64)[-10:]
        for policy, store in stores.items():
            _step(store, new)
            kept_at[policy].append(bool(_held(store, hot).all()))
            assert len(store) <= 100
    assert not kept_at["lru"][20]  # LRU drops them after ~one capacity of new ids
    assert all(kept_at["lfu"][:100])  # LFU keeps them well past that ...
    assert not kept_at["lfu"][-1]  # ... until halving (every 10 x capacity touches) wins
    assert stores["lfu"]._policy.aging >= 5


def test_table_splits_capacity_across_shards() -> None:
    spec = replace(SPEC, shards=4, eviction=EvictionSpec(capacity_rows=100))
    table = EmbeddingTable(spec, seed=0, name="t")
    for start in range(0, 2000, 50):
        _step(table, np.arange(start, start + 50, dtype=np.int64))
        assert all(len(s) <= 25 for s in table.shards)
    assert len(table) <= 100 and table.stats().evictions == 2000 - len(table)


# -- TTL --------------------------------------------------------------------------


def test_ttl_steps_evicts_rows_untouched_for_that_many_steps() -> None:
    shard = _shard(ttl_steps=2, sweep_every_steps=1)
    a, b = _ids(1, 2), _ids(3)
    _step(shard, a)  # touched in step 0
    _step(shard, b)  # step 1 ends: a idle for 1 step
    _step(shard, b)  # step 2 ends: a idle for 2 steps -> swept
    assert not _held(shard, a).any() and _held(shard, b).all()
    assert shard.stats().evictions == 2 and shard.step == 3


def test_ttl_steps_waits_for_the_sweep_interval_or_an_explicit_sweep() -> None:
    shard = _shard(ttl_steps=1, sweep_every_steps=100)
    _step(shard, _ids(1))
    for _ in range(5):
        shard.advance_step()
    assert _held(shard, _ids(1)).all()  # expired, but not swept yet
    assert shard.sweep() == 1 and len(shard) == 0
    assert shard.sweep() == 0


def test_ttl_seconds_with_an_injected_clock() -> None:
    now = [1000.0]
    shard = _shard(time_fn=lambda: now[0], ttl_s=10.0)
    shard.lookup(_ids(1), train=True)
    now[0] = 1005.0
    shard.lookup(_ids(2), train=True)
    now[0] = 1012.0
    assert shard.sweep() == 1
    assert not _held(shard, _ids(1)).any() and _held(shard, _ids(2)).all()
    shard.apply_gradients(_ids(2), np.ones((1, DIM), np.float32))  # a gradient touches too
    now[0] = 1020.0
    assert shard.sweep() == 0
    now[0] = 1022.5
    assert shard.sweep() == 1 and shard.stats().evictions == 2


def test_every_shard_sees_every_step_end() -> None:
    spec = replace(SPEC, shards=4, eviction=EvictionSpec(ttl_steps=3, sweep_every_steps=1))
    table = EmbeddingTable(spec, seed=0, name="t")
    _step(table, _ids(5))  # one id: one shard gets gradients, three do not
    for _ in range(4):
        table.apply_gradients(_ids(), np.zeros((0, DIM), np.float32))
    assert [s.step for s in table.shards] == [5] * 4 and table.step == 5
    assert len(table) == 0  # swept: idle for 4 >= 3 steps


# -- memory ------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("deltas", [False, True])
def test_memory_stays_bounded_streaming_ten_times_capacity(policy: str, deltas: bool) -> None:
    cap = 2000
    eviction = EvictionSpec(capacity_rows=cap, policy=policy)  # type: ignore[arg-type]
    spec = replace(SPEC, shards=2, eviction=eviction)
    table = EmbeddingTable(spec, seed=0, name="t")
    rng = np.random.default_rng(0)
    hot = rng.integers(0, 2**62, size=300)
    sizes: list[tuple[int, int, int, int]] = []
    batches = 100
    for b in range(batches):  # 20k distinct new ids (10x capacity) + recurring hot ids
        new = np.arange(b * 200, (b + 1) * 200, dtype=np.int64) + 10**9
        _step(table, np.concatenate([new, hot[rng.integers(0, hot.size, 50)]]))
        assert len(table) <= cap
        if deltas and b % 10 == 9:
            table.delta_state_dict()
        stats = table.stats()
        index_entries = sum(s._index.capacity for s in table.shards)
        storage_rows = sum(s._storage.capacity_rows for s in table.shards)
        sizes.append((stats.bytes, index_entries, storage_rows, stats.rows))
    first, rest = sizes[: batches // 5], sizes[batches // 5 :]
    # Bytes stopped growing, but for the eviction log (ids for the next delta),
    # which is bounded by max(capacity, 1024) ids per shard, then dropped.
    log_bound = 8 * 1024 * len(table.shards)
    assert max(s[0] for s in rest) <= max(s[0] for s in first) + log_bound
    assert {s[1] for s in rest} == {sizes[batches // 5][1]}  # index size fixed
    assert max(s[2] for s in rest) <= cap + 2  # storage: capacity + unknown rows
    stats = table.stats()
    assert stats.admissions - stats.evictions == stats.rows
    assert stats.evictions > 9 * cap
    assert stats.bytes < 2.5 * cap * (8 * DIM + 16 + 48)  # rows + metadata + index
