"""Admission: frequency filter, probability coin, and the shared unknown row."""

from __future__ import annotations

from typing import Literal

import numpy as np
import pytest

from estuary.config.spec import AdmissionSpec, InitializerSpec, SparseOptimizerSpec, TableSpec
from estuary.embedding import AdmissionFilter, EmbeddingShard, EmbeddingTable

DIM = 4


def _shard(
    min_count: int = 1,
    probability: float = 1.0,
    max_pending_ids: int = 1 << 20,
    counter: Literal["exact", "sketch"] = "exact",
) -> EmbeddingShard:
    spec = TableSpec(
        dim=DIM,
        initializer=InitializerSpec("uniform", 0.5),
        optimizer=SparseOptimizerSpec(name="sgd", lr=1.0),
        admission=AdmissionSpec(min_count=min_count, probability=probability, counter=counter),
    )
    return EmbeddingShard(spec, seed=0, name="t", max_pending_ids=max_pending_ids)


def test_min_count_two_first_sight_reads_unknown_row_second_gets_own_row() -> None:
    shard = _shard(min_count=2)
    ids = np.array([10, 20], np.int64)
    first = shard.lookup(ids, train=True)
    assert not first.any()  # the unknown row starts at zeros
    assert len(shard) == 0
    assert shard.stats().pending_ids == 2
    second = shard.lookup(ids, train=True)
    assert (second != 0).all()
    assert len(shard) == 2
    stats = shard.stats()
    assert (stats.admissions, stats.pending_ids, stats.lookups, stats.hits) == (2, 0, 4, 0)
    np.testing.assert_array_equal(shard.lookup(ids, train=True), second)
    assert shard.stats().hits == 2


@pytest.mark.parametrize("counter", ["exact", "sketch"])
def test_repeats_within_one_batch_count_and_all_copies_get_the_row(
    counter: Literal["exact", "sketch"],
) -> None:
    shard = _shard(min_count=2, counter=counter)
    rows = shard.lookup(np.array([7, 8, 7], np.int64), train=True)
    assert len(shard) == 1
    assert (rows[0] != 0).all() and not rows[1].any()
    np.testing.assert_array_equal(rows[0], rows[2])


@pytest.mark.parametrize("counter", ["exact", "sketch"])
def test_eval_lookups_neither_insert_nor_count_towards_admission(
    counter: Literal["exact", "sketch"],
) -> None:
    shard = _shard(min_count=2, counter=counter)
    ids = np.array([1, 2, 3], np.int64)
    for _ in range(3):
        assert not shard.lookup(ids, train=False).any()
    assert len(shard) == 0 and shard.stats().pending_ids == 0
    shard.lookup(ids, train=True)
    assert len(shard) == 0  # the first *training* sighting


@pytest.mark.parametrize("counter", ["exact", "sketch"])
def test_gradients_of_non_admitted_ids_train_the_unknown_row_and_are_counted(
    counter: Literal["exact", "sketch"],
) -> None:
    shard = _shard(min_count=3, counter=counter)
    admitted = np.array([100], np.int64)
    for _ in range(3):
        shard.lookup(admitted, train=True)
    own_before = shard.lookup(admitted, train=False)
    pending = np.array([1, 2], np.int64)
    shard.lookup(pending, train=True)
    ids = np.array([1, 100, 2], np.int64)
    grads = np.array([[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 2, 0]], np.float32)
    shard.apply_gradients(ids, grads)
    assert shard.stats().unknown_grads == 2
    unknown = -(grads[0] + grads[2])  # sgd, lr 1, one step of the summed gradient
    never_seen = np.array([555], np.int64)
    np.testing.assert_array_equal(shard.lookup(never_seen, train=False)[0], unknown)
    np.testing.assert_array_equal(shard.lookup(pending, train=True), [unknown, unknown])
    np.testing.assert_allclose(shard.lookup(admitted, train=False), own_before - grads[1])


@pytest.mark.parametrize("counter", ["exact", "sketch"])
def test_probability_admits_about_that_fraction_reproducibly(
    counter: Literal["exact", "sketch"],
) -> None:
    ids = np.arange(20_000, dtype=np.int64)
    a = _shard(probability=0.25, counter=counter)
    a.lookup(ids, train=True)
    assert len(a) == pytest.approx(5_000, abs=300)  # ~5 sigma of Binomial(20k, 0.25)
    b = _shard(probability=0.25, counter=counter)
    b.lookup(ids[::-1], train=True)  # same seed, other order: same decisions
    np.testing.assert_array_equal(a.lookup(ids, train=False) != 0, b.lookup(ids, train=False) != 0)
    for _ in range(30):  # each sighting flips a fresh coin
        a.lookup(ids[:1000], train=True)
    assert np.count_nonzero(a.lookup(ids[:1000], train=False).any(axis=1)) == 1000


def test_pending_counts_stay_within_their_memory_bound() -> None:
    bound = 64
    shard = _shard(min_count=4, max_pending_ids=bound)
    filt_bytes_cap = 92 * 16  # 64 / 0.7 entries of 16 B
    hot = np.array([-1], np.int64)
    rng = np.random.default_rng(0)
    for _ in range(100):
        cold = rng.integers(1, 2**40, size=20, dtype=np.int64)  # each seen once
        shard.lookup(np.concatenate([hot, cold]), train=True)
        assert shard.stats().pending_ids <= bound
    assert shard._admission.nbytes <= filt_bytes_cap
    assert shard._admission.aged > 0
    assert len(shard) == 1  # the hot id got through; the cold ones did not
    assert (shard.lookup(hot, train=False) != 0).all()


def test_filter_state_round_trip_keeps_counts() -> None:
    spec = AdmissionSpec(min_count=3)
    filt = AdmissionFilter(spec, seed=1)
    filt.observe(np.array([1, 2, 2, 3, 3], np.int64))
    restored = AdmissionFilter(spec, seed=1)
    restored.load_state_dict(filt.state_dict())
    assert len(restored) == 3
    np.testing.assert_array_equal(restored.observe(np.array([1, 2, 3, 3], np.int64)), [2, 3])


def test_admission_counting_off_keeps_unadmitted_ids_on_the_unknown_row() -> None:
    table = EmbeddingTable(TableSpec(dim=2, admission=AdmissionSpec(min_count=2)), seed=0, name="t")
    once, twice = np.array([1], np.int64), np.array([2], np.int64)
    table.lookup(np.concatenate([once, twice]), train=True)
    table.lookup(twice, train=True)  # second sighting: admitted
    assert len(table) == 1
    table.set_admission_counting(False)  # epoch 2 re-reads the same rows
    table.lookup(once, train=True)
    table.lookup(once, train=True)
    assert len(table) == 1  # a once-seen id does not earn a row by re-reading
    table.set_admission_counting(True)
    table.lookup(once, train=True)
    assert len(table) == 2


@pytest.mark.parametrize("counter", ["exact", "sketch"])
def test_a_raised_min_count_admits_only_ids_seen_that_often_from_then_on(counter: str) -> None:
    """``raise_admission`` (the scaling manager's memory rule): never lowered,
    at most what the counter counts to (a 2-bit sketch: 4); a table admitting
    every id has nothing to raise."""
    spec = TableSpec(dim=2, admission=AdmissionSpec(min_count=2, counter=counter))
    table = EmbeddingTable(spec, seed=0, name="t")
    assert table.admission_min_count == 2
    assert table.raise_admission(1) == 2  # never lowered
    want = 3 if counter == "exact" else 2  # a min_count-2 sketch has 1-bit counters: 2 at most
    assert table.raise_admission(3) == want and table.admission_min_count == want
    ids = np.array([7], np.int64)
    for _ in range(want - 1):
        table.lookup(ids, train=True)
        assert len(table) == 0
    table.lookup(ids, train=True)
    assert len(table) == 1
    plain = EmbeddingTable(TableSpec(dim=2), seed=0, name="p")
    assert plain.admission_min_count is None and plain.raise_admission(4) is None


def test_a_sketch_counts_a_raised_min_count_only_as_far_as_its_counters_go() -> None:
    spec = TableSpec(dim=2, admission=AdmissionSpec(min_count=3, counter="sketch"))
    table = EmbeddingTable(spec, seed=0, name="t")
    assert table.raise_admission(100) == 4  # 2-bit counters
