"""EmbeddingTable: sharding is invisible to results, and states reshard on load."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from estuary.config.spec import (
    AdmissionSpec,
    EvictionSpec,
    InitializerSpec,
    SparseOptimizerSpec,
    TableSpec,
)
from estuary.embedding import EmbeddingShard, EmbeddingTable
from estuary.embedding.hashing import route, shard_of

DIM = 6


def _table(shards: int, admission: AdmissionSpec | None = None) -> EmbeddingTable:
    spec = TableSpec(
        dim=DIM,
        shards=shards,
        initializer=InitializerSpec("normal", 0.1),
        optimizer=SparseOptimizerSpec(name="adagrad", lr=0.1),
        admission=admission or AdmissionSpec(),
    )
    return EmbeddingTable(spec, seed=9, name="t")


def _train(table: EmbeddingTable, steps: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    seen = []
    for _ in range(steps):
        ids = np.unique(rng.integers(-(2**62), 2**62, size=300) // 2**52).astype(np.int64)
        table.lookup(ids, train=True)
        table.apply_gradients(ids, rng.normal(size=(ids.size, DIM)).astype(np.float32))
        seen.append(ids)
    return np.unique(np.concatenate(seen))


def test_four_shards_give_the_same_rows_as_one() -> None:
    one, four = _table(1), _table(4)
    ids = _train(one, steps=5, seed=0)
    _train(four, steps=5, seed=0)
    shuffled = np.random.default_rng(1).permutation(ids)
    np.testing.assert_array_equal(
        four.lookup(shuffled, train=False), one.lookup(shuffled, train=False)
    )
    assert len(four) == len(one) == ids.size
    assert four.stats().rows == one.stats().rows
    assert all(len(s) > ids.size // 8 for s in four.shards)  # every shard holds a share


def test_single_shard_table_passes_straight_through() -> None:
    table = _table(1)
    shard = EmbeddingShard(table.spec, seed=9, name="t")
    ids = np.array([3, 1, 3], np.int64)
    np.testing.assert_array_equal(table.lookup(ids, train=True), shard.lookup(ids, train=True))
    assert table.state_dict().keys() == shard.state_dict().keys()


def test_route_groups_ids_by_owner_and_keeps_every_position() -> None:
    ids = np.random.default_rng(0).integers(-1000, 1000, size=5000).astype(np.int64)
    order, offsets = route(ids, 3)
    np.testing.assert_array_equal(np.sort(order), np.arange(ids.size))
    owner = shard_of(ids, 3)
    for k in range(3):
        assert (owner[order[offsets[k] : offsets[k + 1]]] == k).all()
    assert np.all(np.diff(offsets) > 1400)  # roughly even


def test_loading_four_shards_into_three_preserves_every_row_and_its_state() -> None:
    four = _table(4, AdmissionSpec(min_count=2, counter="exact"))
    ids = _train(four, steps=6, seed=0)
    state = four.state_dict()
    three = _table(3, AdmissionSpec(min_count=2, counter="exact"))
    three.load_state_dict(state)
    assert len(three) == len(four)
    assert three.stats().pending_ids == four.stats().pending_ids
    # Ids that own a row read it; the rest read unknown rows, averaged on reshard.
    owned = ids[np.isin(ids, state["ids"])]
    assert 0 < owned.size < ids.size
    np.testing.assert_array_equal(three.lookup(owned, train=False), four.lookup(owned, train=False))
    # Optimizer state moved with the rows: the same further steps give the same rows.
    grads = np.random.default_rng(2).normal(size=(owned.size, DIM)).astype(np.float32)
    three.apply_gradients(owned, grads)
    four.apply_gradients(owned, grads)
    np.testing.assert_array_equal(three.lookup(owned, train=False), four.lookup(owned, train=False))
    merged = three.state_dict()
    assert sorted(merged["ids"].tolist()) == sorted(state["ids"].tolist())


def test_reshard_averages_unknown_rows() -> None:
    two = _table(2, admission=AdmissionSpec(min_count=10))
    _train(two, steps=2, seed=0)
    state = two.state_dict()
    assert state["unknown.weights"].shape == (2, DIM)
    one = _table(1, admission=AdmissionSpec(min_count=10))
    one.load_state_dict(state)
    np.testing.assert_allclose(
        one.lookup(np.array([12345], np.int64), train=False)[0],
        state["unknown.weights"].mean(axis=0),
    )


def test_loading_four_shards_into_three_keeps_eviction_state() -> None:
    spec = TableSpec(
        dim=DIM,
        shards=4,
        initializer=InitializerSpec("normal", 0.1),
        optimizer=SparseOptimizerSpec(name="adagrad", lr=0.1),
        admission=AdmissionSpec(min_count=2, counter="exact"),  # pending ids by id
        eviction=EvictionSpec(capacity_rows=200, policy="lfu", ttl_steps=40),
    )
    four = EmbeddingTable(spec, seed=9, name="t")
    rng = np.random.default_rng(0)

    def train(table: EmbeddingTable, steps: int, base: int) -> None:
        for step in range(steps):  # hot ids 0-49 and a drifting cold range
            cold = rng.integers(base + step * 20, base + step * 20 + 60, 40)
            ids = np.unique(np.concatenate([rng.integers(0, 50, 30), cold])).astype(np.int64)
            table.lookup(ids, train=True)
            table.apply_gradients(ids, rng.normal(size=(ids.size, DIM)).astype(np.float32))

    train(four, steps=40, base=1000)
    assert four.stats().evictions > 0 and four.stats().pending_ids > 0
    state = four.state_dict()
    three = EmbeddingTable(replace(spec, shards=3), seed=9, name="t")
    three.load_state_dict(state)
    merged = three.state_dict(mark_clean=False)
    row_keys = ["ids", "weights", "opt.accum", "evict.stamp", "evict.freq"]
    want, got = np.argsort(state["ids"]), np.argsort(merged["ids"])
    for key in row_keys:  # every row with its optimizer and eviction state
        np.testing.assert_array_equal(merged[key][got], state[key][want], err_msg=key)
    want_p, got_p = np.argsort(state["admission.ids"]), np.argsort(merged["admission.ids"])
    for key in ["admission.ids", "admission.counts"]:
        np.testing.assert_array_equal(merged[key][got_p], state[key][want_p])
    assert merged["meta.clock"].tolist() == [state["meta.clock"].max()] * 3
    assert merged["meta.aging"].tolist() == [state["meta.aging"].max()] * 3
    assert three.step == four.step
    # The resharded table goes on evicting within its (re-split) capacity.
    evictions = three.stats().evictions
    for _ in range(5):
        train(three, steps=4, base=5000)
        assert all(len(s) <= 67 for s in three.shards)  # ceil(200 / 3)
    assert three.stats().evictions > evictions
