"""Compaction of a shard's rows (``EmbeddingShard.compact``,
``estuary.embedding.compaction``): after most rows left, the arrays shrink and
every id keeps exactly what it held; the shard then behaves as one never
compacted."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from estuary.config.spec import DiskSpec, EvictionSpec, SparseOptimizerSpec, TableSpec
from estuary.embedding import EmbeddingShard, EmbeddingTable
from estuary.embedding.compaction import rows_to_keep
from estuary.embedding.delta import FREQ, IDS, OPT_PREFIX, STAMP, TOUCH_S, WEIGHTS
from estuary.embedding.storage import PER_ROW

DIM = 8
KEYS = np.arange(-300, 2700, dtype=np.int64) * 7919  # 3000 ids, scattered hashes

# (spec changes) of tables keeping different per-row arrays: fp32 Adagrad with
# touched flags only; bf16 row-wise Adagrad with owners, LFU counts and touch
# times (capacity + ttl_s).
KINDS: dict[str, dict[str, Any]] = {
    "plain": {"optimizer": SparseOptimizerSpec(name="adagrad", lr=0.1)},
    "evicting": {
        "optimizer": SparseOptimizerSpec(name="rowwise_adagrad", lr=0.1),
        "dtype": "bf16",
        "eviction": EvictionSpec(capacity_rows=5000, policy="lfu", ttl_s=1e9),
    },
}


class Clock:
    """A wall clock that ticks by one second per read (distinct touch times)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def make(kind: str) -> EmbeddingShard:
    spec = replace(TableSpec(dim=DIM, initial_capacity_rows=64), **KINDS[kind])
    return EmbeddingShard(spec, seed=3, name="t", time_fn=Clock())


def train(shard: EmbeddingShard, ids: np.ndarray, steps: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        batch = np.unique(rng.choice(ids, 256))
        shard.lookup(batch, train=True)
        shard.apply_gradients(batch, rng.standard_normal((batch.size, DIM)).astype(np.float32))


def by_id(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The state's row keys in id order (hash-table order depends on the index size)."""
    order = np.argsort(state[IDS])
    rows = (IDS, WEIGHTS, STAMP, FREQ, TOUCH_S)
    return {k: (v[order] if k in rows or k.startswith(OPT_PREFIX) else v) for k, v in state.items()}


def assert_states_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    """Equal states, but for the chain's lineage (drawn per shard)."""
    a, b = by_id(a), by_id(b)
    a.pop("delta.lineage", None)
    b.pop("delta.lineage", None)
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def drained(kind: str) -> EmbeddingShard:
    """A shard that held 3000 trained ids and lost 90% of them (scattered)."""
    shard = make(kind)
    shard.lookup(KEYS, train=True)
    train(shard, KEYS, steps=4, seed=1)
    shard.remove(KEYS[np.arange(KEYS.size) % 10 != 3])
    return shard


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_compaction_keeps_every_row_and_shrinks_every_array(kind: str) -> None:
    shard, twin = drained(kind), drained(kind)
    before = shard.state_dict(mark_clean=False)
    sizes = {name: getattr(shard._storage, name).shape[0] for name in PER_ROW}
    index_bytes = shard._index.nbytes

    done = shard.compact()

    assert done.skipped is None and done.held == len(shard) == 300
    assert done.moved > 0
    # Every id's weights, optimizer state and eviction fields, bit for bit.
    assert_states_equal(shard.state_dict(mark_clean=False), before)
    keep = rows_to_keep(300, shard._storage.max_rows)
    for name in PER_ROW:
        arr = getattr(shard._storage, name)
        assert arr.shape[0] == (keep if sizes[name] else 0), name
    assert shard._storage.capacity_rows == keep < sizes["array"] / 5
    assert shard._index.nbytes < index_bytes / 2  # rebuilt at the size 300 ids need
    assert shard._index.slot_end == 1 + len(shard)
    assert done.bytes_after < done.bytes_before / 3
    assert shard.stats().bytes < twin.stats().bytes / 3

    # Then it trains, evicts and checkpoints as the twin that never compacted.
    fresh = np.arange(10_000, 10_400, dtype=np.int64)
    for ids, seed in ((KEYS, 5), (np.concatenate([KEYS[::3], fresh]), 6)):
        train(shard, ids, steps=3, seed=seed)
        train(twin, ids, steps=3, seed=seed)
    probe = np.concatenate([KEYS, fresh, [-1, 123456789]])
    np.testing.assert_array_equal(shard.lookup(probe, train=False), twin.lookup(probe, train=False))
    assert_states_equal(shard.state_dict(), twin.state_dict())
    np.testing.assert_array_equal(
        np.sort(shard.delta_state_dict()["ids"]), np.sort(twin.delta_state_dict()["ids"])
    )


def test_an_evicting_shard_evicts_the_same_rows_after_compaction() -> None:
    spec = replace(
        TableSpec(dim=DIM, initial_capacity_rows=64),
        optimizer=SparseOptimizerSpec(name="sgd", lr=0.1),
        eviction=EvictionSpec(capacity_rows=1000),
    )
    shard, twin = (EmbeddingShard(spec, seed=3, name="t") for _ in range(2))
    for s in (shard, twin):
        s.lookup(KEYS[:1000], train=True)
        s.remove(KEYS[:900])
    assert shard.compact().skipped is None
    for s in (shard, twin):  # past the capacity: LRU victims among the compacted rows
        for start in range(1000, 3000, 500):
            s.lookup(KEYS[start : start + 500], train=True)
    assert len(shard) == len(twin) > 900  # evicted down to the capacity, same ids
    np.testing.assert_array_equal(np.sort(shard._index.keys()), np.sort(twin._index.keys()))


def test_a_shard_mostly_in_use_or_with_a_disk_tier_is_not_compacted(tmp_path: Any) -> None:
    shard = make("plain")
    shard.lookup(KEYS, train=True)
    shard.remove(KEYS[: KEYS.size // 10])
    rows = shard._storage.capacity_rows
    done = shard.compact()
    assert done.skipped is not None and "not below 0.75" in done.skipped
    assert shard._storage.capacity_rows == rows and done.freed_bytes == 0
    assert shard.compact(below=1.0).skipped is None  # any slack, when asked
    assert shard._storage.capacity_rows < rows

    tiered = EmbeddingShard(
        replace(TableSpec(dim=DIM), disk=DiskSpec(memory_bytes=200_000, path=str(tmp_path))), 3, "t"
    )
    tiered.lookup(KEYS, train=True)
    tiered.remove(KEYS)
    assert "disk tier" in (tiered.compact().skipped or "")
    with pytest.raises(ValueError, match="below"):
        shard.compact(below=1.5)


def test_a_table_compacts_each_shard() -> None:
    table = EmbeddingTable(replace(TableSpec(dim=DIM), shards=2), seed=3, name="t")
    table.lookup(KEYS, train=True)
    allocated = table.allocated_rows
    table.remove(KEYS[100:])
    done = table.compact()
    assert len(done) == 2 and all(d.skipped is None for d in done)
    assert sum(d.held for d in done) == len(table) == 100
    assert table.allocated_rows < allocated / 10
    table.remove(KEYS[:100])  # every row gone: down to the unknown row
    assert all(d.skipped is None for d in table.compact()) and table.allocated_rows == 0
    twin = EmbeddingTable(replace(TableSpec(dim=DIM), shards=2), seed=3, name="t")
    np.testing.assert_array_equal(
        table.lookup(KEYS[:50], train=True), twin.lookup(KEYS[:50], train=True)
    )
