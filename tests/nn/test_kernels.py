"""The collection's numba kernels against plain numpy references."""

import numpy as np
import pytest

from estuary.nn.kernels import (
    check_offsets,
    dedup_groups,
    pad_sequences,
    pool_bags,
    scatter_bag_grads,
    scatter_sequence_grads,
    truncate_bags,
)


def dedup(values: list[int], bounds: list[int]) -> tuple[list[list[int]], list[int]]:
    v = np.array(values, np.int64)
    unique, inverse = np.empty_like(v), np.empty_like(v)
    counts = dedup_groups(v, np.array(bounds, np.int64), unique, inverse)
    groups = [unique[bounds[g] : bounds[g] + counts[g]].tolist() for g in range(len(counts))]
    return groups, inverse.tolist()


def test_dedup_keeps_first_occurrence_order_per_group() -> None:
    #  group 0: [5 7 5]   group 1: [] (empty)   group 2: [5 -1 5 5]
    groups, inverse = dedup([5, 7, 5, 5, -1, 5, 5], [0, 3, 3, 7])
    assert groups == [[5, 7], [], [5, -1]]  # equal ids in different groups stay apart
    assert inverse == [0, 1, 0, 0, 1, 0, 0]


def test_dedup_handles_every_int64_and_agrees_with_np_unique() -> None:
    rng = np.random.default_rng(0)
    extremes = np.array([0, -1, np.iinfo(np.int64).min, np.iinfo(np.int64).max], np.int64)
    values = np.concatenate([rng.choice(extremes, 50), rng.integers(-(2**62), 2**62, 3000)])
    values = np.concatenate([values, values[::-1]])  # every id at least twice
    (group,), inverse = dedup(values.tolist(), [0, values.size])
    assert sorted(group) == np.unique(values).tolist()
    np.testing.assert_array_equal(np.array(group)[inverse], values)


def test_pool_and_scatter_match_a_reference_on_mixed_bags() -> None:
    # Two features over one table of 3 unique rows; feature 0 sums, feature 1 means.
    #   row:        b0        b1     b2
    #   feature 0: [0, 1]    [2]    []
    #   feature 1: [1, 1, 2] []     [0]
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((3, 4)).astype(np.float32)
    inverse = np.array([0, 1, 2, 1, 1, 2, 0], np.int64)
    offsets = np.array([[0, 2, 3, 3], [0, 3, 3, 4]], np.int64)
    value_start = np.array([0, 3], np.int64)
    row_base = np.zeros(2, np.int64)
    mean = np.array([False, True])
    single = np.zeros(2, np.bool_)
    assert check_offsets(offsets, np.array([3, 4], np.int64), single) == -1
    assert not single.any()
    out = np.empty((3, 2, 4), np.float32)
    pool_bags(rows, inverse, offsets, value_start, row_base, mean, single, out)
    expected = np.stack(
        [
            [rows[0] + rows[1], (2 * rows[1] + rows[2]) / 3],
            [rows[2], np.zeros(4)],
            [np.zeros(4), rows[0]],
        ]
    )
    np.testing.assert_allclose(out, expected, rtol=1e-6)

    grad = rng.standard_normal((3, 2, 4)).astype(np.float32)
    got = np.zeros_like(rows)
    scatter_bag_grads(grad, inverse, offsets, value_start, row_base, mean, single, got)
    want = np.stack(
        [
            grad[0, 0] + grad[2, 1],
            grad[0, 0] + 2 * grad[0, 1] / 3,
            grad[1, 0] + grad[0, 1] / 3,
        ]
    )
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_check_offsets_flags_features_with_one_id_per_bag() -> None:
    #  f0: [a] [b]    f1: [] [a b]  (2 ids in 2 rows, not one each)    f2: [a b] [c]
    offsets = np.array([[0, 1, 2], [0, 0, 2], [0, 2, 3]], np.int64)
    single = np.zeros(3, np.bool_)
    assert check_offsets(offsets, np.array([2, 2, 3], np.int64), single) == -1
    assert single.tolist() == [True, False, False]


@pytest.mark.parametrize(
    ("offsets", "lengths", "bad"),
    [
        ([[1, 1, 2], [0, 2, 3]], [2, 3], 0),  # does not start at 0
        ([[0, 1, 2], [0, 2, 4]], [2, 3], 1),  # ends past its ids
        ([[0, 2, 1], [0, 2, 3]], [1, 3], 0),  # decreasing
    ],
)
def test_check_offsets_names_the_first_bad_feature(
    offsets: list[list[int]], lengths: list[int], bad: int
) -> None:
    single = np.zeros(len(lengths), np.bool_)
    assert check_offsets(np.array(offsets, np.int64), np.array(lengths, np.int64), single) == bad


def test_truncate_keeps_the_first_ids_of_each_bag() -> None:
    # bags [1 2 3] [] [4] [5 6] with max length 2 -> [1 2] [] [4] [5 6]
    values = np.array([1, 2, 3, 4, 5, 6], np.int64)
    kept = np.empty_like(values)
    offsets = truncate_bags(values, np.array([0, 3, 3, 4, 6], np.int64), 2, kept)
    assert offsets.tolist() == [0, 2, 2, 3, 5]
    assert kept[: offsets[-1]].tolist() == [1, 2, 4, 5, 6]


def test_pad_and_its_gradient_skip_padding() -> None:
    # one feature starting at id 1 of inverse; bags [r2 r0] [] [r1]; rows shifted by base 1
    rows = np.arange(8, dtype=np.float32).reshape(4, 2)  # row r of the table = rows[1 + r]
    inverse = np.array([9, 2, 0, 1], np.int64)  # inverse[0] belongs to another feature
    offsets = np.array([0, 2, 2, 3], np.int64)
    out = np.full((3, 2, 2), np.nan, np.float32)
    mask = np.zeros((3, 2), np.bool_)
    pad_sequences(rows, inverse, offsets, 1, 1, out, mask)
    np.testing.assert_array_equal(out[0], rows[[3, 1]])
    np.testing.assert_array_equal(out[1], np.zeros((2, 2)))
    np.testing.assert_array_equal(out[2], [rows[2], [0, 0]])
    assert mask.tolist() == [[True, True], [False, False], [True, False]]
    grads = np.zeros((4, 2), np.float32)
    scatter_sequence_grads(np.ones((3, 2, 2), np.float32), inverse, offsets, 1, 1, grads)
    np.testing.assert_array_equal(grads, [[0, 0], [1, 1], [1, 1], [1, 1]])
