"""Initialisers: distributions within bounds, and rows that depend only on (seed, id)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from estuary.config.spec import InitializerName, InitializerSpec, TableSpec
from estuary.embedding import EmbeddingShard, make_initializer

DIM = 16
IDS = np.arange(-20_000, 20_000, dtype=np.int64)


def _fill(
    name: InitializerName, scale: float | None, ids: np.ndarray = IDS, seed: int = 11
) -> np.ndarray:
    init = make_initializer(InitializerSpec(name=name, scale=scale), DIM)
    storage = np.full((ids.size, DIM + 3), np.nan, np.float32)
    init.fill(storage, np.arange(ids.size, dtype=np.int64), ids, seed)
    assert np.isnan(storage[:, DIM:]).all()  # only the weight columns are written
    return storage[:, :DIM]


def test_uniform_default_bound_is_one_over_sqrt_dim() -> None:
    rows = _fill("uniform", None)
    bound = 1 / math.sqrt(DIM)
    assert rows.min() >= -bound and rows.max() <= bound
    assert rows.min() < -0.99 * bound and rows.max() > 0.99 * bound
    assert abs(rows.mean()) < 0.01 * bound
    assert rows.std() == pytest.approx(bound / math.sqrt(3), rel=0.01)


def test_normal_has_requested_std() -> None:
    rows = _fill("normal", 0.3)
    assert abs(rows.mean()) < 0.005
    assert rows.std() == pytest.approx(0.3, rel=0.01)
    assert np.abs(rows).max() > 0.6  # tails beyond 2 std exist


def test_truncated_normal_stays_within_two_std() -> None:
    rows = _fill("truncated_normal", 0.3)
    assert np.abs(rows).max() <= 0.6
    # Std of a unit normal truncated at +-2 is 0.8796.
    assert rows.std() == pytest.approx(0.3 * 0.8796, rel=0.01)


def test_zeros() -> None:
    assert not _fill("zeros", None).any()


@pytest.mark.parametrize("name", ["uniform", "normal", "truncated_normal"])
def test_row_depends_only_on_seed_and_id(name: InitializerName) -> None:
    rows = _fill(name, 0.1)
    perm = np.random.default_rng(0).permutation(IDS.size)
    np.testing.assert_array_equal(_fill(name, 0.1, IDS[perm]), rows[perm])
    assert not np.array_equal(_fill(name, 0.1, seed=12), rows)
    assert np.unique(rows, axis=0).shape[0] == IDS.size  # distinct ids, distinct rows


def test_shard_rows_do_not_depend_on_insertion_order_or_readmission() -> None:
    spec = TableSpec(dim=DIM, initializer=InitializerSpec("normal", 0.2))
    ids = np.array([5, -9, 2**62, 0], np.int64)
    a = EmbeddingShard(spec, seed=1, name="t")
    b = EmbeddingShard(spec, seed=1, name="t")
    first = a.lookup(ids, train=True)
    b.lookup(np.array([77, 78], np.int64), train=True)
    np.testing.assert_array_equal(b.lookup(ids[::-1], train=True), first[::-1])
    a.remove(ids[:2])
    np.testing.assert_array_equal(a.lookup(ids, train=True), first)
    other_table = EmbeddingShard(spec, seed=1, name="u").lookup(ids, train=True)
    assert not np.array_equal(other_table, first)  # tables draw independent rows
