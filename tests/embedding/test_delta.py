"""Incremental checkpoints: snapshot + deltas == a full snapshot, on every field.

Timeline of the main test (S = shards of the source, R = a replica)::

    source:  train | state_dict (v1) | train, evict, remove, sweep | delta1 (v1->v2)
             | train ... | delta2 (v2->v3) | state_dict (v4)
    replica: load v1 (through safetensors) | apply delta1 | apply delta2  ==  v4
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from estuary.config.spec import (
    AdmissionSpec,
    EvictionSpec,
    InitializerSpec,
    SparseOptimizerSpec,
    TableSpec,
)
from estuary.embedding import EmbeddingShard, EmbeddingTable

DIM = 4
State = dict[str, np.ndarray]


class FakeClock:
    """Wall time for ``ttl_s``, advanced by hand."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def _spec(policy: str, shards: int) -> TableSpec:
    return TableSpec(
        dim=DIM,
        shards=shards,
        initializer=InitializerSpec("normal", 0.1),
        optimizer=SparseOptimizerSpec(name="adam", lr=0.01),
        admission=AdmissionSpec(min_count=2),
        eviction=EvictionSpec(
            capacity_rows=120,
            policy=policy,  # type: ignore[arg-type]
            ttl_steps=6,
            ttl_s=50.0,
            sweep_every_steps=3,
        ),
        initial_capacity_rows=16,
    )


def _train(table: EmbeddingTable, clock: FakeClock, steps: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        clock.now += 1.0
        # A hot set (LFU counts grow) and a drifting cold range (capacity evictions).
        ids = np.unique(
            np.concatenate(
                [rng.integers(0, 30, 20), rng.integers(seed * 1000, seed * 1000 + 400, 40)]
            )
        ).astype(np.int64)
        table.lookup(ids, train=True)
        table.apply_gradients(ids, rng.normal(size=(ids.size, DIM)).astype(np.float32))


def _sorted_by(state: State, key: str, prefix_keys: list[str]) -> dict[str, np.ndarray]:
    order = np.argsort(state[key], kind="stable")
    return {k: np.asarray(state[k])[order] for k in prefix_keys}


def assert_same_state(got: State, want: State) -> None:
    """Equal as tables: rows matched by id, pending by id, everything else as is."""
    skip = {"delta.version"}
    assert set(got) - skip == set(want) - skip
    row_keys = [k for k in want if k == "ids" or k.startswith(("weights", "opt.", "evict."))]
    # Exact counters: pending ids matched by id; a sketch (the default) compares as is.
    pending = ["admission.ids", "admission.counts"] if "admission.ids" in want else []
    for key, value in _sorted_by(want, "ids", row_keys).items():
        np.testing.assert_array_equal(_sorted_by(got, "ids", row_keys)[key], value, err_msg=key)
    for key, value in (_sorted_by(want, "admission.ids", pending) if pending else {}).items():
        np.testing.assert_array_equal(_sorted_by(got, "admission.ids", pending)[key], value)
    for key in set(want) - set(row_keys) - set(pending) - skip:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def _roundtrip(state: State, path: Path) -> State:
    save_file(state, str(path))  # every array is already safetensors-ready
    return load_file(str(path))


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("shards", [1, 4])
def test_snapshot_plus_deltas_equals_a_full_snapshot(
    policy: str, shards: int, tmp_path: Path
) -> None:
    clock = FakeClock()
    source = EmbeddingTable(_spec(policy, shards), seed=3, name="t", time_fn=clock)
    _train(source, clock, steps=20, seed=1)
    snapshot = _roundtrip(source.state_dict(), tmp_path / "snap.safetensors")

    _train(source, clock, steps=25, seed=2)
    source.remove(np.arange(0, 5, dtype=np.int64))
    clock.now += 100.0  # past ttl_s: everything expires ...
    source.lookup(np.arange(5, 15, dtype=np.int64), train=True)  # ... but these
    assert source.sweep() > 0
    delta1 = _roundtrip(source.delta_state_dict(), tmp_path / "d1.safetensors")
    assert delta1["evicted_ids"].size > 0 and delta1["delta.full"][0] == 0

    _train(source, clock, steps=30, seed=3)
    delta2 = source.delta_state_dict()
    final = source.state_dict()
    stats = source.stats()
    assert stats.evictions > 100 and stats.pending_ids > 0
    if policy == "lfu":
        assert int(final["meta.aging"].max()) > int(snapshot["meta.aging"].max())

    replica = EmbeddingTable(_spec(policy, shards), seed=3, name="t", time_fn=clock)
    replica.load_state_dict(snapshot)
    replica.apply_delta(delta1)
    replica.apply_delta(delta2)
    assert_same_state(replica.state_dict(mark_clean=False), final)
    assert int(final["delta.version"][0]) == int(delta2["delta.version"][0]) + 1

    # The replica is a working table: further training matches the source.
    _train(source, clock, steps=5, seed=4)
    _train(replica, clock, steps=5, seed=4)
    probe = np.arange(-10, 4500, dtype=np.int64)
    np.testing.assert_array_equal(
        replica.lookup(probe, train=False), source.lookup(probe, train=False)
    )


def test_delta_holds_only_what_changed() -> None:
    spec = TableSpec(dim=DIM, initializer=InitializerSpec("uniform", 0.1))
    shard = EmbeddingShard(spec, seed=0, name="t")
    shard.lookup(np.arange(100, dtype=np.int64), train=True)
    shard.state_dict()
    shard.apply_gradients(np.array([3, 4], np.int64), np.ones((2, DIM), np.float32))
    shard.lookup(np.array([7, 1000], np.int64), train=True)  # read + inserted
    shard.remove(np.array([50, 51], np.int64))
    shard.lookup(np.array([50], np.int64), train=True)  # back again: a row, not an eviction
    delta = shard.delta_state_dict()
    # 7 was only read: unchanged, and without eviction a read does not stamp.
    assert sorted(delta["ids"].tolist()) == [3, 4, 50, 1000]
    assert delta["evicted_ids"].tolist() == [51]
    assert shard.delta_state_dict()["ids"].size == 0  # nothing since the last delta


@pytest.mark.parametrize("eviction", [{"capacity_rows": 1000}, {"ttl_steps": 50}])
def test_where_recency_matters_reads_stamp_their_rows(eviction: dict[str, int]) -> None:
    spec = TableSpec(dim=DIM, eviction=EvictionSpec(**eviction))
    shard = EmbeddingShard(spec, seed=0, name="t")
    shard.lookup(np.arange(100, dtype=np.int64), train=True)
    shard.state_dict()
    shard.lookup(np.array([7], np.int64), train=True)  # read: its recency is kept
    assert shard.delta_state_dict()["ids"].tolist() == [7]


def test_deltas_apply_only_in_order_and_only_to_their_own_chain() -> None:
    spec = TableSpec(dim=DIM)
    source, replica = (EmbeddingTable(spec, seed=0, name="t") for _ in range(2))
    source.lookup(np.arange(10, dtype=np.int64), train=True)
    replica.load_state_dict(source.state_dict())
    source.lookup(np.arange(10, 20, dtype=np.int64), train=True)
    d1 = source.delta_state_dict()
    source.lookup(np.arange(20, 30, dtype=np.int64), train=True)
    d2 = source.delta_state_dict()
    with pytest.raises(ValueError, match="applies on top of version"):
        replica.apply_delta(d2)
    stranger = EmbeddingTable(spec, seed=0, name="t")
    with pytest.raises(ValueError, match="checkpoint chain"):
        stranger.apply_delta(d1)
    with pytest.raises(ValueError, match="not a delta"):
        replica.apply_delta(source.state_dict())
    replica.apply_delta(d1)
    replica.apply_delta(d2)
    assert len(replica) == 30


def test_more_evictions_than_capacity_make_the_next_delta_full() -> None:
    spec = replace(
        TableSpec(dim=DIM), shards=2, eviction=EvictionSpec(capacity_rows=2048)
    )  # 1024 rows and at most 1024 logged ids per shard
    source, replica = (EmbeddingTable(spec, seed=0, name="t") for _ in range(2))
    replica.load_state_dict(source.state_dict())
    for start in range(0, 10_000, 500):
        source.lookup(np.arange(start, start + 500, dtype=np.int64), train=True)
    delta = source.delta_state_dict()
    assert delta["delta.full"][0] == 1 and "evicted_ids" not in delta
    replica.apply_delta(delta)
    assert_same_state(replica.state_dict(mark_clean=False), source.state_dict())
    assert source.delta_state_dict()["delta.full"][0] == 0  # back to incremental


def test_deltas_apply_across_a_reshard() -> None:
    clock = FakeClock()
    four = EmbeddingTable(_spec("lru", 4), seed=3, name="t", time_fn=clock)
    _train(four, clock, steps=15, seed=1)
    three = EmbeddingTable(_spec("lru", 3), seed=3, name="t", time_fn=clock)
    three.load_state_dict(four.state_dict())
    _train(four, clock, steps=15, seed=2)
    three.apply_delta(four.delta_state_dict())
    want = four.state_dict(mark_clean=False)
    got = three.state_dict(mark_clean=False)
    # Rows, optimizer state, eviction fields and pending counts follow their ids.
    assert sorted(got["ids"].tolist()) == sorted(want["ids"].tolist())
    probe = np.arange(-10, 2500, dtype=np.int64)
    np.testing.assert_array_equal(
        three.lookup(probe, train=False)[np.isin(probe, want["ids"])],
        four.lookup(probe, train=False)[np.isin(probe, want["ids"])],
    )
    g = _sorted_by(got, "ids", ["ids", "evict.stamp", "evict.touch_s", "opt.exp_avg"])
    w = _sorted_by(want, "ids", ["ids", "evict.stamp", "evict.touch_s", "opt.exp_avg"])
    for key in g:
        np.testing.assert_array_equal(g[key], w[key], err_msg=key)
    assert got["meta.clock"].tolist() == [want["meta.clock"].max()] * 3
