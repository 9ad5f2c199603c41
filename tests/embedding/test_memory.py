"""Zeroed arrays for the large tables (estuary.embedding.memory)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from estuary.embedding import memory
from estuary.embedding.memory import HUGE_MIN_BYTES, shrunk, zeros


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((0,), np.int64),
        ((3,), np.int32),
        ((7, 5), np.float32),
        ((HUGE_MIN_BYTES // 64, 16), np.float32),
    ],
)
def test_zeros_is_a_zeroed_aligned_writeable_array(shape: tuple[int, ...], dtype: type) -> None:
    a = zeros(shape, dtype)
    assert a.shape == shape and a.dtype == np.dtype(dtype)
    assert a.flags.c_contiguous and a.flags.writeable
    assert a.size == 0 or a.ctypes.data % 64 == 0
    assert not a.any()
    a[...] = 1
    assert int(a.sum()) == a.size
    b = pickle.loads(pickle.dumps(a))  # a plain array for anyone who copies it
    assert np.array_equal(a, b)


def test_large_arrays_start_on_a_huge_page_where_the_platform_has_them() -> None:
    a = zeros((HUGE_MIN_BYTES // 8,), np.int64)
    if memory._MADV_HUGEPAGE is not None:
        assert a.ctypes.data % (2 << 20) == 0
    small = zeros((HUGE_MIN_BYTES // 8 - 1,), np.int64)  # below the threshold: np.zeros
    assert small.ctypes.data % 64 == 0


def test_without_huge_pages_large_arrays_are_still_zeroed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_MADV_HUGEPAGE", None)
    a = zeros((HUGE_MIN_BYTES // 4,), np.float32)
    assert a.ctypes.data % 64 == 0 and not a.any()


@pytest.mark.parametrize("rows", [HUGE_MIN_BYTES // 64, 100])
def test_shrunk_keeps_the_first_rows_and_gives_the_rest_back(rows: int) -> None:
    a = zeros((rows, 16), np.float32)
    a[...] = np.arange(rows, dtype=np.float32)[:, None]
    keep = rows // 3
    out = shrunk(a, keep)
    assert out.shape == (keep, 16) and out.flags.c_contiguous
    np.testing.assert_array_equal(out[:, 0], np.arange(keep, dtype=np.float32))
    if a.nbytes >= HUGE_MIN_BYTES:
        # Cut in place: a view, and the whole pages past it were released (an
        # anonymous private page reads zeros once given back).
        assert np.shares_memory(out, a)
        past = -(-out.nbytes // 4096) * 4096 // a[0].nbytes + 1
        assert not a[past:].any()
    else:
        assert not np.shares_memory(out, a) and a[keep:].all()
    assert shrunk(out, keep) is out  # nothing to cut
