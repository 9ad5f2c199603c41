"""Per-row metadata only where it is needed: tables that do not evict keep no
owner ids and 1-byte touched flags, and still write exact deltas; a sized table
stays within the memory budget of issue #16 (1.1 x its row + 24 B)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from estuary.config.spec import EvictionSpec, SparseOptimizerSpec, TableSpec
from estuary.embedding import EmbeddingShard
from estuary.embedding.storage import GROWTH

SPEC = TableSpec(dim=16, optimizer=SparseOptimizerSpec(name="rowwise_adagrad"))


def test_a_table_that_does_not_evict_keeps_no_owner_and_byte_flags() -> None:
    plain = EmbeddingShard(SPEC, seed=0, name="t")
    bounded = EmbeddingShard(replace(SPEC, eviction=EvictionSpec(capacity_rows=100)), 0, "t")
    assert plain._storage.owner.size == 0 and plain._storage.stamp.dtype == np.uint8
    assert bounded._storage.owner.size > 0 and bounded._storage.stamp.dtype == np.int64


def test_deltas_of_a_table_without_owners_hold_exactly_the_touched_rows() -> None:
    shard = EmbeddingShard(SPEC, seed=0, name="t")
    shard.lookup(np.arange(100, dtype=np.int64), train=True)
    replica = EmbeddingShard(SPEC, seed=0, name="t")
    replica.load_state_dict(shard.state_dict())
    touched = np.array([3, 50, 99, 7], np.int64)
    shard.apply_gradients(touched, np.ones((4, 16), np.float32))
    shard.lookup(np.array([500, 501], np.int64), train=True)  # inserts count too
    shard.lookup(np.arange(20, dtype=np.int64), train=False)  # reads do not
    delta = shard.delta_state_dict()
    assert sorted(delta["ids"].tolist()) == [3, 7, 50, 99, 500, 501]
    assert "evict.stamp" not in delta  # no clock stamps kept, none written
    replica.apply_delta(delta)
    probe = np.arange(-5, 600, dtype=np.int64)
    np.testing.assert_array_equal(
        replica.lookup(probe, train=False), shard.lookup(probe, train=False)
    )
    assert shard.delta_state_dict()["ids"].size == 0  # the mark cleared the flags


@pytest.mark.parametrize(("optimizer", "dtype"), [("rowwise_adagrad", "bf16"), ("adagrad", "fp32")])
def test_a_sized_table_stays_within_the_memory_budget(optimizer: str, dtype: str) -> None:
    rows = 200_000
    spec = replace(
        SPEC,
        optimizer=SparseOptimizerSpec(name=optimizer),
        dtype=dtype,  # type: ignore[arg-type]
        initial_capacity_rows=rows,
    )
    shard = EmbeddingShard(spec, seed=0, name="t")
    ids = np.random.default_rng(0).integers(-(2**62), 2**62, rows)
    shard.lookup(ids, train=True)
    opt = shard._optimizer
    ideal = 16 * (2 if dtype == "bf16" else 4) + 4 * (opt.width - 16)
    assert shard.stats().bytes / len(shard) <= 1.1 * ideal + 24


def test_rows_grow_by_a_quarter_not_by_doubling() -> None:
    shard = EmbeddingShard(replace(SPEC, initial_capacity_rows=1000), seed=0, name="t")
    shard.lookup(np.arange(1001, dtype=np.int64), train=True)  # 1002 rows with the unknown row
    assert shard._storage.capacity_rows == int(1001 * GROWTH)
