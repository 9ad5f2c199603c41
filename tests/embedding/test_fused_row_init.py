"""New rows initialised in one fused pass (weights, optimizer state, claim) give
the same rows, tables, metadata and stats as the three passes they replace
(``Initializer.fill``, ``SparseOptimizer.init_state``, ``RowStorage.claim``)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from estuary.config.spec import (
    AdmissionSpec,
    EvictionSpec,
    InitializerName,
    InitializerSpec,
    OptimizerName,
    SparseOptimizerSpec,
    TableSpec,
)
from estuary.embedding import EmbeddingShard, Initializer, make_initializer
from estuary.embedding import shard as shard_module
from estuary.embedding.types import Float32Array, Int64Array

MASK = (1 << 64) - 1


def _spec(dim: int, init: InitializerName, opt: OptimizerName) -> TableSpec:
    return TableSpec(
        dim=dim,
        initializer=InitializerSpec(init, 0.3),
        optimizer=SparseOptimizerSpec(name=opt, lr=0.1, initial_accumulator=0.25),
        eviction=EvictionSpec(policy="lfu", ttl_s=1e6),  # keep freq and touch_s too
        initial_capacity_rows=2,  # storage and index grow inside the calls
    )


def _shard(spec: TableSpec, seed: int) -> EmbeddingShard:
    clock = iter(range(1, 1 << 30))  # one tick per call that reads the time
    return EmbeddingShard(spec, seed=seed, name="t", time_fn=lambda: float(next(clock)))


def _three_pass(shard: EmbeddingShard) -> EmbeddingShard:
    shard._fused_init = False
    return shard


def _workload(shard: EmbeddingShard, seed: int) -> list[np.ndarray]:
    """Lookups with repeats, new ids, growth, removals (freed slots reused) and updates."""
    rng = np.random.default_rng(seed)
    outs = []
    known = np.empty(0, np.int64)
    for step in range(12):
        fresh = rng.integers(-(2**63), 2**63 - 1, int(rng.integers(1, 300)), dtype=np.int64)
        old = rng.choice(known, min(known.size, 200)) if known.size else known
        ids = rng.permutation(np.concatenate([fresh, old, fresh[:5], old[:7]]))
        outs.append(shard.lookup(ids, train=True))
        known = np.concatenate([known, fresh])
        uniq = np.unique(ids)
        shard.apply_gradients(uniq, rng.normal(size=(uniq.size, shard.dim)).astype(np.float32))
        if step % 3 == 2:
            shard.remove(rng.choice(known, 40, replace=False))
    return outs


def _assert_same(fused: EmbeddingShard, ref: EmbeddingShard) -> None:
    assert fused.stats() == ref.stats()
    assert fused._index.capacity == ref._index.capacity
    end = ref._index.slot_end
    assert fused._index.slot_end == end
    a, b = fused._storage, ref._storage
    assert a.capacity_rows == b.capacity_rows
    np.testing.assert_array_equal(a.array[:end], b.array[:end])
    for name in ("owner", "stamp", "freq", "touch_s"):
        live = b.stamp[:end] > 0  # a freed slot's owner is stale
        np.testing.assert_array_equal(getattr(a, name)[:end][live], getattr(b, name)[:end][live])
    sa, sb = fused.state_dict(), ref.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa.keys() - {"delta.lineage"}:  # a random id per chain
        np.testing.assert_array_equal(sa[key], sb[key], err_msg=key)


@pytest.mark.parametrize("dim", [4, 16, 17, 64])
@pytest.mark.parametrize(
    ("init", "opt"),
    [("uniform", "adagrad"), ("normal", "adam"), ("truncated_normal", "ftrl"), ("zeros", "sgd")],
)
def test_fused_row_init_matches_the_three_passes(
    dim: int, init: InitializerName, opt: OptimizerName
) -> None:
    fused = _shard(_spec(dim, init, opt), 3)
    ref = _three_pass(_shard(_spec(dim, init, opt), 3))
    assert fused._fused_init
    for got, want in zip(_workload(fused, dim), _workload(ref, dim), strict=True):
        np.testing.assert_array_equal(got, want)
    _assert_same(fused, ref)


def test_fused_row_init_matches_the_three_passes_on_admission() -> None:
    # Admission and a capacity: new rows come through _admit (evictions, reused slots).
    spec = replace(
        _spec(8, "uniform", "adam"),
        admission=AdmissionSpec(min_count=2),
        eviction=EvictionSpec(capacity_rows=500, policy="lfu", ttl_s=1e6),
    )
    fused, ref = _shard(spec, 5), _three_pass(_shard(spec, 5))
    for got, want in zip(_workload(fused, 1), _workload(ref, 1), strict=True):
        np.testing.assert_array_equal(got, want)
    assert fused.stats().evictions > 0 and fused.stats().admissions > 0
    _assert_same(fused, ref)


class _Ones(Initializer):
    """An initializer that only overrides ``fill`` (no ``distribution``)."""

    def fill(self, storage: Float32Array, rows: Int64Array, ids: Int64Array, seed: int) -> None:
        storage[rows, : self.dim] = 1.0


def test_an_initializer_without_a_distribution_takes_the_three_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shard_module, "make_initializer", _Ones)
    shard = EmbeddingShard(_spec(4, "uniform", "adagrad"), seed=0, name="t")
    assert not shard._fused_init
    rows = shard.lookup(np.array([5, 6, 5], np.int64), train=True)
    np.testing.assert_array_equal(rows, np.ones((3, 4), np.float32))
    assert shard.stats().admissions == 2


def _mix64(x: int) -> int:
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def test_uniform_weights_follow_the_documented_counter_based_formula() -> None:
    # Pins every id's initial row across kernel rewrites: u = splitmix64(splitmix64(
    # id ^ seed) + (j + 1) * golden) >> 11 scaled to [0, 1), w = scale * (2u - 1).
    dim, seed, scale = 5, 0xDEADBEEF12345678, 0.3
    ids = np.array([0, -1, 2**63 - 1, -(2**63), 123456789], np.int64)
    init = make_initializer(InitializerSpec("uniform", scale), dim)
    got = np.zeros((ids.size, dim), np.float32)
    init.fill(got, np.arange(ids.size, dtype=np.int64), ids, seed)
    for n, key in enumerate(ids.tolist()):
        base = _mix64((key & MASK) ^ seed)
        for j in range(dim):
            z = _mix64((base + (j + 1) * 0x9E3779B97F4A7C15) & MASK)
            u = (z >> 11) * math.ldexp(1.0, -53)
            assert got[n, j] == np.float32(scale * (2.0 * u - 1.0))


def test_an_initializer_without_distribution_or_fill_is_refused_when_built() -> None:
    from estuary.config.spec import InitializerSpec
    from estuary.embedding.initializers import Initializer

    class Incomplete(Initializer):
        pass

    with pytest.raises(TypeError, match=r"Incomplete: set `distribution` or override `fill`"):
        Incomplete(InitializerSpec("uniform"), 4)
