"""EmbeddingShard.lookup(train=True) when every id gets a row (one probe pass that
inserts and touches, new rows initialised, one gather pass): what it touches and
what each copy of an id reads."""

from __future__ import annotations

import numpy as np

from estuary.config.spec import EvictionSpec, InitializerSpec, SparseOptimizerSpec, TableSpec
from estuary.embedding import EmbeddingShard

DIM = 4
SPEC = TableSpec(
    dim=DIM,
    initializer=InitializerSpec("uniform", 0.5),
    optimizer=SparseOptimizerSpec(name="adagrad", lr=0.1),
    eviction=EvictionSpec(policy="lfu", ttl_s=1e6),  # keep freq and touch_s too
    initial_capacity_rows=2,  # grows inside the first calls
)


def _ids(*values: int) -> np.ndarray:
    return np.array(values, np.int64)


def _meta(shard: EmbeddingShard, ids: np.ndarray) -> tuple[list[int], list[int], list[float]]:
    """(stamp, freq, touch_s) of each id's slot."""
    slots = shard._index.lookup(ids)
    s = shard._storage
    return s.stamp[slots].tolist(), s.freq[slots].tolist(), s.touch_s[slots].tolist()


def test_touches_every_copy_of_a_known_id_and_claims_a_new_one_once() -> None:
    clock = iter([10.0, 20.0])
    shard = EmbeddingShard(SPEC, seed=0, name="t", time_fn=lambda: next(clock))
    shard.lookup(_ids(1, 2), train=True)
    first = shard._clock.value
    # 1 twice (known), 3 three times (new in this call), 2 absent from the call.
    shard.lookup(_ids(1, 3, 1, 3, 3), train=True)
    now = shard._clock.value
    stamps, freqs, times = _meta(shard, _ids(1, 2, 3))
    assert stamps == [now, first, now]
    assert freqs == [3, 1, 1]  # one per touch; a new row starts at 1
    assert times == [20.0, 10.0, 20.0]


def test_every_copy_of_a_new_id_reads_its_initial_row() -> None:
    shard = EmbeddingShard(SPEC, seed=0, name="t")
    ids = _ids(7, 8, 7, 9, 8, 7)
    rows = shard.lookup(ids, train=True)
    alone = EmbeddingShard(SPEC, seed=0, name="t").lookup(_ids(7, 8, 9), train=True)
    np.testing.assert_array_equal(rows, alone[[0, 1, 0, 2, 1, 0]])
    assert shard.stats().admissions == 3 and shard.stats().hits == 3


def test_a_reused_slot_is_reinitialised_before_it_is_read() -> None:
    shard = EmbeddingShard(SPEC, seed=0, name="t")
    shard.lookup(_ids(1, 2, 3), train=True)
    shard.apply_gradients(_ids(2), np.ones((1, DIM), np.float32))
    assert shard.remove(_ids(2)) == 1
    # 4 takes 2's freed slot: it must read 4's initial row, not 2's trained one.
    rows = shard.lookup(_ids(4, 1, 4), train=True)
    fresh = EmbeddingShard(SPEC, seed=0, name="t").lookup(_ids(4), train=True)[0]
    np.testing.assert_array_equal(rows[[0, 2]], [fresh, fresh])
    assert _meta(shard, _ids(4))[1] == [1]
