"""HashIndex: every int64 is a key, mappings survive growth, collisions, removal."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from estuary.embedding.hash_index import GROWTH, MAX_LOAD, HashIndex, Touch
from estuary.embedding.hashing import id_hash

I64 = np.iinfo(np.int64)


def _np_mix64(keys: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer in numpy (uint64 wraps), to craft colliding keys."""
    z = keys.view(np.uint64).copy()
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def test_numpy_mixer_matches_kernel_hash() -> None:
    keys = np.array([0, 1, -1, I64.min, I64.max, 123456789], np.int64)
    assert [int(id_hash(k)) for k in keys] == [int(h) for h in _np_mix64(keys)]


def test_growth_across_many_rehashes_keeps_every_mapping() -> None:
    rng = np.random.default_rng(0)
    index = HashIndex(capacity_ids=1)
    start_capacity = index.capacity
    expected: dict[int, int] = {}
    for size in [1, 2, 3, 10, 100, 1000, 10_000, 50_000]:
        batch = rng.integers(I64.min, I64.max, size=size, dtype=np.int64, endpoint=True)
        slots = index.get_or_insert(batch)
        for key, slot in zip(batch.tolist(), slots.tolist(), strict=True):
            assert expected.setdefault(key, slot) == slot
        keys = np.fromiter(expected, np.int64)
        want = np.fromiter(expected.values(), np.int64)
        np.testing.assert_array_equal(index.lookup(keys), want)
    assert index.capacity >= start_capacity * 1000  # grew through many rehashes
    assert len(index) == len(expected)
    # Slots are dense: 0..n-1, each used once.
    np.testing.assert_array_equal(np.sort(index.slots()), np.arange(len(expected)))


def test_extreme_and_negative_ids_are_ordinary_keys() -> None:
    ids = np.array([0, -1, 1, I64.min, I64.max, I64.min + 1, I64.max - 1, -(2**40)], np.int64)
    index = HashIndex(capacity_ids=2)
    slots, is_new = index.get_or_insert_mask(ids)
    assert is_new.all()
    np.testing.assert_array_equal(slots, np.arange(ids.size))
    np.testing.assert_array_equal(index.lookup(ids), slots)
    np.testing.assert_array_equal(index.get_or_insert(ids[::-1]), slots[::-1])
    keys, got_slots = index.items()
    assert dict(zip(keys.tolist(), got_slots.tolist(), strict=True)) == dict(
        zip(ids.tolist(), slots.tolist(), strict=True)
    )


def test_duplicates_in_one_batch_share_a_slot() -> None:
    index = HashIndex()
    slots, is_new = index.get_or_insert_mask(np.array([7, -7, 7, 7, -7], np.int64))
    np.testing.assert_array_equal(slots, [0, 1, 0, 0, 1])
    np.testing.assert_array_equal(is_new, [True, True, False, False, False])
    assert len(index) == 2


def test_get_or_insert_new_reports_first_occurrences_it_inserted() -> None:
    index = HashIndex()
    index.get_or_insert(np.array([5], np.int64))
    slots, new_at = index.get_or_insert_new(np.array([9, 5, 9, -3, 5], np.int64))
    np.testing.assert_array_equal(new_at, [0, 3])
    np.testing.assert_array_equal(slots, [1, 0, 1, 2, 0])


def test_lookup_and_insert_touch_only_ids_they_find() -> None:
    index = HashIndex()
    index.get_or_insert(np.arange(3, dtype=np.int64))
    stamp, freq = np.zeros(3, np.int64), np.zeros(3, np.int32)
    touch = Touch(stamp, freq, np.empty(0, np.float64), now=7, now_s=0.0)
    index.lookup(np.array([2, 99, 2], np.int64), touch)
    np.testing.assert_array_equal(stamp, [0, 0, 7])
    np.testing.assert_array_equal(freq, [0, 0, 2])
    slots, _ = index.get_or_insert_new(np.array([0, 50, 50], np.int64), touch._replace(now=8))
    np.testing.assert_array_equal(stamp, [8, 0, 7])  # slot 3 (new id 50) lies past the arrays
    assert slots.tolist() == [0, 3, 3]


def test_lookup_never_inserts() -> None:
    index = HashIndex()
    index.get_or_insert(np.array([1, 2, 3], np.int64))
    np.testing.assert_array_equal(index.lookup(np.array([4, 2, -1, 0], np.int64)), [-1, 1, -1, -1])
    assert len(index) == 3


def _colliding_keys(entries: int, home: int, count: int) -> np.ndarray:
    """``count`` keys whose probe starts at bucket ``home`` in a table of ``entries``."""
    rng = np.random.default_rng(1)
    found: list[np.ndarray] = []
    while sum(f.size for f in found) < count:
        cand = rng.integers(I64.min, I64.max, size=1 << 20, dtype=np.int64)
        homes = ((_np_mix64(cand) >> np.uint64(32)) * np.uint64(entries)) >> np.uint64(32)
        found.append(cand[homes == np.uint64(home)])  # hash_index.home_of
    return np.unique(np.concatenate(found))[:count]


def test_one_long_probe_chain_that_wraps_survives_removal_from_its_middle() -> None:
    index = HashIndex(capacity_ids=300)
    entries = index.capacity
    # 150 keys homed at the last bucket: the chain wraps to the front of the table.
    keys = _colliding_keys(entries, entries - 1, 150)
    # Interleave keys homed at bucket 3, which the wrapped chain runs through.
    others = _colliding_keys(entries, 3, 20)
    slots = index.get_or_insert(np.concatenate([keys, others]))
    assert index.capacity == entries  # no growth: the chain really is one run
    table_keys = index.keys()
    assert table_keys.size == 170
    gone = np.concatenate([keys[10:60], others[::3]])
    np.testing.assert_array_equal(
        index.remove(gone), np.concatenate([slots[10:60], slots[150:][::3]])
    )
    kept = np.setdiff1d(np.concatenate([keys, others]), gone)
    want = dict(zip(np.concatenate([keys, others]).tolist(), slots.tolist(), strict=True))
    np.testing.assert_array_equal(index.lookup(kept), [want[k] for k in kept.tolist()])
    np.testing.assert_array_equal(index.lookup(gone), np.full(gone.size, -1))
    assert len(index) == kept.size


def test_removed_slots_are_reused_and_absent_ids_report_minus_one() -> None:
    index = HashIndex()
    slots = index.get_or_insert(np.arange(10, dtype=np.int64))
    np.testing.assert_array_equal(index.remove(np.array([3, 3, 99], np.int64)), [3, -1, -1])
    new_slots, is_new = index.get_or_insert_mask(np.array([100, 101], np.int64))
    assert is_new.all()
    assert new_slots[0] == slots[3]  # freed slot handed out first
    assert new_slots[1] == 10
    assert index.slot_end == 11


def test_first_slot_offsets_every_slot() -> None:
    index = HashIndex(first_slot=1)
    np.testing.assert_array_equal(index.get_or_insert(np.array([5, 6], np.int64)), [1, 2])
    assert index.slot_end == 3


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["insert", "remove", "lookup"]),
            st.lists(st.integers(-40, 40), max_size=30),
        ),
        max_size=25,
    )
)
def test_behaves_like_a_dict_under_random_churn(ops: list[tuple[str, list[int]]]) -> None:
    # A small key range and a tiny start capacity force collisions, growth and
    # backward-shift deletions in the same run.
    index = HashIndex(capacity_ids=1)
    model: dict[int, int] = {}
    for op, keys in ops:
        arr = np.array(keys, np.int64) * 1_000_003  # spread, still collide often
        if op == "insert":
            for key, slot in zip(arr.tolist(), index.get_or_insert(arr).tolist(), strict=True):
                assert model.setdefault(key, slot) == slot
        elif op == "remove":
            got = index.remove(arr).tolist()
            for key, slot in zip(arr.tolist(), got, strict=True):
                assert model.pop(key, -1) == slot
        else:
            assert index.lookup(arr).tolist() == [model.get(k, -1) for k in arr.tolist()]
        assert len(index) == len(model)
        assert len(set(model.values())) == len(model)  # no two keys share a slot
    held, slots = index.items()
    assert dict(zip(held.tolist(), slots.tolist(), strict=True)) == model


def test_a_sized_index_is_not_rounded_up_to_a_power_of_two() -> None:
    # 1M ids at the default max_load 0.75: 1.33M entries (21 B per id), not 2**21 (34 B).
    index = HashIndex(capacity_ids=1_000_000)
    ids = np.random.default_rng(1).integers(I64.min, I64.max, 1_000_000, dtype=np.int64)
    slots = index.get_or_insert(ids)
    assert index.capacity == int(1_000_000 / MAX_LOAD) + 1
    assert index.nbytes / len(index) < 23
    np.testing.assert_array_equal(index.lookup(ids), slots)


def test_growth_keeps_the_load_between_max_load_over_growth_and_max_load() -> None:
    index = HashIndex(capacity_ids=100)
    rng = np.random.default_rng(2)
    loads = []
    for _ in range(60):
        index.get_or_insert(rng.integers(I64.min, I64.max, 500, dtype=np.int64))
        loads.append(len(index) / index.capacity)
    assert min(loads[5:]) >= MAX_LOAD / GROWTH - 0.01 and max(loads) <= MAX_LOAD
