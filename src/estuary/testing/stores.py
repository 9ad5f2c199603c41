"""One conformance suite for ``EmbeddingStore``: every store runs it.

A store's tests subclass ``StoreConformance`` (the API every store has: lookups,
gradients, removal, state dicts and deltas) or ``InProcessStoreConformance``
(also ``lookup(out=...)``, capacity, TTL sweeps and admission counts), and give
a ``make`` fixture: a factory from a ``TableSpec`` to a fresh store::

    from estuary.testing.stores import StoreConformance

    class TestMyStore(StoreConformance):
        @pytest.fixture
        def make(self):
            return lambda spec: MyStore(spec, seed=5, name="t")
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

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
from estuary.embedding import EmbeddingStore

__all__ = [
    "BASE_SPEC",
    "DIM",
    "ODD_IDS",
    "Factory",
    "InProcessStoreConformance",
    "StoreConformance",
]

DIM = 8
I64 = np.iinfo(np.int64)
ODD_IDS = np.array([0, -1, 1, I64.min, I64.max, 42, -(2**50)], np.int64)


BASE_SPEC = TableSpec(
    dim=DIM,
    initializer=InitializerSpec("uniform", 0.1),
    optimizer=SparseOptimizerSpec(name="adam", lr=0.01),
    initial_capacity_rows=4,
)

Factory = Callable[[TableSpec], Any]
"""A fresh store for a ``TableSpec`` (an ``EmbeddingStore`` with state dicts and deltas)."""


def _store(make: Factory, **changes: Any) -> Any:
    store = make(replace(BASE_SPEC, **changes))
    _typed: EmbeddingStore = store  # the store satisfies the protocol
    return store


def _train(store: Any, steps: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = np.unique(rng.integers(-50, 50, size=40)).astype(np.int64)
        store.lookup(ids, train=True)
        store.apply_gradients(ids, rng.normal(size=(ids.size, DIM)).astype(np.float32))


class StoreConformance:
    """The API every store has; a subclass provides the ``make`` fixture.

    ``weight_atol``: how far a weight may be from its exact float32 value after
    an update (0 for float32 rows; a 16-bit table's rounding step otherwise).
    Comparisons of two stores trained alike stay exact in every dtype.
    """

    weight_atol: ClassVar[float] = 0.0

    def test_eval_lookup_never_inserts_and_reads_the_unknown_row(self, make: Factory) -> None:
        store = _store(make)
        store.lookup(ODD_IDS[:3], train=True)
        rows = store.lookup(np.array([99, 100, 0], np.int64), train=False)
        assert len(store) == 3
        assert not rows[:2].any()  # unknown row: zeros
        np.testing.assert_array_equal(rows[2], store.lookup(ODD_IDS[:1], train=False)[0])
        stats = store.stats()
        assert (stats.rows, stats.lookups, stats.hits, stats.admissions) == (3, 7, 2, 3)

    def test_lookup_returns_fresh_float32_arrays(self, make: Factory) -> None:
        store = _store(make)
        rows = store.lookup(ODD_IDS, train=True)
        assert rows.dtype == np.float32 and rows.shape == (ODD_IDS.size, DIM)
        assert rows.flags.c_contiguous and rows.flags.owndata
        before = rows.copy()
        rows[:] = 123.0
        np.testing.assert_array_equal(store.lookup(ODD_IDS, train=True), before)

    def test_rows_survive_storage_growth(self, make: Factory) -> None:
        store = _store(make)  # 4 rows pre-allocated
        first = store.lookup(ODD_IDS, train=True)
        store.lookup(np.arange(10_000, 30_000, dtype=np.int64), train=True)
        assert len(store) == ODD_IDS.size + 20_000
        np.testing.assert_array_equal(store.lookup(ODD_IDS, train=False), first)

    def test_apply_gradients_moves_only_the_given_rows(self, make: Factory) -> None:
        store = _store(make, optimizer=SparseOptimizerSpec(name="sgd", lr=0.5))
        before = store.lookup(ODD_IDS, train=True)
        grads = np.ones((3, DIM), np.float32)
        store.apply_gradients(ODD_IDS[[4, 0, 2]], grads)
        after = store.lookup(ODD_IDS, train=False)
        moved = before[[4, 0, 2]] - 0.5
        np.testing.assert_allclose(after[[4, 0, 2]], moved, atol=self.weight_atol)
        np.testing.assert_array_equal(
            np.delete(after, [4, 0, 2], axis=0), np.delete(before, [4, 0, 2], axis=0)
        )
        with pytest.raises(ValueError, match="grads must have shape"):
            store.apply_gradients(ODD_IDS[:2], np.ones((2, DIM + 1), np.float32))

    @pytest.mark.parametrize("name", ["sgd", "adagrad", "adam", "ftrl"])
    def test_lr_scale_takes_the_step_of_the_optimizer_at_that_learning_rate(
        self, make: Factory, name: str
    ) -> None:
        # After a few plain steps (optimizer state not trivial), a step at
        # lr_scale 0.3 equals, bit for bit, the same step of a store whose
        # optimizer was configured with lr * 0.3 (weight decay included).
        def spec(lr: float) -> SparseOptimizerSpec:
            return SparseOptimizerSpec(name=name, lr=lr, weight_decay=0.5)

        lr, scale = 0.05, 0.3
        scaled, reference = (
            _store(make, optimizer=spec(lr)),
            _store(make, optimizer=spec(lr * scale)),
        )
        _train(scaled, steps=3, seed=0)
        reference.load_state_dict(scaled.state_dict())
        ids = np.arange(-50, 50, 3, dtype=np.int64)
        grads = np.random.default_rng(1).normal(size=(ids.size, DIM)).astype(np.float32)
        before = scaled.lookup(ids, train=True)
        reference.lookup(ids, train=True)
        scaled.apply_gradients(ids, grads, lr_scale=scale)
        reference.apply_gradients(ids, grads)
        after = scaled.lookup(ids, train=False)
        np.testing.assert_array_equal(after, reference.lookup(ids, train=False))
        assert not np.array_equal(after, before)
        # The optimizer state (accumulators, moments, step counts) moved alike too.
        got, want = scaled.state_dict(), reference.state_dict()
        by_id = np.argsort(got["ids"]), np.argsort(want["ids"])  # shards may order rows apart
        for key in [k for k in want if k == "weights" or k.startswith("opt.")]:
            np.testing.assert_array_equal(got[key][by_id[0]], want[key][by_id[1]], err_msg=key)
        for key in [k for k in want if k.startswith("unknown.")]:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)

    def test_removed_ids_read_the_unknown_row_and_count_as_evictions(self, make: Factory) -> None:
        store = _store(make)
        store.lookup(ODD_IDS, train=True)
        assert store.remove(ODD_IDS[:3]) == 3
        assert not store.lookup(ODD_IDS[:3], train=False).any()
        assert len(store) == ODD_IDS.size - 3 and store.stats().evictions == 3

    def test_state_dict_round_trip_through_safetensors(self, make: Factory, tmp_path: Path) -> None:
        kw = {"admission": AdmissionSpec(min_count=2)}
        store = _store(make, **kw)
        _train(store, steps=6, seed=0)
        state = store.state_dict()
        assert state["admission.sketch.words"].any()  # some ids still pending
        assert state["unknown.weights"].any()  # unknown row was trained
        path = f"{tmp_path}/table.safetensors"
        save_file(state, path)  # arrays are already contiguous and safetensors-typed
        restored = _store(make, **kw)
        restored.load_state_dict(load_file(path))
        probe = np.arange(-60, 60, dtype=np.int64)
        np.testing.assert_array_equal(
            restored.lookup(probe, train=False), store.lookup(probe, train=False)
        )
        assert len(restored) == len(store)
        assert restored.stats().pending_ids == store.stats().pending_ids
        # Optimizer state and pending counts came back too: training continues identically.
        _train(store, steps=3, seed=1)
        _train(restored, steps=3, seed=1)
        np.testing.assert_array_equal(
            restored.lookup(probe, train=False), store.lookup(probe, train=False)
        )
        assert len(restored) == len(store)

    def test_snapshot_and_delta_restore_the_same_store(self, make: Factory) -> None:
        kw = {
            "admission": AdmissionSpec(min_count=2),
            "eviction": EvictionSpec(capacity_rows=60, policy="lfu"),
        }
        store, replica = _store(make, **kw), _store(make, **kw)
        _train(store, steps=6, seed=0)
        replica.load_state_dict(store.state_dict())
        _train(store, steps=6, seed=1)
        store.remove(np.arange(-50, -40, dtype=np.int64))
        replica.apply_delta(store.delta_state_dict())
        probe = np.arange(-60, 60, dtype=np.int64)
        np.testing.assert_array_equal(
            replica.lookup(probe, train=False), store.lookup(probe, train=False)
        )
        assert len(replica) == len(store)
        assert replica.stats().pending_ids == store.stats().pending_ids


class InProcessStoreConformance(StoreConformance):
    """Stores in this process: also ``lookup(out=...)``, capacity, TTL sweeps and
    admission counts."""

    def test_lookup_into_out_writes_the_same_rows_as_a_fresh_array(self, make: Factory) -> None:
        # Two stores with the same seed: one allocates, one writes into a reused
        # buffer (a row slice of a bigger one), through inserts, duplicates and misses.
        fresh, reused = _store(make), _store(make)
        buffer = np.full((3 * ODD_IDS.size, DIM), np.nan, np.float32)
        dup_new = np.array([7, 7, 8, 7, 8], np.int64)  # new ids, repeated in one batch
        calls = [
            (ODD_IDS, True),
            (dup_new, True),
            (np.concatenate([ODD_IDS, [1234, -99]]), False),  # two ids without a row
            (np.concatenate([ODD_IDS[::-1], dup_new, [555]]), True),
        ]
        for ids, train in calls:
            out = buffer[2 : 2 + ids.size]
            got = reused.lookup(ids, train=train, out=out)
            assert got is out
            np.testing.assert_array_equal(got, fresh.lookup(ids, train=train))
        assert np.isnan(buffer[:2]).all()  # nothing written outside ``out``
        assert fresh.stats() == reused.stats()

    @pytest.mark.parametrize(
        ("bad", "why"),
        [
            (np.zeros((ODD_IDS.size, DIM), np.float64), "float64"),
            (np.zeros((ODD_IDS.size + 1, DIM), np.float32), rf"\({ODD_IDS.size + 1}, {DIM}\)"),
            (np.zeros((ODD_IDS.size, 2 * DIM), np.float32)[:, :DIM], "c_contiguous=False"),
            (np.zeros((ODD_IDS.size, DIM), np.float32).T.copy().T, "c_contiguous=False"),
            (np.broadcast_to(np.float32(0), (ODD_IDS.size, DIM)), "writeable=False"),
            ([[0.0] * DIM] * ODD_IDS.size, "list"),
        ],
    )
    def test_lookup_rejects_an_out_it_cannot_write_into(
        self, make: Factory, bad: object, why: str
    ) -> None:
        store = _store(make)
        with pytest.raises(ValueError, match=rf"shape \({ODD_IDS.size}, {DIM}\), got .*{why}"):
            store.lookup(ODD_IDS, train=True, out=bad)
        assert len(store) == 0  # checked before anything is inserted

    def test_capacity_bounds_rows_and_stats_add_up(self, make: Factory) -> None:
        store = _store(make, eviction=EvictionSpec(capacity_rows=40))
        rng = np.random.default_rng(0)
        for step in range(20):
            ids = np.concatenate([np.arange(step * 20, step * 20 + 20), rng.integers(0, 10, 5)])
            ids = np.unique(ids).astype(np.int64)
            store.lookup(ids, train=True)
            store.apply_gradients(ids, np.ones((ids.size, DIM), np.float32))
            assert len(store) <= 40
        stats = store.stats()
        assert stats.rows == len(store) and stats.evictions > 300
        assert stats.admissions - stats.evictions == stats.rows
        assert 0.0 < stats.hit_rate < 1.0 and stats.bytes > 0

    def test_sweep_applies_the_ttl_and_counts_evictions(self, make: Factory) -> None:
        store = _store(make, eviction=EvictionSpec(ttl_steps=2, sweep_every_steps=1000))
        store.lookup(ODD_IDS, train=True)
        for _ in range(2):
            store.advance_step()
        assert store.sweep() == 0  # idle for 1 step only
        store.advance_step()
        assert store.sweep() == ODD_IDS.size and len(store) == 0
        assert store.stats().evictions == ODD_IDS.size

    def test_pending_ids_are_counted_until_admitted(self, make: Factory) -> None:
        # Exact counts (the sketch's pending_ids is an estimate that keeps admitted ids).
        store = _store(make, admission=AdmissionSpec(min_count=2, counter="exact"))
        store.lookup(ODD_IDS, train=True)
        assert (store.stats().pending_ids, len(store)) == (ODD_IDS.size, 0)
        store.lookup(ODD_IDS[:3], train=True)
        assert (store.stats().pending_ids, len(store)) == (ODD_IDS.size - 3, 3)
